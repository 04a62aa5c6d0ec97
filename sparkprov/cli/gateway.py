"""`invoke gateway up|down`: one OpenAI endpoint in front of every deployment (LiteLLM's proxy,
sparkprov/serving/gateway.py). Parses and prints; sparkprov/plays/gateway.py runs the plays, so
they have --check, --json, --forks, the recap and exit codes.

data and plays load inside the task, not at the top (sparkprov/cli/command.py says why).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from sparkprov.cli.command import command
from sparkprov.cli.common import engine_options, finish, inventory_path, print_report, select_hosts, user_errors
from sparkprov.options import (Address, Choice, Flag, Form, Image, Int, Number, Text, common, inventory_host_option,
                               option)


@dataclass
class GatewayOptions:
    action: str = option("up (start or update the gateway) or down (remove it)", Choice(("up", "down")),
                         positional=True)
    host: str | None = option("The host to run it on (default: where it runs now, else the inventory's "
                              "gateway_host, else the first host)", Text(max_len=256))
    port: int | None = option("Its port (default: its current one, else gateway_port, else 4000)", Int(1, 65535))
    image: str | None = option("LiteLLM's proxy image (default: gateway_image in the inventory, else "
                               "ghcr.io/berriai/litellm:main-stable; pin a digest for repeatable runs)",
                               Image(example="ghcr.io/berriai/litellm:main-stable"))
    bind: str | None = option("The address it listens on (default 0.0.0.0)", Address(example="0.0.0.0"))
    timeout: float = option("Seconds to wait for it to answer (default 180)", Number(0, 3600, unit="seconds"),
                            default=180.0)
    check: bool = option("Say what would change; change nothing", Flag())
    json: bool = common("json")
    hosts: str | None = common("hosts", "Hosts whose deployments it routes to, comma-separated (default: all in "
                                        "the inventory)")
    inventory: str | None = common("inventory")
    limit: str | None = common("limit")
    forks: int = common("forks")
    accept_new_host_keys: bool = common("accept_new_host_keys")

    # down removes the gateway wherever it runs: where and how it would run do not apply
    RULES = (Form("gateway down", lambda o: o.action == "down",
                  frozenset({"action", "check", "json", "hosts", "inventory", "limit", "forks",
                             "accept_new_host_keys"})),)


@command(GatewayOptions)
def gateway(c, o: GatewayOptions):
    """Start, update (up) or remove (down) LiteLLM's proxy in front of every deployment, routing by model name."""
    from sparkprov.data.inventory import load_inventory
    from sparkprov.plays.gateway import converge

    out = sys.stderr if o.json else sys.stdout
    action, check = o.action, o.check
    with user_errors():
        inv = load_inventory(inventory_path(o.inventory))
        targets = select_hosts(inv, o.hosts, o.limit)
        host = inventory_host_option("host", o.host, inv)
        report, doc = converge(inv, targets, action, engine_options(o), host=host, port=o.port, image=o.image,
                               bind=o.bind, timeout=o.timeout, out=out, quiet=o.json)
    if o.json:
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
