"""Secrets planted in every path a value can take — a secret-named variable, a copy in another
name, a list and a DataFrame holding it, a credential-shaped literal, `os.environ`, an inherited
environment variable, a displayed dict, a value known secret only later, the browser's cells —
are found in none of: the API's answers, the server's logs, the store's file bytes, an export
with full snapshots, and the requests a (loopback) model server receives."""

from __future__ import annotations

import html
import io
import json
import logging

import pytest
from tornado.httpclient import HTTPClientError

from jupyter_themisto.redaction import REDACTED, SECRET_VALUE_REASON, key_path
from jupyter_themisto.store import TrajectoryStore
from tests.helpers import body_of, cli, post, server_config
from tests.peers import OpenAIPeer
from tests.recorder_kernel import RecordingKernel

PLANTED = {
    "name": "hunter2-planted-value-0001",
    "shape": "sk-proj-PLANTED0002abcdefghijklmnop",
    "environ": "envplanted-0003-abcdef",
    "shown": "dictplanted-0004-xyz",
    "inherited": "inheritedplanted-0005",
    "late": "lateplanted-0006-value",
}
CELLS = [
    "import os\nimport pandas as pd",
    f"api_key = {PLANTED['name']!r}",
    "x = api_key\nholder = [x, 1]\nframe = pd.DataFrame({'c': [x, 'other']})\nprint(x)\nx",
    f"model_cfg = {PLANTED['shape']!r}\nmodel_cfg",
    f"os.environ['OPENAI_API_KEY'] = {PLANTED['environ']!r}",
    "print(os.environ['OPENAI_API_KEY'])",
    # A displayed dict whose value is in no source and no variable.
    "print({'pass' + 'word': 'dict' + 'planted-0004-xyz'})",
    "print(os.environ['PLANTED_SERVICE_TOKEN'])",
    # Printed and snapshotted while nobody knows it is secret...
    "val = 'late' + 'planted-0006-value'\nprint(val)",
    # ...until it is bound to a secret name.
    "secret_later = val",
    # The secret as bytes a person encoded (not found as UTF-8 or UTF-32 inside the pickle).
    "wide = api_key.encode('utf-16')\nwide_be = api_key.encode('utf-16-be')",
    "n = 3\nn * 2",
]


@pytest.fixture
def peer():
    with OpenAIPeer(reply="n + 1") as p:
        yield p


@pytest.fixture
def jp_server_config(store_path, peer):
    return server_config(
        # Not the embedded model (the default with the [llm] extra): these tests are not
        # about it, and it would answer slowly on a busy machine.
        default_backend="retrieval",
        backend_settings={"openai": {"base_url": peer.url, "max_retries": 0}},
    )


@pytest.fixture
def recorded(store_path, monkeypatch):
    monkeypatch.setenv("PLANTED_SERVICE_TOKEN", PLANTED["inherited"])
    kernel = RecordingKernel(store_path)
    try:
        ids = []
        for i, code in enumerate(CELLS):
            ids.append(kernel.send(code, cell_id=f"cell-{i}"))
            executed = kernel.collect(ids[-1])
            assert executed.reply["status"] == "ok", executed.reply
            kernel.wait_snapshot(ids[-1])
        rows = kernel.executions()
        yield kernel, rows
    finally:
        kernel.shutdown()


def leaks(data: bytes | str) -> list[str]:
    """The planted secrets found in `data` (as UTF-8, or in bytes also as numpy's UTF-32 and
    UTF-16 of either byte order)."""
    if isinstance(data, str):
        data = data.encode("utf-8", "surrogatepass")
    found = []
    for name, value in PLANTED.items():
        encodings = ("utf-8", "utf-32-le", "utf-16-le", "utf-16-be")
        if any(value.encode(e) in data for e in encodings):
            found.append(name)
    return found


def files_holding_the_recording(store_path, out) -> tuple[list, object]:
    """The store's files (not its key: a random key only) and those of a full export of it
    into `out` (with every blob), and the export's finished process."""
    done = cli("export", "--out", str(out), "--snapshots", "full", store=store_path)
    assert done.returncode == 0, done.stderr
    stored = [f for f in store_path.parent.iterdir() if f.is_file() and f.suffix != ".key"]
    return stored + [f for f in out.rglob("*") if f.is_file()], done


