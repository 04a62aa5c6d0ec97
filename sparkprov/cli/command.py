"""One way to declare a task: `@command(OptionsClass)` above a function of (c, options).

The task's options are the fields of the options dataclass declared with sparkprov/options.py
`option(...)`, in their order (Invoke gives the short flags in that order): their names, their
help (so `invoke --help TASK` shows every one), which are repeatable and which positional. Before
the function runs, every value is parsed by its kind and the class's rules are checked
(`parse_options`): bad input is one line and exit 1, before any file is read or host touched. The
function gets the typed options object and nothing else.

data, plays and the catalog load inside the task functions, not at the top: tasks.py imports
every cli module, and `invoke --list` stays fast.
"""

from __future__ import annotations

import inspect
import os
import sys
from typing import Any, Callable

from invoke import Task, task

from sparkprov.cli.common import user_errors
from sparkprov.options import OptionError, options_of, parse_options, text_option


def command(options: type, **task_kwargs: Any) -> Callable[[Callable[[Any, Any], Any]], Task]:
    """The Invoke task of `body(c, options)`, its command line declared by `options`."""

    def make(body: Callable[[Any, Any], Any]) -> Task:
        fields = options_of(options)
        name = body.__name__.replace("_", "-")
        params = [inspect.Parameter("c", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
        # positional ones first: Invoke fills them in this order, and a signature lists them first
        fields = sorted(fields, key=lambda f: not f.metadata["positional"])
        for f in fields:
            kind = f.metadata["kind"]
            default = (inspect.Parameter.empty if f.metadata["positional"] else
                       f.default if kind.flag else None)
            params.append(inspect.Parameter(f.name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=default))
        names = [f.name for f in fields]

        def run(c, *args, **raw):
            raw.update(zip(names, args))
            with user_errors():
                for f in fields:
                    if f.metadata["positional"]:
                        positional(name, f.name, raw.get(f.name))
                opts = parse_options(options, raw)
            return body(c, opts)

        run.__signature__ = inspect.Signature(params)  # what Invoke reads the task's options from
        run.__name__, run.__qualname__, run.__doc__ = body.__name__, body.__qualname__, body.__doc__
        run.__module__ = body.__module__
        made = task(run, help={f.name: f.metadata["help"] for f in fields},
                    iterable=[f.name for f in fields if f.metadata["kind"].many],
                    positional=[f.name for f in fields if f.metadata["positional"]], **task_kwargs)
        made.options = options  # what the task's command line is made of (tests read it)
        return made

    return make


def positional(task_name: str, name: str, value) -> str:
    """A task's first argument (a model, alias or playbook). Invoke fills it with whatever comes
    first, so `invoke stage-weights --help` arrives here as the model '--help': that is shown
    the task's help, as `invoke --help stage-weights` does; any other option in its place is one
    line saying where the argument goes."""
    if value in ("--help", "-h") and task_name in sys.argv:
        at = sys.argv.index(task_name)
        os.execv(sys.executable, [sys.executable, "-m", "invoke", *sys.argv[1:at], "--help", task_name])
    text_option(name, value)
    if value.startswith("-"):
        raise OptionError(f"{task_name}: {value!r} stands where the {name} goes",
                          fix=f"give the {name} first: invoke {task_name} {name.upper()} [options] "
                              f"(the options: invoke --help {task_name})")
    return value
