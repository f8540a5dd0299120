/**
 * Loopback HTTP servers for the transport's tests: a scriptable Node `http` server that notes when
 * a client closes a connection before its answer was complete, and the wire formats it speaks
 * (the themisto server's event stream, an OpenAI-compatible model server's).
 */
import * as http from 'node:http';
import { AddressInfo } from 'node:net';

import { ServerConnection } from '@jupyterlab/services';

export type Handler = (
  req: http.IncomingMessage,
  res: http.ServerResponse,
  body: string
) => void | Promise<void>;

/** One request as the server received it, and how its answer ended. */
export interface IExchange {
  method: string;
  url: string;
  headers: http.IncomingHttpHeaders;
  body: string;
  /** Resolves when the connection closed before the answer was complete (the client left). */
  closedEarly: Promise<void>;
  /** Resolves when the answer was sent in full. */
  finished: Promise<void>;
}

export class LoopbackServer {
  /** What the next requests get; each test sets its own. */
  handler: Handler = (req, res) => {
    res.writeHead(404, { 'Content-Type': 'application/json' });
    res.end(JSON.stringify({ message: 'no handler' }));
  };
  readonly exchanges: IExchange[] = [];
  /** Handlers that failed (a test checks there are none). */
  readonly errors: unknown[] = [];

  async start(port = 0): Promise<string> {
    await new Promise<void>((resolve, reject) => {
      this._server.once('error', reject);
      this._server.listen(port, '127.0.0.1', () => resolve());
    });
    return `http://127.0.0.1:${(this._server.address() as AddressInfo).port}`;
  }

  async stop(): Promise<void> {
    this._server.closeAllConnections();
    await new Promise<void>(resolve => this._server.close(() => resolve()));
  }

  /** The next request, once it has arrived. */
  nextExchange(): Promise<IExchange> {
    const seen = this.exchanges.length;
    return new Promise(resolve => this._waiters.push({ index: seen, resolve }));
  }

  private _dispatch(req: http.IncomingMessage, res: http.ServerResponse): void {
    const chunks: Buffer[] = [];
    req.on('data', chunk => chunks.push(chunk));
    req.on('end', () => {
      const body = Buffer.concat(chunks).toString('utf-8');
      const exchange: IExchange = {
        method: req.method ?? '',
        url: req.url ?? '',
        headers: req.headers,
        body,
        closedEarly: new Promise(resolve =>
          res.on('close', () => {
            if (!res.writableFinished) {
              resolve();
            }
          })
        ),
        finished: new Promise(resolve => res.on('finish', () => resolve()))
      };
      this.exchanges.push(exchange);
      for (const waiter of this._waiters.filter(w => w.index < this.exchanges.length)) {
        waiter.resolve(this.exchanges[waiter.index]);
      }
      this._waiters = this._waiters.filter(w => w.index >= this.exchanges.length);
      Promise.resolve(this.handler(req, res, body)).catch(error => {
        // A write after the client left is expected in cancellation tests; anything else is
        // the test's own bug and must show (see `errors`).
        if (!res.destroyed) {
          this.errors.push(error);
          res.destroy();
        }
      });
    });
  }

  private _server = http.createServer((req, res) => this._dispatch(req, res));
  private _waiters: { index: number; resolve: (exchange: IExchange) => void }[] = [];
}

/** A promise a test opens by hand: lets a server wait until the client has seen something. */
export function gate(): { opened: Promise<void>; open: () => void } {
  let open = () => {};
  const opened = new Promise<void>(resolve => {
    open = resolve;
  });
  return { opened, open };
}

/** JSON as Python's `json.dumps` writes it (the themisto server's encoder): `", "` and `": "`
 * between items, non-ASCII as `\uXXXX`. */
export function pyJSON(value: unknown): string {
  if (Array.isArray(value)) {
    return `[${value.map(pyJSON).join(', ')}]`;
  }
  if (value !== null && typeof value === 'object') {
    const items = Object.entries(value).map(([k, v]) => `${pyJSON(k)}: ${pyJSON(v)}`);
    return `{${items.join(', ')}}`;
  }
  return JSON.stringify(value).replace(
    /[\u007f-\uffff]/g,
    c => `\\u${c.charCodeAt(0).toString(16).padStart(4, '0')}`
  );
}

/** One server-sent event exactly as jupyter_themisto/server/handlers.py writes it. */
export function themistoEvent(name: string, data: unknown): string {
  return `event: ${name}\ndata: ${pyJSON(data)}\n\n`;
}

/** The response head of the themisto server's prediction stream. */
export function startThemistoStream(res: http.ServerResponse): void {
  res.writeHead(200, {
    'Content-Type': 'text/event-stream; charset=utf-8',
    'Cache-Control': 'no-cache',
    'X-Accel-Buffering': 'no'
  });
  res.flushHeaders();
}

/** An error reply as jupyter_server's APIHandler writes it. */
export function themistoError(res: http.ServerResponse, status: number, message: string): void {
  res.writeHead(status, { 'Content-Type': 'application/json' });
  res.end(pyJSON({ message, reason: null }));
}

/** One chunk of an OpenAI-compatible chat completion stream (`text` null: the choice ends). */
export function openAIChunk(text: string | null, index = 0): string {
  const choice =
    text === null
      ? { index, delta: {}, finish_reason: 'stop' }
      : { index, delta: { content: text }, finish_reason: null };
  const chunk = {
    id: 'chatcmpl-loopback',
    object: 'chat.completion.chunk',
    created: 0,
    model: 'loopback-model',
    choices: [choice]
  };
  return `data: ${JSON.stringify(chunk)}\n\n`;
}

export function startOpenAIStream(res: http.ServerResponse): void {
  res.writeHead(200, { 'Content-Type': 'text/event-stream; charset=utf-8' });
  res.flushHeaders();
}

/** Settings for ServerConnection pointing at `baseUrl` (with a token, as a lab page has). */
export function connectionTo(baseUrl: string, token = ''): ServerConnection.ISettings {
  return ServerConnection.makeSettings({
    baseUrl: baseUrl.endsWith('/') ? baseUrl : baseUrl + '/',
    token,
    appendToken: false
  });
}

/** Wait for `promise` at most `ms` milliseconds; reject naming `what` after that. */
export function within<T>(promise: Promise<T>, ms: number, what: string): Promise<T> {
  let timer: ReturnType<typeof setTimeout> | undefined;
  const timeout = new Promise<never>((_, reject) => {
    timer = setTimeout(() => reject(new Error(`${what}: not within ${ms} ms`)), ms);
  });
  return Promise.race([promise, timeout]).finally(() => clearTimeout(timer));
}