async def test_planted_secrets_leak_nowhere(
    jp_fetch, jp_serverapp, recorded, store_path, peer, caplog, tmp_path
):
    kernel, rows = recorded
    caplog.set_level(logging.DEBUG)
    ext_log = next(iter(jp_serverapp.extension_manager.extension_apps["jupyter_themisto"])).log
    ext_lines = io.StringIO()
    handler = logging.StreamHandler(ext_lines)
    ext_log.addHandler(handler)

    # What the kernel recorded: sources and outputs scrubbed, holders stubbed.
    by_cell = {r["cell_id"]: r for r in rows}
    assert by_cell["cell-1"]["source"] == f"api_key = {REDACTED!r}"
    assert REDACTED in by_cell["cell-6"]["outputs"][0]["text"]
    with TrajectoryStore(store_path, readonly=True) as store:
        variables = {v["name"]: v for v in store.get_variables(rows[-1]["id"])}
        early = {v["name"]: v for v in store.get_variables(by_cell["cell-8"]["id"])}
    for name in ("x", "holder", "frame", "model_cfg", "val", "wide", "wide_be"):
        assert variables[name]["stub_reason"] == SECRET_VALUE_REASON, name
        assert variables[name]["blob_hash"] is None and variables[name]["fingerprint"] is None
    assert variables["api_key"]["stub_reason"].startswith("redacted")
    assert variables["n"]["blob_hash"] and variables["n"]["summary"]["repr"] == "3"
    # Snapshotted before it was known secret, stubbed when it became so.
    assert early["val"]["stub_reason"] == SECRET_VALUE_REASON

    tid = rows[0]["trajectory_id"]
    bodies = [
        await body_of(jp_fetch("themisto", "trajectories")),
        await body_of(jp_fetch("themisto", "trajectories", tid)),
        await body_of(jp_fetch("themisto", "trajectories", tid, "executions")),
    ]
    for r in rows:
        bodies.append(await body_of(jp_fetch("themisto", "executions", str(r["id"]), "variables")))
        for name in ("x", "holder", "frame", "model_cfg", "val", "api_key", "secret_later", "n"):
            bodies.append(
                await body_of(
                    jp_fetch("themisto", "executions", str(r["id"]), "variables", name, "blob")
                )
            )
    # The browser sends the notebook's cells and the cell to predict, secrets and all.
    cells = [{"cell_type": "code", "source": c} for c in CELLS]
    cells += [
        {"cell_type": "markdown", "source": f"Key for the demo: {PLANTED['shape']}"},
        {"cell_type": "code", "source": f"copy = {PLANTED['late']!r}"},
        {"cell_type": "code", "source": f"shown = {PLANTED['shown']!r}"},
    ]
    for backend in ("openai", "retrieval"):
        body = {"trajectory_id": tid, "backend": backend}
        bodies.append(await body_of(post(jp_fetch, "next-cell", {**body, "cells": cells})))
        source = f"check({PLANTED['inherited']!r}, {PLANTED['environ']!r})"
        bodies.append(await body_of(post(jp_fetch, "output", {**body, "source": source})))
    ext_log.removeHandler(handler)

    # The loopback model server was asked (the prompts are real) and saw no secret.
    assert len(peer.requests) == 2
    prompt = json.dumps([req.body for req in peer.requests])
    assert "print(x)" in prompt and REDACTED in prompt
    assert leaks(prompt) == []
    for b in bodies:
        assert leaks(b) == [], b[:500]
    assert leaks(caplog.text) == [] and leaks(ext_lines.getvalue()) == []

    # The store's files hold none of them, nor does an export with every blob.
    kernel.settle()
    files, done = files_holding_the_recording(store_path, tmp_path / "dump")
    assert any(f.parent.name == "blobs" for f in files)
    for f in files:
        assert leaks(f.read_bytes()) == [], f
    assert leaks(done.stdout + done.stderr) == []


