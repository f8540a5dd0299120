/**
 * jupyter-themisto's JupyterLab plugin: ghost-text next cell, suggestion panel, predicted outputs
 * and the trajectory timeline, configured through the settings registry.
 */
import { JupyterFrontEnd, JupyterFrontEndPlugin } from '@jupyterlab/application';
import { ICommandPalette } from '@jupyterlab/apputils';
import { IEditorExtensionRegistry } from '@jupyterlab/codemirror';
import { ICompletionProviderManager } from '@jupyterlab/completer';
import { INotebookTracker } from '@jupyterlab/notebook';
import { ISettingRegistry } from '@jupyterlab/settingregistry';
import { ITranslator, nullTranslator } from '@jupyterlab/translation';

import { ThemistoService } from './common/service';
import {
  notebookRecords,
  PLUGIN_ID,
  readSettings,
  toggleNotebookRecording
} from './common/settings';
import { activateNextCell, SUGGEST_COMMAND } from './completer/plugin';
import { activateOutputPrediction, PREDICT_OUTPUT_COMMAND } from './output/plugin';
import { activatePanel, TOGGLE_PANEL_COMMAND } from './panel/plugin';

const TOGGLE_NOTEBOOK_COMMAND = 'themisto:toggle-notebook';

const plugin: JupyterFrontEndPlugin<void> = {
  id: PLUGIN_ID,
  description: 'Runtime-aware next-cell and output prediction for notebooks.',
  autoStart: true,
  requires: [ICompletionProviderManager, INotebookTracker],
  optional: [ISettingRegistry, ICommandPalette, ITranslator, IEditorExtensionRegistry],
  activate: async (
    app: JupyterFrontEnd,
    manager: ICompletionProviderManager,
    tracker: INotebookTracker,
    registry: ISettingRegistry | null,
    palette: ICommandPalette | null,
    translator: ITranslator | null,
    extensions: IEditorExtensionRegistry | null
  ) => {
    translator = translator ?? nullTranslator;
    const trans = translator.load('jupyter_themisto');
    const service = new ThemistoService({ translator });
    // First: the features below ask for predictions on the same `executed` signal, naming the
    // execution the service has just noted.
    service.followExecutions(tracker);
    activateNextCell(service, manager, tracker, app.commands, translator, extensions);
    activateOutputPrediction(service, tracker, app.commands, translator);
    activatePanel(app, service, tracker, translator);

    app.commands.addCommand(TOGGLE_NOTEBOOK_COMMAND, {
      label: trans.__('Themisto: Record and Predict in This Notebook'),
      describedBy: { args: { type: 'object', properties: {} } },
      isToggled: () => notebookRecords(tracker.currentWidget?.content.model),
      isEnabled: () => !!tracker.currentWidget,
      execute: () => {
        const model = tracker.currentWidget?.content.model;
        if (model) {
          toggleNotebookRecording(model);
        }
      }
    });

    if (palette) {
      for (const command of [
        SUGGEST_COMMAND,
        PREDICT_OUTPUT_COMMAND,
        TOGGLE_PANEL_COMMAND,
        TOGGLE_NOTEBOOK_COMMAND
      ]) {
        palette.addItem({ command, category: trans.__('Themisto') });
      }
    }

    if (registry) {
      try {
        const settings = await registry.load(PLUGIN_ID);
        service.settings = readSettings(settings);
        settings.changed.connect(() => (service.settings = readSettings(settings)));
      } catch (error) {
        service.setStatus({
          level: 'warning',
          message: trans.__(
            'Themisto settings could not be loaded; using defaults (%1).',
            String(error)
          )
        });
      }
    }
  }
};

export default plugin;
