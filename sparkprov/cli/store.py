"""`invoke store`: what each host's model store holds, verified on demand, pruned of what no
deployment uses. Parses and prints; sparkprov/plays/store.py runs the play (the module
sparkprov/modules/store.py), so it has --check, --json, --limit, --forks, the recap and the exit codes
of every command.

data, plays, catalog, staging and rich load inside the functions, not at the top (sparkprov/cli/command.py
says why).
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass

from sparkprov.cli.command import command
from sparkprov.cli.common import finish, inventory_path, print_report, select_hosts, user_errors
from sparkprov.options import Excludes, Flag, OptionError, Text, Words, common, option

REPO_PATTERN = r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*"
SEPARATE = "are separate runs (verify first, then prune)"


@dataclass
class StoreOptions:
    hosts: str | None = common("hosts", "Hosts, groups or patterns to show, comma-separated (default: all in the "
                                        "inventory)")
    inventory: str | None = common("inventory")
    limit: str | None = common("limit")
    prune: list[str] | None = option("Remove these repos (ORG/NAME, comma-separated) from the store; one a "
                                     "deployment uses is refused",
                                     Words(pattern=REPO_PATTERN, allowed_text="repo ids ORG/NAME"))
    prune_unused: bool = option("Remove every repo no deployment uses, and the revisions no deployment uses of "
                                "the others (blobs a kept revision links to stay)", Flag())
    compile_cache: bool = option("Empty the compile cache (refused while a deployment runs on the host)", Flag())
    verify: str | None = option("Hash the blobs of MODEL (a catalog alias, ORG/NAME, or 'all') on every host "
                                "against their own names; record the good ones as verified, remove the bad ones "
                                "(stage-weights fetches them again); no hub needed", Text(max_len=256))
    check: bool = option("Say what would be removed, remove nothing", Flag())
    json: bool = common("json")
    forks: int = common("forks")
    accept_new_host_keys: bool = common("accept_new_host_keys")

    RULES = (Excludes("verify", "prune", SEPARATE), Excludes("verify", "prune_unused", SEPARATE),
             Excludes("verify", "compile_cache", SEPARATE))


@command(StoreOptions)
def store(c, o: StoreOptions):
    """Per host: each model in the store (revision, size, verified, in use by); --verify MODEL; prune what no deployment uses."""
    from sparkprov.data.inventory import load_inventory
    from sparkprov.engine.report import Report
    from sparkprov.plays.store import run_store, store_args

    out = sys.stderr if o.json else sys.stdout
    with user_errors():
        repos = o.prune or []
        for r in repos:
            if "--" in r or ".." in r:
                raise OptionError(f"--prune: {r!r} is not a repo id", fix="give ORG/NAME as the hub names it")
        inv = load_inventory(inventory_path(o.inventory))
        targets = select_hosts(inv, o.hosts, o.limit)
        report = Report(out, quiet=o.json)
        args = store_args(prune=repos, prune_unused=o.prune_unused, compile_cache=o.compile_cache,
                          verify=verify_repos(o.verify) if o.verify is not None else None)
        found = run_store(inv, targets, args, report, check=o.check, forks=o.forks,
                          accept_new_host_keys=o.accept_new_host_keys)
    if o.json:
        print_report(report, True, store=found)
    else:
        print_tables(found)
        report.recap()
    finish(report.exit_code())


def verify_repos(model: str) -> list[str]:
    """--verify: 'all' (every repo: []), ORG/NAME (every revision of it), or a catalog alias (its model and extra repos)."""
    from sparkprov.catalog.load import load_catalog

    if model == "all":
        return []
    if "/" in model:
        repo, at, revision = model.partition("@")
        if not re.fullmatch(REPO_PATTERN, repo) or "--" in repo or ".." in repo:
            raise OptionError(f"--verify {model!r} is not a repo id", fix="give ORG/NAME, a catalog alias or all")
        if at:  # the verify play hashes every revision of a repo: a revision would be silently dropped
            raise OptionError(f"--verify {model!r}: a revision ({revision!r}) cannot be chosen; --verify hashes the "
                              "blobs of every revision of the repo", fix=f"give --verify {repo}")
        return [repo]
    r = load_catalog().get(model)
    return list(dict.fromkeys([r.model.repo] + [x.repo for x in r.extra_repos] + [s.repo for s in r.stage]))


def print_tables(found: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    from sparkprov.staging.plan import human

    con = Console(highlight=False, width=160)
    for host, st in found.items():
        if not st:
            con.print(f"{host}: store not read (see the task's result)")
            continue
        t = Table(title=f"{host}: {st.get('store')}")
        for col in ("model", "revision@commit", "size", "verified", "in use by"):
            t.add_column(col)
        for r in st.get("repos") or []:
            revs = r["revisions"] or [None]
            for i, v in enumerate(revs):
                if v is None:
                    rev, size, ver, use = "-", human(r["size"]), f"{r['blobs_verified']}/{r['blobs']} blobs", ""
                else:
                    name = ",".join(v["refs"]) or "-"
                    rev = f"{name}@{v['commit'][:12]}"
                    size = human(v["size"])
                    ver = f"{v['verified']}/{v['files']}" + (f" ({v['missing']} missing)" if v["missing"] else "")
                    use = ", ".join(v["in_use"])
                t.add_row(r["repo"] if i == 0 else "", rev, size, ver, use)
            if len(revs) > 1:
                t.add_row("", "(all revisions)", human(r["size"]), f"{r['blobs_verified']}/{r['blobs']} blobs", "")
            if r.get("staging_leftovers"):
                t.add_row("", "(partial files in staging)", "", "", "")
        con.print(t)
        cc = st.get("compile_cache") or {}
        con.print(f"compile cache {cc.get('path')}: " + (f"{cc.get('entries')} entries, {human(cc.get('size') or 0)}"
                                                        if cc.get("exists") else "absent"))
        if not st.get("docker"):
            con.print(f"docker: {st.get('docker_error') or 'not reachable'} (no deployment shown as using the store)")
