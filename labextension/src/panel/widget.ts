/**
 * The side panel: top-k next-cell suggestions (Insert, Insert & Run), which backend answered and
 * how fast, a quiet status line for failures, and the recorded trajectory as a timeline + chart.
 */
import { NotebookActions, NotebookPanel } from '@jupyterlab/notebook';
import { Widget } from '@lumino/widgets';

import { describeFailure, listExecutions, listTrajectories } from '../common/handler';
import { INextCellState, IStatus, ThemistoService } from '../common/service';
import { IExecution, ITrajectory } from '../common/types';
import { formatBytes, formatSeconds, renderChart } from './chart';

/** How many executions the timeline shows at most (the newest). */
const TIMELINE_ROWS = 500;

function div(className: string, text = ''): HTMLDivElement {
  const node = document.createElement('div');
  node.className = className;
  node.textContent = text;
  return node;
}

export class ThemistoPanel extends Widget {
  constructor(options: ThemistoPanel.IOptions) {
    super();
    this._service = options.service;
    this._getNotebook = options.getNotebook;
    this.id = 'jp-themisto-panel';
    this.addClass('jp-ThemistoPanel');
    this.title.caption = 'Themisto: next-cell suggestions and trajectory';

    const header = div('jp-ThemistoPanel-header', 'Next cell');
    const suggest = document.createElement('button');
    suggest.className = 'jp-ThemistoPanel-refresh jp-mod-styled';
    suggest.textContent = 'Suggest';
    suggest.title = 'Ask the backend for next-cell suggestions';
    suggest.onclick = () => void this.suggest();
    header.appendChild(suggest);
    this._status = div('jp-ThemistoPanel-status');
    this._meta = div('jp-ThemistoPanel-meta');
    this._suggestions = div('jp-ThemistoPanel-suggestions');
    const timelineHeader = div('jp-ThemistoPanel-header', 'Trajectory');
    const refresh = document.createElement('button');
    refresh.className = 'jp-ThemistoPanel-refresh jp-mod-styled';
    refresh.textContent = 'Refresh';
    refresh.onclick = () => void this.refreshTimeline();
    timelineHeader.appendChild(refresh);
    this._trajectoryInfo = div('jp-ThemistoPanel-meta');
    this._chart = div('jp-ThemistoPanel-chart');
    this._timeline = div('jp-ThemistoPanel-timeline');
    this.node.append(
      this._status,
      header,
      this._meta,
      this._suggestions,
      timelineHeader,
      this._trajectoryInfo,
      this._chart,
      this._timeline
    );

    this._service.statusChanged.connect((_, status) => this._renderStatus(status));
    this._service.nextCellChanged.connect((_, state) => this._renderSuggestions(state));
    this._renderStatus(this._service.status);
    this._renderSuggestions(null);
  }

  /** The notebook changed (or ran a cell): show its suggestions and trajectory. */
  notebookChanged(): void {
    const panel = this._getNotebook();
    this._renderSuggestions(panel ? this._service.nextCellState(panel.context.path) : null);
    void this.refreshTimeline();
  }

  /** Ask for next-cell suggestions for the current notebook (cancelling the previous ask). */
  async suggest(): Promise<void> {
    const panel = this._getNotebook();
    if (!panel) {
      this._service.setStatus({ level: 'info', message: 'Open a notebook to get suggestions.' });
      return;
    }
    if (!this._service.isActiveFor(panel)) {
      this._service.setStatus({
        level: 'info',
        message: 'Themisto is switched off for this notebook (settings or notebook metadata).'
      });
      return;
    }
    this._suggestController?.abort();
    const controller = new AbortController();
    this._suggestController = controller;
    try {
      await this._service.predictNextCell(panel, controller.signal);
    } catch {
      // the service already put the failure on the status line
    }
  }

  /** Reload the recorded trajectory of the current notebook. */
  async refreshTimeline(): Promise<void> {
    const panel = this._getNotebook();
    const generation = ++this._timelineGeneration;
    if (!panel) {
      this._trajectoryInfo.textContent = 'No notebook open.';
      this._renderTimeline([]);
      return;
    }
    try {
      const trajectory = await this._findTrajectory(panel);
      if (generation !== this._timelineGeneration) {
        return;
      }
      if (!trajectory) {
        this._trajectoryInfo.textContent =
          'Nothing recorded yet for this notebook: run a cell to start its trajectory.';
        this._renderTimeline([]);
        return;
      }
      // The newest executions: a long session shows its last TIMELINE_ROWS.
      const offset = Math.max(0, (trajectory.n_executions ?? 0) - TIMELINE_ROWS);
      let page = await listExecutions(trajectory.id, offset, TIMELINE_ROWS);
      if (page.total > offset + page.executions.length) {
        // More ran since the trajectory was listed: the newest page again.
        const newest = Math.max(0, page.total - TIMELINE_ROWS);
        page = await listExecutions(trajectory.id, newest, TIMELINE_ROWS);
      }
      const { executions, total } = page;
      if (generation !== this._timelineGeneration) {
        return;
      }
      const shown = total > executions.length ? ` (the last ${executions.length} shown)` : '';
      this._trajectoryInfo.textContent =
        `${total} execution${total === 1 ? '' : 's'} recorded` + shown;
      this._renderTimeline(executions);
    } catch (error) {
      if (generation === this._timelineGeneration) {
        this._trajectoryInfo.textContent = `Trajectory unavailable: ${describeFailure(error)}`;
      }
    }
  }

