"""The secrets policy: which names and values are secret, and how everything recorded, exported
or sent to a model is scrubbed of them.

Pure (standard library only) so the kernel recorder, the server and the CLI apply the same rule.

**Names.** A name is secret when the case-insensitive pattern (default `key|token|secret|
password|passwd|credential`) is found anywhere in it: `api_key`, `GITHUB_TOKEN`, `db_password`
are secret; `monkey` is too (a false positive costs a summary, a false negative leaks a
credential).

**Values.** A value becomes known secret when it is bound to a secret name (a variable, a dict
key, an environment variable set through `os.environ`, `putenv`, `setdefault`, `update`,
`%env`), or when it has the shape of a credential wherever it appears (`sk-…`, `ghp_…`,
`AKIA…`, `xox…-`, JWTs, PEM private keys, …). Known values are then followed: scrubbed from
every source and output, and a variable whose value holds one becomes a stub.

**Persistence without plaintext.** The kernel knows the values it learnt; the server and the
exports, in other processes, only get a keyed hash of each: HMAC-SHA256 under a random key kept
in a file beside the store (`<store>.key`, mode 0600), truncated to 128 bits, with the value's
length. The store alone confirms no guess (without the key a hash says nothing); with the key,
a text is scrubbed by hashing its candidate substrings of the recorded lengths — those with no
letter or digit just before or after them — and replacing the ones whose hash is recorded
(`DigestMatcher`).
"""

from __future__ import annotations

import ast
import hmac
import json
import os
import pickletools
import re
import secrets as _random
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import fields, is_dataclass, replace
from functools import lru_cache, partial
from itertools import islice
from pathlib import Path
from typing import Any

# Words that name a credential on their own, and "key"/"token" only behind a word that makes them
# one (`api_key`, `GITHUB_TOKEN`, `x-api-key`): a bare `key` is a loop variable or a sort key, and
# its value ("sepal_length") would otherwise be followed and scrubbed from every cell.
DEFAULT_SECRET_PATTERN = (
    r"passw(?:or)?d|passphrase|secret|credential"
    r"|(?:api|access|private|auth|client|signing|encryption|master|license|ssh|gpg|pgp|aws|gcp"
    r"|azure|stripe|openai|anthropic|github|gitlab|slack|service|consumer|subscription|hf|session"
    r"|fernet|jwt|hmac)[_-]?keys?(?![a-z])"
    r"|(?:access|auth|api|bearer|refresh|session|oauth|github|gh|gitlab|hf|hub|huggingface|slack"
    r"|discord|telegram|bot|jwt|csrf|personal|openai|anthropic|jupyterhub|npm|pypi|twitter|id)"
    r"[_-]?tokens?(?![a-z])"
)
# Environment variables are named by convention (`SERVICE_TOKEN`, `STRIPE_KEY`, `MYSQL_PWD`,
# `DB_PASS`): with the default pattern, their names (in the environment and where a cell sets
# one) match these wider words; `PWD`, `OLDPWD` and `PASSENGERS` do not.
ENV_SECRET_PATTERN = r"key|token|secret|passw|passphrase|credential|[_-](?:pass|pwd)(?![a-z])"
REDACTED = "<redacted>"
REDACTED_REASON = "redacted: the name matches the secret pattern"
SECRET_VALUE_REASON = "redacted: holds a secret value"
# Values shorter than this are not followed: "x" or "1" would erase half an output.
MIN_SECRET_VALUE_LEN = 6
# Longer values bound to a secret name are still stubs, but not followed through text.
MAX_SECRET_VALUE_LEN = 64 * 1024
# A dict walk for values under secret-named keys looks at most this many entries per cell.
_MAX_DICT_ENTRIES = 5000
# ... through dicts, and lists and tuples of them (records: `[{"user": …, "password": …}]`),
# nested at most this deep.
_NESTED_SET = {dict, list, tuple}
_MAX_NESTING = 16
_RECORDS_PROBED = 8
# The output text scanned per output beyond the recorder's own cut (a secret straddling it).
_SCAN_MARGIN = 4096

# Credentials recognisable by their shape alone, wherever they appear: (pattern, the letters
# one of which stands just before a match, whether that letter belongs to the credential). Each
# pattern opens with a literal, so the regex engine skips ahead to it (a 64 KB output is scanned
# in about a millisecond); a match counts where no letter, digit or underscore precedes it.
_TOKEN_SCANS: dict[str, list[tuple[str, str, bool]]] = {
    "OpenAI / Anthropic / DeepSeek key": [(r"sk-(?:[A-Za-z0-9]+-)*[A-Za-z0-9_-]{20,}", "", True)],
    "Stripe key": [(r"k_(?:live|test)_[A-Za-z0-9]{16,}", "rsp", True)],
    "GitHub token": [
        (r"gh[pousr]_[A-Za-z0-9]{30,}", "", True),
        (r"github_pat_[A-Za-z0-9_]{30,}", "", True),
    ],
    "GitLab token": [(r"glpat-[A-Za-z0-9_-]{20,}", "", True)],
    "AWS access key id": [
        (f"{p}[0-9A-Z]{{16}}(?![0-9A-Za-z])", "", True)
        for p in ("AKIA", "ASIA", "AGPA", "AIDA", "AROA")
    ],
    "Slack token": [(r"xox[abposr]-[A-Za-z0-9-]{10,}", "", True)],
    "Google API key": [(r"AIza[0-9A-Za-z_-]{35}", "", True)],
    "Hugging Face token": [(r"hf_[A-Za-z0-9]{30,}", "", True)],
    "JSON Web Token": [
        (r"eyJ[A-Za-z0-9_-]{8,}\.eyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}", "", True)
    ],
    "PEM private key": [
        (r"-----BEGIN [A-Z ]*PRIVATE KEY-----[\s\S]*?-----END [A-Z ]*PRIVATE KEY-----", "", True)
    ],
    # The token after "Bearer " (the word itself stays).
    "bearer token": [(r"earer [A-Za-z0-9._~+/-]{20,}=*", "Bb", False)],
}
TOKEN_PATTERNS = {name: [p for p, _, _ in scans] for name, scans in _TOKEN_SCANS.items()}
_TOKENS = [
    (re.compile(p), lead, keep) for scans in _TOKEN_SCANS.values() for p, lead, keep in scans
]
_TOKENS_BYTES = [
    (re.compile(p.encode()), lead.encode())
    for scans in _TOKEN_SCANS.values()
    for p, lead, _ in scans
]
_BEARER_WORD = len("earer ")


