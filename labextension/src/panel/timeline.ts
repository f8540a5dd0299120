/**
 * The panel's trajectory section: the current notebook's recorded executions as a chart and a
 * table (the newest TIMELINE_ROWS), reloaded on demand.
 */
import { NotebookPanel } from '@jupyterlab/notebook';
import { TranslationBundle } from '@jupyterlab/translation';
import { Widget } from '@lumino/widgets';

import { describeFailure } from '../common/errors';
import { listExecutions, listTrajectories } from '../common/trajectories';
import { IExecution, ITrajectory } from '../common/types';
import { chartLegend, executionNumber, formatBytes, formatSeconds, renderChart } from './chart';
import { button, div, header } from './dom';

/** How many executions the timeline shows at most (the newest). */
const TIMELINE_ROWS = 500;

/** The timeline's sign for each execution status (the word is the cell's title). */
const STATUS_SIGNS: Record<string, string> = {
  ok: '✓',
  error: '✗',
  interrupted: '■',
  lost: '∅'
};

export class TimelineView extends Widget {
  constructor(options: TimelineView.IOptions) {
    super();
    this._getNotebook = options.getNotebook;
    const trans = (this._trans = options.trans);
    const refresh = button('jp-ThemistoPanel-refresh', trans.__('Refresh'), () => {
      void this.refresh();
    });
    this._info = div('jp-ThemistoPanel-meta');
    this._chart = div('jp-ThemistoPanel-chart');
    this._table = div('jp-ThemistoPanel-timeline');
    this.node.append(header(trans.__('Trajectory'), refresh), this._info, this._chart, this._table);
  }

  /** Reload the recorded trajectory of the current notebook. */
  async refresh(): Promise<void> {
    const panel = this._getNotebook();
    const generation = ++this._generation;
    const trans = this._trans;
    if (!panel) {
      this._info.textContent = trans.__('No notebook open.');
      this._render([]);
      return;
    }
    try {
      const trajectory = await this._findTrajectory(panel);
      if (generation !== this._generation) {
        return;
      }
      if (!trajectory) {
        this._info.textContent = trans.__(
          'Nothing recorded yet for this notebook: run a cell to start its trajectory.'
        );
        this._render([]);
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
      if (generation !== this._generation) {
        return;
      }
      this._info.textContent =
        total > executions.length
          ? trans._n(
              '%1 execution recorded (the last %2 shown)',
              '%1 executions recorded (the last %2 shown)',
              total,
              executions.length
            )
          : trans._n('%1 execution recorded', '%1 executions recorded', total);
      this._render(executions);
    } catch (error) {
      if (generation === this._generation) {
        this._info.textContent = trans.__(
          'Trajectory unavailable: %1',
          describeFailure(error, trans)
        );
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

  private _render(executions: IExecution[]): void {
    this._chart.textContent = '';
    this._table.textContent = '';
    if (!executions.length) {
      return;
    }
    this._chart.appendChild(renderChart(executions, this._trans));
    this._chart.appendChild(div('jp-ThemistoChart-legend', chartLegend(executions, this._trans)));
    this._table.appendChild(this._tableOf(executions));
  }

  /**
   * One row an execution: its In [n] number, first line of source, status (a sign; the word
   * as its title), wall time, memory. In a narrow panel the memory column gives way (the
   * chart's line shows it) so that the source keeps the room.
   */
  private _tableOf(executions: IExecution[]): HTMLTableElement {
    const trans = this._trans;
    const table = document.createElement('table');
    table.className = 'jp-ThemistoTimeline';
    const head = table.createTHead().insertRow();
    const names: [string, string][] = [
      [trans.__('#'), trans.__('The execution count, as in In [n]')],
      [trans.__('cell'), ''],
      ['', trans.__('status')],
      [trans.__('time'), trans.__('wall time')],
      [trans.__('memory'), trans.__('memory after the cell')]
    ];
    for (const [name, title] of names) {
      const th = document.createElement('th');
      th.textContent = name;
      th.title = title;
      head.appendChild(th);
    }
    const body = table.createTBody();
    for (const execution of executions) {
      const row = body.insertRow();
      row.className = `jp-ThemistoTimeline-row jp-mod-${execution.status}`;
      const firstLine = (execution.source ?? '').split('\n').find(l => l.trim()) ?? '';
      const cells = [
        executionNumber(execution),
        firstLine.length > 40 ? firstLine.slice(0, 39) + '…' : firstLine,
        STATUS_SIGNS[execution.status] ?? '?',
        formatSeconds(execution.wall_time),
        formatBytes(execution.memory_after ?? execution.memory_peak)
      ];
      cells.forEach((text, i) => {
        const td = row.insertCell();
        td.textContent = text;
        if (i === 1) {
          td.title = execution.source;
          td.className = 'jp-ThemistoTimeline-source';
        } else if (i === 2) {
          td.title = execution.status;
          td.setAttribute('aria-label', td.title);
          td.className = 'jp-ThemistoTimeline-status';
        }
      });
    }
    return table;
  }

  private _getNotebook: () => NotebookPanel | null;
  private _trans: TranslationBundle;
  private _info: HTMLDivElement;
  private _chart: HTMLDivElement;
  private _table: HTMLDivElement;
  private _generation = 0;
}

export namespace TimelineView {
  export interface IOptions {
    getNotebook: () => NotebookPanel | null;
    trans: TranslationBundle;
  }
}
