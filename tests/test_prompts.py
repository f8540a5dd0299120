"""The prompt builder: shapes per task, window and budget, runtime placement, markdown, FIM."""

from __future__ import annotations

import pytest

from jupyter_themisto.backends.prompts import (
    QWEN_FIM,
    QWEN_REPO,
    Example,
    PromptOptions,
    approx_tokens,
    completion_prompt,
    cut_prompt,
    next_cell_prompt,
    object_reprs_only,
    output_prompt,
)
from jupyter_themisto.context import ContextCell, PredictionContext, VariableInfo, build_context


def session(**kw):
    return PredictionContext(
        cells=[
            ContextCell(source="Load the data", cell_type="markdown"),
            ContextCell(source="import pandas as pd", execution_count=1, order_index=0),
            ContextCell(
                source="for i in range(2):\n    print(i)",
                output_text="0\n1\n",
                execution_count=2,
                order_index=1,
            ),
        ],
        variables=[VariableInfo(name="i", type="int", summary={"repr": "1"})],
        **kw,
    )


#: how nbconvert begins a script, and a code cell (unnumbered): the default cell style
HEAD = "#!/usr/bin/env python\n# coding: utf-8\n\n"
IN = "# In[ ]:\n\n\n"


def code(source):
    """A code cell as the default prompt writes it."""
    return IN + source + "\n\n\n"


def code_rows(n):
    return [
        {"source": f"x{i} = {i}", "order_index": i, "cell_id": f"c{i}", "status": "ok"}
        for i in range(n)
    ]


def test_default_next_cell_prompt_is_plain_code_and_an_error():
    """The cells as `jupyter nbconvert --to script` writes them (measured: +1.8 chrF over the
    percent format), unnumbered; markdown as comments; the next cell opened."""
    # An output that is not an error is not shown by default (measured: it lowered the scores).
    p = next_cell_prompt(session())
    assert p.text == (
        HEAD
        + "# Load the data\n\n"
        + code("import pandas as pd")
        + code("for i in range(2):\n    print(i)")
        + IN
    )
    assert p.stops[:2] == ["# In[", "\n# Out:"] and p.suffix is None and not p.special
    last = next_cell_prompt(session(), PromptOptions(outputs="last"))
    assert last.text.endswith("    print(i)\n# Out: 0\n#      1\n\n\n" + IN)
    # The variables are not shown by default (measured: no gain, and a header would change the
    # prompt's beginning at every cell); the docstring header is one setting away.
    header = next_cell_prompt(session(), PromptOptions(runtime="header")).text
    assert header.startswith(HEAD + '"""Live variables of the kernel:\ni: int = 1\n"""\n\n# Load')
    # Without runtime information, no output either.
    assert "# Out" not in next_cell_prompt(session(with_runtime=False)).text


def test_the_newest_cells_error_is_shown_by_default_and_ends_a_long_output():
    def ctx(*cells):
        return PredictionContext(
            cells=[
                ContextCell(source=src, output_text=out, status=status, order_index=i)
                for i, (src, out, status) in enumerate(cells)
            ]
        )

    failed = ctx(
        ("import pandas as pd", "", "ok"),
        ("df.applymap(len)", "AttributeError: 'DataFrame' has no attribute 'applymap'\n", "error"),
    )
    assert next_cell_prompt(failed).text.endswith(
        IN + "df.applymap(len)\n# Out: AttributeError: 'DataFrame' has no attribute"
        " 'applymap'\n\n\n" + IN
    )
    failed.with_runtime = False  # (an error is runtime information too)
    assert "# Out" not in next_cell_prompt(failed).text
    assert "# Out" not in next_cell_prompt(failed, PromptOptions(outputs="none")).text
    # An older cell's error is not shown: the newest cell ran after it.
    mended = ctx(("1/0", "ZeroDivisionError: division by zero\n", "error"), ("1/1", "1.0\n", "ok"))
    assert "# Out" not in next_cell_prompt(mended).text
    # A cell that printed much, then raised: its last lines are kept, the error among them.
    printed = "\n".join(f"line {n}" for n in range(20)) + "\nValueError: bad value\n"
    loud = ctx(("run()", printed, "error"))
    text = next_cell_prompt(loud, PromptOptions(max_output_lines=3)).text
    assert "# Out: …\n#      line 18\n#      line 19\n#      ValueError: bad value\n" in text
    assert "line 0" not in text


