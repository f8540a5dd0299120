/**
 * The prediction transport against a real `jupyter server` with the themisto extension, whose
 * `openai` backend talks to a loopback model server run here (an OpenAI-compatible chat stream),
 * so that a test decides what the model says and sees when the Jupyter server hangs up on it.
 *
 * tests/test_frontend.py starts the server and passes THEMISTO_TEST_SERVER_URL,
 * THEMISTO_TEST_SERVER_TOKEN and THEMISTO_TEST_MODEL_PORT (the port its backend calls).
 */
import { IPredictionResult, IPredictRequest } from '../types';
import { ThemistoError } from '../errors';
import { streamPrediction } from '../predict';
import {
  connectionTo,
  gate,
  LoopbackServer,
  openAIChunk,
  startOpenAIStream,
  within
} from './loopback';

const CLOSE_MS = 10_000;

function environment(): { url: string; token: string; modelPort: number } {
  const url = process.env.THEMISTO_TEST_SERVER_URL;
  const token = process.env.THEMISTO_TEST_SERVER_TOKEN;
  const modelPort = Number(process.env.THEMISTO_TEST_MODEL_PORT);
  if (!url || !token || !modelPort) {
    throw new Error(
      'these tests need a running jupyter server: run them with ' +
        '`pytest tests/test_frontend.py`, which starts one and sets THEMISTO_TEST_SERVER_URL, ' +
        'THEMISTO_TEST_SERVER_TOKEN and THEMISTO_TEST_MODEL_PORT'
    );
  }
  return { url, token, modelPort };
}

// Cells the browser sends for a notebook that has no recorded trajectory.
const REQUEST: IPredictRequest = {
  notebook_path: 'frontend-test.ipynb',
  backend: 'openai',
  n: 1,
  cells: [{ cell_type: 'code', source: 'import math\nvalues = [1, 2, 3]' }]
};

describe('streamPrediction against jupyter server', () => {
  const model = new LoopbackServer();
  let env: { url: string; token: string; modelPort: number };

  beforeAll(async () => {
    env = environment();
    await model.start(env.modelPort);
  });
  afterAll(() => model.stop());
  afterEach(() => expect(model.errors).toEqual([]));

  function predict(
    body: IPredictRequest = REQUEST,
    signal: AbortSignal = new AbortController().signal,
    onUpdate?: (result: IPredictionResult) => void,
    token = env.token
  ): Promise<IPredictionResult> {
    return streamPrediction('next-cell', body, signal, onUpdate, connectionTo(env.url, token));
  }

  it("streams the model's lines as they come, from the cells sent", async () => {
    const shown = gate();
    model.handler = async (req, res) => {
      startOpenAIStream(res);
      res.write(openAIChunk('total = sum(values)\n'));
      await shown.opened; // the browser must have the first line before the model goes on
      res.write(openAIChunk('print(total)'));
      res.write(openAIChunk(null));
      res.end('data: [DONE]\n\n');
    };
    const asked = model.nextExchange();
    const texts: string[] = [];
    const result = await within(
      predict(REQUEST, undefined, update => {
        const text = update.suggestions[0]?.text ?? '';
        texts.push(text);
        if (text === 'total = sum(values)\n') {
          shown.open();
        }
      }),
      20_000,
      'the first line reaching onUpdate before the model sends the next'
    );
    expect(result.backend).toBe('openai');
    expect(result.suggestions).toEqual([
      { index: 0, text: 'total = sum(values)\nprint(total)', done: true, score: null }
    ]);
    expect(typeof result.elapsedMs).toBe('number');
    expect(texts).toContain('total = sum(values)\n');
    expect(texts[texts.length - 1]).toBe('total = sum(values)\nprint(total)');
    // What reached the model is the prompt made of the cells the browser sent.
    const request = JSON.parse((await asked).body);
    expect(request.stream).toBe(true);
    expect(JSON.stringify(request.messages)).toContain('values = [1, 2, 3]');
  });

  it('ends with no_prediction when the model says nothing', async () => {
    model.handler = (req, res) => {
      startOpenAIStream(res);
      res.end('data: [DONE]\n\n'); // not one choice
    };
    const result = await predict();
    expect(result.noPrediction).toBe('the model returned no suggestion');
    expect(result.suggestions).toEqual([]);
  });

  it('rejects with the error event of a model stream cut off mid-way', async () => {
    model.handler = (req, res) => {
      startOpenAIStream(res);
      res.write(openAIChunk('total = 1\n'));
      res.end(); // no finish, no [DONE]
    };
    const texts: string[] = [];
    const failure = predict(REQUEST, undefined, update => {
      texts.push(update.suggestions[0]?.text ?? '');
    });
    await expect(failure).rejects.toBeInstanceOf(ThemistoError);
    await expect(failure).rejects.toMatchObject({ status: 502 });
    await expect(failure).rejects.toThrow(/^openai: the stream from .* ended before \[DONE\]/);
    expect(texts).toContain('total = 1\n');
  });

  it("turns HTTP errors into ThemistoErrors with the server's message", async () => {
    model.handler = (req, res) => {
      res.writeHead(500, { 'Content-Type': 'application/json' });
      res.end(JSON.stringify({ error: { message: 'the loopback model is overloaded' } }));
    };
    await expect(predict({ ...REQUEST, n: 0 })).rejects.toMatchObject({
      status: 400,
      message: 'n: Input should be greater than or equal to 1'
    });
    const unknown = predict({ ...REQUEST, backend: 'no-such-backend' });
    await expect(unknown).rejects.toMatchObject({ status: 404 });
    await expect(unknown).rejects.toThrow(/no-such-backend/);
    const failed = predict();
    await expect(failed).rejects.toMatchObject({ status: 502 });
    await expect(failed).rejects.toThrow(/HTTP 500 .*the loopback model is overloaded/);
    const refused = predict(REQUEST, undefined, undefined, 'not-the-token');
    await expect(refused).rejects.toBeInstanceOf(ThemistoError);
    await expect(refused).rejects.toMatchObject({ status: 403 });
  });

  it('aborting mid-stream makes the server hang up on the model', async () => {
    model.handler = (req, res) => {
      startOpenAIStream(res);
      res.write(openAIChunk('total = 1\n'));
      // and never more: only a cancellation can end this
    };
    const asked = model.nextExchange();
    const controller = new AbortController();
    const failure = predict(REQUEST, controller.signal, update => {
      if (update.suggestions.length) {
        controller.abort();
      }
    });
    await expect(failure).rejects.not.toBeInstanceOf(ThemistoError);
    expect(controller.signal.aborted).toBe(true);
    await within(
      (await asked).closedEarly,
      CLOSE_MS,
      'the jupyter server closing its connection to the model after the browser left'
    );
  });

  it('aborting before the first chunk makes the server hang up on the model', async () => {
    model.handler = res => {
      // the model has not said a word yet
    };
    const asked = model.nextExchange();
    const controller = new AbortController();
    const failure = predict(REQUEST, controller.signal);
    const exchange = await within(asked, CLOSE_MS, 'the jupyter server asking the model');
    controller.abort();
    await expect(failure).rejects.not.toBeInstanceOf(ThemistoError);
    await within(
      exchange.closedEarly,
      CLOSE_MS,
      'the jupyter server closing its connection to the model after the browser left'
    );
  });
});
