"""SSH transport: Fabric resolves the connection (~/.ssh/config, ProxyJump, keys); we run the
script on a raw paramiko channel, because it is the one place every byte of a run passes and
Invoke's runner feeds stdin in 10 ms slices.

Host keys are checked strictly: Fabric's default (trust any key) is replaced on the connection
and on every gateway hop. Unknown keys are refused unless the caller asked to accept new ones;
a changed key is always refused.
"""

from __future__ import annotations

import base64
import fcntl
import logging
import hashlib
import os
import select
import socket
import time
from pathlib import Path

import paramiko

from sparkprov.errors import HostKeyError, InputError, SparkprovError
from sparkprov.inputfiles import MAX_KEY, MAX_KNOWN_HOSTS, check_regular_file
from sparkprov.transport.base import ExecResult, Transport, Unreachable
from sparkprov.transport.shell import quote


# paramiko's transport thread logs connection failures with tracebacks; we report them ourselves
# as one line per host, so its log stays silent unless a caller configures logging.
logging.getLogger("paramiko").addHandler(logging.NullHandler())
logging.getLogger("paramiko").propagate = False


EOF_GRACE = 2.0  # seconds the output may still arrive after the exit status


def fingerprint(key: paramiko.PKey) -> str:
    digest = hashlib.sha256(key.asbytes()).digest()
    return "SHA256:" + base64.b64encode(digest).decode().rstrip("=")


def known_host_name(hostname: str, port: int) -> str:
    return hostname if port == 22 else f"[{hostname}]:{port}"


class _StrictPolicy(paramiko.MissingHostKeyPolicy):
    """Refuse unknown keys, naming the host, the key and the fix."""

    def __init__(self, host_label: str, known_hosts: Path):
        self.host_label = host_label
        self.known_hosts = known_hosts

    def missing_host_key(self, client, hostname, key):
        raise HostKeyError(
            f"{self.host_label}: host key for {hostname} is not in {self.known_hosts} "
            f"({key.get_name()} {fingerprint(key)})",
            fix="check the fingerprint on the host (ssh-keygen -lf /etc/ssh/ssh_host_ed25519_key.pub) "
                "then add it, or rerun with --accept-new-host-keys")


class _AcceptNewPolicy(_StrictPolicy):
    """Record keys of hosts never seen before (OpenSSH's accept-new). A changed key never gets
    here: paramiko raises BadHostKeyException for a mismatch before consulting the policy."""

    def missing_host_key(self, client, hostname, key):
        client.get_host_keys().add(hostname, key.get_name(), key)
        self.known_hosts.parent.mkdir(parents=True, exist_ok=True)
        line = f"{hostname} {key.get_name()} {key.get_base64()}\n"
        with open(self.known_hosts, "a", encoding="ascii") as fh:
            fcntl.flock(fh, fcntl.LOCK_EX)  # hosts connect in parallel
            fh.write(line)
        os.chmod(self.known_hosts, 0o600)


def _known_hosts_for(explicit: str | None, ssh_config: dict) -> Path:
    if explicit:
        return Path(os.path.expanduser(explicit))
    from_config = ssh_config.get("userknownhostsfile")
    if from_config:
        first = from_config.split()[0] if isinstance(from_config, str) else from_config[0]
        return Path(os.path.expanduser(first))
    return Path(os.path.expanduser("~/.ssh/known_hosts"))


