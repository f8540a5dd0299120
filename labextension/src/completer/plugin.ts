/**
 * Wiring of the ghost-text feature: registers the provider and invokes it when a new empty code
 * cell becomes active after executions (JupyterLab never fires it on an empty line by itself).
 */
import { Prec } from '@codemirror/state';
import { EditorView, keymap } from '@codemirror/view';
import { EditorExtensionRegistry, IEditorExtensionRegistry } from '@jupyterlab/codemirror';
import { ICompletionProviderManager } from '@jupyterlab/completer';
import { INotebookTracker, NotebookActions, NotebookPanel } from '@jupyterlab/notebook';
import { Cell, ICodeCellModel } from '@jupyterlab/cells';
import { ITranslator } from '@jupyterlab/translation';
import { CommandRegistry } from '@lumino/commands';

import { predictRoute } from '../common/predict';
import { requestJSON } from '../common/request';
import { ThemistoService } from '../common/service';
import { Part } from './parts';
import { NextCellProvider } from './provider';

export const SUGGEST_COMMAND = 'themisto:suggest-next-cell';
export const ACCEPT_WORD_COMMAND = 'themisto:accept-word';
export const ACCEPT_LINE_COMMAND = 'themisto:accept-line';

/** A pause in the typing this long lets the backend read the cell being written (warmWhileTyping). */
export const TYPING_PAUSE_MS = 1000;

/** Whether the notebook has run any code (in this session or as saved). */
function hasExecutions(panel: NotebookPanel): boolean {
  const model = panel.content.model;
  if (!model) {
    return false;
  }
  for (let i = 0; i < model.cells.length; i++) {
    const cell = model.cells.get(i);
    if (cell.type === 'code' && (cell as ICodeCellModel).executionCount) {
      return true;
    }
  }
  return false;
}

