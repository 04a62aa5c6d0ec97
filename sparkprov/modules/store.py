"""store: the model store as something users manage (`invoke store`).

Reads the store in one script (staging/store.py: every hub/models--*/ repo with its refs, snapshots,
blobs and sparkprov's verified record; the compile cache's size) and sparkprov's containers
(ManagedContainers: each one's recipe alias, mapped through the catalog to the repos and revision
it serves from). A container that exists counts, running or not: with its restart policy it comes
back after a reboot and needs its weights then.

    action: list    changes nothing; exports and reports per repo: revisions with commits, size,
                    verified files, which deployments use it
    action: prune   prune: [ORG/NAME, ...]  removes those repos whole (and their staging leftovers);
                    a repo a deployment uses is a failed task naming the deployment;
                    unused: true  removes every repo no deployment uses, and of the repos in use
                    the revisions no deployment uses (a blob a kept snapshot links to stays);
                    compile_cache: true  empties the compile cache, never while a deployment runs
                    on the host.
    action: verify  hashes every blob of the `verify` repos (all: every repo) against its own name,
                    records the good ones as verified, removes the bad ones (a failed task names
                    them); no hub needed.

Exports `store`: {store, repos: [...], compile_cache: {...}, docker}.
"""

from __future__ import annotations

import re
from functools import lru_cache
from typing import Any, Literal, TypedDict

from pydantic import Field, field_validator

from sparkprov import inventory_vars as iv
from sparkprov.facts.serving import ManagedContainers
from sparkprov.modules.base import Change, Diff, Export, FactView, HostContext, Module, ModuleArgs, Plan
from sparkprov.staging import verify
from sparkprov.staging.plan import Item, human
from sparkprov.staging.store import (COMMIT, Removal, StoreContents, StoreContentsFact, removal_revisions,
                                     removal_script, removal_whole, summarize, valid_repo_id)
from sparkprov.transport.shell import cmd

RUNNING = ("running", "restarting")
SHA256 = re.compile(r"[0-9a-f]{64}")


class Args(ModuleArgs):
    action: Literal["list", "prune", "verify"] = "list"
    verify: list[str] = Field(default_factory=list)  # repo ids to hash again (action verify; empty: every repo)
    prune: list[str] = Field(default_factory=list)  # repo ids to remove whole
    unused: bool = False                            # every repo (and revision) no deployment uses
    compile_cache: bool = False                     # empty the compile cache
    recipe_files: list[str] = Field(default_factory=list)  # user recipes the deployments were started with

    @field_validator("prune", "verify")
    @classmethod
    def _repos(cls, v):
        for r in v:
            if not valid_repo_id(r):
                raise ValueError(f"{r!r} is not a repo id ORG/NAME")
        return v


@lru_cache(maxsize=8)
def _catalog(files: tuple[str, ...]):
    from sparkprov.catalog.load import load_catalog

    return load_catalog(list(files))


def uses(containers: list[dict[str, Any]], recipe_files: tuple[str, ...] = ()) -> tuple[dict[str, list[dict]], list[str]]:
    """repo -> [{deployment, container, state, revision}] for every sparkprov container with a recipe;
    and the containers whose repos cannot be told (a recipe the catalog does not know)."""
    out: dict[str, list[dict]] = {}
    unknown: list[str] = []
    for c in containers:
        labels = c["labels"]
        alias = labels.get("sparkprov.recipe")
        if not alias:
            continue  # not a serving container (nccl-check)
        use = {"deployment": labels.get("sparkprov.deployment") or c["name"], "container": c["name"],
               "state": c.get("status", "")}
        repos: list[tuple[str, str | None]] = []
        try:
            r = _catalog(tuple(recipe_files)).recipes.get(alias)
        except Exception:  # a recipe file that no longer loads: the alias cannot be resolved
            r = None
        if r is not None:
            repos = [(r.model.repo, r.model.revision)] + [(x.repo, x.revision) for x in r.extra_repos]
            repos += [(s.repo, s.revision) for s in r.stage]
        elif "/" in (labels.get("sparkprov.model") or ""):
            repos = [(labels["sparkprov.model"], None)]
        else:
            unknown.append(f"{c['name']} (deployment {use['deployment']}, recipe {alias})")
            continue
        for repo, rev in dict.fromkeys(repos):
            out.setdefault(repo, []).append({**use, "revision": rev})
    return out, unknown


def _commit(sc: StoreContents, repo: str, revision: str | None) -> str | None:
    """The commit a revision means on this host (None: cannot tell, so every revision is kept)."""
    if revision is None:
        return None
    if COMMIT.fullmatch(revision):
        return revision
    rc = sc.repos.get(repo)
    return (rc.refs.get(revision) or rc.refs.get(revision.removeprefix("refs/"))) if rc else None