  /**
   * The trajectory the server predicts from: the live kernel's newest one (the server knows
   * which kernel recorded what), else, with no kernel or one that does not record, the newest
   * one recorded for this notebook's path.
   */
  private async _findTrajectory(panel: NotebookPanel): Promise<ITrajectory | null> {
    const kernelId = panel.sessionContext.session?.kernel?.id;
    if (kernelId) {
      const [live] = await listTrajectories({ kernel_id: kernelId, limit: 1 });
      if (live) {
        return live;
      }
    }
    const [saved] = await listTrajectories({ notebook_path: panel.context.path, limit: 1 });
    return saved ?? null;
  }

  private _renderStatus(status: IStatus | null): void {
    this._status.textContent = status?.message ?? '';
    this._status.dataset.level = status?.level ?? '';
    this._status.hidden = !status;
  }

  private _renderSuggestions(state: INextCellState | null): void {
    const panel = this._getNotebook();
    if (state && panel && state.notebookPath !== panel.context.path) {
      return;
    }
    this._suggestions.textContent = '';
    if (!state) {
      this._meta.textContent = 'No suggestions asked for yet.';
      return;
    }
    const result = state.result;
    const backend = result?.backend ?? '…';
    if (state.state === 'pending') {
      this._meta.textContent = 'Asking the backend…';
    } else if (state.state === 'failed') {
      this._meta.textContent = result?.backend
        ? `No suggestions from ${result.backend}.`
        : 'No suggestions.';
    } else {
      const took =
        result?.elapsedMs !== null && result?.elapsedMs !== undefined
          ? `${Math.round(result.elapsedMs)} ms`
          : `${Math.round(performance.now() - state.startedAt)} ms so far`;
      this._meta.textContent = `Backend: ${backend} · ${took}`;
    }
    for (const suggestion of result?.suggestions ?? []) {
      const item = div('jp-ThemistoSuggestion');
      item.dataset.index = String(suggestion.index);
      const code = document.createElement('pre');
      code.className = 'jp-ThemistoSuggestion-code';
      code.textContent = suggestion.text;
      const actions = div('jp-ThemistoSuggestion-actions');
      if (suggestion.score !== null) {
        actions.appendChild(
          div('jp-ThemistoSuggestion-score', `score ${suggestion.score.toFixed(2)}`)
        );
      }
      const insert = document.createElement('button');
      insert.className = 'jp-mod-styled jp-ThemistoSuggestion-insert';
      insert.textContent = 'Insert';
      insert.onclick = () => void this._insert(suggestion.text, false);
      const run = document.createElement('button');
      run.className = 'jp-mod-styled jp-mod-accept jp-ThemistoSuggestion-run';
      run.textContent = 'Insert & Run';
      run.onclick = () => void this._insert(suggestion.text, true);
      actions.append(insert, run);
      item.append(code, actions);
      this._suggestions.appendChild(item);
    }
  }

  /** Put `text` into the active cell if it is empty, else into a new cell below; maybe run it. */
  private async _insert(text: string, run: boolean): Promise<void> {
    const panel = this._getNotebook();
    if (!panel) {
      return;
    }
    const notebook = panel.content;
    const active = notebook.activeCell;
    if (!active || active.model.type !== 'code' || active.model.sharedModel.getSource().trim()) {
      NotebookActions.insertBelow(notebook);
    }
    const cell = notebook.activeCell;
    if (!cell) {
      return;
    }
    cell.model.sharedModel.setSource(text);
    if (run) {
      await NotebookActions.run(notebook, panel.sessionContext);
    }
  }

  private _renderTimeline(executions: IExecution[]): void {
    this._chart.textContent = '';
    this._timeline.textContent = '';
    if (!executions.length) {
      return;
    }
    this._chart.appendChild(renderChart(executions));
    const table = document.createElement('table');
    table.className = 'jp-ThemistoTimeline';
    const head = table.createTHead().insertRow();
    for (const name of ['#', 'cell', 'status', 'time', 'memory']) {
      const th = document.createElement('th');
      th.textContent = name;
      head.appendChild(th);
    }
    const body = table.createTBody();
    for (const execution of executions) {
      const row = body.insertRow();
      row.className = `jp-ThemistoTimeline-row jp-mod-${execution.status}`;
      const firstLine = (execution.source ?? '').split('\n').find(l => l.trim()) ?? '';
      const cells = [
        String(execution.order_index),
        firstLine.length > 40 ? firstLine.slice(0, 39) + '…' : firstLine,
        execution.status,
        formatSeconds(execution.wall_time),
        formatBytes(execution.memory_after ?? execution.memory_peak)
      ];
      cells.forEach((text, i) => {
        const td = row.insertCell();
        td.textContent = text;
        if (i === 1) {
          td.title = execution.source;
          td.className = 'jp-ThemistoTimeline-source';
        }
      });
    }
    this._timeline.appendChild(table);
  }

  private _service: ThemistoService;
  private _getNotebook: () => NotebookPanel | null;
  private _status: HTMLDivElement;
  private _meta: HTMLDivElement;
  private _suggestions: HTMLDivElement;
  private _trajectoryInfo: HTMLDivElement;
  private _chart: HTMLDivElement;
  private _timeline: HTMLDivElement;
  private _suggestController: AbortController | null = null;
  private _timelineGeneration = 0;
}

export namespace ThemistoPanel {
  export interface IOptions {
    service: ThemistoService;
    getNotebook: () => NotebookPanel | null;
  }
}
