"""The Predictor interface every backend implements, and the errors backends raise."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Literal

if TYPE_CHECKING:
    from ..context import PredictionContext
    from ..store import TrajectoryStore
    from .settings import BackendSettings

#: what a backend predicts
Task = Literal["next-cell", "output"]


@dataclass
class NextCellChunk:
    """A piece of a streamed next-cell suggestion.

    Suggestions are numbered by rank (`index` 0 is the best). A backend streams text for a
    suggestion as deltas to append; the chunk with `done=True` closes that suggestion. A chunk
    with `replace=True` replaces what came for its suggestion so far (the server's early answer,
    shown while the model was slower, gives way to the model's).
    """

    index: int
    text: str
    done: bool = False
    score: float | None = None
    replace: bool = False
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass
class OutputChunk:
    """A piece of a streamed output prediction: text to append to the predicted output."""

    text: str
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass
class BackendEnv:
    """What the host (server or CLI) lends a backend: all optional, backends must cope."""

    store: TrajectoryStore | None = None
    kernel_manager: Any = None
    log: logging.Logger = field(default_factory=lambda: logging.getLogger("jupyter_themisto"))
    #: the host's secrets door: a context with every known secret scrubbed. A backend that gets
    #: the context as it is (`sees_secrets`) passes on only what this returns.
    scrub: Callable[[PredictionContext], PredictionContext] | None = None
    #: the host's own instance of a backend by name (its settings, its loaded model), for a
    #: backend that hands over to another (the preview's fallback)
    lookup: Callable[[str], Predictor] | None = None
    #: why some values the store knows to be secret cannot be followed into a context right now
    #: (its key missing or replaced: see redaction.key_problem), or None when all can or the
    #: host sends contexts anyway. A backend that sends the context over the network to a
    #: model server refuses while it says something (the scrub may have missed those values).
    unfollowed: Callable[[], str | None] | None = None


class BackendError(Exception):
    """The backend failed in a way the person can act on; served as HTTP 502."""

    status = 502


class BackendTimeout(BackendError):
    """The backend took longer than allowed; served as HTTP 504."""

    status = 504


class BackendUnavailable(BackendError):
    """The backend cannot work here (missing package, model, key); served as HTTP 503."""

    status = 503


class NoPrediction(Exception):  # noqa: N818 - a normal outcome, not an error
    """The backend honestly has nothing to predict for this request (with the reason).

    `code` and `details` name a reason the frontend words in the person's language (the
    `no_prediction` event carries them beside the reason, which stays English for logs)."""

    def __init__(
        self, reason: str = "", code: str | None = None, details: dict[str, Any] | None = None
    ) -> None:
        super().__init__(reason)
        self.code = code
        self.details = dict(details or {})

    def event_data(self) -> dict[str, Any]:
        """The `no_prediction` event's data."""
        data: dict[str, Any] = {"reason": str(self) or "no prediction"}
        if self.code:
            data["code"] = self.code
            data["details"] = self.details
        return data


class Predictor:
    """A prediction backend.

    Subclasses set `name` and `description`, declare their settings as a pydantic model
    (`settings_model`, a `BackendSettings`), and override `predict_next_cell` and/or
    `predict_output`. `config` holds the backend's own settings as given (from the server's
    traitlets config or the CLI), `settings` the same validated by `settings_model` (unknown
    settings and wrong types raise InvalidSettings naming them); secrets in them must never be
    logged or returned.
    """

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    #: which tasks the backend serves: "next-cell", "output"
    tasks: ClassVar[tuple[Task, ...]] = ("next-cell", "output")
    #: True for a backend that runs the cell in the person's own kernel (the preview): it gets
    #: the context unscrubbed, as the cell really reads, and scrubs whatever it passes on
    #: (`env.scrub`). Every other backend gets only scrubbed contexts.
    sees_secrets: ClassVar[bool] = False
    #: the backend's settings model; None (a third-party backend that declares none): its
    #: settings are passed as given, unchecked
    settings_model: ClassVar[type[BackendSettings] | None] = None

    def __init__(self, config: dict[str, Any] | None = None, env: BackendEnv | None = None):
        from .settings import check_settings

        self.settings: BackendSettings | None = check_settings(
            self.name or type(self).__name__, self.settings_model, config
        )
        self.config = dict(config or {})
        self.env = env or BackendEnv()

    async def predict_next_cell(
        self, ctx: PredictionContext, *, n: int = 1
    ) -> AsyncIterator[NextCellChunk]:
        """Stream up to `n` ranked suggestions for the cell the person will run next."""
        raise NoPrediction(f"the {self.name} backend does not predict next cells")
        yield  # pragma: no cover - makes this an async generator

    async def predict_output(self, ctx: PredictionContext) -> AsyncIterator[OutputChunk]:
        """Stream the predicted text output of `ctx.target_source`."""
        raise NoPrediction(f"the {self.name} backend does not predict outputs")
        yield  # pragma: no cover

    async def health(self) -> dict[str, Any]:
        """A cheap readiness check: {"ok": bool, "detail": str}. Never includes secrets."""
        return {"ok": True, "detail": "ready"}

    async def aclose(self) -> None:
        """Release connections, models, child processes."""
