"""Invoke tasks for the model catalog: `models`, `recipe`, `lint` (thin: parse, call, print)."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

from invoke import Exit

from sparkprov.cli.command import command
from sparkprov.cli.common import inventory_path
from sparkprov.errors import SparkprovError, one_line
from sparkprov.options import (Check, Choice, Excludes, Files, Flag, Form, Hosts, Int, Needs, Text, Words, common,
                               option)

if TYPE_CHECKING:  # annotations only; the catalog loads inside the tasks
    from sparkprov.catalog.load import Catalog
    from sparkprov.catalog.render import HostServeContext, Launch

# The catalog (pydantic models, YAML) loads inside the tasks: `invoke --list` stays instant.

RECIPES_HELP = "a user recipe file (YAML: images:, recipes:) merged over the catalog; repeat for several"
HOST_HELP = "render for this inventory host (its vars: model_store, serve_bind, api_key_file, fabric_ifaces, ...)"
TP_HELP = "tensor-parallel size: the number of Sparks (default: the smallest size the recipe supports)"
PLAIN_HELP = "tab-separated output instead of a table (for scripts)"
READS_VARS = "the inventory is read only for their vars"


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

    inv = load_inventory(inventory_path(inventory))
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


@dataclass
class ModelsOptions:
    recipes: list[str] = option(RECIPES_HELP, Files())
    plain: bool = option(PLAIN_HELP, Flag())


@command(ModelsOptions)
def models(c, o: ModelsOptions):
    """List the model catalog: alias, repo, size, image, TP sizes and the source notes."""
    try:
        cat = _catalog(o.recipes)
    except SparkprovError as exc:
        raise _fail(exc)
    rows = []
    for r in cat.recipes.values():
        notes = sorted({r.source.note} | {f.source.note for f in r.args if f.source} - {"sparkprov"} or {r.source.note})
        rows.append((r.alias, r.model.repo, f"{r.size_gb:g} GB" if r.size_gb else "?", r.image,
                     ",".join(map(str, r.tp_sizes)), " ".join(notes), r.title))
    if o.plain:
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


IMPORTS = frozenset({"alias", "file", "out", "name", "variant"})  # what `recipe import` reads


def _import_needs_file(o) -> tuple[str, str] | None:
    if o.alias == "import" and o.file is None:
        return ("recipe import needs --file FILE",
                "name a recipe of eugr/spark-vllm-docker, sparkrun, spark-pulse or NVIDIA's recipe catalog")
    return None


def _over_several(o) -> bool:
    """The layout spans several Sparks: every node's command, for the hosts --hosts names."""
    return o.executor is not None or o.pp > 1 or o.dp > 1 or (o.tp or 1) > 1


@dataclass
class RecipeOptions:
    alias: str = option("the model alias (see `invoke models`), or `import` with --file", positional=True)
    tp: int | None = option(TP_HELP, Int(1, 64))
    host: str | None = option(HOST_HELP, Text(max_len=256))
    inventory: str | None = common("inventory")
    recipes: list[str] = option(RECIPES_HELP, Files())
    argv: bool = option("print the docker argv as JSON (one list) instead of the annotated view", Flag())
    file: str | None = option("with `import`: a recipe of eugr/spark-vllm-docker, sparkrun, spark-pulse or NVIDIA's "
                              "recipe catalog (schema 3 or 4)")
    out: str | None = option("with `import`: the user recipe file to write (default: imported-ALIAS.yaml)")
    name: str | None = option("with `import`: the alias to give it (default: from the recipe's name)",
                              Text(max_len=256))
    variant: str | None = option("with `import`: a sparkrun variant to apply", Text(max_len=256))
    executor: str | None = option("with --tp/--pp/--dp over several Sparks: every node's container, for executor ray "
                                  "(the default with --pp) or native (the default with --dp)",
                                  Choice(("ray", "native")))
    hosts: str | None = option("with --tp/--pp/--dp over several Sparks: the inventory hosts of the cluster, rank 0 "
                               "first (their fabric_ip, fabric_ifaces, ib_hcas vars fill the commands)", Hosts())
    pp: int = option("pipeline-parallel size (default 1): the engine spans tp x pp Sparks; every node's command "
                     "(--executor)", Int(1, 64), default=1)
    dp: int = option("data-parallel replicas (default 1), one Spark each, behind rank 0's API (executor native): the "
                     "deployment spans tp x pp x dp Sparks", Int(1, 64), default=1)
    ep: bool = option("--enable-expert-parallel (MoE recipes; experts split over tp x dp)", Flag())
    systemd: bool = option("print the systemd unit of each node's container instead (the container in the "
                           "foreground, systemd restarting it; with --host, or --hosts for a layout over several "
                           "Sparks)", Flag())

    RULES = (Form("recipe import", lambda o: o.alias == "import", IMPORTS),
             *(Needs(f, lambda o: o.alias == "import", "`recipe import`", fix=f"leave out --{f}")
               for f in sorted(IMPORTS - {"alias"})),
             Check(_import_needs_file),
             Excludes("argv", "systemd", "both choose what is printed"),
             Excludes("host", "hosts", "are both given: --host renders one Spark's command, --hosts the nodes of a "
                                       "layout over several"),
             Needs("hosts", _over_several, "--tp, --pp or --dp above 1", "without them the layout is one Spark",
                   fix="give --tp N for N hosts, or --host H for one Spark"),
             Needs("inventory", lambda o: o.host is not None or o.hosts is not None, "--host or --hosts", READS_VARS))


