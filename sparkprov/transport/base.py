"""The one primitive every layer above uses: run a POSIX sh script on a host.

The script goes to `sh -s` on stdin. With become, `sudo` runs the shell, and the sudo password
(when one is needed) is the first line of that same stdin: never argv, never a log line.
"""

from __future__ import annotations

import secrets
import threading
from dataclasses import dataclass
from enum import Enum

from sparkprov.errors import SparkprovError
from sparkprov.transport.shell import quote


@dataclass
class ExecResult:
    rc: int
    stdout: str
    stderr: str

    @property
    def ok(self) -> bool:
        return self.rc == 0


class Unreachable(SparkprovError):
    """The host could not be reached (connect, auth, host key, or the link dropped)."""


class BecomeMethod(Enum):
    NONE = "none"          # already root
    PASSWORDLESS = "nopasswd"
    PASSWORD = "password"


class Transport:
    """Base class: counts remote executions and picks how to become root."""

    def __init__(self, name: str):
        self.name = name
        self.remote_calls = 0
        self.become_method: BecomeMethod | None = None
        self.become_password: str | None = None
        self._lock = threading.Lock()

    # -- to implement -------------------------------------------------------
    def _exec(self, command: str, stdin: bytes, timeout: float | None) -> ExecResult:
        raise NotImplementedError

    def connect(self) -> None:
        """Open the connection (may raise Unreachable)."""

    def close(self) -> None:
        """Release the connection."""

    def _put(self, local: str, remote: str) -> None:
        raise NotImplementedError

    # -- the primitives -----------------------------------------------------
    def put(self, local: str, remote: str) -> None:
        """Copy a control-machine file to `remote` (a path relative to the login user's home):
        for payloads too large for a script (a build context of wheels). Counted as a call."""
        if remote.startswith("/") or ".." in remote.split("/"):
            raise SparkprovError(f"{self.name}: upload target {remote!r} must be relative to the home directory")
        with self._lock:
            self.remote_calls += 1
        self._put(local, remote)

    # -- the primitive ------------------------------------------------------
    def run_script(self, script: str, *, become: bool = False, timeout: float | None = None) -> ExecResult:
        with self._lock:
            self.remote_calls += 1
        if not become or self.become_method in (None, BecomeMethod.NONE):
            if become and self.become_method is None:
                raise SparkprovError(f"{self.name}: become requested before sudo was probed")
            return self._exec("sh -s", script.encode(), timeout)
        if self.become_method is BecomeMethod.PASSWORDLESS:
            return self._exec("sudo -n -H sh -s", script.encode(), timeout)
        # sudo can read past the password line of a stdin it shares with the script (seen as a
        # script whose first lines never ran), so sudo gets a stdin of its own holding only the
        # password (printf is a builtin: no argv), and the script waits in a 0600 temp file of
        # the login user. -k: never reuse cached credentials, so sudo always reads the password.
        tag = "SPARKPROV_" + secrets.token_hex(8)
        wrapper = (f"t=$(mktemp) || exit 1\ncat > \"$t\" <<'{tag}'\n{script}\n{tag}\n"
                   f"printf '%s\\n' {quote(self.become_password or '')} | sudo -k -S -p '' -H sh \"$t\"\n"
                   "rc=$?; rm -f \"$t\"; exit $rc\n")
        return self._exec("sh -s", wrapper.encode(), timeout)
