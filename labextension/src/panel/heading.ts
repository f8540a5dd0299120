/**
 * The line over the panel's suggestions: what was asked, who answered and how fast.
 */
import { TranslationBundle } from '@jupyterlab/translation';

import type { INextCellState } from '../common/service';

/** The line for `state` (null: nothing asked yet); `now` as performance.now(). */
export function suggestionsMeta(
  state: INextCellState | null,
  trans: TranslationBundle,
  now = performance.now()
): string {
  if (!state) {
    return trans.__('No suggestions asked for yet.');
  }
  const result = state.result;
  if (state.state === 'pending') {
    return trans.__('Asking the backend…');
  }
  const backend = result?.backend ?? '…';
  if (state.state === 'failed') {
    if (result?.suggestions.length) {
      // What arrived before it stopped (a timeout, a newer run) is listed: not "none".
      return trans.__('Backend: %1 · incomplete', backend);
    }
    return result?.backend
      ? trans.__('No suggestions from %1.', result.backend)
      : trans.__('No suggestions.');
  }
  return result?.elapsedMs !== null && result?.elapsedMs !== undefined
    ? trans.__('Backend: %1 · %2 ms', backend, Math.round(result.elapsedMs))
    : trans.__('Backend: %1 · %2 ms so far', backend, Math.round(now - state.startedAt));
}
