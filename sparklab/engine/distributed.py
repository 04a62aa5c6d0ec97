"""Tensor/pipeline parallel start-up: Ray placement group + one actor per rank, or local
processes for the `mp` backend. Every rank validates the weights on its own node and the
ranks run a real ring all-reduce (see collective.py)."""
from __future__ import annotations

import multiprocessing
import os
import socket
import sys
import threading
import time
import uuid

from . import collective, model as model_mod
from .model import EngineError


def get_ip() -> str:
    """vLLM's get_ip(): VLLM_HOST_IP, else the address of the default route."""
    ip = os.environ.get("VLLM_HOST_IP")
    if ip:
        return ip
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        s.connect(("8.8.8.8", 80))  # UDP connect: no packet is sent
        return s.getsockname()[0]
    except OSError:
        return socket.gethostbyname(socket.gethostname())
    finally:
        s.close()


def local_gpu_count() -> int:
    if os.environ.get("LAB_ENGINE_LOCAL_GPUS"):
        return int(os.environ["LAB_ENGINE_LOCAL_GPUS"])
    cvd = os.environ.get("CUDA_VISIBLE_DEVICES")
    if cvd is not None:
        return len([d for d in cvd.split(",") if d.strip()])
    return 1  # a DGX Spark has one GB10


def _worker_check(spec: dict) -> dict:
    """What each rank does before the collective: validate the weights on this node."""
    info = model_mod.load_model(spec["model"], spec["revision"], spec["download_dir"],
                                spec["load_format"], spec["hf_overrides"])
    cache = model_mod.hub_cache_dir(spec["download_dir"])
    return {"path": info.path, "files": len(info.weight_files), "bytes": info.weight_bytes,
            "hf_cache": cache, "host": socket.gethostname()}


class RankWorker:
    """One tensor-parallel rank (a Ray actor, or the body of an mp process)."""

    def __init__(self, rank: int, world_size: int):
        self.rank, self.world = rank, world_size
        self.member = None

    def node(self) -> dict:
        ip = os.environ.get("VLLM_HOST_IP")
        try:
            import ray
            ray_ip = ray.util.get_node_ip_address()
            gpus = [str(g) for g in ray.get_gpu_ids()]
        except Exception:  # noqa: BLE001 (mp backend: no ray in this process)
            ray_ip, gpus = None, []
        return {"rank": self.rank, "ip": ip or ray_ip or get_ip(), "ray_ip": ray_ip,
                "gpus": gpus, "host": socket.gethostname(), "pid": os.getpid(),
                "gloo_ifname": os.environ.get("GLOO_SOCKET_IFNAME"),
                "hf_home": os.environ.get("HF_HOME")}

    def node_id(self) -> str:
        import ray
        return ray.get_runtime_context().get_node_id()

    def check_weights(self, spec: dict) -> dict:
        try:
            return _worker_check(spec)
        except EngineError as e:
            raise RuntimeError(f"rank {self.rank} on {socket.gethostname()}: {e}") from None

    def open(self, fallback_ip: str | None) -> tuple:
        self.member = collective.RingMember(self.rank, self.world, fallback_ip)
        return self.member.endpoint()

    def collective(self, peers: list, token: str, timeout: float, bulk: int, keep: bool = False) -> dict:
        return self.member.run(peers, token, timeout, bulk, keep=keep)

    def watch(self, interval: float, timeout: float) -> bool:
        """Keep the ring connected and heartbeating (the group lives as long as the engine)."""
        self.lost = None

        def on_lost(msg):
            self.lost = msg
        self.member.watch(on_lost, interval, timeout)
        return True

    def group_state(self) -> dict:
        return {"rank": self.rank, "lost": getattr(self, "lost", None)}


def _collective_params():
    return (float(os.environ.get("LAB_ENGINE_COLLECTIVE_TIMEOUT", "30")),
            int(os.environ.get("LAB_ENGINE_COLLECTIVE_BYTES", str(16 << 20))))


def _report(logger, results: list, world: int):
    for r in sorted(results, key=lambda r: r["rank"]):
        logger.info("rank %d: all-reduce OK over %s (%s)", r["rank"], r["addr"], r["how"])
    slowest = min(r["gbps"] for r in results)
    nbytes = results[0]["bytes"]
    logger.info("Gloo ring all-reduce verified across %d ranks; measured ring bandwidth %.2f Gbit/s "
                "(%.1f MiB per rank, slowest link)", world, slowest, nbytes / (1 << 20))


