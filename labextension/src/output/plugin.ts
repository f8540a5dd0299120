/**
 * Wiring of output prediction: on demand (command, Alt+P) or automatically when the setting is on,
 * stream a predicted output under the active cell; replace it with a match badge when it runs.
 */
import { Cell, CodeCell } from '@jupyterlab/cells';
import { INotebookTracker, NotebookActions, NotebookPanel } from '@jupyterlab/notebook';
import { ITranslator, TranslationBundle } from '@jupyterlab/translation';
import { CommandRegistry } from '@lumino/commands';
import { PanelLayout, Widget } from '@lumino/widgets';

import { streamPrediction } from '../common/predict';
import { ThemistoService } from '../common/service';
import { outputsMatch, outputsText, PredictedOutput, PredictionBadge } from './predicted';

export const PREDICT_OUTPUT_COMMAND = 'themisto:predict-output';

interface ICellPrediction {
  widget: PredictedOutput;
  controller: AbortController;
  source: string;
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
    const widget = new PredictedOutput(this._trans);
    const controller = new AbortController();
    const entry: ICellPrediction = { widget, controller, source };
    this._predictions.set(cell, entry);
    this._insert(cell, widget);
    const request = { ...this._service.baseRequest(panel, 'output'), source };
    const timer = setTimeout(() => controller.abort(), this._service.settings.timeoutMs);
    streamPrediction('output', request, controller.signal, partial => {
      widget.setText(partial.output);
      widget.setState('streaming', partial.backend ?? '');
    })
      .then(result => {
        if (result.noPrediction && !result.output) {
          widget.setState('none', result.noPrediction);
        } else {
          const took = result.elapsedMs !== null ? `${Math.round(result.elapsedMs)} ms` : '';
          widget.setText(result.output);
          const detail = [result.backend, took, result.note].filter(Boolean).join(', ');
          widget.setState('done', detail);
        }
      })
      .catch(error => {
        if (this._predictions.get(cell) !== entry) {
          return;
        }
        widget.setState('failed');
        if (controller.signal.aborted) {
          this._service.setStatus({
            level: 'warning',
            message: this._trans.__('Output prediction cancelled or timed out.')
          });
        } else {
          this._service.reportFailure(error);
        }
      })
      .finally(() => clearTimeout(timer));
  }

  private _onScheduled(cell: Cell): void {
    this._badges.get(cell)?.dispose();
    this._badges.delete(cell);
    const entry = this._predictions.get(cell);
    if (entry) {
      // Stop streaming, but keep what was predicted until the real output arrives.
      entry.controller.abort();
    }
  }

  private _onExecuted(cell: Cell): void {
    const entry = this._predictions.get(cell);
    if (!entry || !(cell instanceof CodeCell)) {
      return;
    }
    this._predictions.delete(cell);
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
  const predictActive = () => {
    const panel = tracker.currentWidget;
    const cell = panel?.content.activeCell;
    if (panel && cell) {
      predictions.predict(panel, cell);
    }
  };
  commands.addCommand(PREDICT_OUTPUT_COMMAND, {
    label: trans.__('Themisto: Predict the Output of the Active Cell'),
    caption: trans.__('Show a dimmed predicted output under the active cell before it runs'),
    describedBy: { args: { type: 'object', properties: {} } },
    isEnabled: () => !!tracker.currentWidget?.content.activeCell,
    execute: predictActive
  });

  // Automatic mode: predict when a code cell with source becomes active, and after edits settle.
  let timer = 0;
  const schedule = () => {
    window.clearTimeout(timer);
    const settings = service.settings;
    if (!settings.predictOutputs) {
      return;
    }
    timer = window.setTimeout(predictActive, Math.max(settings.debounceMs, 400));
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
