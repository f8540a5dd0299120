"""A real ipykernel for the preview tests, asked exactly as the preview backend asks it."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import KernelManager


class Kernel:
    """A real ipykernel with the recorder loaded; previews go through silent user_expressions,
    exactly as the preview backend sends them. `launcher`: a Python script that the kernel's
    command starts with (it sets something up, then execs the kernel)."""

    def __init__(
        self, store_path: Path, cwd: Path, launcher: Path | None = None, **extra_env: str
    ) -> None:
        env = dict(os.environ, **extra_env)
        env["THEMISTO_STORE"] = str(store_path)
        env["THEMISTO_NOTEBOOK_PATH"] = "preview.ipynb"
        # ipykernel turns off its fd-level output capture under pytest; a real kernel has it,
        # and that capture is what would leak a forked child's prints into a cell.
        env.pop("PYTEST_CURRENT_TEST", None)
        kw: dict[str, Any] = {"kernel_name": "python3"}
        if launcher is not None:
            spec_dir = cwd / ".kernelspec" / "launched"
            spec_dir.mkdir(parents=True, exist_ok=True)
            argv = [sys.executable, str(launcher), "-m", "ipykernel_launcher"]
            argv += ["-f", "{connection_file}"]
            (spec_dir / "kernel.json").write_text(
                json.dumps({"argv": argv, "display_name": "launched", "language": "python"})
            )
            kw = {
                "kernel_name": "launched",
                "kernel_spec_manager": KernelSpecManager(kernel_dirs=[str(spec_dir.parent)]),
            }
        self.km = KernelManager(**kw)
        self.km.start_kernel(env=env, cwd=str(cwd), extra_arguments=["--ext=jupyter_themisto"])
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=90)
        self.iopub: list[dict[str, Any]] = []

    @property
    def pid(self) -> int:
        return int(self.km.provisioner.process.pid)  # type: ignore[union-attr]

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
            if m["msg_type"]
            in ("stream", "display_data", "execute_result", "error", "clear_output")
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


#: a kernel launcher that gives up CAP_SYS_ADMIN for good (as a container's root, or any
#: non-root user, lacks it): its previews take the unprivileged way, through a monitor that
#: enters a user namespace first
WITHOUT_SYS_ADMIN = """
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
if libc.prctl(24, 21, 0, 0, 0) != 0:  # PR_CAPBSET_DROP, CAP_SYS_ADMIN: gone across exec
    raise OSError(ctypes.get_errno(), "PR_CAPBSET_DROP")
os.execv(sys.executable, [sys.executable] + sys.argv[1:])
"""


def kernel_for_path(path: str, store_path: Path, cwd: Path) -> Kernel:
    """A kernel whose previews take `path`: "direct" (this test runs as root: the kernel forks
    the preview straight into its namespaces) or "monitor" (a kernel without CAP_SYS_ADMIN)."""
    if path == "direct":
        assert os.geteuid() == 0, "the direct path needs a root kernel"
        return Kernel(store_path, cwd)
    launcher = cwd / ".kernelspec" / "without_sys_admin.py"
    launcher.parent.mkdir(parents=True, exist_ok=True)
    launcher.write_text(WITHOUT_SYS_ADMIN)
    return Kernel(store_path, cwd, launcher=launcher)


def namespaces(pid: int) -> set[str]:
    """Every namespace any thread of process `pid` is in (threads that end meanwhile aside)."""
    found = set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        for name in ("net", "ipc", "uts", "pid", "pid_for_children", "mnt", "user", "cgroup"):
            try:
                found.add(os.readlink(f"/proc/{pid}/task/{tid}/ns/{name}"))
            except OSError:
                pass
    return found


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
