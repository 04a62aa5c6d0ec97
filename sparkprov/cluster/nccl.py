"""`invoke nccl-check`: all-reduce bus bandwidth across the hosts, inside the serving image, bound
to the fabric interfaces provision found (FabricInfo), against a threshold.

Each host runs `python3 -m torch.distributed.run --nnodes N --node-rank R --master-addr HEAD_FABRIC_IP`
on allreduce_bench.py (copied to the host in the same call, mounted read-only) in a container
labelled sparkprov.managed=1 (cluster-down removes one left by an interrupted run). NCCL on the
GPUs where the image's torch sees CUDA; Gloo on CPU otherwise (the lab). NVIDIA warns below
21.875 GB/s (175 Gb/s) between two Sparks; the threshold is applied to the largest message size:
verdict "pass" at or above it, "warn" below. A warn fails the check with NCCL (the GPUs' fabric is
slower than it must be); with Gloo on CPU it is reported and the check passes (CPU copies, not the
fabric, bound Gloo: the threshold is NVIDIA's figure for NCCL).
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from sparkprov.cluster.facts import ImageId
from sparkprov.cluster.hosts import close_all, connect_and_gather
from sparkprov.data.inventory import Inventory
from sparkprov.engine.report import Report, TaskResult
from sparkprov.facts.hardware import FabricInfo
from sparkprov.transport.shell import cmd, heredoc_bytes

BENCH = Path(__file__).with_name("allreduce_bench.py")
NVIDIA_MIN_GBS = 21.875
NAME = "sparkprov-nccl-check"
LAB_TORCH_LABEL = "org.sparkprov.lab.torch"  # the lab image says why it has no torch


def nccl_check(inventory: Inventory, hosts: list[str], image: str, report: Report, *, threshold: float = NVIDIA_MIN_GBS,
               max_bytes: str = "2G", iters: int = 20, port: int = 29500, timeout: float = 600,
               accept_new_host_keys: bool = False) -> dict[str, Any]:
    report.set_hosts(hosts)
    nodes = connect_and_gather(inventory, hosts, lambda n: [FabricInfo(), ImageId(image)],
                               accept_new_host_keys=accept_new_host_keys, become=False)
    out: dict[str, Any] = {"image": image, "threshold_gbs": threshold, "hosts": hosts}
    try:
        bad = False
        for h in hosts:
            n = nodes[h]
            if n.unreachable:
                report.record(TaskResult(h, "nccl-check", "connect", "-", "unreachable", n.unreachable))
                bad = True
                continue
            fab = n.values.get(FabricInfo().key) or {}
            if not fab.get("node_ip"):
                report.record(TaskResult(h, "nccl-check", "fabric", "cluster", "failed",
                                         f"{h}: no fabric rail with an address (G32) (fix: invoke provision --hosts {h} --tags fabric)"))
                bad = True
            if not (n.values.get(ImageId(image).key) or {}).get("id"):
                report.record(TaskResult(h, "nccl-check", "image", "cluster", "failed",
                                         f"{h}: {image} is not on the host (fix: invoke cluster-up once, or docker pull it)"))
                bad = True
        if bad:
            return out
        master = nodes[hosts[0]].values[FabricInfo().key]["node_ip"]
        bench = BENCH.read_bytes()

        def one(rank_host):
            rank, h = rank_host
            n = nodes[h]
            fab = n.values[FabricInfo().key]
            path = n.path("~/.cache/sparkprov/allreduce_bench.py")
            env = {"NCCL_SOCKET_IFNAME": fab["nccl_socket_ifname"], "GLOO_SOCKET_IFNAME": fab["gloo_socket_ifname"],
                   "UCX_NET_DEVICES": fab["ucx_net_devices"], "VLLM_HOST_IP": fab["node_ip"]}
            if fab.get("nccl_ib_hca"):
                env["NCCL_IB_HCA"] = fab["nccl_ib_hca"]
            argv = ["docker", "run", "--rm", "--name", NAME, "--label", "sparkprov.managed=1",
                    "--label", "sparkprov.deployment=nccl-check", "--label", "sparkprov.role=nccl-check",
                    "--network", "host", "--ipc=host", "--gpus", "all", "--entrypoint", "python3"]
            for k, v in env.items():
                argv += ["-e", f"{k}={v}"]
            argv += ["-v", f"{path}:/opt/sparkprov/allreduce_bench.py:ro", image,
                     "-m", "torch.distributed.run", "--nnodes", str(len(hosts)), "--nproc-per-node", "1",
                     "--node-rank", str(rank), "--master-addr", master, "--master-port", str(port),
                     "/opt/sparkprov/allreduce_bench.py", "--max-bytes", max_bytes, "--iters", str(iters)]
            script = ("set -e\nmkdir -p \"$(dirname " + cmd(path) + ")\"\n" + heredoc_bytes(bench, "cat > " + cmd(path))
                      + cmd("docker", "rm", "-f", NAME) + " >/dev/null 2>&1 || true\n"
                      + cmd(*argv) + " 2>&1 | tail -n 40\n")
            return h, n.run(script, timeout=timeout)

        try:
            with ThreadPoolExecutor(max_workers=len(hosts)) as pool:
                results = dict(pool.map(one, enumerate(hosts)))
        except BaseException:
            _cleanup(nodes, hosts)
            raise
        doc = None
        for line in results[hosts[0]].stdout.splitlines():
            if line.startswith('{"allreduce"'):
                doc = json.loads(line)["allreduce"]
        for h in hosts:
            res = results[h]
            if doc is None or not res.ok:
                if "No module named 'torch'" in res.stdout + res.stderr:
                    why = nodes[h].run(cmd("docker", "image", "inspect", "--format",
                                           "{{index .Config.Labels \"" + LAB_TORCH_LABEL + "\"}}", image)
                                       + " 2>/dev/null").stdout.strip()
                    why = why[len("absent: "):] if why.startswith("absent: ") else ""
                    msg = (f"{h}: {image} has no torch, which the all-reduce benchmark needs"
                           + (f" (the lab image was built without it: {why})" if why else
                              " (fix: --image with a serving image that has torch)"))
                else:
                    tail = (res.stdout.strip() or res.stderr.strip()).splitlines()[-3:]
                    msg = f"{h}: the benchmark failed (rc={res.rc}): {' / '.join(tail)}"
                report.record(TaskResult(h, "nccl-check", "all-reduce", "cluster", "failed", msg))
                continue
            if h != hosts[0]:
                report.record(TaskResult(h, "nccl-check", "all-reduce", "cluster", "ok", f"rank {hosts.index(h)} done"))
                continue
            big = doc["largest"]
            verdict = "pass" if big["busbw_gbs"] >= threshold else "warn"
            out.update(verdict=verdict, busbw_gbs=big["busbw_gbs"], backend=doc["backend"],
                       interfaces={hosts[r["rank"]]: {"ifname": r["ifname"], "address": r.get("address")}
                                   for r in doc["ranks"]})
            msg = (f"{doc['backend']} over "
                   + ", ".join(f"{r['ifname'] or '?'} ({r.get('address') or '?'})" for r in doc["ranks"])
                   + f": busbw {big['busbw_gbs']:.2f} GB/s (algbw {big['algbw_gbs']:.2f}) at "
                   f"{big['bytes'] / 2**20:.0f} MiB, peak {doc['peak_busbw_gbs']:.2f} GB/s; threshold {threshold:g} GB/s: ")
            if verdict == "pass":
                msg += "pass"
            elif doc["backend"] == "nccl":
                msg += "WARN, below (check MTU 9000 and NCCL_IB_HCA, G32/G33)"
            else:
                msg += "WARN, below (Gloo on CPU: the threshold is NVIDIA's NCCL figure; reported, not failed)"
            ok = verdict == "pass" or doc["backend"] != "nccl"
            report.record(TaskResult(h, "nccl-check", "all-reduce", "cluster", "ok" if ok else "failed", msg))
        out["result"] = doc
        if doc is None or any(not r.ok for r in results.values()):
            _cleanup(nodes, hosts)
    finally:
        close_all(nodes, report)
    return out


def _cleanup(nodes, hosts: list[str]) -> None:
    """A rank that failed or timed out may leave its peer waiting: remove the benchmark containers."""
    for h in hosts:
        n = nodes[h]
        if n.transport is not None and not n.unreachable:
            try:
                n.run(cmd("docker", "rm", "-f", NAME) + " >/dev/null 2>&1 || true", timeout=60)
            except Exception:  # the host went away: nothing to remove there
                pass
