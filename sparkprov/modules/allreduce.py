"""allreduce: the all-reduce bus bandwidth between the play's hosts over the fabric, measured in
the serving image (serving/allreduce_bench.py under torch.distributed), against a threshold.

Two phases, two plays: `prepare` checks this host (a fabric rail, the image present) and exports
its fabric address; `run` starts this host's rank (rank 0 = the first host; every host of the play
runs at once), bound to the fabric interfaces provision found. NCCL on the GPU unless the
backend is gloo: a container that cannot see the GPU fails, naming the host and the fix. The
benchmark is a measurement, not a state: check mode says it would run it and runs nothing.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal, TypedDict

from pydantic import Field

from sparkprov.modules.base import Change, Export, FactView, HostContext, Module, ModuleArgs, Plan
from sparkprov.facts.docker_run import CAUSE_PREFIX, cause_of, reporting_cause
from sparkprov.facts.fabric import FabricInfo
from sparkprov.facts.serving import ImageId
from sparkprov.transport.shell import cmd, heredoc_bytes

BENCH = Path(__file__).resolve().parents[1] / "serving" / "allreduce_bench.py"
NAME = "sparkprov-nccl-check"
NVIDIA_MIN_GBS = 21.875  # NVIDIA's two-Spark figure


class Args(ModuleArgs):
    phase: Literal["prepare", "run"]
    hosts: list[str] = Field(min_length=2)
    image: str
    backend: Literal["nccl", "gloo"] = "nccl"
    threshold: float = Field(default=NVIDIA_MIN_GBS, gt=0, le=10000)
    max_bytes: str = "2G"
    iters: int = Field(default=20, ge=1, le=10000)
    port: int = Field(default=29500, ge=1, le=65535)
    timeout: float = Field(default=600, gt=0, le=86400)
    # How long a rank waits at the rendezvous for the others (torchrun's static rendezvous waits 900 s
    # by default: a rank whose peer never started hung nccl-check for minutes, issue 36), and for any
    # one collective once they met (a peer that dies mid-run). Every rank starts at once, in an image
    # already on its host: the others arrive within seconds.
    rendezvous_timeout: int = Field(default=120, ge=5, le=3600)


AllreduceResult = TypedDict("AllreduceResult", {"backend": str, "busbw_gbs": float, "algbw_gbs": float, "bytes": int,
                                                "peak_busbw_gbs": float, "threshold_gbs": float,
                                                "ranks": "list[dict[str, Any]]", "pass": bool})

ALLREDUCE_ADDR: Export[str] = Export("allreduce_addr", str, "this rank's fabric address (rank 0's: the rendezvous)")
ALLREDUCE: Export[AllreduceResult] = Export("allreduce", AllreduceResult,
                                            "rank 0: the largest message's bus bandwidth against the threshold")


class Allreduce(Module):
    name = "allreduce"
    Args = Args
    doc = "All-reduce bus bandwidth between the hosts over the fabric, in the serving image (nccl-check)."

    def needs(self, args: Args, host: HostContext):
        return {"fabric": FabricInfo(), "image": ImageId(args.image)}

    def plan(self, args: Args, facts: FactView, host: HostContext) -> Plan:
        h = host.name
        fab = facts.fabric or {}
        if args.phase == "prepare":
            fails = []
            if not fab.get("node_ip"):
                fails.append(f"{h}: no fabric rail with an address (G32) (fix: invoke provision --hosts {h} --tags fabric)")
            if not (facts.image or {}).get("id"):
                fails.append(f"{h}: {args.image} is not on the host (fix: invoke cluster-up once, or docker pull it)")
            if fails:
                return Plan.fail(" | ".join(fails))
            return Plan(msg=f"rank {args.hosts.index(h)} on {fab['nccl_socket_ifname']} ({fab['node_ip']})",
                        exports=ALLREDUCE_ADDR(fab["node_ip"]))
        rank = args.hosts.index(h)
        master = ALLREDUCE_ADDR.read(host.exports, args.hosts[0])
        if not master:
            return Plan.fail(f"{h}: rank 0 ({args.hosts[0]}) has no fabric address (its check failed)")
        path = "$HOME/.cache/sparkprov/allreduce_bench.py"
        env = {"NCCL_SOCKET_IFNAME": fab["nccl_socket_ifname"], "GLOO_SOCKET_IFNAME": fab["gloo_socket_ifname"],
               "UCX_NET_DEVICES": fab["ucx_net_devices"], "VLLM_HOST_IP": fab["node_ip"]}
        if fab.get("nccl_ib_hca"):
            env["NCCL_IB_HCA"] = fab["nccl_ib_hca"]
        argv = ["docker", "run", "--rm", "--name", NAME, "--label", "sparkprov.managed=1",
                "--label", "sparkprov.deployment=nccl-check", "--label", "sparkprov.role=nccl-check",
                "--network", "host", "--ipc=host"] + (["--gpus", "all"] if args.backend == "nccl" else []) + \
               ["--entrypoint", "python3"]
        for k, v in env.items():
            argv += ["-e", f"{k}={v}"]
        bench_argv = ["-m", "torch.distributed.run", "--nnodes", str(len(args.hosts)), "--nproc-per-node", "1",
                      "--node-rank", str(rank), "--master-addr", master, "--master-port", str(args.port),
                      "--rdzv-conf", f"timeout={args.rendezvous_timeout}",
                      "/opt/sparkprov/allreduce_bench.py", "--backend", args.backend, "--max-bytes", args.max_bytes,
                      "--iters", str(args.iters), "--timeout", str(args.rendezvous_timeout)]
        run = reporting_cause(cmd(*argv) + ' -v "$p:/opt/sparkprov/allreduce_bench.py:ro" ' + cmd(args.image, *bench_argv))
        # the benchmark's own exit status goes to the outcome (which names the cause), not to sh
        script = (f'p={path}\nmkdir -p "$(dirname "$p")"\n' + heredoc_bytes(BENCH.read_bytes(), 'cat > "$p"')
                  + cmd("docker", "rm", "-f", NAME) + " >/dev/null 2>&1 || true\n"
                  + "set +e\n" + run + " > \"$p.out\" 2>&1\nrc=$?\ntail -n 40 \"$p.out\"\n"
                  + "[ $rc = 0 ] || " + cmd("docker", "rm", "-f", NAME) + " >/dev/null 2>&1\n"
                  + 'echo "@rc=$rc"\n')
        change = Change(f"all-reduce rank {rank} of {len(args.hosts)} ({args.backend}, up to {args.max_bytes}) "
                        f"with rank 0 at {master}:{args.port}", script, timeout=args.timeout, verify=False)
        change.outcome = lambda out: _judge(out, args, h, rank, f"{master}:{args.port}", change)
        return Plan([change])


# What torch's TCPStore (torchrun's static rendezvous) says when the bound passed before every rank
# came (torch 2.13's libtorch_cpu.so): rank 0 "Timed out after 121 seconds waiting for clients. 1/2
# clients joined.", another rank "The client socket has timed out after 120000ms while trying to
# connect to (ADDR, PORT)."
RENDEZVOUS_TIMEOUTS = ("clients joined.", "The client socket has timed out after")


def waited_alone(out: str) -> bool:
    return any(t in out for t in RENDEZVOUS_TIMEOUTS)


def _judge(out: str, args: Args, host: str, rank: int, master: str, change: Change) -> str | None:
    doc = next((json.loads(line)["allreduce"] for line in out.splitlines() if line.startswith('{"allreduce"')), None)
    rc = next((int(line[4:]) for line in reversed(out.splitlines()) if line.startswith("@rc=")), None)
    if rc or (rank == 0 and doc is None):
        if "No module named 'torch'" in out:
            return f"{host}: {args.image} has no torch, which the benchmark needs (fix: --image with a serving image that has torch)"
        if "no CUDA device is visible" in out:
            return (f"{host}: the container cannot see the GPU, so NCCL cannot run (fix: check the NVIDIA container "
                    "toolkit with invoke provision --tags docker; or --backend gloo to measure the fabric on the CPU)")
        if waited_alone(out):
            return (f"{host}: rank {rank} waited {args.rendezvous_timeout}s at the rendezvous ({master}) "
                    f"for the other {len(args.hosts) - 1} rank(s), which did not all come (fix: see the other hosts' "
                    "results; every host must run its rank at once)")
        cause = cause_of(out)
        if cause and CAUSE_PREFIX in cause:  # docker's own failure (exit 125: the daemon; 126/127: no python3)
            return f"{host}: {cause}"
        lines = [ln for ln in out.strip().splitlines() if ln.strip() and not ln.startswith(("@rc=", "====", "----"))]
        return f"{host}: the benchmark failed (exit status {rc}): {' / '.join(lines[-3:])}"
    if rank != 0:
        return None  # rank 0 reports the result
    big = doc["largest"]
    change.exports = ALLREDUCE({"backend": doc["backend"], "busbw_gbs": big["busbw_gbs"],
                                "algbw_gbs": big["algbw_gbs"], "bytes": big["bytes"],
                                "peak_busbw_gbs": doc["peak_busbw_gbs"], "threshold_gbs": args.threshold,
                                "ranks": doc["ranks"], "pass": big["busbw_gbs"] >= args.threshold})
    change.summary = (f"{doc['backend']} over " + ", ".join(f"{r['ifname'] or '?'} ({r.get('address') or '?'})"
                                                            for r in doc["ranks"])
                      + f": busbw {big['busbw_gbs']:.2f} GB/s (algbw {big['algbw_gbs']:.2f}) at "
                      f"{big['bytes'] / 2**20:.0f} MiB, peak {doc['peak_busbw_gbs']:.2f} GB/s; "
                      f"threshold {args.threshold:g} GB/s")
    if big["busbw_gbs"] < args.threshold:
        why = ("check MTU 9000 and NCCL_IB_HCA, G32/G33" if doc["backend"] == "nccl"
               else "Gloo on the CPU measures the link through the CPU, not NCCL")
        return f"busbw {big['busbw_gbs']:.2f} GB/s is below the threshold {args.threshold:g} GB/s ({why})"
    return None