def test_without_runtime_no_variables_anywhere():
    for runtime in ("header", "end"):
        p = next_cell_prompt(session(with_runtime=False), PromptOptions(runtime=runtime))
        assert "Live variables" not in p.text and "i: int" not in p.text


def test_runtime_at_the_end_and_outputs_of_the_last_cell():
    options = PromptOptions(runtime="end", outputs="last")
    p = next_cell_prompt(session(), options)
    assert p.text.endswith(
        "    print(i)\n# Out: 0\n#      1\n\n\n# Live variables:\n#   i: int = 1\n\n" + IN
    )
    assert p.text.startswith(HEAD + "# Load the data")
    every = next_cell_prompt(session(), PromptOptions(runtime="none", outputs="all"))
    assert every.text.count("# Out:") == 1  # the only cell with an output
    many = PredictionContext(
        cells=[ContextCell(source="print(s)", output_text="\n".join(map(str, range(50))))]
    )
    shown = next_cell_prompt(many, PromptOptions(outputs="last", max_output_lines=3)).text
    assert "#      2\n#      …" in shown and "#      3" not in shown
    # Outputs are runtime information: without it, none is shown.
    many.with_runtime = False
    assert "# Out" not in next_cell_prompt(many, PromptOptions(outputs="all")).text


@pytest.mark.parametrize(
    "text",
    [
        "<Figure size 640x480 with 1 Axes>",
        "<Figure size 1400x600 with 1 Axes>\n<Figure size 1400x600 with 2 Axes>",
        "[<matplotlib.lines.Line2D at 0x7f3a2c1d5e50>]",
        "[<matplotlib.lines.Line2D at 0x7f3a2c1d5e50>, <matplotlib.lines.Line2D at 0x7f3a2c>]",
        "<list_iterator at 0x7f3a2c1d5e50>",
        "<IPython.core.display.Javascript object>",
        "<Axes: title={'center': 'x'}>",
        "Text(0.5, 1.0, 'Prices')",
    ],
)
def test_an_output_of_default_reprs_only_can_be_left_out(text):
    assert object_reprs_only(text)
    ctx = PredictionContext(
        cells=[ContextCell(source="plt.plot(x)", output_text=text, order_index=0)]
    )
    assert "# Out: " in next_cell_prompt(ctx, PromptOptions(outputs="last")).text
    left_out = next_cell_prompt(ctx, PromptOptions(outputs="last", object_reprs=False)).text
    assert left_out == HEAD + code("plt.plot(x)") + IN


@pytest.mark.parametrize(
    "text",
    [
        "0.93",
        "<Figure size 640x480 with 1 Axes>\naccuracy: 0.93",
        "<div>a table</div>",
        "array([1, 2])",
        "   \n",
    ],
)
def test_an_output_that_says_something_is_kept(text):
    assert not object_reprs_only(text)
    ctx = PredictionContext(
        cells=[ContextCell(source="model.score(x)", output_text=text, order_index=0)]
    )
    options = PromptOptions(outputs="last", object_reprs=False)
    shown = next_cell_prompt(ctx, PromptOptions(outputs="last")).text
    assert next_cell_prompt(ctx, options).text == shown
    assert "# Out: " in shown or not text.strip()


def test_markdown_can_be_left_out():
    p = next_cell_prompt(session(), PromptOptions(markdown=False, runtime="none"))
    assert "Load the data" not in p.text and p.text.startswith(HEAD + IN + "import pandas")


