"""The benchmark corpus: real public notebooks written by others, pinned in corpus.json.

Figures on quality, overhead and output preview count only on these notebooks. The manifest
(benchmarks/corpus.json) names each repository, the commit it is pinned to and the notebooks
in it; this script brings them here and records them with the project's own CLI. The notebooks
are never committed to this project.

    python benchmarks/corpus.py materialize [--dest DIR] [--force]
    python benchmarks/corpus.py list [--dest DIR]
    python benchmarks/corpus.py record --store PATH [--jobs N] [--timeout S] [--dest DIR]
    python benchmarks/corpus.py stats --store PATH

`materialize` checks out each pinned commit's whole tree (notebooks read sibling data files)
into DEST/<owner>__<name>/. The git objects come from a local mirror when one is there
($THEMISTO_CORPUS_MIRROR, default /work/.mirror: <owner>+<name>/repo, bare or with a .git),
else from a `git clone` of https://github.com/<owner>/<name> ($THEMISTO_CORPUS_GIT_BASE replaces
https://github.com) into DEST/.git-cache/. DEST is --dest, else $THEMISTO_CORPUS_DIR, else
~/.cache/jupyter-themisto/corpus.

Other benchmark scripts import it:

    import corpus
    paths = corpus.notebooks()                      # materialized on first use
    some = corpus.spread(6, min_cells=10)           # 6 notebooks from 6 repositories
    store = corpus.ensure_recorded(Path("/tmp/corpus.sqlite"))
    for held_out, rest in corpus.leave_one_out(keys): ...
    first, second = corpus.folds(keys, 2)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

HERE = Path(__file__).resolve().parent
MANIFEST = HERE / "corpus.json"
MARKER = ".themisto-corpus.json"
RESERVED = {
    "jakevdp/PythonDataScienceHandbook",
    "wesm/pydata-book",
    "jrjohansson/scientific-python-lectures",
    "ageron/handson-ml3",
    "rougier/numpy-100",
}
_REPO = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")
_COMMIT = re.compile(r"^[0-9a-f]{40}$")
T = TypeVar("T")


class CorpusError(Exception):
    """Something the person can fix: printed as one line, exit status 2."""


# ---------------------------------------------------------------------------- the manifest


def load_manifest(path: Path | None = None) -> dict[str, Any]:
    """The manifest (default: benchmarks/corpus.json, or $THEMISTO_CORPUS_MANIFEST), checked:
    every repository has `repo`, a 40-hex `commit` and notebooks."""
    path = path or Path(os.environ.get("THEMISTO_CORPUS_MANIFEST") or MANIFEST)
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CorpusError(f"no corpus manifest at {path}") from None
    except json.JSONDecodeError as e:
        raise CorpusError(f"{path} is not valid JSON: {e}") from None
    repos = manifest.get("repositories")
    if not isinstance(repos, list) or not repos:
        raise CorpusError(f"{path}: 'repositories' must be a non-empty list")
    seen: set[str] = set()
    for i, r in enumerate(repos):
        where = f"{path}: repositories[{i}]"
        name = r.get("repo") if isinstance(r, dict) else None
        if not isinstance(name, str) or not _REPO.match(name):
            raise CorpusError(f"{where}: 'repo' must be 'owner/name', got {name!r}")
        if name in RESERVED:
            raise CorpusError(f"{where}: {name} is reserved for an independent check")
        if name in seen:
            raise CorpusError(f"{where}: {name} is listed twice")
        seen.add(name)
        if not isinstance(r.get("commit"), str) or not _COMMIT.match(r["commit"]):
            raise CorpusError(f"{where} ({name}): 'commit' must be 40 lowercase hex digits")
        nbs = r.get("notebooks")
        if not isinstance(nbs, list) or not nbs or not all(isinstance(n, str) for n in nbs):
            raise CorpusError(f"{where} ({name}): 'notebooks' must be a non-empty list of paths")
        for n in nbs:
            if n.startswith("/") or ".." in Path(n).parts or not n.endswith(".ipynb"):
                raise CorpusError(f"{where} ({name}): bad notebook path {n!r}")
    return manifest


def manifest_hash(manifest: dict[str, Any] | None = None) -> str:
    """sha256 of what decides a recording: repositories, commits and notebooks, in order."""
    manifest = manifest or load_manifest()
    pinned = [(r["repo"], r["commit"], r["notebooks"]) for r in manifest["repositories"]]
    return hashlib.sha256(json.dumps(pinned, sort_keys=True).encode()).hexdigest()


def default_dest() -> Path:
    env = os.environ.get("THEMISTO_CORPUS_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "jupyter-themisto" / "corpus"


def repo_dir(dest: Path, repo: str) -> Path:
    return dest / repo.replace("/", "__")


# ------------------------------------------------------------------------------- materialize


def _git(*args: str, git_dir: Path | None = None, **kw: Any) -> subprocess.CompletedProcess:
    cmd = ["git"] + (["--git-dir", str(git_dir)] if git_dir else []) + list(args)
    return subprocess.run(cmd, capture_output=True, **kw)


def _has_commit(git_dir: Path, commit: str) -> bool:
    return _git("cat-file", "-e", f"{commit}^{{commit}}", git_dir=git_dir).returncode == 0


def _mirror_git_dir(repo: str) -> Path | None:
    root = Path(os.environ.get("THEMISTO_CORPUS_MIRROR", "/work/.mirror"))
    base = root / repo.replace("/", "+") / "repo"
    for candidate in (base / ".git", base):
        if (candidate / "HEAD").is_file() and (candidate / "objects").is_dir():
            return candidate
    return None


def git_dir_for(repo: str, commit: str, dest: Path) -> Path:
    """A git directory holding `commit`: the local mirror, else a bare clone cached in DEST."""
    mirror = _mirror_git_dir(repo)
    if mirror is not None and _has_commit(mirror, commit):
        return mirror
    cache = dest / ".git-cache" / (repo.replace("/", "__") + ".git")
    url = os.environ.get("THEMISTO_CORPUS_GIT_BASE", "https://github.com/").rstrip("/") + f"/{repo}"
    if not (cache / "HEAD").is_file():
        print(f"  cloning {url} …", flush=True)
        cache.parent.mkdir(parents=True, exist_ok=True)
        r = _git("clone", "--bare", "--quiet", url, str(cache), text=True)
        if r.returncode != 0:
            shutil.rmtree(cache, ignore_errors=True)
            where = f"no mirror at {mirror.parent.parent}" if mirror else "no local mirror"
            raise CorpusError(f"{repo}: {where}, and git clone {url} failed: {r.stderr.strip()}")
    if not _has_commit(cache, commit):
        r = _git("fetch", "--quiet", "origin", commit, git_dir=cache, text=True)
        if r.returncode != 0 or not _has_commit(cache, commit):
            raise CorpusError(f"{repo}: commit {commit} is not in {url}: {r.stderr.strip()}")
    return cache


def _extract(git_dir: Path, commit: str, into: Path) -> list[str]:
    """Write the commit's whole tree into `into`; returns the paths whose blobs are absent
    (a mirror may leave out large files), which are skipped."""
    listing = _git("ls-tree", "-r", "-z", commit, git_dir=git_dir, check=True).stdout
    entries: list[tuple[str, str, str]] = []
    for item in listing.split(b"\0"):
        if not item:
            continue
        meta, path = item.split(b"\t", 1)
        mode, kind, sha = meta.decode().split()
        if kind == "blob":  # submodules ("commit") have no content here
            entries.append((mode, sha, path.decode("utf-8", "surrogateescape")))
    missing: list[str] = []
    cmd = ["git", "--git-dir", str(git_dir), "cat-file", "--batch"]
    with subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE) as proc:
        assert proc.stdin is not None and proc.stdout is not None
        for mode, sha, path in entries:
            proc.stdin.write(sha.encode() + b"\n")
            proc.stdin.flush()
            header = proc.stdout.readline().split()
            if not header or header[-1] == b"missing":
                missing.append(path)
                continue
            data = proc.stdout.read(int(header[2]))
            proc.stdout.read(1)  # the newline after the object
            target = into / path
            target.parent.mkdir(parents=True, exist_ok=True)
            if mode == "120000":
                os.symlink(data.decode("utf-8", "surrogateescape"), target)
            else:
                target.write_bytes(data)
                if mode == "100755":
                    target.chmod(0o755)
        proc.stdin.close()
    return missing


def _marker(folder: Path) -> dict[str, Any] | None:
    try:
        return json.loads((folder / MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def materialize(
    dest: Path | None = None, *, force: bool = False, quiet: bool = False
) -> list[Path]:
    """Check out every pinned repository into DEST (idempotent); returns the notebook paths."""
    dest = (dest or default_dest()).expanduser().resolve()
    manifest = load_manifest()
    dest.mkdir(parents=True, exist_ok=True)
    say = (lambda *a: None) if quiet else (lambda *a: print(*a, flush=True))
    for r in manifest["repositories"]:
        folder = repo_dir(dest, r["repo"])
        mark = _marker(folder)
        if not force and mark and mark.get("commit") == r["commit"]:
            say(f"{r['repo']}: at {r['commit'][:12]} in {folder}")
            continue
        t0 = time.monotonic()
        git_dir = git_dir_for(r["repo"], r["commit"], dest)
        tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=dest))
        try:
            missing = _extract(git_dir, r["commit"], tmp)
            (tmp / MARKER).write_text(
                json.dumps({"repo": r["repo"], "commit": r["commit"], "missing": missing}, indent=1)
            )
            shutil.rmtree(folder, ignore_errors=True)
            tmp.rename(folder)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        note = f"; {len(missing)} files absent from the git source" if missing else ""
        say(f"{r['repo']}: checked out {r['commit'][:12]} ({time.monotonic() - t0:.1f} s){note}")
    paths = _notebook_paths(manifest, dest)
    absent = [p for p in paths if not p.is_file()]
    if absent:
        raise CorpusError(
            f"{len(absent)} listed notebooks are not in their checkout, e.g. {absent[0]} "
            "(the git source lacks them: clone from GitHub, THEMISTO_CORPUS_MIRROR=/nonexistent)"
        )
    return paths


def _notebook_paths(manifest: dict[str, Any], dest: Path) -> list[Path]:
    return [repo_dir(dest, r["repo"]) / n for r in manifest["repositories"] for n in r["notebooks"]]


def notebooks(dest: Path | None = None) -> list[Path]:
    """The corpus notebooks' paths, in manifest order, materialized first if need be."""
    return materialize(dest, quiet=True)


