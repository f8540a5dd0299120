"""The context builder's curation: token budget, variable order, truncation, markdown."""

from __future__ import annotations

import pytest

from jupyter_themisto.backends._text import StopScanner, chat_prose, whole_statements
from jupyter_themisto.backends.prompts import render_context, render_prompt
from jupyter_themisto.context import (
    build_context,
    estimate_tokens,
    runtime_lag,
    truncate_text,
)


def rows(n, output="x" * 50):
    return [
        {
            "source": f"step_{i} = {i}",
            "order_index": i,
            "execution_count": i + 1,
            "status": "ok",
            "outputs": [{"output_type": "stream", "name": "stdout", "text": output}],
        }
        for i in range(n)
    ]


def test_budget_keeps_the_newest_cells_in_run_order():
    ctx = build_context(rows(500), token_budget=400)
    rendered = render_context(ctx)
    assert estimate_tokens(rendered) <= 400 * 1.3
    sources = [c.source for c in ctx.cells]
    assert sources[-1] == "step_499 = 499"
    assert sources == sorted(sources, key=lambda s: int(s.split("_")[1].split()[0]))
    assert 3 < len(sources) < 100
    unlimited = build_context(rows(500), token_budget=None)
    assert len(unlimited.cells) == 500


def test_outputs_are_truncated_with_a_marker():
    ctx = build_context(rows(2, output="y" * 5000), max_output_chars=100, token_budget=None)
    text = ctx.cells[-1].output_text
    assert len(text) < 200 and "more characters" in text


def test_oversized_newest_cell_is_cut_not_dropped():
    big = [{"source": "z = '" + "q" * 20000 + "'", "status": "ok"}]
    ctx = build_context(big, token_budget=200)
    assert len(ctx.cells) == 1 and "characters cut" in ctx.cells[0].source
    assert estimate_tokens(ctx.cells[0].source) <= 210


def test_variables_most_recently_changed_first_and_curated():
    variables = [
        {"name": "old", "type": "int", "summary": {"repr": "1"}},
        {"name": "df", "type": "pandas.DataFrame", "summary": {"shape": [3, 2], "columns": ["a"]}},
        {"name": "np", "type": "module", "summary": {}},
        {"name": "_hidden", "type": "int", "summary": {}},
        {"name": "model", "type": "sklearn.Pipeline", "summary": {"repr": "Pipeline(...)"}},
    ]
    changes = {"old": 1, "df": 7, "model": 4}
    ctx = build_context(rows(8), variables, variable_changes=changes)
    assert [v.name for v in ctx.variables] == ["df", "model", "old"]
    assert ctx.variables[0].changed_at == 7
    text = render_context(ctx)
    assert "df: pandas.DataFrame shape=[3, 2] columns=[a]" in text
    assert "Live variables" in text
    # With the snapshot's `changed` flag only, changed variables go first.
    flagged = [dict(v, changed=v["name"] == "model") for v in variables]
    assert build_context(rows(8), flagged).variables[0].name == "model"


def test_runtime_summary_bounded_by_its_share_of_the_budget():
    variables = [
        {"name": f"v{i:03d}", "type": "pandas.DataFrame", "summary": {"columns": ["c"] * 30}}
        for i in range(200)
    ]
    ctx = build_context(rows(3), variables, token_budget=1000, max_variables=500)
    used = sum(estimate_tokens(line) for line in render_context(ctx).splitlines() if "v" in line)
    assert 0 < len(ctx.variables) < 200 and used <= 1000
    assert len(build_context(rows(3), variables, max_variables=10).variables) == 10


def test_without_runtime_and_redacted():
    variables = [{"name": "api_key", "type": "str", "summary": {"redacted": True}}]
    ctx = build_context(rows(2), variables, with_runtime=False)
    assert ctx.variables == [] and "Live variables" not in render_context(ctx)
    ctx = build_context(rows(2), variables)
    assert "api_key: str (redacted)" in render_context(ctx)


