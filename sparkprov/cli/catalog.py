"""Invoke tasks for the model catalog: `models`, `recipe`, `lint` (thin: parse, call, print)."""

from __future__ import annotations

import os
import sys

from invoke import Exit, task

from typing import TYPE_CHECKING

from sparkprov.errors import SparkprovError, one_line

if TYPE_CHECKING:  # annotations only; the catalog loads inside the tasks
    from sparkprov.catalog.load import Catalog
    from sparkprov.catalog.render import HostServeContext, Launch

# The catalog (pydantic models, YAML) loads inside the tasks: `invoke --list` stays instant.

RECIPES_HELP = "a user recipe file (YAML: images:, recipes:) merged over the catalog; repeat for several"
HOST_HELP = "render for this inventory host (its vars: model_store, serve_bind, api_key_file, fabric_ifaces, ...)"
INVENTORY_HELP = "inventory file for --host (default: $SPARKPROV_INVENTORY, ./inventory.yaml, or the repo's)"
TP_HELP = "tensor-parallel size: the number of Sparks (default: the smallest size the recipe supports)"
PP_HELP = "pipeline-parallel size (default 1): the engine spans tp x pp Sparks; every node's command (--executor)"
DP_HELP = ("data-parallel replicas (default 1), one Spark each, behind rank 0's API (executor native): the "
           "deployment spans tp x pp x dp Sparks")
EP_HELP = "--enable-expert-parallel (MoE recipes; experts split over tp x dp)"


def _fail(exc: SparkprovError) -> Exit:
    return Exit(f"sparkprov: {exc.line()}", code=getattr(exc, "exit_code", 1))


def _catalog(recipes) -> Catalog:
    from sparkprov.catalog.load import load_catalog

    return load_catalog(list(recipes or []))


def _inventory(option: str | None) -> str:
    """The inventory --host and --hosts read: the one every command reads (cli/common.py inventory_path)."""
    from sparkprov.cli.common import inventory_path

    return inventory_path(option)


def _ctx(host: str | None, inventory: str | None, tp: int) -> HostServeContext:
    from sparkprov.catalog.render import HostServeContext

    if not host:
        return HostServeContext(cluster_size=None)
    from sparkprov.data.inventory import load_inventory

    path = _inventory(inventory)
    inv = load_inventory(path)
    if host not in inv.hosts:
        names = inv.resolve(host, what="--host")  # raises a one-line error with a suggestion
        host = names[0]
    return HostServeContext.from_host_vars(host, inv.host_vars(host), home=_home(inv, host))


def _home(inv, host: str) -> str:
    """Without connecting, the usual home of the host's login user (cluster-up uses the real one)."""
    entry = inv.hosts[host]
    user = entry.user or ("root" if entry.connection == "local" else "nvidia")
    return "/root" if user == "root" else f"/home/{user}"


def _console():
    from rich.console import Console

    return Console(highlight=False, soft_wrap=False, width=max(100, int(os.environ.get("COLUMNS", "160"))))


@task(help={"recipes": RECIPES_HELP, "plain": "tab-separated output instead of a table (for scripts)"},
      iterable=["recipes"])
def models(c, recipes=None, plain=False):
    """List the model catalog: alias, repo, size, image, TP sizes and the source notes."""
    try:
        cat = _catalog(recipes)
    except SparkprovError as exc:
        raise _fail(exc)
    rows = []
    for r in cat.recipes.values():
        notes = sorted({r.source.note} | {f.source.note for f in r.args if f.source} - {"sparkprov"} or {r.source.note})
        rows.append((r.alias, r.model.repo, f"{r.size_gb:g} GB" if r.size_gb else "?", r.image,
                     ",".join(map(str, r.tp_sizes)), " ".join(notes), r.title))
    if plain:
        for row in rows:
            print("\t".join(row))
        return
    from rich.table import Table

    table = Table(title=f"sparkprov model catalog ({len(rows)} recipes)")
    for col in ("alias", "repo", "size", "image", "TP", "notes", "title"):
        table.add_column(col, overflow="fold")
    for row in rows:
        table.add_row(*row)
    _console().print(table)


