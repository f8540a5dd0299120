/**
 * Server-sent events: a text/event-stream body read into JSON-decoded events as they arrive.
 */
import { ThemistoError } from './errors';
import { PredictEvent } from './types';

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
