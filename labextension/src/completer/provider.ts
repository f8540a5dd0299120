/**
 * The next cell as ghost text: an inline completion provider answering in empty cells with the
 * backend's top suggestion, streamed, and cancelled when a newer request supersedes it. Text
 * typed or accepted a part at a time (a word, a line) that agrees with the suggestion keeps the
 * rest of it as ghost text.
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
import { firstPart, Part } from './parts';

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

  /** The text as it grows, after `typed` (what the cell holds of it already). */
  async *updates(
    typed = ''
  ): AsyncGenerator<{ response: IInlineCompletionItem }, undefined, unknown> {
    let sent = '';
    for (;;) {
      if (this.text !== sent || this.done) {
        sent = this.text;
        if (!sent.startsWith(typed)) {
          // The model's answer replaced an early one that the cell began: it has no rest.
          yield { response: { insertText: '', isIncomplete: false } };
          return undefined;
        }
        yield { response: { insertText: sent.slice(typed.length), isIncomplete: !this.done } };
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

  /**
   * Ask for the next suggestion in cell `cell` (a cell's model id) without the debounce: the
   * cell above it just ran, so the person is not moving through cells.
   */
  answerNow(cell: string): void {
    this._now = cell;
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
    if (!(panel instanceof NotebookPanel) || !this._service.isActiveFor(panel)) {
      return { items: [] };
    }
    const cell = panel.content.activeCell?.model.id ?? '';
    // Only an empty cell is asking for the *next* cell; elsewhere other providers complete,
    // but for text that begins the suggestion this cell shows: the rest of it stays.
    if (request.text.trim() !== '') {
      const atEnd = request.offset >= Array.from(request.text).length;
      return atEnd ? this._rest(cell, request.text) : { items: [] };
    }
    this.cancel();
    const controller = new AbortController();
    this._controller = controller;
    const now = this._now === cell;
    this._now = null;
    const debounce = now ? 0 : this._service.settings.debounceMs;
    if (debounce > 0) {
      await new Promise(resolve => setTimeout(resolve, debounce));
      if (controller.signal.aborted) {
        return { items: [] };
      }
    }
    const stream = new TextStream();
    const token = this._track(stream, '');
    this._shown = { cell, stream };
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
    const found = this._streams.get(token);
    if (!found) {
      return undefined;
    }
    try {
      yield* found.stream.updates(found.typed);
    } finally {
      this._streams.delete(token);
    }
    return undefined;
  }

  /**
   * The first `part` of the suggestion shown in cell `cell` that follows `typed` (what the
   * cell holds); '' when the cell holds anything else.
   */
  nextPart(cell: string, typed: string, part: Part): string {
    const rest = this._restOf(cell, typed);
    return rest ? firstPart(rest.text, part) : '';
  }

  /**
   * The rest of the suggestion shown in `cell` after `typed` (what the cell holds), streaming
   * on while the suggestion does; no item when the cell holds anything else.
   */
  private _rest(cell: string, typed: string): IInlineCompletionList {
    const rest = this._restOf(cell, typed);
    if (!rest) {
      return { items: [] };
    }
    if (rest.stream.done) {
      return { items: [{ insertText: rest.text }] };
    }
    const token = this._track(rest.stream, typed);
    return { items: [{ insertText: rest.text, isIncomplete: true, token }] };
  }

  /** The suggestion shown in `cell` and its text after `typed`; null if there is none. */
  private _restOf(cell: string, typed: string): { stream: TextStream; text: string } | null {
    const shown = this._shown;
    if (!shown || shown.cell !== cell || !shown.stream.text.startsWith(typed)) {
      return null;
    }
    const text = shown.stream.text.slice(typed.length);
    return text ? { stream: shown.stream, text } : null;
  }

  /** A token for stream() to stream `stream` by, after `typed`. */
  private _track(stream: TextStream, typed: string): string {
    const token = `themisto-${++this._counter}`;
    this._streams.set(token, { stream, typed });
    // A suggestion the completer never streamed (dismissed, superseded) is not kept for long.
    for (const old of this._streams.keys()) {
      if (this._streams.size <= MAX_STREAMS) {
        break;
      }
      this._streams.delete(old);
    }
    return token;
  }

  private _service: ThemistoService;
  private _controller: AbortController | null = null;
  private _streams = new Map<string, { stream: TextStream; typed: string }>();
  /** The suggestion asked for last, and the cell it was asked for in (a cell's model id). */
  private _shown: { cell: string; stream: TextStream } | null = null;
  private _counter = 0;
  /** The cell whose next suggestion is asked for without the debounce (`answerNow`). */
  private _now: string | null = null;
}

export namespace NextCellProvider {
  export interface IOptions {
    service: ThemistoService;
  }
}
