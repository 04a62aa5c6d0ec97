"""`invoke gateway up|down`: one OpenAI endpoint in front of every deployment (LiteLLM's proxy,
sparkprov/serving/gateway.py). Parses and prints; sparkprov/plays/gateway.py runs the plays, so
they have --check, --json, --forks, the recap and exit codes.

data and plays load inside the task, not at the top: tasks.py imports every cli module, and
`invoke --list` stays fast.
"""

from __future__ import annotations

import sys

from invoke import task

from sparkprov.cli.common import engine_options, finish, inventory_path, print_report, select_hosts, user_errors
from sparkprov.cli.options import (address_option, choice_option, float_option, image_option, int_option,
                                   inventory_host_option, parse_forks, positional)
from sparkprov.defaults import DEFAULT_FORKS

HELP = {
    "action": "up (start or update the gateway) or down (remove it)",
    "host": "The host to run it on (default: where it runs now, else the inventory's gateway_host, "
            "else the first host)",
    "port": "Its port (default: its current one, else gateway_port, else 4000)",
    "image": "LiteLLM's proxy image (default: gateway_image in the inventory, else "
             "ghcr.io/berriai/litellm:main-stable; pin a digest for repeatable runs)",
    "bind": "The address it listens on (default 0.0.0.0)",
    "timeout": "Seconds to wait for it to answer (default 180)",
    "check": "Say what would change; change nothing",
    "json": "Print one JSON document ({ok, hosts, results, gateway}) instead of the recap",
    "hosts": "Hosts whose deployments it routes to, comma-separated (default: all in the inventory)",
    "inventory": "Inventory file (default: $SPARKPROV_INVENTORY, ./inventory.yaml, or the repo's)",
    "limit": "Further limit the hosts (pattern)",
    "forks": "How many hosts to work on at once (default 32)",
    "accept_new_host_keys": "Record host keys of hosts never seen before (a changed key is still refused)",
}


@task(help=HELP)
def gateway(c, action, host=None, port=None, image=None, bind=None, timeout=None, check=False, json=False,
            hosts=None, inventory=None, limit=None, forks=None, accept_new_host_keys=False):
    """Start, update (up) or remove (down) LiteLLM's proxy in front of every deployment, routing by model name."""
    from sparkprov.data.inventory import load_inventory
    from sparkprov.plays.gateway import converge

    out = sys.stderr if json else sys.stdout
    with user_errors():
        action = choice_option("action", positional("gateway", "action", action), ("up", "down"))
        port = int_option("port", port, 1, 65535)
        image = image_option("image", image, example="ghcr.io/berriai/litellm:main-stable")
        bind = address_option("bind", bind, example="0.0.0.0")
        timeout = float_option("timeout", timeout, 0, 3600, default=180.0, unit="seconds")
        forks = parse_forks(forks, DEFAULT_FORKS)
        inv = load_inventory(inventory_path(inventory))
        targets = select_hosts(inv, hosts, limit)
        host = inventory_host_option("host", host, inv)
        report, doc = converge(inv, targets, action, engine_options(check=check, forks=forks,
                                                                    accept_new_host_keys=accept_new_host_keys),
                               host=host, port=port, image=image, bind=bind, timeout=timeout, out=out, quiet=json)
    if json:
        print_report(report, True, gateway=doc)
    else:
        if report.exit_code() != 0:  # a failed play never reads as a gateway that serves
            print(f"gateway {action} failed: {report.first_failure()}", file=sys.stderr)
        elif doc.get("endpoint"):
            print(f"gateway {'would serve' if check else 'serves'} {doc['endpoint']} "
                  f"(models: {', '.join(doc['models']) or 'none yet'}; its key: {doc['master_key_file']})")
        elif doc.get("message"):
            print(doc["message"])
        report.recap()
    finish(report.exit_code())
