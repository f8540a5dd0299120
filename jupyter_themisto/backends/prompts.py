"""Prompts: what a model is given for a prediction, rendered from a PredictionContext.

Two families. Chat models (the `openai` and `anthropic` backends) get instructions and the
context as readable text (`render_prompt`). Models that continue text (the in-process
`llamacpp` and `seq2seq` backends) get a `Prompt` (`next_cell_prompt`, `output_prompt`): the
text to continue, the strings that end the answer, and, where the model knows
fill-in-the-middle, the cells below the insertion point as the suffix.

The next-cell prompt was shaped by measurement (benchmarks/prompt_ablation.py, numbers in
README "Prompts"): the executed cells in the order the person ran them, as plain code behind
`# %%` lines, is what a code model continues best. Anything rendered as comments right before
the open cell (outputs, variables) is imitated rather than used, so runtime information goes
where the model reads but does not continue it (`PromptOptions.runtime`). Of the outputs, only
an error of the newest cell is shown by default: on the benchmark corpus it is the one output
that raised the scores (the next cell mends the failed one); other outputs lowered them.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from pathlib import PurePosixPath
from typing import Any, Literal

from pydantic import Field

from ..context import (
    ContextCell,
    PredictionContext,
    VariableInfo,
    bound_names,
    parse_cell,
    variable_line,
)
from .base import Task
from .settings import BackendSettings

#: text shaped like a special token (`<|fim_prefix|>`, `<|endoftext|>`, …)
_SPECIAL = re.compile(r"<\|[A-Za-z_]+\|>")

#: the cell marker of the percent format (Jupytext, VS Code, Spyder)
CELL_MARKER = "# %%"

#: Code fences as a model's vocabulary may hold them, each as one token. An instruct model that
#: opens a fence after a console's `>>> ` cell goes on in prose ("```\n\nThis code snippet
#: creates a plot…"): 45 of 300 corpus output predictions did; a cell's output holds a fence in
#: 4 of 2,480. Output prompts ban them (`Prompt.banned`).
FENCES = ("```", "``", " ```", " ``", " ```\n", "```\n", "````")

#: What an output answer may not begin with when asked again after an empty one: greedy, the
#: model went straight on to the next `>>> ` (32 of 300 corpus answers), or continues the cell.
NOT_FIRST = (">>>", ">>", ">", "\n", "\n\n", " \n", "...", "...\n", " ...")

# An object's default repr says nothing about what comes next: `<Figure size 640x480 with 1
# Axes>`, `[<matplotlib.lines.Line2D at 0x7f…>]`, `<list_iterator at 0x7f…>`, `Text(0.5, 1.0,
# 'x')` (what plt.title returns), `<IPython.core.display.HTML object>`.
_REPR = (
    r"(?:<[^<>\n]*\bat 0x[0-9a-fA-F]+>|<Figure size [^<>\n]*>|<[\w.]+ object>"
    r"|<Axes(?:Subplot)?:[^<>\n]*>|Text\([^\n]*\))"
)
_OBJECT_REPR_LINE = re.compile(rf"\[?{_REPR}(?:, {_REPR})*(?:, …)?\]?")


def object_reprs_only(text: str) -> bool:
    """Whether an output is nothing but objects' default reprs (a figure, an iterator)."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return bool(lines) and all(_OBJECT_REPR_LINE.fullmatch(line) for line in lines)


@dataclass(frozen=True)
class FimTokens:
    """A model's fill-in-the-middle special tokens (prefix, suffix, middle)."""

    prefix: str
    suffix: str
    middle: str


#: Qwen2.5-Coder's (and StarCoder2-style models' with another spelling) FIM tokens
QWEN_FIM = FimTokens("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>")


@dataclass(frozen=True)
class RepoTokens:
    """A model's repository-level tokens: a repository's name, then each file after a
    separator and its path (what the model read in training as several files of one
    repository, the last one to continue)."""

    repo_name: str
    file_sep: str


#: Qwen2.5-Coder's repository-level tokens
QWEN_REPO = RepoTokens("<|repo_name|>", "<|file_sep|>")


