"""`invoke stage-weights MODEL`: put a model's weights into the store of every serving host.

The lead registers it in tasks.py:

    from sparkprov.cli.stage import STAGE_HELP
    @task(help=STAGE_HELP)
    def stage_weights(c, model, hosts=None, ...):
        from sparkprov.cli.stage import stage_weights as run
        run(c, model, hosts=hosts, ...)
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
    "progress_interval": "Seconds between plain progress lines when the output is not a terminal (default 5)",
}


def stage_weights(c, model, hosts=None, inventory=None, limit=None, check=False, rehash=False, json=False, source=None,
                  streams=4, image=None, accept_new_host_keys=False, progress_interval=5.0):
    """Stage a model's weights (and the recipe's extra files) into the model store of every host:
    download once, fan out over the fabric with rsync, verify sha256 everywhere."""
    from invoke.exceptions import Exit

    from sparkprov.cli.common import finish, inventory_path, print_report, select_hosts, user_errors
    from sparkprov.data.inventory import load_inventory
    from sparkprov.engine.report import Report
    from sparkprov.staging.transfer import StageOptions, run_stage

    try:
        streams = int(streams)
        progress_interval = float(progress_interval)
    except ValueError:
        raise Exit("sparkprov: --streams is a whole number and --progress-interval a number of seconds", code=1) from None
    if streams < 1 or streams > 64:
        raise Exit("sparkprov: --streams must be between 1 and 64", code=1)
    out = sys.stderr if json else sys.stdout
    with user_errors():
        inv = load_inventory(inventory_path(inventory))
        targets = select_hosts(inv, hosts, limit)
        report = Report(out, quiet=json)
        live = out.isatty() and not json
        options = StageOptions(check=check, rehash=rehash, source=source, streams=streams, image=image,
                               accept_new_host_keys=accept_new_host_keys, progress_stream=out, live=live,
                               progress_interval=progress_interval)
        summary = run_stage(inv, targets, model, options, report)
    print_report(report, json, stage=summary)
    if not json:
        s = summary
        print(f"\n{s['model']}: {s.get('files', 0)} files, {_h(s.get('bytes', 0))}; source {s['source']}; "
              f"{s.get('seconds', 0):.1f}s")
    finish(report.exit_code())


def _h(n: int) -> str:
    from sparkprov.staging.plan import human

    return human(n)
