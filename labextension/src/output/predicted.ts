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

/** The dimmed area showing a streamed output prediction. */
export class PredictedOutput extends Widget {
  constructor(trans: TranslationBundle) {
    super();
    this._trans = trans;
    this.addClass('jp-ThemistoPredictedOutput');
    this._label = document.createElement('div');
    this._label.className = 'jp-ThemistoPredictedOutput-label';
    this._text = document.createElement('pre');
    this._text.className = 'jp-ThemistoPredictedOutput-text';
    this.node.append(this._label, this._text);
    this.setState('pending');
  }

  get text(): string {
    return this._value;
  }

  setText(text: string): void {
    this._value = text;
    this._text.textContent = text;
  }

  setState(state: 'pending' | 'streaming' | 'done' | 'none' | 'failed', detail = ''): void {
    this.node.dataset.state = state;
    const trans = this._trans;
    const what = {
      pending: trans.__('Predicting output…'),
      streaming: trans.__('Predicted output (streaming)'),
      done: trans.__('Predicted output'),
      none: trans.__('No output prediction'),
      failed: trans.__('Output prediction failed')
    }[state];
    this._label.textContent = detail ? `${what} · ${detail}` : what;
  }

  private _trans: TranslationBundle;
  private _label: HTMLDivElement;
  private _text: HTMLPreElement;
  private _value = '';
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
