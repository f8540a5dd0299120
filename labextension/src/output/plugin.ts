/**
 * Wiring of output prediction: on demand (command, Alt+P) or automatically when the setting is on,
 * stream a predicted output under the active cell; replace it with a match badge when it runs.
 */
import { Cell, CodeCell } from '@jupyterlab/cells';
import { INotebookTracker, NotebookActions, NotebookPanel } from '@jupyterlab/notebook';
import { Kernel } from '@jupyterlab/services';
import { ITranslator, TranslationBundle } from '@jupyterlab/translation';
import { CommandRegistry } from '@lumino/commands';
import { PanelLayout, Widget } from '@lumino/widgets';

import { streamPrediction } from '../common/predict';
import { noPredictionText, standInNote } from '../common/result';
import { ThemistoService } from '../common/service';
import { outputsMatch, outputsText, PredictedOutput, PredictionBadge } from './predicted';

export const PREDICT_OUTPUT_COMMAND = 'themisto:predict-output';

/** How long the browser waits for an output prediction at least: a preview may run as long as
 * the cell would (the server bounds it: the preview backend's `timeout`, 50 s, within the
 * server's prediction_timeout, 60 s). The Cancel button stops it sooner. */
const OUTPUT_TIMEOUT_MS = 65000;

/** Kernel states in which a running preview is cancelled (the kernel goes away). */
const KERNEL_GOING = new Set(['restarting', 'autorestarting', 'terminating', 'dead']);

/** What the person asks of the kernel that a running preview would hold up (the kernel answers
 * it once the preview has ended, up to the preview's bound): a completion (Tab) or inspection
 * (Shift+Tab, the contextual help). Asked for, the notebook's previews give way. */
const ASKED_OF_THE_KERNEL = new Set(['complete_request', 'inspect_request']);

interface ICellPrediction {
  widget: PredictedOutput;
  controller: AbortController;
  /** The cell's text the prediction is for: edited away from it, the prediction goes. */
  source: string;
  panel: NotebookPanel;
  /** Stop following the cell's edits. */
  unwatch: () => void;
  /** Why it was stopped before it ended ("cancelled", "the cell runs"…), if it was. */
  stopped?: string;
}

export class OutputPredictions {
  constructor(service: ThemistoService, trans: TranslationBundle) {
    this._service = service;
    this._trans = trans;
    NotebookActions.executionScheduled.connect((_, { cell }) => this._onScheduled(cell));
    NotebookActions.executed.connect((_, { cell }) => this._onExecuted(cell));
  }

  /** Predict the output of `cell` (a code cell of `panel`) and show it dimmed under the input. */
  predict(panel: NotebookPanel, cell: Cell): void {
    if (!(cell instanceof CodeCell) || !this._service.isActiveFor(panel)) {
      return;
    }
    const source = cell.model.sharedModel.getSource();
    if (!source.trim()) {
      return;
    }
    this._clear(cell);
    this._watch(panel);
    const controller = new AbortController();
    const widget = new PredictedOutput(this._trans, () => this._stop(entry, ''));
    // Once the cell says something else, the prediction (running or done) is not for it.
    const onEdit = () => {
      if (cell.model.sharedModel.getSource() !== source && this._predictions.get(cell) === entry) {
        this._clear(cell);
      }
    };
    cell.model.contentChanged.connect(onEdit);
    const unwatch = () => cell.model.contentChanged.disconnect(onEdit);
    const entry: ICellPrediction = { widget, controller, source, panel, unwatch };
    this._predictions.set(cell, entry);
    this._insert(cell, widget);
    const request = { ...this._service.baseRequest(panel, 'output'), source };
    // Aborting the request closes its connection: the server cancels the preview in the kernel.
    const timer = setTimeout(
      () => controller.abort(),
      Math.max(this._service.settings.timeoutMs, OUTPUT_TIMEOUT_MS)
    );
    streamPrediction('output', request, controller.signal, partial => {
      widget.setText(partial.output);
      widget.setState('streaming', partial.backend ?? '');
    })
      .then(result => {
        // The backend answered: what the status line said of failures is past.
        this._service.setStatus(null);
        if (result.noPrediction && !result.output) {
          widget.setState('none', noPredictionText(result, this._trans));
        } else {
          const took = result.elapsedMs !== null ? `${Math.round(result.elapsedMs)} ms` : '';
          widget.setText(result.output);
          const note = standInNote(result, this._trans);
          const detail = [result.backend, took, note].filter(Boolean).join(', ');
          widget.setState('done', detail);
        }
      })
      .catch(error => {
        if (entry.stopped !== undefined) {
          if (!widget.isDisposed) {
            widget.setState('cancelled', entry.stopped);
          }
          return;
        }
        if (this._predictions.get(cell) !== entry) {
          return;
        }
        widget.setState('failed');
        if (controller.signal.aborted) {
          this._service.setStatus({
            level: 'warning',
            message: this._trans.__('Output prediction cancelled or timed out.'),
            notebookPath: panel.context.path
          });
        } else {
          this._service.reportFailure(error, panel.context.path);
        }
      })
      .finally(() => clearTimeout(timer));
  }