def _token_spans(text: str) -> list[tuple[int, int]]:
    """Where credential-shaped strings are in `text` (starting at a word boundary)."""
    spans = []
    for regex, lead, keep in _TOKENS:
        for m in regex.finditer(text):
            i = m.start()
            if lead:
                if i == 0 or text[i - 1] not in lead:
                    continue
                i -= 1
            if i and (text[i - 1].isalnum() or text[i - 1] == "_"):
                continue
            spans.append((i if keep else m.start() + _BEARER_WORD, m.end()))
    return spans


def _bytes_hold_token(data: bytes) -> bool:
    for regex, lead in _TOKENS_BYTES:
        for m in regex.finditer(data):
            i = m.start()
            if lead:
                if i == 0 or data[i - 1] not in lead:
                    continue
                i -= 1
            if i == 0 or not (chr(data[i - 1]).isalnum() or data[i - 1] == 0x5F):
                return True
    return False


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
    return stub_variable(out, REDACTED_REASON)


def stub_variable(record: Mapping[str, Any], reason: str) -> dict[str, Any]:
    """The record as a secret stub: name and type only, with `reason`."""
    out = dict(record)
    out.update(size=None, summary={"redacted": True}, blob_hash=None, fingerprint=None)
    out["stub_reason"] = reason
    return out


# -- literals in code and text ----------------------------------------------------------------

# A Python string literal: triple-quoted (may span lines) or single-line (escapes honoured).
_LITERAL = (
    r"(?P<prefix>[rRbBuUfF]{0,2})"
    r"(?:(?P<q3>'''|\"\"\")(?P<body3>[\s\S]*?)(?P=q3)"
    r"|(?P<q1>['\"])(?P<body1>(?:\\.|(?!(?P=q1))[^\\\n])*)(?P=q1))"
)
# What binds a literal to a name: the name is matched against the secret pattern.
_BINDINGS = [
    # `NAME = "…"`, `NAME: str = '…'`, `f(NAME="…")`, `(NAME := "…")`, `obj.NAME = "…"`.
    # The annotation's words are separated by single runs of blanks, so that no run of spaces
    # can be split two ways (an output with `key:` and a long row of spaces stays linear).
    re.compile(
        r"(?P<lhs>\b(?P<name>[A-Za-z_][\w.]*)[ \t]*"
        r"(?::[ \t]*[\w\[\].,|]+(?:[ \t]+[\w\[\].,|]+)*[ \t]*)?:?=(?!=)[ \t]*)" + _LITERAL
    ),
    # `"NAME": "…"` in a dict display, JSON or a dict's repr
    re.compile(r"(?P<lhs>(?P<q>['\"])(?P<name>[^'\"\n]{1,200})(?P=q)\s*:\s*)" + _LITERAL),
    # `x["NAME"] = "…"` (os.environ, a config dict, a DataFrame cell)
    re.compile(
        r"(?P<lhs>\[\s*(?P<q>['\"])(?P<name>[^'\"\n]{1,200})(?P=q)\s*\]\s*=(?!=)\s*)" + _LITERAL
    ),
    # `putenv("NAME", "…")`, `environ.setdefault("NAME", "…")`, `("NAME", "…")` pairs
    re.compile(r"(?P<lhs>[(,\[]\s*(?P<q>['\"])(?P<name>[^'\"\n]{1,200})(?P=q)\s*,\s*)" + _LITERAL),
]
# `%env NAME=value`, `%set_env NAME value`, `!export NAME=value`: unquoted values
_SHELL_BINDING = re.compile(
    r"(?P<lhs>(?:%env|%set_env|\bexport)\s+(?P<name>[A-Za-z_]\w*)(?:\s*=\s*|\s+))"
    r"(?P<body>'[^'\n]*'|\"[^\"\n]*\"|[^\s'\"]+)"
)


def _literal_values(m: re.Match[str]) -> list[str]:
    """The value(s) of the literal matched by `m`: as written, and as Python reads it."""
    body = m.group("body3") if m.group("q3") else m.group("body1")
    quote = m.group("q3") or m.group("q1")
    prefix = m.group("prefix")
    values = [body]
    if "f" not in prefix.lower():
        try:
            parsed = ast.literal_eval(f"{prefix}{quote}{body}{quote}")
            text = parsed.decode("utf-8", "replace") if isinstance(parsed, bytes) else parsed
            if isinstance(text, str) and text != body:
                values.append(text)
        except (ValueError, SyntaxError, MemoryError, RecursionError):
            pass
    return values


# A line that may unpack literals into names: `user, password = "bob", "…"`, `(a, b) = …`,
# `[a, b] = …`.
_UNPACKING = re.compile(r"(?m)^[ \t]*[(\[]?[ \t]*[A-Za-z_][\w.]*[ \t]*,[^=\n]*=(?!=)[^\n]*$")
# What stands before a name that is one of several targets (`user, ` of `user, password = …`).
_TARGETS_BEFORE = re.compile(r"[ \t]*[(\[]?[ \t]*(?:[A-Za-z_][\w.]*[ \t]*,[ \t]*)+")
_QUOTE_START = re.compile(r"[rRbBuUfF]*('''|\"\"\"|'|\")")


def _unpacked(line: str) -> list[tuple[str, str, int, int]]:
    """(target name, value, start, end) of each string literal a line unpacks into a name
    (`user, password = "bob", "…"`); none when the line is not such a statement."""
    stripped = line.lstrip()
    try:
        tree = ast.parse(stripped)
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return []
    node = tree.body[0] if len(tree.body) == 1 else None
    if not isinstance(node, ast.Assign) or not isinstance(node.value, (ast.Tuple, ast.List)):
        return []
    raw, indent = stripped.encode(), len(line) - len(stripped)
    out = []
    for target in node.targets:
        if not isinstance(target, (ast.Tuple, ast.List)):
            continue
        for t, v in zip(target.elts, node.value.elts, strict=False):
            name = t.id if isinstance(t, ast.Name) else getattr(t, "attr", "")
            if name and isinstance(v, ast.Constant) and isinstance(v.value, (str, bytes)):
                # (offsets are in UTF-8 bytes)
                start = indent + len(raw[: v.col_offset].decode("utf-8", "replace"))
                end = indent + len(raw[: v.end_col_offset or 0].decode("utf-8", "replace"))
                value = v.value
                text = value.decode("utf-8", "replace") if isinstance(value, bytes) else value
                out.append((name, text, start, end))
    return out


