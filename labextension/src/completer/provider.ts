/**
 * The next cell as ghost text: an inline completion provider answering in empty cells with the
 * backend's top suggestion, streamed, and cancelled when a newer request supersedes it.
 */
import {
  CompletionHandler,
  IInlineCompletionContext,
  IInlineCompletionItem,
  IInlineCompletionList,
  IInlineCompletionProvider
} from '@jupyterlab/completer';
import { NotebookPanel } from '@jupyterlab/notebook';

import { ThemistoService } from '../common/service';
import { IPredictionResult } from '../common/types';

export const PROVIDER_ID = '@jupyter-themisto/next-cell';

const MAX_STREAMS = 8;

/** Partial text of one streamed suggestion, handed from fetch() to stream(). */
class TextStream {
  text = '';
  done = false;

  update(text: string, done: boolean): void {
    this.text = text;
    this.done = this.done || done;
    const waiters = this._waiters;
    this._waiters = [];
    waiters.forEach(resolve => resolve());
  }

  async *updates(): AsyncGenerator<{ response: IInlineCompletionItem }, undefined, unknown> {
    let sent = '';
    for (;;) {
      if (this.text !== sent || this.done) {
        sent = this.text;
        yield { response: { insertText: sent, isIncomplete: !this.done } };
      }
      if (this.done) {
        return undefined;
      }
      await new Promise<void>(resolve => this._waiters.push(resolve));
    }
  }

  private _waiters: (() => void)[] = [];
}

export class NextCellProvider implements IInlineCompletionProvider {
  readonly identifier = PROVIDER_ID;
  readonly name = 'Themisto next cell';

  constructor(options: NextCellProvider.IOptions) {
    this._service = options.service;
  }

  /** Cancel the request in flight, if any (a newer cell became active, or a cell ran). */
  cancel(): void {
    this._controller?.abort();
    this._controller = null;
  }

  async fetch(
    request: CompletionHandler.IRequest,
    context: IInlineCompletionContext
  ): Promise<IInlineCompletionList> {
    const panel = context.widget;
    // Only an empty cell is asking for the *next* cell; elsewhere other providers complete.
    if (!(panel instanceof NotebookPanel) || request.text.trim() !== '') {
      return { items: [] };
    }
    if (!this._service.isActiveFor(panel)) {
      return { items: [] };
    }
    this.cancel();
    const controller = new AbortController();
    this._controller = controller;
    const debounce = this._service.settings.debounceMs;
    if (debounce > 0) {
      await new Promise(resolve => setTimeout(resolve, debounce));
      if (controller.signal.aborted) {
        return { items: [] };
      }
    }
    const token = `themisto-${++this._counter}`;
    const stream = new TextStream();
    this._streams.set(token, stream);
    // A suggestion the completer never streamed (dismissed, superseded) is not kept for long.
    for (const old of this._streams.keys()) {
      if (this._streams.size <= MAX_STREAMS) {
        break;
      }
      this._streams.delete(old);
    }
    let first: () => void = () => undefined;
    const firstChunk = new Promise<void>(resolve => (first = resolve));
    const onUpdate = (result: IPredictionResult) => {
      const top = result.suggestions[0];
      if (top && top.text) {
        stream.update(top.text, top.done);
        first();
      }
    };
    const finished = this._service
      .predictNextCell(panel, controller.signal, onUpdate)
      .then(
        result => {
          const top = result.suggestions[0];
          stream.update(top?.text ?? stream.text, true);
        },
        () => stream.update(stream.text, true)
      )
      .finally(() => {
        first();
        if (this._controller === controller) {
          this._controller = null;
        }
      });
    await Promise.race([firstChunk, finished]);
    if (!stream.text || controller.signal.aborted) {
      this._streams.delete(token);
      return { items: [] };
    }
    if (stream.done) {
      this._streams.delete(token);
      return { items: [{ insertText: stream.text }] };
    }
    return { items: [{ insertText: stream.text, isIncomplete: true, token }] };
  }

  async *stream(
    token: string
  ): AsyncGenerator<{ response: IInlineCompletionItem }, undefined, unknown> {
    const stream = this._streams.get(token);
    if (!stream) {
      return undefined;
    }
    try {
      yield* stream.updates();
    } finally {
      this._streams.delete(token);
    }
    return undefined;
  }

  private _service: ThemistoService;
  private _controller: AbortController | null = null;
  private _streams = new Map<string, TextStream>();
  private _counter = 0;
}

export namespace NextCellProvider {
  export interface IOptions {
    service: ThemistoService;
  }
}