@dataclass(frozen=True)
class Example:
    """Cells run one after another in another notebook (the history, a corpus), the last one
    being what followed cells like the newest ones of the notebook at hand."""

    #: the notebook's path (or its trajectory's id)
    name: str
    cells: tuple[str, ...]


@dataclass(frozen=True)
class Prompt:
    """What a text-continuation model runs for one answer.

    `text` is the whole prompt (with the FIM tokens when `suffix` is used); `stops` end the
    answer at the next cell. `prefix`/`suffix` are the two sides of a fill-in-the-middle prompt
    (`suffix` is None for a plain continuation).
    """

    text: str
    stops: list[str]
    prefix: str = ""
    suffix: str | None = None
    #: `text` holds the model's special tokens (FIM, a chat template), to be read as such
    special: bool = False
    #: the fill-in-the-middle tokens `text` was made with (when `suffix` is used)
    fim: FimTokens | None = None
    #: strings the answer never spells: an engine bans the tokens each of them is (llama.cpp:
    #: those the model has as one token; transformers: the token sequences)
    banned: tuple[str, ...] = ()


@dataclass(frozen=True)
class PromptOptions:
    """How a next-cell prompt is built (backend settings `prompt_<name>`).

    cells: the most executed cells shown (the newest; 0: all that the context holds).
    window_step: the first cell shown moves in steps of this many executions, so that the
      prompts of consecutive cells share their beginning (a model's prompt cache reuses it);
      between `cells` and `cells + window_step - 1` cells are shown.
    outputs: "none", "error" (the newest cell's output when it raised, as comments), "last"
      (the newest cell's output, whatever it is) or "all"; only with runtime information (an
      output is part of it).
    runtime: where the live variables go: "none", "header" (a docstring at the top, read but
      not continued), "end" (comments right before the open cell).
    markdown: markdown cells of the notebook, as `# %% [markdown]` cells where they stand.
    below: the cells below the insertion point, as the suffix of a fill-in-the-middle prompt
      (only for models with FIM tokens; off by default: it lowered the scores, see README).
    below_cells: how many of the cells below (the nearest) the suffix holds.
    max_output_lines: lines kept of an output shown.
    object_reprs: outputs that are nothing but objects' default reprs (`<Figure size 640x480
      with 1 Axes>`, `<list_iterator at 0x…>`) shown too (False: left out, as no output).
    template: "raw" (the script to continue) or "chatml" (the script inside an instruct model's
      ChatML conversation, the assistant's answer opened with a code fence).
    examples: places in other notebooks (the recorded history) whose cells resemble the newest
      ones, shown before the script as other files of the repository (only for models with
      repository-level tokens, with the raw template and without the cells below). Off by
      default: they change the prompt's beginning at every cell, so nothing of it is cached.
    example_lines: lines kept of each cell of an example.
    cell_style: how a cell begins: "nbconvert" (`# In[ ]:` and blank lines, as `jupyter
      nbconvert --to script` writes a notebook, but without the cells' numbers: a cell being
      typed has none yet, and its prompt must read as it will once the cell ran) or "percent"
      (`# %%`, Jupytext's percent format).
    file_name: the notebook's name (its folder and file, as a `.py` file) before the script,
      as a repository's file (models with repository-level tokens, the raw template).
    """

    cells: int = 10
    window_step: int = 10
    outputs: str = "error"
    runtime: str = "none"
    markdown: bool = True
    below: bool = False
    below_cells: int = 2
    max_output_lines: int = 6
    object_reprs: bool = True
    template: str = "raw"
    examples: int = 0
    example_lines: int = 12
    cell_style: str = "nbconvert"
    file_name: bool = False

    @classmethod
    def from_settings(cls, settings: dict[str, Any]) -> PromptOptions:
        """Options from backend settings named `prompt_<option>`; unknown ones are errors."""
        known = {f.name: f for f in fields(cls)}
        values: dict[str, Any] = {}
        for key, value in settings.items():
            if not key.startswith("prompt_"):
                continue
            name = key[len("prompt_") :]
            if name not in known:
                raise ValueError(
                    f"unknown prompt setting {key!r}: expected one of "
                    + ", ".join("prompt_" + n for n in known)
                )
            default = getattr(cls(), name)
            values[name] = _coerce(key, value, default)
        options = replace(cls(), **values)
        options.check()
        return options

    def check(self) -> None:
        if self.outputs not in ("none", "error", "last", "all"):
            raise ValueError(
                f"prompt_outputs must be none, error, last or all, not {self.outputs!r}"
            )
        if self.runtime not in ("none", "header", "end"):
            raise ValueError(f"prompt_runtime must be none, header or end, not {self.runtime!r}")
        if self.template not in ("raw", "chatml"):
            raise ValueError(f"prompt_template must be raw or chatml, not {self.template!r}")
        if self.cell_style not in ("nbconvert", "percent"):
            raise ValueError(
                f"prompt_cell_style must be nbconvert or percent, not {self.cell_style!r}"
            )
        counts = (self.cells, self.below_cells, self.max_output_lines, self.examples)
        if min(counts) < 0 or min(self.window_step, self.example_lines) < 1:
            raise ValueError(
                "prompt_cells, prompt_below_cells, prompt_max_output_lines, prompt_examples ≥ 0"
                " and prompt_window_step, prompt_example_lines ≥ 1"
            )


