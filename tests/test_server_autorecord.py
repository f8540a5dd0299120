"""Auto-record through a real server: kernels it starts record, kernelspecs untouched; opt-outs."""

from __future__ import annotations

import asyncio
import json
import sys
import uuid

import pytest

from jupyter_themisto.server.autorecord import LOADED_AT_START, OPTED_OUT
from jupyter_themisto.store import TrajectoryStore
from tests.helpers import (
    execute_content,
    post,
    run_cell,
    server_config,
    start_session,
    wait_for,
    write_notebook,
)


@pytest.fixture
def auto_record():
    return True


@pytest.fixture
def jp_server_config(store_path, auto_record):
    return server_config(auto_record=auto_record)


async def test_kernels_record_automatically(jp_fetch, jp_serverapp, jp_root_dir, store_path):
    app = jp_serverapp.web_app.settings["themisto_app"]
    write_notebook(jp_root_dir, "auto.ipynb")
    kernel_id = await start_session(jp_fetch, "auto.ipynb")
    assert app.auto_recorder.outcomes[kernel_id] == LOADED_AT_START
    await run_cell(jp_serverapp, kernel_id, "x = 41 + 1\nprint(x)")
    store = TrajectoryStore(store_path)
    traj = await wait_for(lambda: store.latest_trajectory_for_kernel(kernel_id))
    assert traj["notebook_path"] == "auto.ipynb"
    rows = await wait_for(lambda: store.list_executions(traj["id"]))
    assert [r["source"] for r in rows] == ["x = 41 + 1\nprint(x)"]
    assert rows[0]["outputs"][0]["text"] == "42\n"
    # The prediction routes find the live kernel's trajectory.
    r = await post(jp_fetch, "next-cell", {"kernel_id": kernel_id})
    assert r.body.decode().startswith("event: meta")
    # A restart is a new kernel process: it records again, as a new trajectory.
    del app.auto_recorder.outcomes[kernel_id]
    await jp_fetch("api", "kernels", kernel_id, "restart", method="POST", body="{}")
    assert app.auto_recorder.outcomes[kernel_id] == LOADED_AT_START
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
    assert app.auto_recorder.outcomes[kernel_id] == OPTED_OUT
    await run_cell(jp_serverapp, kernel_id, "y = 1")
    await asyncio.sleep(1.0)
    store = TrajectoryStore(store_path)
    assert store.latest_trajectory_for_kernel(kernel_id) is None
    store.close()
    await jp_fetch("api", "kernels", kernel_id, method="DELETE")


async def test_reading_the_switch_while_a_save_writes_the_notebook_loses_nothing(
    jp_fetch, jp_serverapp, jp_root_dir
):
    """A kernel starts while an autosave writes its notebook: the switch is read from a file
    that is half written. The read neither loses the notebook nor misreads the switch.
    (jupyter_server 2.21's notebook read moves a half-written notebook aside and puts the
    save's backup in its place; a save that ends between the two moves leaves no notebook:
    /work/notes/s44/save_race.py loses it within 5 rounds through that read.)"""
    app = jp_serverapp.web_app.settings["themisto_app"]
    metadata = {"themisto": {"record": False}}
    write_notebook(jp_root_dir, "saved.ipynb", metadata)
    cells = [
        {
            "cell_type": "code",
            "id": f"c{i}",
            "metadata": {},
            "source": f"x{i} = 1\n" * 4000,
            "outputs": [],
            "execution_count": None,
        }
        for i in range(20)
    ]
    notebook = {"nbformat": 4, "nbformat_minor": 5, "metadata": metadata, "cells": cells}
    body = json.dumps({"type": "notebook", "format": "json", "content": notebook})
    answers: list[bool] = []
    for _ in range(30):
        saving = asyncio.ensure_future(
            jp_fetch("api", "contents", "saved.ipynb", method="PUT", body=body)
        )
        while not saving.done():
            answers.append(await app.auto_recorder.opted_out("saved.ipynb"))
        await saving
        assert sorted(p.name for p in jp_root_dir.iterdir()) == [
            ".ipynb_checkpoints",
            "saved.ipynb",
        ]
        on_disk = json.loads((jp_root_dir / "saved.ipynb").read_text(encoding="utf-8"))
        assert len(on_disk["cells"]) == 20
    assert len(answers) >= 30
    assert all(answers), answers.count(False)


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


