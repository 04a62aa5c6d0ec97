"""The engine core as a process of its own, beside the API server, as vLLM runs it.

vLLM's API server starts its EngineCore in a child process and watches it; when that process
dies (kill -9), the API server finds out at once ("Engine core proc EngineCore_DP0 died
unexpectedly, shutting down client."), /health turns 503 and the server exits with status 0
a few seconds later (measured: lab-notes.md, "The real vLLM on the CPU"). The stand-in's
engine runs inside the API server process; this child is only the thing whose death means
"the engine core is gone": kill it (its pid is logged at start, its name in /proc is
``EngineCore_DP0``) to get what a dead engine core does to the server.

Unlike the real one, this child ends when the API server does (a pipe closes), so a killed
API server leaves no orphan behind on the machine running the tests (the real engine core and
worker keep running as orphans; in a container the two end together anyway). It ignores
SIGTERM and SIGINT: a signal to the process group reaches the API server, which decides.
"""
from __future__ import annotations

import os
import signal
import threading

NAME = "EngineCore_DP0"


class EngineCore:
    """Fork the core; ``watch(on_dead)`` calls on_dead(message) once when it dies."""

    def __init__(self):
        up_r, up_w = os.pipe()      # the child holds up_w: EOF here when the child is gone
        down_r, down_w = os.pipe()  # this process holds down_w: EOF there when this one is gone
        pid = os.fork()             # before any thread of the server starts
        if pid == 0:                # the engine core
            try:
                os.close(up_r)
                os.close(down_w)
                signal.signal(signal.SIGINT, signal.SIG_IGN)
                signal.signal(signal.SIGTERM, signal.SIG_IGN)
                null = os.open(os.devnull, os.O_RDWR)
                for fd in (0, 1, 2):  # hold none of the server's output pipes
                    os.dup2(null, fd)
                try:
                    with open("/proc/self/comm", "w") as fh:
                        fh.write(NAME)
                except OSError:
                    pass
                while os.read(down_r, 1):
                    pass
            finally:
                os._exit(0)
        os.close(up_w)
        os.close(down_r)
        self.pid, self._up, self._down = pid, up_r, down_w

    def watch(self, on_dead) -> None:
        def wait():
            try:
                while os.read(self._up, 1):
                    pass
            except OSError:
                pass
            how = ""
            try:
                _, status = os.waitpid(self.pid, 0)
                if os.WIFSIGNALED(status):
                    how = f" (killed by signal {os.WTERMSIG(status)})"
                elif os.WIFEXITED(status):
                    how = f" (exit status {os.WEXITSTATUS(status)})"
            except ChildProcessError:
                pass
            on_dead(f"Engine core proc {NAME} died unexpectedly, shutting down client.{how}")
        threading.Thread(target=wait, daemon=True, name="engine-core-monitor").start()
