"""A third-party backend, installed as a separate distribution, served without a patch."""

from __future__ import annotations

import json
import textwrap

import pytest

from jupyter_themisto.backends import available_backends, create_backend
from jupyter_themisto.store import TrajectoryStore
from tests.helpers import post, server_config

PLUGIN = textwrap.dedent(
    '''
    """A test-only backend shipped by the distribution `themisto-echo`."""
    from jupyter_themisto.backends import NextCellChunk, OutputChunk, Predictor


    class EchoPredictor(Predictor):
        name = "echo"
        description = "repeats the last cell"

        async def predict_next_cell(self, ctx, *, n=1):
            last = ctx.cells[-1].source if ctx.cells else ""
            prefix = self.config.get("prefix", "")
            # (an early answer first, which the first suggestion replaces)
            yield NextCellChunk(index=0, text="early")
            for i in range(n):
                text, score = prefix + last, 1.0 / (i + 1)
                yield NextCellChunk(index=i, text=text, done=True, score=score, replace=i == 0)

        async def predict_output(self, ctx):
            yield OutputChunk(text=(ctx.target_source or "").upper())


    class NotAPredictor:
        pass
    '''
)


@pytest.fixture
def plugin_dist(tmp_path, monkeypatch):
    """Installs `themisto-echo` (module + .dist-info with entry points) on sys.path."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "themisto_echo.py").write_text(PLUGIN)
    info = site / "themisto_echo-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: themisto-echo\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        "[jupyter_themisto.backends]\n"
        "echo = themisto_echo:EchoPredictor\n"
        "broken = themisto_echo:NotAPredictor\n"
        "missing = themisto_echo_not_installed:Nothing\n"
    )
    monkeypatch.syspath_prepend(str(site))
    return site


@pytest.fixture
def jp_server_config(store_path, plugin_dist):
    return server_config(default_backend="echo", backend_settings={"echo": {"prefix": "# again\n"}})


def test_registry_finds_the_plugin(plugin_dist):
    assert {"echo", "broken", "missing", "retrieval"} <= set(available_backends())
    assert create_backend("echo").name == "echo"


async def test_server_serves_the_plugin_backend(jp_fetch, store_path):
    store = TrajectoryStore(store_path)
    tid = store.create_trajectory(kernel_id="k")
    store.add_execution(tid, {"source": "print('hi')", "status": "ok"})
    r = await jp_fetch("themisto", "backends")
    body = json.loads(r.body)
    assert body["default"] == "echo"
    entries = {b["name"]: b for b in body["backends"]}
    assert entries["echo"]["health"]["ok"] and entries["echo"]["description"]
    # Broken plugins are listed as unhealthy; they do not hide the others.
    assert entries["broken"]["health"]["ok"] is False
    assert "cannot be loaded" in entries["missing"]["health"]["detail"]
    r = await post(jp_fetch, "next-cell", {"kernel_id": "k", "n": 2})
    text = r.body.decode()
    assert '"backend": "echo"' in text
    assert text.count('"text": "# again\\nprint(\'hi\')"') == 2
    assert '"text": "early", "done": false}' in text and text.count('"replace": true') == 1
    r = await post(jp_fetch, "output", {"trajectory_id": tid, "source": "abc"})
    assert '"text": "ABC"' in r.body.decode()
    store.close()
