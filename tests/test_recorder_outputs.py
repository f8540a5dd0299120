"""Every output a kernel can publish is recorded as the frontend received it, or stubbed with the
reason; the execution is recorded either way. Real kernel, IPython's own display machinery,
and a property test (hypothesis) over odd payloads handed to `publish_display_data` and
`_repr_mimebundle_`."""

from __future__ import annotations

import base64
import json
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jupyter_client.jsonutil import json_default

from jupyter_themisto.kernel.outputs import as_sent, resolve_blob_refs

from .recorder_kernel import kernel_fixture

DISPLAYED = ("display_data", "execute_result", "update_display_data")


kernel = kernel_fixture(
    "outputs", "--ThemistoRecorder.snapshot_mode=off", setup="%matplotlib inline"
)


def _unb64(value):
    """base64 text without the line breaks some encoders add."""
    return "".join(value.split()) if isinstance(value, str) else value


def _plain(bundle):
    return {
        k: _unb64(v) if k.startswith("image/") or k == "application/pdf" else v
        for k, v in bundle.items()
    }


def _same(out, msg):
    meta = dict(out.get("metadata") or {})
    themisto = meta.pop("themisto", None)
    if themisto and set(themisto) - {"update"}:
        return False
    theirs = {k: v for k, v in msg.get("metadata", {}).items() if k != "themisto"}
    return _plain(out["data"]) == _plain(msg["data"]) and meta == theirs


def _subsequence(kept, seen):
    found, i = [], 0
    for out in kept:
        if i < len(seen) and _same(out, seen[i]):
            found.append(out)
            i += 1
    return found


def check_recorded(kernel, done):
    """The execution is recorded; each display the frontend got is recorded as it got it;
    whatever else was recorded is a stub naming why; returns (the row, the stubs)."""
    row = kernel.execution(done.msg_id)
    assert row["status"] in ("ok", "error")
    json.dumps(row["outputs"], allow_nan=False)  # strict JSON, as a browser parses it
    with kernel.store() as store:
        recorded = [
            resolve_blob_refs(o, store.get_blob)
            for o in row["outputs"]
            if o["output_type"] in DISPLAYED
        ]
    seen = [c for kind, c in done.outputs if kind in DISPLAYED]
    kept, stubs = [], []
    for out in recorded:
        unrecorded = out.get("metadata", {}).get("themisto", {}).get("unrecorded")
        if (
            unrecorded
            and list(out["data"]) == ["text/plain"]
            and "[themisto:" in (out["data"]["text/plain"])
        ):
            assert all(isinstance(r, str) and r for r in unrecorded.values())
            stubs.append(out)
        else:
            kept.append(out)
    if done.reply["status"] != "ok" and len(kept) > len(seen):
        # The kernel failed to send one (e.g. too deep for its recursion limit where it sent
        # it): the attempt may be recorded too. What the frontend got is there, in order.
        kept = _subsequence(kept, seen)
    assert len(kept) == len(seen), (kept, seen)
    for out, msg in zip(kept, seen, strict=True):
        assert _same(out, msg), (out, msg)
    return row, stubs