  private _onScheduled(cell: Cell): void {
    this._badges.get(cell)?.dispose();
    this._badges.delete(cell);
    const entry = this._predictions.get(cell);
    if (entry && cell.model.sharedModel.getSource() !== entry.source) {
      this._clear(cell); // (for other text: no badge judges it)
    } else if (entry) {
      // Stop streaming, but keep what was predicted until the real output arrives and judge it
      // by the text that runs, whatever is typed meanwhile.
      entry.unwatch();
      this._stop(entry, this._trans.__('the cell runs'));
    }
    // Any run in the same notebook waits behind a running preview in the kernel: stop them all.
    for (const [other, running] of this._predictions) {
      if (other !== cell && other.parent === cell.parent) {
        this._stop(running, this._trans.__('a cell runs'));
      }
    }
  }

  /** Stop `entry`'s request (the server then cancels its preview in the kernel). */
  private _stop(entry: ICellPrediction, why: string): void {
    if (entry.controller.signal.aborted) {
      return;
    }
    const state = entry.widget.node.dataset.state;
    if (state === 'pending' || state === 'streaming') {
      entry.stopped = why;
    }
    entry.controller.abort();
  }

  /** Cancel a notebook's previews when it closes or its kernel restarts or goes away. */
  private _watch(panel: NotebookPanel): void {
    if (this._watched.has(panel)) {
      return;
    }
    this._watched.add(panel);
    const stopAll = (why: string) => {
      for (const entry of this._predictions.values()) {
        if (entry.panel === panel) {
          this._stop(entry, why);
        }
      }
    };
    const onStatus = (_: unknown, status: string) => {
      if (KERNEL_GOING.has(status)) {
        stopAll(this._trans.__('kernel %1', status));
      }
    };
    const onMessage = (_: unknown, { msg, direction }: Kernel.IAnyMessageArgs) => {
      if (direction === 'send' && ASKED_OF_THE_KERNEL.has(msg.header.msg_type)) {
        stopAll(this._trans.__('completion or help asked of the kernel'));
      }
    };
    const onKernel = (
      _: unknown,
      change: {
        oldValue: Kernel.IKernelConnection | null;
        newValue: Kernel.IKernelConnection | null;
      }
    ) => {
      change.oldValue?.anyMessage.disconnect(onMessage);
      change.newValue?.anyMessage.connect(onMessage);
    };
    panel.sessionContext.statusChanged.connect(onStatus);
    panel.sessionContext.session?.kernel?.anyMessage.connect(onMessage);
    panel.sessionContext.kernelChanged.connect(onKernel);
    panel.disposed.connect(() => {
      stopAll(this._trans.__('notebook closed'));
      panel.sessionContext.statusChanged.disconnect(onStatus);
      panel.sessionContext.kernelChanged.disconnect(onKernel);
      panel.sessionContext.session?.kernel?.anyMessage.disconnect(onMessage);
      this._watched.delete(panel);
      for (const [cell, entry] of this._predictions) {
        if (entry.panel === panel) {
          entry.unwatch();
          this._predictions.delete(cell);
        }
      }
    });
  }

