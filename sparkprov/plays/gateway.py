"""`invoke gateway up|down` on the engine: the status play finds the deployments (as `invoke status`
reads them), then the gateway plays (plays/serve.py gateway_book, gateway_down_book) converge
LiteLLM's proxy (serving/gateway.py) on one host. cluster-up's and cluster-down's plays
(plays/cluster.py) call `refresh` after they changed something, so that a running gateway's routes
follow the deployments."""

from __future__ import annotations

import dataclasses
import io
from typing import TextIO, TypedDict

from sparkprov import inventory_vars as iv
from sparkprov.data.inventory import Inventory
from sparkprov.engine.report import Report
from sparkprov.engine.run import RunOptions
from sparkprov.errors import SparkprovError
from sparkprov.modules.gateway import GATEWAY
from sparkprov.plays.book import run_book
from sparkprov.plays.fleet import refuse_unknown
from sparkprov.plays.serve import gateway_book, gateway_down_book, read_status
from sparkprov.serving import gateway as gw
from sparkprov.serving.address import reached_at


class GatewayRoute(TypedDict):
    model: str
    deployment: str
    host: str
    api_base: str
    on_demand: bool


class GatewaySummary(TypedDict, total=False):
    """What `invoke gateway` did, for its JSON document and its line: where it serves (up), or what
    was removed (down), or why nothing was done ({}: no gateway runs and only_if_running)."""
    host: str
    endpoint: str
    image: str
    models: list[str]
    routes: list[GatewayRoute]
    master_key_file: str          # HOST:PATH
    check: bool
    removed: str                  # down: the host it was removed from
    message: str                  # down: what was done


def converge(inv: Inventory, targets: list[str], action: str, options: RunOptions, *, host: str | None = None,
             port: int | None = None, image: str | None = None, bind: str | None = None, timeout: float = 180.0,
             out: TextIO | None = None, quiet: bool = False,
             only_if_running: bool = False) -> tuple[Report, GatewaySummary]:
    """The status play, then the gateway plays: (report, summary). `options.check` holds for the
    gateway plays (the status play only reads). only_if_running: do nothing where no gateway runs
    (cluster-up/down keeping its routes current)."""
    everyone = list(dict.fromkeys(list(targets) + ([host] if host else [])))
    report = Report(out if out is not None else io.StringIO(), quiet=quiet)
    st, _ = read_status(inv, everyone, dataclasses.replace(options, check=False))
    current = gw.running_gateway(st)
    if only_if_running and current is None:
        return report, {}
    # a host whose containers could not be read would lose its routes (or hide the gateway)
    refuse_unknown(st, consequence="the gateway was not changed")
    where = host or (current or {}).get("host") or iv.value(inv.hosts[targets[0]].vars, "gateway_host") or targets[0]
    if where not in inv.hosts:
        raise SparkprovError(f"gateway_host {where!r} is not a host of {inv.path}", fix="name a host of the inventory")
    check = options.check
    if action == "down":
        if current is None:
            return report, {"message": "no gateway runs on " + ", ".join(everyone)}
        key_hosts = down_key_hosts(st, everyone)
        run_book(inv, gateway_down_book(current["host"], key_hosts), sorted({current["host"], *key_hosts}), options,
                 report)
        return report, {"removed": current["host"], "message": f"gateway on {current['host']} "
                        + ("would be removed" if check else "removed")}
    if current and current["host"] != where:
        raise SparkprovError(f"the gateway runs on {current['host']}, not {where}",
                             fix="invoke gateway down first, or leave out --host")
    hv = inv.hosts[where].vars
    args = {"image": image or (current or {}).get("image") or iv.value(hv, "gateway_image"),
            "port": port or (current or {}).get("port") or iv.value(hv, "gateway_port"),
            "bind": bind or (current or {}).get("bind") or "0.0.0.0", "timeout": timeout}
    addresses = {h: inv.hosts[h].address for h in everyone}
    routes = gw.routes_from_status({h: st[h] for h in everyone}, addresses)
    ondemand = ondemand_args(inv, st, routes, where)
    if ondemand:
        args["ondemand"] = ondemand
    runner = run_book(inv, gateway_book(where, routes, **args), sorted({where} | {r["host"] for r in routes}),
                      options, report)
    bind_at = reached_at(args["bind"], inv.hosts[where].address)
    return report, {"host": where, "endpoint": f"http://{bind_at}:{args['port']}/v1", "image": args["image"],
                    "models": GATEWAY.entry(runner.exports, where, "models") or sorted({r["model"] for r in routes}),
                    "routes": [GatewayRoute(model=r["model"], deployment=r["deployment"], host=r["host"],
                                            api_base=r["api_base"], on_demand=r["on_demand"]) for r in routes],
                    "master_key_file": f"{where}:{gw.DIR}/{gw.MASTER_KEY}", "check": bool(check)}


