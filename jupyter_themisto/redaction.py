"""The secrets policy: which names are secret, and how records and exports are redacted.

Pure (standard library only) so the kernel recorder, the server and the CLI apply the same rule.
A name is secret when the case-insensitive pattern (default `key|token|secret|password|passwd|
credential`) is found anywhere in it: `api_key`, `GITHUB_TOKEN`, `db_password` are secret;
`monkey` is too (a false positive costs a summary, a false negative leaks a credential).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from functools import lru_cache
from typing import Any

DEFAULT_SECRET_PATTERN = r"key|token|secret|password|passwd|credential"
REDACTED = "<redacted>"
REDACTED_REASON = "redacted: the name matches the secret pattern"
# Values shorter than this are not scrubbed from text: "x" or "1" would erase half an output.
MIN_SECRET_VALUE_LEN = 6


@lru_cache(maxsize=32)
def compile_pattern(pattern: str | None = None) -> re.Pattern[str]:
    """The compiled, case-insensitive secret pattern (ValueError for an invalid one)."""
    try:
        return re.compile(pattern or DEFAULT_SECRET_PATTERN, re.IGNORECASE)
    except re.error as e:
        raise ValueError(f"invalid secret pattern {pattern!r}: {e}") from e


def is_secret_name(name: str, pattern: str | None = None) -> bool:
    """True when a variable (or dict key) name matches the secret pattern."""
    return bool(compile_pattern(pattern).search(name))


def redact_variable(record: Mapping[str, Any], pattern: str | None = None) -> dict[str, Any]:
    """A variable record with no value, repr or fingerprint if its name is secret.

    The record has the store's `variables` shape (name, type, size, summary, blob_hash,
    fingerprint, stub_reason). A secret keeps its name and type only: a fingerprint of the
    value would let anyone confirm a guessed secret.
    """
    out = dict(record)
    if not is_secret_name(str(out.get("name", "")), pattern):
        return out
    out.update(
        size=None,
        summary={"redacted": True},
        blob_hash=None,
        fingerprint=None,
        stub_reason=REDACTED_REASON,
    )
    return out


# `NAME = "literal"` / `NAME: str = 'literal'` with NAME secret; the literal is replaced.
_ASSIGNMENT = re.compile(
    r"""(?P<lhs>\b(?P<name>[A-Za-z_][\w.]*)\s*(?::\s*[\w\[\], .|]+)?\s*=\s*)"""
    r"""(?P<prefix>[rRbBuUfF]{0,2})(?P<quote>'''|\"\"\"|'|")(?P<body>.*?)(?P=quote)""",
    re.DOTALL,
)
# `"api_key": "literal"` inside a dict display, and `key="literal"` as a keyword argument.
_MAPPING = re.compile(
    r"""(?P<lhs>(?P<q>['"])(?P<name>[^'"\n]+)(?P=q)\s*:\s*)"""
    r"""(?P<prefix>[rRbBuUfF]{0,2})(?P<quote>'''|\"\"\"|'|")(?P<body>.*?)(?P=quote)""",
    re.DOTALL,
)


def redact_source(source: str, pattern: str | None = None) -> str:
    """Source with string literals assigned to secret names replaced by "<redacted>".

    Catches the common ways a credential is pasted into a cell (`API_KEY = "sk-..."`,
    `token: str = '...'`, `{"password": "..."}`, `f(api_key="...")`); a secret computed at
    run time is handled by the snapshot, not here.
    """
    regex = compile_pattern(pattern)

    def scrub(m: re.Match[str]) -> str:
        if not regex.search(m.group("name")):
            return m.group(0)
        return f"{m.group('lhs')}{m.group('prefix')}{m.group('quote')}{REDACTED}{m.group('quote')}"

    return _MAPPING.sub(scrub, _ASSIGNMENT.sub(scrub, source))


def redact_text(text: str, secrets: Iterable[str]) -> str:
    """Text with every occurrence of the given secret values replaced by "<redacted>"."""
    for value in sorted(set(secrets), key=len, reverse=True):
        if len(value) >= MIN_SECRET_VALUE_LEN and value in text:
            text = text.replace(value, REDACTED)
    return text


def redact_export_row(row: Mapping[str, Any], pattern: str | None = None) -> dict[str, Any]:
    """An export row (an execution with optional `source` and `variables`) made safe to share."""
    out = dict(row)
    if isinstance(out.get("source"), str):
        out["source"] = redact_source(out["source"], pattern)
    variables = out.get("variables")
    if isinstance(variables, list):
        out["variables"] = [
            redact_variable(v, pattern) if isinstance(v, Mapping) else v for v in variables
        ]
    elif isinstance(variables, Mapping):
        out["variables"] = {
            k: (redact_variable({"name": k, **v}, pattern) if isinstance(v, Mapping) else v)
            for k, v in variables.items()
        }
    return out
