/**
 * A prediction's result as its events arrive: suggestions gathered by index (next cell) or the
 * output text (output), which backend answered, how long it took, and why it had nothing.
 */
import { ThemistoError } from './errors';
import { IChunkMetadata, IPredictionResult, ISuggestion, PredictEvent, Task } from './types';

/** The result before any event. */
export function emptyResult(): IPredictionResult {
  return {
    backend: null,
    elapsedMs: null,
    suggestions: [],
    output: '',
    noPrediction: null,
    note: null
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
        result.note = standInNote(item.data.metadata) ?? result.note;
      } else {
        const index = item.data.index ?? 0;
        let suggestion: ISuggestion | undefined = result.suggestions.find(s => s.index === index);
        if (!suggestion) {
          suggestion = { index, text: '', done: false, score: null };
          result.suggestions.push(suggestion);
          result.suggestions.sort((a, b) => a.index - b.index);
        }
        suggestion.text += item.data.text ?? '';
        suggestion.done = !!item.data.done;
        if (item.data.score !== undefined && item.data.score !== null) {
          suggestion.score = item.data.score;
        }
      }
      break;
    case 'no_prediction':
      result.noPrediction = item.data.reason || 'no prediction';
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

/** "preview stopped: the cell would …; answered by X", when a backend stood in for preview. */
function standInNote(metadata: IChunkMetadata | undefined): string | null {
  const preview = metadata?.preview;
  if (!preview?.fallback) {
    return null;
  }
  const why = (preview.stopped ?? []).map(s => `the cell would ${s}`).join('; ');
  return `preview stopped${why ? `: ${why}` : ''}; answered by ${preview.fallback}`;
}
