/**
 * The line over the panel's suggestions agrees with what is listed: suggestions that arrived
 * before a timeout are not called "no suggestions".
 */
import { nullTranslator } from '@jupyterlab/translation';

import type { INextCellState } from '../../common/service';
import { emptyResult } from '../../common/result';
import { suggestionsMeta } from '../heading';

function state(
  kind: INextCellState['state'],
  suggestions: string[],
  backend: string | null = 'llamacpp',
  elapsedMs: number | null = null
): INextCellState {
  const result = emptyResult();
  result.backend = backend;
  result.elapsedMs = elapsedMs;
  result.suggestions = suggestions.map((text, index) => ({ index, text, done: true, score: null }));
  return { notebookPath: 'a.ipynb', state: kind, result, startedAt: 1000 };
}

describe('suggestionsMeta', () => {
  const trans = nullTranslator.load('jupyter_themisto');

  it('does not say "no suggestions" over the suggestions that arrived before a failure', () => {
    const meta = suggestionsMeta(state('failed', ['print(x)']), trans);
    expect(meta).not.toContain('No suggestions');
    expect(meta).toBe('Backend: llamacpp · incomplete');
  });

  it('says "no suggestions" when none arrived', () => {
    expect(suggestionsMeta(state('failed', []), trans)).toBe('No suggestions from llamacpp.');
    expect(suggestionsMeta(state('failed', [], null), trans)).toBe('No suggestions.');
  });

  it('says who answered and how fast, or that it is asking', () => {
    expect(suggestionsMeta(null, trans)).toBe('No suggestions asked for yet.');
    expect(suggestionsMeta(state('pending', []), trans)).toBe('Asking the backend…');
    expect(suggestionsMeta(state('done', ['a'], 'retrieval', 12.4), trans)).toBe(
      'Backend: retrieval · 12 ms'
    );
    expect(suggestionsMeta(state('streaming', ['a']), trans, 1250)).toBe(
      'Backend: llamacpp · 250 ms so far'
    );
  });
});
