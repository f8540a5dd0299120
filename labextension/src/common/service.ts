/**
 * The plugin's shared state: settings, the latest next-cell prediction per notebook, and the
 * quiet status line every feature reports to (the panel shows it; nothing pops up).
 */
import { ICodeCellModel } from '@jupyterlab/cells';
import { INotebookTracker, NotebookActions, NotebookPanel } from '@jupyterlab/notebook';
import { UUID } from '@lumino/coreutils';
import { ITranslator, nullTranslator, TranslationBundle } from '@jupyterlab/translation';
import { ISignal, Signal } from '@lumino/signaling';

import { describeFailure } from './errors';
import { streamPrediction } from './predict';
import { noPredictionText } from './result';
import { DEFAULT_SETTINGS, IThemistoSettings, notebookOptedOut } from './settings';
import { IStatus, statusForNewSettings, statusForNotebook, switchedOffStatus } from './status';
import { IPredictRequest, IPredictionResult, Task } from './types';

/** The next-cell prediction last asked for a notebook, as it streams. */
export interface INextCellState {
  notebookPath: string;
  state: 'pending' | 'streaming' | 'done' | 'failed';
  result: IPredictionResult | null;
  startedAt: number;
  /** Whether a cell of the notebook ran since it was asked: it suggests what followed the
   * cells before that run. */
  stale?: boolean;
}

export class ThemistoService {
  constructor(options: ThemistoService.IOptions = {}) {
    this._trans = (options.translator ?? nullTranslator).load('jupyter_themisto');
  }

  /** Sent with every request so the server cancels our superseded ones. */
  readonly clientId = UUID.uuid4();

  get settings(): IThemistoSettings {
    return this._settings;
  }

  set settings(value: IThemistoSettings) {
    this._settings = value;
    this._settingsChanged.emit(value);
    this._keepStatus(statusForNewSettings(this._status));
  }

  get settingsChanged(): ISignal<this, IThemistoSettings> {
    return this._settingsChanged;
  }

  get statusChanged(): ISignal<this, IStatus | null> {
    return this._statusChanged;
  }

  get nextCellChanged(): ISignal<this, INextCellState> {
    return this._nextCellChanged;
  }

  get status(): IStatus | null {
    return this._status;
  }

  /** Show (or clear with null) the quiet status message. */
  setStatus(status: IStatus | null): void {
    this._status = status;
    this._statusChanged.emit(status);
  }

  /** Report a failed prediction for the notebook at `notebookPath` (the backend the settings
   * name may be the cause: a settings change clears it). */
  reportFailure(error: unknown, notebookPath?: string): void {
    this.setStatus({
      level: 'warning',
      message: describeFailure(error, this._trans),
      notebookPath,
      fromSettings: true
    });
  }

  /** Say that Themisto is off for `panel`'s notebook. */
  reportSwitchedOff(panel: NotebookPanel): void {
    this.setStatus(switchedOffStatus(panel.context.path, this._trans));
  }

  /** `path` (null: none) is the active notebook now: a message about another one goes. */
  activeNotebookChanged(path: string | null): void {
    this._keepStatus(statusForNotebook(this._status, path));
  }

  nextCellState(notebookPath: string): INextCellState | null {
    return this._nextCell.get(notebookPath) ?? null;
  }

  /** Whether predictions are on for this notebook (global switch and its metadata switch). */
  isActiveFor(panel: NotebookPanel | null): boolean {
    return !!panel && this._settings.enabled && !notebookOptedOut(panel.content.model);
  }

  /**
   * Note the execution count of each code cell a notebook of `tracker` runs (the kernel's
   * reply), so that a prediction asked after it names the execution it follows and the server
   * answers once that execution is recorded; a kernel restart starts counting again. Connect it
   * before anything that asks for predictions on the same signal.
   */
  followExecutions(tracker: INotebookTracker): void {
    NotebookActions.executed.connect((_, { notebook, cell }) => {
      const panel = tracker.find(p => p.content === notebook);
      const kernel = panel?.sessionContext.session?.kernel;
      const count =
        cell.model.type === 'code' ? (cell.model as ICodeCellModel).executionCount : null;
      if (panel && kernel && typeof count === 'number' && count > 0) {
        this._lastExecution.set(panel, { kernelId: kernel.id, count });
      }
      // The notebook's suggestions followed the cells before this run.
      const state = panel && this._nextCell.get(panel.context.path);
      if (state && !state.stale) {
        state.stale = true;
        this._nextCellChanged.emit(state);
      }
    });
    const watch = (panel: NotebookPanel) =>
      panel.sessionContext.statusChanged.connect((_, status) => {
        if (status === 'restarting' || status === 'autorestarting' || status === 'dead') {
          this._lastExecution.delete(panel);
        }
      });
    tracker.forEach(watch);
    tracker.widgetAdded.connect((_, panel) => watch(panel));
  }