def test_window_keeps_the_newest_cells_and_its_start_moves_in_steps():
    def shown(n, **kw):
        ctx = build_context(code_rows(n), token_budget=None)
        text = next_cell_prompt(ctx, PromptOptions(runtime="none", **kw)).text
        return [line for line in text.splitlines() if line.startswith("x")]

    assert shown(4, cells=10) == ["x0 = 0", "x1 = 1", "x2 = 2", "x3 = 3"]
    assert shown(25, cells=3, window_step=1) == ["x22 = 22", "x23 = 23", "x24 = 24"]
    # With a step of 5, the first cell shown stays put while 3 to 7 cells are shown.
    firsts = [shown(n, cells=3, window_step=5)[0] for n in range(8, 14)]
    assert firsts == ["x5 = 5"] * 5 + ["x10 = 10"]
    assert all(3 <= len(shown(n, cells=3, window_step=5)) <= 7 for n in range(3, 40))
    assert len(shown(40, cells=0)) == 40  # 0: everything the context holds


def test_window_keeps_the_markdown_right_above_its_first_cell():
    cells = [
        ContextCell(source="a = 1", order_index=0),
        ContextCell(source="Plot it", cell_type="markdown"),
        ContextCell(source="b = 2", order_index=1),
        ContextCell(source="c = 3", order_index=2),
    ]
    options = PromptOptions(cells=2, window_step=1)
    text = next_cell_prompt(PredictionContext(cells=cells), options).text
    assert text == HEAD + "# Plot it\n\n" + code("b = 2") + code("c = 3") + IN


def test_fill_in_the_middle_with_the_cells_below():
    ctx = session(with_runtime=False)
    ctx.cells_below = [
        ContextCell(source="Now plot", cell_type="markdown"),
        ContextCell(source="df.plot()", status="not run"),
    ]
    p = next_cell_prompt(ctx, PromptOptions(below=True), QWEN_FIM)
    assert p.special and p.suffix == "\n# Now plot\n\n" + IN + "df.plot()\n\n"
    one = next_cell_prompt(ctx, PromptOptions(below=True, below_cells=1), QWEN_FIM)
    assert one.suffix == "\n# Now plot\n"
    assert p.text == "<|fim_prefix|>" + p.prefix + "<|fim_suffix|>" + p.suffix + "<|fim_middle|>"
    assert "<|fim_prefix|>" in p.stops
    # Without FIM tokens (or with the option off, the default) the cells below are not used.
    assert next_cell_prompt(ctx, PromptOptions(below=True)).suffix is None
    assert next_cell_prompt(ctx, PromptOptions(), QWEN_FIM).suffix is None


def test_special_tokens_in_a_notebook_cannot_reach_the_model():
    """A cell that spells a special token must not steer a prompt read with special tokens."""
    ctx = PredictionContext(
        cells=[ContextCell(source="s = '<|fim_middle|><|endoftext|>'")],
        cells_below=[ContextCell(source="t = '<|im_start|>'")],
    )
    p = next_cell_prompt(ctx, PromptOptions(below=True), QWEN_FIM)
    inner = p.text[len("<|fim_prefix|>") : -len("<|fim_middle|>")]
    assert inner.count("<|") == 1  # the fim_suffix token only
    assert "s = ''" in p.text and "t = ''" in p.text
    chat = next_cell_prompt(ctx, PromptOptions(template="chatml"))
    assert chat.special and chat.text.count("<|fim_middle|>") == 0
    assert chat.text.count("<|im_start|>") == 3  # system, user, assistant


