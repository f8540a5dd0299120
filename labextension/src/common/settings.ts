/**
 * The plugin's settings (schema/plugin.json) as a typed object, shared by every feature.
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
}

export const DEFAULT_SETTINGS: IThemistoSettings = {
  enabled: true,
  backend: '',
  outputBackend: '',
  trigger: 'automatic',
  debounceMs: 60,
  suggestions: 3,
  predictOutputs: false,
  withRuntime: true,
  timeoutMs: 30000
};

/** Read the composite settings, falling back to defaults for anything missing. */
export function readSettings(settings: ISettingRegistry.ISettings | null): IThemistoSettings {
  if (!settings) {
    return { ...DEFAULT_SETTINGS };
  }
  const composite = settings.composite as Partial<IThemistoSettings>;
  return { ...DEFAULT_SETTINGS, ...composite };
}

/** The per-notebook switch: metadata "themisto": {"record": false} (or "predict": false) opts out. */
export function notebookOptedOut(model: INotebookModel | null | undefined): boolean {
  if (!model) {
    return false;
  }
  const meta = model.getMetadata('themisto') as { record?: boolean; predict?: boolean } | undefined;
  return !!meta && (meta.record === false || meta.predict === false);
}
