/**
 * The prediction transport against a loopback server that speaks the themisto server's wire
 * format (jupyter_themisto/server/handlers.py) and can produce what a real server rarely does:
 * events cut anywhere, multi-line data, comments, a malformed event, a connection left open.
 */
import { nullTranslator, TranslationBundle } from '@jupyterlab/translation';

import { PredictEvent, IPredictionResult, Task } from '../types';
import { ThemistoError } from '../errors';
import { streamPrediction } from '../predict';
import { noPredictionText, standInNote } from '../result';
import { readEvents } from '../sse';
import {
  connectionTo,
  gate,
  LoopbackServer,
  startThemistoStream,
  themistoError,
  themistoEvent,
  within
} from './loopback';

const TOKEN = 'loopback-token';

/** English, as the strings are written. */
const trans = nullTranslator.load('jupyter_themisto');
/** A "translation" that shows which strings went through the bundle. */
/* eslint-disable jupyter/no-dynamic-translation -- it passes on the callers' literals */
const marked = {
  __: (msgid: string, ...args: unknown[]) => `«${trans.__(msgid, ...args)}»`,
  _n: (msgid: string, plural: string, n: number, ...args: unknown[]) =>
    `«${trans._n(msgid, plural, n, ...args)}»`
} as unknown as TranslationBundle;
/* eslint-enable jupyter/no-dynamic-translation */
const CLOSE_MS = 5000;

/** A body stream that hands over `pieces` one read at a time. */
function bodyOf(pieces: Uint8Array[]): ReadableStream<Uint8Array> {
  let i = 0;
  return new ReadableStream<Uint8Array>({
    pull(controller) {
      if (i < pieces.length) {
        controller.enqueue(pieces[i++]);
      } else {
        controller.close();
      }
    }
  });
}

async function collect(body: ReadableStream<Uint8Array>): Promise<PredictEvent[]> {
  const events: PredictEvent[] = [];
  for await (const event of readEvents(body)) {
    events.push(event);
  }
  return events;
}

function snapshot(result: IPredictionResult): IPredictionResult {
  return JSON.parse(JSON.stringify(result));
}

describe('readEvents', () => {
  // A keep-alive comment, CRLF line ends, data over two lines with a comment among them,
  // characters of two and three bytes, and a last event without its closing blank line.
  const wire =
    ': keep-alive\n\n' +
    'event: meta\r\ndata: {"backend": "loopback", "request_id": "r1"}\r\n\r\n' +
    'event: chunk\ndata: {"index": 0,\n: a comment line\ndata:  "text": "café ✓", "done": false}\n\n' +
    'event: done\ndata: {"backend": "loopback", "elapsed_ms": 1.5}';
  const expected = [
    { event: 'meta', data: { backend: 'loopback', request_id: 'r1' } },
    { event: 'chunk', data: { index: 0, text: 'café ✓', done: false } },
    { event: 'done', data: { backend: 'loopback', elapsed_ms: 1.5 } }
  ];
  const bytes = new TextEncoder().encode(wire);

  it('yields the same events wherever the reads split the bytes', async () => {
    expect(await collect(bodyOf([bytes]))).toEqual(expected);
    for (let cut = 1; cut < bytes.length; cut++) {
      const events = await collect(bodyOf([bytes.slice(0, cut), bytes.slice(cut)]));
      expect({ cut, events }).toEqual({ cut, events: expected });
    }
    const oneByteEach = Array.from(bytes, b => Uint8Array.of(b));
    expect(await collect(bodyOf(oneByteEach))).toEqual(expected);
  });

  it('yields each event as soon as its blank line arrives', async () => {
    const encoder = new TextEncoder();
    let sent = 0;
    const pieces = [
      themistoEvent('meta', { backend: 'loopback', request_id: 'r1' }),
      themistoEvent('chunk', { index: 0, text: 'x = 1\n', done: false })
    ];
    const body = new ReadableStream<Uint8Array>({
      pull(controller) {
        if (sent < pieces.length) {
          controller.enqueue(encoder.encode(pieces[sent++]));
        }
        // then nothing more, and no end: the reader must not wait for it
      }
    });
    const events = readEvents(body);
    expect((await events.next()).value).toEqual({
      event: 'meta',
      data: { backend: 'loopback', request_id: 'r1' }
    });
    expect((await events.next()).value).toEqual({
      event: 'chunk',
      data: { index: 0, text: 'x = 1\n', done: false }
    });
    expect(sent).toBe(2);
    await events.return(undefined);
  });

  it('rejects an event whose data is not JSON, naming the event and the data', async () => {
    const body = bodyOf([
      new TextEncoder().encode(
        themistoEvent('meta', { backend: 'loopback', request_id: 'r1' }) +
          'event: chunk\ndata: {"index": 0, "te\n\n'
      )
    ]);
    const events = readEvents(body);
    expect((await events.next()).value).toMatchObject({ event: 'meta' });
    const failure = events.next();
    await expect(failure).rejects.toBeInstanceOf(ThemistoError);
    await expect(failure).rejects.toThrow(
      'malformed event from the server: chunk data is not JSON: {"index": 0, "te'
    );
  });
});

