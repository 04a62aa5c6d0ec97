"""memory_hygiene: how much of the unified memory is free, and freeing it before a large load.

A step other playbooks call before starting vLLM (and provision runs in report-only form):
- reports MemAvailable, MemTotal and the page cache from /proc/meminfo (G13, G16: on GB10 the
  GPU has no memory of its own to report);
- finds an Ollama server holding models (GET /api/ps, G14); `unload_ollama: true` unloads each
  (POST /api/generate {"model": NAME, "keep_alive": 0}), else a warning names them;
- `drop_caches: true` drops the page cache as root (`sync; echo 3 > /proc/sys/vm/drop_caches`,
  G15); it is a change every time it is asked for;
- `min_available_gb`: fail when less is available (checked when nothing else is left to do).

Exports `memory`: {total_bytes, available_bytes, cached_bytes, ollama_models}.
"""

from __future__ import annotations

import json

from sparkprov.modules.base import Change, Diff, Export, FactView, HostContext, Module, ModuleArgs, Plan
from sparkprov.facts.hardware import MemInfo, gib
from sparkprov.facts.runtimes import OllamaState
from sparkprov.transport.shell import cmd
from typing import TypedDict


class Args(ModuleArgs):
    ollama_url: str = "http://127.0.0.1:11434"
    unload_ollama: bool = False
    drop_caches: bool = False
    min_available_gb: float | None = None


class Memory(TypedDict):
    total_bytes: int
    available_bytes: int
    cached_bytes: int
    ollama_models: list[str]


MEMORY: Export[Memory] = Export("memory", Memory, "unified memory after the hygiene, and the models Ollama holds")


class MemoryHygieneModule(Module):
    name = "memory_hygiene"
    Args = Args
    doc = "Report MemAvailable; unload Ollama models and drop the page cache when asked."

    def needs(self, args: Args, host: HostContext):
        return {"mem": MemInfo(), "ollama": OllamaState(args.ollama_url)}

    def plan(self, args: Args, facts: FactView, host: HostContext) -> Plan:
        mem, ollama = facts.mem, facts.ollama
        avail, total, cached = mem.get("MemAvailable", 0), mem["MemTotal"], mem.get("Cached", 0)
        models = ollama["models"]
        changes: list[Change] = []
        warnings: list[str] = []
        touched = [MemInfo(), OllamaState(args.ollama_url)]
        for m in models:
            body = json.dumps({"model": m["name"], "keep_alive": 0})
            script = cmd("curl", "-sf", "-m", "60", "--noproxy", "*", "-X", "POST", args.ollama_url.rstrip("/") + "/api/generate",
                         "-H", "Content-Type: application/json", "-d", body) + " >/dev/null"
            if args.unload_ollama:
                changes.append(Change(f"unload Ollama model {m['name']} ({gib(m.get('size'))})", script,
                                      Diff("ollama loaded models", f"{m['name']}\n", ""), touched))
        if models and not args.unload_ollama:
            warnings.append(f"{host.name}: Ollama holds {len(models)} model(s) in unified memory "
                            f"({', '.join(m['name'] for m in models)}): they compete with vLLM; unload them "
                            "(memory_hygiene unload_ollama: true) before starting vLLM (G14)")
        if args.drop_caches:
            changes.append(Change(f"drop the page cache ({gib(cached)} cached)", "sync\necho 3 > /proc/sys/vm/drop_caches",
                                  Diff("page cache", f"{gib(cached)}\n", "dropped\n"), [MemInfo()], verify=False))
        if not changes and args.min_available_gb is not None and avail < args.min_available_gb * 2**30:
            return Plan.fail(f"{host.name}: only {gib(avail)} of {gib(total)} available, need {args.min_available_gb} GiB: "
                             "stop other runtimes or containers (G13, G14) and drop caches (G15)")
        ol = (f"Ollama: {len(models)} model(s) loaded" if models else
              "Ollama: nothing loaded" if ollama["running"] else "no Ollama server")
        msg = f"MemAvailable {gib(avail)} of {gib(total)} (page cache {gib(cached)}); {ol}"
        return Plan(changes, msg=msg, warnings=warnings,
                    exports=MEMORY({"total_bytes": total, "available_bytes": avail, "cached_bytes": cached,
                                    "ollama_models": [m["name"] for m in models]}))
