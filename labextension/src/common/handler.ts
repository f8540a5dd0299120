/**
 * Transport to the themisto server routes: JSON GETs and streamed (SSE) predictions over fetch.
 */
import { URLExt } from '@jupyterlab/coreutils';
import { ServerConnection } from '@jupyterlab/services';

import {
  IBackendInfo,
  IExecution,
  IPredictRequest,
  IPredictionResult,
  ISuggestion,
  IChunkMetadata,
  ITrajectory,
  PredictEvent
} from './types';

/** An HTTP or stream failure, with the status the server gave (0: the network). */
export class ThemistoError extends Error {
  constructor(
    message: string,
    readonly status: number
  ) {
    super(message);
  }
}

/** GET a JSON document from under /themisto/. */
export async function requestJSON<T>(
  path: string,
  init: RequestInit = {},
  settings: ServerConnection.ISettings = ServerConnection.makeSettings()
): Promise<T> {
  const url = URLExt.join(settings.baseUrl, 'themisto', path);
  let response: Response;
  try {
    response = await ServerConnection.makeRequest(url, init, settings);
  } catch (error) {
    throw new ThemistoError(`server unreachable: ${String(error)}`, 0);
  }
  const text = await response.text();
  if (!response.ok) {
    throw new ThemistoError(errorMessage(response, text), response.status);
  }
  return (text ? JSON.parse(text) : {}) as T;
}

function errorMessage(response: Response, body: string): string {
  try {
    const parsed = JSON.parse(body);
    if (parsed && typeof parsed.message === 'string' && parsed.message) {
      return parsed.message;
    }
  } catch {
    // not JSON: fall through to the status line
  }
  return `${response.status} ${response.statusText}`.trim();
}

/** Trajectories, newest first; only those of a notebook path and/or a kernel, if given. */
export async function listTrajectories(
  query: { notebook_path?: string; kernel_id?: string; limit?: number } = {}
): Promise<ITrajectory[]> {
  const params = new URLSearchParams();
  if (query.notebook_path) {
    params.set('notebook_path', query.notebook_path);
  }
  if (query.kernel_id) {
    params.set('kernel_id', query.kernel_id);
  }
  params.set('limit', String(query.limit ?? 20));
  const reply = await requestJSON<{ trajectories: ITrajectory[] }>(
    `trajectories?${params.toString()}`
  );
  return reply.trajectories ?? [];
}

export async function listExecutions(
  trajectoryId: string,
  offset = 0,
  limit = 500
): Promise<{ executions: IExecution[]; total: number }> {
  return requestJSON(
    `trajectories/${encodeURIComponent(trajectoryId)}/executions?offset=${offset}&limit=${limit}`
  );
}

export async function listBackends(): Promise<{
  default: string;
  backends: IBackendInfo[];
}> {
  return requestJSON('backends');
}

/**
 * Parse a text/event-stream body into events; yields each as soon as its blank line arrives.
 */
export async function* readEvents(body: ReadableStream<Uint8Array>): AsyncGenerator<PredictEvent> {
  const reader = body.getReader();
  const decoder = new TextDecoder();
  let buffer = '';
  let finished = false;
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) {
        finished = true;
        break;
      }
      buffer += decoder.decode(value, { stream: true });
      let boundary: number;
      while ((boundary = buffer.search(/\r?\n\r?\n/)) >= 0) {
        const block = buffer.slice(0, boundary);
        buffer = buffer.slice(boundary).replace(/^\r?\n\r?\n/, '');
        const parsed = parseBlock(block);
        if (parsed) {
          yield parsed;
        }
      }
    }
    const last = parseBlock(buffer);
    if (last) {
      yield last;
    }
  } finally {
    if (!finished) {
      // The reader stopped early (an error event, a malformed one, a failing onUpdate): cancel
      // the body, which closes the connection instead of leaving the server streaming into it.
      await reader.cancel().catch(() => undefined);
    }
    reader.releaseLock();
  }
}

function parseBlock(block: string): PredictEvent | null {
  let event = 'message';
  const data: string[] = [];
  for (const line of block.split(/\r?\n/)) {
    if (line.startsWith(':') || !line) {
      continue;
    }
    const colon = line.indexOf(':');
    const field = colon < 0 ? line : line.slice(0, colon);
    const value = colon < 0 ? '' : line.slice(colon + 1).replace(/^ /, '');
    if (field === 'event') {
      event = value;
    } else if (field === 'data') {
      data.push(value);
    }
  }
  if (!data.length) {
    return null;
  }
  let payload: unknown;
  try {
    payload = JSON.parse(data.join('\n'));
  } catch {
    // 502, as a gateway says of an answer it cannot read.
    const shown = data.join('\n').slice(0, 200);
    throw new ThemistoError(
      `malformed event from the server: ${event} data is not JSON: ${shown}`,
      502
    );
  }
  return { event, data: payload } as PredictEvent;
}

/**
 * Stream one prediction. `onUpdate` sees the result after every event; the promise resolves
 * with the final result, or rejects with ThemistoError (or an AbortError when cancelled).
 */
export async function streamPrediction(
  task: 'next-cell' | 'output',
  body: IPredictRequest,
  signal: AbortSignal,
  onUpdate?: (result: IPredictionResult) => void,
  settings: ServerConnection.ISettings = ServerConnection.makeSettings()
): Promise<IPredictionResult> {
  const url = URLExt.join(settings.baseUrl, 'themisto', 'predict', task);
  let response: Response;
  try {
    response = await ServerConnection.makeRequest(
      url,
      {
        method: 'POST',
        body: JSON.stringify(body),
        headers: { Accept: 'text/event-stream' },
        signal
      },
      settings
    );
  } catch (error) {
    if (signal.aborted) {
      throw error;
    }
    throw new ThemistoError(`server unreachable: ${String(error)}`, 0);
  }
  if (!response.ok || !response.body) {
    const text = await response.text();
    throw new ThemistoError(errorMessage(response, text), response.status);
  }
  const result: IPredictionResult = {
    backend: null,
    elapsedMs: null,
    suggestions: [],
    output: '',
    noPrediction: null,
    note: null
  };
  for await (const item of readEvents(response.body)) {
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
    onUpdate?.(result);
  }
  return result;
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

/** A short human sentence for a failure, for the panel's quiet status line. */
export function describeFailure(error: unknown): string {
  if (error instanceof ThemistoError) {
    switch (error.status) {
      case 0:
        return `Themisto server unreachable (${error.message}).`;
      case 503:
        return `Backend unavailable: ${error.message}`;
      case 504:
        return `Backend timed out: ${error.message}`;
      case 404:
        return `Prediction unavailable: ${error.message}`;
      default:
        return `Prediction failed (${error.status}): ${error.message}`;
    }
  }
  return `Prediction failed: ${String(error)}`;
}
