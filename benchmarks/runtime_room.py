"""How much of the next cell could runtime information tell that the prompt's code does not?

Issue 11 asks that runtime information (live variables, outputs, errors) raise next-cell chrF
by at least 1 point over the same prompt without it. This script measures, on an export dump
(`jupyter themisto export`) and without any model, how much room there is for that: for each
next-cell instance, the names and strings of the cell that followed (identifiers of 3 or more
characters, the contents of string literals; Python's keywords and builtins left out) that the
prompt's code — what the default prompt shows without runtime information — does not hold, and
which of those the runtime information does:

- a live variable's name (a variable the prompt's cells do not show being made, e.g. one made
  in a cell older than the prompt's window);
- a string inside a variable's summary (a DataFrame's column names, a dict's keys, a repr);
- a word of an earlier cell's output or error.

It prints the share of instances with at least one such word, per kind, and the share of the new
words that runtime information holds. The instances after a cell that raised are counted apart
(there the default prompt shows the error).

    .venv/bin/python benchmarks/runtime_room.py DUMP [--limit N]
"""

from __future__ import annotations

import argparse
import builtins
import json
import keyword
import re
import sys
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jupyter_themisto.backends.prompts import PromptOptions, next_cell_prompt  # noqa: E402
from jupyter_themisto.dump import read_manifest, read_table  # noqa: E402
from jupyter_themisto.dump.reader import DumpContexts  # noqa: E402

WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]{2,}")
STRING = re.compile(r"""'([^'\n]{2,})'|"([^"\n]{2,})\"""")
COMMON = set(keyword.kwlist) | set(dir(builtins))


def words(text: str) -> set[str]:
    """The identifiers (3+ characters) and string literals' contents of `text`."""
    found = {w for w in WORD.findall(text) if w not in COMMON}
    found |= {a or b for a, b in STRING.findall(text)}
    return found


def summary_strings(value: Any) -> set[str]:
    """The strings inside a variable's summary (column names, keys, the repr's words)."""
    if isinstance(value, dict):
        return set().union(*(summary_strings(v) for v in value.values()), set())
    if isinstance(value, list):
        return set().union(*(summary_strings(v) for v in value), set())
    if isinstance(value, str):
        return {value} | words(value)
    return set()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dump", type=Path)
    parser.add_argument("--limit", type=int, default=0, help="only the first N instances")
    args = parser.parse_args()
    manifest = read_manifest(args.dump)
    instances = read_table(args.dump, manifest, "next_cell")
    if args.limit:
        instances = instances[: args.limit]
    contexts = DumpContexts(read_table(args.dump, manifest, "executions"), None)
    options = PromptOptions()
    kinds = ("a live variable's name", "a string in a variable's summary", "an earlier output")
    counts: dict[bool, Counter[str]] = {False: Counter(), True: Counter()}
    new_words = {False: 0, True: 0}
    known_words = {False: 0, True: 0}
    examples: Counter[str] = Counter()
    for instance in instances:
        ctx = contexts.build(instance, with_runtime=True)
        after_error = bool(ctx.cells) and ctx.cells[-1].status == "error"
        counts[after_error]["instances"] += 1
        plain = next_cell_prompt(contexts.build(instance, with_runtime=False), options).text
        new = words(instance["target"]) - words(plain)
        if not new:
            continue
        names = {v.name for v in ctx.variables}
        in_summaries = set().union(*(summary_strings(v.summary) for v in ctx.variables), set())
        in_outputs = set().union(*(words(c.output_text) for c in ctx.cells), set())
        found = [new & names, new & in_summaries - names, new & in_outputs - names - in_summaries]
        known = set().union(*found)
        new_words[after_error] += len(new)
        known_words[after_error] += len(known)
        for kind, hit in zip(kinds, found, strict=True):
            counts[after_error][kind] += bool(hit)
        counts[after_error]["any"] += bool(known)
        examples.update(known)
    for after_error, label in ((False, "after a cell that ran"), (True, "after an error")):
        c = counts[after_error]
        n = c["instances"]
        if not n:
            continue
        print(f"{label}: {n} next-cell instances")
        for kind in (*kinds, "any"):
            share = c[kind] / n
            print(f"  a new word that runtime information holds, {kind}: {c[kind]} ({share:.1%})")
        share = known_words[after_error] / max(1, new_words[after_error])
        print(
            f"  words of the next cell the prompt's code lacks: {new_words[after_error]};"
            f" of them runtime information holds {known_words[after_error]} ({share:.1%})"
        )
    print("most frequent:", json.dumps(examples.most_common(25)))


if __name__ == "__main__":
    main()
