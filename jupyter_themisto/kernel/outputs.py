"""Capture one execution's outputs inside the kernel as bounded nbformat output dicts.

What is captured, and from where (ipykernel >= 7.3, IPython >= 9.1):

- `stream` (stdout/stderr): a wrapper around `sys.stdout.write` / `sys.stderr.write` installed
  for the duration of the cell. ipykernel's fd-level capture (C extensions, subprocesses
  writing to fd 1/2) and other threads' prints pass through the same `write`, so they are
  included as far as they arrived before the cell finished.
- `execute_result`: a hook on `shell.displayhook` (sees the message ipykernel sends).
- `display_data` (and `update_display_data`, recorded as display_data with
  `metadata.themisto.update = true`): a hook on `shell.display_pub`. Hooks always return the
  message unchanged: the person sees exactly what they would without the recorder.
- `error`: every traceback the shell shows during the cell, where it shows it: a wrapper around
  `shell._showtraceback` (ipykernel's sends the `error` message the frontend shows, with the
  same ename, evalue and traceback). That is the cell's own exception, and also the tracebacks
  shown by a cell that does not fail: `showtraceback()` in an `except`, a formatter that raises
  (IPython shows its traceback, then the result without that format), an error inside
  `get_ipython().run_cell(...)`. A cell that failed without its exception being shown that way
  gets it last (`error_output`): IPython's `history_manager.exceptions[execution_count]`, else
  formatted from the exception.
- `clear_output`: recorded as what the notebook keeps, as nbclient and JupyterLab apply it: the
  outputs so far vanish at once, or, with `wait=True`, just before the cell's next output
  arrives (the progress-bar pattern keeps only the last frame); a `wait=True` clear with no
  output after it in the cell clears nothing (`clear_pending` then says so, for the error
  output the recorder adds after the cell, if it adds one: it comes after the clear).

Bounds: a text value longer than `max_output_bytes` keeps its head and ends with the visible
marker `TRUNCATION_MARKER`; the execution's inline total is bounded by `max_execution_bytes`
(further outputs are replaced by one stream output saying how many were omitted). Outputs
that were cut carry `metadata.themisto.truncated = true`.

Every display_data / execute_result is recorded in its wire form: packed exactly as
jupyter_client packs the message the frontend receives (bytes as base64 — IPython's PNG/JPEG/PDF
formatters return bytes —, numpy numbers as JSON numbers, NaN/inf as their repr, non-string keys
as strings, tuples and sets as lists) and read back. An output that cannot be packed (an object
JSON cannot hold, a key collision, nesting too deep) never reached the frontend either: it is
recorded as a `text/plain` stub saying why, with the offending MIME keys and reasons in
`metadata.themisto.unrecorded`. Only that output: the execution is recorded either way.

Text is recorded as the frontend receives it: a lone surrogate (`os.listdir` gives one for each
byte of a file name that is not UTF-8) is sent by jupyter_client as the byte it stands for and
decoded by the receiver with U+FFFD in its place (see `as_sent`); stream text and the fields of
an error go through the same replacement as display data, so the store never holds a string
that cannot be encoded as UTF-8.

Binary payloads (base64 MIME values such as image/png, image/jpeg, application/pdf) larger than
`blob_threshold` bytes are stored in the trajectory store's blob table (the decoded bytes,
content-addressed) and the MIME value in the output dict is replaced by a reference::

    {"themisto_blob": "<sha256 of the decoded bytes>", "bytes": <decoded size>,
     "encoding": "base64"}

`resolve_blob_refs(output, store)` turns such an output back into a plain nbformat output
(the reference replaced by the base64 text). Payloads over `max_blob_bytes` are not stored:
the value becomes the marker string instead.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
import sys
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

TRUNCATION_MARKER = "\n[themisto: output truncated, {omitted} bytes omitted]\n"
OMITTED_MARKER = (
    "[themisto: {count} more outputs omitted ({size} bytes), over the execution bound]\n"
)
BLOB_KEY = "themisto_blob"
UNRECORDED_MARKER = "[themisto: this output was not recorded: {reason}]"

# MIME types whose values are base64 text of binary data in Jupyter messages.
_TEXT_MIME_PREFIXES = ("text/",)
_TEXT_MIMES = {"image/svg+xml", "application/javascript", "application/xml"}


# Lone surrogates that surrogateescape cannot turn back into a byte (U+DC80..U+DCFF it can).
_UNSENDABLE_SURROGATES = re.compile("[\ud800-\udc7f\udd00-\udfff]")


def as_sent(text: str) -> str:
    """`text` as the frontend receives it in a Jupyter message.

    jupyter_client's session packs a message with `.encode("utf8", errors="surrogateescape")`
    and its receivers (jupyter_client's `json_unpacker`, the browser's TextDecoder) decode with
    replacement: a surrogate U+DC80..U+DCFF is sent as the byte it stands for and arrives as
    U+FFFD (or, with the bytes beside it, as the character they spell). Any other lone
    surrogate makes the kernel's send fail (the frontend gets nothing of that message): it is
    replaced by U+FFFD here, so what is recorded can always be encoded as UTF-8.

    Cheap for text without surrogates (almost all): one encode, no copy kept.
    """
    if text.isascii():
        return text
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = _UNSENDABLE_SURROGATES.sub("\ufffd", text)
        return text.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
    return text


def is_binary_mime(mime: str) -> bool:
    """True for MIME types Jupyter transports as base64 (images, pdf, other binaries)."""
    if mime.startswith(_TEXT_MIME_PREFIXES) or mime in _TEXT_MIMES:
        return False
    if mime.endswith("+json") or mime == "application/json":
        return False
    return mime.startswith(("image/", "application/", "audio/", "video/"))


class OutputCapture:
    """Collects the outputs of the execution currently running (main thread only)."""

    def __init__(self, shell: Any) -> None:
        self.shell = shell
        self.outputs: list[dict[str, Any]] = []
        self.active = False
        # A `clear_output(wait=True)` waiting for the next output (see the module doc).
        self.clear_pending = False
        # The last exceptions whose traceback was shown (and recorded) during the cell: the
        # cell's own is shown at its end (only failing callbacks of its events after it). A
        # few only: an exception holds its frames, and their locals, alive.
        self.shown: deque[BaseException] = deque(maxlen=8)
        self._wrapped: dict[str, tuple[Any, Callable[..., Any], Callable[..., Any]]] = {}
        self._traceback_hook: tuple[Any, Callable[..., Any]] | None = None

    # -- life cycle --------------------------------------------------------------------------

    def install_hooks(self) -> None:
        """Register the display hooks (once per load; they are idle outside a cell)."""
        pub = getattr(self.shell, "display_pub", None)
        if pub is not None and hasattr(pub, "register_hook"):
            pub.register_hook(self._display_hook)
        hook = getattr(self.shell, "displayhook", None)
        if hook is not None and hasattr(hook, "register_hook"):
            hook.register_hook(self._result_hook)
        self._wrap_showtraceback()

    def remove_hooks(self) -> None:
        self.stop()
        pub = getattr(self.shell, "display_pub", None)
        if pub is not None and hasattr(pub, "unregister_hook"):
            pub.unregister_hook(self._display_hook)
        hook = getattr(self.shell, "displayhook", None)
        if hook is not None and hasattr(hook, "unregister_hook"):
            hook.unregister_hook(self._result_hook)
        if self._traceback_hook is not None:
            original, wrapper = self._traceback_hook
            self._traceback_hook = None
            # As for the streams: only if nobody wrapped on top of us since.
            if vars(self.shell).get("_showtraceback") is wrapper:
                try:
                    if original is None:
                        del self.shell._showtraceback
                    else:
                        self.shell._showtraceback = original
                except Exception:
                    pass

    def start(self) -> None:
        self.outputs = []
        self.shown.clear()
        self.clear_pending = False
        self.active = True
        for name in ("stdout", "stderr"):
            self._wrap_stream(name)

    def stop(self) -> list[dict[str, Any]]:
        """Stop capturing and return what was captured (streams merged, in order)."""
        self.active = False
        for name in list(self._wrapped):
            stream, original, wrapper = self._wrapped.pop(name)
            # Only unwrap if nobody wrapped on top of us since; otherwise our wrapper stays in
            # the chain, inert (self.active is False), rather than dropping their wrapper.
            if getattr(stream, "write", None) is wrapper:
                try:
                    stream.write = original
                except Exception:
                    pass
        return self.outputs

    # -- sources -----------------------------------------------------------------------------

    def _wrap_stream(self, name: str) -> None:
        stream = getattr(sys, name, None)
        if stream is None:
            return
        original = stream.write
        capture = self

        def write(data: Any, *args: Any, **kwargs: Any) -> Any:
            result = original(data, *args, **kwargs)
            if capture.active and data:
                try:
                    capture._add_stream(name, data)
                except Exception:
                    pass
            return result

        try:
            stream.write = write
        except Exception:
            return
        self._wrapped[name] = (stream, original, write)

    def _wrap_showtraceback(self) -> None:
        """Record each traceback the shell shows while a cell runs, as an `error` output.

        IPython's `showtraceback` / `showsyntaxerror` end in `_showtraceback(etype, evalue,
        stb)`; ipykernel's sends the frontend an `error` message of `ename = etype.__name__`,
        `evalue = str(evalue)`, `traceback = stb` (what nbclient and JupyterLab keep). Recorded
        after it returns: a traceback whose sending failed never reached the frontend either.
        """
        shell = self.shell
        original = getattr(shell, "_showtraceback", None)
        if original is None or self._traceback_hook is not None:
            return
        capture = self

        def _showtraceback(etype: Any, evalue: Any, stb: Any, *args: Any, **kwargs: Any) -> Any:
            result = original(etype, evalue, stb, *args, **kwargs)
            if capture.active:
                try:
                    capture._add_error(etype, evalue, stb)
                except Exception as e:
                    capture._lost_output(e)
            return result

        try:
            before = vars(shell).get("_showtraceback")
            shell._showtraceback = _showtraceback
        except Exception:
            return
        self._traceback_hook = (before, _showtraceback)

    def _add_error(self, etype: Any, evalue: Any, stb: Any) -> None:
        lines = stb if isinstance(stb, (list, tuple)) else [] if stb is None else [stb]
        self._add(
            {
                "output_type": "error",
                "ename": str(getattr(etype, "__name__", etype)),
                "evalue": str(evalue),
                "traceback": [str(t) for t in lines],
            }
        )
        if isinstance(evalue, BaseException):
            self.shown.append(evalue)

    def showed(self, error: BaseException | None) -> bool:
        """True if `error`'s traceback was shown, so recorded, during the cell."""
        return error is not None and any(e is error for e in self.shown)

    def _add_stream(self, name: str, data: Any) -> None:
        shell = self.shell
        # The same conditions as IPython's own tee: a display or traceback being rendered
        # writes through the stream too, but it is recorded as its own output.
        if getattr(getattr(shell, "display_pub", None), "is_publishing", False):
            return
        if getattr(getattr(shell, "displayhook", None), "is_active", False):
            return
        if getattr(shell, "showing_traceback", False):
            return
        text = data.decode("utf-8", "replace") if isinstance(data, bytes) else str(data)
        last = self.outputs[-1] if self.outputs and not self.clear_pending else None
        if last is not None and last["output_type"] == "stream" and last["name"] == name:
            last["_parts"].append(text)
        else:
            self._add({"output_type": "stream", "name": name, "_parts": [text]})

    def _add(self, out: dict[str, Any]) -> None:
        """A new output: a `clear_output(wait=True)` before it clears the outputs first."""
        if self.clear_pending:
            self.outputs.clear()
            self.clear_pending = False
        self.outputs.append(out)

    def _display_hook(self, msg: Any) -> Any:
        # Only references are kept here (no copy on the person's time): the writer thread packs
        # them into their wire form just after the reply.
        try:
            if self.active and isinstance(msg, dict):
                kind = msg.get("msg_type") or msg.get("header", {}).get("msg_type")
                content = msg.get("content") or {}
                if kind in ("display_data", "update_display_data"):
                    meta = content.get("metadata") or {}
                    if kind == "update_display_data":
                        meta = dict(meta) if isinstance(meta, dict) else {}
                        mine = meta.get("themisto")
                        meta["themisto"] = {
                            **(mine if isinstance(mine, dict) else {}),
                            "update": True,
                        }
                    out = {
                        "output_type": "display_data",
                        "data": content.get("data"),
                        "metadata": meta,
                    }
                    if kind == "update_display_data":
                        # Not an output of its own for the frontend (it changes one in place):
                        # a clear waiting for the next output still waits.
                        self.outputs.append(out)
                    else:
                        self._add(out)
                elif kind == "clear_output":
                    # Recorded as what a notebook would keep (see the module doc).
                    if content.get("wait"):
                        self.clear_pending = True
                    else:
                        self.outputs.clear()
        except Exception as e:
            self._lost_output(e)
        return msg

    def _result_hook(self, msg: Any) -> Any:
        try:
            if self.active and isinstance(msg, dict):
                content = msg.get("content") or {}
                self._add(
                    {
                        "output_type": "execute_result",
                        "execution_count": content.get("execution_count"),
                        "data": content.get("data"),
                        "metadata": content.get("metadata") or {},
                    }
                )
        except Exception as e:
            self._lost_output(e)
        return msg

    def _lost_output(self, error: BaseException) -> None:
        try:
            self._add(unrecorded_output(None, error))
        except Exception:
            pass


def drain_fd_pipes(budget: float = 0.02) -> None:
    """Give ipykernel's fd watcher threads a moment to forward bytes still in their pipes.

    Output written at fd level (subprocesses, C code) travels through a pipe read by a thread;
    bytes still in the pipe when the cell ends would be missed (and attributed to no cell).
    Waits at most `budget` seconds, only while a pipe has unread bytes.
    """
    import select

    from .. import _clock as time

    fids: list[int] = [
        f
        for f in (getattr(s, "_fid", None) for s in (sys.stdout, sys.stderr))
        if isinstance(f, int)
    ]
    if not fids:
        return
    deadline = time.monotonic() + budget
    try:
        while time.monotonic() < deadline:
            readable, _, _ = select.select(fids, [], [], 0)
            if not readable:
                return
            time.sleep(0.001)
    except (OSError, ValueError):
        return


def error_output(shell: Any, execution_count: int | None, exc: BaseException) -> dict[str, Any]:
    """The nbformat error output for an exception raised by a cell."""
    stored = None
    hm = getattr(shell, "history_manager", None)
    exceptions = getattr(hm, "exceptions", None)
    if isinstance(exceptions, dict) and execution_count is not None:
        stored = exceptions.get(execution_count)
    if isinstance(stored, dict) and "ename" in stored:
        return {
            "output_type": "error",
            "ename": str(stored.get("ename", "")),
            "evalue": str(stored.get("evalue", "")),
            "traceback": [str(t) for t in stored.get("traceback") or []],
        }
    import traceback

    return {
        "output_type": "error",
        "ename": type(exc).__name__,
        "evalue": str(exc),
        "traceback": traceback.format_exception(type(exc), exc, exc.__traceback__),
    }


def _pack(obj: Any) -> bytes:
    """The bytes jupyter_client's session sends for `obj` (its json_packer, without the
    warning its fallback emits: a warning here would reach the person's cell)."""
    from jupyter_client.jsonutil import json_clean, json_default

    try:
        text = json.dumps(obj, default=json_default, ensure_ascii=False, allow_nan=False)
        return text.encode("utf8", errors="surrogateescape")
    except (TypeError, ValueError):
        clean = json_clean(obj)
        text = json.dumps(clean, default=json_default, ensure_ascii=False, allow_nan=False)
        return text.encode("utf8", errors="surrogateescape")


def _reason(error: BaseException) -> str:
    if isinstance(error, RecursionError):
        return "nested too deeply to encode as JSON"
    return as_sent(f"{type(error).__name__}: {str(error)[:200]}")


def wire_form(out: dict[str, Any]) -> dict[str, Any]:
    """A display_data / execute_result dict as the frontend received it (see module doc).

    An output that jupyter_client cannot pack never reached the frontend either (the kernel's
    send failed the same way): it becomes a stub naming each value that could not be packed.
    """
    try:
        # Decoded as jupyter_client's json_unpacker does (a lone surrogate was packed as the
        # byte it stands for: U+FFFD, as the frontend shows it).
        wired = json.loads(_pack(out).decode("utf-8", "replace"))
        if isinstance(wired, dict):
            return wired
        raise ValueError(f"not a mapping: {type(wired).__name__}")
    except (TypeError, ValueError, RecursionError, OverflowError) as whole:
        unrecorded: dict[str, str] = {}
        data = out.get("data")
        parts = dict(data) if isinstance(data, dict) else {"data": data}
        parts["metadata"] = out.get("metadata")
        for key, value in parts.items():
            try:
                _pack(value)
            except (TypeError, ValueError, RecursionError, OverflowError) as e:
                unrecorded[as_sent(str(key))] = _reason(e)
        if not unrecorded:
            unrecorded["output"] = _reason(whole)
        reasons = "; ".join(f"{k}: {v}" for k, v in unrecorded.items())
        stub: dict[str, Any] = {
            "output_type": out.get("output_type", "display_data"),
            "data": {"text/plain": UNRECORDED_MARKER.format(reason=reasons)},
            "metadata": {"themisto": {"unrecorded": unrecorded}},
        }
        if stub["output_type"] == "execute_result":
            count = out.get("execution_count")
            stub["execution_count"] = count if isinstance(count, int) else None
        return stub


def unrecorded_output(out: Any, error: BaseException) -> dict[str, Any]:
    """The stub that stands for an output that could not be recorded at all."""
    kind = out.get("output_type") if isinstance(out, dict) else None
    reason = _reason(error)
    stub: dict[str, Any] = {
        "output_type": "display_data",
        "data": {"text/plain": UNRECORDED_MARKER.format(reason=reason)},
        "metadata": {"themisto": {"unrecorded": {as_sent(str(kind or "output")): reason}}},
    }
    return stub


def finalize_outputs(
    raw: Iterable[dict[str, Any]],
    *,
    max_output_bytes: int,
    max_execution_bytes: int,
    blob_threshold: int,
    max_blob_bytes: int,
    put_blob: Callable[[bytes], str] | None,
    scrub: Callable[[str], str] | None = None,
) -> list[dict[str, Any]]:
    """Bounded, blob-offloaded, JSON-ready output dicts from the captured ones."""
    result: list[dict[str, Any]] = []
    total = 0
    omitted_count = 0
    omitted_size = 0
    for original in raw:
        try:
            out, size, cut = _finalize_one(
                original,
                max_output_bytes=max_output_bytes,
                blob_threshold=blob_threshold,
                max_blob_bytes=max_blob_bytes,
                put_blob=put_blob,
                scrub=scrub,
            )
        except Exception as e:  # one output's trouble never costs the others
            out = unrecorded_output(original, e)
            size, cut = len(out["data"]["text/plain"]), False
        if total + size > max_execution_bytes:
            omitted_count += 1
            omitted_size += size
            continue
        if cut and out.get("output_type") in ("display_data", "execute_result"):
            # Streams have no metadata in nbformat: their marker in the text is the signal.
            meta = out.setdefault("metadata", {})
            if isinstance(meta, dict):
                meta.setdefault("themisto", {})["truncated"] = True
        total += size
        result.append(out)
    if omitted_count:
        result.append(
            {
                "output_type": "stream",
                "name": "stdout",
                "text": OMITTED_MARKER.format(count=omitted_count, size=omitted_size),
            }
        )
    return result


def _finalize_one(
    original: dict[str, Any],
    *,
    max_output_bytes: int,
    blob_threshold: int,
    max_blob_bytes: int,
    put_blob: Callable[[bytes], str] | None,
    scrub: Callable[[str], str] | None,
) -> tuple[dict[str, Any], int, bool]:
    """One output: wire form, scrubbed, bounded; returns it, its size, whether it was cut."""
    out = dict(original)
    if out.get("output_type") == "stream" and "_parts" in out:
        out["text"] = "".join(out.pop("_parts"))
    elif out.get("output_type") in ("display_data", "execute_result"):
        out = wire_form(out)
    cut = False
    if out.get("output_type") == "stream":
        text = as_sent(out["text"])
        text = scrub(text) if scrub else text
        out["text"], cut = _truncate(text, max_output_bytes)
        size = len(out["text"].encode("utf-8", "replace"))
    elif out.get("output_type") == "error":
        size = 0
        out["ename"] = as_sent(out.get("ename", ""))
        out["evalue"] = as_sent(out.get("evalue", ""))
        out["traceback"] = [as_sent(t) for t in out.get("traceback", [])]
        if scrub:
            out["evalue"] = scrub(out.get("evalue", ""))
            out["traceback"] = [scrub(t) for t in out.get("traceback", [])]
        for i, line in enumerate(out.get("traceback", [])):
            out["traceback"][i], c = _truncate(line, max_output_bytes)
            cut = cut or c
            size += len(out["traceback"][i])
    else:
        data, size, cut = _bound_bundle(
            out.get("data") or {},
            max_output_bytes=max_output_bytes,
            blob_threshold=blob_threshold,
            max_blob_bytes=max_blob_bytes,
            put_blob=put_blob,
            scrub=scrub,
        )
        out["data"] = data
    return out, size, cut


def _truncate(text: str, limit: int) -> tuple[str, bool]:
    raw = text.encode("utf-8", "replace")
    if len(raw) <= limit:
        return text, False
    head = raw[:limit].decode("utf-8", "ignore")
    return head + TRUNCATION_MARKER.format(omitted=len(raw) - limit), True


def _bound_bundle(
    data: dict[str, Any],
    *,
    max_output_bytes: int,
    blob_threshold: int,
    max_blob_bytes: int,
    put_blob: Callable[[bytes], str] | None,
    scrub: Callable[[str], str] | None,
) -> tuple[dict[str, Any], int, bool]:
    out: dict[str, Any] = {}
    size = 0
    cut = False
    for mime, value in data.items():
        if isinstance(value, str) and is_binary_mime(mime):
            encoded = len(value)
            if encoded > blob_threshold:
                ref = _offload(value, max_blob_bytes, put_blob)
                if ref is not None:
                    out[mime] = ref
                    size += 200
                    continue
                if encoded > max_blob_bytes or put_blob is None:
                    out[mime] = TRUNCATION_MARKER.format(omitted=encoded).strip()
                    cut = True
                    continue
            out[mime] = value
            size += encoded
        elif isinstance(value, str):
            text = scrub(value) if scrub else value
            out[mime], c = _truncate(text, max_output_bytes)
            cut = cut or c
            size += len(out[mime])
        else:
            # JSON values (application/json, widget state, lists...): bound by serialized size.
            try:
                encoded_json = json.dumps(value, default=str)
            except Exception:
                encoded_json = repr(value)
            if len(encoded_json) > max_output_bytes:
                out[mime] = TRUNCATION_MARKER.format(omitted=len(encoded_json)).strip()
                cut = True
                size += len(out[mime])
            else:
                out[mime] = value
                size += len(encoded_json)
    return out, size, cut


def _offload(
    value: str, max_blob_bytes: int, put_blob: Callable[[bytes], str] | None
) -> dict[str, Any] | None:
    if put_blob is None:
        return None
    compact = "".join(value.split())
    try:
        raw = base64.b64decode(compact, validate=True)
    except (binascii.Error, ValueError):
        return None
    # Only canonical base64 is offloaded: resolving the reference must give the value back
    # (a custom application/* type may carry text that merely decodes).
    if base64.b64encode(raw).decode("ascii") != compact:
        return None
    if len(raw) > max_blob_bytes:
        return None
    try:
        digest = put_blob(raw)
    except Exception:
        return None
    return {BLOB_KEY: digest, "bytes": len(raw), "encoding": "base64"}


def resolve_blob_refs(output: dict[str, Any], get_blob: Callable[[str], bytes]) -> dict[str, Any]:
    """A plain nbformat output: blob references replaced by their base64 text.

    `get_blob` is e.g. `TrajectoryStore.get_blob`. A missing blob leaves the reference as is.
    """
    data = output.get("data")
    if not isinstance(data, dict):
        return output
    out = dict(output)
    out["data"] = dict(data)
    for mime, value in data.items():
        if isinstance(value, dict) and BLOB_KEY in value:
            try:
                out["data"][mime] = base64.b64encode(get_blob(value[BLOB_KEY])).decode("ascii")
            except KeyError:
                pass
    return out
