"""Typed bodies of the prediction requests (pydantic), validated before anything runs."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    model_validator,
)

__all__ = [
    "NextCellRequest",
    "NotebookCell",
    "OutputRequest",
    "ValidationError",
    "describe_validation_error",
]


def _utf8(value: str) -> str:
    # JSON's "\ud800" escapes give strings no file, database or model server can take.
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"not valid Unicode (an unpaired surrogate at {e.start})") from None
    return value


Text = Annotated[str, AfterValidator(_utf8)]


class NotebookCell(BaseModel):
    """A cell of the notebook as the browser has it (optional context for the prediction)."""

    model_config = ConfigDict(extra="ignore")

    cell_type: Literal["code", "markdown", "raw"] = "code"
    source: Text = ""
    #: the nbformat cell id (recorded executions name it): places markdown beside its code
    id: Text | None = Field(None, max_length=200)


class PredictionRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    kernel_id: Text | None = Field(None, min_length=1, max_length=200)
    trajectory_id: Text | None = Field(None, min_length=1, max_length=200)
    notebook_path: Text | None = Field(None, max_length=4096)
    backend: Text | None = Field(None, min_length=1, max_length=100)
    #: the kernel's execution count of the cell the prediction follows (the one just run): the
    #: server waits until that execution is recorded (ThemistoExtensionApp.execution_wait)
    after_execution_count: int | None = Field(None, ge=1, le=2**63 - 1)
    with_runtime: bool = True
    client_id: Text | None = Field(None, max_length=200)
    cells: list[NotebookCell] | None = Field(None, max_length=10000)
    #: next cell: the notebook's cells below the insertion point, in notebook order
    cells_below: list[NotebookCell] | None = Field(None, max_length=10000)

    @model_validator(mode="after")
    def _needs_an_id(self) -> PredictionRequest:
        if not self.kernel_id and not self.trajectory_id and not self.notebook_path:
            raise ValueError("kernel_id, trajectory_id or notebook_path is required")
        return self


class NextCellRequest(PredictionRequest):
    n: int = Field(3, ge=1, le=20)
    #: only prepare: let the backend evaluate the prompt now (answered 204, no suggestion), so
    #: that the suggestion asked for later starts at once
    warm: bool = False
    #: with `warm`: also let a local model write the suggestion for that prompt, in the
    #: background, as the early answer once the cell has run (the plugin: while a cell is
    #: typed, and after a run that no suggestion was asked for; not as a cell starts running,
    #: which stops it instead: the run needs the cores)
    ahead: bool = False
    #: only stop what a local model is writing ahead (answered 204, nothing evaluated): the
    #: plugin sends it when the typing goes on after a warm-up with `ahead`, whose prompt, the
    #: cell as it was, is then gone; the writing would only take the cores from the typing
    stop_ahead: bool = False

    @model_validator(mode="after")
    def _stop_alone(self) -> NextCellRequest:
        if self.stop_ahead and (self.warm or self.ahead):
            raise ValueError("stop_ahead asks for nothing else: not with warm or ahead")
        return self


class OutputRequest(PredictionRequest):
    source: Text = Field(..., max_length=1_000_000)


def describe_validation_error(e: ValidationError) -> str:
    """One line per problem, naming the field: `n: Input should be greater than or equal to 1`."""
    parts = []
    for err in e.errors():
        loc = ".".join(str(x) for x in err.get("loc", ())) or "body"
        msg = err.get("msg", "invalid")
        if err.get("type") == "extra_forbidden":
            msg = "unknown field"
        parts.append(f"{loc}: {msg}")
    return "; ".join(parts)