async def test_a_secret_typed_again_before_the_kernel_knows_it_reaches_no_model(jp_fetch, peer):
    """The browser's cells bind a secret literal (`db_password = "…"`) and use the value again
    where no rule sees a secret (`login("…")`) before the kernel has run them (or while another
    process locks the store, so its keyed hash cannot land): the request's own binding is
    enough for the server to scrub the value everywhere in what the model is sent. A key that
    only looks like one (`sort_key`) is left as the person wrote it."""
    typed = "typedplanted-0007-value"
    cells = [
        {"cell_type": "code", "source": "sort_key = 'sepal_length'"},
        {"cell_type": "code", "source": f"db_password = {typed!r}"},
        {"cell_type": "markdown", "source": f"Log in with {typed} below."},
        {"cell_type": "code", "source": f"session = login({typed!r})\nsorted_by('sepal_length')"},
    ]
    body = {"backend": "openai", "cells": cells, "notebook_path": "typed.ipynb"}
    answer = (await body_of(post(jp_fetch, "next-cell", body))).decode()
    assert len(peer.requests) == 1
    prompt = json.dumps(peer.requests[0].body)
    assert "session = login(" in prompt and "sorted_by(" in prompt  # the cells reached it
    assert typed not in prompt and typed not in answer
    assert prompt.count(REDACTED) >= 3
    assert prompt.count("sepal_length") == 2


async def test_no_context_goes_to_a_model_server_while_the_key_cannot_follow_its_hashes(
    jp_fetch, jp_serverapp, store_path, peer, caplog
):
    """A kernel learnt a value is secret (its keyed hash is in the store); the store's key is
    then lost. The browser's cells show that value where no rule but the hash finds it (a
    literal in a call): nothing is sent to the HTTP backend (503, saying why and how to go on),
    local backends answer as before; once allowed, the context goes out unscrubbed (what the
    refusal kept from the model server); with the key back it goes out scrubbed."""
    value = "unfollowedplanted-0008"
    rows, _ = run_recorded(store_path, ["secret_later = 'unfollowed' + 'planted-0008'"], "unf")
    key = key_path(store_path)
    kept = key.read_bytes()
    key.unlink()
    cells = [
        {"cell_type": "code", "source": "import json"},
        {"cell_type": "code", "source": f"session = connect({value!r})"},
    ]
    body = {"backend": "openai", "cells": cells, "notebook_path": "unfollowed.ipynb"}
    caplog.set_level(logging.INFO)

    with pytest.raises(HTTPClientError) as refused:
        await post(jp_fetch, "next-cell", body)
    assert refused.value.code == 503
    message = json.loads(refused.value.response.body)["message"]
    assert str(key) in message and "missing or damaged" in message
    assert "allow_unfollowed_secrets" in message and value not in message
    with pytest.raises(HTTPClientError) as refused_output:
        output = {"backend": "openai", "trajectory_id": rows[0]["trajectory_id"]}
        await post(jp_fetch, "output", {**output, "source": f"connect({value!r})"})
    assert refused_output.value.code == 503
    assert peer.requests == []  # nothing reached the model server
    # The local backends go on (nothing leaves the machine).
    local = await post(jp_fetch, "next-cell", {**body, "backend": "retrieval"})
    assert local.code == 200

    manager = jp_serverapp.web_app.settings["themisto_manager"]
    manager.allow_unfollowed_secrets = True
    await post(jp_fetch, "next-cell", body)
    assert len(peer.requests) == 1 and value in json.dumps(peer.requests[0].body)

    manager.allow_unfollowed_secrets = False
    key.write_bytes(kept)
    # (the server reads the key again when the store's hashes change: a kernel learns one)
    kernel = RecordingKernel(store_path)
    try:
        mid = kernel.send("password = 'another' + 'planted-0009'")
        assert kernel.collect(mid).reply["status"] == "ok"
        kernel.settle()
    finally:
        kernel.shutdown()
    await post(jp_fetch, "next-cell", body)
    assert len(peer.requests) == 2
    prompt = json.dumps(peer.requests[1].body)
    assert value not in prompt and "session = connect(" in prompt and REDACTED in prompt
    assert value not in caplog.text