FORMATTERS = r"""
import math, io
import numpy as np, pandas as pd, sympy
import matplotlib.pyplot as plt
from PIL import Image
from IPython.display import display, publish_display_data

png = Image.new("RGB", (40, 30), (200, 10, 10))
buf = io.BytesIO(); png.save(buf, format="PNG"); png_bytes = buf.getvalue()

class Everything:
    def _repr_png_(self): return png_bytes
    def _repr_jpeg_(self):
        b = io.BytesIO(); png.save(b, format="JPEG"); return b.getvalue()
    def _repr_svg_(self): return "<svg xmlns='http://www.w3.org/2000/svg'/>"
    def _repr_pdf_(self): return b"%PDF-1.4 fake pdf bytes"
    def _repr_json_(self): return {"nan": float("nan"), 1: np.int64(2), "inf": np.float32("inf")}
    def _repr_latex_(self): return r"$\alpha$"
    def _repr_markdown_(self): return "**md**"
    def _repr_javascript_(self): return "console.log(1)"
    def _repr_html_(self): return "<b>html</b>"
    def __repr__(self): return "Everything()"

class Widgety:
    def _repr_mimebundle_(self, include=None, exclude=None):
        return ({"application/vnd.jupyter.widget-view+json":
                    {"model_id": "abc", "version_major": 2, "version_minor": 0},
                 "application/x-custom": {"values": (1, 2, {3, 4})},
                 "text/plain": "Widgety()"}, {"application/x-custom": {"tuple": (1,)}})

sympy.init_printing()
x = sympy.symbols("x")
display(Everything())
display(Widgety())
display(sympy.Integral(sympy.sqrt(1 / x), x))
display(pd.DataFrame({"a": [1.5, float("nan")], "b": ["x", None]}))
display(png)
fig, ax = plt.subplots(); ax.plot([1, 3, 2]); plt.show()
publish_display_data({"text/plain": "raw", "application/json": {"k": b"raw bytes"},
                      "image/png": png_bytes})
h = display("first", display_id=True)
h.update("second")
np.float32(1.5)
"""


def test_every_formatter_type_is_recorded(kernel):
    done = kernel.run(FORMATTERS)
    assert done.reply["status"] == "ok", done.outputs
    row, stubs = check_recorded(kernel, done)
    assert not stubs
    outputs = [o for o in row["outputs"] if o["output_type"] != "stream"]
    kinds = [o["output_type"] for o in outputs]
    assert kinds.count("display_data") >= 9 and kinds[-1] == "execute_result", row["outputs"]
    everything = outputs[0]["data"]
    assert {
        "image/png",
        "image/jpeg",
        "image/svg+xml",
        "application/pdf",
        "application/json",
        "text/latex",
        "text/markdown",
        "application/javascript",
        "text/html",
    } <= set(everything)
    # Bytes from the formatters became base64 (blobs when large), as ipykernel sends them.
    with kernel.store() as store:
        resolved = resolve_blob_refs(outputs[0], store.get_blob)["data"]
    assert base64.b64decode(resolved["image/png"]).startswith(b"\x89PNG")
    assert base64.b64decode(resolved["application/pdf"]) == b"%PDF-1.4 fake pdf bytes"
    assert everything["application/json"] == {"nan": "nan", "1": 2, "inf": "np.float32(inf)"}
    widget = outputs[1]["data"]
    assert widget["application/vnd.jupyter.widget-view+json"]["model_id"] == "abc"
    assert outputs[1]["metadata"] == {"application/x-custom": {"tuple": [1]}}
    sympy_out = outputs[2]["data"]
    assert "text/latex" in sympy_out or "image/png" in sympy_out
    assert outputs[-1]["data"] == {"text/plain": "np.float32(1.5)"}
    updates = [o for o in outputs if o.get("metadata", {}).get("themisto", {}).get("update")]
    assert [u["data"]["text/plain"] for u in updates] == ["'second'"]


def test_values_no_frontend_could_get_become_stubs_and_the_row_stays(kernel):
    done = kernel.run(
        "from IPython.display import publish_display_data\n"
        "class Opaque: pass\n"
        "publish_display_data({'text/plain': 'ok', 'application/x-custom': Opaque()})\n"
        "deep = []\n"
        "for _ in range(100_000): deep = [deep]\n"
        "publish_display_data({'text/plain': 'deep', 'application/json': deep})\n"
        "print('after')"
    )
    row = kernel.execution(done.msg_id)
    assert row is not None and row["status"] in ("ok", "error")
    texts = [o.get("text", "") for o in row["outputs"] if o["output_type"] == "stream"]
    if done.reply["status"] == "ok":
        assert "after\n" in texts
    stubbed = [
        o for o in row["outputs"] if o.get("metadata", {}).get("themisto", {}).get("unrecorded")
    ]
    assert stubbed, row["outputs"]
    for o in stubbed:
        for reason in o["metadata"]["themisto"]["unrecorded"].values():
            assert reason  # says why
    json.dumps(row["outputs"], allow_nan=False)
    # The kernel and the recorder go on.
    after = kernel.run("21 * 2")
    assert kernel.execution(after.msg_id)["outputs"][0]["data"]["text/plain"] == "42"