def redact_literals(text: str, pattern: str | None = None, found: list[str] | None = None) -> str:
    """`text` with string literals bound to secret names replaced by "<redacted>".

    Catches the common ways a credential is pasted into a cell or shown in an output
    (`API_KEY = "sk-…"`, `token: str = '…'`, `{"password": "…"}`, `f(api_key="…")`,
    `os.environ["OPENAI_API_KEY"] = "…"`, `os.putenv("TOKEN", "…")`, `%env TOKEN=…`). The
    values are appended to `found` (as written and as Python reads them).
    """
    regex = compile_pattern(pattern)
    env_pattern = env_secret_pattern(pattern)
    env_regex = compile_pattern(env_pattern)
    if not _may_name_secret(text, env_pattern, env_regex):
        return text

    def secret_name(m: re.Match[str]) -> bool:
        name = m.group("name")
        if regex.search(name):
            return True
        # `os.environ["NAME"] = …`, `putenv("NAME", …)`, `environ.setdefault("NAME", …)`
        return bool(
            env_regex.search(name)
            and _ENV_BEFORE.search(m.string, max(0, m.start() - 40), m.start())
        )

    def scrub(m: re.Match[str]) -> str:
        if not secret_name(m):
            return m.group(0)
        line_start = m.string.rfind("\n", 0, m.start()) + 1
        if _TARGETS_BEFORE.fullmatch(m.string, line_start, m.start("name")):
            return m.group(0)  # one of several targets: its literal is not the next one
        quote = m.group("q3") or m.group("q1")
        if found is not None:
            found.extend(_literal_values(m))
        return f"{m.group('lhs')}{m.group('prefix')}{quote}{REDACTED}{quote}"

    def scrub_shell(m: re.Match[str]) -> str:
        if not env_regex.search(m.group("name")):
            return m.group(0)
        body = m.group("body")
        if found is not None:
            found.append(body.strip("'\""))
        return m.group("lhs") + REDACTED

    def unpack(m: re.Match[str]) -> str:
        line = m.group(0)
        for name, value, start, end in reversed(_unpacked(line)):
            if regex.search(name):
                quote = _QUOTE_START.match(line, start)
                if quote is None or "f" in line[start : quote.start(1)].lower():
                    continue  # (an f-string's value is not its text)
                if found is not None:
                    found.append(value)
                line = f"{line[:start]}{quote.group(0)}{REDACTED}{quote.group(1)}{line[end:]}"
        return line

    def bind(region: str) -> str:
        region = _UNPACKING.sub(unpack, region)
        for binding in _BINDINGS:
            region = binding.sub(scrub, region)
        return _SHELL_BINDING.sub(scrub_shell, region)

    if len(text) <= _WHOLE_TEXT:
        return bind(text)
    # A long text (an HTML table): only the lines naming a secret, and what a literal opened
    # there spans, can hold a binding.
    parts, last = [], 0
    for start, end in _regions(text, env_pattern, env_regex):
        parts += [text[last:start], bind(text[start:end])]
        last = end
    parts.append(text[last:])
    return "".join(parts)


# Texts up to this long are searched whole; longer ones around the names that match only.
_WHOLE_TEXT = 4096
_DEFAULT_WORDS = ("key", "token", "secret", "pass", "pwd", "credential")


# What stands before a binding that sets an environment variable.
_ENV_BEFORE = re.compile(
    r"(?:environ|putenv|setdefault)\s*$|environ\.update\(\s*(?:\{|dict\()?\s*$"
)


def env_secret_pattern(pattern: str | None) -> str:
    """The pattern for environment variable names: the wider words for the default pattern,
    else the person's own pattern."""
    return ENV_SECRET_PATTERN if pattern in (None, "", DEFAULT_SECRET_PATTERN) else pattern


def _may_name_secret(text: str, pattern: str | None, regex: re.Pattern[str]) -> bool:
    """False when no secret name can occur in `text` (a fast path for the default patterns)."""
    if pattern in (None, "", DEFAULT_SECRET_PATTERN, ENV_SECRET_PATTERN):
        low = text.lower()
        return any(w in low for w in _DEFAULT_WORDS)
    return regex.search(text) is not None


@lru_cache(maxsize=32)
def _lowercase_pattern(pattern: str | None) -> re.Pattern[str] | None:
    """The pattern compiled without IGNORECASE, for lowercased text, when it names no capital
    letter (the default does not): many times faster than IGNORECASE over a long text."""
    p = pattern or DEFAULT_SECRET_PATTERN
    if p != p.lower():
        return None
    try:
        return re.compile(p)
    except re.error:
        return None


def _name_matches(text: str, pattern: str | None, regex: re.Pattern[str]) -> Iterator[Any]:
    """Matches of the secret pattern in `text` (their spans index `text`)."""
    fast = _lowercase_pattern(pattern)
    if fast is not None:
        low = text.lower()
        if len(low) == len(text):  # no character whose lowercase is longer
            return fast.finditer(low)
    return regex.finditer(text)


def _secret_lines(lines: str, pattern: str | None, regex: re.Pattern[str]) -> set[str]:
    """The lines of `lines` (names, one a line) that the secret pattern matches."""
    if not lines or not _may_name_secret(lines, pattern, regex):
        return set()
    found = set()
    for m in _name_matches(lines, pattern, regex):
        start = lines.rfind("\n", 0, m.start()) + 1
        end = lines.find("\n", m.end())
        found.add(lines[start : len(lines) if end < 0 else end])
    return found


def _regions(text: str, pattern: str | None, regex: re.Pattern[str]) -> list[tuple[int, int]]:
    """Disjoint spans of `text`: each line with a secret-name match and the next one, extended
    to the close of a triple-quoted literal opened there."""
    spans: list[tuple[int, int]] = []
    for m in _name_matches(text, pattern, regex):
        start = text.rfind("\n", 0, m.start()) + 1
        end = text.find("\n", m.end())
        end = len(text) if end < 0 else text.find("\n", end + 1)
        end = len(text) if end < 0 else end
        for q in ('"""', "'''"):
            opened = text.find(q, m.end(), end)
            if opened >= 0:
                closed = text.find(q, opened + 3)
                if closed >= 0:
                    end = max(end, closed + 3)
        if spans and start <= spans[-1][1]:
            spans[-1] = (spans[-1][0], max(end, spans[-1][1]))
        else:
            spans.append((start, end))
    return spans


def redact_tokens(text: str, found: list[str] | None = None) -> str:
    """`text` with every credential-shaped string (TOKEN_PATTERNS) replaced by "<redacted>"."""
    spans = _token_spans(text)
    if not spans:
        return text
    spans.sort()
    parts, last = [], 0
    for i, j in spans:
        if i < last:  # overlapping shapes: the first one already covers it
            continue
        parts += [text[last:i], REDACTED]
        if found is not None:
            found.append(text[i:j])
        last = j
    parts.append(text[last:])
    return "".join(parts)


def redact_source(source: str, pattern: str | None = None) -> str:
    """Source with secret literals (see redact_literals) and credential-shaped strings
    replaced by "<redacted>". A secret computed at run time is followed by value instead."""
    return redact_tokens(redact_literals(source, pattern))


def redact_text(text: str, secrets: Iterable[str]) -> str:
    """Text with every occurrence of the given secret values replaced by "<redacted>"."""
    for value in sorted(set(secrets), key=len, reverse=True):
        if len(value) >= MIN_SECRET_VALUE_LEN and value in text:
            text = text.replace(value, REDACTED)
    return text