def execute_request(code):
    """An execute_request as JupyterLab sends it over the kernel websocket."""
    msg_id = uuid.uuid4().hex
    header = {
        "msg_id": msg_id,
        "msg_type": "execute_request",
        "username": "test",
        "session": "ws-test",
        "date": "",
        "version": "5.3",
    }
    msg = {
        "header": header,
        "parent_header": {},
        "metadata": {"cellId": f"cell-{msg_id[:6]}"},
        "content": execute_content(code),
        "channel": "shell",
        "buffers": [],
    }
    return msg_id, json.dumps(msg)


async def send_at_once(ws, codes, timeout=120.0):
    """Sends every cell at once (as "Run All" does); waits for every reply; returns msg ids."""
    ids = []
    for code in codes:
        msg_id, text = execute_request(code)
        ids.append(msg_id)
        await ws.write_message(text)
    pending = set(ids)
    deadline = asyncio.get_running_loop().time() + timeout
    while pending:
        left = deadline - asyncio.get_running_loop().time()
        assert left > 0, f"no reply to {len(pending)} cells"
        raw = await asyncio.wait_for(ws.read_message(), left)
        assert raw is not None, "the websocket closed"
        msg = json.loads(raw)
        if msg.get("msg_type") == "execute_reply":
            assert msg["content"]["status"] == "ok", msg["content"]
            pending.discard(msg["parent_header"].get("msg_id"))
    return ids


async def test_cells_sent_the_instant_a_kernel_starts_or_restarts_are_recorded(
    jp_fetch, jp_ws_fetch, jp_serverapp, jp_root_dir, store_path
):
    write_notebook(jp_root_dir, "fast.ipynb")
    kernel_id = await start_session(jp_fetch, "fast.ipynb")
    # The first request the kernel reads: no waiting for it to be ready.
    ws = await jp_ws_fetch("api", "kernels", kernel_id, "channels")
    cells = ["a = 1", "b = a + 1", "print(a + b)"]
    first = await send_at_once(ws, cells)
    store = TrajectoryStore(store_path)
    traj = await wait_for(lambda: store.latest_trajectory_for_kernel(kernel_id))
    assert traj["notebook_path"] == "fast.ipynb"
    rows = await wait_for(lambda: (r := store.list_executions(traj["id"])) and len(r) >= 3 and r)
    assert [r["msg_id"] for r in rows] == first
    assert [r["source"] for r in rows] == cells
    ws.close()

    # "Restart Kernel and Run All": the cells go out as soon as the restart request returns.
    await jp_fetch("api", "kernels", kernel_id, "restart", method="POST", body="{}")
    ws = await jp_ws_fetch("api", "kernels", kernel_id, "channels")
    run_all = [f"c{i} = {i}" for i in range(8)]
    again = await send_at_once(ws, run_all)
    newer = await wait_for(
        lambda: (t := store.latest_trajectory_for_kernel(kernel_id))["id"] != traj["id"] and t
    )
    rows = await wait_for(lambda: (r := store.list_executions(newer["id"])) and len(r) >= 8 and r)
    assert [r["msg_id"] for r in rows] == again
    assert newer["notebook_path"] == "fast.ipynb"
    ws.close()

    # The notebook opts out meanwhile: the next restart reads the switch again.
    write_notebook(jp_root_dir, "fast.ipynb", {"themisto": {"record": False}})
    await jp_fetch("api", "kernels", kernel_id, "restart", method="POST", body="{}")
    assert jp_serverapp.web_app.settings["themisto_app"].auto_recorder.outcomes[kernel_id] == (
        OPTED_OUT
    )
    ws = await jp_ws_fetch("api", "kernels", kernel_id, "channels")
    await send_at_once(ws, ["private = 1"])
    ws.close()
    await asyncio.sleep(1.0)
    assert store.latest_trajectory_for_kernel(kernel_id)["id"] == newer["id"]
    assert store.count_executions(newer["id"]) == 8
    store.close()
    await jp_fetch("api", "kernels", kernel_id, method="DELETE")


