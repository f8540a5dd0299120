"""The seq2seq backend's real loading and generation path, with tiny models the test creates.

The weights are random (nothing is downloaded): the tests compare the backend's answer with
what transformers' own `generate` gives for the same prompt, not its quality.
"""

from __future__ import annotations

import threading

import pytest
import torch
import transformers as tf
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from jupyter_themisto.backends import BackendUnavailable, create_backend
from jupyter_themisto.backends._local import Completion, stream_from_thread
from jupyter_themisto.backends._text import StopScanner, strip_code_fences
from jupyter_themisto.backends.prompts import completion_prompt
from jupyter_themisto.backends.seq2seq import Seq2SeqPredictor, banned_ids
from jupyter_themisto.context import ContextCell, PredictionContext

CORPUS = [
    "import pandas as pd\ndf = pd.read_csv('data.csv')\ndf.head()\n",
    "# In[1]:\nprint(df.shape)\n# Out[1]:\n(3, 2)\n",
    "import numpy as np\nx = np.arange(10)\nx.mean()\n",
    "for i in range(3):\n    print(i)\n",
]


def make_tokenizer() -> tf.PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<pad>", "</s>", "<unk>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS * 20, trainer)
    return tf.PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>"
    )


def save_tiny_model(folder, kind: str, keep=None) -> None:
    """A random-weight T5 (encoder-decoder) or GPT-2 (causal) model and its tokenizer.

    `keep(token_text) -> bool` limits what the model may generate to the tokens it accepts.
    """
    tokenizer = make_tokenizer()
    torch.manual_seed(0)
    ids = {
        "vocab_size": len(tokenizer),
        "pad_token_id": tokenizer.pad_token_id,
        "eos_token_id": tokenizer.eos_token_id,
    }
    if kind == "t5":
        config = tf.T5Config(
            d_model=32, d_ff=64, d_kv=8, num_layers=2, num_heads=2, decoder_start_token_id=0, **ids
        )
        model = tf.T5ForConditionalGeneration(config)
    else:
        config = tf.GPT2Config(n_embd=32, n_layer=2, n_head=2, n_positions=512, **ids)
        model = tf.GPT2LMHeadModel(config)
    # Random weights would often pick a special token first and answer nothing at all.
    suppress = set(tokenizer.all_special_ids)
    if keep is not None:
        suppress |= {i for i in range(len(tokenizer)) if not keep(tokenizer.decode([i]))}
    model.generation_config.suppress_tokens = sorted(suppress)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


