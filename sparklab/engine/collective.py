"""A real ring all-reduce over TCP between the tensor-parallel ranks (Gloo's role in vLLM).

Each rank binds a listener on the IPv4 address of the interface named by GLOO_SOCKET_IFNAME
(falling back to VLLM_HOST_IP / the node IP), connects to its successor, accepts its
predecessor, then reduces a small integer vector (checked exactly) and times a bulk ring
transfer to report bandwidth.
"""
from __future__ import annotations

import array
import fcntl
import os
import socket
import struct
import threading
import time

_MAGIC = b"LABGLOO1"


class GlooError(RuntimeError):
    pass


def interface_ipv4(ifname: str) -> str:
    """IPv4 address of ifname (SIOCGIFADDR), or a Gloo-like error."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        req = struct.pack("256s", ifname.encode()[:15])
        res = fcntl.ioctl(s.fileno(), 0x8915, req)  # SIOCGIFADDR
        return socket.inet_ntoa(res[20:24])
    except OSError as e:
        what = "no such device" if e.errno == 19 else "interface has no IPv4 address" if e.errno == 99 else e.strerror
        raise GlooError(
            "[enforce fail at /pytorch/third_party/gloo/gloo/transport/tcp/device.cc:84] ifa != nullptr. "
            f"Unable to find address for: {ifname} ({what})")
    finally:
        s.close()


def bind_address(fallback_ip: str | None) -> tuple[str, str]:
    """(address, how) for this rank's listener."""
    ifname = os.environ.get("GLOO_SOCKET_IFNAME")
    if ifname:
        ifname = ifname.split(",")[0].strip()
        return interface_ipv4(ifname), f"GLOO_SOCKET_IFNAME={ifname}"
    ip = os.environ.get("VLLM_HOST_IP") or fallback_ip
    if not ip:
        ip = socket.gethostbyname(socket.gethostname())
    return ip, "VLLM_HOST_IP/node IP (GLOO_SOCKET_IFNAME unset)"


