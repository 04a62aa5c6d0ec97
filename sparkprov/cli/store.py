"""`invoke store`: what each host's model store holds, verified on demand, pruned of what no
deployment uses. Parses and prints; sparkprov/plays/store.py runs the play (the module
sparkprov/modules/store.py), so it has --check, --json, --limit, --forks, the recap and the exit codes
of every command.

data, plays, catalog, staging and rich load inside the functions, not at the top: tasks.py imports
every cli module, and `invoke --list` stays fast.
"""

from __future__ import annotations

import re
import sys

from invoke import task

from sparkprov.cli.common import finish, inventory_path, print_report, select_hosts, user_errors
from sparkprov.cli.options import OptionError, csv_option, parse_forks, text_option
from sparkprov.defaults import DEFAULT_FORKS

REPO_PATTERN = r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*"

HELP = {
    "hosts": "Hosts, groups or patterns to show, comma-separated (default: all in the inventory)",
    "inventory": "Inventory file (default: $SPARKPROV_INVENTORY, ./inventory.yaml, or the repo's)",
    "limit": "Further limit the hosts (pattern, e.g. 'spark2' or '!spark1')",
    "prune": "Remove these repos (ORG/NAME, comma-separated) from the store; one a deployment uses is refused",
    "prune_unused": "Remove every repo no deployment uses, and the revisions no deployment uses of the others "
                    "(blobs a kept revision links to stay)",
    "compile_cache": "Empty the compile cache (refused while a deployment runs on the host)",
    "verify": "Hash the blobs of MODEL (a catalog alias, ORG/NAME, or 'all') on every host against their own names; "
              "record the good ones as verified, remove the bad ones (stage-weights fetches them again); no hub needed",
    "check": "Say what would be removed, remove nothing",
    "json": "Print one JSON document ({ok, hosts, results, store}) instead of the tables and recap",
    "forks": "How many hosts to work on at once (default 32)",
    "accept_new_host_keys": "Record host keys of hosts never seen before (a changed key is still refused)",
}


@task(help=HELP)
def store(c, hosts=None, inventory=None, limit=None, prune=None, prune_unused=False, compile_cache=False,
          verify=None, check=False, json=False, forks=None, accept_new_host_keys=False):
    """Per host: each model in the store (revision, size, verified, in use by); --verify MODEL; prune what no deployment uses."""
    from sparkprov.data.inventory import load_inventory
    from sparkprov.engine.report import Report
    from sparkprov.plays.store import run_store, store_args

    out = sys.stderr if json else sys.stdout
    with user_errors():
        forks = parse_forks(forks, DEFAULT_FORKS)
        repos = csv_option("prune", prune, pattern=REPO_PATTERN, allowed_text="repo ids ORG/NAME") or []
        for r in repos:
            if "--" in r or ".." in r:
                raise OptionError(f"--prune: {r!r} is not a repo id", fix="give ORG/NAME as the hub names it")
        verify = text_option("verify", verify)
        if verify is not None and (repos or prune_unused or compile_cache):
            raise OptionError("--verify and pruning are separate runs", fix="give --verify MODEL alone, then prune")
        inv = load_inventory(inventory_path(inventory))
        targets = select_hosts(inv, hosts, limit)
        report = Report(out, quiet=json)
        args = store_args(prune=repos, prune_unused=prune_unused, compile_cache=compile_cache,
                          verify=verify_repos(verify) if verify is not None else None)
        found = run_store(inv, targets, args, report, check=check, forks=forks,
                          accept_new_host_keys=accept_new_host_keys)
    if json:
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