@pytest.fixture(scope="module", params=["t5", "gpt2"])
def model_dir(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    # Words only: white space alone would be an empty suggestion.
    save_tiny_model(folder, request.param, keep=lambda text: any(c.isalnum() for c in text))
    return folder


def session(**kw) -> PredictionContext:
    return PredictionContext(
        cells=[
            ContextCell(source="import numpy as np", execution_count=1),
            ContextCell(source="x = np.arange(10)", execution_count=2),
        ],
        **kw,
    )


def reference(folder, prompt: str, stops: list[str], max_new_tokens: int) -> str:
    """transformers' own greedy answer to `prompt`, cut at the cell boundary, fences removed."""
    tokenizer = tf.AutoTokenizer.from_pretrained(folder)
    config = tf.AutoConfig.from_pretrained(folder)
    auto = tf.AutoModelForSeq2SeqLM if config.is_encoder_decoder else tf.AutoModelForCausalLM
    model = auto.from_pretrained(folder)
    inputs = tokenizer(prompt, return_tensors="pt")
    inputs.pop("token_type_ids", None)
    with torch.no_grad():
        out = model.generate(
            **inputs,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
        )
    if not config.is_encoder_decoder:
        out = out[:, inputs["input_ids"].shape[1] :]
    text = tokenizer.decode(out[0], skip_special_tokens=True)
    scanner = StopScanner(stops)
    return strip_code_fences(scanner.feed(text) + scanner.finish())


async def test_next_cell_equals_transformers_generate(model_dir):
    backend = create_backend(
        "seq2seq", {"model_path": str(model_dir), "max_tokens": 20, "suggestion_timeout": 300}
    )
    assert isinstance(backend, Seq2SeqPredictor)
    assert (await backend.health())["ok"] is True
    chunks = [c async for c in backend.predict_next_cell(session())]
    text = "".join(c.text for c in chunks)
    p = completion_prompt(session(), "next-cell")
    prompt, stops = p.text, p.stops
    expected = reference(model_dir, prompt, stops, 20)
    assert chunks[-1].done
    assert expected.strip(), "the tiny model should answer more than white space"
    assert text == expected


async def test_output_prediction_equals_transformers_generate(model_dir):
    backend = Seq2SeqPredictor(
        {"model_path": str(model_dir), "output_max_tokens": 12, "output_timeout": 300}
    )
    ctx = session(target_source="x.mean()")
    text = "".join([c.text async for c in backend.predict_output(ctx)])
    p = completion_prompt(ctx, "output")
    prompt, stops = p.text, p.stops
    assert prompt.endswith(">>> x.mean()\n")
    assert text == reference(model_dir, prompt, stops, 12)


async def test_generation_streams_and_stops_when_cancelled(tmp_path):
    # Every token this model may generate holds a line break, so each is streamed on its own.
    save_tiny_model(tmp_path, "gpt2", keep=lambda text: "\n" in text)
    backend = Seq2SeqPredictor({"model_path": str(tmp_path)})
    model = backend.shared()

    full = list(backend.produce(model, Completion("x = 1\n", [], 200), threading.Event()))
    assert len(full) == 200  # one piece per token, streamed as generated

    cancelled = threading.Event()
    pieces = backend.produce(model, Completion("x = 1\n", [], 200), cancelled)
    first = next(pieces)
    cancelled.set()
    rest = list(pieces)
    assert first == full[0] and len(rest) < 50  # generation stopped at the next token


async def test_banned_strings_are_never_generated(model_dir):
    backend = Seq2SeqPredictor({"model_path": str(model_dir)})
    model = backend.shared()
    prompt = "import numpy as np\nx = np.arange(10)\n"
    free = "".join(backend.produce(model, Completion(prompt, [], 8), threading.Event()))
    word = next(w for w in free.split() if w.isalnum())  # the model does write it
    banned = Completion(prompt, [], 8, banned=(word, "```", "\x00never"))
    again = "".join(backend.produce(model, banned, threading.Event()))
    assert again.strip() and word not in again.split()
    # A text the vocabulary cannot spell is left out, not banned as the unknown token.
    tokenizer = model.model[1]
    assert banned_ids(tokenizer, ["<unk>", ""]) == []
    assert banned_ids(tokenizer, [word]) == [tokenizer(word, add_special_tokens=False).input_ids]


async def test_a_banned_first_token_is_not_the_first(model_dir):
    backend = Seq2SeqPredictor({"model_path": str(model_dir)})
    model = backend.shared()
    tokenizer = model.model[1]
    prompt = "import numpy as np\nx = np.arange(10)\n"
    free = list(backend.produce(model, Completion(prompt, [], 6), threading.Event()))
    first = tokenizer.decode(tokenizer(free[0], add_special_tokens=False).input_ids[:1])
    job = Completion(prompt, [], 6, banned_first=(first,))
    again = list(backend.produce(model, job, threading.Event()))
    assert again and not again[0].startswith(first), (free, again)


async def test_closing_the_stream_frees_the_model(model_dir):
    backend = Seq2SeqPredictor({"model_path": str(model_dir)})
    model = backend.shared()

    def produce(cancelled: threading.Event):
        return backend.produce(model, Completion("import numpy as np\n", [], 400), cancelled)

    pieces = stream_from_thread(model, produce)
    assert await pieces.__anext__()
    await pieces.aclose()
    # The worker lets go of the model once generation stopped: the next generation gets it.
    again = [p async for p in stream_from_thread(model, produce)]
    assert "".join(again).strip()


async def test_missing_or_empty_model_folder(tmp_path):
    with pytest.raises(BackendUnavailable, match="set model_path"):
        Seq2SeqPredictor({}).shared()
    with pytest.raises(BackendUnavailable, match="no config.json"):
        Seq2SeqPredictor({"model_path": str(tmp_path)}).shared()
    (tmp_path / "config.json").write_text('{"model_type": "no-such-architecture"}')
    with pytest.raises(BackendUnavailable, match="cannot load"):
        Seq2SeqPredictor({"model_path": str(tmp_path)}).shared()
    assert (await Seq2SeqPredictor({}).health())["ok"] is False