  private _onExecuted(cell: Cell): void {
    const entry = this._predictions.get(cell);
    if (!entry || !(cell instanceof CodeCell)) {
      return;
    }
    this._predictions.delete(cell);
    entry.unwatch();
    const predicted = entry.widget.text;
    entry.widget.dispose();
    if (!predicted) {
      return;
    }
    const actual = outputsText(cell.model.outputs.toJSON());
    const badge = new PredictionBadge(outputsMatch(predicted, actual), predicted, this._trans);
    this._badges.set(cell, badge);
    // Under the real output, which now stands where the prediction was.
    (cell.layout as PanelLayout).addWidget(badge);
  }

  private _clear(cell: Cell): void {
    const entry = this._predictions.get(cell);
    if (entry) {
      entry.unwatch();
      entry.controller.abort();
      entry.widget.dispose();
      this._predictions.delete(cell);
    }
    this._badges.get(cell)?.dispose();
    this._badges.delete(cell);
  }

  /** Put `widget` right after the cell's input, above its real output area. */
  private _insert(cell: CodeCell, widget: Widget): void {
    const layout = cell.layout as PanelLayout;
    const index = layout.widgets.findIndex(w => w.hasClass('jp-Cell-outputWrapper'));
    if (index >= 0) {
      layout.insertWidget(index, widget);
    } else {
      layout.addWidget(widget);
    }
  }

  private _service: ThemistoService;
  private _trans: TranslationBundle;
  private _predictions = new Map<Cell, ICellPrediction>();
  private _watched = new Set<NotebookPanel>();
  private _badges = new Map<Cell, Widget>();
}

export function activateOutputPrediction(
  service: ThemistoService,
  tracker: INotebookTracker,
  commands: CommandRegistry,
  translator: ITranslator
): OutputPredictions {
  const trans = translator.load('jupyter_themisto');
  const predictions = new OutputPredictions(service, trans);
  /** Predict the active cell's output; `asked` (the command, not the automatic mode): say so
   * when Themisto is off for the notebook. */
  const predictActive = (asked = false) => {
    const panel = tracker.currentWidget;
    const cell = panel?.content.activeCell;
    if (panel && cell) {
      if (asked && !service.isActiveFor(panel)) {
        service.reportSwitchedOff(panel);
        return;
      }
      predictions.predict(panel, cell);
    }
  };
  commands.addCommand(PREDICT_OUTPUT_COMMAND, {
    label: trans.__('Themisto: Predict the Output of the Active Cell'),
    caption: trans.__('Show a dimmed predicted output under the active cell before it runs'),
    describedBy: { args: { type: 'object', properties: {} } },
    isEnabled: () => !!tracker.currentWidget?.content.activeCell,
    execute: () => predictActive(true)
  });

  // Automatic mode: predict when a code cell with source becomes active, and after edits settle.
  let timer = 0;
  const schedule = () => {
    window.clearTimeout(timer);
    const settings = service.settings;
    if (!settings.predictOutputs) {
      return;
    }
    timer = window.setTimeout(() => predictActive(), Math.max(settings.debounceMs, 400));
  };
  let watched: Cell | null = null;
  tracker.activeCellChanged.connect((_, cell) => {
    watched?.model.contentChanged.disconnect(schedule);
    watched = cell;
    cell?.model.contentChanged.connect(schedule);
    schedule();
  });
  return predictions;
}
