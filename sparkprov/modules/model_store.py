"""model_store: the model store and the compile cache live on host volumes the login user owns.

- the store (`path`, default the `model_store` variable, else ~/vllm) is HF_HOME with the hub
  layout (`hub/`), owned by the login user, mounted at the same path in every container and on
  every node (G22, G34);
- the compile cache (`compile_cache`, default the variable of that name, else
  ~/vllm-compile-cache) is mounted at /root/.cache/vllm in containers (G22); it is keyed by arch,
  vLLM version, model and flags, so `clear_compile_cache: true` empties it after an upgrade (G25);
- files in either owned by someone else (root-owned leftovers of a container download, G23) are
  given back to the login user (`fix_ownership`, default true; false: fail naming them);
- free space of the store's filesystem is reported (`min_free_gb`: fail below it).

Exports `model_store`: {hf_home, compile_cache, free_bytes, container: {env: {HF_HOME}, mounts}}.
"""

from __future__ import annotations

from sparkprov.modules.base import Change, Diff, Export, FactView, HostContext, Module, ModuleArgs, Plan
from sparkprov.facts.files import OwnedTree
from sparkprov.facts.hardware import gib
from sparkprov.modules._provision import setting
from sparkprov.transport.shell import cmd
from typing import Any, TypedDict

CONTAINER_CACHE = "/root/.cache/vllm"


class Args(ModuleArgs):
    path: str | None = None           # default: the `model_store` variable, else ~/vllm
    compile_cache: str | None = None  # default: the `compile_cache` variable, else ~/vllm-compile-cache
    fix_ownership: bool = True
    clear_compile_cache: bool = False
    min_free_gb: float | None = None


def _paths(args: Args, host: HostContext) -> tuple[str, str]:
    store = str(setting(args.path, host, "model_store"))
    cache = str(setting(args.compile_cache, host, "compile_cache"))
    return store, cache


def _bad_path(p: str) -> str | None:
    if not (p.startswith("/") or p.startswith("~/")) or "\0" in p or "\n" in p or p.rstrip("/") in ("", "~"):
        return f"{p!r} must be an absolute path or start with ~/ (and not be / or ~ itself)"
    return None


class StorePaths(TypedDict):
    hf_home: str
    compile_cache: str
    free_bytes: int | None
    container: dict[str, Any]   # env and mounts a serving container gets for them


STORE_PATHS: Export[StorePaths] = Export("model_store", StorePaths, "where the model store and compile cache are")


class ModelStoreModule(Module):
    name = "model_store"
    Args = Args
    doc = "HF_HOME store (hub layout) and compile cache owned by the login user; root-owned leftovers fixed; free space."

    def needs(self, args: Args, host: HostContext):
        store, cache = _paths(args, host)
        return {"store": OwnedTree(store, host.user, ("hub",)), "cache": OwnedTree(cache, host.user)}

    def plan(self, args: Args, facts: FactView, host: HostContext) -> Plan:
        store_arg, cache_arg = _paths(args, host)
        bad = _bad_path(store_arg) or _bad_path(cache_arg)
        if bad:
            return Plan.fail(f"{host.name}: {bad}")
        user = host.user
        sfact, cfact = facts.fact("store"), facts.fact("cache")
        store, cache = facts.store, facts.cache
        spath, cpath = host.path(store_arg), host.path(cache_arg)
        changes: list[Change] = []
        for label, path, st, fact, subs in (("model store (HF_HOME)", spath, store, sfact, ["hub"]),
                                            ("compile cache", cpath, cache, cfact, [])):
            if st["exists"] and st["type"] != "directory":
                return Plan.fail(f"{host.name}: {path} exists and is not a directory; move it away for the {label}")
            if not st["exists"]:
                dirs = [path] + [f"{path}/{s}" for s in subs]
                script = "\n".join([cmd("mkdir", "-p", "--", *dirs), cmd("chown", f"{user}:", "--", *dirs),
                                    cmd("chmod", "0755", "--", *dirs)])
                changes.append(Change(f"create the {label} {path}" + (" with hub/" if subs else ""), script,
                                      Diff(path, "absent\n", f"directory owner={user} mode=0755\n"), [fact]))
                continue
            missing = [s for s in subs if s not in st["subdirs"]]
            if missing:
                dirs = [f"{path}/{s}" for s in missing]
                changes.append(Change(f"create {', '.join(dirs)} (hub layout)",
                                      "\n".join([cmd("mkdir", "-p", "--", *dirs), cmd("chown", f"{user}:", "--", *dirs)]),
                                      Diff(path, "no hub/\n", "hub/\n"), [fact]))
            if st["foreign_count"]:
                listing = "".join(f"{f}\n" for f in st["foreign"]) + ("...\n" if st["foreign_count"] > len(st["foreign"]) else "")
                if not args.fix_ownership:
                    return Plan.fail(f"{host.name}: {st['foreign_count']} entries in {path} are not owned by {user} "
                                     f"(e.g. {st['foreign'][0] if st['foreign'] else '?'}): a root container downloaded "
                                     f"into the store (G23). Fix: sudo chown -R {user}: {path}, and pre-stage as the user")
                changes.append(Change(f"{path}: give {st['foreign_count']} entries owned by others back to {user} (G23)",
                                      cmd("chown", "-R", "-h", f"{user}:", "--", path),
                                      Diff(f"{path} (owners)", listing, f"all owned by {user}\n"), [fact]))
        if args.clear_compile_cache and cache.get("entries"):
            changes.append(Change(f"clear the compile cache {cpath} ({cache['entries']} entries, {gib(cache.get('size'))}) (G25)",
                                  cmd("find", cpath, "-mindepth", "1", "-delete"),
                                  Diff(cpath, f"{cache['entries']} entries\n", "empty\n"), [cfact]))
        free = store.get("free")
        if args.min_free_gb is not None and free is not None and free < args.min_free_gb * 2**30:
            return Plan.fail(f"{host.name}: {gib(free)} free on {store.get('mount')} for {spath}, need {args.min_free_gb} GiB")
        exports = STORE_PATHS({"hf_home": spath, "compile_cache": cpath, "free_bytes": free,
                               "container": {"env": {"HF_HOME": spath},
                                             "mounts": [f"{spath}:{spath}", f"{cpath}:{CONTAINER_CACHE}"]}})
        entries = cache.get("entries") or 0
        msg = (f"{spath}: HF_HOME (hub layout), owned by {user}, {gib(free)} free on {store.get('mount')}; "
               f"compile cache {cpath} -> {CONTAINER_CACHE} in containers ({entries} entries, {gib(cache.get('size') or 0)}"
               + ("; clear it after a vLLM upgrade, G25" if entries else "") + ")")
        return Plan(changes, msg=msg, exports=exports)
