"""Auto-record through a real server: kernels it starts record, kernelspecs untouched; opt-outs."""

from __future__ import annotations

import asyncio
import json

import nbformat
import pytest

from jupyter_themisto.store import TrajectoryStore


@pytest.fixture
def auto_record():
    return True


@pytest.fixture
def jp_server_config(store_path, auto_record):
    return {
        "ServerApp": {"jpserver_extensions": {"jupyter_themisto": True}},
        "ThemistoExtensionApp": {"auto_record": auto_record},
    }


def write_notebook(root, name, metadata=None):
    nb = nbformat.v4.new_notebook()
    nb.metadata.update(metadata or {})
    nb.cells.append(nbformat.v4.new_code_cell("x = 41 + 1"))
    nbformat.write(nb, str(root / name))


async def start_session(jp_fetch, path):
    body = {"path": path, "type": "notebook", "name": path, "kernel": {"name": "python3"}}
    r = await jp_fetch("api", "sessions", method="POST", body=json.dumps(body))
    return json.loads(r.body)["kernel"]["id"]


async def run_cell(jp_serverapp, kernel_id, code):
    kc = jp_serverapp.kernel_manager.get_kernel(kernel_id).client()
    kc.start_channels()
    try:
        await kc.wait_for_ready(timeout=60)
        reply = await kc.execute(code, reply=True, timeout=60)
        assert reply["content"]["status"] == "ok"
    finally:
        kc.stop_channels()


async def wait_for(predicate, timeout=60.0):
    for _ in range(int(timeout / 0.1)):
        value = predicate()
        if value:
            return value
        await asyncio.sleep(0.1)
    raise AssertionError("timed out waiting")


async def test_kernels_record_automatically(jp_fetch, jp_serverapp, jp_root_dir, store_path):
    app = jp_serverapp.web_app.settings["themisto_app"]
    write_notebook(jp_root_dir, "auto.ipynb")
    kernel_id = await start_session(jp_fetch, "auto.ipynb")
    await wait_for(lambda: kernel_id in app.auto_recorder.outcomes)
    assert app.auto_recorder.outcomes[kernel_id] == "loaded"
    await run_cell(jp_serverapp, kernel_id, "x = 41 + 1\nprint(x)")
    store = TrajectoryStore(store_path)
    traj = await wait_for(lambda: store.latest_trajectory_for_kernel(kernel_id))
    assert traj["notebook_path"] == "auto.ipynb"
    rows = await wait_for(lambda: store.list_executions(traj["id"]))
    # The silent %load_ext is not part of the person's trajectory.
    assert [r["source"] for r in rows] == ["x = 41 + 1\nprint(x)"]
    assert rows[0]["outputs"][0]["text"] == "42\n"
    # The prediction routes find the live kernel's trajectory.
    r = await jp_fetch(
        "themisto", "predict", "next-cell", method="POST", body=json.dumps({"kernel_id": kernel_id})
    )
    assert r.body.decode().startswith("event: meta")
    # A restart is a new kernel process: it records again, as a new trajectory.
    del app.auto_recorder.outcomes[kernel_id]
    await jp_fetch("api", "kernels", kernel_id, "restart", method="POST", body="{}")
    await wait_for(lambda: kernel_id in app.auto_recorder.outcomes)
    assert app.auto_recorder.outcomes[kernel_id] == "loaded"
    await run_cell(jp_serverapp, kernel_id, "after_restart = 1")
    newer = await wait_for(
        lambda: (t := store.latest_trajectory_for_kernel(kernel_id))["id"] != traj["id"] and t
    )
    rows = await wait_for(lambda: store.list_executions(newer["id"]))
    assert [r["source"] for r in rows] == ["after_restart = 1"]
    assert newer["notebook_path"] == "auto.ipynb"
    store.close()
    await jp_fetch("api", "kernels", kernel_id, method="DELETE")


async def test_notebook_metadata_opts_out(jp_fetch, jp_serverapp, jp_root_dir, store_path):
    app = jp_serverapp.web_app.settings["themisto_app"]
    write_notebook(jp_root_dir, "private.ipynb", {"themisto": {"record": False}})
    kernel_id = await start_session(jp_fetch, "private.ipynb")
    await wait_for(lambda: kernel_id in app.auto_recorder.outcomes)
    assert app.auto_recorder.outcomes[kernel_id] == "opted out"
    await run_cell(jp_serverapp, kernel_id, "y = 1")
    await asyncio.sleep(1.0)
    store = TrajectoryStore(store_path)
    assert store.latest_trajectory_for_kernel(kernel_id) is None
    store.close()
    await jp_fetch("api", "kernels", kernel_id, method="DELETE")


@pytest.mark.parametrize("auto_record", [False])
async def test_server_switch_off(jp_fetch, jp_serverapp, jp_root_dir, store_path):
    app = jp_serverapp.web_app.settings["themisto_app"]
    write_notebook(jp_root_dir, "off.ipynb")
    kernel_id = await start_session(jp_fetch, "off.ipynb")
    await run_cell(jp_serverapp, kernel_id, "z = 1")
    await asyncio.sleep(1.0)
    assert app.auto_recorder.outcomes == {}
    store = TrajectoryStore(store_path)
    assert store.count_executions() == 0
    store.close()
    await jp_fetch("api", "kernels", kernel_id, method="DELETE")
