"""Output preview in a real kernel: the sandboxed fork shows what a cell would print and leaves
the namespace, the files, the network and the processes of the real world as they were."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path
from typing import Any

import pytest
from jupyter_client.manager import KernelManager

from jupyter_themisto.kernel import sandbox
from jupyter_themisto.store import TrajectoryStore


class Kernel:
    """A real ipykernel with the recorder loaded; previews go through silent user_expressions,
    exactly as the preview backend sends them."""

    def __init__(self, store_path: Path, cwd: Path, **extra_env: str) -> None:
        env = dict(os.environ, **extra_env)
        env["THEMISTO_STORE"] = str(store_path)
        env["THEMISTO_NOTEBOOK_PATH"] = "preview.ipynb"
        # ipykernel turns off its fd-level output capture under pytest; a real kernel has it,
        # and that capture is what would leak a forked child's prints into a cell.
        env.pop("PYTEST_CURRENT_TEST", None)
        self.km = KernelManager(kernel_name="python3")
        self.km.start_kernel(env=env, cwd=str(cwd), extra_arguments=["--ext=jupyter_themisto"])
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=90)
        self.iopub: list[dict[str, Any]] = []

    def _request(self, code: str, **kw: Any) -> tuple[str, dict[str, Any], list[dict]]:
        msg_id = self.kc.execute(code, allow_stdin=False, stop_on_error=False, **kw)
        deadline = time.monotonic() + 120
        mine: list[dict[str, Any]] = []
        while True:
            msg = self.kc.get_iopub_msg(timeout=max(1.0, deadline - time.monotonic()))
            self.iopub.append(msg)
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            mine.append(msg)
            if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
                break
        while True:
            reply = self.kc.get_shell_msg(timeout=max(1.0, deadline - time.monotonic()))
            if reply["parent_header"].get("msg_id") == msg_id:
                return msg_id, reply["content"], mine

    def run(self, code: str) -> list[dict[str, Any]]:
        """Run a cell for real; its iopub outputs."""
        _, reply, msgs = self._request(code)
        assert reply["status"] == "ok", reply
        return [
            {"msg_type": m["msg_type"], **m["content"]}
            for m in msgs
            if m["msg_type"] in ("stream", "display_data", "execute_result", "error")
        ]

    def value(self, expr: str) -> str:
        _, reply, _ = self._request("", silent=True, user_expressions={"v": expr})
        result = reply["user_expressions"]["v"]
        assert result["status"] == "ok", result
        return result["data"]["text/plain"]

    def preview(self, source: str, **limits: Any) -> dict[str, Any]:
        args = "".join(f", {k}={v!r}" for k, v in limits.items())
        expr = (
            "__import__('jupyter_themisto.kernel.preview', fromlist=['run_preview'])"
            f".run_preview({source!r}{args})"
        )
        _, reply, msgs = self._request(
            "", silent=True, store_history=False, user_expressions={"p": expr}
        )
        # Nothing of the preview may reach iopub: only the busy/idle of the request itself.
        assert [m["msg_type"] for m in msgs] == ["status", "status"], msgs
        result = reply["user_expressions"]["p"]
        assert result["status"] == "ok", result
        return result["data"]["application/json"]

    def close(self) -> None:
        self.kc.stop_channels()
        self.km.shutdown_kernel(now=True)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("preview")


@pytest.fixture(scope="module")
def kernel(workdir):
    k = Kernel(workdir / "store.sqlite", workdir)
    k.run("xs = [1, 2, 3]\nys = {'a': 1}\nimport pandas as pd\n")
    yield k
    k.close()


def text_of(reply: dict[str, Any]) -> str:
    parts = []
    for out in reply["outputs"]:
        if out["output_type"] == "stream":
            parts.append(out["text"])
        elif out["output_type"] in ("execute_result", "display_data"):
            parts.append(out["data"]["text/plain"])
        elif out["output_type"] == "error":
            parts.append(f"{out['ename']}: {out['evalue']}")
    return "".join(parts)


def test_sandbox_layers_are_on(kernel):
    reply = kernel.preview("1 + 1")
    assert reply["status"] == "ok" and reply["stopped"] == []
    assert reply["outputs"] == [
        {
            "output_type": "execute_result",
            "data": {"text/plain": "2"},
            "metadata": {},
            "execution_count": None,
        }
    ]
    for layer in ("landlock", "seccomp", "no_new_privs", "cpu"):
        assert reply["sandbox"][layer].startswith("on"), reply["sandbox"]
    assert reply["sandbox"]["memory"] == "watched by the kernel (1024 MB)"


def test_mutations_and_deletions_stay_in_the_fork(kernel):
    count = kernel.value("get_ipython().execution_count")
    reply = kernel.preview("xs.append(4)\ndel ys\nprint('mutated')\nxs")
    assert reply["stopped"] == []
    assert text_of(reply) == "mutated\n[1, 2, 3, 4]"
    assert kernel.value("xs") == "[1, 2, 3]"
    assert kernel.value("ys") == "{'a': 1}"
    # Neither counted nor recorded as an execution.
    assert kernel.value("get_ipython().execution_count") == count


def test_previews_are_not_recorded(kernel, workdir):
    kernel.preview("print('not recorded')")
    kernel.run("zz = 1")
    # The recorder writes after the reply: wait for the real cell, then look for the preview.
    deadline = time.monotonic() + 60
    while "zz = 1" not in (sources := _recorded_sources(workdir)):
        assert time.monotonic() < deadline, sources
        time.sleep(0.1)
    assert not any("not recorded" in s for s in sources)


def _recorded_sources(workdir: Path) -> list[str]:
    store = TrajectoryStore(str(workdir / "store.sqlite"))
    try:
        return [
            e["source"] for t in store.list_trajectories() for e in store.list_executions(t["id"])
        ]
    finally:
        store.close()


def test_file_writes_deletions_renames_are_stopped(kernel, workdir):
    data = workdir / "data"
    data.mkdir()
    (data / "keep.txt").write_text("original")
    before = {p.name: p.read_bytes() for p in data.iterdir()}
    cells = {
        f"open({str(data / 'results.csv')!r}, 'w').write('x')": "write",
        f"import pandas as pd; pd.DataFrame({{'a': [1]}}).to_csv({str(data / 'r.csv')!r})": "write",
        f"import os; os.remove({str(data / 'keep.txt')!r})": "delete",
        f"from pathlib import Path; Path({str(data / 'keep.txt')!r}).unlink()": "delete",
        f"import os; os.rename({str(data / 'keep.txt')!r}, {str(data / 'moved.txt')!r})": "rename",
        f"import os; os.mkdir({str(data / 'sub')!r})": "create",
        f"open({str(data / 'keep.txt')!r}, 'a').write('more')": "write",
    }
    for cell, verb in cells.items():
        reply = kernel.preview(cell)
        assert reply["stopped"] and reply["stopped"][0].startswith(verb), (cell, reply)
        assert str(data) in reply["stopped"][0]
    assert "results.csv" in kernel.preview(next(iter(cells)))["stopped"][0]
    assert {p.name: p.read_bytes() for p in data.iterdir()} == before


def test_kernel_level_barriers_hold_without_the_audit_hooks(kernel, workdir):
    """C code bypasses Python's audit hooks; Landlock and seccomp still refuse."""
    target = workdir / "c-level.txt"
    marker = workdir / "spawned.txt"
    reply = kernel.preview(
        "import ctypes\nlibc = ctypes.CDLL(None)\n"
        f"print(libc.open({str(target).encode()!r}, 0o101, 0o644))\n"  # O_WRONLY|O_CREAT
        f"print(libc.system(b'touch {marker}') != 0)\n"
        "print(libc.fork())\n"
    )
    assert text_of(reply) == "-1\nTrue\n-1\n", reply
    assert not target.exists() and not marker.exists()
    # A file the person opened for writing before the preview: the fork's copy cannot write.
    inherited = workdir / "open-handle.txt"
    kernel.run(f"fh = open({str(inherited)!r}, 'w')")
    reply = kernel.preview("fh.write('from the preview'); fh.flush()")
    assert reply["stopped"] and "forbids" in reply["stopped"][0], reply
    kernel.run("fh.close()")
    assert inherited.read_text() == ""