async def test_a_kernel_started_without_a_session_records(jp_fetch, jp_ws_fetch, store_path):
    r = await jp_fetch("api", "kernels", method="POST", body=json.dumps({"name": "python3"}))
    kernel_id = json.loads(r.body)["id"]
    ws = await jp_ws_fetch("api", "kernels", kernel_id, "channels")
    ids = await send_at_once(ws, ["x = 1", "x + 1"])
    ws.close()
    store = TrajectoryStore(store_path)
    traj = await wait_for(lambda: store.latest_trajectory_for_kernel(kernel_id))
    rows = await wait_for(lambda: (r := store.list_executions(traj["id"])) and len(r) >= 2 and r)
    assert [r["msg_id"] for r in rows] == ids
    assert traj["notebook_path"] is None
    store.close()
    await jp_fetch("api", "kernels", kernel_id, method="DELETE")


async def test_lost_executions_are_served_and_predicted_on(jp_fetch, store_path):
    store = TrajectoryStore(store_path)
    tid = store.create_trajectory(notebook_path="gaps.ipynb", kernel_id="k-gaps")
    store.add_execution(tid, {"source": "a = 1", "status": "ok", "snapshot_status": "off"})
    store.add_execution(
        tid,
        {
            "source": "b = a + 1",
            "status": "lost",
            "detail": "the execution could not be written: OperationalError: database is full",
            "wall_time": 0.01,
        },
    )
    store.add_execution(tid, {"source": "print(b)", "status": "ok", "outputs": []})
    store.close()
    r = await jp_fetch("themisto", "trajectories", tid, "executions")
    rows = json.loads(r.body)
    rows = rows.get("executions", rows) if isinstance(rows, dict) else rows
    assert [e["status"] for e in rows] == ["ok", "lost", "ok"]
    assert "database is full" in rows[1]["detail"]
    r = await post(jp_fetch, "next-cell", {"trajectory_id": tid, "backend": "retrieval"})
    assert r.code == 200 and "event: done" in r.body.decode()


async def test_a_python_kernel_that_is_not_ipykernel_is_loaded_late(
    jp_fetch, jp_serverapp, jp_root_dir, jp_data_dir, store_path
):
    """A Python kernelspec whose command line does not name ipykernel cannot take `--ext`: the
    server loads the recorder with a silent execute once the kernel is ready, and names the
    trajectory by the notebook's API path."""
    launcher = jp_data_dir / "start_kernel.py"
    launcher.write_text(
        "from ipykernel.kernelapp import launch_new_instance\nlaunch_new_instance()\n"
    )
    spec = jp_data_dir / "kernels" / "late-python"
    spec.mkdir(parents=True)
    argv = [sys.executable, str(launcher), "-f", "{connection_file}"]
    (spec / "kernel.json").write_text(
        json.dumps({"argv": argv, "display_name": "late", "language": "python"})
    )
    app = jp_serverapp.web_app.settings["themisto_app"]
    (jp_root_dir / "sub").mkdir()
    write_notebook(jp_root_dir / "sub", "late.ipynb")
    body = {
        "path": "sub/late.ipynb",
        "type": "notebook",
        "name": "late.ipynb",
        "kernel": {"name": "late-python"},
    }
    r = await jp_fetch("api", "sessions", method="POST", body=json.dumps(body))
    kernel_id = json.loads(r.body)["kernel"]["id"]
    await wait_for(lambda: kernel_id in app.auto_recorder.outcomes)
    assert app.auto_recorder.outcomes[kernel_id] == "loaded"
    await run_cell(jp_serverapp, kernel_id, "late = 1")
    store = TrajectoryStore(store_path)
    traj = await wait_for(lambda: store.latest_trajectory_for_kernel(kernel_id))
    rows = await wait_for(lambda: store.list_executions(traj["id"]))
    assert [r["source"] for r in rows] == ["late = 1"]
    assert traj["notebook_path"] == "sub/late.ipynb"
    store.close()
    await jp_fetch("api", "kernels", kernel_id, method="DELETE")