_PROMPT = PromptOptions()


class PromptSettings(BackendSettings):
    """The `prompt_*` settings of the backends that continue text (`PromptOptions`)."""

    prompt_cells: int = Field(
        _PROMPT.cells,
        ge=0,
        description="the newest executed cells shown (0: all the context holds)",
    )
    prompt_window_step: int = Field(
        _PROMPT.window_step,
        ge=1,
        description="the first cell shown moves in steps of this many executions, so"
        " consecutive prompts share their beginning and the model's prompt cache serves it"
        " (between `prompt_cells` and `prompt_cells + step − 1` cells shown)",
    )
    prompt_outputs: Literal["none", "error", "last", "all"] = Field(
        _PROMPT.outputs,  # type: ignore[arg-type]
        description="with runtime information: `none`, `error` (the newest cell's output when"
        " it raised, as `# Out:` comments), `last` (the newest cell's output, whatever it is) or"
        " `all`",
    )
    prompt_max_output_lines: int = Field(
        _PROMPT.max_output_lines, ge=0, description="lines kept of an output shown"
    )
    prompt_object_reprs: bool = Field(
        _PROMPT.object_reprs,
        description="outputs that are nothing but objects' default reprs (`<Figure size 640x480"
        " with 1 Axes>`, `<list_iterator at 0x…>`) shown too (`false`: left out, as no output)",
    )
    prompt_runtime: Literal["none", "header", "end"] = Field(
        _PROMPT.runtime,  # type: ignore[arg-type]
        description="where the live variables go: `none`, `header` (a docstring at the top),"
        " `end` (comments before the open cell)",
    )
    prompt_markdown: bool = Field(_PROMPT.markdown, description="markdown cells of the notebook")
    prompt_below: bool = Field(
        _PROMPT.below,
        description="the cells below the insertion point as a FIM suffix (models with FIM tokens)",
    )
    prompt_below_cells: int = Field(
        _PROMPT.below_cells, ge=0, description="how many of the cells below the suffix holds"
    )
    prompt_template: Literal["raw", "chatml"] = Field(
        _PROMPT.template,  # type: ignore[arg-type]
        description="`raw` (the script to continue) or `chatml` (inside an instruct model's"
        " ChatML conversation)",
    )
    prompt_examples: int = Field(
        _PROMPT.examples,
        ge=0,
        description="places in your other notebooks (the recorded history) whose cells resemble"
        " the newest ones, each its best-matching cell and the 2 run before it, shown before"
        " the script as other files of the project (models with repository-level tokens, like"
        " Qwen2.5-Coder's; not with `prompt_below`). Off by default (0): the examples change"
        " with every cell, so the engine evaluates the whole prompt anew each time, seconds"
        " on 2 cores (see README for what they gain and cost)",
    )
    prompt_example_lines: int = Field(
        _PROMPT.example_lines, ge=1, description="lines kept of each cell of an example"
    )
    prompt_cell_style: Literal["nbconvert", "percent"] = Field(
        _PROMPT.cell_style,  # type: ignore[arg-type]
        description="how each cell begins: `nbconvert` (`# In[ ]:` and blank lines, as `jupyter"
        " nbconvert --to script` writes a notebook, unnumbered) or `percent` (`# %%`)",
    )
    prompt_file_name: bool = Field(
        _PROMPT.file_name,
        description="the notebook's folder and name before the script, as a file of a"
        " repository (models with repository-level tokens, like Qwen2.5-Coder's)",
    )

    def prompt_options(self) -> PromptOptions:
        """The PromptOptions these settings give."""
        return PromptOptions(
            **{f.name: getattr(self, "prompt_" + f.name) for f in fields(PromptOptions)}
        )