def test_examples_from_other_notebooks_come_first_as_files_of_the_repository():
    ctx = session(notebook_path="work/sales.ipynb")
    long = "\n".join(f"step{i}()" for i in range(15))
    examples = [
        Example("old/eda.ipynb", ("import pandas as pd", "df = pd.read_csv('x.csv')", "df.head()")),
        Example("t-1234", (long,)),
        Example("third.ipynb", ("never shown",)),
    ]
    plain = next_cell_prompt(ctx)
    # (off by default: measured, evaluating them made suggestions too slow, see README)
    assert next_cell_prompt(ctx, examples=examples, repo=QWEN_REPO) == plain
    two = PromptOptions(examples=2)
    p = next_cell_prompt(ctx, two, examples=examples, repo=QWEN_REPO)
    assert p.text == (
        "<|repo_name|>notebooks\n"
        + ("<|file_sep|>old/eda.py\n" + HEAD + code("import pandas as pd"))
        + (code("df = pd.read_csv('x.csv')") + code("df.head()"))
        + ("<|file_sep|>t-1234.py\n" + HEAD)
        + code("\n".join(f"step{i}()" for i in range(12)) + "\n...")
        + ("<|file_sep|>work/sales.py\n" + plain.text)
    )
    assert p.special and p.prefix == p.text and p.suffix is None
    assert p.stops == plain.stops + ["<|file_sep|>", "<|repo_name|>"]
    one = next_cell_prompt(
        ctx, PromptOptions(examples=1, example_lines=2), examples=examples, repo=QWEN_REPO
    )
    assert "t-1234" not in one.text and "df.head()" in one.text
    # Without the model's tokens, with the option off, the chat template or the cells below (a
    # fill-in-the-middle prompt), the examples are not used.
    assert next_cell_prompt(ctx, two, examples=examples) == plain
    chat = next_cell_prompt(
        ctx, PromptOptions(examples=2, template="chatml"), examples=examples, repo=QWEN_REPO
    )
    assert "<|file_sep|>" not in chat.text
    ctx.cells_below = [ContextCell(source="df.plot()", status="not run")]
    fim = next_cell_prompt(
        ctx, PromptOptions(examples=2, below=True), QWEN_FIM, examples=examples, repo=QWEN_REPO
    )
    assert fim.suffix is not None and "<|file_sep|>" not in fim.text


def test_examples_are_kept_whole_and_the_script_is_cut_to_the_engines_limit():
    ctx = build_context(code_rows(200))
    examples = [
        Example("a.ipynb", ("a = 1", "a + 1")),
        Example("<|fim_middle|>b\n<|file_sep|>x.ipynb", ("'<|endoftext|>'",)),
    ]
    p = next_cell_prompt(
        ctx, PromptOptions(cells=0, examples=2), examples=examples, repo=QWEN_REPO, limit=(400, 150)
    )
    files, script = p.text.split("<|file_sep|>notebook.py\n")
    assert files == (
        "<|repo_name|>notebooks\n<|file_sep|>a.py\n"
        + (HEAD + code("a = 1") + code("a + 1"))
        + ("<|file_sep|>b_x.py\n" + HEAD + code("''"))
    )  # a name or cell spelled like a special token loses it, a name its line breaks
    assert len(p.text) <= 400 and approx_tokens(p.text) <= 150
    assert script.startswith((IN + "x", "x")) and script.endswith(code("x199 = 199") + IN)
    assert p.text.count("<|") == 4  # the repository's name and three file separators, no more


