"""Long waits with visible progress: a rich status line on a terminal, plain lines otherwise.

`wait_for(label, poll, timeout)` calls `poll()` until it says done or failed; no fixed sleeps: the
pause between polls grows from 0.5 s to `max_interval` and is cut short by nothing but the poll.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Callable, TextIO


@dataclass
class Poll:
    done: bool = False
    failed: str | None = None
    status: str = ""


class WaitTimeout(Exception):
    def __init__(self, label: str, seconds: float, last: str):
        super().__init__(f"{label}: not ready after {seconds:.0f}s ({last or 'no status'})")
        self.last = last


class Progress:
    def __init__(self, stream: TextIO | None = None, *, live: bool | None = None, interval: float = 10.0,
                 quiet: bool = False):
        self.stream = stream or sys.stdout
        self.live = self.stream.isatty() if live is None else live
        self.interval = interval  # seconds between plain lines
        self.quiet = quiet

    def line(self, text: str) -> None:
        if not self.quiet:
            print(text, file=self.stream, flush=True)

    def wait_for(self, label: str, poll: Callable[[], Poll], timeout: float, *, max_interval: float = 5.0) -> float:
        """Seconds it took; raises WaitTimeout, or RuntimeError with the poll's failure."""
        t0 = time.monotonic()
        pause = 0.5
        last_line = t0
        status_ctx = None
        if self.live and not self.quiet:
            from rich.console import Console

            status_ctx = Console(file=self.stream).status(f"{label} ...")
            status_ctx.start()
        last = ""
        try:
            while True:
                p = poll()
                waited = time.monotonic() - t0
                last = p.status or last
                if p.failed:
                    raise RuntimeError(p.failed)
                if p.done:
                    self.line(f"{label}: ready after {waited:.0f}s" + (f" ({p.status})" if p.status else ""))
                    return waited
                if waited >= timeout:
                    raise WaitTimeout(label, waited, last)
                if status_ctx is not None:
                    status_ctx.update(f"{label}: {waited:.0f}s / {timeout:.0f}s  {p.status}")
                elif time.monotonic() - last_line >= self.interval or waited < 0.01:
                    self.line(f"{label}: waiting {waited:.0f}s of {timeout:.0f}s: {p.status}")
                    last_line = time.monotonic()
                time.sleep(min(pause, max(0.0, timeout - waited)))
                pause = min(max_interval, pause * 1.5)
        finally:
            if status_ctx is not None:
                status_ctx.stop()