@command(RecipeOptions)
def recipe(c, o: RecipeOptions):
    """Print the exact container command sparkprov would run, with every flag and where it came from.
    `invoke recipe import --file FILE` converts another tool's recipe into a user recipe and lints it."""
    if o.alias == "import":
        return recipe_import(c, o.file, out=o.out, name=o.name, variant=o.variant)
    from sparkprov.catalog.layout import Layout, layout_of
    from sparkprov.catalog.render import render_launch

    alias, tp, pp, dp, ep = o.alias, o.tp, o.pp, o.dp, o.ep
    try:
        if o.executor is not None or pp > 1 or dp > 1 or (tp or 1) > 1 and o.hosts:
            executor = o.executor or ("native" if dp > 1 else "ray")
            layout = Layout(tp or (1 if pp > 1 or dp > 1 else 2), pp, dp, ep, executor)
            return _cluster_commands(alias, layout, o.hosts, o.inventory, o.recipes, o.argv, o.systemd)
        cat = _catalog(o.recipes)
        r = cat.get(alias)
        size = _tp_for(r, tp)
        layout_of(r, cat, Layout(size, ep=ep))
        if o.systemd:
            return _single_unit(alias, Layout(size, ep=ep), o.host, o.inventory, o.recipes)
        launch = render_launch(r, _ctx(o.host, o.inventory, size), size, catalog=cat, ep=ep)
    except SparkprovError as exc:
        raise _fail(exc)
    if o.argv:
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
    inv = load_inventory(inventory_path(inventory))
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
    from sparkprov.catalog.layout import layout_of, unverified_executor
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
    from sparkprov import inventory_vars as iv
    from sparkprov.data.inventory import load_inventory

    inv = load_inventory(inventory_path(inventory))
    names = inv.resolve(names, what="--hosts")
    host_vars = {h: inv.host_vars(h) for h in names}
    unset = [f"{h} ({', '.join(v for v in ('fabric_ip', 'fabric_ifaces') if not iv.value(host_vars[h], v))})"
             for h in names if not (iv.value(host_vars[h], "fabric_ip") and iv.value(host_vars[h], "fabric_ifaces"))]
    if unset:
        raise InputError(f"no fabric address or interface in the inventory for {', '.join(unset)}: the commands "
                         "would bind the management LAN (G32)", fix="set fabric_ip and fabric_ifaces in the hosts' "
                         "vars (invoke provision --tags fabric brings the link up)")
    dep = dep.model_copy(update={"hosts": names})
    image = node.node_image(dep)
    out = []
    for h in names:
        launch = node.launch(dep, h, host_vars[h], _home(inv, h), None, None, image)
        out.append((h, node.container(dep, h, launch, iv.value(host_vars[names[0]], "fabric_ip"), foreground=systemd)))
    if systemd:
        return _print_units(inv, out)
    if as_json:
        print(json.dumps({h: s.argv for h, s in out}))
        return
    print(f"# {layout.describe()} on {', '.join(names)}; cluster-up adds SPARKPROV_RANK0 (rank 0's container "
          "ID, known once it runs) to the other ranks")
    unverified = unverified_executor(cat.image(cat.get(alias).image), layout)
    if unverified:
        print(f"# unverified: {unverified}")
    if image.derived and image.requirements == (ray_requirement(),):
        print(f"# {image.requested} ships no Ray: cluster-up runs {image.runs}, derived from it once with Ray")
    elif image.derived:
        print(f"# cluster-up runs {image.runs}, derived once from {image.requested} with "
              f"{' '.join(image.requirements)} (nothing installed at container start)")
    for h, s in out:
        print(f"# rank {dep.rank(h)} on {h}: {s.name} ({s.role})")
        print(shlex.join(s.argv))


@dataclass
class LintOptions:
    alias: str = option("the model alias to lint, or `all` for every recipe (user files included)", positional=True)
    tp: int | None = option(TP_HELP, Int(1, 64))
    host: str | None = option(HOST_HELP, Text(max_len=256))
    inventory: str | None = common("inventory")
    recipes: list[str] = option(RECIPES_HELP, Files())
    colocate: list[str] | None = option("other aliases placed on the same host, comma-separated (G13 sums their "
                                        "memory)", Words())
    show_silenced: bool = option("also print warnings a recipe silenced with lint_ignore", Flag())

    # `all` lints each recipe at its own smallest size
    RULES = (Needs("tp", lambda o: o.alias != "all", "one alias", "`lint all` lints each recipe at its smallest size",
                   fix="leave out --tp, or lint one alias"),
             Needs("inventory", lambda o: o.host is not None, "--host", READS_VARS))


