"""A preview shows what the real run of the same cell will show: each test previews a cell, then
runs it for real in the same kernel state, and compares what the notebook would display (streams
merged as the notebook merges them, clear_output applied, results and displays as text/plain,
errors by name and message). The cases are what a forked child does differently from the kernel
unless told: `random` reseeds itself, numpy's generator is seeded where first used, the input
history and execution count move on, ipykernel publishes stdout and stderr in its own order, the
inline backend shows figures after errors too, and a forking thread other than the kernel's
would have its own context and event loop."""

from __future__ import annotations

import re
from typing import Any

import pytest

from .preview_kernel import Kernel


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("fidelity")
    k = Kernel(workdir / "store.sqlite", workdir)
    # (no timed flush of the real kernel's streams during a test, however loaded the machine:
    # the preview takes the kernel's own flush_interval)
    k.run("import sys\nsys.stdout.flush_interval = sys.stderr.flush_interval = 30.0")
    yield k
    k.close()


def notebook_view(outputs: list[dict[str, Any]]) -> list[tuple[str, ...]]:
    """What the notebook shows for nbformat outputs or iopub messages (`msg_type` or
    `output_type`)."""
    shown: list[list[str]] = []
    clear_waiting = False
    for out in outputs:
        kind = out.get("msg_type") or out.get("output_type")
        if kind == "clear_output":
            if out.get("wait"):
                clear_waiting = True
            else:
                shown.clear()
            continue
        if clear_waiting:
            shown.clear()
            clear_waiting = False
        if kind == "stream":
            if shown and shown[-1][:2] == ["stream", out["name"]]:
                shown[-1][2] += out["text"]
            else:
                shown.append(["stream", out["name"], out["text"]])
        elif kind in ("execute_result", "display_data"):
            shown.append([kind, out["data"].get("text/plain", "")])
        elif kind == "error":
            shown.append([kind, out["ename"], out["evalue"]])
    return [tuple(s) for s in shown]


def run_real(k: Kernel, cell: str) -> list[dict[str, Any]]:
    """The cell's iopub outputs (an error is an output like any other here)."""
    _, _, msgs = k._request(cell)
    kinds = ("stream", "display_data", "execute_result", "error", "clear_output")
    return [{"msg_type": m["msg_type"], **m["content"]} for m in msgs if m["msg_type"] in kinds]


def same_as_real(k: Kernel, cell: str) -> list[tuple[str, ...]]:
    reply = k.preview(cell)
    assert reply["status"] == "ok" and reply["stopped"] == [], reply
    preview = notebook_view(reply["outputs"])
    real = notebook_view(run_real(k, cell))
    assert preview == real
    assert real, "the cell shows nothing: the comparison would prove nothing"
    return real


def test_unseeded_random_numbers_are_the_kernels(kernel):
    kernel.run("import random")
    shown = same_as_real(kernel, "print(random.random(), random.randint(0, 10**9))")
    # The real run drew its numbers; the next preview sees the kernel's state after them.
    assert same_as_real(kernel, "random.random()") != shown


def test_stdout_comes_before_stderr_as_ipykernel_publishes_them(kernel):
    shown = same_as_real(
        kernel,
        "import sys, warnings\n"
        "print('to stderr first', file=sys.stderr)\n"
        "print('then stdout')\n"
        "warnings.warn('a warning')\n"
        "print('more stdout')\n"
        "display('a display flushes both')\n"
        "print('after the display', file=sys.stderr)\n"
        "print('last')",
    )
    # (not the order of the calls: each stream is published when flushed, stdout first)
    assert shown[0] == ("stream", "stdout", "then stdout\nmore stdout\n")
    assert shown[1][:2] == ("stream", "stderr")


def test_explicit_flushes_and_clear_output_are_kept(kernel):
    same_as_real(
        kernel,
        "import sys\nfrom IPython.display import clear_output\n"
        "print('a', file=sys.stderr, flush=True)\nprint('b')\n"
        "clear_output(wait=True)\nprint('c')\nprint('d', file=sys.stderr)",
    )
    shown = same_as_real(
        kernel, "from IPython.display import clear_output\nprint('x')\nclear_output()\nprint('y')"
    )
    assert shown == [("stream", "stdout", "y\n")]


def test_input_history_and_execution_count_are_the_real_runs(kernel):
    kernel.run("n_before = len(In)")
    same_as_real(kernel, "print(len(In) - n_before, repr(_i), repr(In[-1][:5]))\n_ih[-1][:5]")
    count = int(kernel.value("get_ipython().execution_count"))
    reply = kernel.preview("'counted'")
    assert reply["outputs"][0]["execution_count"] == count


def test_input_history_holds_the_cell_as_ipython_stores_it(kernel):
    # (without the newline the cell's transformation adds, or the one it ends with: seen in a
    # notebook's `print(globals())`; the count moves on before the cell runs)
    same_as_real(
        kernel,
        "n = get_ipython().execution_count\n"
        "print(n, repr(_ih[-1]), repr(In[-1]), repr(globals()[f'_i{n - 1}']))\n",
    )
    same_as_real(kernel, "x = %pwd\nprint(repr(_ih[-1]), repr(In[-1]))")