def test_runtime_lag_counts_the_cells_run_since_a_snapshot_gave_the_namespace():
    def lag(*statuses):
        return runtime_lag([{"snapshot_status": s} for s in statuses])

    assert lag() == 0
    assert lag("ok") == lag("partial") == lag("unchanged") == 0
    # Skipped, failed, coalesced, pending, off: the variables are those of an older snapshot.
    assert lag("ok", "skipped") == lag("partial", "failed") == lag("ok", "pending") == 1
    assert lag("unchanged", "coalesced", "off") == 2
    assert lag("failed", "skipped") == 2 and lag("none") == 1
    assert lag("ok", "skipped", "unchanged") == 0


def test_markdown_cells_of_the_notebook_come_first():
    nb = [
        {"cell_type": "markdown", "source": "# Sales analysis\nWe look at revenue."},
        {"cell_type": "code", "source": "ignored = 1"},
        {"cell_type": "markdown", "source": ["## Cleaning"]},
    ]
    ctx = build_context(rows(2), notebook_cells=nb)
    kinds = [c.cell_type for c in ctx.cells]
    assert kinds == ["markdown", "markdown", "code", "code"]
    text = render_context(ctx)
    assert "# # Sales analysis" in text and "ignored" not in text


def test_prompts_per_task_and_ids():
    ctx = build_context(rows(2), target_source="step_1", notebook_path="a.ipynb", kernel_id="k")
    assert ctx.notebook_path == "a.ipynb" and ctx.kernel_id == "k"
    instructions, prompt = render_prompt(ctx, "output")
    assert "output" in instructions and prompt.endswith("output of:\nstep_1\n")
    instructions, prompt = render_prompt(ctx, "next-cell")
    assert "next code cell" in instructions and prompt.endswith("# The next cell:\n")
    assert "# In[2]:\nstep_1 = 1\n# Out:\n# xxxx" in prompt
    with pytest.raises(ValueError):
        render_prompt(ctx, "poem")


def test_truncate_text():
    assert truncate_text("abc", 10) == "abc"
    cut = truncate_text("a" * 100 + "b" * 100, 30)
    assert cut.startswith("a" * 20) and cut.endswith("b" * 10) and "cut" in cut
    assert truncate_text("abc", 0) == ""


def test_notebook_code_cells_stand_in_when_nothing_ran_yet():
    nb = [
        {"cell_type": "markdown", "source": "# Intro"},
        {"cell_type": "code", "source": "import pandas as pd"},
    ]
    ctx = build_context([], notebook_cells=nb)
    assert [(c.cell_type, c.status) for c in ctx.cells] == [("markdown", "ok"), ("code", "not run")]
    assert "# In[ ]: (not run)\nimport pandas as pd" in render_context(ctx)
    # Once cells ran, the recorded executions are the code context.
    ran = build_context([{"source": "x = 1"}], notebook_cells=nb)
    assert [c.source for c in ran.cells] == ["# Intro", "x = 1"]


def test_chat_about_the_code_is_told_from_outputs():
    for chat in (
        "This code snippet creates a scatter plot of Iris flowers.",
        "...\n\n**Created Question**:\nWhat is the purpose of the `KMeans` class?",
        "To solve the given problem, we need to understand the code.",
        "42\nThe output of the program will be 42.",
    ):
        assert chat_prose(chat), chat
    for output in (
        "<Figure size 640x480 with 1 Axes>\n",
        "first value: 1\n",
        "   sepal_length  sepal_width\n0           5.1          3.5\n",
        "TypeError: unsupported operand type(s) for +: 'int' and 'str'\n",
        "The answer is 42\n",  # a sentence, but not about code
        "[0, 1, 4, 9]\n",
    ):
        assert not chat_prose(output), output


