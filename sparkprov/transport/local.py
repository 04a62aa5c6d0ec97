"""Local transport: the control machine is the host (most owners run sparkprov on their Spark)."""

from __future__ import annotations

import os
import shutil
import subprocess

from sparkprov.transport.base import ExecResult, Transport


class LocalTransport(Transport):
    def _exec(self, command: str, stdin: bytes, timeout: float | None) -> ExecResult:
        try:
            proc = subprocess.run(["/bin/sh", "-c", command], input=stdin, capture_output=True,
                                  timeout=timeout, check=False)
        except subprocess.TimeoutExpired as exc:
            return ExecResult(124, (exc.stdout or b"").decode(errors="replace"), "timed out")
        return ExecResult(proc.returncode, proc.stdout.decode(errors="replace"),
                          proc.stderr.decode(errors="replace"))

    def _put(self, local: str, remote: str) -> None:
        dest = os.path.join(os.path.expanduser("~"), remote)
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        shutil.copyfile(local, dest)