def _who(users: list[dict]) -> str:
    return ", ".join(sorted({f"{u['deployment']} ({u['state']})" for u in users}))


def report(sc: StoreContents, used: dict[str, list[dict]]) -> list[dict[str, Any]]:
    rows = []
    for repo in sorted(sc.repos):
        s = summarize(sc, sc.repos[repo])
        users = used.get(repo, [])
        commits = {_commit(sc, repo, u["revision"]) for u in users}
        s["in_use"] = sorted({u["deployment"] for u in users})
        s["users"] = users
        for rev in s["revisions"]:
            rev["in_use"] = sorted({u["deployment"] for u in users
                                    if None in commits or _commit(sc, repo, u["revision"]) == rev["commit"]})
        rows.append(s)
    return rows


class StoreListing(TypedDict):
    store: str
    repos: list[dict[str, Any]]     # per repo: revisions with commits, size, verified, in use by
    compile_cache: dict[str, Any]
    docker: bool                    # False: no deployment could be read as using the store
    docker_error: str | None


STORE_CONTENTS: Export[StoreListing] = Export("store", StoreListing, "what the model store holds, and who uses it")


class Store(Module):
    name = "store"
    Args = Args
    doc = "List the model store (repos, revisions, size, verified, in use); prune unused repos, revisions, compile cache."

    def needs(self, args: Args, host: HostContext):
        return {"store": StoreContentsFact(iv.value(host.vars, "model_store"),
                                           iv.value(host.vars, "compile_cache")),
                "containers": ManagedContainers()}

    def plan(self, args: Args, facts: FactView, host: HostContext) -> Plan:
        sc: StoreContents = facts.store
        cont = facts.containers
        warnings: list[str] = []
        if cont["access"]:
            containers = cont["containers"]
        else:
            containers = []
            err = cont.get("error") or ""
            if sc.docker and "daemon" not in err.lower():
                # docker is there but will not say what runs (permission): nothing can be proven unused
                if args.action == "prune":
                    return Plan.fail(f"{host.name}: cannot tell which deployments use the store: docker: {err}",
                                     exports=self._exports(sc, {}, cont))
                warnings.append(f"docker: {err}: deployments using the store are not shown")
            elif sc.docker:
                warnings.append(f"the docker daemon is not running ({err}): no deployment runs on {host.name}")
        used, unknown = uses(containers, tuple(args.recipe_files))
        exports = self._exports(sc, used, cont)
        rows = STORE_CONTENTS.of(exports)["repos"]
        total = sum(r["size"] for r in rows)
        cache = sc.cache
        msg = (f"{len(rows)} models, {human(total)} in {sc.store}; compile cache "
               + (f"{cache.get('path')}: {cache.get('entries')} entries, {human(cache.get('size') or 0)}"
                  if cache.get("exists") else f"{cache.get('path')}: absent"))
        if args.action == "list":
            if unknown:
                warnings.append("containers whose repos the catalog cannot tell: " + ", ".join(unknown))
            return Plan(msg=msg, warnings=warnings, exports=exports)
        if args.action == "verify":
            return self._verify(args, sc, facts.fact("store"), msg, warnings, exports)
        if unknown and (args.prune or args.unused):
            return Plan.fail(f"{host.name}: cannot tell which repos these sparkprov containers use: "
                             + ", ".join(unknown) + " (pass the recipe files they were started with, or remove them "
                             "with invoke cluster-down first)", exports=exports)
        removals: list[Removal] = []
        refused: list[str] = []
        for repo in args.prune:
            rc = sc.repos.get(repo)
            if repo in used:
                refused.append(f"{repo} is in use by {_who(used[repo])}")
            elif rc is not None:
                removals.append(removal_whole(rc))
        if refused:
            deps = sorted({u["deployment"] for r in args.prune for u in used.get(r, [])})
            return Plan.fail(f"{host.name}: not pruned: " + "; ".join(refused)
                             + f" (stop it first: invoke cluster-down --deployments {','.join(deps)})", exports=exports)
        if args.unused:
            removals += _unused(sc, used, args.prune)
        changes: list[Change] = []
        fact = facts.fact("store")
        if removals:
            changes.append(_removal(host.name, sc, rows, removals, fact))
        if args.compile_cache:
            running = [c for c in containers if c.get("status") in RUNNING and c["labels"].get("sparkprov.recipe")]
            if running:
                deps = sorted({c["labels"].get("sparkprov.deployment") or c["name"] for c in running})
                return Plan.fail(f"{host.name}: compile cache {cache.get('path')} not emptied: deployment "
                                 f"{', '.join(deps)} runs here (stop it first: invoke cluster-down --deployments "
                                 f"{','.join(deps)})", exports=exports)
            if cache.get("exists") and cache.get("entries"):
                changes.append(Change(f"empty the compile cache {cache['path']} ({cache['entries']} entries, "
                                      f"{human(cache.get('size') or 0)})",
                                      cmd("find", cache["path"], "-mindepth", "1", "-delete"),
                                      Diff(cache["path"], f"{cache['entries']} entries, {human(cache.get('size') or 0)}\n",
                                           "empty\n"), touches=[fact]))
        if not changes:
            msg = "nothing to prune; " + msg
        return Plan(changes, msg=msg, warnings=warnings, exports=exports)

    @staticmethod
    def _verify(args: Args, sc: StoreContents, fact, msg: str, warnings: list[str], exports: dict) -> Plan:
        """Hash every blob of the repos against its own name (sha256, or the git blob id of small
        files), record the good ones as verified.py does, remove the bad ones (stage-weights fetches
        them again). Not re-planned after (it would hash again): the outcome fails on a bad blob."""
        missing = [r for r in args.verify if r not in sc.repos]
        if missing:
            return Plan.fail(f"not in {sc.store}: {', '.join(missing)}", exports=exports)
        checks = []
        for repo in args.verify or sorted(sc.repos):
            rc = sc.repos[repo]
            for name, b in sorted(rc.blobs.items()):
                if COMMIT.fullmatch(name) or SHA256.fullmatch(name):
                    large = len(name) == 64
                    checks.append(verify.Check("published", Item(repo, "", "", name, b.size, "" if large else name,
                                                                 name if large else None, f"{rc.dir}/blobs/{name}")))
        if not checks:
            return Plan(msg="nothing to hash; " + msg, warnings=warnings, exports=exports)

        def outcome(out: str) -> str | None:
            bad = sorted(rel for rel, (good, _) in verify.parse(out).items() if not good)
            return (f"{len(bad)} blobs hashed wrong and were removed (restage with invoke stage-weights): "
                    + ", ".join(bad[:5])) if bad else None

        size = sum(c.item.size for c in checks)
        return Plan([Change(f"hash {len(checks)} blobs ({human(size)}) of {', '.join(args.verify) or 'every repo'}",
                            verify.script(sc.store, checks, parallel=4), touches=[fact], verify=False,
                            outcome=outcome, timeout=24 * 3600)], msg=msg, warnings=warnings, exports=exports)

    @staticmethod
    def _exports(sc: StoreContents, used: dict[str, list[dict]], cont: dict[str, Any]) -> dict[str, Any]:
        return STORE_CONTENTS({"store": sc.store, "repos": report(sc, used), "compile_cache": sc.cache,
                               "docker": bool(cont.get("access")), "docker_error": cont.get("error")})