def test_lone_surrogates_are_recorded_as_the_frontend_got_them(kernel, tmp_path):
    """A lone surrogate (os.listdir's for each byte of a file name that is not UTF-8) reaches
    the frontend as U+FFFD (jupyter_client packs it as that byte, its receiver decodes with
    replacement): stream text, display data (text and JSON values, keys too) and an error are
    recorded as the client here received them, never with the surrogate."""
    folder = tmp_path / "latin1"
    folder.mkdir()
    with open(os.path.join(os.fsencode(folder), b"caf\xe9.csv"), "wb"):
        pass
    done = kernel.run(f"import os\nfor f in os.listdir({str(folder)!r}): print(f)")
    row = kernel.execution(done.msg_id)
    sent = "".join(c["text"] for c in done.of("stream"))
    assert sent == "caf\ufffd.csv\n"
    assert row["outputs"] == [{"output_type": "stream", "name": "stdout", "text": sent}]

    # Escaped bytes that spell a character together arrive as that character.
    done = kernel.run("print('x\\udc80y', 'e\\udcc3\\udca9f')")
    row = kernel.execution(done.msg_id)
    sent = "".join(c["text"] for c in done.of("stream"))
    assert sent == "x\ufffdy e\xe9f\n"
    assert row["outputs"] == [{"output_type": "stream", "name": "stdout", "text": sent}]

    done = kernel.run(
        "display({'text/plain': 'p\\udc80q', 'text/html': '<b>\\udcff</b>',"
        " 'application/json': {'k\\udc81': ['v\\udc82w', 1]}}, raw=True)"
    )
    row = kernel.execution(done.msg_id)
    (sent,) = done.of("display_data")
    assert sent["data"] == {
        "text/plain": "p\ufffdq",
        "text/html": "<b>\ufffd</b>",
        "application/json": {"k\ufffd": ["v\ufffdw", 1]},
    }
    assert [(o["output_type"], o["data"], o["metadata"]) for o in row["outputs"]] == [
        ("display_data", sent["data"], sent["metadata"])
    ]
    done = kernel.run("type('R', (), {'__repr__': lambda self: 'r\\udc80s'})()")
    row = kernel.execution(done.msg_id)
    (sent,) = done.of("execute_result")
    assert sent["data"] == {"text/plain": "r\ufffds"}
    assert [(o["output_type"], o["data"]) for o in row["outputs"]] == [
        ("execute_result", sent["data"])
    ]

    done = kernel.run("raise ValueError('bad\\udc80value')")
    row = kernel.execution(done.msg_id)
    (sent,) = done.of("error")
    assert sent["evalue"] == "bad\ufffdvalue"
    assert row["outputs"] == [{"output_type": "error", **sent}]
    # Strict UTF-8 JSON, as an export writes it.
    json.dumps(row["outputs"], ensure_ascii=False).encode("utf-8")


def test_a_source_with_a_lone_surrogate_is_recorded_as_the_frontend_got_it_back(kernel):
    """A browser writes a lone surrogate in a cell as a JSON escape (`JSON.stringify`), so the
    kernel reads the surrogate (and Python refuses to compile it); its echo (`execute_input`)
    reaches the frontend with U+FFFD in its place, and so is the source recorded (it was `?`),
    with the error."""
    session = kernel.kc.session
    packer = session.pack
    session.pack = lambda obj: json.dumps(obj, default=json_default).encode("ascii")
    try:
        msg_id = kernel.send("print('ok')  # caf\udce9.csv")
    finally:
        session.pack = packer
    done = kernel.collect(msg_id)
    (error,) = done.of("error")
    assert done.reply["status"] == "error" and error["ename"] == "UnicodeEncodeError"
    row = kernel.execution(msg_id)
    assert row["source"] == "print('ok')  # caf\ufffd.csv" and row["status"] == "error"


