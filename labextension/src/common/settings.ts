/**
 * The plugin's settings (schema/plugin.json) as a typed object, shared by every feature, and
 * each notebook's own switches in its metadata.
 */
import { ISettingRegistry } from '@jupyterlab/settingregistry';
import { INotebookModel } from '@jupyterlab/notebook';

export const PLUGIN_ID = 'jupyter-themisto:plugin';

export interface IThemistoSettings {
  enabled: boolean;
  backend: string;
  outputBackend: string;
  trigger: 'automatic' | 'manual';
  debounceMs: number;
  suggestions: number;
  predictOutputs: boolean;
  withRuntime: boolean;
  timeoutMs: number;
  warmWhileTyping: boolean;
}

export const DEFAULT_SETTINGS: IThemistoSettings = {
  enabled: true,
  backend: '',
  outputBackend: 'preview',
  trigger: 'automatic',
  debounceMs: 60,
  suggestions: 3,
  predictOutputs: false,
  withRuntime: true,
  timeoutMs: 30000,
  warmWhileTyping: true
};

/** Read the composite settings, falling back to defaults for anything missing. */
export function readSettings(settings: ISettingRegistry.ISettings | null): IThemistoSettings {
  if (!settings) {
    return { ...DEFAULT_SETTINGS };
  }
  const composite = settings.composite as Partial<IThemistoSettings>;
  return { ...DEFAULT_SETTINGS, ...composite };
}

/** The notebook's own switches: its metadata "themisto": {"record": …, "predict": …}. */
interface INotebookSwitches {
  record?: boolean;
  predict?: boolean;
}

function notebookSwitches(model: INotebookModel | null | undefined): INotebookSwitches {
  return (model?.getMetadata('themisto') as INotebookSwitches | undefined) ?? {};
}

/** The per-notebook switch: metadata "themisto": {"record": false} (or "predict": false) opts out. */
export function notebookOptedOut(model: INotebookModel | null | undefined): boolean {
  const switches = notebookSwitches(model);
  return switches.record === false || switches.predict === false;
}

/** Whether the notebook records (and so predicts): its "record" switch is not off. */
export function notebookRecords(model: INotebookModel | null | undefined): boolean {
  return notebookSwitches(model).record !== false;
}

/** Turn the notebook's "record" switch over, keeping the rest of its "themisto" metadata. */
export function toggleNotebookRecording(model: INotebookModel): void {
  const switches = { ...notebookSwitches(model) };
  switches.record = switches.record === false;
  model.setMetadata('themisto', switches);
}
