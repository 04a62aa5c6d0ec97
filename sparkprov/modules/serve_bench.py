"""serve_bench: vLLM's benchmark client against a deployment this host serves (`invoke bench`).

Plans from the host's sparkprov containers (the status fact): a host that serves the deployment
(its container runs and answers /health) runs `vllm bench serve` once per concurrency level inside
that container (sparkprov/serving/bench.py); a host that does not serve it has nothing to do.
A benchmark is a measurement, not a state: check mode says what it would run and runs nothing,
and nothing is re-read afterwards. The rows go to the play's exports (`bench`) for the command
to store, plot and compare."""

from __future__ import annotations

from pydantic import Field

from sparkprov.facts.base import FactError
from sparkprov.facts.hardware import NvidiaSmi
from sparkprov.facts.serving import ServingStatus
from sparkprov.modules.base import Change, Export, FactView, HostContext, Module, ModuleArgs, Plan
from sparkprov.serving import bench
from typing import TypedDict


class Args(ModuleArgs):
    deployment: str = Field(min_length=1, max_length=128)
    concurrency: list[int] = Field(min_length=1, max_length=32)
    input_len: int = Field(default=1024, ge=1, le=1_048_576)
    output_len: int = Field(default=128, ge=1, le=1_048_576)
    prompts: int | None = Field(default=None, ge=1, le=1_000_000)  # per level; None: 4 x concurrency, at least 8
    timeout: float = Field(default=3600, gt=0, le=86400)  # per level
    profile: str | None = Field(default=None, max_length=64)  # a named profile the parameters came from (arena)


class BenchTarget(TypedDict):
    container: str              # the rank 0 container the client runs in
    labels: dict[str, str]


class BenchMember(TypedDict):
    rank: str | None            # the node's rank in the deployment (its label)


BENCH_TARGET: Export[BenchTarget] = Export("bench_target", BenchTarget, "the deployment serves its API here")
BENCH_MEMBER: Export[BenchMember] = Export("bench_member", BenchMember, "a node of the deployment, and its rank")
BENCH: Export[bench.BenchRun] = Export("bench", dict, "the run (serving/bench.py record: rows, provenance, ...)")


class ServeBench(Module):
    name = "serve_bench"
    Args = Args
    doc = "Run vLLM's benchmark client (vllm bench serve) against a deployment this host serves."

    def needs(self, args: Args, host: HostContext):
        # the driver comes with the gather (one section more, no round trip); the kernel and the
        # OS with the host's identity, which every gather reads
        return {"status": ServingStatus(), "gpu": NvidiaSmi()}

    def plan(self, args: Args, facts: FactView, host: HostContext) -> Plan:
        st = facts.status
        if not st.get("access"):
            return Plan.fail(f"{host.name}: docker: {st.get('error')}")
        mine = [c for c in st["containers"] if c["labels"].get("sparkprov.deployment") == args.deployment
                and c["labels"].get("sparkprov.port")]
        if not mine:
            # a rank that serves no API: the command names it among the run's hosts
            ranks = [c for c in st["containers"] if c["labels"].get("sparkprov.deployment") == args.deployment]
            exports = BENCH_MEMBER({"rank": ranks[0]["labels"].get("sparkprov.rank")}) if ranks else {}
            return Plan(msg=f"{args.deployment} does not serve here", exports=exports)
        c = mine[0]
        if c["status"] != "running" or c.get("health") != 200:
            return Plan.fail(f"{host.name}: {args.deployment} is not answering ({c['name']} is {c['status']}, "
                             f"/health {c.get('health')}) (fix: invoke status, then invoke cluster-up)")
        labels = c["labels"]
        levels = ",".join(map(str, args.concurrency))
        spec = {"container": c["name"], "port": int(labels["sparkprov.port"]), "model": labels.get("sparkprov.model"),
                "keyfile": labels.get("sparkprov.api_key_file"), "concurrency": args.concurrency,
                "input_len": args.input_len, "output_len": args.output_len, "prompts": args.prompts,
                "timeout": args.timeout, "result_dir": bench.RESULT_DIR}
        change = Change(f"vllm bench serve in {c['name']} at concurrency {levels} "
                        f"(input {args.input_len}, output {args.output_len} tokens)", bench.host_script(spec),
                        verify=False, timeout=args.timeout * len(args.concurrency) + 60)
        params = {"concurrency": args.concurrency, "input_len": args.input_len, "output_len": args.output_len,
                  "prompts": args.prompts}
        try:
            gpu = facts.gpu
        except FactError:  # no driver to name: the run records none
            gpu = None
        system = bench.system_facts(gpu, host.info)
        change.outcome = lambda out: _judge(out, args, host.name, labels, params, system, change)
        return Plan([change], exports={**BENCH_TARGET({"container": c["name"], "labels": labels}),
                                       **BENCH_MEMBER({"rank": labels.get("sparkprov.rank") or "0"})})


def _judge(out: str, args: Args, host: str, labels: dict, params: dict, system: dict, change: Change) -> str | None:
    try:
        doc = bench.parse_host_output(out)
    except ValueError as e:
        return f"{host}: {e}"
    rec = bench.record(host, args.deployment, labels, params, doc, system, args.profile)
    change.exports = BENCH(rec)
    failed = doc.get("error") or next((r["error"] for r in doc.get("rows", []) if "error" in r), None)
    done = ", ".join(f"c={r['concurrency']}: {r['output_throughput']:.1f} output tok/s" for r in rec["rows"]
                     if r.get("output_throughput") is not None)
    change.summary = f"vllm bench serve in {doc.get('container')}: {done or 'no level finished'}"
    if failed:
        return f"{host}: {failed}"
    return None