def _print_launch(launch: Launch) -> None:
    from sparkprov.catalog.lint import plan_launch
    from sparkprov.catalog.render import shell_command
    from sparkprov.serving.spec import recipe_container

    from rich.table import Table

    con = _console()
    print(shell_command(recipe_container(launch).argv))
    print()
    t = Table(title="vLLM arguments", show_lines=False)
    for col in ("argument", "value", "from", "source"):
        t.add_column(col, overflow="fold")
    for a in launch.vllm_args:
        t.add_row(a.flag or "(model)", a.value if a.value is not None else "", a.origin, str(a.source))
    con.print(t)
    t = Table(title="environment")
    for col in ("name", "value", "from", "source"):
        t.add_column(col, overflow="fold")
    for e in launch.env:
        t.add_row(e.name, e.value, e.origin, str(e.source))
    con.print(t)
    t = Table(title="mounts")
    for col in ("host", "container", "mode", "purpose", "source"):
        t.add_column(col, overflow="fold")
    for m in launch.mounts:
        t.add_row(m.host, m.container, "ro" if m.read_only else "rw", m.purpose, str(m.source))
    con.print(t)
    t = Table(title="docker options")
    for col in ("option", "from", "source"):
        t.add_column(col, overflow="fold")
    for o in launch.docker_options:
        t.add_row(" ".join(o.words), o.origin, str(o.source))
    con.print(t)
    plan = plan_launch(launch)
    print(f"memory: {plan.summary()}")
    info = launch.image_info
    if info is not None:
        print(f"image: {info.ref}: vLLM {info.vllm or '?'}, digest {info.digest or 'unpinned'}, multi-node executors "
              f"{', '.join(info.executors) or 'none known'}")
    if launch.baked:
        print(f"derived image: {launch.image}: the recipe's {' '.join(launch.baked)} baked in once by cluster-up "
              "(wheels from the control machine; nothing installed at container start)")
    if launch.wrapped:
        print("entrypoint: sparkprov's sh wrapper (API key read from a mounted 0600 file into vLLM's environment)")
    for corr in launch.recipe.corrections:
        print(f"correction: {corr.what}: {corr.reason}")


@task(help={"alias": "the model alias (see `invoke models`), or `import` with --file", "tp": TP_HELP, "pp": PP_HELP,
            "dp": DP_HELP, "ep": EP_HELP,
            "host": HOST_HELP, "inventory": INVENTORY_HELP, "recipes": RECIPES_HELP,
            "argv": "print the docker argv as JSON (one list) instead of the annotated view",
            "systemd": "print the systemd unit of each node's container instead (the container in the foreground, "
                       "systemd restarting it; with --host, or --hosts for a layout over several Sparks)",
            "executor": "with --tp/--pp/--dp over several Sparks: every node's container, for executor ray (the "
                        "default with --pp) or native (the default with --dp)",
            "hosts": "with --executor: the inventory hosts of the cluster, rank 0 first (their fabric_ip, "
                     "fabric_ifaces, ib_hcas vars fill the command; without them it shows marked placeholders)",
            "file": "with `import`: a recipe of eugr/spark-vllm-docker or sparkrun/spark-pulse (recipe_version 2)",
            "out": "with `import`: the user recipe file to write (default: imported-ALIAS.yaml)",
            "name": "with `import`: the alias to give it (default: from the recipe's name)",
            "variant": "with `import`: a sparkrun variant to apply"},
      iterable=["recipes"])