@command(LintOptions)
def lint(c, o: LintOptions):
    """Preflight checks over the rendered launch: one line per finding; errors exit non-zero."""
    from sparkprov.catalog.knownflags import default_cache_dir
    from sparkprov.catalog.lint import errors, lint_launch
    from sparkprov.catalog.render import render_launch

    try:
        cat = _catalog(o.recipes)
        aliases = list(cat.recipes) if o.alias == "all" else [o.alias]
        findings = []
        for a in aliases:
            r = cat.get(a)
            size = _tp_for(r, o.tp) if o.alias != "all" else min(r.tp_sizes)
            ctx = _ctx(o.host, o.inventory, size)
            launch = render_launch(r, ctx, size, catalog=cat)
            others = []
            for other in o.colocate or []:
                ro = cat.get(other)
                others.append(render_launch(ro, ctx, min(ro.tp_sizes), catalog=cat))
            findings += lint_launch(launch, catalog=cat, colocated=others, flags_cache=str(default_cache_dir()))
    except SparkprovError as exc:
        raise _fail(exc)
    shown = [f for f in findings if o.show_silenced or not f.silenced]
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


@dataclass
class ImagesOptions:
    recipes: list[str] = option(RECIPES_HELP, Files())
    plain: bool = option(PLAIN_HELP, Flag())
    host: str | None = option("resolve each image's tag to the digest it has on this inventory host (docker image "
                              "inspect)", Text(max_len=256))
    inventory: str | None = common("inventory")
    pin: bool = option("with --host: write the resolved digests as a user recipe file (see --out)", Flag())
    out: str = option("with --pin: the file it writes (default: images-pinned.yaml); load it with --recipes",
                      default="images-pinned.yaml")
    flags: bool = option("with --host: also ask each present image's vLLM for its options (`vllm serve --help=all`) "
                         "and cache them per digest on this machine (what lint checks flags against)", Flag())

    RULES = (Needs("pin", lambda o: o.host is not None, "--host", fix="give --host HOST (the digests are the ones it "
                                                                      "pulled)"),
             Needs("out", lambda o: o.pin, "--pin"),
             Needs("flags", lambda o: o.host is not None, "--host"),
             Needs("inventory", lambda o: o.host is not None, "--host", READS_VARS))


@command(ImagesOptions)
def images(c, o: ImagesOptions):
    """List the catalog's images: vLLM version, digest, multi-node executors, Ray, flag set, recipes."""
    from sparkprov.catalog.images import image_rows
    from sparkprov.outputs import check_output_file

    host, out = o.host, o.out
    try:
        if o.pin:  # before the table: the error is the only line
            out_path = check_output_file("out", out, inputs=o.recipes)
        cat = _catalog(o.recipes)
    except SparkprovError as exc:
        raise _fail(exc)
    rows = image_rows(cat)
    resolved: dict[str, str] = {}
    if host:
        resolved = _resolve_on_host(cat, host, o.inventory, o.flags)
    cols = ("image", "vLLM", "digest", "executors", "ray", "gb10", "flag set", "recipes")
    if host:
        cols += (f"digest on {host}",)
    table_rows = [r.cells() + ((resolved.get(r.ref, "not present"),) if host else ()) for r in rows]
    if o.plain:
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
    if o.pin:
        from sparkprov.catalog.images import pinned_images_yaml
        from sparkprov.outputs import write_text_atomic

        try:
            write_text_atomic(out_path, pinned_images_yaml(cat, resolved, host=host))
        except OSError as exc:
            raise Exit(f"sparkprov: cannot write {out_path}: {exc.strerror or exc} (fix: give --out a file you can "
                       "write)", code=1) from None
        print(f"pinned {len(resolved)} image(s) into {out}; use it with --recipes {out}", file=sys.stderr)


def _resolve_on_host(cat: Catalog, host: str, inventory: str | None, flags: bool) -> dict[str, str]:
    """The image_flags play on the host (plays/images.py): the digests its tags resolved to."""
    from sparkprov.data.inventory import load_inventory
    from sparkprov.plays.images import host_images

    try:
        found = host_images(load_inventory(inventory_path(inventory)), host,
                            {r: cat.image_table[r].vllm for r in cat.image_table}, ask=flags)
    except SparkprovError as exc:
        raise _fail(exc)
    for line in found.lines:
        print(line, file=sys.stderr)
    if found.code:
        raise Exit(code=found.code)
    return found.digests


def recipe_import(c, file: str, out: str | None = None, name: str | None = None, variant: str | None = None):
    """`invoke recipe import --file FILE` (its options parsed by RecipeOptions): convert another tool's
    recipe into a sparkprov user recipe file and lint it with the G-rules: one line per finding (and
    per thing that did not carry over); errors exit non-zero. The file is written (atomically) only
    when the import has no error and the recipe loads over the catalog; a recipe with lint errors is
    written all the same (to be edited) and exits 1."""
    from sparkprov.catalog.importer import import_file, lint_imported
    from sparkprov.catalog.knownflags import default_cache_dir
    from sparkprov.catalog.lint import errors
    from sparkprov.outputs import check_output_file, write_text_atomic

    try:
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