def test_as_sent_replaces_only_lone_surrogates():
    assert as_sent("plain") == "plain" and as_sent("h\xe9llo \U0001f600") == "h\xe9llo \U0001f600"
    assert as_sent("caf\udce9.csv") == "caf\ufffd.csv"
    # Escaped bytes that spell UTF-8 are sent as that character.
    assert as_sent("\udcc3\udca9") == "\xe9"
    # Surrogates surrogateescape cannot send (the kernel's send fails): U+FFFD each.
    assert as_sent("a\ud800b\udfff\udc7f") == "a\ufffdb\ufffd\ufffd"
    assert as_sent("\ud83d\ude00") == "\ufffd\ufffd"  # a pair split into two lone ones


# -- a property test: whatever the payload, the execution is recorded faithfully --------------

LEAVES = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70).map(repr),
    st.floats(allow_nan=True, allow_infinity=True).map(lambda f: f"float({str(f)!r})"),
    st.text(max_size=20).map(repr),
    st.binary(max_size=40).map(repr),
    st.sampled_from(
        [
            "None",
            "True",
            "np.float32(0.5)",
            "np.int64(7)",
            "np.float64('nan')",
            "np.bool_(True)",
            "np.array([1, 2])",
            "datetime.date(2024, 1, 2)",
            "datetime.datetime(2024, 1, 2, 3, 4)",
            "object()",
            "Decimal('1.5')",
            "complex(1, 2)",
            "{1, 2}",
            "frozenset({'a'})",
            "range(3)",
        ]
    ),
)
KEYS = st.one_of(
    st.text(max_size=8).map(repr),
    st.integers(min_value=-5, max_value=5).map(repr),
    st.sampled_from(["None", "True", "(1, 2)", "1.5", "'1'"]),
)
PAYLOADS = st.recursive(
    LEAVES,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4).map(lambda xs: "[" + ", ".join(xs) + "]"),
        st.lists(inner, max_size=3).map(lambda xs: "(" + "".join(x + ", " for x in xs) + ")"),
        st.lists(st.tuples(KEYS, inner), max_size=4).map(
            lambda kv: "{" + ", ".join(f"{k}: {v}" for k, v in kv) + "}"
        ),
        st.integers(min_value=1, max_value=4000).map(lambda n: f"nest({n})"),
    ),
    max_leaves=12,
)
MIMES = st.sampled_from(
    [
        "application/json",
        "application/x-custom",
        "application/vnd.custom+json",
        "image/png",
        "text/html",
        "application/vnd.jupyter.widget-view+json",
    ]
)
HOW = st.sampled_from(["publish", "mimebundle", "metadata"])

PRELUDE = (
    "import datetime\nimport numpy as np\nfrom decimal import Decimal\n"
    "from IPython.display import display, publish_display_data\n"
    "def nest(n):\n    v = []\n    for _ in range(n): v = [v]\n    return v\n"
    "class Bundle:\n"
    "    def __init__(self, data, meta): self.data, self.meta = data, meta\n"
    "    def _repr_mimebundle_(self, include=None, exclude=None): return self.data, self.meta\n"
)


def _cell(how, mime, payload):
    if how == "publish":
        return f"publish_display_data({{'text/plain': 'p', {mime!r}: {payload}}})"
    if how == "mimebundle":
        return f"Bundle({{'text/plain': 'b', {mime!r}: {payload}}}, {{}})"
    return f"display(Bundle({{'text/plain': 'm'}}, {{{mime!r}: {payload}}}))"


@settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(how=HOW, mime=MIMES, payload=PAYLOADS)
def test_any_payload_is_recorded_or_stubbed_with_a_reason(kernel, how, mime, payload):
    kernel.run(PRELUDE)
    done = kernel.run(_cell(how, mime, payload))
    row, stubs = check_recorded(kernel, done)
    if done.reply["status"] == "ok":
        # The kernel sent the output: it is recorded, not stubbed.
        assert not stubs, (payload, stubs)
    else:
        # The kernel could not send it (the person saw an error): a stub says why.
        assert row["status"] == "error"


# Cells with clear_output, and the outputs a notebook keeps of them (nbclient 0.11's
# NotebookClient.clear_output/output, and JupyterLab's OutputAreaModel, do the same): a clear
# with wait=True empties the cell's outputs just before its next output (stream, display,
# result, error; not an update of a display, which changes one in place), and clears nothing
# if no output follows it in the cell.
CLEARS = [
    (
        "print('x1'); clear_output(wait=True); print('x2')",
        [{"output_type": "stream", "name": "stdout", "text": "x2\n"}],
    ),
    (
        "print('x1'); clear_output(); print('x2')",
        [{"output_type": "stream", "name": "stdout", "text": "x2\n"}],
    ),
    (
        "print('x1'); clear_output(wait=True)",
        [{"output_type": "stream", "name": "stdout", "text": "x1\n"}],
    ),
    (
        "display('d1'); clear_output(wait=True); display('d2'); clear_output(wait=True); 'r'",
        [
            {
                "output_type": "execute_result",
                "execution_count": None,
                "data": {"text/plain": "'r'"},
                "metadata": {},
            }
        ],
    ),
    (
        "h = display('a', display_id=True); clear_output(wait=True); h.update('b')",
        [
            {"output_type": "display_data", "data": {"text/plain": "'a'"}, "metadata": {}},
            {
                "output_type": "display_data",
                "data": {"text/plain": "'b'"},
                "metadata": {"themisto": {"update": True}},
            },
        ],
    ),
    (
        "h = display('a', display_id=True); clear_output(wait=True); h.update('b'); print('c')",
        [{"output_type": "stream", "name": "stdout", "text": "c\n"}],
    ),
    ("print('x1'); clear_output(wait=True); 1 / 0", ["ZeroDivisionError"]),
]


@pytest.mark.parametrize(("code", "kept"), CLEARS)
def test_clear_output_keeps_what_a_notebook_keeps(kernel, code, kept):
    done = kernel.run("from IPython.display import clear_output, display\n" + code)
    # The frontend was sent every output, the cleared ones too.
    assert len(done.outputs) >= len(kept)
    row = kernel.execution(done.msg_id)
    outputs = row["outputs"]
    if kept and kept[0] == "ZeroDivisionError":
        assert [(o["output_type"], o.get("ename")) for o in outputs] == [
            ("error", "ZeroDivisionError")
        ]
        return
    for out in outputs:
        if out["output_type"] == "execute_result":
            assert out["execution_count"] == row["execution_count"]
            out["execution_count"] = None
    assert outputs == kept


def test_a_progress_loop_records_its_last_frame_whole(kernel):
    done = kernel.run(
        "from IPython.display import clear_output\n"
        "for epoch in range(60):\n"
        "    clear_output(wait=True)\n"
        "    print(f'epoch {epoch} loss {1/(epoch+1):.4f} ' + 'x' * 4000)\n"
        "print('FINAL: training done')"
    )
    sent = "".join(o["text"] for o in done.of("stream"))
    assert sent.count("epoch ") == 60 and len(sent) > 64 * 1024  # over max_output_bytes
    (out,) = kernel.execution(done.msg_id)["outputs"]
    assert out["text"] == f"epoch 59 loss {1 / 60:.4f} " + "x" * 4000 + "\nFINAL: training done\n"