# --------------------------------------------------------------------------- Ray
def start_ray(world_size: int, spec: dict, logger) -> dict:
    try:
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
    except ImportError:
        raise EngineError("ValueError", "Failed to import Ray, please install Ray with `pip install ray`.")
    try:  # ship this package to the workers by value: nodes need not have it importable
        from ray import cloudpickle
        for m in (sys.modules[__name__], collective, model_mod):
            cloudpickle.register_pickle_by_value(m)
    except Exception:  # noqa: BLE001
        pass
    try:
        ray.init(address="auto", ignore_reinit_error=True, logging_level="ERROR",
                 log_to_driver=False)
    except (ConnectionError, RuntimeError) as e:
        raise EngineError("ConnectionError", str(e))
    driver_ip = get_ip()
    gpus = ray.cluster_resources().get("GPU", 0)
    logger.info("Connected to Ray cluster; cluster resources GPU=%s, nodes=%d, driver ip=%s",
                gpus, len([n for n in ray.nodes() if n.get("Alive")]), driver_ip)
    if world_size > gpus:
        raise EngineError("ValueError",
                          "The number of required GPUs exceeds the total number of available GPUs "
                          f"in the placement group. (world_size={world_size}, GPUs in Ray cluster={gpus:g})")
    here = [n for n in ray.nodes() if n.get("Alive") and n.get("NodeManagerAddress") == driver_ip]
    if here and here[0].get("Resources", {}).get("GPU", 0) < 1:
        raise EngineError("ValueError",
                          f"Current node has no GPU available. vLLM engine cannot start without GPU. "
                          f"Make sure you have at least 1 GPU available in a node current_ip={driver_ip!r}.")
    specs = [{"GPU": 1.0} for _ in range(world_size)]
    specs[0][f"node:{driver_ip}"] = 0.001
    strategy = os.environ.get("LAB_ENGINE_PG_STRATEGY", "PACK")
    pg = placement_group(specs, strategy=strategy)
    timeout = float(os.environ.get("LAB_ENGINE_PG_TIMEOUT", "60"))
    t0 = time.time()
    interval = min(10.0, max(timeout / 6, 0.5))
    while True:
        ready, _ = ray.wait([pg.ready()], timeout=interval)
        if ready:
            break
        waited = time.time() - t0
        if waited >= timeout:
            remove_placement_group(pg)
            raise EngineError("ValueError",
                              f"Cannot provide a placement group of placement_group_specs={specs} within "
                              f"{timeout:g} seconds. See `ray status` and `ray list nodes` to make sure the "
                              "cluster has enough resources.")
        logger.info("Waiting for creating a placement group of specs for %d seconds. specs=%s. Check "
                    "`ray status` and `ray list nodes` to see if you have enough resources, and make sure "
                    "the IP addresses used by ray cluster are the same as VLLM_HOST_IP environment "
                    "variable specified in each node if you are running on a multi-node.", waited, specs)
    Actor = ray.remote(num_cpus=0, num_gpus=1)(RankWorker)
    actors = [Actor.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
        placement_group=pg, placement_group_bundle_index=i,
        placement_group_capture_child_tasks=True)).remote(i, world_size) for i in range(world_size)]
    try:
        nodes = ray.get([a.node.remote() for a in actors])
        for n in nodes:
            logger.info("rank %d: node %s (ip %s, ray ip %s, pid %d), GPU ids %s, GLOO_SOCKET_IFNAME=%s, "
                        "HF_HOME=%s", n["rank"], n["host"], n["ip"], n["ray_ip"], n["pid"], n["gpus"],
                        n["gloo_ifname"], n["hf_home"])
        if not any(n["ray_ip"] == driver_ip for n in nodes):
            raise EngineError("ValueError",
                              f"Ray does not allocate any GPUs on the driver node (ip {driver_ip}). Consider "
                              "adjusting the Ray placement group or running the driver on a GPU node.")
        checks = ray.get([a.check_weights.remote(spec) for a in actors])
        for n, c in zip(nodes, checks):
            logger.info("rank %d: weights complete on %s (%d files, %.2f GiB in %s)",
                        n["rank"], n["host"], c["files"], c["bytes"] / (1 << 30), c["hf_cache"])
        endpoints = ray.get([a.open.remote(n["ray_ip"]) for a, n in zip(actors, nodes)])
        logger.info("rank 0 published its address %s:%d via Ray; ring: %s", endpoints[0][0],
                    endpoints[0][1], " -> ".join(f"{h}:{p}" for h, p in endpoints))
        ctimeout, bulk = _collective_params()
        token = uuid.uuid4().hex
        results = ray.get([a.collective.remote(endpoints, token, ctimeout, bulk, True) for a in actors])
        ray.get([a.watch.remote(float(os.environ.get("LAB_ENGINE_HEARTBEAT_SECONDS", "1")),
                                float(os.environ.get("LAB_ENGINE_GROUP_TIMEOUT", "30"))) for a in actors])
    except ray.exceptions.RayTaskError as e:
        cause = e.cause if getattr(e, "cause", None) is not None else e
        raise EngineError("RuntimeError", f"{type(cause).__name__}: {cause}") from None
    except ray.exceptions.RayActorError as e:
        raise EngineError("RuntimeError", f"a Ray worker died: {e}") from None
    _report(logger, results, world_size)
    node_ids = {}
    try:
        node_ids = {ray.get(a.node_id.remote()) for a in actors}
    except Exception:  # noqa: BLE001
        pass
    return {"backend": "ray", "placement_group": pg, "actors": actors,
            "nodes": nodes, "results": results, "node_ids": node_ids}


