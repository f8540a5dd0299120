"""The packaged JupyterLab plugin: a wheel built from a clean source ships it; the lab sees it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent
LABEXT = "share/jupyter/labextensions/jupyter-themisto"


def _tracked_files() -> list[str]:
    out = subprocess.run(
        ["git", "ls-files", "-z"], cwd=ROOT, check=True, capture_output=True
    ).stdout
    return [name for name in out.decode().split("\0") if name]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Build a wheel from a copy of the tracked files: no node_modules, no earlier build."""
    source = tmp_path_factory.mktemp("source")
    for name in _tracked_files():
        src = ROOT / name
        if not src.is_file():  # deleted in the working tree, not yet committed
            continue
        dest = source / name
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dest)
    assert not (source / "labextension" / "node_modules").exists()
    assert not (source / "jupyter_themisto" / "labextension").exists()
    out = tmp_path_factory.mktemp("wheel")
    env = dict(os.environ)
    env["PATH"] = f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}"
    env["PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD"] = "1"
    env["YARN_ENABLE_IMMUTABLE_INSTALLS"] = "1"
    started = time.perf_counter()
    # No build isolation: the build requirements are already in the venv, and the test must not
    # need PyPI. The npm install does run for real (from yarn's cache when warm).
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", out, "."],
        cwd=source,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    print(f"\nwheel from a clean source built in {time.perf_counter() - started:.1f} s")
    wheels = list(out.glob("jupyter_themisto-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


def test_wheel_ships_the_prebuilt_labextension(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        data = next(n for n in names if n.endswith(".data/data/" + LABEXT + "/package.json"))
        package = json.loads(zf.read(data))
        prefix = data[: -len("package.json")]
        load = package["jupyterlab"]["_build"]["load"]
        assert prefix + load in names
        remote = zf.read(prefix + load).decode()
        assert "jupyter-themisto" in remote
        schema = json.loads(zf.read(prefix + "schemas/jupyter-themisto/plugin.json"))
        assert {
            "enabled",
            "backend",
            "trigger",
            "debounceMs",
            "suggestions",
            "predictOutputs",
            "outputBackend",
        } <= set(schema["properties"])
        install = json.loads(zf.read(prefix + "install.json"))
        assert install["packageName"] == "jupyter-themisto"
        # The server extension is enabled on install too.
        assert any(
            n.endswith("etc/jupyter/jupyter_server_config.d/jupyter_themisto.json") for n in names
        )
    assert package["name"] == "jupyter-themisto"


def test_labextension_list_shows_it_enabled() -> None:
    proc = subprocess.run(
        [str(VENV_BIN / "jupyter"), "labextension", "list"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "NO_COLOR": "1"},
    )
    listing = proc.stdout + proc.stderr
    line = next((ln for ln in listing.splitlines() if "jupyter-themisto" in ln), None)
    assert line is not None, listing
    assert "enabled" in line and "OK" in line, line
    assert "disabled" not in line


def test_server_extension_list_shows_it_enabled_and_ok() -> None:
    proc = subprocess.run(
        [str(VENV_BIN / "jupyter"), "server", "extension", "list"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "NO_COLOR": "1"},
    )
    listing = proc.stdout + proc.stderr
    lines = listing.splitlines()
    at = next((i for i, ln in enumerate(lines) if "jupyter_themisto" in ln), None)
    assert at is not None, listing
    assert "enabled" in lines[at], lines[at]
    # The line after names the extension app and says it loads ("… OK").
    assert "OK" in " ".join(lines[at : at + 3]), lines[at : at + 3]