def code_cells(path: Path) -> list[str]:
    """The non-empty code cells' sources of a notebook file, in file order."""
    nb = json.loads(path.read_text(encoding="utf-8"))
    sources = (
        "".join(c["source"]) if isinstance(c["source"], list) else c["source"]
        for c in nb.get("cells", [])
        if c.get("cell_type") == "code"
    )
    return [s for s in sources if s.strip()]


def spread(n: int, min_cells: int = 0, dest: Path | None = None) -> list[Path]:
    """`n` corpus notebooks with at least `min_cells` non-empty code cells, spread over the
    repositories: one from each in manifest order, then a second from each, and so on; within
    a repository in the order of their keys' sha256 (fixed, and not always chapter one)."""
    by_repo: dict[str, list[Path]] = {}
    for path in notebooks(dest):
        if len(code_cells(path)) >= min_cells:
            by_repo.setdefault(repo_of(notebook_key(path, dest)), []).append(path)
    queues = [sorted(ps, key=lambda p: _rank(notebook_key(p, dest))) for ps in by_repo.values()]
    chosen: list[Path] = []
    while len(chosen) < n and any(queues):
        for queue in queues:
            if queue and len(chosen) < n:
                chosen.append(queue.pop(0))
    return chosen


def notebook_key(path: str | Path, dest: Path | None = None) -> str:
    """'owner/name:path/in/repo' for a materialized notebook path (a trajectory's
    notebook_path): the identity splits group by."""
    dest = (dest or default_dest()).expanduser().resolve()
    rel = Path(path).resolve().relative_to(dest)
    return rel.parts[0].replace("__", "/", 1) + ":" + "/".join(rel.parts[1:])