def recipe(c, alias, tp=None, host=None, inventory=None, recipes=None, argv=False, file=None, out=None, name=None,
           variant=None, executor=None, hosts=None, pp=None, dp=None, ep=False, systemd=False):
    """Print the exact container command sparkprov would run, with every flag and where it came from.
    `invoke recipe import --file FILE` converts another tool's recipe into a user recipe and lints it."""
    if alias == "import":
        return recipe_import(c, file, out=out, name=name, variant=variant)
    from sparkprov.catalog.render import render_launch

    from sparkprov.catalog.layout import Layout, layout_of
    from sparkprov.cli.options import choice_option, int_option, positional

    try:
        positional("recipe", "alias", alias)
        tp = int_option("tp", tp, 1, 64)
        pp = int_option("pp", pp, 1, 64, default=1)
        dp = int_option("dp", dp, 1, 64, default=1)
        executor = choice_option("executor", executor, ("ray", "native"))
        if executor is not None or pp > 1 or dp > 1 or (tp or 1) > 1 and hosts:
            executor = executor or ("native" if dp > 1 else "ray")
            layout = Layout(tp or (1 if pp > 1 or dp > 1 else 2), pp, dp, bool(ep), executor)
            return _cluster_commands(alias, layout, hosts, inventory, recipes, argv, systemd)
        cat = _catalog(recipes)
        r = cat.get(alias)
        size = _tp_for(r, tp)
        layout_of(r, cat, Layout(size, ep=bool(ep)))
        if systemd:
            return _single_unit(alias, Layout(size, ep=bool(ep)), host, inventory, recipes)
        launch = render_launch(r, _ctx(host, inventory, size), size, catalog=cat, ep=bool(ep))
    except SparkprovError as exc:
        raise _fail(exc)
    if argv:
        import json

        from sparkprov.serving.spec import recipe_container

        print(json.dumps(recipe_container(launch).argv))
        return
    _print_launch(launch)


def _deployment_of(alias: str, layout, names: list[str], recipes):
    from sparkprov.serving.deployment import Deployment, default_name

    return Deployment(name=default_name(alias), model=alias, hosts=names or ["node0"],
                      tp=layout.tp, pp=layout.pp, dp=layout.dp, ep=layout.ep, executor=layout.executor,
                      recipe_files=list(recipes or []))


def _print_units(inv, specs) -> None:
    """Each container's systemd unit, under the path it goes to on its host."""
    from sparkprov.serving import systemd

    for h, s in specs:
        entry = inv.hosts[h]
        user = entry.user or ("root" if entry.connection == "local" else "nvidia")
        print(f"# {h}: {systemd.UNIT_DIR}/{systemd.unit_name(s)}")
        print(systemd.render(s, user=user, start_timeout_s=s.launch.startup.health_timeout_s))


def _single_unit(alias, layout, host, inventory, recipes) -> None:
    """--systemd for one Spark: the unit of the single-node deployment of the alias on --host."""
    from sparkprov.data.inventory import load_inventory
    from sparkprov.errors import InputError
    from sparkprov.serving import node

    if not host:
        raise _fail(InputError("--systemd renders the unit of a host's container", fix="--host H (an inventory host)"))
    inv = load_inventory(_inventory(inventory))
    host = inv.resolve(host, what="--host")[0]
    dep = _deployment_of(alias, layout, [host], recipes)
    launch = node.launch(dep, host, inv.host_vars(host), _home(inv, host), None, None)
    _print_units(inv, [(host, node.container(dep, host, launch, None, foreground=True))])


def _tp_for(r, tp: int | None) -> int:
    """--tp as given, if the recipe runs at it (G35), else its smallest size."""
    if tp is None:
        return min(r.tp_sizes)
    if tp not in r.tp_sizes:
        from sparkprov.errors import InputError

        raise InputError(f"--tp {tp}: {r.alias} runs at tp {', '.join(map(str, r.tp_sizes))}",
                         fix=f"--tp {min(r.tp_sizes)}")
    return tp