  /** The request body shared by both tasks: which kernel, which notebook, which backend. */
  baseRequest(panel: NotebookPanel, task: Task): IPredictRequest {
    const request: IPredictRequest = {
      notebook_path: panel.context.path,
      with_runtime: this._settings.withRuntime,
      client_id: this.clientId
    };
    const kernel = panel.sessionContext.session?.kernel;
    if (kernel) {
      request.kernel_id = kernel.id;
      const last = this._lastExecution.get(panel);
      if (last && last.kernelId === kernel.id) {
        request.after_execution_count = last.count;
      }
    }
    const backend = (task === 'output' && this._settings.outputBackend) || this._settings.backend;
    if (backend) {
      request.backend = backend;
    }
    return request;
  }

  /**
   * Predict the next cell of `panel`; the ghost text and the panel both read this one stream.
   * `onUpdate` sees every partial result.
   */
  async predictNextCell(
    panel: NotebookPanel,
    signal: AbortSignal,
    onUpdate?: (result: IPredictionResult) => void
  ): Promise<IPredictionResult> {
    const request = this.baseRequest(panel, 'next-cell');
    request.n = this._settings.suggestions;
    request.cells = [];
    request.cells_below = [];
    // The cells the predicted one follows: those above the active cell, and the active cell
    // itself unless it is the empty one waiting for the prediction; then the cells below the
    // insertion point (a model with fill-in-the-middle reads them). Ids let the server place
    // markdown beside the recorded runs of the code it explains.
    const model = panel.content.model;
    if (model) {
      const active = panel.content.activeCellIndex;
      const last = active < 0 ? model.cells.length - 1 : active;
      let below = false;
      for (let i = 0; i < model.cells.length; i++) {
        const cell = model.cells.get(i);
        const source = cell.sharedModel.getSource();
        if (i === active && !source.trim()) {
          below = true;
          continue;
        }
        const entry = { cell_type: cell.type, source, id: cell.id };
        if (below || i > last) {
          request.cells_below.push(entry);
        } else {
          request.cells.push(entry);
        }
      }
    }
    const path = panel.context.path;
    const state: INextCellState = {
      notebookPath: path,
      state: 'pending',
      result: null,
      startedAt: performance.now()
    };
    this._nextCell.set(path, state);
    this._nextCellChanged.emit(state);
    // A newer request for the notebook (the panel's Suggest beside the ghost text's, which the
    // server answers by superseding the older) owns the panel and the status line: what the
    // older one says after it, even its 409, is not shown.
    const current = () => this._nextCell.get(path) === state;
    const controller = new AbortController();
    const abort = () => controller.abort();
    signal.addEventListener('abort', abort);
    const timer = setTimeout(() => controller.abort(), this._settings.timeoutMs);
    try {
      const result = await streamPrediction('next-cell', request, controller.signal, partial => {
        state.state = 'streaming';
        state.result = partial;
        if (current()) {
          this._nextCellChanged.emit(state);
        }
        onUpdate?.(partial);
      });
      state.state = 'done';
      state.result = result;
      if (!current()) {
        return result;
      }
      this._nextCellChanged.emit(state);
      if (result.noPrediction) {
        this.setStatus({
          level: 'info',
          message: this._trans.__('No suggestion yet: %1', noPredictionText(result, this._trans)),
          notebookPath: path
        });
      } else {
        this.setStatus(null);
      }
      return result;
    } catch (error) {
      state.state = 'failed';
      if (!current()) {
        throw error;
      }
      this._nextCellChanged.emit(state);
      if (controller.signal.aborted && !signal.aborted) {
        const timeoutMs = this._settings.timeoutMs;
        this.setStatus({
          level: 'warning',
          message: state.result?.suggestions.length
            ? this._trans.__(
                'The backend did not finish within %1 ms: the suggestions listed arrived before.',
                timeoutMs
              )
            : this._trans.__('The backend did not answer within %1 ms.', timeoutMs),
          notebookPath: path,
          fromSettings: true
        });
      } else if (!signal.aborted) {
        this.reportFailure(error, path);
      }
      throw error;
    } finally {
      clearTimeout(timer);
      signal.removeEventListener('abort', abort);
    }
  }

  /** Show `status` unless it is already shown. */
  private _keepStatus(status: IStatus | null): void {
    if (status !== this._status) {
      this.setStatus(status);
    }
  }

  private _trans: TranslationBundle;
  private _settings: IThemistoSettings = { ...DEFAULT_SETTINGS };
  private _status: IStatus | null = null;
  private _nextCell = new Map<string, INextCellState>();
  /** The execution count of the code cell each notebook ran last, and in which kernel. */
  private _lastExecution = new WeakMap<NotebookPanel, { kernelId: string; count: number }>();
  private _settingsChanged = new Signal<this, IThemistoSettings>(this);
  private _statusChanged = new Signal<this, IStatus | null>(this);
  private _nextCellChanged = new Signal<this, INextCellState>(this);
}

export namespace ThemistoService {
  export interface IOptions {
    /** Translates the status line's messages (the default: none). */
    translator?: ITranslator;
  }
}
