"""Text clean-up shared by the model backends: code fences and stop strings in streamed text."""

from __future__ import annotations

from collections.abc import Sequence


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
