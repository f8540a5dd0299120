/**
 * The side panel: a quiet status line for failures, the next-cell suggestions of the current
 * notebook (suggestions.ts) and its recorded trajectory (timeline.ts).
 */
import { NotebookPanel } from '@jupyterlab/notebook';
import { ITranslator, nullTranslator } from '@jupyterlab/translation';
import { Panel, Widget } from '@lumino/widgets';

import { ThemistoService } from '../common/service';
import { IStatus } from '../common/status';
import { div } from './dom';
import { SuggestionsView } from './suggestions';
import { TimelineView } from './timeline';

export class ThemistoPanel extends Panel {
  constructor(options: ThemistoPanel.IOptions) {
    super();
    const trans = (options.translator ?? nullTranslator).load('jupyter_themisto');
    this._service = options.service;
    this._getNotebook = options.getNotebook;
    this.id = 'jp-themisto-panel';
    this.addClass('jp-ThemistoPanel');
    this.title.caption = trans.__('Themisto: next-cell suggestions and trajectory');

    this._status = new Widget({ node: div('jp-ThemistoPanel-status') });
    this._suggestions = new SuggestionsView({
      service: options.service,
      getNotebook: options.getNotebook,
      trans
    });
    this._timeline = new TimelineView({ getNotebook: options.getNotebook, trans });
    this.addWidget(this._status);
    this.addWidget(this._suggestions);
    this.addWidget(this._timeline);

    this._service.statusChanged.connect(this._onStatusChanged, this);
    this._onStatusChanged(this._service, this._service.status);
  }

  /** The notebook changed (or ran a cell): show its suggestions and trajectory. */
  notebookChanged(): void {
    const panel = this._getNotebook();
    this._suggestions.render(panel ? this._service.nextCellState(panel.context.path) : null);
    void this.refreshTimeline();
  }

  /** Ask for next-cell suggestions for the current notebook (cancelling the previous ask). */
  suggest(): Promise<void> {
    return this._suggestions.suggest();
  }

  /** Reload the recorded trajectory of the current notebook. */
  refreshTimeline(): Promise<void> {
    return this._timeline.refresh();
  }

  private _onStatusChanged(_: ThemistoService, status: IStatus | null): void {
    const node = this._status.node;
    node.textContent = status?.message ?? '';
    node.dataset.level = status?.level ?? '';
    node.hidden = !status;
  }

  private _service: ThemistoService;
  private _getNotebook: () => NotebookPanel | null;
  private _status: Widget;
  private _suggestions: SuggestionsView;
  private _timeline: TimelineView;
}

export namespace ThemistoPanel {
  export interface IOptions {
    service: ThemistoService;
    getNotebook: () => NotebookPanel | null;
    translator?: ITranslator;
  }
}
