"""The JupyterLab plugin's own checks, run from pytest so that CI counts them.

`jlpm lint:check` (prettier and eslint) must pass; `jlpm test` runs the jest unit tests of
labextension/src/**/__tests__/, those of the transport against a real `jupyter server` with the
extension started here (its `openai` backend calls a model server the jest tests run on a port
chosen here). Every jest test found in the spec files is a pytest test of its own, and jest must
have run exactly those.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, get_args

import pytest

from jupyter_themisto.backends.base import Task
from tests.ui.lab import JupyterLab, free_port

ROOT = Path(__file__).resolve().parents[1]
LABEXT = ROOT / "labextension"
VENV_BIN = Path(sys.executable).parent
# The jest run (its own bound: 600 s) and the server it talks to are set up in a fixture that
# counts towards the first test's time: more than the default 300 s on a loaded machine.
pytestmark = pytest.mark.timeout(900)

# `it('title', …)` / `it("title", …)` in the spec files: what jest must report, one by one.
_IT = re.compile(r"""^\s*it\(\s*(?P<q>['"])(?P<title>.+?)(?P=q),""", re.M)


def _expected_tests() -> list[tuple[str, str]]:
    found = []
    for spec in sorted(LABEXT.glob("src/**/__tests__/*.spec.ts")):
        rel = spec.relative_to(LABEXT).as_posix()
        titles = [m.group("title") for m in _IT.finditer(spec.read_text())]
        assert len(titles) == len(set(titles)), f"{rel}: test titles must be unique"
        found += [(rel, title) for title in titles]
    return found


EXPECTED = _expected_tests()


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}"  # jlpm, and the scripts' jlpm
    env.update(extra)
    return env


def _jlpm(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    if not (LABEXT / "node_modules" / ".bin" / "jest").exists():
        pytest.fail("labextension/node_modules lacks the dev tools: run `bash .ci/setup`")
    return subprocess.run(
        [str(VENV_BIN / "jlpm"), *args],
        cwd=LABEXT,
        env=env or _env(),
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_lint_check() -> None:
    proc = _jlpm("lint:check")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert "All matched files use Prettier code style!" in out
    # eslint prints a summary only when it has something to say: no errors and no warnings.
    summary = re.search(r"(\d+) problems? \((\d+) errors?, (\d+) warnings?\)", out)
    assert summary is None or summary.group(2) == "0", out[-6000:]
    assert summary is None, f"eslint warnings:\n{out[-6000:]}"


def test_task_union_matches_the_server() -> None:
    """The frontend's `Task` union names the server's tasks (backends/base.py's `Task`)."""
    types = (LABEXT / "src" / "common" / "types.ts").read_text()
    union = re.search(r"^export type Task = ([^;]+);", types, re.M)
    assert union is not None, "labextension/src/common/types.ts declares no Task union"
    assert sorted(re.findall(r"'([^']+)'", union.group(1))) == sorted(get_args(Task))


@pytest.fixture(scope="module")
def jupyter_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[JupyterLab, int]]:
    model_port = free_port()
    openai = {
        "base_url": f"http://127.0.0.1:{model_port}/v1",
        "model": "loopback-model",
        "api_key": "test",
        "max_retries": 0,
    }
    server = JupyterLab(
        tmp_path_factory.mktemp("frontend-server"),
        [
            f"--ThemistoExtensionApp.backend_settings={json.dumps({'openai': openai})}",
            "--ThemistoExtensionApp.default_backend=openai",
        ],
        app="server",
    )
    server.start()
    try:
        yield server, model_port
    finally:
        server.stop()


@pytest.fixture(scope="module")
def jest_report(
    jupyter_server: tuple[JupyterLab, int], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    server, model_port = jupyter_server
    out = tmp_path_factory.mktemp("jest") / "report.json"
    proc = _jlpm(
        "test",
        "--ci",
        "--json",
        f"--outputFile={out}",
        env=_env(
            THEMISTO_TEST_SERVER_URL=server.url,
            THEMISTO_TEST_SERVER_TOKEN=server.token,
            THEMISTO_TEST_MODEL_PORT=str(model_port),
        ),
    )
    print(proc.stderr[-3000:])  # jest's own summary, shown with -s or on failure
    assert out.exists(), f"jest wrote no report:\n{proc.stdout[-3000:]}{proc.stderr[-6000:]}"
    report = json.loads(out.read_text())
    report["exit_code"] = proc.returncode
    report["output"] = proc.stderr
    report["server_log"] = server.log()
    return report


def _results(report: dict[str, Any]) -> dict[tuple[str, str], dict[str, Any]]:
    results = {}
    for suite in report["testResults"]:
        rel = Path(suite["name"]).resolve().relative_to(LABEXT).as_posix()
        for test in suite["assertionResults"]:
            results[(rel, test["title"])] = test
    return results


def test_jest_ran_every_test(jest_report: dict[str, Any]) -> None:
    results = _results(jest_report)
    assert len(EXPECTED) >= 20, EXPECTED  # the spec files were found and read
    assert sorted(results) == sorted(EXPECTED), jest_report["output"][-4000:]
    assert jest_report["numTotalTests"] == len(EXPECTED)
    assert jest_report["numPendingTests"] == 0 and jest_report["numTodoTests"] == 0
    assert jest_report["numRuntimeErrorTestSuites"] == 0, jest_report["output"][-4000:]
    failed = jest_report["numFailedTests"]
    assert jest_report["numPassedTests"] == len(EXPECTED) - failed
    assert (jest_report["exit_code"] == 0) == (failed == 0 and jest_report["success"])


@pytest.mark.parametrize(("spec", "title"), EXPECTED, ids=[f"{s}::{t}" for s, t in EXPECTED])
def test_jest(jest_report: dict[str, Any], spec: str, title: str) -> None:
    result = _results(jest_report).get((spec, title))
    assert result is not None, f"jest did not run {title!r}:\n{jest_report['output'][-4000:]}"
    messages = "\n".join(result["failureMessages"])
    if "server.spec.ts" in spec and result["status"] != "passed":
        messages += "\n--- jupyter server log ---\n" + jest_report["server_log"]
    assert result["status"] == "passed", messages
