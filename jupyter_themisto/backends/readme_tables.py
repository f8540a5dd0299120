"""Fills README's settings tables from the backends' settings models.

`python -m jupyter_themisto.backends.readme_tables README.md` rewrites every block
`<!-- settings: NAME -->` … `<!-- /settings -->` with the table of backend NAME's settings;
`--check` only says whether they match (tests/test_backend_settings.py checks README so).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from .registry import load_backend_class
from .settings import settings_table

_BLOCK = re.compile(
    r"(<!-- settings: (?P<name>[\w-]+)(?P<opts>[^>]*?) -->\n)(?P<body>.*?)(<!-- /settings -->)",
    re.S,
)


def _table_for(name: str, opts: str) -> str:
    model = load_backend_class(name).settings_model
    if model is None:
        raise ValueError(f"backend {name!r} declares no settings model")
    options = dict(re.findall(r"(only|exclude)=(\S+)", opts))
    return settings_table(model, options.get("only", "*"), options.get("exclude", ""))


def readme_tables(text: str) -> str:
    """`text` with every `<!-- settings: NAME -->` … `<!-- /settings -->` block filled with the
    table of backend NAME's settings model; `<!-- settings: NAME only=prompt_* -->` or
    `exclude=a,b` choose rows (settings a shared table lists once)."""
    return _BLOCK.sub(
        lambda m: m.group(1) + _table_for(m.group("name"), m.group("opts")) + m.group(5), text
    )


def main(argv: list[str] | None = None) -> int:
    """Rewrite (or with --check, only compare) the settings tables of a README."""
    args = list(sys.argv[1:] if argv is None else argv)
    check = "--check" in args
    paths = [a for a in args if a != "--check"] or ["README.md"]
    stale = []
    for p in paths:
        path = Path(p)
        text = path.read_text(encoding="utf-8")
        new = readme_tables(text)
        if new != text:
            stale.append(p)
            if not check:
                path.write_text(new, encoding="utf-8")
    if check and stale:
        print(
            f"settings tables out of date in {', '.join(stale)}; run "
            "python -m jupyter_themisto.backends.readme_tables " + " ".join(stale)
        )
        return 1
    for p in stale if not check else []:
        print(f"rewrote the settings tables of {p}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
