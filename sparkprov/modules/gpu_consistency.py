"""gpu_consistency: the hosts of one cluster run the same driver and CUDA version.

Runs in a play after gpu_check (plays are barriers) and reads what each host exported as
`gpu`; it reads nothing remotely. Differences are flagged as warnings (`strict: true` makes
them a failure): NCCL, Ray and one image across nodes want one stack (G34).
"""

from __future__ import annotations

from sparkprov.modules.base import FactView, HostContext, Module, ModuleArgs, Plan
from sparkprov.modules.gpu_check import GPU


class Args(ModuleArgs):
    strict: bool = False


class GpuConsistencyModule(Module):
    name = "gpu_consistency"
    Args = Args
    doc = "Flag driver or CUDA versions that differ between the hosts of a play (from gpu_check's exports)."

    def plan(self, args: Args, facts: FactView, host: HostContext) -> Plan:
        gpus = GPU.of_play(host)
        if host.name not in gpus:
            return Plan.skip("gpu_check exported nothing for this host")
        problems = []
        for key, label in (("driver_version", "driver"), ("cuda_version", "CUDA")):
            seen = {h: g.get(key) for h, g in sorted(gpus.items())}
            if len(set(seen.values())) > 1:
                problems.append(f"{label} versions differ across the cluster: "
                                + ", ".join(f"{h} {v}" for h, v in seen.items())
                                + f": upgrade so every node runs the same {label}")
        if problems and args.strict:
            return Plan.fail("; ".join(problems))
        mine = gpus[host.name]
        return Plan(msg=f"{len(gpus)} host(s); this one: driver {mine['driver_version']}, CUDA {mine['cuda_version']}",
                    warnings=problems)
