"""`invoke provision`, `invoke play PLAYBOOK`: YAML playbooks on the engine; `invoke schema`: the JSON
Schemas of the inventory and playbook files. Parses and prints; cli/common.py run_playbook runs a
playbook file.

data loads inside the schema task, not at the top: tasks.py imports every cli
module, and `invoke --list` stays fast.
"""

from __future__ import annotations

from invoke import task

from sparkprov.cli.common import COMMON_HELP, finish, playbook_path, run_playbook, user_errors
from sparkprov.cli.options import positional
from sparkprov.errors import SparkprovError


@task(help=COMMON_HELP)
def provision(c, hosts=None, inventory=None, playbook=None, check=False, diff=False, json=False, limit=None,
              tags=None, skip_tags=None, forks=None, accept_new_host_keys=False, verbose=False):
    """Converge Sparks to ready-to-serve: docker, GPU checks, fabric, SSH mesh, model store."""
    finish(run_playbook(playbook=playbook_path(playbook, "provision.yaml"), inventory=inventory, hosts=hosts,
                        limit=limit, check=check, diff=diff, as_json=json, tags=tags, skip_tags=skip_tags,
                        forks=forks, accept_new_host_keys=accept_new_host_keys, verbose=verbose))


@task(help={**COMMON_HELP, "playbook": "Playbook file to run (required)"})
def play(c, playbook, hosts=None, inventory=None, check=False, diff=False, json=False, limit=None, tags=None,
         skip_tags=None, forks=None, accept_new_host_keys=False, verbose=False):
    """Run any playbook against the inventory."""
    if isinstance(playbook, str) and playbook.startswith("-"):
        with user_errors():
            positional("play", "playbook", playbook)
    finish(run_playbook(playbook=playbook, inventory=inventory, hosts=hosts, limit=limit, check=check, diff=diff,
                        as_json=json, tags=tags, skip_tags=skip_tags, forks=forks,
                        accept_new_host_keys=accept_new_host_keys, verbose=verbose))


@task
def schema(c):
    """Write JSON Schemas for inventory and playbook files to schemas/ (for editors), and the README's list
    of inventory variables (from sparkprov/inventory_vars.py)."""
    from sparkprov.data.schema import write_schemas

    with user_errors():
        try:
            paths = write_schemas()
        except OSError as exc:  # a read-only checkout, a file where schemas/ should be
            raise SparkprovError(f"cannot write schemas: {exc.strerror}: {exc.filename}",
                                 fix="run it in a writable checkout") from None
    for path in paths:
        print(path)
