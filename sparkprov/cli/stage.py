"""`invoke stage-weights MODEL`: put a model's weights into the store of every serving host.

Plays on the engine (sparkprov/staging/plays.py): store check, download once, send, publish.
"""

from __future__ import annotations

import sys

STAGE_HELP = {
    "model": "Catalog alias (e.g. qwen3.5-122b) or a Hugging Face repo id ORG/NAME[@REVISION]",
    "hosts": "Hosts, groups or patterns to stage on, comma-separated (default: all in the inventory)",
    "inventory": "Inventory file (default: $SPARKPROV_INVENTORY, ./inventory.yaml, or the repo's)",
    "limit": "Further limit the selected hosts (pattern, e.g. 'spark2' or '!spark1')",
    "check": "Print the plan per host (what is missing, partial, unverified; bytes; free space) and transfer nothing",
    "rehash": "Hash every file again, even those recorded as verified with unchanged size and mtime",
    "json": "Print one JSON document at the end ({ok, hosts, results, stage}) instead of the recap",
    "source": "Host that downloads from the hub and feeds the others (default: the control machine when it is "
              "in the play, else the first host)",
    "streams": "Most rsync streams at once over the fabric, all receivers together (default 4)",
    "image": "Image that runs huggingface_hub on the downloading host (default: the recipe's serving image, "
             "else the inventory var stage_image)",
    "accept_new_host_keys": "Record host keys of hosts never seen before (a changed key is still refused)",
    "progress_interval": "Kept for scripts; the engine reports each step as it ends",
}


def stage_weights(c, model, hosts=None, inventory=None, limit=None, check=False, rehash=False, json=False, source=None,
                  streams=4, image=None, accept_new_host_keys=False, progress_interval=5.0, forks=None):
    """Stage a model's weights (and the recipe's extra files) into the model store of every host:
    download once, fan out over the fabric with rsync, verify sha256 everywhere."""
    from invoke.exceptions import Exit

    from sparkprov.cli.common import finish, inventory_path, print_report, select_hosts, user_errors
    from sparkprov.data.inventory import load_inventory
    from sparkprov.engine.report import Report
    from sparkprov.engine.run import DEFAULT_FORKS
    from sparkprov.plays.stage import StageOptions, run_stage

    try:
        streams = int(streams)
        float(progress_interval)
        forks = int(forks) if forks is not None else DEFAULT_FORKS
    except ValueError:
        raise Exit("sparkprov: --streams and --forks are whole numbers and --progress-interval a number of seconds",
                   code=1) from None
    if not 1 <= streams <= 64 or not 1 <= forks <= 1024:
        raise Exit("sparkprov: --streams must be between 1 and 64, --forks between 1 and 1024", code=1)
    out = sys.stderr if json else sys.stdout
    with user_errors():
        inv = load_inventory(inventory_path(inventory))
        targets = select_hosts(inv, hosts, limit)
        report = Report(out, quiet=json)
        summary = run_stage(inv, targets, model, StageOptions(check=check, rehash=rehash, source=source, streams=streams,
                                                              image=image, accept_new_host_keys=accept_new_host_keys,
                                                              forks=forks), report)
        src = summary["source"]
    print_report(report, json, stage=summary)
    if not json:
        print(f"\n{model}: {summary['files']} files, {_h(summary['bytes'])}; source {src}; "
              f"{summary['seconds']:.1f}s" + (" (check: nothing transferred)" if check else ""))
    finish(report.exit_code())


def _h(n: int) -> str:
    from sparkprov.staging.plan import human

    return human(n)