def test_network_connections_are_stopped(kernel):
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.setblocking(False)
    port = listener.getsockname()[1]
    try:
        reply = kernel.preview(
            f"import socket\ns = socket.create_connection(('127.0.0.1', {port}))\ns.sendall(b'hi')"
        )
        assert reply["stopped"] == [f"open a network connection (('127.0.0.1', {port}))"]
        reply = kernel.preview(
            f"import urllib.request\nurllib.request.urlopen('http://127.0.0.1:{port}/', timeout=2)"
        )
        assert reply["stopped"][0].startswith("open a network connection"), reply
        # Below the audit hooks: a raw connect(2) through libc.
        reply = kernel.preview(
            "import ctypes, struct\nlibc = ctypes.CDLL(None)\nfd = libc.socket(2, 1, 0)\n"
            f"addr = struct.pack('=H', 2) + struct.pack('>H', {port}) + bytes([127, 0, 0, 1])"
            " + bytes(8)\n"
            "print(libc.connect(fd, addr, 16))"
        )
        assert text_of(reply) == "-1\n", reply
        time.sleep(0.5)
        with pytest.raises(BlockingIOError):
            listener.accept()
    finally:
        listener.close()


def test_processes_are_stopped(kernel, workdir):
    marker = workdir / "subprocess-ran.txt"
    reply = kernel.preview(f"import subprocess\nsubprocess.run(['touch', {str(marker)!r}])")
    assert reply["stopped"] == [f"start a process (touch {marker})"]
    reply = kernel.preview(f"import os\nos.system('touch {marker}')")
    assert reply["stopped"][0].startswith("start a process")
    reply = kernel.preview("import multiprocessing as mp\np = mp.Process(target=print)\np.start()")
    assert reply["stopped"][0].startswith("start a process"), reply
    assert not marker.exists()