def test_a_cell_reads_the_same_typed_and_run_and_the_percent_format_is_a_setting_away():
    """The default prompt holds no cell numbers: a cell being typed has none yet, and the
    prompt the plugin warms up while it is typed must be the one asked once it ran (the answer
    written ahead, the engine's cache). `# %%` cells (Jupytext's percent format) are the other
    style, with markdown marked as such."""
    ran = session()
    typed = session()
    for c in typed.cells:
        c.execution_count = None
    assert next_cell_prompt(typed) == next_cell_prompt(ran)
    assert "In[1]" not in next_cell_prompt(ran).text
    ran.cells[-1].output_text, ran.cells[-1].status = "Traceback\nNameError: x", "error"
    percent = PromptOptions(cell_style="percent")
    p = next_cell_prompt(ran, percent)
    assert p.text == (
        "# %% [markdown]\n# Load the data\n\n"
        "# %%\nimport pandas as pd\n\n"
        "# %%\nfor i in range(2):\n    print(i)\n# Out: Traceback\n#      NameError: x\n\n"
        "# %%\n"
    )
    assert p.stops[:2] == ["# %%", "\n# Out:"] and not p.special
    # The cells below, and the examples of other notebooks, are in the same style.
    ran.cells_below = [
        ContextCell(source="Now plot", cell_type="markdown"),
        ContextCell(source="x.plot()", status="not run"),
    ]
    fim = next_cell_prompt(ran, PromptOptions(cell_style="percent", below=True), QWEN_FIM)
    assert fim.suffix == "\n# %% [markdown]\n# Now plot\n\n# %%\nx.plot()\n"
    examples = [Example("old/eda.ipynb", ("import numpy as np", "np.ones(3)"))]
    shown = next_cell_prompt(
        ran, PromptOptions(cell_style="percent", examples=1), examples=examples, repo=QWEN_REPO
    )
    assert shown.text.startswith(
        "<|repo_name|>notebooks\n<|file_sep|>old/eda.py\n"
        "# %%\nimport numpy as np\n\n# %%\nnp.ones(3)\n\n<|file_sep|>notebook.py\n# %% [mark"
    )


@pytest.mark.parametrize(
    "path, name",
    [
        ("work/eda/sales.ipynb", "eda/sales.py"),
        ("sales report.ipynb", "sales_report.py"),
        ("/", "notebook.py"),
        (".", "notebook.py"),
        ("<|file_sep|>/a.ipynb", "a.py"),
        (None, "notebook.py"),
    ],
)
def test_the_notebooks_folder_and_name_as_a_file_of_a_repository(path, name):
    ctx = session(notebook_path=path)
    plain = next_cell_prompt(ctx)
    p = next_cell_prompt(ctx, PromptOptions(file_name=True), repo=QWEN_REPO)
    assert p.text == f"<|repo_name|>notebooks\n<|file_sep|>{name}\n" + plain.text
    assert p.special and p.stops == plain.stops + ["<|file_sep|>", "<|repo_name|>"]
    # Only for a model with these tokens, and the raw template.
    assert next_cell_prompt(ctx, PromptOptions(file_name=True)) == plain
    chat = next_cell_prompt(ctx, PromptOptions(file_name=True, template="chatml"), repo=QWEN_REPO)
    assert "<|file_sep|>" not in chat.text


def test_chatml_template_opens_a_code_fence():
    p = next_cell_prompt(session(), PromptOptions(template="chatml", runtime="none"))
    assert p.text.startswith("<|im_start|>system\nYou predict the next code cell")
    assert p.text.endswith("<|im_start|>assistant\n```python\n")
    assert "```" in p.stops and "<|im_end|>" in p.stops


def test_output_prompt_is_a_console_session():
    ctx = session(target_source="x = i + 1\nx")
    p = output_prompt(ctx)
    assert p.text == (
        ">>> import pandas as pd\n"
        ">>> for i in range(2):\n...     print(i)\n... \n0\n1\n"
        ">>> i\n1\n"
        ">>> x = i + 1\n... x\n"
    )
    assert p.stops == [">>> "]
    assert ">>> i\n" not in output_prompt(session(target_source="print(1)")).text
    assert completion_prompt(ctx, "output") == p
    assert completion_prompt(ctx, "next-cell") == next_cell_prompt(ctx)
    with pytest.raises(ValueError, match="unknown task"):
        completion_prompt(ctx, "poem")