# Cells that show a traceback (IPython's `_showtraceback`, an `error` message to the frontend)
# without, or before, failing: each is recorded where the frontend shows it, the cell's own
# exactly once, and the cell's status is its own. Each: the code, the kinds of the outputs a
# notebook keeps, the status recorded.
SHOWN_TRACEBACKS = {
    "showtraceback": (
        "try:\n    1/0\nexcept Exception:\n    get_ipython().showtraceback()\nprint('after tb')",
        ["error", "stream"],
        "ok",
    ),
    # IPython shows the formatter's traceback, then the result without text/html.
    "failing formatter": (
        "class R:\n    def _repr_html_(self): raise ValueError('html fails')\n"
        "    def __repr__(self): return 'R()'\nR()",
        ["error", "execute_result"],
        "ok",
    ),
    "run_cell": (
        "get_ipython().run_cell('print(\"inner\"); 1/0'); print('outer after')",
        ["stream", "error", "stream"],
        "ok",
    ),
    "repr that prints then raises": (
        "class Bad:\n    def __repr__(self): print('repr side effect'); raise ValueError('no')\n"
        "Bad()",
        ["stream", "error"],
        "ok",
    ),
    "shown, then the cell fails": (
        "try:\n    {}['k']\nexcept KeyError:\n    get_ipython().showtraceback()\n"
        "print('then')\nraise ValueError('own')",
        ["error", "stream", "error"],
        "error",
    ),
    "run_cell fails, then the cell": (
        "get_ipython().run_cell('1/0'); print('between'); undefined_name",
        ["error", "stream", "error"],
        "error",
    ),
    "cleared, shown, printed": (
        "from IPython.display import clear_output\nprint('gone')\nclear_output(wait=True)\n"
        "try:\n    1/0\nexcept Exception:\n    get_ipython().showtraceback()\nprint('kept')",
        ["error", "stream"],
        "ok",
    ),
    "syntax error": ("def f(:\n    pass", ["error"], "error"),
}


def _as_notebook_keeps(outputs):
    """The iopub messages a frontend got, as nbclient turns them into nbformat outputs (and
    JupyterLab keeps them): consecutive stream text of one name in one output; a clear with
    wait=True empties the outputs before the next one."""
    from nbformat.v4 import output_from_msg

    kept, waiting = [], False
    for kind, content in outputs:
        if kind == "clear_output":
            if content.get("wait"):
                waiting = True
            else:
                kept.clear()
            continue
        if waiting:
            kept.clear()
            waiting = False
        out = output_from_msg({"msg_type": kind, "header": {"msg_type": kind}, "content": content})
        if kind == "stream" and kept and kept[-1].get("name") == out["name"]:
            kept[-1]["text"] += out["text"]
        else:
            kept.append(out)
    return kept


@pytest.mark.parametrize(
    ("code", "kinds", "status"), SHOWN_TRACEBACKS.values(), ids=list(SHOWN_TRACEBACKS)
)
def test_every_traceback_shown_is_recorded_where_the_frontend_shows_it(kernel, code, kinds, status):
    msg_id = kernel.send(code)
    outputs = []
    while True:  # (clear_output too, which `collect` leaves out)
        msg = kernel.kc.get_iopub_msg(timeout=90)
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            break
        if msg["msg_type"] in ("stream", "execute_result", "error", "clear_output"):
            outputs.append((msg["msg_type"], msg["content"]))
    while (reply := kernel.kc.get_shell_msg(timeout=90))["parent_header"]["msg_id"] != msg_id:
        pass
    shown = _as_notebook_keeps(outputs)
    assert [o["output_type"] for o in shown] == kinds
    row = kernel.execution(msg_id)
    recorded = row["outputs"]
    for out in recorded:
        if out["output_type"] == "execute_result":
            out["execution_count"] = None
    for out in shown:
        if out["output_type"] == "execute_result":
            out["execution_count"] = None
    assert recorded == shown
    # The status is the cell's own: an error only if the cell itself failed. (ipykernel 7
    # replies `error` also when a traceback was shown while a result was being formatted:
    # the failing formatter, the raising `__repr__`; the recorder keeps the cell's own.)
    assert row["status"] == status
    if reply["content"]["status"] == "ok":
        assert status == "ok"