def _unused(sc: StoreContents, used: dict, named: list[str]) -> list[Removal]:
    """What no deployment uses (besides the repos named to prune): a repo no container reads, and
    the revisions of a used repo that none of its containers runs."""
    out: list[Removal] = []
    for repo, rc in sorted(sc.repos.items()):
        if repo in named:
            continue
        if repo not in used:
            out.append(removal_whole(rc))
            continue
        keep = {_commit(sc, repo, u["revision"]) for u in used[repo]}
        if None not in keep:
            r = removal_revisions(rc, keep)
            if r is not None:
                out.append(r)
    return out


def _removal(host: str, sc: StoreContents, rows: list, removals: list[Removal], fact) -> Change:
    """The removals as one change, its diff the store's repos and revisions before and after."""
    freed = sum(r.bytes for r in removals)
    before = "".join(f"{r['repo']}: {human(r['size'])}, " + ", ".join(v["commit"][:12] for v in r["revisions"])
                     + "\n" for r in rows)
    gone = {r.repo: r for r in removals}
    after = ""
    for r in rows:
        rm = gone.get(r["repo"])
        if rm is None:
            after += before.splitlines(keepends=True)[rows.index(r)]
        elif not rm.whole:
            kept = [v for v in r["revisions"] if v["commit"] not in rm.commits]
            after += (f"{r['repo']}: {human(r['size'] - rm.bytes)}, "
                      + ", ".join(v["commit"][:12] for v in kept) + "\n")
    return Change(f"remove {', '.join(r.describe() for r in removals)} ({human(freed)})",
                  removal_script(sc.store, removals), Diff(f"{host}: {sc.store}/hub", before, after), touches=[fact])