def test_output_prompt_asks_the_console_for_what_the_cell_reads():
    """Live variables the cell reads are shown as a console shows them when asked, right
    before the cell: their value, an array's shape where its repr was cut, a frame's shape and
    columns. What the cell binds itself is not shown (its old value is not what it prints)."""
    columns = [f"c{k}" for k in range(25)]
    variables = [
        VariableInfo(name="i", type="int", summary={"repr": "1"}),
        VariableInfo(
            name="M",
            type="numpy.ndarray",
            summary={"shape": [2, 2], "repr": "array([[1, 2],\n       [3, 4]])"},
        ),
        VariableInfo(
            name="big",
            type="numpy.ndarray",
            summary={"shape": [1000], "repr": "array([  0,   1, ..., 999])"},
        ),
        VariableInfo(
            name="df",
            type="pandas.DataFrame",
            summary={"shape": [3, 2], "columns": ["a", "b"], "repr": "   a  b\n0 ..."},
        ),
        VariableInfo(
            name="wide", type="pandas.DataFrame", summary={"shape": [1, 25], "columns": columns}
        ),
        VariableInfo(name="token", type="str", summary={"redacted": True}),
        VariableInfo(name="obj", type="mymod.Thing", summary={}),
    ]

    def tail(source, with_runtime=True):
        ctx = PredictionContext(
            cells=[], variables=variables, target_source=source, with_runtime=with_runtime
        )
        return output_prompt(ctx).text

    assert tail("M.T") == ">>> M\narray([[1, 2],\n       [3, 4]])\n>>> M.T\n"
    assert tail("big.mean()") == ">>> big.shape\n(1000,)\n>>> big.mean()\n"
    assert tail("df.head()") == (
        ">>> df.shape\n(3, 2)\n>>> df.columns.tolist()\n['a', 'b']\n>>> df.head()\n"
    )
    wide = tail("wide.describe()")
    assert ">>> wide.columns.tolist()[:20]\n['c0'," in wide and "'c19']\n" in wide
    assert tail("print(token)") == ">>> print(token)\n"  # redacted: nothing of it
    assert tail("obj") == ">>> type(obj)\n<class 'mymod.Thing'>\n>>> obj\n"
    assert tail("M.T", with_runtime=False) == ">>> M.T\n"
    # A value shaped like the model's special tokens cannot end or steer the prompt.
    variables.append(VariableInfo(name="s", type="str", summary={"repr": "'<|endoftext|>hi'"}))
    assert tail("s + '!'") == ">>> s\n'hi'\n>>> s + '!'\n"
    # The very question the cell asks is not asked just before it (a small model then answers
    # something else): the cell shows the value itself.
    assert tail("M\n") == ">>> M\n"
    assert tail("df.shape") == ">>> df.shape\n"
    # Bound by the cell: assigned, augmented, a loop's target, imported, defined, deleted.
    for source in (
        "i = 5\nprint(i)",
        "i += 1\ni",
        "for i in range(3):\n    print(i)",
        "import i\ni",
        "def i():\n    pass\ni",
        "del i",
    ):
        assert ">>> i\n1\n" not in tail(source), source
    assert tail("x = i + 1\nx").startswith(">>> i\n1\n")  # read, not bound
    # Not Python (a magic): an assignment at a line's start still binds; a comparison does not.
    assert ">>> i\n1\n" not in tail("%%time\ni = 2\ni")
    assert tail("%%time\ni <= 2").startswith(">>> i\n1\n")
    # A cell run since the snapshot (its own was skipped) rebinds i: its old value is not shown.
    since = [ContextCell(source="i = 7"), ContextCell(source="print('hi')")]
    ctx = PredictionContext(cells=since, variables=variables, target_source="i + M.sum()")
    assert ">>> print('hi')\n>>> i\n1\n>>> M\n" in output_prompt(ctx).text
    ctx.runtime_lag = 2
    assert ">>> i\n1\n" not in output_prompt(ctx).text and ">>> M\n" in output_prompt(ctx).text
    ctx.runtime_lag = 1  # the snapshot came after `i = 7`: i is current
    assert ">>> i\n1\n" in output_prompt(ctx).text
    ctx.runtime_lag = 9  # older than every cell the context kept (it holds only the newest)
    assert ">>> i\n1\n" not in output_prompt(ctx).text


