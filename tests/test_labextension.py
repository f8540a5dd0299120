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

# A clean build (npm install, webpack) and a pip install into a new environment take minutes
# on a loaded 2-core machine: the bound is that of their own commands, not the default 300 s.
pytestmark = pytest.mark.timeout(900)


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


def test_a_kernel_environment_pinned_to_older_pandas_and_numpy_keeps_them(
    wheel: Path, tmp_path: Path
) -> None:
    """Installing the package into a kernel's environment (for the recorder) upgrades nothing
    the person pinned: the research tools' pandas/pyarrow/matplotlib/metrics are the `eval`
    extra. The recorder then records there (`jupyter themisto record` in that environment)."""
    venv = tmp_path / "pinned"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    py = str(venv / "bin" / "python")
    pins = ["numpy==1.26.4", "pandas==2.1.4"]
    if sys.version_info < (3, 12):
        pins = ["numpy==1.23.5", "pandas==1.5.3"]

    def pip(*args: str) -> None:
        # (--no-compile: byte-compiling the ~100 packages took half of the test's time)
        proc = subprocess.run(
            [py, "-m", "pip", "install", "--quiet", "--no-compile", *args],
            capture_output=True,
            text=True,
            timeout=900,
        )
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    def versions() -> str:
        return subprocess.run(
            [py, "-c", "import numpy, pandas; print(numpy.__version__, pandas.__version__)"],
            capture_output=True,
            text=True,
            check=True,
            timeout=120,
        ).stdout.strip()

    pip(*pins)
    before = versions()
    assert before == " ".join(p.split("==")[1] for p in pins)
    pip(str(wheel))
    assert versions() == before

    notebook = tmp_path / "old.ipynb"
    cells = [
        "import numpy as np, pandas as pd",
        "df = pd.DataFrame({'a': np.arange(3)})\ndf['a'].sum()",
    ]
    notebook.write_text(
        json.dumps(
            {
                "nbformat": 4,
                "nbformat_minor": 5,
                "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3"}},
                "cells": [
                    {
                        "cell_type": "code",
                        "id": f"c{i}",
                        "source": src,
                        "metadata": {},
                        "outputs": [],
                        "execution_count": None,
                    }
                    for i, src in enumerate(cells)
                ],
            }
        )
    )
    store = tmp_path / "store.sqlite"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JUPYTER", "PYTHONPATH"))}
    env["JUPYTER_DATA_DIR"] = str(tmp_path / "data")
    proc = subprocess.run(
        [str(venv / "bin" / "jupyter-themisto"), "record", str(notebook), "--store", str(store)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]

    from jupyter_themisto.store import TrajectoryStore

    with TrajectoryStore(store, readonly=True) as s:
        (trajectory,) = s.list_trajectories()
        rows = s.list_executions(trajectory["id"])
        assert [r["status"] for r in rows] == ["ok", "ok"]
        assert rows[1]["outputs"][0]["data"]["text/plain"] == "3"
        variables = {v["name"]: v for v in s.get_variables(rows[1]["id"])}
    assert variables["df"]["summary"]["shape"] == [3, 1]
    # The research commands name the extra they need instead of a traceback.
    out = tmp_path / "dump"
    proc = subprocess.run(
        [str(venv / "bin" / "jupyter-themisto"), "export", "--store", str(store)]
        + ["--out", str(out), "--format", "parquet"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 2, proc.stderr
    assert "pip install 'jupyter-themisto[eval]'" in proc.stderr and "Traceback" not in proc.stderr
    assert not out.exists()
