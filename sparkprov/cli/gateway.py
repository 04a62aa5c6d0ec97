"""`invoke gateway up|down`: one OpenAI endpoint in front of every deployment (LiteLLM's proxy,
sparkprov/serving/gateway.py). Both are plays on the engine: the status play finds the
deployments (as `invoke status` reads them), then the gateway plays (sparkprov/plays/serve.py
gateway_book) converge the proxy; so they have --check, --json, --forks, the recap and exit codes.
cluster-up and cluster-down call `refresh` after they changed something, so a running gateway's
routes follow the deployments.
"""

from __future__ import annotations

import sys

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


def gateway(c, action, host=None, port=None, image=None, bind=None, timeout=None, check=False, json=False,
            hosts=None, inventory=None, limit=None, forks=None, accept_new_host_keys=False):
    """Start, update (up) or remove (down) LiteLLM's proxy in front of every deployment, routing by model name."""
    from sparkprov.cli.common import finish, inventory_path, print_report, select_hosts, user_errors
    from sparkprov.cli.options import (address_option, choice_option, float_option, image_option, int_option,
                                       inventory_host_option, parse_forks, positional)
    from sparkprov.data.inventory import load_inventory
    from sparkprov.engine.run import DEFAULT_FORKS

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
        report, doc = converge(inv, targets, action, host=host, port=port, image=image, bind=bind, timeout=timeout,
                               check=check, forks=forks, accept_new_host_keys=accept_new_host_keys, out=out,
                               quiet=json)
    if json:
        print_report(report, True, gateway=doc)
    else:
        if report.exit_code() != 0:  # a failed play never reads as a gateway that serves
            bad = next((r.msg for r in report.results if r.status in ("failed", "unreachable")), "")
            print(f"gateway {action} failed: {bad}", file=sys.stderr)
        elif doc.get("endpoint"):
            print(f"gateway {'would serve' if check else 'serves'} {doc['endpoint']} "
                  f"(models: {', '.join(doc['models']) or 'none yet'}; its key: {doc['master_key_file']})")
        elif doc.get("message"):
            print(doc["message"])
        report.recap()
    finish(report.exit_code())


def converge(inv, targets, action, *, host=None, port=None, image=None, bind=None, timeout=180.0, check=False,
             forks=None, accept_new_host_keys=False, out=None, quiet=False, only_if_running=False):
    """The status play, then the gateway plays. (report, summary). only_if_running: do nothing
    where no gateway runs (cluster-up/down keeping its routes current)."""
    import io

    from sparkprov.cli.common import engine_options
    from sparkprov.engine.report import Report
    from sparkprov.errors import SparkprovError
    from sparkprov.plays import serve as plays
    from sparkprov.serving import gateway as gw

    everyone = list(dict.fromkeys(list(targets) + [h for h in ([host] if host else [])]))
    st, _ = plays.read_status(inv, everyone, engine_options(forks=forks, accept_new_host_keys=accept_new_host_keys))
    report = Report(out if out is not None else io.StringIO(), quiet=quiet)
    blind = [h for h in everyone if not st[h]["reachable"] or not st[h]["docker"]]
    current = gw.running_gateway(st)
    if only_if_running and current is None:
        return report, {}
    if blind:
        # a host whose containers could not be read would lose its routes (or hide the gateway)
        err = SparkprovError(f"the deployments on {', '.join(blind)} are unknown ("
                             + "; ".join(f"{h}: {st[h].get('error') or 'docker not reachable'}" for h in blind)
                             + "): the gateway was not changed", fix="bring the host back, or leave it out with --limit")
        err.exit_code = 4 if any(not st[h]["reachable"] for h in blind) else 2  # the engine's codes
        raise err
    where = host or (current or {}).get("host") or inv.hosts[targets[0]].vars.get("gateway_host") or targets[0]
    if where not in inv.hosts:
        raise SparkprovError(f"gateway_host {where!r} is not a host of {inv.path}", fix="name a host of the inventory")
    options = engine_options(check=check, forks=forks, accept_new_host_keys=accept_new_host_keys)
    if action == "down":
        if current is None:
            return report, {"message": "no gateway runs on " + ", ".join(everyone)}
        plays.run_book(inv, plays.gateway_down_book(current["host"]), [current["host"]], options, report)
        return report, {"removed": current["host"], "message": f"gateway on {current['host']} "
                        + ("would be removed" if check else "removed")}
    if current and current["host"] != where:
        raise SparkprovError(f"the gateway runs on {current['host']}, not {where}",
                             fix="invoke gateway down first, or leave out --host")
    hv = inv.hosts[where].vars
    args = {"image": image or (current or {}).get("image") or hv.get("gateway_image") or gw.IMAGE,
            "port": port or (current or {}).get("port") or int(hv.get("gateway_port") or gw.PORT),
            "bind": bind or (current or {}).get("bind") or "0.0.0.0", "timeout": timeout}
    addresses = {h: inv.hosts[h].address for h in everyone}
    routes = gw.routes_from_status({h: st[h] for h in everyone}, addresses)
    runner = plays.run_book(inv, plays.gateway_book(where, routes, **args),
                            sorted({where} | {r["host"] for r in routes}), options, report)
    ep = (runner.exports.get(where) or {}).get("gateway") or {}
    bind_at = args["bind"] if args["bind"] not in ("0.0.0.0", "::") else inv.hosts[where].address
    return report, {"host": where, "endpoint": f"http://{bind_at}:{args['port']}/v1", "image": args["image"],
                    "models": ep.get("models") or sorted({r["model"] for r in routes}),
                    "routes": [{k: r[k] for k in ("model", "deployment", "host", "api_base")} for r in routes],
                    "master_key_file": f"{where}:{gw.DIR}/{gw.MASTER_KEY}", "check": bool(check)}


def refresh(inv, *, forks=None, accept_new_host_keys=False) -> str | None:
    """After cluster-up/down changed deployments: a running gateway's routes follow them. Returns
    a line for the command's summary (None: no gateway, nothing done)."""
    from sparkprov.errors import SparkprovError

    try:
        report, doc = converge(inv, list(inv.hosts), "up", forks=forks, accept_new_host_keys=accept_new_host_keys,
                               only_if_running=True)
    except SparkprovError as e:
        return f"gateway not updated: {e}"
    if not doc:
        return None
    if report.exit_code() != 0:
        bad = next((r.msg for r in report.results if r.status in ("failed", "unreachable")), "")
        return f"gateway not updated: {bad}"
    changed = any(r.status == "changed" for r in report.results if r.module == "gateway")
    return (f"gateway on {doc['host']}: routes {'updated' if changed else 'unchanged'} "
            f"({', '.join(doc['models']) or 'no deployment'})")