class RingMember:
    def __init__(self, rank: int, world_size: int, fallback_ip: str | None = None):
        self.rank, self.world = rank, world_size
        self.addr, self.how = bind_address(fallback_ip)
        self.listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.listener.bind((self.addr, 0))
        except OSError as e:
            raise GlooError(f"[gloo/transport/tcp/device.cc] bind to {self.addr}: {e.strerror}")
        self.listener.listen(4)
        self.port = self.listener.getsockname()[1]

    def endpoint(self) -> tuple[str, int]:
        return self.addr, self.port

    def run(self, peers: list, token: str, timeout: float = 30.0, bulk_bytes: int = 16 << 20,
            keep: bool = False) -> dict:
        """Connect the ring, all-reduce, measure bandwidth. peers[i] = (ip, port) of rank i.

        keep: the ring stays connected afterwards (the process group lives as long as the
        engine): see watch()."""
        nxt = peers[(self.rank + 1) % self.world]
        send_sock = None
        result: dict = {}
        accepted: dict = {}

        def accept():
            self.listener.settimeout(timeout)
            try:
                conn, _ = self.listener.accept()
                conn.settimeout(timeout)
                hello = _recv_exact(conn, len(_MAGIC) + 4 + len(token.encode()))
                if hello != _MAGIC + struct.pack("<I", (self.rank - 1) % self.world) + token.encode():
                    raise GlooError("unexpected peer on the ring (handshake mismatch)")
                accepted["conn"] = conn
            except Exception as e:  # noqa: BLE001
                accepted["error"] = e

        t = threading.Thread(target=accept, daemon=True)
        t.start()
        deadline = time.time() + timeout
        last = None
        while time.time() < deadline:
            try:
                send_sock = socket.create_connection(tuple(nxt), timeout=min(5.0, timeout))
                send_sock.settimeout(timeout)
                send_sock.sendall(_MAGIC + struct.pack("<I", self.rank) + token.encode())
                break
            except OSError as e:
                last = e
                send_sock = None
                time.sleep(0.2)
        if send_sock is None:
            raise GlooError(f"Gloo connectFullMesh failed with [gloo/transport/tcp/pair.cc:144] "
                            f"connect to rank {(self.rank + 1) % self.world} at {nxt[0]}:{nxt[1]} "
                            f"from {self.addr}: {last}")
        t.join(timeout + 1)
        if "error" in accepted or "conn" not in accepted:
            err = accepted.get("error", "timed out")
            raise GlooError(f"Gloo connectFullMesh failed with [gloo/transport/tcp/pair.cc:144] "
                            f"accept from rank {(self.rank - 1) % self.world} on {self.addr}:{self.port}: {err}")
        recv_sock = accepted["conn"]
        try:
            # Ring all-reduce of a small vector: rank r contributes (r + 1) * (i + 1).
            n = 1024 * self.world
            vec = array.array("q", [(self.rank + 1) * (i + 1) for i in range(n)])
            chunk = n // self.world
            def seg(k):
                k %= self.world
                return slice(k * chunk, (k + 1) * chunk)
            for step in range(self.world - 1):  # reduce-scatter
                s = seg(self.rank - step)
                r = seg(self.rank - step - 1)
                out = vec[s].tobytes()
                incoming = array.array("q")
                incoming.frombytes(_exchange(send_sock, recv_sock, out, len(out)))
                part = vec[r]
                vec[r] = array.array("q", (a + b for a, b in zip(part, incoming)))
            for step in range(self.world - 1):  # all-gather
                s = seg(self.rank + 1 - step)
                r = seg(self.rank - step)
                out = vec[s].tobytes()
                incoming = array.array("q")
                incoming.frombytes(_exchange(send_sock, recv_sock, out, len(out)))
                vec[r] = incoming
            factor = self.world * (self.world + 1) // 2
            ok = all(vec[i] == factor * (i + 1) for i in range(n))
            if not ok:
                raise GlooError("all-reduce produced a wrong sum")
            # Bulk ring transfer for bandwidth.
            payload = os.urandom(1 << 16) * max(1, bulk_bytes >> 16)
            t0 = time.perf_counter()
            _exchange(send_sock, recv_sock, payload, len(payload))
            dt = max(time.perf_counter() - t0, 1e-9)
            result = {"rank": self.rank, "addr": self.addr, "how": self.how, "ok": True,
                      "bytes": len(payload), "seconds": dt, "gbps": len(payload) * 8 / dt / 1e9}
        except BaseException:
            keep = False
            raise
        finally:
            if keep:
                self.send_sock, self.recv_sock = send_sock, recv_sock
            else:
                send_sock.close()
                recv_sock.close()
            self.listener.close()
        return result

    def watch(self, on_lost, interval: float = 1.0, timeout: float = 30.0) -> None:
        """Keep the group alive: a heartbeat to the successor every `interval` seconds, one
        expected from the predecessor within `timeout`. A torch.distributed group does not
        re-admit a lost rank: the first failure (peer closed, reset, silent for `timeout`) calls
        on_lost(message) once, with a Gloo-style message; the ring is then closed, so the
        failure travels round the ring to every other rank."""
        send_sock, recv_sock = self.send_sock, self.recv_sock
        nxt, prv = (self.rank + 1) % self.world, (self.rank - 1) % self.world
        fired = threading.Event()

        def lost(msg):
            if fired.is_set():
                return
            fired.set()
            for s in (send_sock, recv_sock):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()
            on_lost(msg)

        def sender():
            while not fired.is_set():
                try:
                    send_sock.sendall(b"\x01")
                except OSError as e:
                    return lost(f"[gloo/transport/tcp/pair.cc:598] Connection closed by peer (send to "
                                f"rank {nxt}): {e.strerror or e}")
                fired.wait(interval)

        def receiver():
            recv_sock.settimeout(timeout)
            while not fired.is_set():
                try:
                    data = recv_sock.recv(4096)
                except socket.timeout:
                    return lost(f"[gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting {timeout:g}s "
                                f"for data from rank {prv}")
                except OSError as e:
                    return lost(f"[gloo/transport/tcp/pair.cc:534] Read error from rank {prv}: "
                                f"{e.strerror or e}")
                if not data:
                    return lost(f"[gloo/transport/tcp/pair.cc:534] Connection closed by peer (rank {prv})")

        for fn in (sender, receiver):
            threading.Thread(target=fn, daemon=True, name=f"gloo-watch-{self.rank}-{fn.__name__}").start()


def _recv_exact(sock, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(min(1 << 20, n - len(buf)))
        if not chunk:
            raise GlooError("Connection closed by peer [gloo/transport/tcp/pair.cc:598]")
        buf += chunk
    return bytes(buf)


def _exchange(send_sock, recv_sock, out: bytes, n_in: int) -> bytes:
    """Send to the successor while receiving from the predecessor (same size both ways)."""
    err: list = []

    def sender():
        try:
            send_sock.sendall(out)
        except OSError as e:
            err.append(e)

    t = threading.Thread(target=sender, daemon=True)
    t.start()
    data = _recv_exact(recv_sock, n_in)
    t.join()
    if err:
        raise GlooError(f"Connection reset by peer [gloo/transport/tcp/pair.cc]: {err[0]}")
    return data