describe('streamPrediction over HTTP', () => {
  const server = new LoopbackServer();
  let url = '';

  beforeAll(async () => {
    url = await server.start();
  });
  afterAll(() => server.stop());
  afterEach(() => expect(server.errors).toEqual([]));

  function predict(
    task: Task,
    signal: AbortSignal = new AbortController().signal,
    onUpdate?: (result: IPredictionResult) => void
  ): Promise<IPredictionResult> {
    return streamPrediction(
      task,
      { notebook_path: 'analysis.ipynb', n: 2 },
      signal,
      onUpdate,
      connectionTo(url, TOKEN)
    );
  }

  it('sends the request and gathers suggestions, score and timing from the frames', async () => {
    server.handler = (req, res) => {
      startThemistoStream(res);
      res.write(themistoEvent('meta', { backend: 'loopback', request_id: 'r1' }));
      res.write(themistoEvent('chunk', { index: 1, text: 'df.tail()', done: false }));
      res.write(themistoEvent('chunk', { index: 0, text: 'df.head', done: false }));
      res.write(themistoEvent('chunk', { index: 0, text: '()', done: true, score: 0.75 }));
      res.end(themistoEvent('done', { backend: 'loopback', elapsed_ms: 12.5 }));
    };
    const exchange = server.nextExchange();
    const result = await predict('next-cell');
    const request = await exchange;
    expect(request.method).toBe('POST');
    expect(request.url.split('?')[0]).toBe('/themisto/predict/next-cell');
    expect(request.headers.authorization).toBe(`token ${TOKEN}`);
    expect(request.headers.accept).toBe('text/event-stream');
    expect(JSON.parse(request.body)).toEqual({ notebook_path: 'analysis.ipynb', n: 2 });
    expect(result).toEqual({
      backend: 'loopback',
      elapsedMs: 12.5,
      suggestions: [
        { index: 0, text: 'df.head()', done: true, score: 0.75 },
        { index: 1, text: 'df.tail()', done: true, score: null }
      ],
      output: '',
      noPrediction: null,
      noPredictionEvent: null,
      standIn: null
    });
  });

  it('reads events cut into small writes, multi-line data, comments and keep-alives', async () => {
    const wire =
      ': keep-alive\n\n' +
      themistoEvent('meta', { backend: 'loopback', request_id: 'r1' }) +
      ': still working\n\n' +
      'event: chunk\ndata: {"index": 0,\ndata: "text": "print(\\"é\\")", "done": true}\n\n' +
      themistoEvent('done', { backend: 'loopback', elapsed_ms: 3 });
    server.handler = async (req, res) => {
      startThemistoStream(res);
      const bytes = Buffer.from(wire, 'utf-8');
      for (let i = 0; i < bytes.length; i += 7) {
        res.write(bytes.subarray(i, i + 7));
        await new Promise(resolve => setImmediate(resolve));
      }
      res.end();
    };
    const result = await predict('next-cell');
    expect(result.suggestions).toEqual([{ index: 0, text: 'print("é")', done: true, score: null }]);
    expect(result.backend).toBe('loopback');
  });

  it('hands each chunk on before the server has sent the next', async () => {
    const seen = gate();
    server.handler = async (req, res) => {
      startThemistoStream(res);
      res.write(themistoEvent('meta', { backend: 'loopback', request_id: 'r1' }));
      res.write(themistoEvent('chunk', { index: 0, text: 'a = 1\n', done: false }));
      await seen.opened; // the client must show the first line while the second is not sent
      res.write(themistoEvent('chunk', { index: 0, text: 'b = 2', done: true }));
      res.end(themistoEvent('done', { backend: 'loopback', elapsed_ms: 1 }));
    };
    const updates: IPredictionResult[] = [];
    const result = await within(
      predict('next-cell', undefined, update => {
        updates.push(snapshot(update));
        if (update.suggestions[0]?.text === 'a = 1\n') {
          seen.open();
        }
      }),
      10_000,
      'the first chunk reaching onUpdate before the stream goes on'
    );
    expect(updates.map(u => u.suggestions[0]?.text ?? null)).toEqual([
      null,
      'a = 1\n',
      'a = 1\nb = 2',
      'a = 1\nb = 2'
    ]);
    expect(updates[1].suggestions[0].done).toBe(false);
    expect(result.suggestions[0]).toEqual({
      index: 0,
      text: 'a = 1\nb = 2',
      done: true,
      score: null
    });
  });

  it('lets a chunk marked replace take the place of an early answer', async () => {
    server.handler = (req, res) => {
      startThemistoStream(res);
      res.write(themistoEvent('meta', { backend: 'loopback', request_id: 'r1' }));
      res.write(themistoEvent('chunk', { index: 0, text: 'df.sum()', done: false }));
      res.write(themistoEvent('chunk', { index: 0, text: 'df.desc', done: false, replace: true }));
      res.write(themistoEvent('chunk', { index: 0, text: 'ribe()', done: true }));
      res.end(themistoEvent('done', { backend: 'loopback', elapsed_ms: 2 }));
    };
    const updates: (string | null)[] = [];
    const result = await predict('next-cell', undefined, update => {
      updates.push(update.suggestions[0]?.text ?? null);
    });
    expect(updates).toEqual([null, 'df.sum()', 'df.desc', 'df.describe()', 'df.describe()']);
    expect(result.suggestions).toEqual([
      { index: 0, text: 'df.describe()', done: true, score: null }
    ]);
  });

  it('streams an output prediction with the note of a backend that stood in', async () => {
    const metadata = { preview: { stopped: ['write files'], fallback: 'openai' } };
    server.handler = (req, res) => {
      startThemistoStream(res);
      res.write(themistoEvent('meta', { backend: 'preview', request_id: 'r1' }));
      res.write(themistoEvent('chunk', { text: '1\n', metadata }));
      res.write(themistoEvent('chunk', { text: '2\n', metadata }));
      res.end(themistoEvent('done', { backend: 'preview', elapsed_ms: 8 }));
    };
    const result = await predict('output');
    expect(result.output).toBe('1\n2\n');
    expect(standInNote(result, trans)).toBe(
      'preview stopped: the cell would write files; answered by openai'
    );
    expect(server.exchanges[server.exchanges.length - 1].url.split('?')[0]).toBe(
      '/themisto/predict/output'
    );
  });

  it('ends with the reason when the backend has no prediction', async () => {
    server.handler = (req, res) => {
      startThemistoStream(res);
      res.write(themistoEvent('meta', { backend: 'loopback', request_id: 'r1' }));
      res.write(themistoEvent('no_prediction', { reason: 'the model returned no suggestion' }));
      res.end(themistoEvent('done', { backend: 'loopback', elapsed_ms: 2 }));
    };
    const result = await predict('next-cell');
    expect(result.noPrediction).toBe('the model returned no suggestion');
    expect(result.suggestions).toEqual([]);
  });

  it("words a preview's CPU bound in the person's language", async () => {
    // (the server's reason stays English; its code and details are translated here)
    const stopped = (seconds: number) =>
      themistoEvent('no_prediction', {
        reason: `the preview used its ${seconds} CPU seconds and was stopped; … (English)`,
        code: 'preview_cpu_bound',
        details: { seconds }
      });
    for (const seconds of [60, 1]) {
      server.handler = (req, res) => {
        startThemistoStream(res);
        res.write(themistoEvent('meta', { backend: 'preview', request_id: 'r1' }));
        res.write(stopped(seconds));
        res.end(themistoEvent('done', { backend: 'preview', elapsed_ms: 2 }));
      };
      const result = await predict('output');
      const unit = seconds === 1 ? 'second' : 'seconds';
      expect(noPredictionText(result, trans)).toBe(
        `the preview used its ${seconds} CPU ${unit} and was stopped; the real cell may take long`
      );
      expect(noPredictionText(result, marked)).toBe(
        `«the preview used its ${seconds} CPU ${unit} and was stopped; the real cell may take long»`
      );
    }
    // A reason without a code is shown as the server wrote it.
    server.handler = (req, res) => {
      startThemistoStream(res);
      res.write(themistoEvent('no_prediction', { reason: 'kernel busy (busy)' }));
      res.end(themistoEvent('done', { backend: 'preview', elapsed_ms: 2 }));
    };
    expect(noPredictionText(await predict('output'), marked)).toBe('kernel busy (busy)');
  });

  it('notes a backend that stood in for a preview stopped by its CPU bound', async () => {
    const metadata = {
      preview: {
        stopped: ["use more than the preview's 60 CPU seconds"],
        cpu_bound: 60,
        fallback: 'openai'
      }
    };
    server.handler = (req, res) => {
      startThemistoStream(res);
      res.write(themistoEvent('chunk', { text: '1\n', metadata }));
      res.end(themistoEvent('done', { backend: 'preview', elapsed_ms: 8 }));
    };
    const result = await predict('output');
    expect(standInNote(result, trans)).toBe(
      'the preview used its 60 CPU seconds and was stopped; the real cell may take long; answered by openai'
    );
    expect(standInNote(result, marked)).toBe(
      '««the preview used its 60 CPU seconds and was stopped; the real cell may take long»; answered by openai»'
    );
  });

  it('rejects with the status and message of an error event', async () => {
    server.handler = (req, res) => {
      startThemistoStream(res);
      res.write(themistoEvent('meta', { backend: 'loopback', request_id: 'r1' }));
      res.write(themistoEvent('chunk', { index: 0, text: 'x = ', done: false }));
      res.write(themistoEvent('error', { status: 504, message: 'the model took too long' }));
      res.end(themistoEvent('done', { backend: 'loopback', elapsed_ms: 2 }));
    };
    const failure = predict('next-cell');
    await expect(failure).rejects.toBeInstanceOf(ThemistoError);
    await expect(failure).rejects.toMatchObject({
      status: 504,
      message: 'the model took too long'
    });
  });

  it('rejects a malformed event with a clear error', async () => {
    server.handler = (req, res) => {
      startThemistoStream(res);
      res.write(themistoEvent('meta', { backend: 'loopback', request_id: 'r1' }));
      res.end('event: chunk\ndata: {"index": 0, "text": "x\n\n');
    };
    const failure = predict('next-cell');
    await expect(failure).rejects.toBeInstanceOf(ThemistoError);
    await expect(failure).rejects.toThrow(
      /^malformed event from the server: chunk data is not JSON/
    );
  });

  it("turns an HTTP error into a ThemistoError with the server's message", async () => {
    server.handler = (req, res) => themistoError(res, 404, 'no trajectory for analysis.ipynb');
    await expect(predict('output')).rejects.toMatchObject({
      status: 404,
      message: 'no trajectory for analysis.ipynb'
    });
    server.handler = (req, res) => {
      res.writeHead(502, { 'Content-Type': 'text/html' });
      res.end('<html><body>proxy says no</body></html>');
    };
    const failure = predict('next-cell');
    await expect(failure).rejects.toBeInstanceOf(ThemistoError);
    await expect(failure).rejects.toMatchObject({ status: 502, message: '502 Bad Gateway' });
  });

  it('says the server is unreachable (status 0) when nothing listens', async () => {
    const gone = new LoopbackServer();
    const goneUrl = await gone.start();
    await gone.stop();
    const failure = streamPrediction(
      'next-cell',
      {},
      new AbortController().signal,
      undefined,
      connectionTo(goneUrl, TOKEN)
    );
    await expect(failure).rejects.toBeInstanceOf(ThemistoError);
    await expect(failure).rejects.toMatchObject({ status: 0 });
    await expect(failure).rejects.toThrow(/^server unreachable/);
  });

  it('aborting mid-stream stops it and closes the connection', async () => {
    server.handler = (req, res) => {
      startThemistoStream(res);
      res.write(themistoEvent('meta', { backend: 'loopback', request_id: 'r1' }));
      res.write(themistoEvent('chunk', { index: 0, text: 'x = 1\n', done: false }));
      // and never more: only the client can end this exchange
    };
    const controller = new AbortController();
    const exchange = server.nextExchange();
    const updates: string[] = [];
    const failure = predict('next-cell', controller.signal, update => {
      updates.push(update.suggestions[0]?.text ?? '');
      if (update.suggestions.length) {
        controller.abort();
      }
    });
    await expect(failure).rejects.not.toBeInstanceOf(ThemistoError);
    await expect(failure).rejects.toMatchObject({ name: 'AbortError' });
    await within((await exchange).closedEarly, CLOSE_MS, 'the server seeing the connection close');
    expect(updates).toEqual(['', 'x = 1\n']);
  });

  it('aborting before the answer starts closes the connection', async () => {
    server.handler = () => {
      // no answer at all: the request hangs until the client gives up
    };
    const controller = new AbortController();
    const exchange = server.nextExchange();
    const failure = predict('next-cell', controller.signal);
    const arrived = await within(exchange, CLOSE_MS, 'the request arriving');
    controller.abort();
    await expect(failure).rejects.not.toBeInstanceOf(ThemistoError);
    await within(arrived.closedEarly, CLOSE_MS, 'the server seeing the connection close');
  });

  it('closes the connection when it stops reading on an error event', async () => {
    server.handler = (req, res) => {
      startThemistoStream(res);
      res.write(themistoEvent('meta', { backend: 'loopback', request_id: 'r1' }));
      res.write(themistoEvent('error', { status: 502, message: 'the model crashed' }));
      // a server that keeps the stream open after its error
    };
    const exchange = server.nextExchange();
    await expect(predict('next-cell')).rejects.toMatchObject({
      status: 502,
      message: 'the model crashed'
    });
    await within((await exchange).closedEarly, CLOSE_MS, 'the server seeing the connection close');
  });
});