def _cluster_commands(alias, layout, hosts, inventory, recipes, as_json, systemd=False) -> None:
    """Every node's exact `docker run` (or with `systemd` its unit) for a tp x pp x dp layout, built
    by the code cluster-up runs."""
    import json
    import shlex

    from sparkprov.catalog.derive import ray_requirement
    from sparkprov.catalog.layout import layout_of
    from sparkprov.errors import InputError
    from sparkprov.serving import node

    nodes = layout.nodes
    if nodes < 2 or nodes > 64:
        raise InputError(f"--executor needs tp x pp x dp from 2 to 64 Sparks, not {nodes}",
                         fix="--tp 2, --pp 2 or --dp 2")
    names = [h for h in (hosts or "").split(",") if h.strip()]
    dep = _deployment_of(alias, layout, names, recipes)
    cat = node.catalog_for(dep)
    layout_of(cat.get(alias), cat, layout, hosts=len(names) if names else None)  # the layout before the hosts
    if not names:  # no placeholder ever reaches a printed command: the addresses come from the inventory
        raise InputError(f"{layout.describe()} spans {nodes} Sparks: every node's command carries rank 0's fabric "
                         "address and its own", fix=f"--hosts with {nodes} inventory hosts, rank 0 first, whose "
                         "vars set fabric_ip and fabric_ifaces")
    from sparkprov.data.inventory import load_inventory

    inv = load_inventory(_inventory(inventory))
    names = inv.resolve(names, what="--hosts")
    host_vars = {h: inv.host_vars(h) for h in names}
    unset = [f"{h} ({', '.join(v for v in ('fabric_ip', 'fabric_ifaces') if not host_vars[h].get(v))})"
             for h in names if not (host_vars[h].get("fabric_ip") and host_vars[h].get("fabric_ifaces"))]
    if unset:
        raise InputError(f"no fabric address or interface in the inventory for {', '.join(unset)}: the commands "
                         "would bind the management LAN (G32)", fix="set fabric_ip and fabric_ifaces in the hosts' "
                         "vars (invoke provision --tags fabric brings the link up)")
    dep = dep.model_copy(update={"hosts": names})
    if node.derived_image(dep):
        dep = dep.model_copy(update={"image": node.derived_image(dep)})
    out = []
    for h in names:
        launch = node.launch(dep, h, host_vars[h], _home(inv, h), None, None)
        out.append((h, node.container(dep, h, launch, str(host_vars[names[0]]["fabric_ip"]), foreground=systemd)))
    if systemd:
        return _print_units(inv, out)
    if as_json:
        print(json.dumps({h: s.argv for h, s in out}))
        return
    print(f"# {layout.describe()} on {', '.join(names)}; cluster-up adds SPARKPROV_RANK0 (rank 0's container "
          "ID, known once it runs) to the other ranks")
    if dep.image and node.derived_requirements(dep) == [ray_requirement()]:
        print(f"# {node.image_ref(dep)} ships no Ray: cluster-up runs {dep.image}, derived from it once with Ray")
    elif dep.image:
        print(f"# cluster-up runs {dep.image}, derived once from {node.image_ref(dep)} with "
              f"{' '.join(node.derived_requirements(dep))} (nothing installed at container start)")
    for h, s in out:
        print(f"# rank {dep.rank(h)} on {h}: {s.name} ({s.role})")
        print(shlex.join(s.argv))


@task(help={"alias": "the model alias to lint, or `all` for every recipe (user files included)", "tp": TP_HELP,
            "host": HOST_HELP, "inventory": INVENTORY_HELP, "recipes": RECIPES_HELP,
            "colocate": "other aliases placed on the same host, comma-separated (G13 sums their memory)",
            "show_silenced": "also print warnings a recipe silenced with lint_ignore"},
      iterable=["recipes"], positional=["alias"])
