"""A task's arguments for one host: templates rendered with the host's variables, then validated
by the module's Args model. Errors point at the task's place in its playbook."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from sparkprov import modules
from sparkprov.engine.expr import Undefined, render
from sparkprov.engine.playbook import Task
from sparkprov.yamlpos import Positions, validation_error



def render_args(task: Task, variables: dict[str, Any]) -> Any:
    """The task's arguments for one host, validated. Raises InputError at the task's position."""
    try:
        args = render(task.args, variables)
    except Undefined as exc:
        raise task.error(f"task {task.name!r}: {exc}", fix="define it in the inventory vars or the play's vars") from None
    module_cls = modules.registry()[task.module]
    try:
        return module_cls.Args.model_validate(args)
    except ValidationError as exc:
        err = validation_error(exc, Positions(task.where[0], {(): task.where[1:]}))
        raise task.error(f"task {task.name!r}: {err.message}", fix=err.fix) from None
