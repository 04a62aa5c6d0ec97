"""`invoke plan MODEL`: every layout of a catalog model on N Sparks, with memory per node and the
one sparkprov would pick (the logic: sparkprov/catalog/layout_plan.py; this file parses and prints).

No host is contacted: the Sparks are the inventory's hosts (their vars host_memory_gib,
max_gpu_memory_utilization, other_services_gib, min_headroom_gib where set) or, without --hosts,
N identical Sparks with the GB10 constants of catalog/memory.py. Bench results are the JSON files
`invoke bench` stored on this machine.

catalog and data load inside the functions, not at the top (sparkprov/cli/command.py says why).
"""

from __future__ import annotations

import json as _json
import sys
from dataclasses import dataclass
from pathlib import Path

from invoke.exceptions import Exit

from sparkprov.cli.command import command
from sparkprov.cli.common import inventory_path, split_csv, user_errors
from sparkprov import inventory_vars as iv
from sparkprov.errors import InputError
from sparkprov.options import Choice, Excludes, Files, Flag, Hosts, Int, Needs, Text, common, option

DEFAULT_RESULTS = "~/.local/share/sparkprov/bench"
KV_SOURCES = {"measured": "as a note measured it", "layers": "from the layers' kinds, a full-length request's share",
              "unknown": "not known: the config's layer dimensions are not recorded"}


@dataclass
class PlanOptions:
    model: str = option("the catalog alias (see `invoke models`)", positional=True)
    hosts: str | None = option("the inventory hosts to plan for, comma-separated: tp x pp x dp equals their GPUs, "
                               "one per Spark (default: --sparks identical Sparks)", Hosts())
    inventory: str | None = common("inventory")
    sparks: int | None = option("without --hosts: plan for 1 to N identical Sparks (default 2)", Int(1, 64))
    concurrency: int | None = option("concurrent full-length requests the pool must hold (default: the recipe's "
                                     "--max-num-seqs, else 1)", Int(1, 4096))
    recipes: list[str] = option("a user recipe file merged over the catalog; repeat for several", Files())
    results: str | None = option("bench results folder (default ~/.local/share/sparkprov/bench, where `invoke "
                                 "bench` stores them)", Text())
    json: bool = option("print one JSON document instead of the table", Flag())
    topology: str | None = option("the fabric's topology: pair, mesh, ring or switch (default: the inventory's "
                                  "fabric_topology of the first --hosts host, else none: every layout the catalog "
                                  "allows)", Choice(iv.TOPOLOGIES))

    RULES = (Excludes("sparks", "hosts", "both say how many Sparks"),
             Needs("inventory", lambda o: o.hosts is not None, "--hosts", "the inventory is read only for their vars"))


@command(PlanOptions)
def plan(c, o: PlanOptions):
    """Every layout of a model on the Sparks (tp x pp, replicas): memory per node, and the one to pick and why."""
    from sparkprov.catalog.layout_plan import catalog_rules, figures_of, latest_bench, pick, plan_layouts
    from sparkprov.catalog.load import load_catalog

    with user_errors():
        results = o.results or DEFAULT_RESULTS
        if o.results is not None and not Path(results).expanduser().is_dir():
            raise InputError(f"--results {results!r} is not a folder", fix="name the folder `invoke bench --results` wrote "
                             f"(default {DEFAULT_RESULTS})")
        cat = load_catalog(o.recipes)
        recipe = cat.get(o.model)
        fleet, where, declared = _fleet(o.hosts, o.inventory, o.sparks or 2)
        topology = o.topology or declared
        figures = figures_of(recipe, cat)
        concurrency = o.concurrency or _max_num_seqs(recipe) or 1
        counts = [len(fleet)] if o.hosts is not None else list(range(1, len(fleet) + 1))
        bench = latest_bench(_bench_records(results), recipe.alias)
        plans = plan_layouts(figures, fleet, counts=counts, rules=catalog_rules(recipe, cat, topology, len(fleet)),
                             concurrency=concurrency, bench=bench)
        chosen = pick(plans, concurrency)
    if o.json:
        print(_json.dumps({"model": recipe.alias, "sparks": [s.name for s in fleet], "from": where,
                          "concurrency": concurrency, "kv_source": figures.kv_source, "topology": topology,
                          "layouts": [p.as_dict() for p in plans],
                          "pick": chosen.plan.as_dict() if chosen.plan else None, "why": chosen.why,
                          "rule": list(chosen.rule)}, indent=2))
        if chosen.plan is None:
            raise Exit(code=2)
        return
    _print(recipe.alias, figures, fleet, where, concurrency, plans, chosen, topology)


def _max_num_seqs(recipe) -> int | None:
    f = recipe.flag("--max-num-seqs")
    try:
        return int(f.value) if f is not None and f.value is not None else None
    except (TypeError, ValueError):
        return None