def lint(c, alias, tp=None, host=None, inventory=None, recipes=None, colocate=None, show_silenced=False):
    """Preflight checks over the rendered launch: one line per finding; errors exit non-zero."""
    from sparkprov.catalog.knownflags import default_cache_dir
    from sparkprov.catalog.lint import errors, lint_launch
    from sparkprov.catalog.render import render_launch

    from sparkprov.cli.options import csv_option, int_option, positional

    try:
        positional("lint", "alias", alias)
        tp = int_option("tp", tp, 1, 64)
        colocate = ",".join(csv_option("colocate", colocate) or [])
        cat = _catalog(recipes)
        aliases = list(cat.recipes) if alias == "all" else [alias]
        findings = []
        for a in aliases:
            r = cat.get(a)
            size = _tp_for(r, tp) if alias != "all" else min(r.tp_sizes)
            ctx = _ctx(host, inventory, size)
            launch = render_launch(r, ctx, size, catalog=cat)
            others = []
            for o in [x.strip() for x in (colocate or "").split(",") if x.strip()]:
                ro = cat.get(o)
                others.append(render_launch(ro, ctx, min(ro.tp_sizes), catalog=cat))
            findings += lint_launch(launch, catalog=cat, colocated=others, flags_cache=str(default_cache_dir()))
    except SparkprovError as exc:
        raise _fail(exc)
    shown = [f for f in findings if show_silenced or not f.silenced]
    for f in shown:
        print(f.line())
    n_err, n_warn = len(errors(findings)), len([f for f in findings if f.severity == "WARNING" and not f.silenced])
    silenced = len([f for f in findings if f.silenced])
    summary = f"{len(aliases)} recipe(s): {n_err} error(s), {n_warn} warning(s)"
    if silenced:
        summary += f", {silenced} silenced"
    print(summary, file=sys.stderr)
    if n_err:
        raise Exit(code=1)


@task(help={"recipes": RECIPES_HELP, "plain": "tab-separated output instead of a table (for scripts)",
            "host": "resolve each image's tag to the digest it has on this inventory host (docker image inspect)",
            "inventory": INVENTORY_HELP,
            "pin": "with --host: write the resolved digests as a user recipe file (see --out)",
            "out": "the file --pin writes (default: images-pinned.yaml); load it with --recipes",
            "flags": "with --host: also ask each present image's vLLM for its options (`vllm serve --help=all`) "
                     "and cache them per digest on this machine (what lint checks flags against)"},
      iterable=["recipes"])
def images(c, recipes=None, plain=False, host=None, inventory=None, pin=False, out="images-pinned.yaml",
           flags=False):
    """List the catalog's images: vLLM version, digest, multi-node executors, Ray, flag set, recipes."""
    from sparkprov.catalog.images import image_rows
    from sparkprov.cli.options import OptionError, text_option
    from sparkprov.outputs import check_output_file

    try:
        if pin and not host:  # before the table: the error is the only line
            raise OptionError("--pin needs --host", fix="give --host HOST (the digests are the ones it pulled)")
        if pin:
            out_path = check_output_file("out", text_option("out", out), inputs=recipes or [])
        cat = _catalog(recipes)
    except SparkprovError as exc:
        raise _fail(exc)
    rows = image_rows(cat)
    resolved: dict[str, str] = {}
    if host:
        resolved = _resolve_on_host(cat, host, inventory, flags)
    cols = ("image", "vLLM", "digest", "executors", "ray", "gb10", "flag set", "recipes")
    if host:
        cols += (f"digest on {host}",)
    table_rows = [r.cells() + ((resolved.get(r.ref, "not present"),) if host else ()) for r in rows]
    if plain:
        for row in table_rows:
            print("\t".join(row))
    else:
        from rich.table import Table

        t = Table(title=f"sparkprov images ({len(rows)})")
        for col in cols:
            t.add_column(col, overflow="fold")
        for row in table_rows:
            t.add_row(*row)
        _console().print(t)
    if pin:
        from sparkprov.catalog.images import pinned_images_yaml
        from sparkprov.outputs import write_text_atomic

        try:
            write_text_atomic(out_path, pinned_images_yaml(cat, resolved, host=host))
        except OSError as exc:
            raise Exit(f"sparkprov: cannot write {out_path}: {exc.strerror or exc} (fix: give --out a file you can "
                       "write)", code=1) from None
        print(f"pinned {len(resolved)} image(s) into {out}; use it with --recipes {out}", file=sys.stderr)


