"""The suite's progress on stderr: one line rewritten in place on a terminal, else a line every 10 s."""

from __future__ import annotations

import shutil
import sys
import time
from typing import Callable, TextIO


class StderrProgress:
    """`progress(text)` shows where a long stream is; `progress("")` clears it before a table row is printed.

    On a terminal the text replaces the last one on the same line; in a log (not a terminal) a line is written
    at most every `every_s` seconds, so a long run still shows it is alive without flooding the log.
    """

    def __init__(self, stream: TextIO | None = None, *, every_s: float = 10.0, clock: Callable[[], float] = time.monotonic):
        self.stream = stream or sys.stderr
        self.every_s = every_s
        self.clock = clock
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._shown = False
        self._last = clock()

    def __call__(self, text: str) -> None:
        if self.tty:
            if text or self._shown:
                width = shutil.get_terminal_size().columns - 1
                self.stream.write("\r\033[K" + text[:width])
                self.stream.flush()
            self._shown = bool(text)
        elif text and self.clock() - self._last >= self.every_s:
            self._last = self.clock()
            self.stream.write(text + "\n")
            self.stream.flush()