export function activateNextCell(
  service: ThemistoService,
  manager: ICompletionProviderManager,
  tracker: INotebookTracker,
  commands: CommandRegistry,
  translator: ITranslator,
  extensions: IEditorExtensionRegistry | null
): NextCellProvider {
  const trans = translator.load('jupyter_themisto');
  const provider = new NextCellProvider({ service });
  manager.registerInlineProvider(provider);

  // Cells sent to the kernel but not yet answered, per notebook: a suggestion waits for them
  // (it follows the last of them). The request names the execution it follows
  // (ThemistoService.baseRequest), and the server waits for the recorder to write it: Shift+Enter
  // activates the new cell before the cell it ran is recorded.
  const pending = new WeakMap<object, Set<string>>();
  const pendingOf = (notebook: object) => {
    let set = pending.get(notebook);
    if (!set) {
      set = new Set();
      pending.set(notebook, set);
    }
    return set;
  };
  let waiting: { panel: NotebookPanel; cell: Cell } | null = null;

  const invokeNow = (panel: NotebookPanel, cell: Cell) => {
    // The completer extension swaps its editor on activeCellChanged too; let it go first.
    requestAnimationFrame(() => {
      if (
        tracker.currentWidget === panel &&
        panel.content.activeCell === cell &&
        !cell.model.sharedModel.getSource().trim()
      ) {
        manager.inline?.invoke(panel.id);
      }
    });
  };

  /** Invoke once the notebook's running cells are answered. */
  const invokeWhenAnswered = (panel: NotebookPanel, cell: Cell) => {
    if (pendingOf(panel.content).size > 0) {
      waiting = { panel, cell };
      return;
    }
    waiting = null;
    invokeNow(panel, cell);
  };

  tracker.activeCellChanged.connect((_, cell) => {
    provider.cancel();
    waiting = null;
    const panel = tracker.currentWidget;
    if (!panel || !cell || cell.model.type !== 'code') {
      return;
    }
    const settings = service.settings;
    if (settings.trigger !== 'automatic' || !service.isActiveFor(panel)) {
      return;
    }
    if (cell.model.sharedModel.getSource().trim() !== '') {
      return;
    }
    if (!hasExecutions(panel) && pendingOf(panel.content).size === 0) {
      return;
    }
    invokeWhenAnswered(panel, cell);
  });

  // Notebooks sent a warm-up with `ahead`: their active cell and its source then.
  const writingAhead = new WeakMap<object, { cell: Cell | null; source: string }>();
  /**
   * Let the backend evaluate the prompt for a cell after `cell` now, while the person reads
   * the output: the suggestion asked for later (a new cell, Alt+\\) then starts at once.
   * With `ahead`, a local model also writes that suggestion meanwhile, for the early answer:
   * not as a cell starts running (that warm-up stops it: the run needs the cores).
   */
  const warm = async (panel: NotebookPanel, cell: Cell, ahead = false) => {
    const model = panel.content.model;
    if (!model) {
      return;
    }
    if (ahead) {
      const active = panel.content.activeCell;
      const source = active?.model.sharedModel.getSource() ?? '';
      writingAhead.set(panel.content, { cell: active, source });
    } else {
      writingAhead.delete(panel.content); // (a warm-up without it stops the writing)
    }
    const request = service.baseRequest(panel, 'next-cell');
    request.warm = true;
    request.ahead = ahead;
    request.cells = [];
    for (let i = 0; i < model.cells.length; i++) {
      const each = model.cells.get(i);
      request.cells.push({ cell_type: each.type, source: each.sharedModel.getSource() });
      if (each === cell.model) {
        break;
      }
    }
    await requestJSON(predictRoute('next-cell'), { method: 'POST', body: JSON.stringify(request) });
  };

  // While a code cell is being written, the backend can read the prompt up to it: warmed at
  // each pause in the typing, the cell is mostly in a local model's cache when it runs, and the
  // warm-up as it starts (below) evaluates only what was typed since.
  let typing: { cell: Cell; timer: number } | null = null;
  const warmedSource = new WeakMap<Cell, string>();
  const warmTyped = (cell: Cell) => {
    const panel = tracker.currentWidget;
    const source = cell.model.sharedModel.getSource();
    if (
      !panel ||
      panel.content.activeCell !== cell ||
      !service.settings.warmWhileTyping ||
      !service.isActiveFor(panel) ||
      !source.trim() ||
      warmedSource.get(cell) === source ||
      // (no executions: nothing to go on from; cells still running: the prompt is not theirs)
      !hasExecutions(panel) ||
      pendingOf(panel.content).size > 0
    ) {
      return;
    }
    warmedSource.set(cell, source);
    void warm(panel, cell, true).catch(() => undefined); // the suggestion reports failures
  };
  /**
   * The typing goes on after a warm-up with `ahead`: the suggestion being written is for the
   * cell as it was, which will not run; stop it, it would only take the cores from the typing.
   */
  const stopWritingAhead = (cell: Cell) => {
    const panel = tracker.currentWidget;
    const since = panel && writingAhead.get(panel.content);
    if (
      !panel ||
      !since ||
      // (not a change of its source: its outputs, its execution count)
      (since.cell === cell && since.source === cell.model.sharedModel.getSource())
    ) {
      return;
    }
    writingAhead.delete(panel.content);
    const request = service.baseRequest(panel, 'next-cell');
    request.stop_ahead = true;
    void requestJSON(predictRoute('next-cell'), {
      method: 'POST',
      body: JSON.stringify(request)
    }).catch(() => undefined); // (nothing is lost if it fails: the next warm-up stops it too)
  };
  const onTyped = () => {
    if (typing) {
      const cell = typing.cell;
      stopWritingAhead(cell);
      window.clearTimeout(typing.timer);
      typing.timer = window.setTimeout(() => warmTyped(cell), TYPING_PAUSE_MS);
    }
  };
  const stopTyping = () => {
    if (typing) {
      window.clearTimeout(typing.timer);
      typing.cell.model.contentChanged.disconnect(onTyped);
      typing = null;
    }
  };
  tracker.activeCellChanged.connect((_, cell) => {
    stopTyping();
    if (cell && cell.model.type === 'code') {
      typing = { cell, timer: 0 };
      cell.model.contentChanged.connect(onTyped);
    }
  });

  NotebookActions.executionScheduled.connect((_, { notebook, cell }) => {
    // A cell that starts running makes any next-cell prediction in flight stale.
    provider.cancel();
    if (typing?.cell === cell) {
      window.clearTimeout(typing.timer); // (the warm-up below covers what was typed)
    }
    pendingOf(notebook).add(cell.model.id);
    // While it runs, the model can already read the prompt up to it: the suggestion asked for
    // when it is recorded then evaluates only what the run added.
    const panel = tracker.find(p => p.content === notebook);
    if (panel && cell.model.type === 'code' && service.isActiveFor(panel)) {
      void warm(panel, cell).catch(() => undefined);
    }
  });
  NotebookActions.executed.connect((_, { notebook, cell }) => {
    const set = pendingOf(notebook);
    set.delete(cell.model.id);
    if (set.size === 0 && waiting && waiting.panel.content === notebook) {
      provider.answerNow(waiting.cell.model.id); // (no debounce: the run is over)
      invokeWhenAnswered(waiting.panel, waiting.cell);
      return;
    }
    // No suggestion is about to be asked for (the next cell has text, or more cells run):
    // prepare the one that may be asked for later (the server waits for this run's record).
    const panel = tracker.find(p => p.content === notebook);
    if (set.size > 0 || !panel || cell.model.type !== 'code' || !service.isActiveFor(panel)) {
      return;
    }
    const active = panel.content.activeCell;
    if (active && !active.model.sharedModel.getSource().trim()) {
      return; // an empty cell: its suggestion does the work
    }
    void warm(panel, cell, true).catch(() => undefined); // the suggestion reports failures
  });

  commands.addCommand(SUGGEST_COMMAND, {
    label: trans.__('Themisto: Suggest the Next Cell'),
    caption: trans.__('Show the predicted next cell as ghost text in the active empty cell'),
    describedBy: { args: { type: 'object', properties: {} } },
    isEnabled: () => !!tracker.currentWidget,
    execute: () => {
      const panel = tracker.currentWidget;
      if (panel) {
        manager.inline?.invoke(panel.id);
      }
    }
  });

  /** The active cell and the `part` of its ghost text that follows what the cell holds. */
  const partOf = (part: Part) => {
    const cell = tracker.currentWidget?.content.activeCell;
    if (!cell?.editor) {
      return null;
    }
    const source = cell.model.sharedModel.getSource();
    const text = provider.nextPart(cell.model.id, source, part);
    return text ? { editor: cell.editor, end: source.length, text } : null;
  };
  const acceptPart = (part: Part) => {
    const panel = tracker.currentWidget;
    const found = partOf(part);
    const end = found?.editor.getPositionAt(found.end);
    if (panel && found && end && found.editor.replaceSelection) {
      // Typed in at the end, as if by hand; then asked again, since the completer drops its
      // ghost text when the cursor goes to another line: the provider answers with the rest.
      found.editor.setCursorPosition(end);
      found.editor.replaceSelection(found.text);
      manager.inline?.invoke(panel.id);
    }
  };
  const parts: [string, Part, string, string][] = [
    [
      ACCEPT_WORD_COMMAND,
      'word',
      trans.__('Themisto: Accept the Next Word of the Suggestion'),
      trans.__('Insert the ghost text up to its next word; the rest stays')
    ],
    [
      ACCEPT_LINE_COMMAND,
      'line',
      trans.__('Themisto: Accept the Next Line of the Suggestion'),
      trans.__('Insert the ghost text up to the end of its line; the rest stays')
    ]
  ];
  for (const [command, part, label, caption] of parts) {
    commands.addCommand(command, {
      label,
      caption,
      describedBy: { args: { type: 'object', properties: {} } },
      isEnabled: () => partOf(part) !== null,
      execute: () => acceptPart(part)
    });
  }
  // Their keys go to the editor first: CodeMirror's own bindings (Alt+→ moves by syntax) take
  // them before JupyterLab's shortcuts could. Elsewhere, or with no ghost text, they do what
  // they always did.
  const accept = (view: EditorView, command: string) => {
    if (!view.dom.closest('.jp-mod-inline-completer-active') || !commands.isEnabled(command)) {
      return false;
    }
    void commands.execute(command);
    return true;
  };
  extensions?.addExtension({
    name: 'jupyter-themisto:accept-parts',
    factory: () =>
      EditorExtensionRegistry.createImmutableExtension(
        Prec.highest(
          keymap.of([
            { key: 'Alt-ArrowRight', run: view => accept(view, ACCEPT_WORD_COMMAND) },
            { key: 'Mod-ArrowDown', run: view => accept(view, ACCEPT_LINE_COMMAND) }
          ])
        )
      )
  });
  return provider;
}