def _coerce(key: str, value: Any, default: Any) -> Any:
    if isinstance(default, bool):
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        if not isinstance(value, bool):
            raise ValueError(f"{key} must be true or false, not {value!r}")
        return value
    if isinstance(default, int):
        try:
            return int(value)
        except (TypeError, ValueError):
            raise ValueError(f"{key} must be a whole number, not {value!r}") from None
    return str(value)


def _cut_output(cell: ContextCell, limit: int) -> list[str]:
    """The lines of a cell's output, at most `limit` of them and a `…` where some were cut."""
    lines = cell.output_text.rstrip().splitlines()
    if len(lines) > limit:
        # A cell that raised ends with its error (`NameError: name 'x' is not defined`): kept.
        lines = ["…"] + lines[-limit:] if cell.status == "error" else lines[:limit] + ["…"]
    return lines


def _output_lines(cell: ContextCell, limit: int) -> list[str]:
    lines = _cut_output(cell, limit)
    return [("# Out: " if i == 0 else "#      ") + line for i, line in enumerate(lines)]


def _window(cells: list[ContextCell], options: PromptOptions) -> list[ContextCell]:
    """The newest `options.cells` code cells, with the markdown cells that stand among them."""
    code = [i for i, c in enumerate(cells) if c.cell_type == "code"]
    if not options.cells or len(code) <= options.cells:
        return cells
    indexes = [cells[i].order_index for i in code]
    if any(x is None for x in indexes):
        kept = code[-options.cells :]
    else:
        # Count in executions since the trajectory began, so that the window's start is the
        # same for a stretch of consecutive cells and the prompt's beginning stays put.
        newest = int(indexes[-1] or 0)
        start = (max(0, newest + 1 - options.cells) // options.window_step) * options.window_step
        kept = [i for i in code if int(cells[i].order_index or 0) >= start]
    begin = kept[0]
    # Markdown right above the first kept cell belongs to it.
    while begin > 0 and cells[begin - 1].cell_type == "markdown":
        begin -= 1
    return cells[begin:]


#: the lines `jupyter nbconvert --to script` writes first
NBCONVERT_HEAD = ["#!/usr/bin/env python", "# coding: utf-8", ""]


#: the line nbconvert writes before a code cell, unnumbered
IN_MARKER = "# In[ ]:"


def _markdown_block(cell: ContextCell, style: str) -> str:
    """A markdown cell as comments, in the prompt's cell style."""
    head = [f"{CELL_MARKER} [markdown]"] if style == "percent" else []
    return "\n".join(head + ["# " + line for line in cell.source.splitlines()] + [""]) + "\n"


def _code_block(lines: list[str], style: str) -> str:
    """A code cell's lines (its source, and an output shown) in the prompt's cell style."""
    if style == "percent":
        return "\n".join([CELL_MARKER, *lines, ""]) + "\n"
    return "\n".join([IN_MARKER, "", "", *lines, "", "", ""])


#: what a code model's tokenizer makes a token of, about: each digit (Qwen's and Llama 3's
#: split numbers so), a word with the space before it, a run of punctuation, a run of spaces
_TOKEN = re.compile(r"\d| ?[^\W\d_]{1,10}| ?[^\w\s]+|_+|\s+")


def approx_tokens(text: str) -> int:
    """About how many tokens `text` is for a code model. On 30 corpus output prompts it was
    0.90–1.11 of Qwen2.5-Coder's own count; characters / 3 was 0.52–1.24 of it (numbers and
    tables are a token a character or two)."""
    return len(_TOKEN.findall(text))


def cut_prompt(prompt: str, max_chars: int, max_tokens: int | None = None) -> str:
    """The tail of `prompt` within `max_chars` and `max_tokens` (`approx_tokens`), starting at
    a line (the newest cells matter most, and the prompt ends where the answer begins)."""
    start = max(0, len(prompt) - max_chars)
    if max_tokens is not None:
        starts = [m.start() for m in _TOKEN.finditer(prompt, start)]
        if len(starts) > max_tokens:
            start = starts[-max_tokens] if max_tokens > 0 else len(prompt)
    if not start:
        return prompt
    tail = prompt[start:]
    newline = tail.find("\n")
    return tail[newline + 1 :] if 0 <= newline < len(tail) - 1 else tail


def stable_start(
    blocks: list[str],
    fixed: int,
    budget: int | None,
    after: list[bool],
    size: Callable[[str], int] = len,
) -> int:
    """The first of `blocks` (the rendered cells, oldest first) a prompt of at most `budget`
    keeps, besides `fixed` that are always there (both measured by `size`: in characters, or
    in tokens with `approx_tokens`).

    Old cells go in steps of half the budget, counted from the first block: the cut stays at
    the same cell while the newest cells add up to half a budget, so consecutive prompts share
    their beginning and the engine's prompt cache serves all but the new cells (a cut that
    moved with every new cell would make each prompt new: a prefill of the whole budget, the
    slow "cold" case, every time). Between half and all of the budget is kept. `after[i]`
    says whether block i may begin the prompt (not a code cell right below its markdown).
    """
    sizes = [size(b) for b in blocks]
    total = fixed + sum(sizes)
    if budget is None or total <= budget or not blocks:
        return 0
    step = max(1, budget // 2)
    over = total - budget
    threshold = -(-over // step) * step  # `over` rounded up to whole steps
    dropped = 0
    for i, n in enumerate(sizes):
        if dropped >= threshold and after[i]:
            return i
        dropped += n
    return len(blocks) - 1  # the newest cell alone is over the budget (the engine cuts it)


def next_cell_prompt(
    ctx: PredictionContext,
    options: PromptOptions | None = None,
    fim: FimTokens | None = None,
    max_chars: int | None = None,
    examples: list[Example] | None = None,
    repo: RepoTokens | None = None,
    limit: tuple[int, int] | None = None,
) -> Prompt:
    """The next cell as the open last cell of a percent-format script.

    The executed cells (newest `options.cells`) as plain code in the order they ran, markdown
    cells where they stand, the runtime summary where `options.runtime` puts it, and with `fim`
    and cells below the insertion point a fill-in-the-middle prompt whose suffix holds them.
    With `max_chars`, the script (the suffix has its own quarter of it) keeps its newest cells
    within that many characters, its beginning moved in steps (`stable_start`). With `examples`
    and a model's `repo` tokens, the examples come first as other files of the repository and
    the script is the last file; `limit` (characters, tokens: what the engine keeps of a
    prompt) then cuts the script, never the examples.
    """
    options = options or PromptOptions()
    cells = [c for c in ctx.cells if options.markdown or c.cell_type != "markdown"]
    cells = _window(cells, options)
    newest = max((i for i, c in enumerate(cells) if c.cell_type == "code"), default=-1)
    head: list[str] = []
    variables = [variable_line(v) for v in ctx.variables] if ctx.with_runtime else []
    if variables and options.runtime == "header":
        head += ['"""Live variables of the kernel:', *variables, '"""', ""]
    style = options.cell_style
    if style == "nbconvert":
        head[:0] = NBCONVERT_HEAD
    blocks: list[str] = []
    for i, c in enumerate(cells):
        if c.cell_type == "markdown":
            blocks.append(_markdown_block(c, style))
            continue
        lines = [c.source.rstrip()]
        # Outputs and errors are runtime information too: shown only with it.
        if (
            ctx.with_runtime
            and c.output_text.strip()
            and (
                options.outputs == "all"
                or (options.outputs == "last" and i == newest)
                or (options.outputs == "error" and i == newest and c.status == "error")
            )
            and (options.object_reprs or not object_reprs_only(c.output_text))
        ):
            lines += _output_lines(c, options.max_output_lines)
        blocks.append(_code_block(lines, style))
    tail: list[str] = []
    if variables and options.runtime == "end":
        tail += ["# Live variables:", *("#   " + v for v in variables), ""]
    if style == "percent":
        tail += [CELL_MARKER, ""]
    else:
        tail += [IN_MARKER, "", "", ""]
    head_text, tail_text = "".join(line + "\n" for line in head), "\n".join(tail)
    below_wanted = fim is not None and options.below and bool(ctx.cells_below)
    budget = max_chars - max_chars // 4 if max_chars is not None and below_wanted else max_chars
    if budget is not None and options.template == "chatml":
        budget -= len(_chatml(""))
    may_begin = [
        c.cell_type == "markdown" or i == 0 or cells[i - 1].cell_type != "markdown"
        for i, c in enumerate(cells)
    ]
    start = stable_start(blocks, len(head_text) + len(tail_text), budget, may_begin)
    # Engines read special tokens spelled in the prompt as such: none may come from the notebook.
    prefix = _SPECIAL.sub("", head_text + "".join(blocks[start:]) + tail_text)
    stops = [CELL_MARKER if style == "percent" else "# In[", "\n# Out:"]
    shown = (examples or [])[: options.examples]
    files_wanted = bool(shown) or options.file_name
    if files_wanted and repo is not None and options.template == "raw" and not below_wanted:
        files = _repository(ctx, shown, repo, options.example_lines, style)
        if limit is not None:
            chars, tokens = limit
            kept = cut_prompt(prefix, chars - len(files), tokens - approx_tokens(files))
            prefix = kept.lstrip("\n") if kept != prefix else prefix
        text = files + prefix
        stops += [repo.file_sep, repo.repo_name]
        return Prompt(text=text, stops=stops, prefix=text, special=True)
    if options.template == "chatml":
        text = _chatml(prefix)
        return Prompt(text=text, stops=stops + ["```", "<|im_end|>"], prefix=text, special=True)
    below = [c for c in ctx.cells_below if options.markdown or c.cell_type != "markdown"]
    below = below[: options.below_cells]
    if fim is None or not options.below or not below:
        return Prompt(text=prefix, stops=stops, prefix=prefix)
    after = "".join(
        _markdown_block(c, style)
        if c.cell_type == "markdown"
        else _code_block([c.source.rstrip()], style)
        for c in below
    )
    suffix = _SPECIAL.sub("", "\n" + after.removesuffix("\n"))
    if max_chars is not None:
        suffix = suffix[: max_chars // 4]
    text = fim.prefix + prefix + fim.suffix + suffix + fim.middle
    return Prompt(
        text=text,
        stops=stops + [fim.prefix, fim.suffix],
        prefix=prefix,
        suffix=suffix,
        special=True,
        fim=fim,
    )


def _repository(
    ctx: PredictionContext,
    examples: list[Example],
    repo: RepoTokens,
    max_lines: int,
    style: str,
) -> str:
    """The examples as files of a repository, their cells in the prompt's cell style, and the
    separator of the notebook's own file (the script follows it)."""

    def file_name(path: str) -> str:
        # The folder and the name: `02-DataFrames/Snippets.py` (what the notebook is about).
        parts = list(PurePosixPath(path.replace("\\", "/")).parts[-2:])
        parts[-1:] = [PurePosixPath(p).stem for p in parts[-1:]]
        names = [re.sub(r"\s+", "_", _SPECIAL.sub("", p)).strip("_/.") for p in parts]
        return "/".join(n for n in names if n) + ".py" if any(names) else "notebook.py"

    files = [f"{repo.repo_name}notebooks\n"]
    head = "".join(line + "\n" for line in NBCONVERT_HEAD) if style == "nbconvert" else ""
    for example in examples:
        cells = [head]
        for source in example.cells:
            lines = _SPECIAL.sub("", source).rstrip().splitlines()
            cut = lines[:max_lines] + (["..."] if len(lines) > max_lines else [])
            cells.append(_code_block(["\n".join(cut)], style))
        files.append(f"{repo.file_sep}{file_name(example.name)}\n" + "".join(cells))
    files.append(f"{repo.file_sep}{file_name(ctx.notebook_path or 'notebook')}\n")
    return "".join(files)


def _chatml(script: str) -> str:
    """`script` inside an instruct model's ChatML conversation, the answer's fence opened."""
    return (
        f"<|im_start|>system\n{NEXT_CELL_INSTRUCTIONS}<|im_end|>\n<|im_start|>user\n"
        f"```python\n{script}```<|im_end|>\n<|im_start|>assistant\n```python\n"
    )


def output_prompt(
    ctx: PredictionContext, max_tokens: int | None = None, max_output_lines: int = 20
) -> Prompt:
    """An output as what a Python console session prints after the cell.

    `>>> ` and `... ` before each cell's lines (an indented block ends with an empty `... `
    line, as a console needs it to run the block), then what it printed, at most
    `max_output_lines` lines of it. With runtime information, the live variables the cell
    reads (and does not bind) come right before it, as the console shows them when asked
    (`_echo`: `>>> v` and its value; a small model copies what it is shown, so only those,
    never one the cell or a cell run since the snapshot rebinds, and never the cell's own
    question). Ends at the next `>>> `, and never opens a code fence (`FENCES`: an instruct
    model's way into prose).
    With `max_tokens`, the session keeps its newest cells within about that many tokens
    (`approx_tokens`), its beginning moved in steps (`stable_start`: consecutive prompts of a
    notebook share it, and the engine's cache), and a cell too long for it alone keeps its end.
    """
    shown = ctx.variables if ctx.with_runtime else []
    named = set(re.findall(r"[A-Za-z_]\w*", ctx.target_source or ""))
    named -= _bound(ctx.target_source or "")
    # Cells run since the snapshot (`runtime_lag`) may have rebound a variable: not shown.
    ran = [c.source for c in ctx.cells if c.cell_type == "code" and c.status != "not run"]
    for source in ran[len(ran) - ctx.runtime_lag :] if ctx.runtime_lag else []:
        named -= _bound(source)
    cell = ctx.target_source.strip() if ctx.target_source else ""
    asked: list[str] = []
    for echo in (_echo(v) for v in shown if v.name in named):
        # Asked right before the very same question (`>>> x` before the cell `x`), a small model
        # takes the repeat for a mistake and answers something else (or nothing): the cell is left
        # to show the value itself.
        if f">>> {cell}" not in echo[::2]:
            asked += echo

    def console(source: str) -> list[str]:
        src = source.rstrip().splitlines() or [""]
        lines = [">>> " + src[0]] + ["... " + line for line in src[1:]]
        if len(src) > 1 and src[-1][:1] in (" ", "\t"):
            lines.append("... ")
        return lines

    blocks: list[str] = []
    for c in ctx.cells:
        if c.cell_type != "code" or c.status == "not run":
            continue
        lines = console(c.source)
        if c.output_text.strip():
            lines += _cut_output(c, max_output_lines)
        blocks.append("\n".join(lines) + "\n")
    tail = "".join(f"{line}\n" for line in asked)
    tail += "\n".join(console(ctx.target_source or "")) + "\n"
    fixed = approx_tokens(tail)
    start = stable_start(blocks, fixed, max_tokens, [True] * len(blocks), approx_tokens)
    text = _SPECIAL.sub("", "".join(blocks[start:]) + tail)
    if max_tokens is not None:
        text = cut_prompt(text, len(text), max_tokens)  # a cell too long alone keeps its end
    return Prompt(text=text, stops=[">>> "], prefix=text, banned=FENCES)


def _echo(v: VariableInfo) -> list[str]:
    """A live variable as a console shows it when asked: its value, else its shape (an array
    whose repr was cut), a frame's shape and columns; nothing of a redacted one."""
    s = v.summary
    if s.get("redacted"):
        return []
    shape = [f">>> {v.name}.shape", str(tuple(s["shape"]))] if s.get("shape") else []
    if s.get("columns"):
        columns = [str(c) for c in s["columns"]]
        ask = f"{v.name}.columns.tolist()" + ("[:20]" if len(columns) > 20 else "")
        return shape + [f">>> {ask}", str(columns[:20])]
    text = str(s.get("repr") or "")
    cut = "..." in text  # the recorder's short repr ends so, reprlib's elides the middle so
    if text and not (cut and shape):
        return [f">>> {v.name}", text]
    return shape or [f">>> type({v.name})", f"<class '{v.type}'>"]


#: what may stand before `=` in an augmented assignment (`+=`, `//=`, `**=`, `>>=`, …)
_AUGMENTED = r"(?:[-+*/%&|^@]|//|\*\*|<<|>>)"


def _bound(source: str) -> set[str]:
    """The names a cell binds (assignments, loop targets, imports, definitions): what they held
    before it ran is not what it shows. A cell that is not Python (a cell magic, a syntax
    error): the names assigned at the start of a line."""
    tree = parse_cell(source)
    if tree is not None:
        return bound_names(tree)
    return set(re.findall(rf"^\s*([A-Za-z_]\w*)\s*{_AUGMENTED}?=(?!=)", source, re.M))


def completion_prompt(
    ctx: PredictionContext,
    task: Task,
    options: PromptOptions | None = None,
    fim: FimTokens | None = None,
) -> Prompt:
    """The Prompt of `task` ("next-cell" or "output") for a text-continuation model."""
    if task == "next-cell":
        return next_cell_prompt(ctx, options, fim)
    if task == "output":
        return output_prompt(ctx)
    raise ValueError(f"unknown task {task!r}: expected 'next-cell' or 'output'")


# -- chat models ------------------------------------------------------------------------------

NEXT_CELL_INSTRUCTIONS = (
    "You predict the next code cell a person will run in a Jupyter notebook, from the cells "
    "they ran so far (in the order they ran them) and the live variables of their kernel. "
    "Answer with the Python code of the next cell only: no explanation, no Markdown fences."
)
OUTPUT_INSTRUCTIONS = (
    "You predict the text output a Jupyter notebook cell will print or display when it runs, "
    "from the cells run before it and the live variables of the kernel. Answer with the "
    "output text only, exactly as Jupyter would show it: no explanation, no Markdown fences."
)


def render_context(ctx: PredictionContext) -> str:
    """The context as plain text for a chat model: notes, cells in run order, variables."""
    lines: list[str] = []
    if ctx.notebook_path:
        lines.append(f"# Notebook: {ctx.notebook_path}")
    for c in ctx.cells:
        if c.cell_type == "markdown":
            lines.append("# [markdown]")
            lines.extend("# " + line for line in c.source.splitlines())
            continue
        count = c.execution_count if c.execution_count is not None else " "
        lines.append(f"# In[{count}]:" + ("" if c.status == "ok" else f" ({c.status})"))
        lines.append(c.source.rstrip())
        if c.output_text.strip():
            lines.append("# Out:")
            lines.extend("# " + line for line in c.output_text.rstrip().splitlines())
    if ctx.with_runtime and ctx.variables:
        lines.append("# Live variables (most recently changed first):")
        lines.extend("#   " + variable_line(v) for v in ctx.variables)
    return "\n".join(lines) + "\n"


def render_prompt(ctx: PredictionContext, task: Task) -> tuple[str, str]:
    """(instructions, prompt text) for a chat model, `task` "next-cell" or "output"."""
    body = render_context(ctx)
    if task == "output":
        body += f"# The cell to predict the output of:\n{(ctx.target_source or '').rstrip()}\n"
        return OUTPUT_INSTRUCTIONS, body
    if task != "next-cell":
        raise ValueError(f"unknown task {task!r}: expected 'next-cell' or 'output'")
    body += "# The next cell:\n"
    return NEXT_CELL_INSTRUCTIONS, body


__all__ = [
    "CELL_MARKER",
    "QWEN_FIM",
    "QWEN_REPO",
    "Example",
    "FimTokens",
    "Prompt",
    "PromptOptions",
    "RepoTokens",
    "approx_tokens",
    "completion_prompt",
    "cut_prompt",
    "next_cell_prompt",
    "object_reprs_only",
    "output_prompt",
    "stable_start",
    "render_context",
    "render_prompt",
]
