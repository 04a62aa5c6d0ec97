"""gpu_check: the NVIDIA driver and GPU are fit to serve.

- nvidia-smi present and talking to the driver; GPU name and compute capability (GB10 = 12.1,
  sm_121; any other NVIDIA GPU is accepted with its own, e.g. H100 = 9.0);
- driver version >= the minimum: the `min_driver` argument, else the lowest `min_driver` of the
  catalog's images (sparkprov.catalog.load_catalog), else the `min_driver` variable; catalog
  images that need a newer driver than the host has are named in warnings (G5);
- CUDA version (from nvidia-smi's header);
- memory from /proc/meminfo: GB10's nvidia-smi reports `[N/A]` (unified memory, G16), and CPU
  and GPU share one pool (G13); a `modeset=0` kernel parameter caps CUDA-visible memory near
  62 GB, so the usable utilization is about 0.55 (G18).

Failures name the host, what was found, what is needed and how to fix it.
Exports `gpu`: {name, compute_cap, count, driver_version, cuda_version, unified_memory,
memory_total_bytes, memory_available_bytes, max_gpu_memory_utilization, min_driver}.
"""

from __future__ import annotations

import threading
from functools import lru_cache

from sparkprov.modules.base import Export, FactView, HostContext, Module, ModuleArgs, Plan
from sparkprov.facts.hardware import KernelCmdline, MemInfo, NvidiaSmi, driver_at_least, gib, version_tuple
from sparkprov.modules._provision import setting
from sparkprov.modules.host_identity import IDENTITY
from typing import TypedDict

GB10_COMPUTE_CAP = "12.1"
MODESET0_UTILIZATION = 0.55  # G18 (source 002): ~62 GB of 119 GB visible to CUDA
DRIVER_FIX = ("upgrade the NVIDIA driver (DGX OS: `sudo apt update && sudo apt full-upgrade`, then reboot; "
              "other Ubuntu hosts: install nvidia-driver-580-open or newer)")


class Args(ModuleArgs):
    min_driver: str | None = None  # default: the catalog's images, else the `min_driver` variable
    compute_cap: str | None = None  # demand this compute capability (e.g. "12.1"); default: warn on a Spark without GB10


_CATALOG_LOCK = threading.Lock()


def catalog_drivers() -> tuple[tuple[str, str | None], ...]:
    """(image ref, min_driver or None) for every catalog image not known to fail on GB10. Read
    once per process: the hosts plan in parallel, and without the lock each of 16 threads parsed
    the whole catalog at once (1.4 s of a 16-host no-op provision)."""
    with _CATALOG_LOCK:
        return _catalog_drivers()


@lru_cache(maxsize=1)
def _catalog_drivers() -> tuple[tuple[str, str | None], ...]:
    try:
        from sparkprov.catalog.load import load_catalog

        catalog = load_catalog()
    except Exception:  # a broken catalog is reported by the catalog's own commands
        return ()
    return tuple(sorted((ref, img.min_driver) for ref, img in catalog.image_table.items() if img.gb10 is not False))


def min_driver_for(args_min: str | None, images: tuple[tuple[str, str | None], ...], var_min: str | None
                   ) -> tuple[str | None, str]:
    """The minimum driver (the lowest that runs some catalog image) and where it came from.
    Catalog images that state no minimum count with the `min_driver` variable."""
    if args_min:
        return str(args_min), "the task's min_driver"
    cands = [(v, f"catalog image {ref}") for ref, v in images if v]
    unstated = [ref for ref, v in images if not v]
    if unstated and var_min:
        cands.append((str(var_min), f"the min_driver variable, for {len(unstated)} catalog image(s) that state none"))
    if cands:
        return min(cands, key=lambda c: version_tuple(c[0]))
    if var_min:
        return str(var_min), "the min_driver variable"
    return None, ""


class Gpu(TypedDict):
    name: str
    compute_cap: str
    count: int
    driver_version: str
    cuda_version: str | None
    unified_memory: bool
    memory_total_bytes: int
    memory_available_bytes: int | None
    max_gpu_memory_utilization: float | None
    min_driver: str