def test_output_prompt_shows_what_the_recorder_summarized_as_the_console_would():
    """The recorder's summaries (kernel/variables.py) of real values, asked for in the prompt:
    a small array's value is its repr, a long one's repr was cut so its shape is shown."""
    import numpy as np
    import pandas as pd

    from jupyter_themisto.kernel.variables import summarize, type_name

    values = {
        "small": np.array([[1, 2], [3, 4]]),
        "long": np.arange(1000),
        "df": pd.DataFrame({"x": [1, 2, 3], "y": ["a", "b", "c"]}),
        "name": "Ada",
    }
    variables = [
        VariableInfo(name=k, type=type_name(v), summary=summarize(v, 200))
        for k, v in values.items()
    ]
    ctx = PredictionContext(
        cells=[], variables=variables, target_source="(small * 2, long.sum(), df.x.max(), name)"
    )
    assert output_prompt(ctx).text == (
        f">>> small\n{values['small']!r}\n"
        ">>> long.shape\n(1000,)\n"
        ">>> df.shape\n(3, 2)\n>>> df.columns.tolist()\n['x', 'y']\n"
        ">>> name\n'Ada'\n"
        ">>> (small * 2, long.sum(), df.x.max(), name)\n"
    )


def test_output_prompt_keeps_its_newest_cells_and_a_stable_beginning():
    def cells(n, lines=1):
        return [
            ContextCell(
                source=f"v{i} = {i}\nprint(v{i})",
                output_text=f"{i}\n" * lines,
                order_index=i,
            )
            for i in range(n)
        ]

    long = PredictionContext(cells=cells(3, lines=30), target_source="v2")
    assert output_prompt(long).text.split("\n").count("2") == 20  # each output: ≤ 20 lines
    assert output_prompt(long).text.count("…") == 3

    ctx = PredictionContext(cells=cells(40), target_source="print(v39 + 1)")
    p = output_prompt(ctx, max_tokens=300)
    assert approx_tokens(p.text) <= 300 and p.text.endswith(">>> print(v39 + 1)\n")
    assert ">>> v39 = 39" in p.text and ">>> v0 = 0" not in p.text
    # Consecutive prompts share their beginning (the engine's cache serves them): it moves in
    # steps of half the budget, not with every new cell.
    firsts = [
        output_prompt(
            PredictionContext(cells=cells(k), target_source=f"v{k} = {k}"), max_tokens=300
        ).text.split("\n")[0]
        for k in range(10, 40)
    ]
    moves = sum(a != b for a, b in zip(firsts, firsts[1:], strict=False))
    assert 1 <= moves <= 6, firsts
    # A cell alone over the budget is still the prompt's end (the engine cuts its beginning).
    huge = PredictionContext(cells=cells(1), target_source="x = 1\n" * 500)
    cut = output_prompt(huge, max_tokens=100).text
    assert cut.endswith("... x = 1\n") and 90 <= approx_tokens(cut) <= 100


def test_prompts_are_cut_to_whole_lines_within_characters_and_tokens():
    numbers = "".join(f"row {i}: {i * 1013 % 99991}\n" for i in range(200))
    assert approx_tokens("df.head(10)") == 7  # df . head ( 1 0 ): about a tokenizer's count
    assert approx_tokens("x" * 600) >= 60  # a long run of letters is no single token
    assert cut_prompt(numbers, 10_000) == numbers
    by_chars = cut_prompt(numbers, 300)
    assert len(by_chars) <= 300 and by_chars.startswith("row ") and numbers.endswith(by_chars)
    by_tokens = cut_prompt(numbers, 10_000, 50)
    assert approx_tokens(by_tokens) <= 50 and by_tokens.startswith("row ")
    assert numbers.endswith(by_tokens) and len(by_tokens) < 300  # digits: a token each
    assert cut_prompt(numbers, 10_000, 0) == ""


