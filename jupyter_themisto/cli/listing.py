"""`jupyter themisto list` and `show ID`: the trajectories, and one trajectory's executions."""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
from typing import Any

from ..console import CliError
from ..context import outputs_problem, outputs_to_text
from ._common import one_line, open_store, table


def add_parsers(sub: Any) -> None:
    p = sub.add_parser("list", help="list recorded trajectories", description=__doc__)
    p.add_argument("--limit", type=int, default=None, help="show at most N (newest first)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=cmd_list)

    s = sub.add_parser("show", help="show one trajectory's executions", description=__doc__)
    s.add_argument("trajectory", metavar="ID", help="trajectory id (a unique prefix will do)")
    s.add_argument("--json", action="store_true", help="print JSON instead of a table")
    s.set_defaults(func=cmd_show)


def _time(ts: float | None) -> str:
    if ts is None:
        return ""
    return dt.datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M:%S")


def _mb(n: int | None) -> str:
    return "" if n is None else f"{n / 2**20:.1f}"


def cmd_list(args: argparse.Namespace) -> int:
    store = open_store(args)
    rows = store.list_trajectories(limit=args.limit)
    if args.json:
        print(json.dumps(rows, indent=2, default=str))
        return 0
    if not rows:
        print(f"no trajectories in {store.path}")
        return 0
    print(
        table(
            [
                (r["id"], _time(r["started_at"]), r["n_executions"], r["notebook_path"] or "")
                for r in rows
            ],
            ["ID", "STARTED", "EXECUTIONS", "NOTEBOOK"],
        )
    )
    return 0


def resolve_trajectory(store: Any, ident: str) -> dict[str, Any]:
    """The trajectory with id `ident`, or the only one whose id starts with it."""
    found = store.get_trajectory(ident)
    if found:
        return found
    matches = [t for t in store.list_trajectories() if t["id"].startswith(ident)]
    if len(matches) == 1:
        return matches[0]
    if not matches:
        raise CliError(f"unknown trajectory {ident!r} in {store.path}")
    raise CliError(f"trajectory prefix {ident!r} is ambiguous ({len(matches)} match)")


def cmd_show(args: argparse.Namespace) -> int:
    store = open_store(args)
    t = resolve_trajectory(store, args.trajectory)
    rows = store.list_executions(t["id"])
    for r in rows:
        problem = outputs_problem(r["outputs"])
        if problem is not None:
            print(
                f"jupyter-themisto: warning: execution {r['id']} (order {r['order_index']}) has"
                f" damaged outputs in the store ({problem}): shown with none",
                file=sys.stderr,
            )
            r["outputs"] = []
    if args.json:
        print(json.dumps({"trajectory": t, "executions": rows}, indent=2, default=str))
        return 0
    print(
        f"trajectory {t['id']}  notebook {t['notebook_path'] or '-'}"
        f"  started {_time(t['started_at'])}"
    )
    print(
        table(
            [
                (
                    r["order_index"],
                    r["execution_count"],
                    r["status"],
                    "" if r["wall_time"] is None else f"{r['wall_time']:.3f}",
                    _mb(r["memory_after"]),
                    r["snapshot_status"],
                    one_line(r["source"], 50),
                    one_line(outputs_to_text(r["outputs"]), 40),
                )
                for r in rows
            ],
            ["#", "IN", "STATUS", "WALL_S", "MEM_MB", "SNAPSHOT", "SOURCE", "OUTPUT"],
        )
    )
    return 0