def _fleet(hosts: str | None, inventory: str | None, count: int):
    """The Sparks to plan for: the inventory's hosts (their memory vars, no connection), or
    `count` identical ones."""
    from sparkprov.catalog.layout_plan import Spark

    if hosts is None:
        return [Spark(f"spark{i + 1}") for i in range(count)], "GB10 constants (catalog/memory.py), no inventory read", None
    from sparkprov.catalog.render import HostServeContext
    from sparkprov.data.inventory import load_inventory

    inv = load_inventory(inventory_path(inventory))
    names = inv.resolve(split_csv(hosts), where=("--hosts", None, None), what="--hosts")
    if not names:
        raise InputError(f"--hosts {hosts!r} selects no host of {inv.path}", fix="name hosts of the inventory")
    fleet = []
    for name in names:
        ctx = HostServeContext.from_host_vars(name, inv.host_vars(name), home="/home/nvidia")
        fleet.append(Spark(name, host_gib=ctx.host_memory_gib, utilization_cap=ctx.utilization_cap,
                           other_services_gib=ctx.other_services_gib, min_headroom_gib=ctx.min_headroom_gib))
    return (fleet, f"inventory {inv.path} (host vars and the GB10 constants; no host contacted)",
            iv.value(inv.host_vars(names[0]), "fabric_topology"))


def _bench_records(results: str) -> list[dict]:
    """The runs `invoke bench` stored (RESULTS/DEPLOYMENT/RECIPE_HASH/*.json, read and checked by
    serving/bench.py); a file that is not one is named on stderr and skipped."""
    from sparkprov.serving.bench import load_runs

    root = Path(results).expanduser()
    if not root.is_dir():
        return []
    runs, skipped = load_runs(sorted(root.glob("*/*/*.json"), reverse=True))
    for exc in skipped:
        print(f"sparkprov: skipped {exc.line()}", file=sys.stderr)
    return runs


def _num(v, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def _print(alias, figures, fleet, where, concurrency, plans, chosen, topology=None) -> None:
    bpt = figures.bytes_per_token
    print(f"{alias} on {', '.join(s.name for s in fleet)}: memory from {where}"
          + (f"; fabric topology {topology}" if topology else ""))
    print(f"  util {figures.utilization:.2f}, weights {_num(figures.weights_gib, '.1f')} GiB at runtime size, KV "
          f"{_num(bpt and bpt / 1024, '.1f')} KiB/token on one Spark ({KV_SOURCES[figures.kv_source]}), "
          f"--max-model-len {_num(figures.max_model_len, ',')}, concurrency {concurrency}")
    print()
    header = (f"{'layout':<22} {'sparks':>6}  {'budget':>7} {'weights':>8} {'KV pool':>8} {'tokens':>11}  "
              "verdict (per node: GiB; tokens: one engine)")
    print(header)
    for p in plans:
        n = min(p.nodes, key=lambda x: x.kv_pool_gib if x.kv_pool_gib is not None else float("inf"))
        verdict = []
        if p.refused:
            verdict.append(f"not allowed: {p.refused}")
        if p.does_not_fit:
            verdict.append(p.does_not_fit)
        if p.unverified:
            verdict.append(f"unverified: {p.unverified}")
        if all(x.measured for x in p.nodes):
            verdict.append("pool as measured")
        if p.fits:
            verdict.append("fits" + ("" if p.covers is None else
                                     f", covers {-(-concurrency // p.dp)} x {figures.max_model_len:,} per replica"
                                     if p.covers else f", does not cover {-(-concurrency // p.dp)} x "
                                     f"{figures.max_model_len:,} per replica"))
        print(f"{p.describe():<22} {p.sparks:>6}  {n.budget_gib:>7.1f} {_num(n.weights_gib, '>8.1f')} "
              f"{_num(n.kv_pool_gib, '>8.1f')} {_num(n.tokens, '>11,')}  {'; '.join(verdict)}")
        print(f"{'':<22} {'':>6}  run as: {p.options()} ({p.mode})")
        for row in (p.bench or {}).get("rows") or []:
            print(f"{'':<31}measured: concurrency {row.get('concurrency')}: {_num(row.get('output_throughput'), '.1f')} "
                  f"output tok/s, TTFT p50 {_num(row.get('ttft_p50_ms'), '.0f')} ms "
                  f"({p.bench.get('time')}, {p.bench.get('host')})")
    print()
    if chosen.plan is None:
        print(f"pick: none: {chosen.why}")
    else:
        print(f"pick: {chosen.plan.describe()} ({chosen.plan.options()}): {chosen.why}")
    print("rule:")
    for step in chosen.rule:
        print(f"  {step}")
    if chosen.plan is None:
        raise Exit(code=2)