def test_options_from_backend_settings():
    o = PromptOptions.from_settings(
        {"prompt_cells": "5", "prompt_markdown": "false", "prompt_runtime": "end", "seed": 3}
    )
    assert (o.cells, o.markdown, o.runtime) == (5, False, "end")
    assert PromptOptions.from_settings({"prompt_object_reprs": "false"}).object_reprs is False
    for bad, match in [
        ({"prompt_colour": 1}, "unknown prompt setting 'prompt_colour'"),
        ({"prompt_runtime": "middle"}, "prompt_runtime must be"),
        ({"prompt_outputs": "some"}, "prompt_outputs must be"),
        ({"prompt_template": "alpaca"}, "prompt_template must be"),
        ({"prompt_cells": "many"}, "prompt_cells must be a whole number"),
        ({"prompt_below": "maybe"}, "prompt_below must be true or false"),
        ({"prompt_window_step": 0}, "prompt_window_step"),
        ({"prompt_below_cells": -1}, "prompt_below_cells"),
        ({"prompt_object_reprs": "sometimes"}, "prompt_object_reprs must be true or false"),
        ({"prompt_cell_style": "light"}, "prompt_cell_style must be nbconvert or percent"),
        ({"prompt_file_name": "yes"}, "prompt_file_name must be true or false"),
    ]:
        with pytest.raises(ValueError, match=match):
            PromptOptions.from_settings(bad)


def grown(n, markdown=False):
    """A notebook of `n` executed cells of about 60 characters (with a markdown cell above
    each with `markdown`), as the context has them."""
    cells = []
    for i in range(n):
        if markdown:
            cells.append(ContextCell(source=f"Step {i}: what comes next", cell_type="markdown"))
        source = f"frame_{i} = load_part({i}, columns=['a', 'b'])  # part {i:03d}"
        cells.append(ContextCell(source=source, execution_count=i + 1, order_index=i))
    return PredictionContext(cells=cells)


def test_a_long_prompt_is_cut_in_steps_so_consecutive_prompts_share_their_beginning():
    options = PromptOptions(cells=0)  # every cell: only the character budget cuts
    budget = 1000
    prompts = [next_cell_prompt(grown(n), options, max_chars=budget).text for n in range(1, 80)]
    starts = [p.removeprefix(HEAD).split("\n", 4)[3] for p in prompts]
    for n, p in enumerate(prompts, start=1):
        assert len(p) <= budget and p.startswith(HEAD + IN + "frame_")
        assert f"part {n - 1:03d}" in p  # the newest cell is always there
        if len(next_cell_prompt(grown(n), options).text) > budget:
            assert len(p) >= budget // 2 - 80  # at most half the budget (and a cell) is lost
    # The beginning moved a few times in 79 cells (every half budget of new code), not with
    # each cell; between moves each prompt is the one before with the new cell appended.
    moves = sum(a != b for a, b in zip(starts, starts[1:], strict=False))
    assert 1 <= moves <= 79 * 70 // (budget // 2) + 1
    kept = [
        b for a, b in zip(prompts, prompts[1:], strict=False) if b.startswith(a.removesuffix(IN))
    ]
    assert len(kept) == len(prompts) - 1 - moves
    # Without a budget the prompt is the whole window, as before.
    assert next_cell_prompt(grown(30), options).text.count(IN) == 31


def test_a_cut_keeps_markdown_with_the_cell_below_it_and_fits_a_suffix():
    options = PromptOptions(cells=0, below=True)
    for n in range(5, 40):
        ctx = grown(n, markdown=True)
        p = next_cell_prompt(ctx, options, max_chars=900)
        assert p.text.startswith(HEAD + "# Step ")
        ctx.cells_below = [ContextCell(source="y = 1\n" * 200)]
        fim = next_cell_prompt(ctx, options, QWEN_FIM, max_chars=900)
        # The script keeps three quarters of the budget, the cells below a quarter.
        assert len(fim.prefix) <= 900 - 900 // 4 and len(fim.suffix or "") <= 900 // 4
        assert fim.text.startswith("<|fim_prefix|>" + HEAD + "# Step ")
    chat = next_cell_prompt(grown(60), PromptOptions(cells=0, template="chatml"), max_chars=1500)
    assert len(chat.text) <= 1500 and chat.text.startswith("<|im_start|>system")
