"""vLLM's native multi-node (no Ray): `vllm serve MODEL -tp T [-pp P] --nnodes N --node-rank R
--master-addr A --master-port P [--headless]`.

Every node runs one `vllm serve`; node rank 0 serves the OpenAI API, the others `--headless`
(no API server). The tp x pp ranks are spread evenly over the nodes (ranks R*k .. R*k+k-1 on
node R, k = tp*pp/N) and form one group, as torch.distributed does:

* rendezvous (torch's TCPStore): node rank 0 listens on --master-port (every interface, as
  TCPStore does) and waits for the other N-1 nodes; the others connect to --master-addr,
  retrying, until LAB_ENGINE_DIST_TIMEOUT seconds (600, torch's default) have passed;
* every node validates its own weights, binds its ranks' Gloo listeners on GLOO_SOCKET_IFNAME
  (else VLLM_HOST_IP, else the node IP) and the ranks run the ring all-reduce of collective.py
  over those addresses (the fabric, when the bindings are right);
* the group then stays connected for the engine's life (heartbeats on the ring, plus each
  node's rendezvous connection). A torch.distributed group does not re-admit a lost rank; a node
  that finds a master whose group is already formed keeps retrying until that master goes away.

When a member goes away, the survivors behave as the real vLLM was measured to (lab-notes.md,
"The real vLLM on the CPU"; engine._group_lost): node rank 0 notices nothing (/health 200) until
its next generation request fails with 500 (or 45 s pass), then exits 0; a headless node does
not exit at all, it stays stranded in the old group. A new node rank 0 then waits in its
rendezvous for a node that will never come (the stranded one does not rejoin): it hangs in
start-up, never healthy, and ignores SIGTERM while it waits (the real one was seen deaf to
SIGTERM there for over 90 s; the stand-in gives up after LAB_ENGINE_DIST_TIMEOUT, 600 s, as
torch's store does). All nodes must be started again for a group to form.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
import uuid

from . import collective
from .distributed import _collective_params, _report, _worker_check, get_ip, local_gpu_count
from .model import EngineError


def dist_timeout() -> float:
    return float(os.environ.get("LAB_ENGINE_DIST_TIMEOUT", "600"))


def group_timeout() -> float:
    return float(os.environ.get("LAB_ENGINE_GROUP_TIMEOUT", "30"))


def _send(sock, obj) -> None:
    sock.sendall((json.dumps(obj) + "\n").encode())


class _Lines:
    def __init__(self, sock):
        self.sock, self.buf = sock, b""

    def read(self, timeout: float | None):
        self.sock.settimeout(timeout)
        while b"\n" not in self.buf:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise ConnectionError("connection closed by peer")
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return json.loads(line)


class NativeGroup:
    """This node's part of a native multi-node group."""

    def __init__(self, args, spec: dict, logger, on_lost):
        self.args, self.spec, self.logger, self.on_lost = args, spec, logger, on_lost
        self.nnodes, self.node_rank = args.nnodes, args.node_rank
        self.world = args.tensor_parallel_size * args.pipeline_parallel_size
        self.conns: list = []
        self.members: list = []
        self._lost = threading.Event()

    # ------------------------------------------------------------------ checks
    def validate(self) -> list[int]:
        a = self.args
        if self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            raise EngineError("ValueError", f"node_rank ({self.node_rank}) must be in [0, nnodes) "
                              f"(nnodes={self.nnodes}).")
        if self.world % self.nnodes:
            raise EngineError("ValueError", f"world_size ({self.world} = tensor_parallel_size "
                              f"{a.tensor_parallel_size} x pipeline_parallel_size {a.pipeline_parallel_size}) "
                              f"must be divisible by nnodes ({self.nnodes}).")
        per = self.world // self.nnodes
        gpus = local_gpu_count()
        if per > gpus:
            raise EngineError("ValueError", f"World size ({self.world}) over {self.nnodes} nodes needs {per} "
                              f"GPU(s) per node, but this node has {gpus}.")
        if a.distributed_executor_backend == "ray":
            raise EngineError("ValueError", "--nnodes > 1 runs vLLM's multiprocessing executor across nodes; "
                              "it cannot be combined with --distributed-executor-backend ray.")
        return list(range(self.node_rank * per, (self.node_rank + 1) * per))

    # ------------------------------------------------------------------ lifecycle
    def _lost_once(self, msg: str) -> None:
        if self._lost.is_set():
            return
        self._lost.set()
        self.on_lost(msg)

    def start(self) -> dict:
        ranks = self.validate()
        a = self.args
        self.logger.info("Multi-node (mp executor): node rank %d of %d, ranks %s of world size %d, "
                         "master %s:%d%s", self.node_rank, self.nnodes, ranks, self.world, a.master_addr,
                         a.master_port, ", headless" if a.headless else "")
        check = _worker_check(self.spec)
        self.logger.info("node %d: weights complete on %s (%d files, %.2f GiB in %s)", self.node_rank,
                         check["host"], check["files"], check["bytes"] / (1 << 30), check["hf_cache"])
        fallback = get_ip()
        try:
            self.members = [collective.RingMember(r, self.world, fallback) for r in ranks]
        except collective.GlooError as e:
            raise EngineError("RuntimeError", str(e))
        hello = {"op": "join", "node_rank": self.node_rank, "nnodes": self.nnodes, "world": self.world,
                 "tp": a.tensor_parallel_size, "pp": a.pipeline_parallel_size, "model": a.model,
                 "host": check["host"], "ranks": [[m.rank, m.addr, m.port] for m in self.members]}
        if self.node_rank == 0:
            return self._master(hello)
        return self._node(hello)

    def _run_members(self, peers, token, ctimeout, bulk) -> list[dict]:
        results, errors = [None] * len(self.members), []

        def one(i, m):
            try:
                results[i] = m.run(peers, token, ctimeout, bulk, keep=True)
            except Exception as e:  # noqa: BLE001
                errors.append(f"{type(e).__name__}: {e}")
        threads = [threading.Thread(target=one, args=(i, m), daemon=True) for i, m in enumerate(self.members)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise EngineError("RuntimeError", errors[0])
        return results

    def _watch(self) -> None:
        hb = float(os.environ.get("LAB_ENGINE_HEARTBEAT_SECONDS", "1"))
        for m in self.members:
            m.watch(lambda msg, r=m.rank: self._lost_once(f"RuntimeError: rank {r}: {msg}"),
                    interval=hb, timeout=group_timeout())

        def conn_watch(sock, who):
            sock.settimeout(None)
            try:
                while sock.recv(4096):
                    pass
                why = "connection closed"
            except OSError as e:
                why = e.strerror or str(e)
            self._lost_once(f"DistNetworkError: the rendezvous connection to {who} was lost ({why}); "
                            "a process group does not re-admit a lost rank")
        for sock, who in self.conns:
            threading.Thread(target=conn_watch, args=(sock, who), daemon=True).start()

    # ------------------------------------------------------------------ node rank 0
    def _master(self, hello: dict) -> dict:
        a, timeout = self.args, dist_timeout()
        srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            srv.bind(("0.0.0.0", a.master_port))
        except OSError as e:
            raise EngineError("DistNetworkError", f"The server socket has failed to listen on any local "
                              f"network address. port: {a.master_port}, useIpv6: 0, code: -{e.errno}, "
                              f"name: EADDRINUSE, message: {e.strerror}")
        srv.listen(64)
        joined = {0: (hello, None)}
        t0 = time.time()
        last_note = t0
        self.logger.info("Waiting for %d other node(s) to join on port %d (--master-addr %s)",
                         self.nnodes - 1, a.master_port, a.master_addr)
        deaf = self._deaf_to_sigterm(joined)
        try:
            while len(joined) < self.nnodes:
                left = timeout - (time.time() - t0)
                if left <= 0:
                    raise EngineError("DistStoreError", f"Timed out after {timeout:g} seconds waiting for "
                                      f"clients. {len(joined)}/{self.nnodes} clients joined.")
                srv.settimeout(min(left, 5.0))
                try:
                    conn, peer = srv.accept()
                except socket.timeout:
                    if time.time() - last_note >= 10:
                        last_note = time.time()
                        self.logger.info("Still waiting for node(s) %s to join (%.0fs)", sorted(
                            set(range(self.nnodes)) - set(joined)), time.time() - t0)
                    continue
                try:
                    msg = _Lines(conn).read(10)
                except (OSError, ValueError, ConnectionError):
                    conn.close()
                    continue
                err = self._check_join(msg, joined)
                if err:
                    self.logger.warning("Refused a join from %s: %s", peer[0], err)
                    try:
                        _send(conn, {"op": "error", "message": err})
                    finally:
                        conn.close()
                    continue
                joined[msg["node_rank"]] = (msg, conn)
                self.logger.info("node %d (%s, %s) joined: ranks %s", msg["node_rank"], msg["host"], peer[0],
                                 [r[0] for r in msg["ranks"]])
            deaf()
            peers = [None] * self.world
            for msg, _ in joined.values():
                for rank, addr, port in msg["ranks"]:
                    peers[rank] = [addr, port]
            token = uuid.uuid4().hex
            ctimeout, bulk = _collective_params()
            plan = {"op": "peers", "peers": peers, "token": token, "timeout": ctimeout, "bulk": bulk}
            for r, (_, conn) in joined.items():
                if conn is not None:
                    _send(conn, plan)
                    self.conns.append((conn, f"node {r}"))
            # later joiners are refused (the group is formed); they keep retrying
            threading.Thread(target=self._refuse_late, args=(srv,), daemon=True).start()
            results = self._run_members(peers, token, ctimeout, bulk)
            for r, (_, conn) in joined.items():
                if conn is None:
                    continue
                reply = _Lines(conn).read(ctimeout + 30)
                if reply.get("op") != "result":
                    raise EngineError("RuntimeError", f"node {r}: {reply.get('message', reply)}")
                results += reply["results"]
        except (OSError, ConnectionError, ValueError) as e:
            raise EngineError("RuntimeError", f"multi-node rendezvous failed: {e}")
        finally:
            deaf()
        _report(self.logger, results, self.world)
        self._watch()
        return {"backend": "mp-multinode", "results": results, "nodes": self.nnodes}

    def _check_join(self, msg: dict, joined: dict) -> str | None:
        mine = joined[0][0]
        if msg.get("op") != "join":
            return "not a join request"
        for k in ("nnodes", "world", "tp", "pp", "model"):
            if msg.get(k) != mine[k]:
                return f"{k} differs: node {msg.get('node_rank')} has {msg.get(k)!r}, node 0 has {mine[k]!r}"
        r = msg.get("node_rank")
        if not isinstance(r, int) or not 0 < r < self.nnodes:
            return f"bad node rank {r!r}"
        if r in joined:
            return f"node rank {r} has already joined (duplicate --node-rank)"
        return None

    def _deaf_to_sigterm(self, joined: dict):
        """While node rank 0 waits for the other nodes, SIGTERM does nothing (measured: a rank 0
        waiting in start-up for a stranded group ignored SIGTERM for over 90 s; the real one is
        blocked in torch's store). Only SIGKILL ends it. Returns the function that hears it again."""
        if threading.current_thread() is not threading.main_thread():
            return lambda: None

        def ignored(signum, frame):
            self.logger.info("Received SIGTERM while waiting for node(s) %s to join; still waiting",
                             sorted(set(range(self.nnodes)) - set(joined)))
        prev = signal.signal(signal.SIGTERM, ignored)
        done = []

        def restore():
            if not done:
                done.append(True)
                signal.signal(signal.SIGTERM, prev)
        return restore

    def _refuse_late(self, srv) -> None:
        srv.settimeout(None)
        while True:  # after a loss too: a lost rank cannot rejoin this group
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            try:
                _send(conn, {"op": "error", "retry": True,
                             "message": "the process group is already formed; a lost rank cannot rejoin"})
            except OSError:
                pass
            conn.close()

    # ------------------------------------------------------------------ node rank > 0
    def _node(self, hello: dict) -> dict:
        a, timeout = self.args, dist_timeout()
        t0, last_note, last_err = time.time(), 0.0, None
        while True:
            if time.time() - t0 > timeout:
                raise EngineError("DistNetworkError", f"The client socket has timed out after {timeout:g}s "
                                  f"while trying to connect to ({a.master_addr}, {a.master_port}). "
                                  f"Last error: {last_err}")
            try:
                conn = socket.create_connection((a.master_addr, a.master_port), timeout=5)
                _send(conn, hello)
                lines = _Lines(conn)
                plan = lines.read(timeout)
            except (OSError, ConnectionError, ValueError) as e:
                last_err = e
                if time.time() - last_note >= 10:
                    last_note = time.time()
                    self.logger.info("Waiting for the master node at %s:%d (%s)", a.master_addr,
                                     a.master_port, e)
                time.sleep(1)
                continue
            if plan.get("op") == "error":
                conn.close()
                if plan.get("retry"):
                    last_err = plan["message"]
                    if time.time() - last_note >= 10:
                        last_note = time.time()
                        self.logger.info("Master at %s:%d: %s; retrying", a.master_addr, a.master_port,
                                         plan["message"])
                    time.sleep(1)
                    continue
                raise EngineError("RuntimeError", f"the master node refused this node: {plan['message']}")
            break
        self.logger.info("Joined the group at %s:%d", a.master_addr, a.master_port)
        try:
            results = self._run_members(plan["peers"], plan["token"], plan["timeout"], plan["bulk"])
        except EngineError as e:
            try:
                _send(conn, {"op": "error", "message": str(e)})
            except OSError:
                pass
            raise
        _send(conn, {"op": "result", "results": results})
        self.conns.append((conn, f"the master node {a.master_addr}:{a.master_port}"))
        for r in results:
            self.logger.info("rank %d: all-reduce OK over %s (%s)", r["rank"], r["addr"], r["how"])
        self._watch()
        return {"backend": "mp-multinode", "results": results, "nodes": self.nnodes}
