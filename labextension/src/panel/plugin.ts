/**
 * Wiring of the side panel: adds it to the right sidebar and keeps it in step with the active
 * notebook and its executions.
 */
import { ILabShell, JupyterFrontEnd } from '@jupyterlab/application';
import { ISessionContext } from '@jupyterlab/apputils';
import { INotebookTracker, NotebookActions } from '@jupyterlab/notebook';
import { Kernel } from '@jupyterlab/services';
import { ITranslator } from '@jupyterlab/translation';
import { LabIcon } from '@jupyterlab/ui-components';

import { ThemistoService } from '../common/service';
import { ThemistoPanel } from './widget';

export const TOGGLE_PANEL_COMMAND = 'themisto:toggle-panel';

const ICON_SVG = `<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 24 24">
<g class="jp-icon3" fill="#616161"><circle cx="12" cy="12" r="4"/>
<path d="M12 2a10 10 0 1 0 10 10h-2a8 8 0 1 1-8-8z"/></g></svg>`;

export const themistoIcon = new LabIcon({ name: 'jupyter-themisto:icon', svgstr: ICON_SVG });

export function activatePanel(
  app: JupyterFrontEnd,
  service: ThemistoService,
  tracker: INotebookTracker,
  translator: ITranslator
): ThemistoPanel {
  const trans = translator.load('jupyter_themisto');
  const panel = new ThemistoPanel({
    service,
    getNotebook: () => tracker.currentWidget,
    translator
  });
  panel.title.icon = themistoIcon;
  app.shell.add(panel, 'right', { rank: 900 });

  // The recorder writes the row before the kernel replies; the snapshot follows a bit later.
  let timers: number[] = [];
  const refreshSoon = (): void => {
    timers.forEach(t => window.clearTimeout(t));
    timers = [150, 1500].map(delay => window.setTimeout(() => void panel.refreshTimeline(), delay));
  };
  // A restarted or changed kernel starts a new trajectory (the recorder creates it as the
  // kernel starts): the timeline shows it without waiting for the first cell.
  let restarting = false;
  const onKernelStatus = (_: ISessionContext, status: Kernel.Status): void => {
    if (status === 'restarting' || status === 'autorestarting') {
      restarting = true;
    } else if (status === 'idle' && restarting) {
      restarting = false;
      refreshSoon();
    }
  };
  let watched: ISessionContext | null = null;
  const watch = (context: ISessionContext | null): void => {
    watched?.statusChanged.disconnect(onKernelStatus);
    watched?.kernelChanged.disconnect(refreshSoon);
    watched = context;
    restarting = false;
    watched?.statusChanged.connect(onKernelStatus);
    watched?.kernelChanged.connect(refreshSoon);
  };
  tracker.currentChanged.connect(() => {
    // A message about the notebook left behind goes.
    service.activeNotebookChanged(tracker.currentWidget?.context.path ?? null);
    watch(tracker.currentWidget?.sessionContext ?? null);
    panel.notebookChanged();
  });
  watch(tracker.currentWidget?.sessionContext ?? null);
  NotebookActions.executed.connect((_, { notebook }) => {
    if (notebook === tracker.currentWidget?.content) {
      refreshSoon();
    }
  });

  app.commands.addCommand(TOGGLE_PANEL_COMMAND, {
    label: trans.__('Themisto: Show the Suggestions and Trajectory Panel'),
    describedBy: { args: { type: 'object', properties: {} } },
    execute: () => {
      const shell = app.shell as ILabShell;
      if (panel.isVisible && shell.collapseRight) {
        shell.collapseRight();
      } else {
        app.shell.activateById(panel.id);
      }
    }
  });
  return panel;
}