ORDINARY = [
    # What tutorials do with keys and tokens: none of these values is a secret.
    "d = {'key1': 'value1', 'species': 'setosa'}\nfor key in d:\n    print(key, d[key])",
    "sort_key = 'sepal_length'\ntokens = 'the quick brown fox'.split()\n"
    "bos_token = '<|endoftext|>'",
    "print(sort_key, bos_token, d['key1'])",
    # A real one among them is still followed.
    "import os\nos.environ['SERVICE_TOKEN'] = 'svc-planted-0007'\nx = 'svc-planted-0007'",
]


def run_recorded(store_path, cells: list[str], prefix: str) -> tuple[list, dict]:
    """Run `cells` (each must succeed) in a recording kernel: the rows recorded, and the
    variables of the last one's snapshot by name."""
    kernel = RecordingKernel(store_path)
    try:
        for i, code in enumerate(cells):
            mid = kernel.send(code, cell_id=f"{prefix}-{i}")
            assert kernel.collect(mid).reply["status"] == "ok"
            kernel.wait_snapshot(mid)
        rows = kernel.executions()
        with TrajectoryStore(store_path, readonly=True) as store:
            variables = {v["name"]: v for v in store.get_variables(rows[-1]["id"])}
        kernel.settle()
    finally:
        kernel.shutdown()
    return rows, variables


def test_ordinary_keys_and_tokens_are_not_followed(store_path):
    rows, variables = run_recorded(store_path, ORDINARY, "ord")
    recorded = json.dumps([[r["source"], r["outputs"]] for r in rows])
    for word in ("value1", "setosa", "sepal_length", "<|endoftext|>", "quick"):
        assert word in recorded, word
    assert rows[0]["outputs"][0]["text"] == "key1 value1\nspecies setosa\n"
    for name in ("d", "key", "sort_key", "tokens", "bos_token"):
        assert variables[name]["stub_reason"] is None, name
        assert variables[name]["blob_hash"], name
    assert "svc-planted-0007" not in recorded
    assert variables["x"]["stub_reason"] == SECRET_VALUE_REASON


# & < > " ': a table escapes the first three, html.escape the quotes too.
HTML_SECRET = "p&ss<w0rd>42\"q'x"
HTML_CELLS = [
    "import html\nimport pandas as pd\nfrom IPython.display import HTML, display",
    f"password = {HTML_SECRET!r}",
    "pd.DataFrame({'c': [password]})",
    "display(HTML(html.escape(password)))\nescaped = html.escape(password, quote=False)",
]


def test_a_secret_escaped_for_html_leaks_nowhere(store_path, tmp_path):
    rows, variables = run_recorded(store_path, HTML_CELLS, "html")
    forms = {HTML_SECRET, html.escape(HTML_SECRET, quote=False), html.escape(HTML_SECRET)}
    forms |= {json.dumps(f)[1:-1] for f in forms}  # as the JSON files write them

    def html_leaks(data: bytes | str) -> list[str]:
        text = data.decode("utf-8", "replace") if isinstance(data, bytes) else data
        return [f for f in forms if f in text]

    # The table and the page still read "<redacted>" where the value was.
    table = rows[2]["outputs"][0]["data"]
    assert "<td>&lt;redacted&gt;</td>" in table["text/html"] and REDACTED in table["text/plain"]
    assert rows[3]["outputs"][0]["data"]["text/html"] == "&lt;redacted&gt;"
    assert html_leaks(json.dumps(rows, ensure_ascii=False)) == []
    assert variables["escaped"]["stub_reason"] == SECRET_VALUE_REASON
    files, _ = files_holding_the_recording(store_path, tmp_path / "dump")
    exported = (tmp_path / "dump" / "executions.jsonl").read_text()
    assert "&lt;redacted&gt;" in exported and html_leaks(exported) == []
    for f in files:
        assert html_leaks(f.read_bytes()) == [], f


