"""Everything a playbook will evaluate, checked for the whole playbook before any host is touched.

At run time a `when:` naming an undefined variable fails its task, but only after the tasks
before it have changed the host: a half-applied play from a typo. So before the first connection
every `when:` and every template is checked against the names that will exist on each targeted
host: its inventory vars, the play's vars, extra vars, and the names the engine itself defines
(the host facts gathered at first contact, inventory_hostname, exports, groups; see
Runner._variables in engine/run.py).

Load-time checks that need no inventory (dunder access in `when:`, text that looks like a
template but is not one) are here too, called by data/playbook.py with the exact position.
"""

from __future__ import annotations

import ast
import re
from typing import Any, Iterable, Iterator, Mapping

from sparkprov.engine.expr import _CONSTS, _TEMPLATE, ExprError
from sparkprov.engine.playbook import Playbook, Task
from sparkprov.errors import InputError


# What Runner._variables adds to every host's variables: HostInfo's keys (facts/base.py; the os_*
# and dgx_* ones only where the host has the release files, so a `when:` may test them) and the
# engine's own names.
HOST_FACT_NAMES = frozenset({
    "user", "uid", "home", "hostname", "arch", "kernel", "os_id", "os_version_id", "os_pretty_name",
    "dgx_name", "dgx_pretty_name", "dgx_ota_version",
})
ENGINE_NAMES = frozenset({"inventory_hostname", "inventory_hosts", "exports", "groups"})
RUNTIME_NAMES = HOST_FACT_NAMES | ENGINE_NAMES

_BRACES = re.compile(r"\{\{|\}\}|\{%|%\}")


def template_problem(text: str) -> str | None:
    """Why a string that looks like a template is not one sparkprov renders, or None. Without this
    `{{ name | default('x') }}` or `{{name}` would reach the host as literal braces."""
    if not isinstance(text, str) or not _BRACES.search(text):
        return None
    if _BRACES.search(_TEMPLATE.sub("", text)) is None:
        return None
    snippet = text if len(text) <= 80 else text[:77] + "..."
    return (f"{snippet!r} looks like a template but is not one sparkprov renders "
            "(only {{ name }} and {{ name.key }}: no filters, expressions or {% %} blocks)")


def template_problems(value: Any, path: tuple = ()) -> Iterator[tuple[tuple, str]]:
    """(path inside value, problem) for every string of a nested value that is a broken template."""
    if isinstance(value, str):
        problem = template_problem(value)
        if problem:
            yield path, problem
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from template_problems(v, path + (i,))
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from template_problems(v, path + (k,))


def condition_dunder(expr: str) -> str | None:
    """The first attribute or key of a `when:` that reaches for Python internals (`x.__class__`,
    `x['__globals__']`, or any name or attribute starting with '_'), or None. Evaluation only
    looks into dicts, so this cannot escape today; refusing it at load keeps it that way."""
    try:
        tree = ast.parse(expr, mode="eval")
    except (SyntaxError, RecursionError, MemoryError, ValueError):
        return None  # check_condition reports these
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_"):
            return node.attr
        if isinstance(node, ast.Name) and node.id.startswith("__"):
            return node.id
        if (isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant)
                and isinstance(node.slice.value, str) and node.slice.value.startswith("__")):
            return node.slice.value
    return None


def condition_names(expr: str) -> list[str]:
    """The top-level variable names a `when:` reads (constants such as true/none excluded)."""
    tree = ast.parse(expr, mode="eval")
    names = sorted((n for n in ast.walk(tree) if isinstance(n, ast.Name) and n.id not in _CONSTS),
                   key=lambda n: (n.lineno, n.col_offset))  # in the order the user wrote them
    return list(dict.fromkeys(n.id for n in names))