def _resolve_on_host(cat: Catalog, host: str, inventory: str | None, flags: bool) -> dict[str, str]:
    """One play on the engine (image_flags): the digests the host's tags resolved to and, with
    --flags, each present image's own options cached on this machine."""
    import io

    from sparkprov.data.playbook import Playbook
    from sparkprov.data.inventory import load_inventory
    from sparkprov.engine.report import Report
    from sparkprov.engine.run import RunOptions
    from sparkprov.plays.book import play, run_book, task
    from sparkprov.modules.image_flags import IMAGE_FLAGS

    try:
        inv = load_inventory(_inventory(inventory))
        name = host if host in inv.hosts else inv.resolve(host, what="--host")[0]
        refs = list(cat.image_table)
        book = Playbook("images", [play("images", [name], [task(
            "image digests and options", "image_flags",
            {"images": refs, "ask": flags, "versions": {r: cat.image_table[r].vllm for r in refs}}, ("--host", None, None))])])
        report = Report(io.StringIO(), quiet=True)
        runner = run_book(inv, book, [name], RunOptions(), report)
    except SparkprovError as exc:
        raise _fail(exc)
    for r in report.results:
        if r.status in ("failed", "unreachable"):
            print(f"{name}: {r.msg}", file=sys.stderr)
        elif r.status == "changed" and flags:
            print(f"{name}: {r.msg}", file=sys.stderr)
    if report.exit_code():
        raise Exit(code=report.exit_code())
    return dict((IMAGE_FLAGS.read(runner.exports, name) or {}).get("digests") or {})


@task(help={"file": "a recipe of eugr/spark-vllm-docker or the recipe_version \"2\" YAML of sparkrun/spark-pulse",
            "out": "the user recipe file to write (default: imported-ALIAS.yaml)",
            "name": "the alias to give it (default: from the recipe's name)",
            "variant": "a sparkrun variant to apply (variants: in the file)"})
def recipe_import(c, file, out=None, name=None, variant=None):
    """Convert another tool's recipe into a sparkprov user recipe file and lint it with the G-rules:
    one line per finding (and per thing that did not carry over); errors exit non-zero.
    The file is written (atomically) only once the recipe loads over the catalog; a recipe with
    lint errors is written all the same (to be edited) and exits 1."""
    from sparkprov.catalog.importer import import_file, lint_imported
    from sparkprov.catalog.knownflags import default_cache_dir
    from sparkprov.catalog.lint import errors
    from sparkprov.cli.options import OptionError, text_option
    from sparkprov.outputs import check_output_file, write_text_atomic

    try:
        if file is None:
            raise OptionError("recipe import needs --file FILE",
                              fix="name a recipe of eugr/spark-vllm-docker or sparkrun (recipe_version 2)")
        file = text_option("file", file)
        name, variant, out = (text_option(k, v, max_len=256) for k, v in (("name", name), ("variant", variant),
                                                                           ("out", out)))
        if out is not None:  # before the input is read: a bad --out costs nothing
            check_output_file("out", out, inputs=[file])
        imp = import_file(file, alias=name, variant=variant)
        path = check_output_file("out", out or f"imported-{imp.alias}.yaml", inputs=[file])
        text = imp.yaml_text(str(file))
        launch, findings = lint_imported(text, imp.alias, path, flags_cache=str(default_cache_dir()))
        try:
            write_text_atomic(path, text)
        except OSError as exc:  # a full disk, a folder made read-only meanwhile
            raise SparkprovError(f"cannot write {path}: {exc.strerror or exc}",
                                 fix="give --out a file you can write") from None
    except SparkprovError as exc:
        raise _fail(exc)
    print(f"{file} ({imp.fmt}) -> {path}: recipe {imp.alias}", file=sys.stderr)
    for p in imp.problems:
        print(f"NOT IMPORTED {imp.alias}: {one_line(p)}")
    for f in findings:
        if not f.silenced:
            print(one_line(f.line()))
    n_err = len(errors(findings))
    n_warn = len([f for f in findings if f.severity == "WARNING" and not f.silenced])
    print(f"{imp.alias}: {n_err} error(s), {n_warn} warning(s), {len(imp.problems)} not imported; "
          f"use it with --recipes {path}", file=sys.stderr)
    if n_err:
        raise Exit(code=1)