class SSHTransport(Transport):
    def __init__(self, name: str, address: str, *, user: str | None = None, port: int | None = None,
                 key_file: str | None = None, known_hosts: str | None = None,
                 accept_new_host_keys: bool = False, connect_timeout: float = 10.0):
        super().__init__(name)
        self.address = address
        self.user = user
        self.port = port
        self.key_file = key_file
        self.known_hosts_opt = known_hosts
        self.accept_new = accept_new_host_keys
        self.connect_timeout = connect_timeout
        self.conn = None

    # -- connecting -----------------------------------------------------------
    def _check_file(self, path, what: str, max_bytes: int) -> None:
        """A regular file of sane size, or one line naming this host and the file."""
        try:
            check_regular_file(path, what, max_bytes)
        except InputError as exc:
            raise (HostKeyError if what == "known_hosts" else SparkprovError)(f"{self.name}: {exc.line()}") from None

    def _harden(self, conn) -> None:
        """Replace Fabric's trust-anything policy on this hop and every gateway hop."""
        known = _known_hosts_for(self.known_hosts_opt, conn.ssh_config)
        client: paramiko.SSHClient = conn.client
        for system_file in ("/etc/ssh/ssh_known_hosts",):
            if os.path.exists(system_file):
                self._check_file(system_file, "known_hosts", MAX_KNOWN_HOSTS)
                client.load_system_host_keys(system_file)
        if known.exists():
            # paramiko reads it line by line to the end: a FIFO blocks, /dev/zero never ends
            self._check_file(known, "known_hosts", MAX_KNOWN_HOSTS)
            try:
                client.load_host_keys(str(known))
            except (OSError, paramiko.SSHException) as exc:
                raise HostKeyError(f"{self.name}: cannot read {known}: {exc}",
                                   fix="repair or remove the bad line") from None
        policy = (_AcceptNewPolicy if self.accept_new else _StrictPolicy)(self.name, known)
        client.set_missing_host_key_policy(policy)
        gateway = getattr(conn, "gateway", None)
        if gateway is not None and hasattr(gateway, "client"):
            self._harden(gateway)

    def connect(self) -> None:
        from fabric import Config, Connection

        kwargs: dict = {}
        if self.key_file:
            key = os.path.expanduser(self.key_file)
            if os.path.lexists(key):  # a missing key is paramiko's to report, as before
                self._check_file(key, "ssh_key", MAX_KEY)
            kwargs["key_filename"] = [key]
        conn = Connection(self.address, user=self.user, port=self.port, config=Config(),
                          connect_timeout=int(self.connect_timeout), connect_kwargs=kwargs)
        self._harden(conn)
        try:
            conn.open()
        except HostKeyError:
            raise
        except paramiko.BadHostKeyException as exc:
            raise HostKeyError(
                f"{self.name}: host key for {exc.hostname} CHANGED: got {fingerprint(exc.key)}, "
                f"known_hosts has {fingerprint(exc.expected_key)}; refusing (possible man-in-the-middle)",
                fix=f"if the host was reinstalled, verify the new key and run: ssh-keygen -R "
                    f"{known_host_name(exc.hostname, conn.port)} -f "
                    f"{_known_hosts_for(self.known_hosts_opt, conn.ssh_config)}") from None
        except paramiko.AuthenticationException as exc:
            raise Unreachable(f"{self.name}: SSH authentication failed for {conn.user}@{conn.host}: {exc}",
                              fix="check user and ssh_key in the inventory") from None
        except (OSError, socket.timeout, paramiko.SSHException, EOFError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc) or type(exc).__name__
            raise Unreachable(f"{self.name}: cannot connect to {conn.host}:{conn.port}: {reason}",
                              fix="check that the host is up and sshd is running") from None
        conn.transport.set_keepalive(15)
        self.conn = conn

    def close(self) -> None:
        if self.conn is not None:
            try:
                self.conn.close()
            finally:
                self.conn = None

    # -- running --------------------------------------------------------------
    def _put(self, local: str, remote: str) -> None:
        if self.conn is None:
            raise Unreachable(f"{self.name}: not connected")
        folder = remote.rsplit("/", 1)[0] if "/" in remote else ""
        if folder:
            self._exec("mkdir -p " + quote(folder), b"", 60)
        try:
            self.conn.put(local, remote=remote)  # SFTP on the same connection, relative to home
        except (OSError, paramiko.SSHException) as exc:
            raise Unreachable(f"{self.name}: upload of {remote} failed: {exc}") from None

    def _exec(self, command: str, stdin: bytes, timeout: float | None) -> ExecResult:
        if self.conn is None:
            self.connect()
        transport = self.conn.transport
        if transport is None or not transport.is_active():
            raise Unreachable(f"{self.name}: connection lost", fix="check the host and rerun")
        try:
            chan = transport.open_session(timeout=self.connect_timeout)
            chan.exec_command(command)
            chan.sendall(stdin)
            chan.shutdown_write()
            out, err = bytearray(), bytearray()
            deadline = time.monotonic() + timeout if timeout else None
            status_at = 0.0
            while True:
                busy = False
                while chan.recv_ready():
                    out += chan.recv(65536)
                    busy = True
                while chan.recv_stderr_ready():
                    err += chan.recv_stderr(65536)
                    busy = True
                # Done at the exit status AND the end of the data: sshd may send the exit status
                # while output is still in flight (a loaded host), so the status alone ended reads
                # early (seen as a re-read whose last fact sections were missing). A process the
                # script left behind may hold the output open for good: the end of the data is
                # awaited EOF_GRACE seconds after the status, not longer.
                if chan.exit_status_ready() and not chan.recv_ready() and not chan.recv_stderr_ready():
                    if chan.eof_received or chan.closed:
                        break
                    status_at = status_at or time.monotonic()
                    if time.monotonic() - status_at > EOF_GRACE:
                        break
                if chan.closed and not chan.exit_status_ready():
                    raise Unreachable(f"{self.name}: connection lost while running", fix="check the host and rerun")
                if deadline and time.monotonic() > deadline:
                    chan.close()
                    return ExecResult(124, out.decode(errors="replace"), err.decode(errors="replace") + "\ntimed out")
                if not busy:
                    select.select([chan], [], [], 0.05)
            rc = chan.recv_exit_status()
            chan.close()
        except (OSError, EOFError, paramiko.SSHException) as exc:
            raise Unreachable(f"{self.name}: connection lost: {exc or type(exc).__name__}",
                              fix="check the host and rerun") from None
        if rc == -1:
            raise Unreachable(f"{self.name}: connection lost (no exit status)", fix="check the host and rerun")
        return ExecResult(rc, out.decode(errors="replace"), err.decode(errors="replace"))
