/**
 * Wiring of the ghost-text feature: registers the provider and invokes it when a new empty code
 * cell becomes active after executions (JupyterLab never fires it on an empty line by itself).
 */
import { ICompletionProviderManager } from '@jupyterlab/completer';
import { INotebookTracker, NotebookActions, NotebookPanel } from '@jupyterlab/notebook';
import { CommandRegistry } from '@lumino/commands';

import { ThemistoService } from '../common/service';
import { NextCellProvider } from './provider';

export const SUGGEST_COMMAND = 'themisto:suggest-next-cell';

/** Whether the notebook has run any code (in this session or as saved). */
function hasExecutions(panel: NotebookPanel): boolean {
  const model = panel.content.model;
  if (!model) {
    return false;
  }
  for (let i = 0; i < model.cells.length; i++) {
    const cell = model.cells.get(i);
    if (cell.type === 'code' && (cell as any).executionCount) {
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

  const invoke = (panel: NotebookPanel) => {
    // The completer extension swaps its editor on the same signal; let it go first.
    requestAnimationFrame(() => {
      if (tracker.currentWidget === panel) {
        manager.inline?.invoke(panel.id);
      }
    });
  };

  tracker.activeCellChanged.connect((_, cell) => {
    provider.cancel();
    const panel = tracker.currentWidget;
    if (!panel || !cell || cell.model.type !== 'code') {
      return;
    }
    const settings = service.settings;
    if (settings.trigger !== 'automatic' || !service.isActiveFor(panel)) {
      return;
    }
    if (cell.model.sharedModel.getSource().trim() !== '' || !hasExecutions(panel)) {
      return;
    }
    invoke(panel);
  });

  // A cell that starts running makes any next-cell prediction in flight stale.
  NotebookActions.executionScheduled.connect(() => provider.cancel());

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