def scrub_json(
    obj: Any,
    scrub: Callable[[str], str],
    secret_key: Callable[[str], Any] | None = None,
    _depth: int = 0,
) -> Any:
    """A copy of a JSON-like value with `scrub` applied to every string (keys included), and
    the string under a key `secret_key` accepts (`{"password": "…"}`) replaced whole."""
    if isinstance(obj, str):
        return scrub(obj)
    if _depth > 100:
        # Deeper than any real output: checked as its JSON text, dropped whole if it holds one.
        try:
            text = json.dumps(obj, default=str)
        except (ValueError, TypeError, RecursionError):
            return REDACTED
        return obj if scrub(text) == text else REDACTED
    if isinstance(obj, Mapping):
        out = {}
        for k, v in obj.items():
            key = scrub(k) if isinstance(k, str) else k
            if isinstance(v, str) and v and isinstance(k, str) and secret_key and secret_key(k):
                out[key] = REDACTED
            else:
                out[key] = scrub_json(v, scrub, secret_key, _depth + 1)
        return out
    if isinstance(obj, (list, tuple)):
        return [scrub_json(v, scrub, secret_key, _depth + 1) for v in obj]
    return obj


# -- the keyed hashes -------------------------------------------------------------------------

KEY_BYTES = 32
DIGEST_BYTES = 16


def key_path(store_path: str | os.PathLike[str]) -> Path:
    """Where the key of a store's secret digests lives: `<store>.key`, beside it."""
    p = Path(store_path)
    return p.with_name(p.name + ".key")


def load_key(store_path: str | os.PathLike[str], *, create: bool = True) -> bytes | None:
    """The store's digest key, created (0600, atomically) when missing and `create` (else None
    when it is missing, damaged or unreadable)."""
    path = key_path(store_path)
    try:
        data = path.read_bytes()
        if len(data) == KEY_BYTES:
            return data
    except FileNotFoundError:
        pass
    except OSError:
        if not create:
            return None  # (unreadable: to a reader, as good as missing)
        raise
    if not create:
        return None
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{_random.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(_random.token_bytes(KEY_BYTES))
        try:
            # link() never replaces: two processes creating the key at once agree on one.
            os.link(tmp, path)
        except FileExistsError:
            pass
    finally:
        tmp.unlink(missing_ok=True)
    data = path.read_bytes()
    if len(data) != KEY_BYTES:
        raise ValueError(f"{path} is not a secrets key ({len(data)} bytes, expected {KEY_BYTES})")
    return data


def secret_digest(key: bytes, value: str) -> str:
    """The keyed hash recorded for a secret value."""
    mac = hmac.digest(key, value.encode("utf-8", "surrogatepass"), "sha256")
    return mac[:DIGEST_BYTES].hex()


# Recorded beside the values' hashes, with length 0 (no text is searched for one): the keys the
# store's hashes were made with, so that a key replaced or lost can be told.
_KEY_CHECK = "jupyter-themisto: the key these hashes were made with"


def key_check(key: bytes) -> tuple[str, int, bool]:
    """The row that marks `key` as one the store's hashes were made with."""
    return (secret_digest(key, _KEY_CHECK), 0, False)


def key_problem(
    store_path: str | os.PathLike[str], key: bytes | None, digests: list[tuple[str, int, bool]]
) -> str | None:
    """Why some of the values a store holds as keyed hashes (its `digests`) cannot be followed
    with `key` (the key beside it; None when it is missing or damaged), or None when all can.
    A store written before the key was marked tells only a missing key."""
    values = sum(length >= MIN_SECRET_VALUE_LEN for _, length, _ in digests)
    if not values:
        return None
    path = key_path(store_path)
    if key is None:
        hashes = "1 keyed hash" if values == 1 else f"the {values} keyed hashes"
        return (
            f"its key {path} is missing or damaged, so {hashes} of values the kernels knew to"
            " be secret cannot be followed"
        )
    marks = {digest for digest, length, _ in digests if length == 0}
    if marks - {key_check(key)[0]}:
        return (
            f"some of its keyed hashes of values the kernels knew to be secret were made with"
            f" another key than {path} (it was replaced), so those values cannot be followed"
        )
    return None


# A recorded value is looked for where it stands apart: the characters just before and just
# after it are not letters or digits (or it starts or ends the text).
_DELIMITER = re.compile(r"[^A-Za-z0-9]")
# A terminal's colour or style sequence (`\x1b[31m`): its last letter stands apart too.
_ANSI = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]")
_RUN = re.compile(r"\S+")


class DigestMatcher:
    """Finds, in a text, the secret values whose keyed hashes are recorded (see the module's
    docstring): candidates are the substrings of a recorded length with no letter or digit
    just before or just after them (and no whitespace, unless a recorded value holds some)."""

    def __init__(self, key: bytes, digests: Iterable[tuple[str, int, bool]]) -> None:
        self.key = key
        self.digests: set[str] = set()
        compact: set[int] = set()
        spaced: set[int] = set()
        for digest, length, has_space in digests:
            if length < MIN_SECRET_VALUE_LEN:
                continue
            self.digests.add(digest)
            (spaced if has_space else compact).add(length)
        # length -> whether a value of that length may hold whitespace
        self.lengths = {n: n in spaced for n in sorted(compact | spaced)}
        self._shortest = min(self.lengths, default=0)
        # hash() of windows known not to be secret: an int each, however long the window.
        self._clean: set[int] = set()

    def __bool__(self) -> bool:
        return bool(self.digests)

    def _is_secret(self, window: str) -> bool:
        h = hash(window)
        if h in self._clean:
            return False
        if secret_digest(self.key, window) in self.digests:
            return True
        if len(self._clean) > 200_000:
            self._clean.clear()
        self._clean.add(h)
        return False

    def find(self, text: str) -> set[str]:
        """The recorded secret values that occur in `text`."""
        if not self.digests or len(text) < self._shortest:
            return set()
        windows: set[str] = set()
        compact = [n for n, spaced in self.lengths.items() if not spaced]
        if compact:
            # A value without whitespace lies within one run of non-space characters.
            for run in _RUN.finditer(text):
                start, end = run.span()
                if end - start >= compact[0]:
                    self._windows(text, start, end, compact, windows)
        spaced = [n for n, spaced in self.lengths.items() if spaced]
        if spaced:
            self._windows(text, 0, len(text), spaced, windows)
        return {w for w in windows if w.strip() == w and self._is_secret(w)}

    @staticmethod
    def _windows(text: str, start: int, end: int, lengths: list[int], out: set[str]) -> None:
        """The substrings of text[start:end] of the given lengths with no letter or digit
        just before or just after them: between two such edges, n + 1 apart."""
        edges = [start - 1, *(m.start() for m in _DELIMITER.finditer(text, start, end)), end]
        if "\x1b" in text:
            edges += [m.end() - 1 for m in _ANSI.finditer(text, start, end)]
        edge_set = set(edges)
        for n in lengths:
            if n > end - start:
                break
            for before in edge_set.intersection([e - n - 1 for e in edges]):
                out.add(text[before + 1 : before + 1 + n])

    def scrub(self, text: str) -> str:
        for value in sorted(self.find(text), key=len, reverse=True):
            text = text.replace(value, _replacement(value))
        return text


