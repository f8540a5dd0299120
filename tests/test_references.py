"""Library objects stored as references (jupyter_themisto/references.py), as an attacker would
try them: objects of the person's that pose as a library's, patched modules, metaclasses that
run code when looked at, other versions; and in a real kernel and through a real server."""

from __future__ import annotations

import json
import math
import pickle
import sys
import textwrap
import types
from collections import OrderedDict

import numpy as np
import pytest

from jupyter_themisto.kernel.pickling import small_value
from jupyter_themisto.references import (
    ReferenceMismatch,
    library_reference,
    load_reference,
    reference_pickle,
)
from tests.helpers import error_of, server_config

from .recorder_kernel import RecordingKernel


@pytest.mark.parametrize(
    "obj",
    [json.dumps, math.sin, OrderedDict, np.sin, np.sum, np.ndarray, pickle.Pickler, len],
    ids=lambda o: getattr(o, "__qualname__", repr(o)),
)
def test_library_objects_are_references_that_load_the_same_object(obj):
    ref = library_reference(obj)
    assert ref is not None and set(ref) == {"ref", "version", "check"}
    assert load_reference(ref) is obj
    assert pickle.loads(reference_pickle(ref)) is obj
    assert small_value(obj)  # the kernel may snapshot it itself: no code of the person's runs


def test_a_star_import_is_mostly_references():
    ns: dict = {}
    exec("from numpy import *", ns)
    names = [n for n, v in ns.items() if not n.startswith("_") and type(v) is not types.ModuleType]
    refs = {n: library_reference(ns[n]) for n in names}
    assert sum(r is not None for r in refs.values()) > 0.8 * len(names)
    assert refs["sin"]["ref"] == "numpy:sin" and refs["sin"]["version"].startswith("numpy ")


def _persons_module(tmp_path, monkeypatch, name, code):
    """A module of the person's: a file beside the notebook, imported from there."""
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(code))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, name, raising=False)
    return __import__(name)


def test_what_the_person_wrote_or_changed_is_never_a_reference(tmp_path, monkeypatch):
    # Their own module (beside the notebook, not an installed library).
    mine = _persons_module(
        tmp_path, monkeypatch, "helpers13", "def clean(x):\n    return x\nclass Row:\n    pass\n"
    )
    assert library_reference(mine.clean) is None and library_reference(mine.Row) is None
    # A function of theirs dressed up as json.dumps and put in its place.
    ns: dict = {}
    exec("def dumps(obj):\n    return 'fake'\n", ns)
    fake = ns["dumps"]
    fake.__module__, fake.__qualname__ = "json", "dumps"
    monkeypatch.setattr(json, "dumps", fake)
    assert library_reference(fake) is None
    # ... even with its code claiming a library's file: then a reference is made (nothing at
    # record time tells it apart), but it does not load the real json.dumps in its place.
    fake.__code__ = fake.__code__.replace(co_filename=json.__file__)
    ref = library_reference(fake)
    monkeypatch.undo()
    assert ref is not None
    with pytest.raises(ReferenceMismatch, match="not the recorded one"):
        load_reference(ref)
    # The real json.dumps while a module attribute holds something else: not identical.
    real = json.dumps
    monkeypatch.setattr(json, "dumps", lambda obj: "patched")
    assert library_reference(real) is None
    monkeypatch.undo()
    assert library_reference(real) is not None
    # A class of theirs with a library's name and module, with and without methods.
    ns = {}
    exec("class OrderedDict(dict):\n    def keys(self):\n        return []\n", ns)
    spoof = ns["OrderedDict"]
    spoof.__module__ = "collections"
    import collections

    monkeypatch.setattr(collections, "OrderedDict", spoof)
    assert library_reference(spoof) is None
    monkeypatch.undo()
    # Bound methods, lambdas, closures, nested functions: pickled as before.
    assert library_reference([].append) is None
    assert library_reference(lambda x: x) is None
    assert library_reference(np.random.rand) is None  # a method of numpy's global RandomState


def test_looking_at_an_object_runs_none_of_the_persons_code(tmp_path):
    marker = tmp_path / "ran.txt"
    ns: dict = {"MARK": str(marker)}
    exec(
        textwrap.dedent(
            """
            class Meta(type):
                def __getattribute__(cls, name):
                    open(MARK, "a").write(name + "\\n")
                    return type.__getattribute__(cls, name)
                def __getattr__(cls, name):
                    open(MARK, "a").write("getattr " + name + "\\n")
                    raise AttributeError(name)
            class Watched(metaclass=Meta):
                pass
            Watched.__module__ = "json"
            class Proxy:
                def __getattr__(self, name):
                    open(MARK, "a").write("proxy " + name + "\\n")
                    return "json"
            """
        ),
        ns,
    )
    for obj in (ns["Watched"], ns["Watched"](), ns["Proxy"]()):
        assert library_reference(obj) is None
        small_value(obj)
    assert not marker.exists()


def test_a_reference_never_loads_another_object(monkeypatch):
    ref = library_reference(json.dumps)
    assert ref is not None
    with pytest.raises(ReferenceMismatch, match="recorded with"):
        load_reference({**ref, "version": "python 2.7.18"})
    with pytest.raises(ReferenceMismatch, match="not the recorded one"):
        load_reference({**ref, "check": "000000000000"})
    with pytest.raises(ReferenceMismatch, match="no loads_everything"):
        load_reference({**ref, "ref": "json:loads_everything"})
    with pytest.raises(ReferenceMismatch, match="cannot import"):
        load_reference({**ref, "ref": "no_such_module_13:dumps"})
    # The name now holds another library function (same version, other shape): refused.
    monkeypatch.setattr(json, "dumps", json.loads)
    with pytest.raises(ReferenceMismatch):
        load_reference(ref)
    with pytest.raises(ReferenceMismatch):
        pickle.loads(reference_pickle(ref))