def down_key_hosts(st: dict, hosts: list[str]) -> list[str]:
    """Where `gateway down` removes the on-demand key: every host it read, not only those holding an
    on-demand container now (one whose on-demand deployment was removed before keeps the key, which
    its guard would go on accepting); absent where there is none (no change there)."""
    return sorted(h for h in hosts if h in st)


def ondemand_args(inv: Inventory, st: dict, routes: list[gw.Route], gateway_host: str) -> dict | None:
    """What the gateway's hook needs of the hosts of on-demand routes (None: there are none): each
    one's guard address as the gateway's host reaches it (the guard's listening addresses, from the
    status play), the guards' port, each host's memory and on-demand budget (inventory). Refused
    before any host is changed where a guard cannot be reached."""
    hosts = sorted({r["host"] for r in routes if r["on_demand"]})
    if not hosts:
        return None
    ports = {iv.value(inv.hosts[h].vars, "guard_port") for h in hosts}
    if len(ports) > 1:
        raise SparkprovError(f"the guards of {', '.join(hosts)} listen on different ports ({sorted(ports)}): the "
                             "gateway reaches them on one", fix="give guard_port one value for these hosts")
    addresses = {}
    for h in hosts:
        guard = (st[h].get("host") or {}).get("guard") or {}
        at = gw.guard_address(h, gateway_host, guard.get("listen") or [])
        if at is None:
            raise SparkprovError(f"{h} holds an on-demand deployment, but its guard "
                                 + ("listens on loopback only" if guard.get("running") else "does not run")
                                 + f": the gateway on {gateway_host} cannot start it",
                                 fix=f"invoke provision --hosts {h} (the guard, on the fabric), or run the gateway "
                                     f"on {h}")
        addresses[h] = at
    host_gib = {h: float(iv.value(inv.hosts[h].vars, "host_memory_gib")) for h in hosts}
    budgets = gw.ondemand_budgets(st, hosts, host_gib,
                                  {h: float(iv.value(inv.hosts[h].vars, "min_headroom_gib")) for h in hosts},
                                  {h: iv.value(inv.hosts[h].vars, "ondemand_budget_gib") for h in hosts})
    return {"guard_port": ports.pop(), "addresses": addresses, "budgets_gib": budgets, "host_gib": host_gib}


def refresh(inv: Inventory, options: RunOptions) -> str | None:
    """After cluster-up/down changed deployments (plays/cluster.py): a running gateway's routes follow
    them. Returns a line for the command's summary (None: no gateway, nothing done)."""
    try:
        report, doc = converge(inv, list(inv.hosts), "up", options, only_if_running=True)
    except SparkprovError as e:
        return f"gateway not updated: {e}"
    if not doc:
        return None
    if report.exit_code() != 0:
        return f"gateway not updated: {report.first_failure()}"
    changed = any(r.status == "changed" for r in report.results if r.module == "gateway")
    return (f"gateway on {doc['host']}: routes {'updated' if changed else 'unchanged'} "
            f"({', '.join(doc['models']) or 'no deployment'})")
