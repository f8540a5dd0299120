"""One namespace snapshot written to the store: each variable's record and the snapshot's status.

Per variable, in this order:

1. a name matching the secret pattern, a dict holding a secret-named key (one level deep), or
   a value, serialized bytes or summary holding a value known secret (jupyter_themisto.
   redaction.KernelSecrets: `x = api_key`, a list or DataFrame holding it)
   -> stub with the type only (no value, repr, fingerprint);
1b. a function or class of an installed library, identical to its module's attribute
   (references.library_reference: `from sympy import *`) -> its reference in the summary
   (module:qualname, version, check), no blob;
2. objects that must not or cannot be pickled (pickling.refusal) -> stub (type, short repr,
   reason);
3. a cheap fingerprint (variables.fingerprint) equal to the previous snapshot's -> the previous
   blob is reused without serializing (`changed = false`);
4. an estimated size over `max_variable_bytes` -> summarized only ("too large");
5. pickling.serialize: pickle protocol 5, then dill, with a size and a time bound;
6. the bytes go to the blob store under their sha256 (stored once however many steps reuse
   them); `changed` says whether the hash differs from the previous snapshot's.

5b. a variable without a cheap fingerprint that could not be serialized last time (too slow,
   too large, refused) and whose identity fingerprint (type, id, size, attributes' identities)
   is unchanged -> the previous stub again, not tried again (`changed = false`);
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .. import _clock as time
from ..redaction import REDACTED_REASON, KernelSecrets, is_secret_name, stub_variable
from ..references import library_reference
from .pickling import (
    NotInKernel,
    Refused,
    TooLarge,
    TooSlow,
    interrupt_watch,
    refusal,
    serialize,
    small_value,
    time_limit,
)
from .variables import (
    SMALL_CONTAINER,
    estimated_size,
    fingerprint,
    identity_fingerprint,
    remembered,
    summarize,
    type_name,
    xxh3,
)


def _secret_key_in(value: Any, pattern: str | None) -> str | None:
    """A secret-named string key of a mapping (one level deep: `{"db": {"password": ..}}`)."""
    if not isinstance(value, dict) or len(value) > 10 * SMALL_CONTAINER:
        return None
    for key, item in value.items():
        if isinstance(key, str) and is_secret_name(key, pattern):
            return key
        if isinstance(item, dict) and len(item) <= SMALL_CONTAINER:
            for sub in item:
                if isinstance(sub, str) and is_secret_name(sub, pattern):
                    return f"{key}.{sub}"
    return None


def snapshot_status(records: list[dict[str, Any]]) -> str:
    """`ok` when every variable has its value stored (a blob or a library reference) or was
    redacted, else `partial`."""
    complete = all(
        r.get("blob_hash")
        or (r.get("summary") or {}).get("ref")
        or str(r.get("stub_reason") or "").startswith("redacted")
        for r in records
    )
    return "ok" if complete else "partial"


# Bytes the kernel serializes of one variable itself (small_snapshot.py); larger: a child.
_KERNEL_BYTES = 4 << 20


class SnapshotWriter:
    """Serializes one namespace into the store (used in the fork child and in inline mode)."""

    def __init__(
        self,
        store: Any,
        trajectory_id: str,
        *,
        secret_pattern: str | None,
        max_variable_bytes: int,
        max_variable_seconds: float,
        max_repr_chars: int,
        secrets: KernelSecrets | None = None,
        recheck: bool = False,
        put_blob: Callable[[bytes], str] | None = None,
        strict: bool = False,
    ) -> None:
        self.store = store
        # The kernel's own snapshot (small_snapshot.py): NotInKernel, not a stub, for what a
        # child must serialize (of the person's, too large or too slow for the kernel).
        self.strict = strict
        # Where serialized values go (the store; a snapshot the kernel takes itself collects
        # them first and writes them with its rows).
        self.put_blob = put_blob or store.put_blob
        self.secrets = secrets
        # Values learnt secret since the last snapshot: nothing is reused unseen.
        self.recheck = recheck
        self.trajectory_id = trajectory_id
        self.secret_pattern = secret_pattern
        self.max_variable_bytes = max_variable_bytes
        self.max_variable_seconds = max_variable_seconds
        self.max_repr_chars = max_repr_chars

    def previous(self) -> dict[str, dict[str, Any]]:
        try:
            return {v["name"]: v for v in self.store.latest_variables(self.trajectory_id)}
        except Exception:
            return {}

    def write(
        self, execution_id: int, variables: list[tuple[str, Any]], *, mode: str
    ) -> tuple[int, str]:
        t0 = time.perf_counter()
        previous = self.previous()
        records = [self.record(name, value, previous.get(name)) for name, value in variables]
        if self.secrets is not None:
            # A reason may quote an error's message, and a message may quote a secret value.
            # (Most reasons recur: "a module", "too large: …")
            scrubbed: dict[str, str] = {}
            for rec in records:
                reason = rec.get("stub_reason")
                if reason:
                    if reason not in scrubbed:
                        scrubbed[reason] = self.secrets.scrub(reason)
                    rec["stub_reason"] = scrubbed[reason]
        status = snapshot_status(records)
        sid = self.store.write_snapshot(
            execution_id,
            records,
            status=status,
            mode=mode,
            duration=time.perf_counter() - t0,
            # A child's snapshot wins over a sweep's 'failed' (see set_snapshot_owner).
            replace_failed=mode == "fork",
        )
        return sid, status

    def _holds_secret(self, rec: dict[str, Any], **what: Any) -> bool:
        """Make `rec` a stub if the value, its bytes or its summary hold a secret value."""
        reason = self.secrets.stub_reason(**what) if self.secrets is not None else None
        if reason:
            rec.update(stub_variable(rec, reason), changed=True)
        return reason is not None

    def _serialize_strict(self, value: Any) -> tuple[bytes, str]:
        """The kernel's own pickle of `value`: NotInKernel unless every object in it is a
        builtin's, a library's or a plain instance, and it fits in _KERNEL_BYTES."""
        try:
            limit = min(self.max_variable_bytes, _KERNEL_BYTES)
            return serialize(value, max_bytes=limit, strict=True)
        except (Refused, TooLarge, RecursionError) as e:
            raise NotInKernel(type(e).__name__) from e

    def record(self, name: str, value: Any, prev: dict[str, Any] | None) -> dict[str, Any]:
        rec: dict[str, Any] = {"name": name, "type": type_name(value)}
        if is_secret_name(name, self.secret_pattern):
            rec.update(summary={"redacted": True}, stub_reason=REDACTED_REASON)
            rec["changed"] = prev is None or prev.get("type") != rec["type"]
            return rec
        secret_key = _secret_key_in(value, self.secret_pattern)
        if secret_key is not None:
            rec.update(
                summary={"redacted": True, "len": len(value)},
                stub_reason=f"redacted: holds the secret-named key {secret_key!r}",
            )
            rec["changed"] = prev is None or prev.get("stub_reason") != rec["stub_reason"]
            return rec
        ref = library_reference(value)
        if ref is not None:
            rec["summary"] = ref
            rec["changed"] = prev is None or prev.get("summary") != ref
            return rec
        # The kernel's own snapshot of a library's object (a sympy matrix, an estimator): its
        # pickle first, which meets every object in it before any code of it runs; only then
        # the library's code (its size, repr, hash), which may call back into what it holds
        # (pandas deep-copies a frame's attrs).
        vetted = self._serialize_strict(value) if self.strict and not small_value(value) else None
        if self._holds_secret(rec, value=value):
            return rec
        reason = refusal(value)
        if reason:
            summary = summarize(value, self.max_repr_chars)
            if self._holds_secret(rec, summary=summary):
                return rec
            rec.update(summary=summary, stub_reason=reason)
            rec["changed"] = prev is None or prev.get("summary", {}).get("repr") != summary["repr"]
            return rec
        estimate = estimated_size(value)
        if self.strict and estimate is not None and estimate > _KERNEL_BYTES:
            raise NotInKernel(f"~{estimate} bytes")  # hashing it takes a while
        fp = fingerprint(value)
        rec["fingerprint"] = fp
        # Nothing is reused unseen once a value was learnt secret since the last snapshot.
        same_type = prev is not None and prev.get("type") == rec["type"] and not self.recheck
        ident = identity_fingerprint(value) if fp is None else None
        if ident is not None and prev is not None and remembered(value, prev, self.recheck):
            # Failed last time and looks the same: remembered, not tried again.
            rec.update(
                summary=dict(prev.get("summary") or {}),
                size=prev.get("size"),
                stub_reason=prev.get("stub_reason"),
                fingerprint=ident,
                changed=False,
            )
            return rec
        if fp is not None and same_type and prev is not None and prev.get("fingerprint") == fp:
            # Unchanged by its fingerprint: reuse the previous summary and blob (or stub).
            rec.update(
                summary=dict(prev.get("summary") or {}),
                size=prev.get("size"),
                blob_hash=prev.get("blob_hash"),
                stub_reason=prev.get("stub_reason"),
                changed=False,
            )
            return rec
        summary = summarize(value, self.max_repr_chars)
        if self._holds_secret(rec, summary=summary):
            return rec
        rec["summary"] = summary
        if estimate is not None and estimate > self.max_variable_bytes:
            rec.update(
                fingerprint=fp or ident,
                size=estimate,
                stub_reason=f"too large: ~{estimate} bytes > {self.max_variable_bytes} "
                "(summarized only)",
                changed=True,
            )
            return rec
        # (Restored after the stub is made: an interrupt arriving meanwhile is a real one.)
        with interrupt_watch() as watch:
            try:
                if vetted is not None:
                    data, codec = vetted
                else:
                    with time_limit(self.max_variable_seconds):
                        data, codec = serialize(value, max_bytes=self.max_variable_bytes)
            except Refused as e:
                rec.update(stub_reason=str(e), changed=True)
                return rec
            except TooLarge as e:
                rec.update(
                    fingerprint=ident,
                    size=e.args[0] if e.args else None,
                    stub_reason=f"too large: over {self.max_variable_bytes} bytes serialized "
                    "(summarized only)",
                    changed=True,
                )
                return rec
            except TooSlow:
                if self.strict:
                    raise  # the kernel's budget: a child serializes it
                rec.update(
                    fingerprint=ident,
                    stub_reason=f"too slow: over {self.max_variable_seconds}s to serialize "
                    "(summarized only)",
                    changed=True,
                )
                return rec
            except BaseException as e:  # noqa: B036 - unpicklable: any error makes a stub
                # SystemExit, GeneratorExit, a KeyboardInterrupt raised by the value's own code
                # (its __reduce__) included; only the person pressing interrupt stops the
                # snapshot (the manager marks it failed, as it marks any snapshot that raised).
                if isinstance(e, KeyboardInterrupt) and watch.interrupted:
                    raise
                rec.update(
                    fingerprint=ident,
                    stub_reason=f"unpicklable: {type(e).__name__}: {str(e)[:200]}",
                    changed=True,
                )
                return rec
        if self._holds_secret(rec, data=data):
            return rec
        summary["codec"] = codec
        if fp is None:
            # No cheap fingerprint: the pickle's own hash spares the compression and write of
            # a value serialized to the same bytes as last time.
            fp = rec["fingerprint"] = f"pickle:{xxh3(data)}"
            if same_type and prev is not None and prev.get("fingerprint") == fp:
                rec.update(size=len(data), blob_hash=prev.get("blob_hash"), changed=False)
                if rec["blob_hash"]:
                    return rec
        digest = self.put_blob(data)
        rec.update(
            size=len(data),
            blob_hash=digest,
            changed=prev is None or prev.get("blob_hash") != digest,
        )
        return rec