#: items of a list, tuple or column bound to a secret name that are learnt
_SECRET_ITEMS = 100


def _secret_values(value: Any, nested: bool = True) -> list[Any]:
    """What a value bound to a secret name holds that may be printed: a string or bytes, a
    number as printed (`password = 27182818284`), the strings and numbers of a list, tuple or
    set (the first _SECRET_ITEMS). `learn` keeps those of a secret's length. Told by exact
    type (a subclass of the person's, or an `isinstance` through their `__class__`, would run
    their code in the kernel)."""
    kind = type(value)
    if kind in (str, bytes, bytearray):
        return [value]
    if kind in (int, float):
        return [repr(value)]
    if nested and kind in (list, tuple, set, frozenset):
        return [v for item in islice(value, _SECRET_ITEMS) for v in _secret_values(item, False)]
    return []


def _frame_type() -> type | None:
    """pandas' DataFrame if pandas is imported (never imported here). A frame is told by its
    type, exactly: an attribute of its class would go through a metaclass of the person's,
    `isinstance` through a `__class__` of theirs, and a subclass of theirs may override what is
    read of it."""
    frame = getattr(sys.modules.get("pandas"), "DataFrame", None)
    return frame if isinstance(frame, type) else None


def _escaped_forms(value: str) -> list[str]:
    """The value as it reads inside a repr or a JSON string (quotes, backslashes, newlines),
    and each of those escaped for HTML (a DataFrame's table, `HTML(html.escape(…))`)."""
    forms = [value]
    for escaped in (repr(value)[1:-1], json.dumps(value)[1:-1]):
        if escaped not in forms:
            forms.append(escaped)
    for form in list(forms):
        for escaped in _html_forms(form):
            if escaped not in forms:
                forms.append(escaped)
    return forms


def _html_forms(text: str) -> list[str]:
    """`text` as HTML writers escape it: pandas only & < >, `html.escape` its quotes too
    (&quot; &#x27;), markupsafe (Jinja, a Styler) as &#34; &#39;."""
    base = text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    return [
        base,
        base.replace('"', "&quot;").replace("'", "&#x27;"),
        base.replace('"', "&#34;").replace("'", "&#39;"),
    ]


# A value found HTML-escaped stands in HTML: its replacement is escaped too, so that it reads
# "<redacted>" there instead of opening an unknown tag that swallows what follows.
_HTML_REDACTED = _html_forms(REDACTED)[0]
_HTML_ENTITY = re.compile(r"&(?:amp|lt|gt|quot|#x27|#39|#34);")


def _replacement(found: str) -> str:
    """What replaces a secret form found in a text: "<redacted>", escaped if the form is."""
    return _HTML_REDACTED if _HTML_ENTITY.search(found) else REDACTED


def _has_space(value: str) -> bool:
    return any(c.isspace() for c in value)


def pickle_strings(data: bytes, *, max_ops: int = 2_000_000) -> Iterator[str]:
    """The strings a pickle holds, read without unpickling (pickletools); for a pickle that
    does not parse (or is too long to walk), its runs of printable text instead."""
    try:
        strings = []
        for n, (_op, arg, _pos) in enumerate(pickletools.genops(data)):
            if n > max_ops:
                raise ValueError("too many opcodes")
            if isinstance(arg, str):
                strings.append(arg)
            elif isinstance(arg, (bytes, bytearray)) and len(arg) >= MIN_SECRET_VALUE_LEN:
                strings.append(bytes(arg).decode("utf-8", "replace"))
        yield from strings
    except Exception:
        for m in re.finditer(rb"[^\x00-\x08\x0e-\x1f\x7f]{%d,}" % MIN_SECRET_VALUE_LEN, data):
            run = m.group().decode("utf-8", "replace")
            yield run
            # A length byte may precede a pickled string: also read the run without it.
            yield run[1:]


# -- what the kernel knows ---------------------------------------------------------------------