def test_stop_scanner_cuts_across_chunks():
    s = StopScanner(["# %%", "\n# Out"])
    pieces = [s.feed(t) for t in ["df.head()\n", "#", " ", "%", "% next"]]
    assert "".join(pieces) == "df.head()\n" and s.stopped
    assert s.feed("more") == "" and s.finish() == ""
    s = StopScanner([">>> "])
    assert s.feed("(3, 2)\n>") == "(3, 2)\n"  # ">" may begin a stop: held back
    assert s.feed("x") == ">x" and s.finish() == "" and not s.stopped


@pytest.mark.parametrize(
    ("cut", "kept"),
    [
        # the limit came mid-call: the unfinished line goes
        ("df = pd.read_csv('a.csv')\nplt.plot(x, ", "df = pd.read_csv('a.csv')"),
        # ... and the lines of a statement whose closing bracket never came
        ("fig, ax = plt.subplots()\nax.plot(x,\n    y,\n    col", "fig, ax = plt.subplots()"),
        # a block's lines stay with it; magics and shell lines count as code
        ("for i in range(3):\n    print(i)\nprint('do", "for i in range(3):\n    print(i)"),
        ("%matplotlib inline\nimport numpy as np\nnp.ar", "%matplotlib inline\nimport numpy as np"),
        ("!ls data\nx = [1,\n", "!ls data"),
        # a cut that ended at a line's end (the line limit) loses only what does not parse
        ("a = 1\nb = 2\n", "a = 1\nb = 2"),
        ("a = 1\nif a:\n", "a = 1"),
        # nothing whole to end at: kept as it came (cutting would not make it run)
        ("df.groupby(['a',", "df.groupby(['a',"),
        ("run = dict(\n    alpha=4.1,\n    be", "run = dict(\n    alpha=4.1,\n    be"),
        ("# load the data\ndf = pd.read_csv(", "# load the data\ndf = pd.read_csv("),
        ("%%bash\nls\necho hel", "%%bash\nls\necho hel"),
    ],
)
def test_an_answer_a_limit_cut_ends_where_its_code_is_whole(cut, kept):
    assert whole_statements(cut) == kept


def test_markdown_stands_after_the_latest_run_of_the_code_above_it():
    nb = [
        {"cell_type": "markdown", "source": "# Title", "id": "m0"},
        {"cell_type": "code", "source": "a = 1", "id": "c0"},
        {"cell_type": "markdown", "source": "Then b", "id": "m1"},
        {"cell_type": "code", "source": "b = 2", "id": "c1"},
        {"cell_type": "markdown", "source": "Now plot", "id": "m2"},
    ]
    runs = [
        {"source": "a = 1", "cell_id": "c0", "order_index": 0},
        {"source": "b = 2", "cell_id": "c1", "order_index": 1},
        {"source": "a = 1", "cell_id": "c0", "order_index": 2},
    ]
    ctx = build_context(runs, notebook_cells=nb, token_budget=None)
    sources = [c.source for c in ctx.cells]
    assert sources == ["# Title", "a = 1", "b = 2", "a = 1", "Then b", "Now plot"]
    assert [c.order_index for c in ctx.cells if c.cell_type == "code"] == [0, 1, 2]
    # Short of room, the markdown right above the insertion point is kept first.
    tight = build_context(runs, notebook_cells=nb, token_budget=26)
    notes = [c.source for c in tight.cells if c.cell_type == "markdown"]
    assert notes == ["Then b", "Now plot"]


def test_cells_below_nearest_first_within_their_share():
    below = [{"cell_type": "code", "source": f"y{i} = {'x' * 80}"} for i in range(100)]
    ctx = build_context(rows(3), cells_below=below, token_budget=1000)
    assert ctx.cells_below[0].source.startswith("y0 =")
    assert 0 < len(ctx.cells_below) < 100
    assert sum(estimate_tokens(c.source) for c in ctx.cells_below) <= 200
    assert all(c.status == "not run" for c in ctx.cells_below)
    assert build_context(rows(3)).cells_below == []