# Built by concatenation: no cell's source holds the value as a literal bound to a name.
NESTED = {
    "record": "nested-planted-0011",
    "other_record": "nested-planted-0012",
    "deep": "deep-planted-0013",
    "tuple": "tuple-planted-0014",
}
NESTED_CELLS = [
    "accounts = [{'user': 'ann', 'password': 'nested-' + 'planted-0011'},\n"
    "            {'user': 'bob', 'password': 'nested-' + 'planted-0012'}]",
    "cfg = {'env': {'prod': {'db': {'conn': {'api_key': 'deep-' + 'planted-0013'}}}}}",
    "creds = ({'user': 'x', 'auth_token': 'tuple-' + 'planted-0014'},)",
    "print(accounts[1]['password'], cfg['env']['prod']['db']['conn']['api_key'])",
    "copy = creds[0]['auth_token']\nrows = [{'user': f'u{i}', 'score': i} for i in range(100)]",
]


def test_secrets_in_lists_of_records_and_deep_configs_leak_nowhere(store_path, tmp_path):
    """Values under secret-named keys are followed however the dicts nest: in a list or tuple
    of records, and five dicts deep (they were followed two levels deep, and not in lists)."""
    rows, variables = run_recorded(store_path, NESTED_CELLS, "nested")

    def nested_leaks(data: bytes | str) -> list[str]:
        if isinstance(data, str):
            data = data.encode("utf-8", "surrogatepass")
        return [k for k, v in NESTED.items() if v.encode() in data]

    assert rows[3]["outputs"][0]["text"] == f"{REDACTED} {REDACTED}\n"
    for name in ("accounts", "cfg", "creds", "copy"):
        assert variables[name]["stub_reason"] == SECRET_VALUE_REASON, name
    # Records that name no secret are kept as they are.
    assert variables["rows"]["stub_reason"] is None and variables["rows"]["blob_hash"]
    assert nested_leaks(json.dumps(rows, ensure_ascii=False)) == []
    files, _ = files_holding_the_recording(store_path, tmp_path / "dump")
    for f in files:
        assert nested_leaks(f.read_bytes()) == [], f


def test_secrets_of_other_notebooks_and_in_markdown_leave_no_notebook_file_unscrubbed(tmp_path):
    """Notebook A binds a value to a secret name; notebook B, recorded after it into the same
    store, prints that value, and unpacks another one into a secret name (`user, password =
    'bob', '…'`), repeated in a markdown cell. Neither value is in the store's file nor anywhere
    in an export, its notebook_cells table (the notebook files, for the live setting) included,
    and the name unpacked beside the secret one keeps its value."""
    import nbformat
    from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

    known, typed = "xkcdplanted-0010-known", "mdplanted-0011-typed"
    store = tmp_path / "store" / "store.sqlite"
    store.parent.mkdir()
    a, b = tmp_path / "a.ipynb", tmp_path / "b.ipynb"
    nbformat.write(new_notebook(cells=[new_code_cell(f"db_password = {known!r}")]), a)
    cells = [
        new_code_cell(f"print('plain', {known!r})"),
        new_markdown_cell(f"Log in with {typed} (bound below)."),
        new_code_cell(f"user, password = 'bob', {typed!r}\nprint('ok')"),
    ]
    nbformat.write(new_notebook(cells=cells), b)
    for nb in (a, b):  # one after the other: B's kernel starts once A's hash is stored
        done = cli("record", str(nb), "--timeout", "120", store=store)
        assert done.returncode == 0, done.stderr

    files, done = files_holding_the_recording(store, tmp_path / "dump")
    cells_file = next(f for f in files if f.name.startswith("notebook_cells"))
    assert "Log in with" in cells_file.read_text() and "'bob'" in cells_file.read_text()
    for f in files:
        data = f.read_bytes()
        assert known.encode() not in data and typed.encode() not in data, f


