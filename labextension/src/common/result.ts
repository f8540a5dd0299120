/**
 * A prediction's result as its events arrive: suggestions gathered by index (next cell) or the
 * output text (output), which backend answered, how long it took, and why it had nothing.
 */
import { TranslationBundle } from '@jupyterlab/translation';

import { ThemistoError } from './errors';
import { IPredictionResult, ISuggestion, PredictEvent, Task } from './types';

/** The result before any event. */
export function emptyResult(): IPredictionResult {
  return {
    backend: null,
    elapsedMs: null,
    suggestions: [],
    output: '',
    noPrediction: null,
    noPredictionEvent: null,
    standIn: null
  };
}

/** Fold one event of a `task` prediction into `result`; an error event throws ThemistoError. */
export function addEvent(result: IPredictionResult, task: Task, item: PredictEvent): void {
  switch (item.event) {
    case 'meta':
      result.backend = item.data.backend;
      break;
    case 'chunk':
      if (task === 'output') {
        result.output += item.data.text ?? '';
        if (item.data.metadata?.preview?.fallback) {
          result.standIn = item.data.metadata.preview;
        }
      } else {
        const index = item.data.index ?? 0;
        let suggestion: ISuggestion | undefined = result.suggestions.find(s => s.index === index);
        if (!suggestion) {
          suggestion = { index, text: '', done: false, score: null };
          result.suggestions.push(suggestion);
          result.suggestions.sort((a, b) => a.index - b.index);
        }
        // (an early answer, shown while the model was slower, gives way to the model's)
        suggestion.text = (item.data.replace ? '' : suggestion.text) + (item.data.text ?? '');
        suggestion.done = !!item.data.done;
        if (item.data.score !== undefined && item.data.score !== null) {
          suggestion.score = item.data.score;
        }
      }
      break;
    case 'no_prediction':
      result.noPrediction = item.data.reason || 'no prediction';
      result.noPredictionEvent = item.data;
      break;
    case 'error':
      throw new ThemistoError(item.data.message, item.data.status);
    case 'done':
      result.backend = item.data.backend ?? result.backend;
      result.elapsedMs = item.data.elapsed_ms ?? null;
      for (const suggestion of result.suggestions) {
        suggestion.done = true;
      }
      break;
  }
}

/** The preview's CPU bound, worded for the person (not the cell's fault: it may take long). */
function cpuBoundText(seconds: number, trans: TranslationBundle): string {
  return trans._n(
    'the preview used its %1 CPU second and was stopped; the real cell may take long',
    'the preview used its %1 CPU seconds and was stopped; the real cell may take long',
    seconds // (%1: the count)
  );
}

/** Why there is no prediction, in the person's language where the server named the reason
 * (else the server's reason as it is). */
export function noPredictionText(result: IPredictionResult, trans: TranslationBundle): string {
  const event = result.noPredictionEvent;
  const seconds = event?.details?.seconds;
  switch (event?.code) {
    case 'preview_cpu_bound':
      if (typeof seconds === 'number') {
        return cpuBoundText(seconds, trans);
      }
      break;
    case 'waits_for_input':
      return trans.__('this cell waits for input; no preview');
  }
  return result.noPrediction ?? trans.__('no prediction');
}

/** "preview stopped: the cell would …; answered by X", when a backend stood in for preview. */
export function standInNote(result: IPredictionResult, trans: TranslationBundle): string | null {
  const preview = result.standIn;
  if (!preview?.fallback) {
    return null;
  }
  if (typeof preview.cpu_bound === 'number') {
    return trans.__('%1; answered by %2', cpuBoundText(preview.cpu_bound, trans), preview.fallback);
  }
  // (what the cell would do is the kernel's English)
  const why = (preview.stopped ?? []).map(s => trans.__('the cell would %1', s)).join('; ');
  return why
    ? trans.__('preview stopped: %1; answered by %2', why, preview.fallback)
    : trans.__('preview stopped; answered by %1', preview.fallback);
}
