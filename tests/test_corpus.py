"""benchmarks/corpus.py: the committed manifest is valid and leaves out the reserved
repositories; materialize checks a pinned commit out of a real local git mirror (idempotent,
restored by --force, absent blobs reported); bad manifests are refused with a clear error;
the splits are deterministic and disjoint; record + stats run real kernels end to end."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_notebook

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("corpus", ROOT / "benchmarks" / "corpus.py")
assert _spec and _spec.loader
corpus = importlib.util.module_from_spec(_spec)
sys.modules["corpus"] = corpus
_spec.loader.exec_module(corpus)


def git(cwd: Path, *args: str) -> str:
    env = {
        **os.environ,
        "GIT_AUTHOR_NAME": "t",
        "GIT_AUTHOR_EMAIL": "t@example.org",
        "GIT_COMMITTER_NAME": "t",
        "GIT_COMMITTER_EMAIL": "t@example.org",
    }
    r = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


@pytest.fixture
def mirror(tmp_path, monkeypatch):
    """A repository 'someone/tutorial' in a mirror laid out as fetch lays it out, and a
    manifest pinning its first commit."""
    work = tmp_path / "work"
    (work / "lesson").mkdir(parents=True)
    (work / "lesson" / "data.csv").write_text("x,y\n1,2\n3,4\n")
    (work / "lesson" / "helper.py").write_text("def double(v):\n    return 2 * v\n")
    cells = [
        "import csv\nrows = list(csv.DictReader(open('data.csv')))\nlen(rows)",
        "from helper import double\nprint(double(int(rows[1]['y'])))",
        "1 / 0",
    ]
    nb = new_notebook(cells=[new_code_cell(c) for c in cells])
    nbformat.write(nb, str(work / "lesson" / "intro.ipynb"))
    git(work, "init", "-q")
    git(work, "add", ".")
    git(work, "commit", "-q", "-m", "first")
    commit = git(work, "rev-parse", "HEAD")
    (work / "lesson" / "data.csv").write_text("changed later\n")
    git(work, "commit", "-q", "-am", "second")
    root = tmp_path / "mirror"
    (root / "someone+tutorial").mkdir(parents=True)
    git(tmp_path, "clone", "-q", "--bare", str(work), str(root / "someone+tutorial" / "repo"))
    manifest = tmp_path / "corpus.json"
    manifest.write_text(
        json.dumps(
            {
                "repositories": [
                    {
                        "repo": "someone/tutorial",
                        "commit": commit,
                        "notebooks": ["lesson/intro.ipynb"],
                    }
                ]
            }
        )
    )
    monkeypatch.setenv("THEMISTO_CORPUS_MIRROR", str(root))
    monkeypatch.setenv("THEMISTO_CORPUS_MANIFEST", str(manifest))
    return {"root": root, "commit": commit, "manifest": manifest, "dest": tmp_path / "dest"}


def test_committed_manifest_is_valid_and_excludes_reserved_repositories(monkeypatch):
    monkeypatch.delenv("THEMISTO_CORPUS_MANIFEST", raising=False)
    m = corpus.load_manifest()
    repos = [r["repo"] for r in m["repositories"]]
    assert len(repos) >= 6 and len(set(repos)) == len(repos)
    assert not set(repos) & corpus.RESERVED
    assert set(m["excluded"]["reserved"]) == corpus.RESERVED
    # No fork or copy of a reserved repository under another owner either.
    reserved_names = {r.split("/")[1].lower() for r in corpus.RESERVED}
    assert not {r.split("/")[1].lower() for r in repos} & reserved_names
    assert sum(len(r["notebooks"]) for r in m["repositories"]) >= 45
    for r in m["repositories"]:
        assert set(r.get("notes", {})) <= set(r["notebooks"]), r["repo"]
    assert corpus.manifest_hash(m) == corpus.manifest_hash(json.loads(json.dumps(m)))


def test_materialize_checks_out_the_pinned_commit_idempotently(mirror):
    dest = mirror["dest"]
    (path,) = corpus.materialize(dest, quiet=True)
    folder = dest / "someone__tutorial"
    assert path == folder / "lesson" / "intro.ipynb" and path.is_file()
    # The pinned commit's tree, not the mirror's newest one.
    assert (folder / "lesson" / "data.csv").read_text() == "x,y\n1,2\n3,4\n"
    assert (folder / "lesson" / "helper.py").is_file()
    marker = json.loads((folder / corpus.MARKER).read_text())
    assert marker == {"repo": "someone/tutorial", "commit": mirror["commit"], "missing": []}
    # A second run leaves the checkout alone; --force restores what a notebook changed.
    (folder / "lesson" / "data.csv").write_text("scribbled")
    assert corpus.notebooks(dest) == [path]
    assert (folder / "lesson" / "data.csv").read_text() == "scribbled"
    corpus.materialize(dest, force=True, quiet=True)
    assert (folder / "lesson" / "data.csv").read_text() == "x,y\n1,2\n3,4\n"
    assert corpus.notebook_key(path, dest) == "someone/tutorial:lesson/intro.ipynb"
    assert not [p for p in dest.iterdir() if p.name.startswith(".someone__tutorial")]


def test_materialize_reports_blobs_the_mirror_lacks(mirror):
    repo = mirror["root"] / "someone+tutorial" / "repo"
    sha = git(repo, "rev-parse", f"{mirror['commit']}:lesson/data.csv")
    subprocess.run(["git", "--git-dir", str(repo), "repack", "-a", "-d", "-q"], check=True)
    # Unpack everything but that blob, as a mirror that leaves out large files would be.
    packs = list((repo / "objects" / "pack").glob("*.pack"))
    for pack in packs:
        moved = pack.with_suffix(".keep-aside")
        pack.rename(moved)
        pack.with_suffix(".idx").unlink()
        subprocess.run(
            ["git", "--git-dir", str(repo), "unpack-objects", "-q"],
            stdin=moved.open("rb"),
            check=True,
        )
        moved.unlink()
    (repo / "objects" / sha[:2] / sha[2:]).unlink()
    corpus.materialize(mirror["dest"], quiet=True)
    folder = mirror["dest"] / "someone__tutorial"
    marker = json.loads((folder / corpus.MARKER).read_text())
    assert marker["missing"] == ["lesson/data.csv"]
    assert not (folder / "lesson" / "data.csv").exists()
    assert (folder / "lesson" / "intro.ipynb").is_file()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"repo": "wesm/pydata-book"}, "reserved"),
        ({"repo": "not a repo"}, "'owner/name'"),
        ({"commit": "abc"}, "40 lowercase hex"),
        ({"notebooks": []}, "non-empty list"),
        ({"notebooks": ["../../etc/passwd.ipynb"]}, "bad notebook path"),
        ({"notebooks": ["/abs/nb.ipynb"]}, "bad notebook path"),
    ],
)
def test_bad_manifests_are_refused(mirror, change, message):
    m = json.loads(mirror["manifest"].read_text())
    m["repositories"][0].update(change)
    mirror["manifest"].write_text(json.dumps(m))
    with pytest.raises(corpus.CorpusError, match=message):
        corpus.materialize(mirror["dest"], quiet=True)
    assert not (mirror["dest"] / "someone__tutorial").exists()


def test_unknown_commit_is_a_clear_error(mirror, tmp_path):
    m = json.loads(mirror["manifest"].read_text())
    m["repositories"][0]["commit"] = "0" * 40
    mirror["manifest"].write_text(json.dumps(m))
    r = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "corpus.py"), "materialize"]
        + ["--dest", str(mirror["dest"])],
        capture_output=True,
        text=True,
        # Not in the mirror: the clone is tried from a git server that does not exist.
        env={**os.environ, "THEMISTO_CORPUS_GIT_BASE": str(tmp_path / "no-server")},
        timeout=120,
    )
    assert r.returncode == 2
    assert r.stderr.startswith("corpus.py: error: someone/tutorial: ")
    assert "git clone" in r.stderr and "no-server" in r.stderr
    assert "Traceback" not in r.stderr


def test_folds_and_leave_one_out_are_deterministic_and_disjoint():
    keys = [f"owner/repo{i % 3}:nb{i}.ipynb" for i in range(11)]
    a, b = corpus.folds(keys + keys[:4], 2)
    assert (a, b) == tuple(corpus.folds(list(reversed(keys)), 2))
    assert set(a).isdisjoint(b) and sorted(a + b) == sorted(keys)
    assert abs(len(a) - len(b)) <= 1
    three = corpus.folds(keys, 3)
    assert sorted(sum(three, [])) == sorted(keys)
    loo = list(corpus.leave_one_out(keys))
    assert [h for h, _ in loo] == sorted(keys)
    assert all(h not in rest and len(rest) == len(keys) - 1 for h, rest in loo)
    rows = [{"nb": k, "i": i} for i, k in enumerate(keys)]
    test, train = corpus.split_by(rows, lambda r: r["nb"], a)
    assert {r["nb"] for r in test} == set(a) and {r["nb"] for r in train} == set(b)
    with pytest.raises(ValueError):
        corpus.folds(keys, 1)


def test_spread_takes_notebooks_from_each_repository_in_turn(tmp_path, monkeypatch):
    dest = tmp_path / "dest"
    counts = {"a/x": {"one": 5, "two": 1, "three": 4}, "b/y": {"four": 6}}
    paths = []
    for repo, notebooks in counts.items():
        for name, n in notebooks.items():
            cells = [new_code_cell(f"x = {i}") for i in range(n)] + [new_code_cell("  \n")]
            path = dest / repo.replace("/", "__") / "nb" / f"{name}.ipynb"
            path.parent.mkdir(parents=True, exist_ok=True)
            nbformat.write(new_notebook(cells=cells), str(path))
            paths.append(path)
    monkeypatch.setattr(corpus, "notebooks", lambda dest=None: list(paths))
    assert corpus.code_cells(paths[0]) == [f"x = {i}" for i in range(5)]  # blank cells left out

    def keys(chosen):
        return [corpus.notebook_key(p, dest) for p in chosen]

    eligible_a = sorted(["a/x:nb/one.ipynb", "a/x:nb/three.ipynb"], key=corpus._rank)
    # One from each repository, then a second round; too few cells: never.
    assert keys(corpus.spread(2, 3, dest)) == [eligible_a[0], "b/y:nb/four.ipynb"]
    assert keys(corpus.spread(10, 3, dest)) == [eligible_a[0], "b/y:nb/four.ipynb", eligible_a[1]]
    assert keys(corpus.spread(10, 6, dest)) == ["b/y:nb/four.ipynb"]
    assert len(corpus.spread(10, 0, dest)) == 4
    assert corpus.spread(0, 0, dest) == []


def test_record_then_stats_with_real_kernels(mirror, tmp_path):
    store = tmp_path / "corpus.sqlite"
    path = corpus.ensure_recorded(store, dest=mirror["dest"])
    assert path == store.resolve()
    (result,) = corpus.recording_results(store)
    assert (result["cells"], result["ok"], result["errors"]) == (3, 2, 1)
    assert result["key"] == "someone/tutorial:lesson/intro.ipynb"
    s = corpus.stats(store, mirror["dest"])
    assert (s["notebooks"], s["code_cells"], s["ok"], s["error"]) == (1, 3, 2, 1)
    # len(rows) -> "2", print(double(4)) -> "8", and the ZeroDivisionError's text.
    assert s["text_output"] == 3 and s["ok_text_output"] == 2
    assert s["next_cell"] == 2
    assert s["per_repo"]["someone/tutorial"]["cells"] == 3
    # Recorded once: a second call reuses the store as it is.
    before = store.stat().st_mtime_ns
    assert corpus.ensure_recorded(store, dest=mirror["dest"]) == path
    assert store.stat().st_mtime_ns == before