def test_a_kernel_records_a_star_import_as_references(tmp_path):
    k = RecordingKernel(
        tmp_path / "refs.sqlite",
        # A generous budget: a loaded machine must not send this to a child.
        ["--ThemistoRecorder.snapshot_delay=0", "--ThemistoRecorder.small_snapshot_seconds=5"],
    )
    try:
        star = k.run("from numpy import *\nfrom json import dumps")
        v = k.variables(star.msg_id)
        assert v["sin"]["summary"]["ref"] == "numpy:sin" and v["sin"]["blob_hash"] is None
        assert v["dumps"]["summary"]["ref"] == "json:dumps"
        row = k.execution(star.msg_id)
        assert row["snapshot_status"] == "ok"
        # Shadowed by the person's own function: pickled (by reference to __main__) as before.
        mine = k.run("def sin(x):\n    return 0")
        v2 = k.variables(mine.msg_id)
        assert "ref" not in v2["sin"]["summary"] and v2["sin"]["blob_hash"]
        assert v2["sin"]["changed"] is True and v2["cos"]["changed"] is False
        assert v2["cos"]["summary"] == v["cos"]["summary"]
    finally:
        k.shutdown()


@pytest.fixture
def jp_server_config(store_path):
    return server_config(default_backend="retrieval")


async def test_the_server_serves_a_reference_as_a_pickle_that_checks_it(jp_fetch, store):
    tid = store.create_trajectory()
    eid = store.add_execution(tid, {"source": "from json import dumps", "status": "ok"})
    ref = library_reference(json.dumps)
    stale = {**ref, "version": "python 2.7.18"}
    store.write_snapshot(
        eid,
        [
            {"name": "dumps", "type": "function", "summary": ref},
            {"name": "old", "type": "function", "summary": stale},
        ],
    )
    r = await jp_fetch("themisto", "executions", str(eid), "variables", "dumps", "blob")
    assert r.headers["X-Themisto-Codec"] == "reference"
    assert pickle.loads(r.body) is json.dumps
    r = await jp_fetch("themisto", "executions", str(eid), "variables", "old", "blob")
    with pytest.raises(ReferenceMismatch):
        pickle.loads(r.body)
    code, _ = await error_of(
        jp_fetch("themisto", "executions", str(eid), "variables", "nothing", "blob")
    )
    assert code == 404


def _snapshot_mode(k, msg_id):
    row = k.wait_snapshot(msg_id)
    with k.store() as store:
        return store.get_snapshot(row["id"])["mode"]


def test_the_kernel_snapshots_library_objects_itself_but_never_runs_the_persons_code(tmp_path):
    """A library's object (a Fraction, an argparse Namespace of plain values) is snapshotted by
    the kernel (no fork); one holding an object of the person's with a __reduce__, a class with
    a metaclass of theirs that runs code when looked at, or an instance of a class with a
    __getattribute__ of theirs goes to a child: their code never runs in the kernel."""
    marker = tmp_path / "ran-in.txt"
    k = RecordingKernel(
        tmp_path / "lib.sqlite",
        # A generous budget: a loaded machine must not send these to a child.
        ["--ThemistoRecorder.snapshot_delay=0", "--ThemistoRecorder.small_snapshot_seconds=5"],
    )
    try:
        kernel_pid = k.run("import os\nprint(os.getpid())").of("stream")[0]["text"].strip()
        lib = k.run(
            "import argparse, fractions\n"
            "third = fractions.Fraction(1, 3)\n"
            "opts = argparse.Namespace(rate=0.5, name='run', sizes=[1, 2])"
        )
        assert _snapshot_mode(k, lib.msg_id) == "inline"
        v = k.variables(lib.msg_id)
        assert v["third"]["blob_hash"] and v["opts"]["blob_hash"]
        assert pickle.loads(_blob(k, v["opts"]["blob_hash"])) == argparse_namespace()
        hostile = [
            # A library object holding one of theirs, whose __reduce__ runs code.
            "class _Loud:\n"
            "    def __reduce__(self):\n"
            f"        open({str(marker)!r}, 'a').write(f'{{os.getpid()}} reduce\\n')\n"
            "        return (_Loud, ())\n"
            "held = argparse.Namespace(inner=_Loud())",
            # A class whose metaclass runs code on any attribute lookup.
            "class _Meta(type):\n"
            "    def __getattribute__(cls, name):\n"
            f"        open({str(marker)!r}, 'a').write(f'{{os.getpid()}} meta {{name}}\\n')\n"
            "        return type.__getattribute__(cls, name)\n"
            "class Watched(metaclass=_Meta):\n"
            "    pass\n"
            "watched = Watched()",
            # An instance whose class looks every attribute up through code of theirs.
            "class Proxy:\n"
            "    def __getattribute__(self, name):\n"
            f"        open({str(marker)!r}, 'a').write(f'{{os.getpid()}} proxy {{name}}\\n')\n"
            "        return object.__getattribute__(self, name)\n"
            "proxy = Proxy()",
        ]
        for code in hostile:
            marker.unlink(missing_ok=True)
            done = k.run(code)
            assert _snapshot_mode(k, done.msg_id) == "fork", code
            ran_in = {line.split()[0] for line in marker.read_text().split("\n") if line}
            assert kernel_pid not in ran_in, (code, marker.read_text())
    finally:
        k.shutdown()


def argparse_namespace():
    import argparse

    return argparse.Namespace(rate=0.5, name="run", sizes=[1, 2])


def _blob(k, digest):
    with k.store() as store:
        return store.get_blob(digest)
