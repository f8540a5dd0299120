"""Checks of a suggested cell against the live kernel (backends/checks.py): names no cell bound
and the kernel lacks, attributes a built-in value lacks, columns a DataFrame lacks; and the
names a context says the kernel has (context.defined_names) from cells and the snapshot."""

from __future__ import annotations

from jupyter_themisto.backends.checks import unknown_references
from jupyter_themisto.context import PredictionContext, VariableInfo, defined_names

CELLS = [
    "import pandas as pd\nfrom sklearn.model_selection import train_test_split as split",
    "df = pd.read_csv('data.csv')\nnumbers = [1, 2, 3]",
    "%matplotlib inline\nfor i, row in df.iterrows():\n    pass",
    "def fit(X, y=None):\n    return X\nclass Model: ...",
    "!ls data",
]
VARIABLES = [
    VariableInfo("df", "pandas.DataFrame", {"shape": [3, 2], "columns": ["age", "colour"]}),
    VariableInfo("numbers", "list", {"len": 3}),
    VariableInfo("loaded_elsewhere", "int", {}),  # bound by a cell the context does not show
]


def context(with_runtime: bool = True, cells: list[str] = CELLS) -> PredictionContext:
    names = defined_names(cells, (v.name for v in VARIABLES)) if with_runtime else None
    return PredictionContext(variables=VARIABLES, with_runtime=with_runtime, defined_names=names)


def test_names_the_cells_and_the_snapshot_bound_are_known():
    names = context().defined_names
    assert names is not None
    # imports (aliases), assignments, loop targets, definitions, parameters, the snapshot,
    # builtins and IPython's own names; magics and shell lines do not stop the parse
    for name in ("pd", "split", "df", "numbers", "i", "row", "fit", "Model", "X", "y"):
        assert name in names, name
    assert {"loaded_elsewhere", "print", "display", "get_ipython"} <= names
    assert "train_test_split" not in names and "sklearn" not in names
    ok = "X_train, X_test = split(df)\nprint(len(numbers), loaded_elsewhere)\nfit(X_train)"
    assert unknown_references(ok, context()) == []
    # a name the suggestion binds itself before reading it is fine
    assert unknown_references("total = sum(numbers)\ntotal / 2", context()) == []


def test_what_the_kernel_lacks_is_named():
    ctx = context()
    assert unknown_references("train_test_split(df)\nplt.plot(x)", ctx) == [
        "plt",
        "train_test_split",
        "x",
    ]
    # an attribute a list does not have; one it has is fine
    assert unknown_references("numbers.shape", ctx) == ["numbers.shape"]
    assert unknown_references("numbers.append(4)", ctx) == []
    # a column the DataFrame lacks; one it has, and a DataFrame attribute, are fine
    assert unknown_references("df['color'].mean()", ctx) == ["df['color']"]
    assert unknown_references("df['colour'].mean() + df.age.max()", ctx) == []


def test_nothing_is_said_when_it_cannot_be_told():
    # no runtime information
    assert unknown_references("plt.plot(x)", context(with_runtime=False)) is None
    # the suggestion does not parse
    assert unknown_references("df[['a'", context()) is None
    # a star import may have bound anything: in the cells or in the suggestion
    star = context(cells=[*CELLS, "from pylab import *"])
    assert unknown_references("plot(x)", star) is None
    assert unknown_references("from math import *\nsqrt(2)", context()) is None
    # a DataFrame whose columns the snapshot cut short: any column may exist
    cut = VariableInfo("wide", "pandas.DataFrame", {"columns": ["a"], "columns_omitted": 90})
    ctx = PredictionContext(
        variables=[cut], with_runtime=True, defined_names=defined_names([], ["wide"])
    )
    assert unknown_references("wide['z']", ctx) == []
