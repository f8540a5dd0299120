"""Would a lower line cap on next-cell answers score better? No model: rescores the answers of
an `evaluate` run cut to their first N lines.

`max_lines` (30) bounds an answer's lines. A lower cap would end long answers sooner; this
prints, for each cap, the chrF and exact match the run's answers would have had, paired against
the answers as they were (bootstrap interval of the difference), and the lines of the answers
and of the cells that came next. An answer cut while it was written may end elsewhere than one
cut afterwards (a cap also frees the time the rest took), so this bounds what the cap changes in
the text, not in the time.

    .venv/bin/python benchmarks/line_cap.py RUN/next-cell__llamacpp__with-runtime.jsonl
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jupyter_themisto.metrics import chrf, exact_match, paired_difference  # noqa: E402

CAPS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 15, 20)


def first_lines(text: str, n: int) -> str:
    return "\n".join(text.splitlines()[:n]).rstrip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path, help="a next-cell .jsonl written by `evaluate`")
    args = parser.parse_args()
    if not args.run.is_file():
        sys.exit(f"{args.run}: no such file (a .jsonl written by `jupyter themisto evaluate`)")
    try:
        rows = [json.loads(line) for line in args.run.read_text().splitlines() if line.strip()]
    except (ValueError, UnicodeDecodeError) as e:
        sys.exit(f"{args.run}: not a .jsonl written by `jupyter themisto evaluate` ({e})")
    rows = [r for r in rows if r.get("task") == "next-cell" and "reference" in r]
    if not rows:
        sys.exit(f"{args.run}: no next-cell answers")
    answers = [r.get("prediction") or "" for r in rows]
    references = [r["reference"] for r in rows]
    lines = [len(a.splitlines()) for a in answers]
    ref_lines = [len(r.splitlines()) for r in references]
    print(
        f"{len(rows)} answers: {statistics.mean(lines):.2f} lines on average"
        f" (median {statistics.median(lines):g}); the cells that came next:"
        f" {statistics.mean(ref_lines):.2f} (median {statistics.median(ref_lines):g})"
    )
    whole = [100 * chrf(a, r) for a, r in zip(answers, references, strict=True)]
    print(f"as they were: chrF {statistics.mean(whole):.2f}")
    for n in CAPS:
        cut = [first_lines(a, n) for a in answers]
        scores = [100 * chrf(a, r) for a, r in zip(cut, references, strict=True)]
        em = statistics.mean(100 * exact_match(a, r) for a, r in zip(cut, references, strict=True))
        d = paired_difference(whole, scores)
        print(
            f"cap {n:2d} lines: chrF {statistics.mean(scores):.2f}, EM {em:.2f} %,"
            f" {d['mean']:+.2f} [{d['low']:+.2f}, {d['high']:+.2f}]"
            f" ({sum(1 for x in lines if x > n)} answers cut)"
        )


if __name__ == "__main__":
    main()
