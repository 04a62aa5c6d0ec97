"""Playbooks: a list of plays; a play targets hosts and lists tasks; a task names one module.

    - name: Prepare Sparks
      hosts: sparks
      become: true
      tasks:
        - name: docker group
          group: {name: docker}
          tags: [docker]
          notify: [restart something]
      handlers:
        - name: restart something
          command: {argv: [...]}

Everything is validated on load, module arguments included, before any host is touched. What a
file loads into is what the engine runs (sparkprov/engine/playbook.py: Playbook, Play, Task), as
the commands' playbooks built in code are (sparkprov/plays/).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from sparkprov import modules
from sparkprov.yamlpos import Positions, load_yaml, parse_model
from sparkprov.engine.expr import ExprError, check_condition, has_template
from sparkprov.engine.playbook import Play, Playbook, Task
from sparkprov.engine.validate import check_condition_safe, template_problems
from sparkprov.errors import InputError

TASK_KEYWORDS = {"name", "tags", "when", "notify", "check_mode", "no_log", "become", "ignore_errors"}


class _TaskKeywords(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str | None = None
    tags: list[str] = Field(default_factory=list)
    when: str | bool | None = None
    notify: list[str] = Field(default_factory=list)
    check_mode: bool | None = None
    no_log: bool = False
    become: bool | None = None
    ignore_errors: bool = False

    @field_validator("tags", "notify", mode="before")
    @classmethod
    def _listify(cls, v):
        return [v] if isinstance(v, str) else v


class _PlayFile(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str | None = None
    hosts: str | list[str]
    become: bool = False
    vars: dict[str, Any] = Field(default_factory=dict)
    tags: list[str] = Field(default_factory=list)
    tasks: list[Any] = Field(default_factory=list)
    handlers: list[Any] = Field(default_factory=list)
    any_errors_fatal: bool = False


def _parse_task(raw: Any, pos: Positions, path: tuple, play_tags: list[str]) -> Task:
    line, col = pos.at(path)
    where = (pos.file, line, col)
    if not isinstance(raw, dict):
        raise pos.error(path, "a task must be a mapping with a module name and its arguments",
                        fix="write e.g. `- name: ...` then `file: {path: ..., mode: \"0644\"}`")
    module_keys = [k for k in raw if k not in TASK_KEYWORDS]
    registry = modules.registry()
    if not module_keys:
        raise pos.error(path, "task names no module", fix="add one, e.g. `file: {path: /etc/x, content: ...}`")
    if len(module_keys) > 1:
        unknown = [k for k in module_keys if k not in registry]
        key = unknown[0] if unknown else module_keys[1]
        fix = _suggest(key, registry, TASK_KEYWORDS)
        raise pos.error(path + (key,), f"task has more than one module or an unknown keyword: {', '.join(map(str, module_keys))}",
                        key=True, fix=fix)
    mod_name = str(module_keys[0])
    if mod_name not in registry:
        raise pos.error(path + (mod_name,), f"unknown module {mod_name!r}", key=True,
                        fix=_suggest(mod_name, registry, TASK_KEYWORDS))
    kw = parse_model(_TaskKeywords, {k: v for k, v in raw.items() if k in TASK_KEYWORDS}, pos, prefix=path)
    args = raw[mod_name]
    if args is None:
        args = {}
    if not isinstance(args, dict):
        raise pos.error(path + (mod_name,), f"arguments of {mod_name} must be a mapping",
                        fix=f"write `{mod_name}: {{key: value}}`")
    if isinstance(kw.when, str):
        try:
            check_condition(kw.when)
            check_condition_safe(kw.when)
        except ExprError as exc:
            raise pos.error(path + ("when",), str(exc), fix="use and/or/not, ==, !=, <, >, in, and variable names") from None
    for sub, problem in template_problems(args):
        # text like `{{ x | default(1) }}` would otherwise reach the host as literal braces
        raise pos.error(path + (mod_name,) + sub, problem,
                        fix="use {{ name }}; for literal braces, put the text in an inventory var and write {{ that_var }}")
    module_cls = registry[mod_name]
    # Arguments without templates are validated now; templated ones once per host (validate_for_host).
    if not has_template(args):
        parse_model(module_cls.Args, args, pos, prefix=path + (mod_name,))
    return Task(name=kw.name or f"{mod_name}", module=mod_name, args=args, tags=sorted(set(kw.tags) | set(play_tags)),
                when=kw.when, notify=kw.notify, check_mode=kw.check_mode, no_log=kw.no_log, become=kw.become,
                ignore_errors=kw.ignore_errors, where=where,
                when_where=(pos.file, *pos.at(path + ("when",))) if kw.when is not None else None)


def _suggest(word: str, registry: dict, keywords: set[str]) -> str:
    import difflib

    close = difflib.get_close_matches(str(word), list(registry) + sorted(keywords), n=1)
    return f"did you mean {close[0]!r}?" if close else f"modules: {', '.join(sorted(registry))}"


def load_playbook(path: str | Path) -> Playbook:
    data, pos = load_yaml(path, what="playbook")
    file = str(path)
    if data is None:
        raise InputError("the playbook is empty", file=file, line=1, column=1,
                         fix="start each play with `- hosts: ...`")
    if not isinstance(data, list) or not data:
        raise pos.error((), "a playbook must be a non-empty list of plays", fix="start each play with `- hosts: ...`")
    book = Playbook(file)
    for i, raw_play in enumerate(data):
        if not isinstance(raw_play, dict):
            raise pos.error((i,), "a play must be a mapping with hosts: and tasks:")
        play = parse_model(_PlayFile, raw_play, pos, prefix=(i,))
        host_terms = play.hosts if isinstance(play.hosts, list) else [p for p in re.split(r"[,:\s]+", play.hosts) if p]
        if not [t for t in host_terms if str(t).strip()]:
            # an empty pattern selects nothing, and a play that silently runs nowhere looks like success
            raise pos.error((i, "hosts"), f"hosts: {play.hosts!r} names no host", fix="write e.g. `hosts: all` or a group name")
        tasks = [_parse_task(t, pos, (i, "tasks", j), play.tags) for j, t in enumerate(play.tasks)]
        handlers = [_parse_task(t, pos, (i, "handlers", j), play.tags) for j, t in enumerate(play.handlers)]
        names = {h.name for h in handlers}
        for j, t in enumerate(tasks):
            for n in t.notify:
                if n not in names:
                    raise pos.error((i, "tasks", j, "notify"), f"notify names no handler {n!r}",
                                    fix=f"define it under handlers: of this play (have: {', '.join(sorted(names)) or 'none'})")
        line, col = pos.at((i,))
        book.plays.append(Play(play.name or f"play {i + 1}", play.hosts, play.become, play.vars, tasks, handlers,
                               (file, line, col), play.any_errors_fatal))
    return book