def monitor_ray(cluster: dict, on_lost, interval: float = 1.0) -> None:
    """Watch a Ray TP group for the engine's life (a thread): a rank's actor dying
    (RayActorError), a node of the group leaving the Ray cluster, or a rank losing its ring
    peer calls on_lost(message) once, as vLLM's engine core dies when its Ray workers do."""
    import ray

    actors, node_ids = cluster["actors"], cluster.get("node_ids") or set()

    def loop():
        while True:
            time.sleep(interval)
            try:
                states = ray.get([a.group_state.remote() for a in actors], timeout=max(5.0, 5 * interval))
            except ray.exceptions.RayActorError as e:
                return on_lost(f"ray.exceptions.RayActorError: The actor died unexpectedly before finishing "
                               f"this task. {str(e).splitlines()[0] if str(e) else ''}".rstrip())
            except ray.exceptions.GetTimeoutError:
                states = []
            except Exception as e:  # noqa: BLE001 (the GCS itself went away)
                return on_lost(f"{type(e).__name__}: {e}")
            for st in states:
                if st.get("lost"):
                    return on_lost(f"RuntimeError: rank {st['rank']}: {st['lost']}")
            try:
                alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
            except Exception as e:  # noqa: BLE001
                return on_lost(f"{type(e).__name__}: lost the Ray cluster: {e}")
            gone = node_ids - alive
            if gone:
                return on_lost(f"ray.exceptions.NodeDiedError: node(s) {sorted(gone)} of the placement group "
                               f"died; {len(alive)} Ray node(s) left")
    threading.Thread(target=loop, daemon=True, name="ray-group-monitor").start()


# --------------------------------------------------------------------------- mp
def _mp_rank(rank, world, spec, conn):
    try:
        w = RankWorker(rank, world)
        w.check_weights(spec)
        conn.send(("endpoint", w.open(get_ip())))
        peers, token, timeout, bulk = conn.recv()
        conn.send(("result", w.collective(peers, token, timeout, bulk)))
    except Exception as e:  # noqa: BLE001
        conn.send(("error", f"{type(e).__name__}: {e}"))


def start_mp(world_size: int, spec: dict, logger) -> dict:
    gpus = local_gpu_count()
    if world_size > gpus:
        raise EngineError("ValueError",
                          f"World size ({world_size}) is larger than the number of available GPUs ({gpus}) "
                          "in this node. If this is intentional and you are using:\n"
                          "- ray, set '--distributed-executor-backend ray'.\n"
                          "- multiprocessing, set '--nnodes' appropriately.")
    ctx = multiprocessing.get_context("fork")
    procs, conns = [], []
    for r in range(world_size):
        parent, child = ctx.Pipe()
        p = ctx.Process(target=_mp_rank, args=(r, world_size, spec, child), daemon=True)
        p.start()
        procs.append(p)
        conns.append(parent)

    def recv(c):
        kind, val = c.recv()
        if kind == "error":
            raise EngineError("RuntimeError", f"Worker failed: {val}")
        return val

    try:
        endpoints = [recv(c) for c in conns]
        ctimeout, bulk = _collective_params()
        token = uuid.uuid4().hex
        for c in conns:
            c.send((endpoints, token, ctimeout, bulk))
        results = [recv(c) for c in conns]
    finally:
        for p in procs:
            p.join(5)
    _report(logger, results, world_size)
    return {"backend": "mp", "results": results}
