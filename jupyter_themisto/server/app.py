"""ThemistoExtensionApp: the jupyter_server extension, its traitlets configuration and wiring."""

from __future__ import annotations

import os
from typing import Any

from jupyter_server.extension.application import ExtensionApp
from traitlets import Bool, Dict, Float, Int, Unicode, validate

from ..backends import default_backend_name
from ..context import DEFAULT_MAX_OUTPUT_CHARS, DEFAULT_TOKEN_BUDGET
from ..store import STORE_ENV, TrajectoryStore, resolve_store_path
from .autorecord import AutoRecorder
from .handlers import default_handlers
from .manager import ThemistoManager


class ThemistoExtensionApp(ExtensionApp):
    """Serves recorded trajectories and streamed next-cell / output predictions."""

    name = "jupyter_themisto"
    load_other_extensions = True

    store_path = Unicode(
        "",
        help="Trajectory store file. Empty: $THEMISTO_STORE, else "
        "<jupyter data dir>/themisto/trajectories.sqlite. Kernels started by this server "
        "record into the same file (it is exported to them as THEMISTO_STORE).",
    ).tag(config=True)
    default_backend = Unicode(
        "",
        help="Backend used when a request names none (an entry point of the "
        "jupyter_themisto.backends group: llamacpp, retrieval, openai, anthropic, …). Empty: "
        "llamacpp (the embedded code model) when the [llm] extra is installed, else retrieval.",
    ).tag(config=True)
    preload_model = Bool(
        True,
        help="When the default backend runs a model in this process (llamacpp), load it in the "
        "background as the server starts, so that the first suggestion does not wait for it.",
    ).tag(config=True)
    backend_settings = Dict(
        {},
        help="Per-backend settings, by backend name, e.g. {'openai': {'base_url': "
        "'http://localhost:11434/v1', 'model': 'qwen2.5-coder'}}. Each backend declares its "
        "settings (README, and their JSON schema at /themisto/backends); an unknown setting or "
        "a wrong type is logged as the server starts, and the backend answers with the error. "
        "Keys are never sent to the browser; prefer the OPENAI_API_KEY / ANTHROPIC_API_KEY "
        "environment variables.",
    ).tag(config=True)
    prediction_timeout = Float(
        60.0,
        help="Seconds a whole prediction may take; past it the request fails with 504 (or an "
        "`error` event once streaming).",
    ).tag(config=True)
    token_budget = Int(
        DEFAULT_TOKEN_BUDGET,
        help="Approximate tokens of context (cells, outputs, runtime summary) given to a "
        "backend per prediction.",
    ).tag(config=True)
    max_output_chars = Int(
        DEFAULT_MAX_OUTPUT_CHARS,
        help="Characters of each recorded cell output kept in a prediction context.",
    ).tag(config=True)
    max_page_size = Int(
        1000, help="Most trajectories or executions returned by one list request."
    ).tag(config=True)
    snapshot_wait = Float(
        2.0,
        help="Seconds an output prediction waits for the latest execution's namespace "
        "snapshot (written just after the cell) so that it sees the current variables.",
    ).tag(config=True)
    execution_wait = Float(
        5.0,
        help="Seconds a prediction request that names the execution it follows "
        "(`after_execution_count`) waits for that execution to be recorded; past it the "
        "request is answered 404 saying which execution is missing.",
    ).tag(config=True)
    early_answer_ms = Float(
        50.0,
        help="When nothing of a model backend's first next-cell suggestion has come this many "
        "milliseconds after it was asked for (a model loading or reading a cold prompt, a remote "
        "API's round trip), the cell the `retrieval` backend ranks first is shown meanwhile; the "
        "model's first text replaces it, and it stays when the model has nothing (0: off).",
    ).tag(config=True)
    auto_record = Bool(
        True,
        help="Record in every Python kernel this server starts, from its first request: "
        "ipykernel kernels are launched with `--ext=jupyter_themisto` (other Python kernels "
        "get a silent `%load_ext jupyter_themisto` once ready). A notebook opts out with "
        '`"themisto": {"record": false}` in its metadata.',
    ).tag(config=True)
    auto_record_timeout = Float(
        60.0,
        help="Seconds to wait for a Python kernel that is not ipykernel to be ready before "
        "giving up loading the recorder into it.",
    ).tag(config=True)

    allow_unfollowed_secrets = Bool(
        False,
        help="Send prediction contexts to the HTTP backends (openai, anthropic) even while the "
        "store holds keyed hashes of secret values that its key (<store>.key: missing, damaged "
        "or replaced) cannot follow. By default those backends are refused meanwhile (503, "
        "saying why): a value a kernel knew to be secret could reach the model server unscrubbed.",
    ).tag(config=True)

    @validate("prediction_timeout", "auto_record_timeout")
    def _positive(self, proposal: Any) -> float:
        if proposal["value"] <= 0:
            raise ValueError(f"{proposal['trait'].name} must be > 0")
        return proposal["value"]

    @validate("snapshot_wait", "execution_wait", "early_answer_ms")
    def _not_negative(self, proposal: Any) -> float:
        if proposal["value"] < 0:
            raise ValueError(f"{proposal['trait'].name} must be >= 0")
        return proposal["value"]

    @validate("token_budget", "max_output_chars", "max_page_size")
    def _positive_int(self, proposal: Any) -> int:
        if proposal["value"] < 1:
            raise ValueError(f"{proposal['trait'].name} must be >= 1")
        return proposal["value"]

    def initialize_settings(self) -> None:
        assert self.serverapp is not None  # set by jupyter_server before this is called
        # (absolute: kernels run in the notebooks' folders, and record where the server reads)
        path = str(resolve_store_path(self.store_path or None))
        # Kernels inherit the server's environment: they record where the server reads.
        self._previous_store_env = os.environ.get(STORE_ENV)
        self._store_env = os.environ[STORE_ENV] = path
        # A store file deleted or replaced while the server runs (to start afresh, or by a
        # sync tool) is followed: the kernels record into the new file, and so it is served.
        self.store = TrajectoryStore(path, follow=True)
        default_backend = self.default_backend or default_backend_name()
        self.manager = ThemistoManager(
            self.store,
            default_backend=default_backend,
            backend_settings=self.backend_settings,
            kernel_manager=self.serverapp.kernel_manager,
            log=self.log,
            prediction_timeout=self.prediction_timeout,
            token_budget=self.token_budget,
            max_output_chars=self.max_output_chars,
            max_page=self.max_page_size,
            snapshot_wait=self.snapshot_wait,
            execution_wait=self.execution_wait,
            early_answer=self.early_answer_ms / 1000,
            allow_unfollowed_secrets=self.allow_unfollowed_secrets,
        )
        self.auto_recorder = AutoRecorder(
            self.serverapp,
            log=self.log,
            ready_timeout=self.auto_record_timeout,
            manager=self.manager,
        )
        if self.auto_record:
            self.auto_recorder.attach()
        self.settings.update(themisto_manager=self.manager, themisto_app=self)
        for problem in self.manager.check_settings():
            self.log.error("themisto: %s", problem)
        if self.preload_model:
            self.manager.preload_default()
        self.log.info("themisto: trajectory store %s; default backend %s", path, default_backend)

    def initialize_handlers(self) -> None:
        self.handlers.extend(default_handlers)

    async def stop_extension(self) -> None:
        await self.auto_recorder.close()
        await self.manager.close()
        self.store.close()
        # Leave the environment as found (several servers may live in one test process).
        if os.environ.get(STORE_ENV) == self._store_env:
            if self._previous_store_env is None:
                os.environ.pop(STORE_ENV, None)
            else:
                os.environ[STORE_ENV] = self._previous_store_env


# `python -m jupyter_themisto.server.app --help-all` lists every trait with its help (the
# server's own --help-all does not include extensions' classes); without flags it starts a
# Jupyter server with this extension.
main = launch_new_instance = ThemistoExtensionApp.launch_instance

if __name__ == "__main__":
    main()