class KernelSecrets:
    """The secret values a kernel has learnt, in its memory only, and how it scrubs with them.

    The recorder calls `observe` after each cell (namespace, environment, source), scrubs the
    execution's source and outputs with `scrub` / `scrub_output` / `scrub_json`, asks
    `stub_reason` for each snapshot value, and calls `persist` once the execution is written:
    new values go to the store as keyed hashes, and the trajectory's earlier rows are scrubbed
    of them (an earlier output that printed a value only later known secret).
    """

    def __init__(self, pattern: str | None = None) -> None:
        self.pattern = pattern
        self.values: set[str] = set()
        self._forms: list[str] = []  # every value and its escaped forms, longest first
        self._new: list[str] = []
        self._encoded: list[bytes] = []
        #: incremented whenever a value is learnt: a snapshot taken with an older generation
        #: may hold a value now secret
        self.generation = 0
        self.matcher: DigestMatcher | None = None
        self._digest_count = -1
        self._environ: dict[Any, Any] = {}
        # The namespace's names at the last observe, and which of them the pattern matched
        # (most cells bind no new name: 900 after `from sympy import *` are not searched again).
        self._names_seen: tuple[str | None, str] = (None, "")
        self._secret_names: set[str] = set()
        #: how many bytes of each output are scanned (the recorder cuts the rest)
        self.output_limit: int | None = None
        # hash() of the texts scrub_output returned since the last scrub_json, and the
        # generation then: scrub_json does not scan them again unless a value was learnt since.
        self._scrubbed: set[int] = set()
        self._scrubbed_at = 0

    # learning ------------------------------------------------------------------------------

    def learn(self, value: Any) -> bool:
        """Take `value` (a str or bytes) as secret; True if it was not known."""
        if isinstance(value, (bytes, bytearray)):
            value = bytes(value).decode("utf-8", "replace")
        if not isinstance(value, str):
            return False
        if value.strip() != value:
            # A key read from a file ends with a newline that its printed form lacks.
            self.learn(value.strip())
        if not MIN_SECRET_VALUE_LEN <= len(value) <= MAX_SECRET_VALUE_LEN:
            return False
        if value in self.values or value in (REDACTED, _HTML_REDACTED):
            return False
        self.values.add(value)
        self._new.append(value)
        forms = set(self._forms)
        for form in _escaped_forms(value):
            forms.add(form)
        self._forms = sorted(forms, key=len, reverse=True)
        encoded = set(self._encoded)
        for form in self._forms:
            encoded.add(form.encode("utf-8", "surrogatepass"))
            encoded.add(form.encode("utf-32-le", "surrogatepass"))  # numpy's str arrays
            # (a value a person encoded: `.encode("utf-16")` is little-endian, with a BOM)
            encoded.add(form.encode("utf-16-le", "surrogatepass"))
            encoded.add(form.encode("utf-16-be", "surrogatepass"))
        self._encoded = sorted(encoded, key=len, reverse=True)
        self.generation += 1
        return True

    def learn_all(self, values: Iterable[Any]) -> None:
        for v in values:
            self.learn(v)

    def observe(self, namespace: Mapping[str, Any], source: str = "") -> None:
        """Learn the values bound to secret names in the namespace, the environment and the
        source (literals and credential-shaped strings)."""
        regex = compile_pattern(self.pattern)
        names = [n for n in namespace if isinstance(n, str) and not n.startswith("_")]
        text = "\n".join(names)
        if self._names_seen != (self.pattern, text):
            self._secret_names = _secret_lines(text, self.pattern, regex)
            self._names_seen = (self.pattern, text)
        for name in self._secret_names:
            self.learn_all(_secret_values(namespace.get(name)))
        budget = _MAX_DICT_ENTRIES
        frame = _frame_type()
        for name in names:
            value = namespace.get(name)
            kind = type(value)
            if kind in _NESTED_SET and budget > 0:
                try:
                    budget -= self._observe_nested(value, regex, budget, 0, set())[0]
                except RuntimeError:  # changed by another thread meanwhile: next cell
                    pass
            elif kind is frame:
                self._learn_columns(value, regex)
        # os.environ's own dict (bytes or str by platform) compares in C: most cells change none.
        data = getattr(os.environ, "_data", None)
        if data is None or data != self._environ:
            self._environ = dict(data) if data is not None else {}
            env_pattern = env_secret_pattern(self.pattern)
            env_names = "\n".join(os.environ)
            for name in _secret_lines(env_names, env_pattern, compile_pattern(env_pattern)):
                self.learn(os.environ.get(name))
        found: list[str] = []
        redact_tokens(redact_literals(source, self.pattern, found), found)
        self.learn_all(found)

    def _observe_nested(
        self, node: Any, regex: re.Pattern[str], budget: int, depth: int, visited: set[int]
    ) -> tuple[int, bool]:
        """Learn str values under secret-named keys of the dicts in `node` (a dict, list or
        tuple), however they nest; returns the entries looked at (at most `budget`) and whether
        a secret-named key was among them.

        A list or tuple is records of one shape: it is looked into when its first item is a
        dict, list or tuple (a list of a million numbers costs one look), and past its first
        `_RECORDS_PROBED` items only when they named a secret."""
        if id(node) in visited:
            return 0, False
        visited.add(id(node))
        if type(node) is dict:
            found = self._learn_entries(node, regex, budget)
            seen = min(len(node), budget)
            items: Iterable[Any] = node.values()
            # The value types, collected in C: most dicts hold no container.
            if depth >= _MAX_NESTING or not set(map(type, islice(items, budget))) & _NESTED_SET:
                return seen, found
        elif node and type(node[0]) in _NESTED_SET and depth < _MAX_NESTING:
            seen, found, items = 1, False, node
        else:
            return 1, False
        for i, item in enumerate(islice(items, budget)):
            if seen >= budget or type(node) is not dict and i == _RECORDS_PROBED and not found:
                break
            if type(item) in _NESTED_SET:
                more, named = self._observe_nested(item, regex, budget - seen, depth + 1, visited)
                seen += more
                found = found or named
        return seen, found

    def _learn_entries(self, d: dict[Any, Any], regex: re.Pattern[str], budget: int) -> bool:
        """Learn the str values of `d` under secret-named keys (its first `budget` entries);
        whether a key named a secret."""
        # One search over all the keys (joined in C): most dicts name no secret, cost no more.
        try:
            names = "\n".join(islice(d, budget))
        except TypeError:  # not all keys are strings
            names = "\n".join([k for k in islice(d, budget) if isinstance(k, str)])
        found = False
        if names and _may_name_secret(names, self.pattern, regex):
            for key, item in islice(d.items(), budget):
                if isinstance(key, str) and regex.search(key):
                    found = True
                    self.learn_all(_secret_values(item))
        return found

    def _learn_columns(self, frame: Any, regex: re.Pattern[str]) -> None:
        """Learn the values in a DataFrame's secret-named columns (`password`), the first
        _SECRET_ITEMS of each."""
        try:
            names = [c for c in islice(frame.columns, _MAX_DICT_ENTRIES) if isinstance(c, str)]
            # (one search over the names joined: most frames name no secret)
            if not _may_name_secret("\n".join(names), self.pattern, regex):
                return
            for column in [c for c in names if regex.search(c)][:_SECRET_ITEMS]:
                self.learn_all(_secret_values(list(frame[column].head(_SECRET_ITEMS))))
        except Exception:  # noqa: BLE001 - a frame that cannot be read so is not followed
            pass

    # scrubbing ------------------------------------------------------------------------------

    def scrub(self, text: str, *, literals: bool = False) -> str:
        """`text` without known secret values, credential-shaped strings (learnt on the way)
        and, with `literals`, literals bound to secret names (see redact_literals)."""
        if not text:
            return text
        found: list[str] = []
        if literals:
            text = redact_literals(text, self.pattern, found)
        text = redact_tokens(text, found)
        if found:
            self.learn_all(found)
        for form in self._forms:
            if form in text:
                text = text.replace(form, _replacement(form))
        if self.matcher:
            text = self.matcher.scrub(text)
        return text

    def scrub_output(self, text: str) -> str:
        """An output's text: like `scrub` with literals (a displayed `{'password': …}`), over
        the part the recorder keeps (the rest is cut after this)."""
        if not self._scrubbed:
            self._scrubbed_at = self.generation
        limit = self.output_limit
        if limit is not None and len(text) > limit + _SCAN_MARGIN:
            bound = limit + _SCAN_MARGIN
            return self.scrub(text[:bound], literals=True) + text[bound:]
        out = self.scrub(text, literals=True)
        self._scrubbed.add(hash(out))
        return out

    def scrub_json(self, obj: Any) -> Any:
        """Recorded outputs (or any JSON-like value) with every string scrubbed, and strings
        under secret-named keys replaced (not learnt: a plot's spec names many keys)."""
        regex = compile_pattern(self.pattern)
        done = self._scrubbed if self.generation == self._scrubbed_at else set()
        self._scrubbed = set()
        scrub = self.scrub if self._forms or self.matcher else redact_tokens
        return scrub_json(obj, lambda t: t if hash(t) in done else scrub(t), regex.search)

    # snapshot values ------------------------------------------------------------------------

    def text_holds_secret(self, text: str) -> bool:
        return any(form in text for form in self._forms) or bool(
            _token_spans(text) or (self.matcher and self.matcher.find(text))
        )

    def bytes_hold_secret(self, data: bytes) -> bool:
        if any(e in data for e in self._encoded) or _bytes_hold_token(data):
            return True
        if self.matcher:
            return any(self.matcher.find(s) for s in pickle_strings(data))
        return False

    def stub_reason(
        self,
        value: Any = None,
        *,
        data: bytes | None = None,
        summary: Mapping[str, Any] | None = None,
    ) -> str | None:
        """SECRET_VALUE_REASON if a variable's value, its serialized bytes or its summary hold
        a secret value, else None."""
        if isinstance(value, (str, bytes, bytearray)):
            text = bytes(value).decode("utf-8", "replace") if not isinstance(value, str) else value
            if self.text_holds_secret(text):
                return SECRET_VALUE_REASON
        if data is not None and self.bytes_hold_secret(data):
            return SECRET_VALUE_REASON
        if summary:
            try:
                text = json.dumps(summary, default=str, ensure_ascii=False)
            except (TypeError, ValueError, RecursionError):
                text = ""
            if text and self.text_holds_secret(text):
                return SECRET_VALUE_REASON
        return None

    # the store ------------------------------------------------------------------------------

    def load_digests(self, store: Any) -> None:
        """Follow the values other kernels recorded (by keyed hash) too. A store that cannot
        be read now (a damaged key file, a broken store) leaves the values followed so far
        followed; the next call tries again."""
        try:
            count = store.secret_digest_count()
            if count == self._digest_count:
                return
            if not count:
                self._digest_count = count  # (nothing to follow yet)
                return
            # (Read, not made: a key made here could follow none of the hashes recorded
            # without it. One is made when this kernel first records a hash.)
            key = load_key(store.path, create=False)
            if key is None:
                return  # (looked for again at the next execution)
            self.matcher = DigestMatcher(key, store.secret_digests())
            self._digest_count = count
        except Exception:
            pass

    def persist(self, store: Any, trajectory_id: str | None) -> int:
        """Record the newly learnt values (as keyed hashes) and scrub the trajectory's earlier
        executions and snapshots of them; returns how many values were new. The values stay
        to record until this succeeds (a locked store is tried again: the job is idempotent)."""
        new = list(self._new)
        if not new:
            return 0
        made = not key_path(store.path).exists()
        had = store.secret_digest_count() if made else 0
        key = load_key(store.path)
        assert key is not None
        rows = [key_check(key)]
        if had:
            # Hashes were recorded under a key that is gone: marked as another key's (one
            # nobody holds), so that readers tell it even where those hashes had no mark.
            rows.append((_random.token_hex(DIGEST_BYTES), 0, False))
        for value in new:
            for form in _escaped_forms(value):
                rows.append((secret_digest(key, form), len(form), _has_space(form)))
        store.add_secret_digests(rows)
        if trajectory_id is not None:
            self.rescrub(store, trajectory_id)
        del self._new[: len(new)]  # (a value learnt meanwhile stays for the next call)
        return len(new)

    def rescrub(self, store: Any, trajectory_id: str) -> None:
        """Scrub the trajectory's stored rows with what is known now (SQLite's secure_delete
        zeroes the replaced bytes; a WAL checkpoint drops the old pages)."""
        checked: dict[str, bool] = {}
        dropped: set[str] = set()
        with store.secure_rewrite() as rewrite:
            for e in store.list_executions(trajectory_id):
                source = self.scrub(e["source"])
                outputs = self.scrub_json(e["outputs"])
                if source != e["source"] or outputs != e["outputs"]:
                    rewrite.execution(e["id"], source=source, outputs=outputs)
                if e.get("snapshot_id") is None:
                    continue
                for v in store.get_variables(e["id"]):
                    if str(v.get("stub_reason") or "").startswith("redacted"):
                        continue
                    digest = v.get("blob_hash")
                    holds = self.stub_reason(summary=v.get("summary")) is not None
                    if not holds and digest:
                        if digest not in checked:
                            try:
                                checked[digest] = self.bytes_hold_secret(store.get_blob(digest))
                            except KeyError:
                                checked[digest] = False
                        holds = checked[digest]
                    if holds:
                        rewrite.variable(v["snapshot_id"], v["name"], SECRET_VALUE_REASON)
                        if digest:
                            dropped.add(digest)
            rewrite.drop_blobs(dropped)


