"""A real `jupyter lab` subprocess for the browser tests: temp root, store and settings."""

from __future__ import annotations

import json
import os
import secrets
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

VENV_BIN = Path(sys.executable).parent
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]

# Watches, in the page, for the new empty cell becoming active and then its ghost text
# appearing: `window.__themistoTiming` gets their times (activeAt, ghostAt; performance.now()).
GHOST_TIMING_JS = """() => {
  const nb = document.querySelector('.jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook');
  const before = nb.querySelectorAll('.jp-Cell').length;
  const t = (window.__themistoTiming = {});
  const obs = new MutationObserver(() => {
    const all = nb.querySelectorAll('.jp-Cell');
    const active = nb.querySelector('.jp-Cell.jp-mod-active');
    if (!t.activeAt && all.length > before && active === all[all.length - 1]) {
      t.activeAt = performance.now();
    }
    if (t.activeAt && !t.ghostAt && active && active.querySelector('.jp-GhostText')) {
      t.ghostAt = performance.now();
      obs.disconnect();
    }
  });
  obs.observe(nb, { subtree: true, childList: true, attributes: true, attributeFilter: ['class'] });
}"""

# User settings written before the lab starts: no news toast over the screenshots, our provider
# explicitly on, no streaming animation (the test compares the ghost text with what Tab inserts).
USER_SETTINGS: dict[str, dict[str, Any]] = {
    "@jupyterlab/apputils-extension/notification": {"fetchNews": "false"},
    "@jupyterlab/completer-extension/inline-completer": {
        "providers": {"@jupyter-themisto/next-cell": {"enabled": True}},
        "streamingAnimation": "none",
    },
    "jupyter-themisto/plugin": {"debounceMs": 30},
}


def check_installed_build(root: Path) -> None:
    """The lab serves the venv's copy of the build: refuse to test an older one than the tree's."""
    built = root / "jupyter_themisto" / "labextension" / "package.json"
    installed = VENV_BIN.parent / "share" / "jupyter" / "labextensions" / "jupyter-themisto"
    if not built.exists():
        return  # nothing built in the tree: whatever is installed is what there is
    load = json.loads(built.read_text())["jupyterlab"]["_build"]["load"]
    served = json.loads((installed / "package.json").read_text())["jupyterlab"]["_build"]["load"]
    if load != served:
        raise RuntimeError(
            f"the installed labextension ({served}) is not the current build ({load}): "
            "run `bash .ci/setup` to reinstall it"
        )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class JupyterLab:
    """`jupyter lab` with the extension, the embedded retrieval backend and an isolated store;
    `app="server"` runs the plain `jupyter server` (the same extension, no lab pages)."""

    def __init__(
        self, base: Path, extra_args: list[str] | None = None, *, app: str = "lab"
    ) -> None:
        self.base = base
        self.extra_args = list(extra_args or [])
        self.app = app
        self.root = base / "root"
        self.store_path = base / "store" / "trajectories.sqlite"
        self.port = free_port()
        self.token = secrets.token_hex(16)
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = base / "lab.log"
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: Any = None

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            THEMISTO_STORE=str(self.store_path),
            JUPYTER_CONFIG_DIR=str(self.base / "config"),
            JUPYTER_DATA_DIR=str(self.base / "data"),
            JUPYTER_RUNTIME_DIR=str(self.base / "runtime"),
            JUPYTERLAB_SETTINGS_DIR=str(self.base / "settings"),
            JUPYTERLAB_WORKSPACES_DIR=str(self.base / "workspaces"),
            IPYTHONDIR=str(self.base / "ipython"),
            PATH=f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}",
        )
        return env

    def start(self, timeout: float = 120.0) -> None:
        for sub in ("root", "store", "config", "data", "runtime", "settings", "workspaces"):
            (self.base / sub).mkdir(parents=True, exist_ok=True)
        for name, values in USER_SETTINGS.items():
            path = self.base / "settings" / f"{name}.jupyterlab-settings"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(values))
        self._log = open(self.log_path, "wb")
        self._proc = subprocess.Popen(
            [
                str(VENV_BIN / "jupyter"),
                self.app,
                "--no-browser",
                "--allow-root",
                f"--ServerApp.port={self.port}",
                "--ServerApp.port_retries=0",
                "--ServerApp.ip=127.0.0.1",
                f"--IdentityProvider.token={self.token}",
                f"--ServerApp.root_dir={self.root}",
                *(
                    ["--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"]
                    if self.app == "lab"
                    else []
                ),
                *self.extra_args,
            ],
            env=self.env(),
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"jupyter {self.app} exited early:\n{self.log()}")
            try:
                self.api("GET", "/api/status")
                return
            except (urllib.error.URLError, ConnectionError, OSError):
                time.sleep(0.3)
        raise RuntimeError(f"jupyter {self.app} did not answer within {timeout} s:\n{self.log()}")

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(timeout=10)
        if self._log is not None:
            self._log.close()

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-6000:]
        except OSError:
            return ""

    def api(self, method: str, path: str, body: Any = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            self.url + path,
            data=data,
            method=method,
            headers={"Authorization": f"token {self.token}", "Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=30) as response:
            text = response.read()
        return json.loads(text) if text else None

    def new_notebook(self, name: str, metadata: dict[str, Any] | None = None) -> str:
        """Write an (almost) empty Python notebook into the root; return its path."""
        nb = {
            "nbformat": 4,
            "nbformat_minor": 5,
            "metadata": {
                "kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"},
                "language_info": {"name": "python"},
                **(metadata or {}),
            },
            "cells": [
                {
                    "cell_type": "code",
                    "id": "first",
                    "metadata": {},
                    "source": "",
                    "outputs": [],
                    "execution_count": None,
                }
            ],
        }
        self.api(
            "PUT", f"/api/contents/{name}", {"type": "notebook", "format": "json", "content": nb}
        )
        return name

    def lab_url(self, notebook: str, workspace: str) -> str:
        return f"{self.url}/lab/workspaces/{workspace}/tree/{notebook}?reset&token={self.token}"

    def kernel_id(self, notebook: str) -> str | None:
        for session in self.api("GET", "/api/sessions"):
            if session.get("path") == notebook and session.get("kernel"):
                return session["kernel"]["id"]
        return None
