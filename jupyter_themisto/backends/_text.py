"""Text clean-up shared by the model backends: code fences and stop strings in streamed text."""

from __future__ import annotations

import re
from collections.abc import AsyncIterable, AsyncIterator, Sequence

from ..context import parse_cell
from .base import NextCellChunk, NoPrediction, OutputChunk


class FenceStripper:
    """Removes Markdown code fences from streamed model text as it streams.

    Models asked for bare code still often answer "```python\\n…\\n```"; inserting that into a
    cell is a known annoyance. A leading fence line is dropped, and everything from a closing
    fence line on (often an explanation) too. Text is held back only while its line could still
    turn out to be a fence (white space or up to three backticks so far); the rest of a line
    passes at once, so the first word of a suggestion need not wait for the end of its line.
    """

    def __init__(self) -> None:
        self._buf = ""
        self._started = False
        self._closed = False
        self._mid_line = False  # the current line's beginning was passed on already

    def feed(self, text: str) -> str:
        if self._closed:
            return ""
        self._buf += text
        out: list[str] = []
        while "\n" in self._buf and not self._closed:
            line, self._buf = self._buf.split("\n", 1)
            out.append(self._line(line, complete=True))
        if self._buf and not self._closed and (self._mid_line or not _may_be_fence(self._buf)):
            out.append(self._buf)
            self._buf, self._started, self._mid_line = "", True, True
        return "".join(out)

    def finish(self) -> str:
        if self._closed:
            return ""
        rest, self._buf = self._buf, ""
        return self._line(rest, complete=False) if rest else ""

    def _line(self, line: str, *, complete: bool) -> str:
        end = "\n" if complete else ""
        if self._mid_line:  # its beginning was no fence
            self._mid_line = not complete
            return line + end
        fence = line.strip().startswith("```")
        if not self._started:
            if not line.strip() and complete:
                return ""  # leading blank lines
            self._started = True
            if fence:
                return ""
        elif fence:
            self._closed = True
            return ""
        return line + end


def _may_be_fence(partial_line: str) -> bool:
    """Whether a line that begins so could still be a fence line."""
    head = partial_line.lstrip()[:3]
    return "```".startswith(head)


async def unfenced(texts: AsyncIterable[str]) -> AsyncIterator[tuple[str, bool]]:
    """Streamed model text through one FenceStripper: (text, False) for each non-empty piece
    as it passes, then (what was held back, True), possibly empty."""
    s = FenceStripper()
    async for text in texts:
        out = s.feed(text)
        if out:
            yield out, False
    yield s.finish(), True


async def output_chunks(texts: AsyncIterable[str]) -> AsyncIterator[OutputChunk]:
    """An output prediction streamed from a model's text, code fences stripped."""
    got = False
    async for out, _last in unfenced(texts):
        if out:
            got = True
            yield OutputChunk(text=out)
    if not got:
        raise NoPrediction("the model returned no output prediction")


def strip_code_fences(text: str) -> str:
    """The whole-text form of FenceStripper."""
    s = FenceStripper()
    return s.feed(text) + s.finish()


