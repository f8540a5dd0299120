/**
 * The quiet status line's message, and when it goes stale: a message about one notebook goes
 * when another becomes active, one the settings caused goes when they change.
 */
import { TranslationBundle } from '@jupyterlab/translation';

/** One quiet message for the panel. */
export interface IStatus {
  level: 'info' | 'warning' | 'error';
  message: string;
  /** The notebook the message is about ('' for none open): switching to another clears it. */
  notebookPath?: string;
  /** Whether the settings may have caused it (the backend they name…): a change clears it. */
  fromSettings?: boolean;
}

/** What the status line keeps when `path` (null: none) becomes the active notebook. */
export function statusForNotebook(status: IStatus | null, path: string | null): IStatus | null {
  if (status?.notebookPath !== undefined && status.notebookPath !== (path ?? '')) {
    return null;
  }
  return status;
}

/** What the status line keeps when the settings change. */
export function statusForNewSettings(status: IStatus | null): IStatus | null {
  return status?.fromSettings ? null : status;
}

/** The message for a notebook in which Themisto is off (settings or its metadata). */
export function switchedOffStatus(notebookPath: string, trans: TranslationBundle): IStatus {
  return {
    level: 'info',
    message: trans.__(
      'Themisto is switched off for this notebook (settings or notebook metadata).'
    ),
    notebookPath,
    fromSettings: true
  };
}
