/**
 * @jest-environment jsdom
 *
 * The status line's sentence for each failure: in English, and through a translation bundle
 * built as JupyterLab's TranslationManager builds one from a language pack's domain data (in a
 * DOM, where JupyterLab's Gettext reads the page's language).
 */
import { Gettext, nullTranslator } from '@jupyterlab/translation';

import { describeFailure, ThemistoError } from '../errors';

/** A French bundle of the plugin's domain holding two of its sentences. */
function frenchBundle(): Gettext {
  const trans = new Gettext({ domain: 'jupyter_themisto', locale: 'fr' });
  trans.loadJSON(
    {
      '': {
        language: 'fr',
        domain: 'jupyter_themisto',
        pluralForms: 'nplurals=2; plural=(n > 1);'
      },
      'Backend unavailable: %1': ['Backend indisponible : %1'],
      'Prediction failed (%1): %2': ['Échec de la prédiction (%1) : %2']
    },
    'jupyter_themisto'
  );
  return trans;
}

describe('describeFailure', () => {
  it('names each failure by the status the server gave', () => {
    const trans = nullTranslator.load('jupyter_themisto');
    const said = (status: number, message: string) =>
      describeFailure(new ThemistoError(message, status), trans);
    expect(said(0, 'connection refused')).toBe('Themisto server unreachable (connection refused).');
    expect(said(503, 'no API key')).toBe('Backend unavailable: no API key');
    expect(said(504, 'no answer in 30 s')).toBe('Backend timed out: no answer in 30 s');
    expect(said(404, 'no backend named x')).toBe('Prediction unavailable: no backend named x');
    expect(said(500, 'boom')).toBe('Prediction failed (500): boom');
    expect(describeFailure(new TypeError('bad body'), trans)).toBe(
      'Prediction failed: TypeError: bad body'
    );
  });

  it('speaks the language of the bundle it is given, English where the bundle is silent', () => {
    const trans = frenchBundle();
    expect(describeFailure(new ThemistoError('no API key', 503), trans)).toBe(
      'Backend indisponible : no API key'
    );
    expect(describeFailure(new ThemistoError('boom', 500), trans)).toBe(
      'Échec de la prédiction (500) : boom'
    );
    expect(describeFailure(new ThemistoError('slow', 504), trans)).toBe('Backend timed out: slow');
  });
});