class StopScanner:
    """Cuts streamed text at the first stop string (a cell boundary), across chunk borders.

    Text that could be the start of a stop string is held back until the next chunk tells;
    once a stop string is seen, it and everything after it are dropped and `stopped` is set.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self._buf = ""
        self.stopped = False

    def feed(self, text: str) -> str:
        if self.stopped:
            return ""
        self._buf += text
        cut = min((i for i in (self._buf.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            out, self._buf = self._buf[:cut], ""
            self.stopped = True
            return out
        hold = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(self._buf)), 0, -1):
                if self._buf.endswith(s[:n]):
                    hold = max(hold, n)
                    break
        out = self._buf[: len(self._buf) - hold]
        self._buf = self._buf[len(out) :]
        return out

    def finish(self) -> str:
        if self.stopped:
            return ""
        rest, self._buf = self._buf, ""
        return rest


class AnswerBounds:
    """Ends a streamed code answer before it rambles: at most `max_lines` lines, and no loops.

    A small model that has lost its way tends to write the same line again and again (`df.head()`
    ten times) or to cycle through a few lines. The answer is cut before a line that repeats one
    of the previous `window` lines for the `max_repeats`-th time (0: never), and before line
    `max_lines`+1.
    Text is passed on line by line once a line is complete; the last, partial line as it
    streams (it is checked when it completes). `stopped` says the answer should end.
    """

    def __init__(self, max_lines: int = 30, max_repeats: int = 2, window: int = 8) -> None:
        self.max_lines = max_lines
        self.max_repeats = max_repeats
        self.window = window
        self.stopped = False
        self._lines: list[str] = []
        self._partial = ""  # the current line so far, already passed on
        self._held = ""  # a partial line not passed on yet (it may be a repetition)

    def feed(self, text: str) -> str:
        if self.stopped:
            return ""
        out: list[str] = []
        buf = self._held + text
        self._held = ""
        while "\n" in buf and not self.stopped:
            rest, buf = buf.split("\n", 1)
            line = self._partial + rest
            if self._ends_here(line):
                self.stopped = True
                # The line was streamed in part already: what was sent stays, nothing more.
                return "".join(out)
            self._lines.append(line)
            out.append(rest + "\n")
            self._partial = ""
        if buf and not self.stopped and not self._partial and len(self._lines) >= self.max_lines:
            self.stopped = True  # a line past the last one allowed begins
            return "".join(out)
        if buf and not self.stopped:
            # A line that could still turn out to be a repetition of a recent one is held back.
            candidate = self._partial + buf
            recent = self._lines[-self.window :]
            if self.max_repeats and any(old.startswith(candidate) for old in recent if old.strip()):
                self._held = buf
            else:
                out.append(buf)
                self._partial = candidate
        return "".join(out)

    def finish(self) -> str:
        if self.stopped or not self._held:
            return ""
        line = self._partial + self._held
        self._held = ""
        return "" if self._ends_here(line) else line[len(self._partial) :]

    def _ends_here(self, line: str) -> bool:
        if len(self._lines) >= self.max_lines:
            return True
        if not line.strip() or not self.max_repeats:
            return False
        recent = self._lines[-self.window :]
        return sum(1 for old in recent if old == line) >= self.max_repeats


def normalized(text: str) -> str:
    """The text as compared for duplicates: trailing spaces and blank edges dropped."""
    return "\n".join(line.rstrip() for line in text.strip().splitlines())


def code_lines(text: str) -> list[str]:
    """The lines of `text` that are code: not blank, not only a comment."""
    return [
        line for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")
    ]


def degenerate_reason(text: str, previous: str | None) -> str | None:
    """Why a next-cell suggestion is not worth showing, or None when it is.

    Nothing but comments or blank lines (a small model continuing the prompt's `# Out:` lines),
    or the cell just run, again.
    """
    if not code_lines(text):
        return "only comments or blank lines"
    if previous is not None and normalized(text) == normalized(previous):
        return "the previous cell again"
    return None


def whole_statements(text: str) -> str:
    """A code answer that a limit cut off (tokens, time or lines), ended where its code is whole.

    Its last line is dropped unless the text ends with a newline (the limit may have come
    mid-expression), and then trailing lines until the rest parses as a cell: a statement
    whose closing bracket or block never came would be a SyntaxError on "Insert & Run". When
    no beginning with code parses (one unfinished statement, a cell magic, code that never
    parsed), cutting would not make it run: it is kept as it came.
    """
    complete = text.split("\n")[:-1]
    for end in range(len(complete), 0, -1):
        head = "\n".join(complete[:end]).rstrip()
        if not code_lines(head):
            break
        if parse_cell(head) is not None:
            return head
    return text.rstrip()


def closing_chunk(index: int, shown: str, final: str) -> NextCellChunk:
    """The chunk that closes suggestion `index`: the rest of `final` after what was `shown`,
    or `final` whole in place of it when it ends before the stream got to (a limit cut the
    answer and `whole_statements` ended it further back)."""
    if final.startswith(shown):
        return NextCellChunk(index=index, text=final[len(shown) :], done=True)
    return NextCellChunk(index=index, text=final, done=True, replace=True)


def hold_back(text: str, previous: str | None) -> bool:
    """Whether a suggestion streamed so far should be held back (it may still be degenerate).

    Held: while it has no code line yet, and while it is still the beginning of the previous
    cell (it may turn out to be that cell again).
    """
    if not code_lines(text):
        return True
    if previous is None:
        return False
    got, prev = normalized(text), normalized(previous)
    return bool(prev) and prev.startswith(got)


#: A chat answer's line: a bold heading (`**Created Question**:`), or a sentence about the code
#: ("This code snippet creates…", "To solve the problem, …"). On the corpus it matched 10 of
#: 2,480 real outputs (a print of "This function is …", sklearn warnings) and 10 of the 32
#: answers an output retry gave (`LocalModelPredictor.predict_output`).
_PROSE = re.compile(
    r"(?m)^(?:\*\*[A-Z][\w ]+\*\*:?|(?:This|The|In this|In the|Here|To|I'm|I am|It|Note|We|You"
    r"|Let's)\b[^\n]{0,200}?\b(?:code|function|snippet|output|program|example|solution|problem"
    r"|plot|dataset|data)\b)"
)


def chat_prose(text: str) -> bool:
    """Whether an output answer reads as an instruct model's chat about the code."""
    return _PROSE.search(text) is not None