GPU: Export[Gpu] = Export("gpu", Gpu, "the host's GPU, driver, CUDA and memory as gpu_check judged them")


class GpuCheckModule(Module):
    name = "gpu_check"
    Args = Args
    doc = "nvidia-smi works, GPU and compute capability, driver >= minimum, CUDA version, memory from /proc/meminfo."

    def needs(self, args: Args, host: HostContext):
        return {"smi": NvidiaSmi(), "mem": MemInfo(), "cmdline": KernelCmdline()}

    def plan(self, args: Args, facts: FactView, host: HostContext) -> Plan:
        smi, mem, kcmd = facts.smi, facts.mem, facts.cmdline
        images = catalog_drivers()
        need, source = min_driver_for(args.min_driver, images, setting(None, host, "min_driver"))
        h = host.name
        if not smi["present"]:
            return Plan.fail(f"{h}: nvidia-smi not found: no NVIDIA driver installed; need driver >= {need or '580'}. "
                             f"Fix: {DRIVER_FIX}")
        if smi["error"]:
            return Plan.fail(f"{h}: nvidia-smi cannot talk to the driver: {smi['error']}. Fix: reboot; if it persists "
                             "check `sudo fuser -v /dev/nvidia*` and reinstall the driver")
        gpu = smi["gpus"][0]
        driver, cuda = smi["driver_version"], smi["cuda_version"]
        warnings: list[str] = []
        if need is None:
            return Plan.fail(f"{h}: no minimum driver known: the catalog's images name none and min_driver is unset. "
                             "Fix: set min_driver in the inventory or the playbook (e.g. \"580\")")
        if not driver_at_least(driver, need):
            return Plan.fail(f"{h}: NVIDIA driver {driver} is too old: need >= {need} ({source}). Fix: {DRIVER_FIX}")
        for ref, v in images:
            if v and not driver_at_least(driver, v):
                warnings.append(f"{h}: driver {driver} is below {v} that {ref} needs: that image will restart-loop "
                                f"with 'compatibility mode is UNAVAILABLE' (G5)")
        ident = IDENTITY.read(host.exports, h)
        cc = gpu["compute_cap"]
        if args.compute_cap and cc != args.compute_cap:
            return Plan.fail(f"{h}: GPU {gpu['name']} has compute capability {cc}, need {args.compute_cap}")
        if ident and ident["is_spark"] and cc != GB10_COMPUTE_CAP:
            warnings.append(f"{h}: a DGX Spark with GPU {gpu['name']} (compute capability {cc}), expected GB10 ({GB10_COMPUTE_CAP})")
        unified = gpu["memory_total_mib"] is None
        total = mem["MemTotal"] if unified else gpu["memory_total_mib"] * 2**20
        avail = mem.get("MemAvailable")
        cap = None
        if kcmd["modeset"] == "0":
            cap = MODESET0_UTILIZATION
            warnings.append(f"{h}: kernel parameter modeset=0 caps CUDA-visible memory near 62 GB: keep "
                            f"--gpu-memory-utilization at or below {cap} (G18)")
        mem_txt = (f"unified memory (nvidia-smi: [N/A]; /proc/meminfo: {gib(total)} total, {gib(avail)} available)"
                   if unified else f"{gib(total)} GPU memory, host {gib(mem['MemTotal'])} ({gib(avail)} available)")
        msg = (f"{gpu['name']} (compute capability {cc}), {len(smi['gpus'])} GPU(s), driver {driver} >= {need}, "
               f"CUDA {cuda or '?'}, {mem_txt}")
        exports = GPU({"name": gpu["name"], "compute_cap": cc, "count": len(smi["gpus"]), "driver_version": driver,
                           "cuda_version": cuda, "unified_memory": unified, "memory_total_bytes": total,
                           "memory_available_bytes": avail, "max_gpu_memory_utilization": cap, "min_driver": need})
        return Plan(msg=msg, warnings=warnings, exports=exports)