def template_names(value: Any) -> list[str]:
    """The top-level variable names the templates of a nested value read."""
    out: list[str] = []
    if isinstance(value, str):
        out += [m.group(1).split(".")[0] for m in _TEMPLATE.finditer(value)]
    elif isinstance(value, list):
        for v in value:
            out += template_names(v)
    elif isinstance(value, dict):
        for v in value.values():
            out += template_names(v)
    return list(dict.fromkeys(out))


def _when_error(task: Task, message: str) -> InputError:
    file, line, col = getattr(task, "when_where", None) or task.where
    return InputError(f"task {task.name!r}: when: {message}", file=file, line=line, column=col,
                      fix="define it in the inventory vars or the play's vars")


def validate_playbook_expressions(playbook: Playbook, known_names: Iterable[str] | Mapping[str, Iterable[str]],
                                  *, hosts_of_play=None) -> None:
    """Raise InputError (one line, the task's position) for the first `when:` or template naming a
    variable that will not exist, before any host is touched.

    known_names: names defined outside the playbook (inventory vars, extra vars) for every host,
    or a mapping host -> those names; with a mapping, `hosts_of_play(play)` gives the hosts each
    play runs on, and each is checked with its own names. Play vars and RUNTIME_NAMES are added
    here."""
    for play in playbook.plays:
        if isinstance(known_names, Mapping):
            hosts = list(hosts_of_play(play)) if hosts_of_play else list(known_names)
            scopes = {h: set(known_names.get(h, ())) | set(play.vars) | RUNTIME_NAMES for h in hosts}
        else:
            scopes = {None: set(known_names) | set(play.vars) | RUNTIME_NAMES}
        if not scopes:
            continue  # the play runs on none of the selected hosts

        def missing(name: str) -> str | None:
            """None when every host defines it; else the message's tail naming where it is not."""
            lacking = [h for h, defined in scopes.items() if name not in defined]
            if not lacking:
                return None
            if len(lacking) == len(scopes):
                return ""
            return f" on {', '.join(map(str, lacking[:3]))}" + (" and more" if len(lacking) > 3 else "")

        for task in play.tasks + play.handlers:
            if isinstance(task.when, str):
                try:
                    used = condition_names(task.when)
                except (SyntaxError, RecursionError, MemoryError, ValueError):
                    used = []  # check_condition reported it at load
                for name in used:
                    where = missing(name)
                    if where is not None:
                        raise _when_error(task, f"undefined variable {name!r}{where}")
            for name in template_names(task.args):
                where = missing(name)
                if where is not None:
                    raise task.error(f"task {task.name!r}: undefined variable {name!r}{where}",
                                     fix="define it in the inventory vars or the play's vars")


def check_condition_safe(expr: str) -> None:
    """check_condition's companion at load: refuse dunder access (ExprError)."""
    bad = condition_dunder(expr)
    if bad is not None:
        raise ExprError(f"{bad!r} is not allowed in a condition (names starting with '_' are Python internals)")


def check_override_flags(dep: Any, recipe: Any, catalog: Any, cache_dir: str | None = None) -> None:
    """Each flag a deployment's overrides add is one the vLLM of its recipe's image knows: the
    image's cached `vllm serve --help=all` answer where one is cached, else the set recorded for
    its vLLM version (the lint's G4 knows the same offline). An unknown flag would otherwise be
    found by the preflight on the host, or by vLLM exiting with 'unrecognized arguments'."""
    from sparkprov.catalog.knownflags import REPLACED, known_flags

    info = catalog.image(recipe.image)
    flags = known_flags(info if info is not None else recipe.image, catalog, cache_dir)
    if flags is None:  # an image whose vLLM nothing records: the preflight asks the image itself
        return
    for flag, value in dep.overrides.items():
        if value is None or value is False:  # removing a flag the image lacks harms nothing
            continue
        if not flags.knows(flag):
            raise dep.error(f"override {flag} is not an option of the vLLM in {recipe.image} ({flags.describe()})",
                            fix=REPLACED.get(flag, "check the spelling (invoke images --host H --flags lists the "
                                                   "image's own), or remove it"), override=flag)
