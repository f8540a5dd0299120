/**
 * When the status line's message goes stale: a message about one notebook goes when another
 * becomes active, one the settings caused goes when they change; the rest stays.
 */
import { nullTranslator } from '@jupyterlab/translation';

import { IStatus, statusForNewSettings, statusForNotebook, switchedOffStatus } from '../status';

describe('the status line', () => {
  const trans = nullTranslator.load('jupyter_themisto');
  const off = switchedOffStatus('a.ipynb', trans);
  const general: IStatus = { level: 'warning', message: 'settings could not be loaded' };

  it('says a notebook is switched off in the words the panel uses', () => {
    expect(off.message).toBe(
      'Themisto is switched off for this notebook (settings or notebook metadata).'
    );
    expect(off.level).toBe('info');
  });

  it("drops a notebook's message when another notebook becomes active", () => {
    expect(statusForNotebook(off, 'b.ipynb')).toBeNull();
    expect(statusForNotebook(off, null)).toBeNull();
    expect(statusForNotebook(off, 'a.ipynb')).toBe(off);
    expect(statusForNotebook(general, 'b.ipynb')).toBe(general);
    expect(statusForNotebook(null, 'b.ipynb')).toBeNull();
    // "Open a notebook…" is about no notebook: any notebook ends it.
    const none: IStatus = { level: 'info', message: 'open one', notebookPath: '' };
    expect(statusForNotebook(none, 'a.ipynb')).toBeNull();
    expect(statusForNotebook(none, null)).toBe(none);
  });

  it('drops a message the settings caused when they change', () => {
    const unknown: IStatus = {
      level: 'warning',
      message: "Prediction unavailable: unknown backend 'nosuchbackend'",
      notebookPath: 'a.ipynb',
      fromSettings: true
    };
    expect(statusForNewSettings(unknown)).toBeNull();
    expect(statusForNewSettings(off)).toBeNull();
    expect(statusForNewSettings(general)).toBe(general);
    expect(statusForNewSettings(null)).toBeNull();
  });
});
