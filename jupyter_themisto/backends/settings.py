"""Typed backend settings: the pydantic base every backend's settings model derives from, their
validation (errors name the backend and the setting), JSON schema, and README tables.

A backend declares its settings as a model (`Predictor.settings_model`); a setting it does not
declare, or a value of the wrong type, is an error when the backend is made, instead of being
silently ignored. README's tables are made by `settings_table` (see `readme_tables.py`).
"""

from __future__ import annotations

import copy
import fnmatch
import functools
import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, SecretStr, ValidationError

from .base import BackendUnavailable

if TYPE_CHECKING:
    from .base import Predictor

__all__ = [
    "BackendSettings",
    "InvalidSettings",
    "check_settings",
    "settings_schema",
    "settings_table",
]


class BackendSettings(BaseModel):
    """Settings of a backend (`backend_settings[name]` on the server, `-o KEY=VALUE` in the
    CLI). Subclasses declare each setting with its default and a `description`; anything else
    is refused."""

    # (settings such as `model_path` are no clash with pydantic's own `model_*` names)
    model_config = ConfigDict(extra="forbid", protected_namespaces=())


class InvalidSettings(BackendUnavailable, ValueError):
    """A backend's settings are wrong (unknown setting, wrong type, value out of range): the
    backend cannot be made; served as 503 with the message, which names backend and setting."""


def _known(model: type[BaseModel], loc: tuple[Any, ...]) -> list[str]:
    """The settings the (nested) model at `loc` declares, for an "unknown setting" error."""
    for part in loc[:-1]:
        field = model.model_fields.get(str(part))
        inner = getattr(field, "annotation", None) if field is not None else None
        nested = [
            a
            for a in (getattr(inner, "__args__", None) or (inner,))
            if isinstance(a, type) and issubclass(a, BaseModel)
        ]
        if not nested:
            return []
        model = nested[0]
    return sorted(model.model_fields)


def problems(model: type[BaseModel], e: ValidationError) -> str:
    """What `e` found, one clause per problem naming the setting:
    `max_trajectorys: unknown setting (known: …)`. Only pydantic's message is used, never the
    value given (it may be a key)."""
    parts = []
    for err in e.errors():
        loc = tuple(err.get("loc", ()))
        where = "".join(f"{x}: " if i == len(loc) - 1 else f"{x}." for i, x in enumerate(loc))
        if err.get("type") == "extra_forbidden":
            known = _known(model, loc)
            listed = f" (known: {', '.join(known)})" if known else ""
            parts.append(f"{where}unknown setting{listed}")
        else:
            msg = str(err.get("msg", "invalid"))
            parts.append(where + msg.removeprefix("Value error, "))
    return "; ".join(parts)


def check_settings(
    backend: str, model: type[BackendSettings] | None, config: Mapping[str, Any] | None
) -> BackendSettings | None:
    """`config` validated by `model` (None: the backend takes its settings as given)."""
    if model is None:
        return None
    if config is not None and not isinstance(config, Mapping):
        raise InvalidSettings(
            f"{backend} backend settings: must be a mapping of setting names to values,"
            f" not {type(config).__name__}"
        )
    try:
        return model.model_validate(dict(config or {}))
    except ValidationError as e:
        raise InvalidSettings(f"{backend} backend settings: {problems(model, e)}") from None


def settings_schema(cls: type[Predictor]) -> dict[str, Any] | None:
    """The JSON schema of a backend's settings (None for a backend that declares none)."""
    model = cls.settings_model
    return None if model is None else copy.deepcopy(_json_schema(model))


@functools.cache
def _json_schema(model: type[BaseModel]) -> dict[str, Any]:
    # pydantic builds a schema anew each time (15-20 ms a backend): GET /themisto/backends
    # lists every backend's, so they are built once per process.
    return model.model_json_schema()


def _default_text(value: Any) -> str:
    if value is None or isinstance(value, SecretStr):
        return "—"
    return f"`{json.dumps(value)}`"


def settings_table(model: type[BackendSettings], only: str = "*", exclude: str = "") -> str:
    """A Markdown table of the model's settings (name, default, what it does); `only` and
    `exclude` are comma-separated name patterns (`prompt_*`)."""

    def matches(name: str, patterns: str) -> bool:
        return any(fnmatch.fnmatchcase(name, p) for p in patterns.split(",") if p)

    # The model's own settings first, then those it shares with its bases.
    shared = {n for base in model.__mro__[1:] for n in getattr(base, "model_fields", {})}
    names = [n for n in model.model_fields if n not in shared]
    names += [n for n in model.model_fields if n in shared]
    rows = ["| setting | default | what |", "|---|---|---|"]
    for name in names:
        field = model.model_fields[name]
        if not matches(name, only) or matches(name, exclude):
            continue
        what = " ".join((field.description or "").split()).replace("|", "\\|")
        rows.append(f"| `{name}` | {_default_text(field.get_default())} | {what} |")
    return "\n".join(rows) + "\n"
