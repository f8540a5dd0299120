"""The `seq2seq` backend: a Hugging Face encoder-decoder or causal model from a local folder."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from pydantic import Field

from ._local import Completion, LocalModelPredictor, LocalModelSettings, SharedModel, shared_model
from .base import BackendError, BackendUnavailable


class Seq2SeqSettings(LocalModelSettings):
    model_path: str | None = Field(
        None,
        description="required: a folder written by `save_pretrained`, with its tokenizer"
        " (nothing is ever downloaded)",
    )
    max_input_tokens: int | None = Field(
        None,
        ge=0,
        description="longer prompts keep their newest part (default: the model's position"
        " limit, else 1024)",
    )


class Seq2SeqPredictor(LocalModelPredictor):
    """A transformers model on the CPU (extra `[seq2seq]`): T5/CodeT5-style encoder-decoders
    and GPT-style causal models alike, chosen by the model's own config (settings:
    `Seq2SeqSettings`).
    """

    name = "seq2seq"
    description = "A local Hugging Face encoder-decoder or causal model (transformers, CPU)"
    settings_model = Seq2SeqSettings
    settings: Seq2SeqSettings

    def model_dir(self) -> Path:
        configured = self.settings.model_path
        if not configured:
            raise BackendUnavailable(
                "seq2seq: no model: set model_path to a folder saved with save_pretrained"
                " (model and tokenizer)"
            )
        path = Path(os.path.expanduser(str(configured)))
        if not (path / "config.json").is_file():
            raise BackendUnavailable(f"seq2seq: {path} holds no model (no config.json)")
        return path

    def shared(self) -> SharedModel:
        path = self.model_dir()
        try:
            import transformers as tf
        except ImportError as e:
            raise BackendUnavailable(
                f"seq2seq: transformers is not installed ({e}); "
                "`pip install 'jupyter-themisto[seq2seq]'`"
            ) from None

        def load() -> Any:
            try:
                config = tf.AutoConfig.from_pretrained(path, local_files_only=True)
                auto = (
                    tf.AutoModelForSeq2SeqLM
                    if config.is_encoder_decoder
                    else tf.AutoModelForCausalLM
                )
                model = auto.from_pretrained(path, local_files_only=True)
                tokenizer = tf.AutoTokenizer.from_pretrained(path, local_files_only=True)
            except (OSError, ValueError, KeyError) as e:
                raise BackendUnavailable(f"seq2seq: cannot load {path}: {e}") from None
            model.eval()
            # The newest cells matter most: a long prompt loses its beginning, not its end.
            tokenizer.truncation_side = "left"
            return model, tokenizer

        return shared_model(("seq2seq", str(path.resolve())), load)

    def produce(
        self, model: SharedModel, job: Completion, cancelled: threading.Event
    ) -> Iterator[str]:
        import torch
        import transformers as tf

        lm, tokenizer = model.model
        limit = int(
            self.settings.max_input_tokens
            or getattr(lm.config, "max_position_embeddings", 0)
            or getattr(lm.config, "n_positions", 0)
            or 1024
        )
        if not lm.config.is_encoder_decoder:
            limit = max(16, limit - job.max_tokens)  # a causal model's answer shares its window
        inputs = tokenizer(job.prompt, return_tensors="pt", truncation=True, max_length=limit)
        inputs.pop("token_type_ids", None)
        banned = banned_ids(tokenizer, job.banned)
        # Not the first token: those of `banned_first` that are one token each.
        first = [ids[0] for ids in banned_ids(tokenizer, job.banned_first) if len(ids) == 1]
        streamer = tf.TextIteratorStreamer(
            tokenizer, skip_prompt=True, skip_special_tokens=True, timeout=300
        )

        class Cancelled(tf.StoppingCriteria):
            def __call__(self, input_ids: Any, scores: Any, **kwargs: Any) -> Any:
                return torch.full((input_ids.shape[0],), cancelled.is_set(), dtype=torch.bool)

        failure: list[BaseException] = []

        def generate() -> None:
            try:
                torch.manual_seed(job.seed)
                with torch.no_grad():
                    lm.generate(
                        **inputs,
                        max_new_tokens=job.max_tokens,
                        do_sample=job.temperature > 0,
                        **({"temperature": job.temperature} if job.temperature > 0 else {}),
                        pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id,
                        **({"bad_words_ids": banned} if banned else {}),
                        **({"begin_suppress_tokens": first} if first else {}),
                        streamer=streamer,
                        stopping_criteria=tf.StoppingCriteriaList([Cancelled()]),
                    )
            except BaseException as e:  # noqa: BLE001 - reported by the iterating side
                failure.append(e)
                streamer.end()

        worker = threading.Thread(target=generate, name="themisto-seq2seq", daemon=True)
        worker.start()
        try:
            for text in streamer:
                if text:
                    yield text
        finally:
            cancelled.set()
            worker.join()
        if failure:
            raise BackendError(f"seq2seq: generation failed: {failure[0]}")

    async def health(self) -> dict[str, Any]:
        try:
            path = self.model_dir()
        except BackendUnavailable as e:
            return {"ok": False, "detail": str(e)}
        import importlib.util

        if importlib.util.find_spec("transformers") is None:
            return {"ok": False, "detail": "transformers is not installed (extra [seq2seq])"}
        return {"ok": True, "detail": f"{path.name} (loads on first use)"}


def banned_ids(tokenizer: Any, texts: Iterable[str]) -> list[list[int]]:
    """The token sequences of `texts` for `generate(bad_words_ids=…)`; a text the vocabulary
    cannot spell (an unknown token in it) is left out: banning the unknown token would ban
    more than the text."""
    out: list[list[int]] = []
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False).input_ids
        if ids and tokenizer.unk_token_id not in ids:
            out.append(list(ids))
    return out
