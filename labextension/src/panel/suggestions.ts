/**
 * The panel's next-cell section: the top-k suggestions of the current notebook as they stream,
 * which backend answered and how fast, and Insert / Insert & Run for each.
 */
import { NotebookActions, NotebookPanel } from '@jupyterlab/notebook';
import { TranslationBundle } from '@jupyterlab/translation';
import { Widget } from '@lumino/widgets';

import { INextCellState, ThemistoService } from '../common/service';
import { ISuggestion } from '../common/types';
import { button, div, header } from './dom';
import { suggestionsMeta } from './heading';

export class SuggestionsView extends Widget {
  constructor(options: SuggestionsView.IOptions) {
    super();
    this._service = options.service;
    this._getNotebook = options.getNotebook;
    const trans = (this._trans = options.trans);
    const suggest = button('jp-ThemistoPanel-refresh', trans.__('Suggest'), () => {
      void this.suggest();
    });
    suggest.title = trans.__('Ask the backend for next-cell suggestions');
    this._meta = div('jp-ThemistoPanel-meta');
    // After a run the suggestions are for the cells before it: said, not re-asked (the ghost
    // text asks in a new empty cell; two requests would compete for the model).
    this._stale = div(
      'jp-ThemistoPanel-stale',
      `${trans.__('Suggestions for the cells before the last run')} · `
    );
    const again = button('jp-ThemistoPanel-suggestAgain', trans.__('Suggest again'), () => {
      void this.suggest();
    });
    again.title = trans.__('Ask the backend for next-cell suggestions');
    this._stale.appendChild(again);
    this._list = div('jp-ThemistoPanel-suggestions');
    this.node.append(header(trans.__('Next cell'), suggest), this._meta, this._stale, this._list);
    this._service.nextCellChanged.connect(this._onNextCellChanged, this);
    this.render(null);
  }

  /** Ask for next-cell suggestions for the current notebook (cancelling the previous ask). */
  async suggest(): Promise<void> {
    const panel = this._getNotebook();
    const trans = this._trans;
    if (!panel) {
      this._service.setStatus({
        level: 'info',
        message: trans.__('Open a notebook to get suggestions.'),
        notebookPath: ''
      });
      return;
    }
    if (!this._service.isActiveFor(panel)) {
      this._service.reportSwitchedOff(panel);
      return;
    }
    this._controller?.abort();
    const controller = new AbortController();
    this._controller = controller;
    try {
      await this._service.predictNextCell(panel, controller.signal);
    } catch {
      // the service already put the failure on the status line
    }
  }

  /** Show `state` if it is the current notebook's (null: nothing asked yet). */
  render(state: INextCellState | null): void {
    const panel = this._getNotebook();
    if (state && panel && state.notebookPath !== panel.context.path) {
      return;
    }
    this._list.textContent = '';
    this._meta.textContent = suggestionsMeta(state, this._trans);
    const stale = !!state?.stale;
    this._stale.hidden = !stale;
    this.node.classList.toggle('jp-mod-stale', stale);
    for (const suggestion of state?.result?.suggestions ?? []) {
      this._list.appendChild(this._item(suggestion));
    }
  }

  private _onNextCellChanged(_: ThemistoService, state: INextCellState): void {
    this.render(state);
  }

  private _item(suggestion: ISuggestion): HTMLDivElement {
    const trans = this._trans;
    const item = div('jp-ThemistoSuggestion');
    item.dataset.index = String(suggestion.index);
    const code = document.createElement('pre');
    code.className = 'jp-ThemistoSuggestion-code';
    code.textContent = suggestion.text;
    const actions = div('jp-ThemistoSuggestion-actions');
    if (suggestion.score !== null) {
      actions.appendChild(
        div('jp-ThemistoSuggestion-score', trans.__('score %1', suggestion.score.toFixed(2)))
      );
    }
    actions.append(
      button('jp-ThemistoSuggestion-insert', trans.__('Insert'), () => {
        void this._insert(suggestion.text, false);
      }),
      button('jp-mod-accept jp-ThemistoSuggestion-run', trans.__('Insert & Run'), () => {
        void this._insert(suggestion.text, true);
      })
    );
    item.append(code, actions);
    return item;
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

  private _service: ThemistoService;
  private _getNotebook: () => NotebookPanel | null;
  private _trans: TranslationBundle;
  private _meta: HTMLDivElement;
  private _stale: HTMLDivElement;
  private _list: HTMLDivElement;
  private _controller: AbortController | null = null;
}

export namespace SuggestionsView {
  export interface IOptions {
    service: ThemistoService;
    getNotebook: () => NotebookPanel | null;
    trans: TranslationBundle;
  }
}