def test_timing_magics_use_the_kernels_units(kernel):
    cell = "%time sum(range(10))"
    reply = kernel.preview(cell)
    real = kernel.run(cell)

    def shape(text: str) -> str:
        # (which unit a duration gets depends on how long it took: 0 ns or 2 μs of CPU)
        return re.sub(r"[\d.]+(?:e[+-]?\d+)? (ns|[\u00b5\u03bc]s|us|ms|s)\b", "#", text)

    preview_text = "".join(o.get("text", "") for o in reply["outputs"])
    real_text = "".join(o.get("text", "") for o in real)
    assert "Wall time" in real_text and shape(preview_text) == shape(real_text)
    # The kernel's streams take "µs" (UTF-8): so does the preview's, never "us".
    assert not re.search(r"\d us\b", real_text + preview_text)


def test_figures_follow_an_error_as_they_do_a_result(kernel):
    kernel.run("%matplotlib inline\nimport matplotlib.pyplot as plt")
    shown = same_as_real(kernel, "plt.plot([1, 2])\n1 / 0")
    assert [s[0] for s in shown] == ["error", "display_data"]


def test_the_cell_runs_in_the_kernels_thread_and_context(kernel):
    kernel.run("import decimal, numpy as np\ndecimal.getcontext().prec = 5\nnp.set_printoptions(3)")
    same_as_real(
        kernel,
        "import asyncio, threading\n"
        "print(threading.current_thread().name, asyncio.get_event_loop().is_running())\n"
        "print(decimal.Decimal(1) / 7, np.array([1 / 7]))",
    )


def test_a_failing_display_formatter_shows_its_error_as_the_kernel_sends_it(kernel):
    # (IPython sends the formatter's traceback through the kernel's session: a pandas Styler
    # whose _repr_html_ raised showed a "Logging error" in the preview instead)
    shown = same_as_real(
        kernel,
        "class Broken:\n"
        "    def _repr_html_(self):\n"
        "        raise ValueError('no html')\n"
        "    def __repr__(self):\n"
        "        return 'Broken()'\n"
        "Broken()",
    )
    assert ("error", "ValueError", "no html") in shown


def test_comm_messages_go_to_the_browser_not_into_the_output(kernel):
    # (an nbagg figure talks to the browser through a comm: the notebook shows its
    # Javascript and HTML displays, the messages are not output)
    kernel.run("import matplotlib\nmatplotlib.use('nbagg')\nimport matplotlib.pyplot as plt")
    try:
        shown = same_as_real(
            kernel, "fig, ax = plt.subplots()\nax.bar([1, 2], [3, -1])\nplt.show()"
        )
        assert [s[0] for s in shown] == ["display_data", "display_data"]
        # (the real figure would send its draw messages during the next request)
        kernel.run("plt.close('all')\nmatplotlib.use('inline')")
        same_as_real(
            kernel,
            "from comm import create_comm\nc = create_comm(target_name='x')\n"
            "c.send({'a': 1})\nprint('sent')",
        )
    finally:
        kernel.run("plt.close('all')\nmatplotlib.use('inline')")


def test_openmp_runs_in_the_preview_after_the_kernel_started_its_threads(kernel):
    # (GNU OpenMP's pool does not survive the fork: KMeans hung the preview past its timeout
    # once the kernel had run one, in scikit-learn's clustering tutorials)
    kernel.run(
        "from sklearn.cluster import KMeans\nfrom sklearn.datasets import make_blobs\n"
        "X, _ = make_blobs(n_samples=1500, random_state=170)\n"
        "KMeans(n_clusters=3, random_state=0).fit(X)"
    )
    shown = same_as_real(
        kernel,
        "km = KMeans(n_clusters=3, random_state=0).fit(X)\n"
        "print(km.labels_[:20], km.n_iter_)\nkm.cluster_centers_.round(6)",
    )
    assert shown[0][0] == "stream"


def test_numpys_global_generator_is_the_kernels_when_the_preview_loads_it(tmp_path):
    # (numpy >= 2 imports numpy.random only when first used, and seeds its global generator from
    # the OS then: a preview that used it first drew other numbers than the real run, as in
    # scikit-learn's `KFold(shuffle=True)` without a seed in a cross-validation tutorial)
    k = Kernel(tmp_path / "store.sqlite", tmp_path)
    try:
        k.run("import sys, numpy as np")
        assert k.value("'numpy.random' in sys.modules") == "False"
        shown = same_as_real(k, "print(np.random.rand(3))\nnp.random.randint(10**9)")
        assert shown[0][0] == "stream"
        # (the kernel's numbers move on as the real run drew them; the next preview follows)
        same_as_real(k, "np.random.permutation(10)")
    finally:
        k.close()