def repo_of(key: str) -> str:
    return key.split(":", 1)[0]


# ------------------------------------------------------------------------------------ splits


def _rank(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def folds(keys: Iterable[str], k: int = 2) -> list[list[str]]:
    """`k` folds of the distinct keys (notebook keys), deterministic and balanced: keys ordered
    by their sha256 are dealt round-robin. Every instance of one notebook lands in one fold."""
    if k < 2:
        raise ValueError("k must be at least 2")
    ordered = sorted(set(keys), key=_rank)
    return [ordered[i::k] for i in range(k)]


def leave_one_out(keys: Iterable[str]) -> Iterator[tuple[str, list[str]]]:
    """(held-out notebook, all the others) for every distinct key, in a fixed order."""
    ordered = sorted(set(keys))
    for i, key in enumerate(ordered):
        yield key, ordered[:i] + ordered[i + 1 :]


def split_by(items: Sequence[T], key: Any, held_out: Iterable[str]) -> tuple[list[T], list[T]]:
    """(items whose key(item) is in held_out, the rest)."""
    held = set(held_out)
    test = [x for x in items if key(x) in held]
    train = [x for x in items if key(x) not in held]
    return test, train


# ------------------------------------------------------------------------------------ record


def _cli(*args: str, timeout: float | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "jupyter_themisto.cli", *args]
    env = {k: v for k, v in os.environ.items() if k != "THEMISTO_STORE"}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


def _statuses(store: Path, trajectory: str) -> Counter:
    r = _cli("show", trajectory, "--json", "--store", str(store))
    if r.returncode != 0:
        raise CorpusError(f"cannot read trajectory {trajectory}: {r.stderr.strip()}")
    return Counter(e["status"] for e in json.loads(r.stdout)["executions"])


_NOISE = re.compile(r"it/s|cell/s|s/cell|s/it|Kernel is running over TCP|^\s*$")


def _trajectory_of(store: Path, notebook: Path) -> str | None:
    """The newest trajectory recorded from `notebook`, if any."""
    if not store.is_file():
        return None
    r = _cli("list", "--json", "--store", str(store))
    if r.returncode != 0:
        return None
    mine = [t for t in json.loads(r.stdout) if t["notebook_path"] == str(notebook.resolve())]
    return mine[0]["id"] if mine else None


def record_one(
    path: Path, store: Path, timeout: float = 120.0, log: Path | None = None
) -> dict[str, Any]:
    """`jupyter themisto record --allow-errors` of one notebook (a fresh python3 kernel).
    What the command and its kernel wrote on stderr (the recorder logs its failures there)
    goes to `log`; the lines naming themisto are kept in the result too."""
    t0 = time.monotonic()
    r = _cli(
        "record", str(path), "--allow-errors", "--kernel", "python3",
        "--timeout", str(timeout), "--store", str(store),
    )  # fmt: skip
    seconds = time.monotonic() - t0
    lines = [ln for ln in r.stderr.replace("\r", "\n").splitlines() if not _NOISE.search(ln)]
    if log is not None:
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text(f"$ record {path}\n{r.stdout}\n" + "\n".join(lines) + "\n")
    m = re.search(r"trajectory (\S+), (\d+) cells recorded", r.stdout + r.stderr)
    result: dict[str, Any] = {
        "notebook": str(path),
        "trajectory_id": None,
        "cells": 0,
        "ok": 0,
        "errors": 0,
        "seconds": round(seconds, 2),
        "stopped": None,
        "recorder_log": [
            ln
            for ln in lines
            if "themisto:" in ln and "stopped:" not in ln and "recording to" not in ln
        ],
    }
    stop = re.search(r"; stopped: (.*)", r.stderr)
    trajectory = m.group(1) if m and m.group(1) != "None" else None
    if trajectory is None:
        # `record` itself failed (e.g. a traceback): what it recorded is still in the store.
        trajectory = _trajectory_of(store, path)
        result["stopped"] = lines[-1] if lines else f"record exited {r.returncode}"
    elif stop:
        result["stopped"] = stop.group(1)
    if trajectory is None:
        return result
    result["trajectory_id"] = trajectory
    statuses = _statuses(store, trajectory)
    result["cells"] = sum(statuses.values())
    result["ok"] = statuses.get("ok", 0)
    result["errors"] = result["cells"] - result["ok"]
    return result


def record(
    store: Path, *, dest: Path | None = None, jobs: int = 1, timeout: float = 120.0
) -> list[dict[str, Any]]:
    """Record every corpus notebook into `store`, `jobs` kernels at a time; prints a line per
    notebook and a total. Returns the per-notebook results in manifest order."""
    dest = (dest or default_dest()).expanduser().resolve()
    # Not checked out again (another run may be using the checkout); notebooks that write
    # files beside them leave them there: `materialize --force` restores a pristine tree.
    paths = materialize(dest, quiet=True)
    store = store.expanduser().resolve()
    store.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    results: list[dict[str, Any] | None] = [None] * len(paths)
    width = len(str(len(paths)))

    logs = store.with_name(store.name + ".logs")

    def run(i: int) -> None:
        res = record_one(paths[i], store, timeout, log=logs / f"{i + 1:04d}.log")
        res["key"] = notebook_key(paths[i], dest)
        results[i] = res
        stop = f"  STOPPED: {res['stopped']}" if res["stopped"] else ""
        if res["recorder_log"]:
            stop += f"  RECORDER: {len(res['recorder_log'])} log lines, {res['recorder_log'][0]}"
        print(
            f"[{i + 1:>{width}}/{len(paths)}] {res['cells']:4d} cells {res['errors']:3d} errors "
            f"{res['seconds']:7.1f} s  {res['key']}{stop}",
            flush=True,
        )

    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        list(pool.map(run, range(len(paths))))
    done = [r for r in results if r is not None]
    cells = sum(r["cells"] for r in done)
    errors = sum(r["errors"] for r in done)
    stopped = sum(1 for r in done if r["stopped"])
    noisy = sum(1 for r in done if r["recorder_log"])
    print(
        f"total: {len(done)} notebooks, {cells} cells recorded, {errors} errors "
        f"({errors / max(cells, 1):.1%}), {stopped} stopped early, "
        f"{time.monotonic() - t0:.0f} s wall with {jobs} job(s); recorder log lines in "
        f"{noisy} notebooks (stderr of each run: {logs}/)",
        flush=True,
    )
    return done


def _sidecar(store: Path) -> Path:
    return store.with_name(store.name + ".corpus.json")


def _remove_store(store: Path) -> None:
    for p in (store, store.with_name(store.name + "-wal"), store.with_name(store.name + "-shm")):
        p.unlink(missing_ok=True)


def ensure_recorded(
    store: Path, *, dest: Path | None = None, jobs: int = 1, timeout: float = 120.0
) -> Path:
    """The store holding the whole corpus recorded: reused when its sidecar
    (<store>.corpus.json) says it was recorded from this manifest, else recorded afresh."""
    store = store.expanduser().resolve()
    digest = manifest_hash()
    side = _sidecar(store)
    try:
        info = json.loads(side.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        info = {}
    if store.is_file() and info.get("manifest_hash") == digest:
        return store
    _remove_store(store)
    side.unlink(missing_ok=True)
    results = record(store, dest=dest, jobs=jobs, timeout=timeout)
    side.write_text(
        json.dumps(
            {"manifest_hash": digest, "recorded_at": time.time(), "results": results}, indent=1
        )
    )
    return store


def listed_trajectories(store: Path) -> list[str] | None:
    """The ids of the store's trajectories whose notebooks the manifest lists now (a store
    recorded from an older manifest may hold notebooks pruned since), by the sidecar's
    results; None when the store has no sidecar (not recorded by this script)."""
    results = recording_results(store)
    if not results:
        return None
    listed = {f"{r['repo']}:{n}" for r in load_manifest()["repositories"] for n in r["notebooks"]}
    # (a notebook whose recording made no trajectory has a result with trajectory_id None)
    made = [r for r in results if r.get("trajectory_id")]
    return [r["trajectory_id"] for r in made if r.get("key") in listed]


def recording_results(store: Path) -> list[dict[str, Any]]:
    """The per-notebook results `ensure_recorded` / `record --store` saved beside the store."""
    try:
        return json.loads(_sidecar(store.expanduser().resolve()).read_text())["results"]
    except (OSError, ValueError, KeyError):
        return []


# ------------------------------------------------------------------------------------- stats


def stats(store: Path, dest: Path | None = None) -> dict[str, Any]:
    """Counts over an exported dump of the store (exactly what `jupyter themisto export`
    writes): notebooks, executions ok/error, cells with text output, next-cell instances."""
    from jupyter_themisto.dump import read_manifest, read_table

    store = store.expanduser().resolve()
    if not store.is_file():
        raise CorpusError(f"no store at {store} (run `record --store {store}` first)")
    dest = (dest or default_dest()).expanduser().resolve()
    listed = {f"{r['repo']}:{n}" for r in load_manifest()["repositories"] for n in r["notebooks"]}
    outside: set[str] = set()
    with tempfile.TemporaryDirectory(prefix="corpus-stats-") as tmp:
        out = Path(tmp) / "dump"
        r = _cli("export", "--out", str(out), "--snapshots", "none", "--store", str(store))
        if r.returncode != 0:
            raise CorpusError(f"export failed: {r.stderr.strip()}")
        manifest = read_manifest(out)
        counts = manifest["counts"]
        per_repo: dict[str, Counter] = {}
        notebooks_seen: set[str] = set()
        trajectories: set[str] = set()
        total: Counter = Counter()
        for row in read_table(out, manifest, "executions"):
            nb = row["notebook_path"] or "?"
            try:
                key = notebook_key(nb, dest)
            except ValueError:
                key = nb
            if key not in listed:  # recorded from an older manifest, or not the corpus
                outside.add(key)
                continue
            notebooks_seen.add(key)
            trajectories.add(row["trajectory_id"])
            c = per_repo.setdefault(repo_of(key), Counter())
            for counter in (c, total):
                counter["cells"] += 1
                counter[row["status"]] += 1
                if row["output_text"].strip():
                    counter["text"] += 1
                    if row["status"] == "ok":
                        counter["ok_text"] += 1
        # The task instances exactly as the export wrote them, of the listed notebooks only.
        tasks = {}
        for name in ("next_cell", "output"):
            rows = read_table(out, manifest, name)
            tasks[name] = sum(1 for row in rows if row["trajectory_id"] in trajectories)
        if not outside:
            assert tasks == {k: counts[k] for k in tasks}, (tasks, counts)
        next_cell, output_instances = tasks["next_cell"], tasks["output"]
    seconds: Counter = Counter()
    nbs_per_repo: Counter = Counter()
    for res in recording_results(store):
        if res.get("key") not in listed:
            continue
        seconds[repo_of(res["key"])] += res["seconds"]
        nbs_per_repo[repo_of(res["key"])] += 1
    return {
        "notebooks": len(notebooks_seen),
        "code_cells": total["cells"],
        "ok": total["ok"],
        "error": total["error"],
        "other": total["cells"] - total["ok"] - total["error"],
        "text_output": total["text"],
        "ok_text_output": total["ok_text"],
        "next_cell": next_cell,
        "output_instances": output_instances,
        "not_in_manifest": sorted(outside),
        "per_repo": {
            repo: {**dict(c), "notebooks": nbs_per_repo.get(repo), "seconds": seconds.get(repo)}
            for repo, c in sorted(per_repo.items())
        },
    }


def print_stats(s: dict[str, Any]) -> None:
    print(f"notebooks                  {s['notebooks']}")
    print(f"code cells executed        {s['code_cells']}")
    print(f"  ok / error / other       {s['ok']} / {s['error']} / {s['other']}")
    print(f"cells with text output     {s['text_output']} ({s['ok_text_output']} of them ok)")
    print(f"next-cell instances        {s['next_cell']}")
    print(f"output instances           {s['output_instances']}")
    if s["not_in_manifest"]:
        print(f"left out: {len(s['not_in_manifest'])} recorded notebooks not in the manifest")
    print()
    head = ("repository", "nbs", "cells", "errors", "err %", "text", "s")
    print("{:48} {:>4} {:>6} {:>6} {:>6} {:>5} {:>7}".format(*head))
    for repo, c in s["per_repo"].items():
        cells = c.get("cells", 0)
        err = c.get("error", 0)
        secs = f"{c['seconds']:.0f}" if c.get("seconds") is not None else "?"
        nbs = c.get("notebooks") or "?"
        print(
            f"{repo:48} {nbs:>4} {cells:6d} {err:6d} {err / max(cells, 1):6.1%} "
            f"{c.get('text', 0):5d} {secs:>7}"
        )


# --------------------------------------------------------------------------------------- CLI


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="corpus.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    dest_help = "corpus folder (default: $THEMISTO_CORPUS_DIR or ~/.cache/jupyter-themisto/corpus)"
    m = sub.add_parser("materialize", help="check out the pinned repositories")
    m.add_argument("--dest", type=Path, help=dest_help)
    m.add_argument("--force", action="store_true", help="check out again even if present")
    ls = sub.add_parser("list", help="print the materialized notebook paths")
    ls.add_argument("--dest", type=Path, help=dest_help)
    rec = sub.add_parser("record", help="record every notebook with `jupyter themisto record`")
    rec.add_argument("--store", type=Path, required=True, help="trajectory store to write")
    rec.add_argument("--jobs", type=int, default=1, help="notebooks recorded at once (default 1)")
    rec.add_argument("--timeout", type=float, default=120.0, help="seconds one cell may run")
    rec.add_argument("--dest", type=Path, help=dest_help)
    st = sub.add_parser("stats", help="count what a recorded store holds")
    st.add_argument("--store", type=Path, required=True, help="the recorded store")
    st.add_argument("--dest", type=Path, help=dest_help)
    st.add_argument("--json", action="store_true", help="print JSON")
    args = parser.parse_args(argv)
    try:
        if args.command == "materialize":
            paths = materialize(args.dest, force=args.force)
            print(f"{len(paths)} notebooks in {(args.dest or default_dest()).expanduser()}")
        elif args.command == "list":
            for p in materialize(args.dest, quiet=True):
                print(p)
            sys.stdout.flush()
        elif args.command == "record":
            store = args.store.expanduser().resolve()
            if store.exists():
                raise CorpusError(f"{store} exists: pass a new path (recording appends)")
            results = record(store, dest=args.dest, jobs=args.jobs, timeout=args.timeout)
            _sidecar(store).write_text(
                json.dumps(
                    {"manifest_hash": manifest_hash(), "recorded_at": time.time(),
                     "results": results},
                    indent=1,
                )
            )  # fmt: skip
        elif args.command == "stats":
            s = stats(args.store, args.dest)
            if args.json:
                print(json.dumps(s, indent=1))
            else:
                print_stats(s)
    except CorpusError as e:
        print(f"corpus.py: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `corpus.py list | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
