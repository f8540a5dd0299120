/**
 * Wiring of the ghost-text feature: registers the provider and invokes it when a new empty code
 * cell becomes active after executions (JupyterLab never fires it on an empty line by itself).
 */
import { ICompletionProviderManager } from '@jupyterlab/completer';
import { INotebookTracker, NotebookActions, NotebookPanel } from '@jupyterlab/notebook';
import { Cell, ICodeCellModel } from '@jupyterlab/cells';
import { CommandRegistry } from '@lumino/commands';

import { listExecutions, listTrajectories, requestJSON } from '../common/handler';
import { ThemistoService } from '../common/service';
import { NextCellProvider } from './provider';

export const SUGGEST_COMMAND = 'themisto:suggest-next-cell';

/** How long to wait for the recorder to write the cell just run before predicting anyway. */
const RECORD_WAIT_MS = 5000;

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
  commands: CommandRegistry
): NextCellProvider {
  const provider = new NextCellProvider({ service });
  manager.registerInlineProvider(provider);

  // Cells sent to the kernel but not yet answered, per notebook. The backend predicts from the
  // recorded trajectory, and Shift+Enter activates the new cell before the cell it ran is
  // recorded: a prediction asked then would answer for the trajectory one step behind.
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
  /** What identifies the row of the cell run last: its execution count, else its source. */
  const lastRun = new WeakMap<object, { count: number | null; source: string }>();

  /**
   * Resolve once the kernel's newest trajectory ends with the cell run last, or at once if the
   * kernel does not record (opted out, no recorder); give up after RECORD_WAIT_MS.
   */
  const recorded = async (panel: NotebookPanel) => {
    const kernelId = panel.sessionContext.session?.kernel?.id;
    const run = lastRun.get(panel.content);
    if (!kernelId || !run) {
      return;
    }
    const started = performance.now();
    try {
      while (performance.now() - started < RECORD_WAIT_MS) {
        // Looked up each time: a restarted kernel keeps its id but starts a new trajectory.
        const list = await listTrajectories({ limit: 20 });
        const trajectory = list.find(t => t.kernel_id === kernelId);
        if (!trajectory) {
          return;
        }
        const n = trajectory.n_executions ?? 0;
        if (n > 0) {
          const { executions } = await listExecutions(trajectory.id, n - 1, 1);
          const row = executions[0];
          if (
            row &&
            (run.count !== null ? row.execution_count === run.count : row.source === run.source)
          ) {
            return;
          }
        }
        await new Promise(resolve => setTimeout(resolve, 25));
      }
    } catch {
      // the server will say what is wrong when the prediction itself is asked for
    }
  };

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

  /** Invoke once the notebook's running cells are answered, the kernel idle and recorded. */
  const invokeWhenRecorded = (panel: NotebookPanel, cell: Cell) => {
    if (pendingOf(panel.content).size > 0) {
      waiting = { panel, cell };
      return;
    }
    waiting = null;
    void recorded(panel).then(() => invokeNow(panel, cell));
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
    invokeWhenRecorded(panel, cell);
  });

  /**
   * Let the backend evaluate the prompt for a cell after `cell` now, while the person reads
   * the output: the suggestion asked for later (a new cell, Alt+\\) then starts at once.
   */
  const warm = async (panel: NotebookPanel, cell: Cell) => {
    const model = panel.content.model;
    if (!model) {
      return;
    }
    const request = service.baseRequest(panel, 'next-cell');
    request.warm = true;
    request.cells = [];
    for (let i = 0; i < model.cells.length; i++) {
      const each = model.cells.get(i);
      request.cells.push({ cell_type: each.type, source: each.sharedModel.getSource() });
      if (each === cell.model) {
        break;
      }
    }
    await requestJSON('predict/next-cell', { method: 'POST', body: JSON.stringify(request) });
  };

  NotebookActions.executionScheduled.connect((_, { notebook, cell }) => {
    // A cell that starts running makes any next-cell prediction in flight stale.
    provider.cancel();
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
    const count = cell.model.type === 'code' ? (cell.model as ICodeCellModel).executionCount : null;
    lastRun.set(notebook, {
      count: typeof count === 'number' ? count : null,
      source: cell.model.sharedModel.getSource()
    });
    if (set.size === 0 && waiting && waiting.panel.content === notebook) {
      invokeWhenRecorded(waiting.panel, waiting.cell);
      return;
    }
    // No suggestion is about to be asked for (the next cell has text, or more cells run):
    // prepare the one that may be asked for later.
    const panel = tracker.find(p => p.content === notebook);
    if (set.size === 0 && panel && cell.model.type === 'code' && service.isActiveFor(panel)) {
      void recorded(panel)
        .then(() => {
          const active = panel.content.activeCell;
          const asking = active && !active.model.sharedModel.getSource().trim();
          if (!asking && pendingOf(notebook).size === 0) {
            return warm(panel, cell);
          }
        })
        .catch(() => undefined); // only a preparation: the suggestion itself reports failures
    }
  });

  commands.addCommand(SUGGEST_COMMAND, {
    label: 'Themisto: Suggest the Next Cell',
    caption: 'Show the predicted next cell as ghost text in the active empty cell',
    isEnabled: () => !!tracker.currentWidget,
    execute: () => {
      const panel = tracker.currentWidget;
      if (panel) {
        manager.inline?.invoke(panel.id);
      }
    }
  });
  return provider;
}
