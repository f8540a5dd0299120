/**
 * The dimmed "predicted output" area under a code cell and the badge that replaces it when the
 * cell really runs, saying whether the prediction matched.
 */
import * as nbformat from '@jupyterlab/nbformat';
import { TranslationBundle } from '@jupyterlab/translation';
import { PartialJSONObject } from '@lumino/coreutils';
import { Widget } from '@lumino/widgets';

/** Plain text of nbformat outputs, the same shape the backends predict. */
export function outputsText(outputs: nbformat.IOutput[]): string {
  const parts: string[] = [];
  for (const output of outputs) {
    if (nbformat.isStream(output)) {
      parts.push(joinText(output.text));
    } else if (nbformat.isExecuteResult(output) || nbformat.isDisplayData(output)) {
      const plain = output.data?.['text/plain'];
      if (plain !== undefined) {
        parts.push(joinText(plain));
        if (!parts[parts.length - 1].endsWith('\n')) {
          parts[parts.length - 1] += '\n';
        }
      }
    } else if (nbformat.isError(output)) {
      parts.push(`${output.ename}: ${output.evalue}\n`);
    }
  }
  return parts.join('');
}

function joinText(text: nbformat.MultilineString | PartialJSONObject): string {
  return Array.isArray(text) ? text.join('') : String(text ?? '');
}

/** Compare ignoring trailing whitespace and blank-line differences. */
export function outputsMatch(predicted: string, actual: string): boolean {
  const norm = (text: string) =>
    text
      .split('\n')
      .map(line => line.replace(/\s+$/, ''))
      .filter(line => line !== '')
      .join('\n');
  return norm(predicted) === norm(actual);
}

/** The dimmed area showing a streamed output prediction. While the prediction runs (a preview
 * may run as long as the cell would) it shows the elapsed time and a Cancel button. */
export class PredictedOutput extends Widget {
  constructor(trans: TranslationBundle, onCancel?: () => void) {
    super();
    this._trans = trans;
    this.addClass('jp-ThemistoPredictedOutput');
    this._label = document.createElement('div');
    this._label.className = 'jp-ThemistoPredictedOutput-label';
    this._what = document.createElement('span');
    this._elapsed = document.createElement('span');
    this._elapsed.className = 'jp-ThemistoPredictedOutput-elapsed';
    this._cancel = document.createElement('button');
    this._cancel.className = 'jp-ThemistoPredictedOutput-cancel jp-mod-styled';
    this._cancel.textContent = trans.__('Cancel');
    this._cancel.title = trans.__('Stop this prediction (a running preview is killed)');
    // The focus goes back where it was (the cell's editor, the notebook in command mode): the
    // button hides once the prediction stops, and the focus would fall to the page.
    let before: Element | null = null;
    this._cancel.onmousedown = () => {
      before = document.activeElement;
    };
    this._cancel.onclick = () => {
      onCancel?.();
      const back =
        before instanceof HTMLElement && before !== document.body && before.isConnected
          ? before
          : this.parent?.node;
      before = null;
      back?.focus({ preventScroll: true });
    };
    this._label.append(this._what, this._elapsed, this._cancel);
    this._text = document.createElement('pre');
    this._text.className = 'jp-ThemistoPredictedOutput-text';
    this.node.append(this._label, this._text);
    this._started = Date.now();
    this._timer = window.setInterval(() => this._tick(), 1000);
    this.setState('pending');
  }

  get text(): string {
    return this._value;
  }

  setText(text: string): void {
    this._value = text;
    this._text.textContent = text;
  }

  setState(
    state: 'pending' | 'streaming' | 'done' | 'none' | 'failed' | 'cancelled',
    detail = ''
  ): void {
    this.node.dataset.state = state;
    const trans = this._trans;
    const what = {
      pending: trans.__('Predicting output…'),
      streaming: trans.__('Predicted output (streaming)'),
      done: trans.__('Predicted output'),
      none: trans.__('No output prediction'),
      failed: trans.__('Output prediction failed'),
      cancelled: trans.__('Output prediction cancelled')
    }[state];
    this._what.textContent = detail ? `${what} · ${detail}` : what;
    const running = state === 'pending' || state === 'streaming';
    this._cancel.hidden = !running;
    if (!running) {
      window.clearInterval(this._timer);
      this._elapsed.textContent = '';
    } else {
      this._tick();
    }
  }

  dispose(): void {
    window.clearInterval(this._timer);
    super.dispose();
  }

  private _tick(): void {
    const seconds = Math.floor((Date.now() - this._started) / 1000);
    // (shown from the first second on: quick predictions never flicker a counter)
    this._elapsed.textContent = seconds >= 1 ? ` · ${this._trans.__('running %1 s', seconds)}` : '';
  }

  private _trans: TranslationBundle;
  private _label: HTMLDivElement;
  private _what: HTMLSpanElement;
  private _elapsed: HTMLSpanElement;
  private _cancel: HTMLButtonElement;
  private _text: HTMLPreElement;
  private _value = '';
  private _started: number;
  private _timer: number;
}

/** The small badge left after the real output arrives. */
export class PredictionBadge extends Widget {
  constructor(matched: boolean, predicted: string, trans: TranslationBundle) {
    super();
    this.addClass('jp-ThemistoPredictionBadge');
    this.addClass(matched ? 'jp-mod-matched' : 'jp-mod-differed');
    this.node.dataset.matched = String(matched);
    this.node.textContent = matched
      ? trans.__('✓ prediction matched')
      : trans.__('✗ prediction differed');
    this.node.title = `${trans.__('Predicted output:')}\n${predicted}`;
  }
}