def test_endless_loop_is_killed_and_kernel_goes_on(kernel):
    reply = kernel.preview("n = 0\nwhile True:\n    n += 1", timeout=2.0)
    assert reply["stopped"] == ["run longer than 2 s"]
    assert kernel.run("print(xs)") == [
        {"msg_type": "stream", "name": "stdout", "text": "[1, 2, 3]\n"}
    ]
    assert "n" not in kernel.value("sorted(k for k in globals() if k == 'n')")


def test_memory_beyond_the_limit_is_stopped(kernel):
    # Filled memory (b"x" * n touches every page; bytes(n) would stay lazily unmapped).
    reply = kernel.preview("chunks = [b'x' * 2**26 for _ in range(200)]", memory_mb=256)
    assert reply["stopped"] == ["use more than 256 MB of memory"], reply
    reply = kernel.preview("big = b'x' * (64 * 2**30)\nlen(big)", memory_mb=256)
    assert reply["stopped"][0].startswith("use more than"), reply
    assert kernel.value("'big' in globals() or 'chunks' in globals()") == "False"


def test_child_prints_never_reach_the_persons_cells(kernel):
    seen = len(kernel.iopub)
    reply = kernel.preview(
        "import os, sys\nprint('LEAK-print')\nos.write(1, b'LEAK-fd1\\n')\n"
        "os.write(2, b'LEAK-fd2\\n')\nsys.__stdout__.write('LEAK-dunder\\n')\n"
        "sys.__stdout__.flush()"
    )
    assert text_of(reply) == "LEAK-print\n"
    outputs = kernel.run("print('after')")
    assert outputs == [{"msg_type": "stream", "name": "stdout", "text": "after\n"}]
    time.sleep(0.5)
    kernel.run("pass")
    assert not any("LEAK" in str(m["content"]) for m in kernel.iopub[seen:])


