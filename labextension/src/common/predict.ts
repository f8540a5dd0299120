/**
 * One streamed prediction: POST /themisto/predict/<task>, read its events as they arrive and
 * hand the growing result to the caller.
 */
import { ServerConnection } from '@jupyterlab/services';

import { responseError } from './errors';
import { sendRequest } from './request';
import { addEvent, emptyResult } from './result';
import { readEvents } from './sse';
import { IPredictRequest, IPredictionResult, Task } from './types';

/** The route of a `task` prediction, under /themisto/. */
export function predictRoute(task: Task): string {
  return `predict/${task}`;
}

/**
 * Stream one prediction. `onUpdate` sees the result after every event; the promise resolves
 * with the final result, or rejects with ThemistoError (or an AbortError when cancelled).
 */
export async function streamPrediction(
  task: Task,
  body: IPredictRequest,
  signal: AbortSignal,
  onUpdate?: (result: IPredictionResult) => void,
  settings: ServerConnection.ISettings = ServerConnection.makeSettings()
): Promise<IPredictionResult> {
  const response = await sendRequest(
    predictRoute(task),
    {
      method: 'POST',
      body: JSON.stringify(body),
      headers: { Accept: 'text/event-stream' },
      signal
    },
    settings
  );
  if (!response.body) {
    throw await responseError(response);
  }
  const result = emptyResult();
  for await (const item of readEvents(response.body)) {
    addEvent(result, task, item);
    onUpdate?.(result);
  }
  return result;
}
