"""`%themisto status|on|off`: inspect, pause or resume recording in this kernel."""

from __future__ import annotations

from typing import Any

from IPython.core.magic import Magics, line_magic, magics_class


@magics_class
class ThemistoMagics(Magics):
    def __init__(self, shell: Any, recorder: Any) -> None:
        super().__init__(shell)
        self.recorder = recorder

    @line_magic
    def themisto(self, line: str) -> None:
        """%themisto status | on | off — show the recorder's state, resume or pause recording."""
        arg = line.strip().lower() or "status"
        if arg == "on":
            self.recorder.enabled = True
        elif arg == "off":
            self.recorder.enabled = False
        elif arg != "status":
            print(f"usage: %themisto status|on|off (got {line.strip()!r})")
            return
        for key, value in self.recorder.status().items():
            print(f"{key}: {value}")