def test_dataframe_head_equals_the_real_output_byte_for_byte(kernel):
    kernel.run(
        "import numpy as np\nrng = np.random.default_rng(0)\n"
        "df = pd.DataFrame(rng.normal(size=(50, 4)), columns=list('abcd'))\n"
        "df['name'] = ['row %d' % i for i in range(50)]"
    )
    reply = kernel.preview("df.head()")
    real = kernel.run("df.head()")
    assert len(real) == 1 and real[0]["msg_type"] == "execute_result"
    assert len(reply["outputs"]) == 1
    assert reply["outputs"][0]["data"] == real[0]["data"]
    assert (
        reply["outputs"][0]["data"]["text/plain"].encode() == real[0]["data"]["text/plain"].encode()
    )
    # Streams, displays, the trailing semicolon and errors follow IPython too.
    cell = "print('a')\nfrom IPython.display import display\ndisplay(df.shape)\ndf.shape"
    real = kernel.run(cell)
    got = kernel.preview(cell)["outputs"]
    assert [o["output_type"] for o in got] == ["stream", "display_data", "execute_result"]
    assert got[0]["text"] == real[0]["text"]
    assert got[1]["data"] == real[1]["data"] and got[2]["data"] == real[2]["data"]
    assert kernel.preview("df.shape;")["outputs"] == []
    err = kernel.preview("1 / 0")["outputs"]
    assert err[0]["ename"] == "ZeroDivisionError" and err[0]["evalue"] == "division by zero"


def test_interrupting_the_kernel_kills_the_preview(kernel):
    import psutil

    expr = (
        "__import__('jupyter_themisto.kernel.preview', fromlist=['run_preview'])"
        ".run_preview('while True: pass', timeout=60.0)"
    )
    proc = psutil.Process(kernel.km.provisioner.process.pid)

    def running_children() -> list:
        # (the recorder's finished snapshot children may linger as zombies)
        return [c for c in proc.children() if c.status() != psutil.STATUS_ZOMBIE]

    deadline = time.monotonic() + 30
    while running_children():  # the recorder's snapshot of the last real cell
        assert time.monotonic() < deadline, running_children()
        time.sleep(0.05)
    msg_id = kernel.kc.execute(
        "", silent=True, store_history=False, user_expressions={"p": expr}, allow_stdin=False
    )
    while not running_children():
        assert time.monotonic() < deadline, "the preview child never started"
        time.sleep(0.05)
    started = time.monotonic()
    kernel.km.interrupt_kernel()
    while True:
        reply = kernel.kc.get_shell_msg(timeout=30)
        if reply["parent_header"].get("msg_id") == msg_id:
            break
    assert time.monotonic() - started < 20  # not the preview's 60 s timeout
    assert reply["content"]["user_expressions"]["p"]["ename"] == "KeyboardInterrupt"
    deadline = time.monotonic() + 10
    while running_children():
        assert time.monotonic() < deadline, running_children()
        time.sleep(0.05)
    assert kernel.value("xs") == "[1, 2, 3]"


def test_a_preview_without_its_kernel_level_layers_does_not_run():
    on = {"landlock": "on (ABI 7)", "seccomp": "on", "no_new_privs": "on", "cpu": "on (5 s)"}
    assert sandbox.missing_layers(on) == []
    lacking = {**on, "landlock": "unavailable: No module named 'landlock'"}
    assert sandbox.missing_layers(lacking) == ["landlock (unavailable: No module named 'landlock')"]
    assert sandbox.missing_layers({}) == ["landlock (not tried)", "seccomp (not tried)"]


def test_a_kernel_without_landlock_previews_nothing(tmp_path):
    # A kernel where the Landlock binding cannot be imported (as on a system without it).
    shadow = tmp_path / "shadow"
    shadow.mkdir()
    (shadow / "landlock.py").write_text("raise ImportError('no Landlock binding here')\n")
    k = Kernel(tmp_path / "store.sqlite", tmp_path, PYTHONPATH=str(shadow))
    try:
        reply = k.preview("open('written.txt', 'w').write('x'); print('ran')")
        assert reply["status"] == "unsupported" and reply["outputs"] == []
        assert "preview unavailable" in reply["detail"] and "landlock" in reply["detail"]
        assert reply["sandbox"]["landlock"].startswith("unavailable")
        assert not (tmp_path / "written.txt").exists()
    finally:
        k.close()
