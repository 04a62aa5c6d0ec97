"""Per-host progress: a live table (bytes, rate, ETA) on a terminal, plain periodic lines otherwise.

Bytes are measured, not estimated: a poller stats the files each host is receiving (staged and
published sizes) over a connection of its own, so the transfer's own connection stays busy with
the transfer. Polls are counted apart from the stage's remote calls (`progress_polls`).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, TextIO

from sparkprov.staging.plan import human


@dataclass
class HostProgress:
    total: int = 0
    done: int = 0
    start_done: int = 0
    phase: str = "waiting"
    samples: deque = field(default_factory=lambda: deque(maxlen=12))
    finished: bool = False

    def rate(self) -> float:
        if len(self.samples) < 2:
            return 0.0
        (t0, b0), (t1, b1) = self.samples[0], self.samples[-1]
        return (b1 - b0) / (t1 - t0) if t1 > t0 else 0.0

    def eta(self) -> str:
        r = self.rate()
        left = self.total - self.done
        if self.finished or left <= 0:
            return "-"
        if r <= 0:
            return "?"
        s = int(left / r)
        return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


class Progress:
    def __init__(self, stream: TextIO, *, live: bool, interval: float = 5.0):
        self.stream = stream
        self.live = live
        self.interval = interval
        self.hosts: dict[str, HostProgress] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._live = None
        self.polls = 0

    # -- updates -------------------------------------------------------------------
    def set_total(self, host: str, total: int, done: int = 0) -> None:
        with self._lock:
            hp = self.hosts.setdefault(host, HostProgress())
            hp.total, hp.done, hp.start_done = total, done, done
            hp.samples.clear()
            hp.samples.append((time.monotonic(), done))

    def phase(self, host: str, phase: str, *, finished: bool = False) -> None:
        with self._lock:
            hp = self.hosts.setdefault(host, HostProgress())
            hp.phase, hp.finished = phase, finished
            if finished:
                hp.done = hp.total

    def bytes(self, host: str, done: int) -> None:
        with self._lock:
            hp = self.hosts.setdefault(host, HostProgress())
            hp.done = min(max(done, 0), hp.total) if hp.total else done
            hp.samples.append((time.monotonic(), hp.done))

    # -- display ------------------------------------------------------------------
    def _row(self, name: str, hp: HostProgress) -> tuple[str, ...]:
        pct = f"{100 * hp.done / hp.total:5.1f}%" if hp.total else "  -  "
        return (name, hp.phase, f"{human(hp.done)} / {human(hp.total)}", pct, f"{human(hp.rate())}/s", hp.eta())

    def _table(self):
        from rich.table import Table

        t = Table(box=None, pad_edge=False)
        for col in ("host", "phase", "bytes", "", "rate", "eta"):
            t.add_column(col)
        with self._lock:
            for name, hp in self.hosts.items():
                t.add_row(*self._row(name, hp))
        return t

    def _lines(self) -> None:
        with self._lock:
            rows = [self._row(n, hp) for n, hp in self.hosts.items() if not hp.finished and hp.total]
        width = max([8] + [len(r[0]) for r in rows])
        for r in rows:
            self.stream.write(f"{r[0]:<{width}} | {r[1]}: {r[2]} ({r[3].strip()}) at {r[4]}, eta {r[5]}\n")
        self.stream.flush()

    def start(self, poll: Callable[[], None] | None = None, poll_every: float = 1.0) -> None:
        if self.live:
            from rich.console import Console
            from rich.live import Live

            self._live = Live(self._table(), console=Console(file=self.stream), refresh_per_second=4,
                              transient=False)
            self._live.start()

        def loop() -> None:
            last_line = time.monotonic()
            while not self._stop.wait(poll_every):
                if poll is not None:
                    try:
                        poll()
                        self.polls += 1
                    except Exception:  # a failed poll only costs one update
                        pass
                if self._live is not None:
                    self._live.update(self._table())
                elif time.monotonic() - last_line >= self.interval:
                    last_line = time.monotonic()
                    self._lines()

        self._thread = threading.Thread(target=loop, name="stage-progress", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        if self._live is not None:
            self._live.update(self._table())
            self._live.stop()