# -- what the server and the exports know ------------------------------------------------------


# What a context's variable record becomes (StoreRedactor.scrub_context).
_Rule = Callable[[Mapping[str, Any]], Mapping[str, Any]]


class StoreRedactor:
    """Scrubs what leaves a store (API answers, exports, prediction contexts) with the
    secrets policy: literals bound to secret names, credential-shaped strings, and the values
    the kernels recorded as keyed hashes."""

    def __init__(
        self,
        store: Any,
        pattern: str | None = None,
        warn: Callable[[str], None] | None = None,
    ) -> None:
        self.store = store
        self.pattern = pattern
        # Told once why values recorded as secret cannot be followed (see key_problem).
        self.warn = warn
        self.problem: str | None = None
        self.matcher: DigestMatcher | None = None
        # (how many hashes, in which store file) when the matcher was made
        self._seen: tuple[int, int | None] = (-1, None)
        # text -> (scrubbed, the values of the secret literals in it)
        self._cache: dict[str, tuple[str, tuple[str, ...]]] = {}
        # Whether a summary holds a secret, by what identifies its value (blob, fingerprint):
        # an unchanged variable recurs in every snapshot of a trajectory.
        self._verdicts: dict[tuple[Any, ...], bool] = {}

    def refresh(self) -> None:
        """Pick up hashes recorded since the last call (cheap when there are none)."""
        try:
            # (a store file deleted and made anew, with its own key, may hold as many)
            seen = (self.store.secret_digest_count(), getattr(self.store, "file_id", None))
        except Exception:
            return
        if seen == self._seen:
            return
        key = load_key(self.store.path, create=False) if seen[0] else None
        digests = self.store.secret_digests() if seen[0] else []
        self.matcher = DigestMatcher(key, digests) if key else None
        problem = key_problem(self.store.path, key, digests)
        if problem is not None and problem != self.problem and self.warn is not None:
            self.warn(f"the trajectory store {self.store.path}: {problem}")
        self.problem = problem
        self._seen = seen
        self._cache.clear()
        self._verdicts.clear()

    def scrub_text(self, text: str, found: list[str] | None = None) -> str:
        """`text` scrubbed; the values of literals bound to secret names in it are appended to
        `found`."""
        if not text:
            return text
        cached = self._cache.get(text)
        if cached is None:
            values: list[str] = []
            out = redact_tokens(redact_literals(text, self.pattern, values))
            if self.matcher:
                out = self.matcher.scrub(out)
            cached = (out, tuple(values))
            if len(text) <= 4096:  # short texts recur (sources, small outputs): at most ~16 MB
                if len(self._cache) >= 4096:
                    self._cache.clear()
                self._cache[text] = cached
        if found is not None:
            found.extend(cached[1])
        return cached[0]

    def scrub_json(self, obj: Any) -> Any:
        return scrub_json(obj, self.scrub_text, compile_pattern(self.pattern).search)

    def scrub_texts(self, texts: list[str]) -> list[str]:
        """The texts of one document (a notebook's cells) scrubbed as a context is: a value a
        literal binds to a secret name in one of them is scrubbed from all (see scrub_context)."""
        found: list[str] = []
        out = [self.scrub_text(text, found) for text in texts]
        bound = self._bound(found)
        return [bound.scrub(text) for text in out] if bound is not None else out

    def _bound(self, found: list[str]) -> KernelSecrets | None:
        """The values of the secret literals `found` (by scrub_text) as secrets to follow
        through the rest of a context, or None when there are none worth following."""
        if not found:
            return None
        bound = KernelSecrets(self.pattern)
        bound.learn_all(found)
        return bound if bound.values else None

    def scrub_execution(self, row: Mapping[str, Any]) -> dict[str, Any]:
        """An execution row (store shape) with its source, outputs and detail scrubbed."""
        out = dict(row)
        for name in ("source", "detail"):
            if isinstance(out.get(name), str):
                out[name] = self.scrub_text(out[name])
        if "outputs" in out:
            out["outputs"] = self.scrub_json(out["outputs"])
        return out

    def scrub_variable(self, record: Mapping[str, Any]) -> dict[str, Any]:
        """A variable record: a stub if its name is secret or its summary holds a secret; its
        reason (which may quote an error's message) scrubbed."""
        out = redact_variable(record, self.pattern)
        if isinstance(out.get("stub_reason"), str):
            out["stub_reason"] = self.scrub_text(out["stub_reason"])
        summary = out.get("summary")
        if summary and not summary.get("redacted"):
            ident = (out.get("type"), out.get("blob_hash"), out.get("fingerprint"))
            holds = self._verdicts.get(ident) if ident[1] or ident[2] else None
            if holds is None:
                holds = self.scrub_json(summary) != summary
                if ident[1] or ident[2]:
                    if len(self._verdicts) > 100_000:
                        self._verdicts.clear()
                    self._verdicts[ident] = holds
            if holds:
                return stub_variable(out, SECRET_VALUE_REASON)
        return out

    def blob_holds_secret(self, data: bytes) -> bool:
        """True when a serialized value holds a credential-shaped string or a recorded value."""
        if _bytes_hold_token(data):
            return True
        if self.matcher:
            return any(self.matcher.find(s) for s in pickle_strings(data))
        return False

    def scrub_context(self, ctx: Any) -> Any:
        """A prediction context (jupyter_themisto.context.PredictionContext) safe to hand to any
        backend: every text in it scrubbed — cells and their outputs, the target cell, and any
        text field a later version adds — and a variable whose summary holds a secret reduced
        to its name and type.

        A value that a literal binds to a secret name anywhere in it (`api_key = "…"` in a
        cell above) is scrubbed from all of it (`print("…")` typed below), as the kernel does
        once that cell has run: the request may come before the kernel's keyed hash of it
        reaches the store (the cell not run yet, or the store locked by another process)."""
        self.refresh()
        found: list[str] = []
        out = self._scrub_dataclass(ctx, partial(self.scrub_text, found=found), self.scrub_variable)
        bound = self._bound(found)
        if bound is None:
            return out

        def variable(record: Mapping[str, Any]) -> Mapping[str, Any]:
            summary = record.get("summary")
            if summary and not summary.get("redacted") and bound.scrub_json(summary) != summary:
                return stub_variable(record, SECRET_VALUE_REASON)
            return record

        return self._scrub_dataclass(out, bound.scrub, variable)

    def _scrub_dataclass(self, obj: Any, scrub: Callable[[str], str], variable: _Rule) -> Any:
        names = {f.name for f in fields(obj)}
        if {"name", "type", "summary"} <= names:  # a variable as the runtime summary shows it
            record = variable({"name": obj.name, "type": obj.type, "summary": obj.summary})
            return replace(obj, summary=record["summary"])
        changes = {name: self._scrub_value(getattr(obj, name), scrub, variable) for name in names}
        return replace(obj, **changes)

    def _scrub_value(self, value: Any, scrub: Callable[[str], str], variable: _Rule) -> Any:
        if isinstance(value, str):
            return scrub(value)
        if is_dataclass(value) and not isinstance(value, type):
            return self._scrub_dataclass(value, scrub, variable)
        if isinstance(value, (list, tuple)):
            return type(value)(self._scrub_value(v, scrub, variable) for v in value)
        if isinstance(value, dict):
            return scrub_json(value, scrub, compile_pattern(self.pattern).search)
        return value

    def scrub_export_row(self, row: Mapping[str, Any]) -> dict[str, Any]:
        """An export row (an execution with `source`, `outputs`, `output_text`, `variables`)."""
        out = self.scrub_execution(row)
        for name in ("output_text", "snapshot_detail"):
            if isinstance(out.get(name), str):
                out[name] = self.scrub_text(out[name])
        variables = out.get("variables")
        if isinstance(variables, list):
            out["variables"] = [
                self.scrub_variable(v) if isinstance(v, Mapping) else v for v in variables
            ]
        return out


def redact_export_row(row: Mapping[str, Any], pattern: str | None = None) -> dict[str, Any]:
    """An export row (an execution with optional `source` and `variables`) made safe to share,
    by name and shape only (StoreRedactor.scrub_export_row also follows recorded values)."""
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


__all__ = [
    "DEFAULT_SECRET_PATTERN",
    "ENV_SECRET_PATTERN",
    "REDACTED",
    "REDACTED_REASON",
    "SECRET_VALUE_REASON",
    "TOKEN_PATTERNS",
    "DigestMatcher",
    "KernelSecrets",
    "StoreRedactor",
    "compile_pattern",
    "env_secret_pattern",
    "is_secret_name",
    "key_path",
    "key_problem",
    "load_key",
    "pickle_strings",
    "redact_export_row",
    "redact_literals",
    "redact_source",
    "redact_text",
    "redact_tokens",
    "redact_variable",
    "scrub_json",
    "secret_digest",
    "stub_variable",
]