def test_a_kernels_first_cell_is_scrubbed_of_the_values_other_kernels_recorded(store_path):
    """A kernel's first cell prints a value another kernel recorded as secret: the source is
    scrubbed before it is written, though the kernel reads the store's hashes only then."""
    value = "firstplanted-0013-value"
    for code in (f"db_password = {value!r}", f"print('plain', {value!r})"):
        kernel = RecordingKernel(store_path)
        try:
            assert kernel.collect(kernel.send(code)).reply["status"] == "ok"
            kernel.settle()
        finally:
            kernel.shutdown()
    with TrajectoryStore(store_path, readonly=True) as store:
        sources = [store.list_executions(t["id"])[0]["source"] for t in store.list_trajectories()]
    assert sorted(sources) == sorted(
        [f"db_password = {REDACTED!r}", f"print('plain', {REDACTED!r})"]
    )
    assert value.encode() not in store_path.read_bytes()


def test_a_secret_quoted_by_an_error_is_not_recorded_as_the_reason(store_path):
    """A value's `__reduce__` raises an error quoting a secret the kernel knows: the variable
    is a stub whose reason says why without the value, in the store and in the kernel's log."""
    value = "stubplanted-0012-value"
    cells = [
        f"db_password = {value!r}",
        "class Leaky:\n    def __reduce__(self):\n"
        "        raise ValueError('cannot pickle, pw=' + db_password)\nleaky = Leaky()",
    ]
    rows, variables = run_recorded(store_path, cells, "leaky")
    reason = variables["leaky"]["stub_reason"]
    assert reason.startswith("unpicklable: ValueError: cannot pickle, pw=") and REDACTED in reason
    assert value not in json.dumps(rows)
    assert value.encode() not in store_path.read_bytes()


def test_secret_names_bound_to_other_than_a_string_are_followed(store_path):
    """Values bound to secret names that are not plain strings: bytearray, a number, numbers
    and strings in lists and nested dicts, a DataFrame's secret-named column. None is in the
    store's file (sources, outputs, summaries, blobs); an ordinary number stays."""
    planted = {
        "ba": "baplanted0015",
        "num": "27182818284",
        "nested": "31415926535",
        "listed": "listplanted0016",
        "frame": "dfplanted0017",
    }
    cells = [
        f"api_key = bytearray(b'{planted['ba']}')\nprint(api_key)",
        f"password = {planted['num']}\nprint('pin', password, 123456)",
        f"cfg = {{'db': {{'password': {planted['nested']}}}}}\nprint(cfg)",
        f"users = {{'name': ['bob'], 'password': ['{planted['listed']}', 'other-value-9']}}\n"
        "print(users)",
        "import pandas as pd\n"
        f"df = pd.DataFrame({{'user': ['bob'], 'password': ['{planted['frame']}']}})\ndf",
        f"print({planted['num']} + 0, {planted['frame']!r})",
    ]
    rows, _ = run_recorded(store_path, cells, "typed")
    data = b"".join(p.read_bytes() for p in store_path.parent.glob(store_path.name + "*"))
    for name, value in planted.items():
        assert value.encode() not in data, name
        assert value not in json.dumps(rows), name
    assert "123456" in json.dumps(rows)  # (a number bound to no secret name)


def test_a_secret_in_a_traceback_a_cell_shows_without_failing_is_scrubbed(store_path):
    """A cell that shows a traceback and goes on (`showtraceback()` in an `except`, an error
    inside `run_cell`): the error outputs recorded for them have the secret value scrubbed from
    their evalue and traceback, as every other output; the value is not in the store's file."""
    value = "tbplanted-0018-value"
    cells = [
        f"db_password = {value!r}",
        "try:\n    raise ValueError('login failed for ' + db_password)\n"
        "except ValueError:\n    get_ipython().showtraceback()\nprint('went on')",
        "get_ipython().run_cell('raise KeyError(db_password)')",
    ]
    rows, _ = run_recorded(store_path, cells, "shown")
    shown, inner = rows[1]["outputs"][0], rows[2]["outputs"][0]
    assert shown["output_type"] == inner["output_type"] == "error", rows
    assert shown["evalue"] == f"login failed for {REDACTED}" and REDACTED in inner["evalue"]
    assert any(REDACTED in line for line in shown["traceback"] + inner["traceback"])
    assert rows[1]["outputs"][1]["text"] == "went on\n"
    assert value not in json.dumps(rows)
    data = b"".join(p.read_bytes() for p in store_path.parent.glob(store_path.name + "*"))
    assert value.encode() not in data
