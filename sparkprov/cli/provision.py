"""`invoke provision`, `invoke play PLAYBOOK`: YAML playbooks on the engine; `invoke schema`: the JSON
Schemas of the inventory and playbook files. Parses and prints; cli/common.py run_playbook runs a
playbook file.

data loads inside the schema task, not at the top: tasks.py imports every cli
module, and `invoke --list` stays fast.
"""

from __future__ import annotations

from dataclasses import dataclass

from invoke import task

from sparkprov.cli.command import command
from sparkprov.cli.common import finish, playbook_path, run_playbook, user_errors
from sparkprov.errors import SparkprovError
from sparkprov.options import Check, Flag, Words, common, option

PLAYBOOK_HELP = "Playbook file to run"


def _tag_in_both(o) -> tuple[str, str] | None:
    """A tag both run and skipped: the tasks carrying it are skipped, and the run looks like success."""
    both = sorted(set(o.tags or []) & set(o.skip_tags or []))
    if both:
        return (f"--tags and --skip-tags both name {both[0]!r}: the tasks carrying it would be skipped",
                f"leave {both[0]!r} out of one of them")
    return None


@dataclass
class ProvisionOptions:
    hosts: str | None = common("hosts")
    inventory: str | None = common("inventory")
    playbook: str | None = option(PLAYBOOK_HELP + " (default: playbooks/provision.yaml)")
    check: bool = option("Check mode: show what would change, change nothing", Flag())
    diff: bool = option("Show before/after for files and settings", Flag())
    json: bool = common("json")
    limit: str | None = common("limit")
    tags: list[str] | None = option("Only run tasks with these tags (comma-separated)", Words())
    skip_tags: list[str] | None = option("Skip tasks with these tags (comma-separated)", Words())
    forks: int = common("forks")
    accept_new_host_keys: bool = common("accept_new_host_keys")
    verbose: bool = option("Say where the engine splits a play's one apply call, and why", Flag())

    RULES = (Check(_tag_in_both),)

    def run(self, playbook: str) -> int:
        return run_playbook(playbook=playbook, inventory=self.inventory, hosts=self.hosts, limit=self.limit,
                            check=self.check, diff=self.diff, as_json=self.json, tags=self.tags or [],
                            skip_tags=self.skip_tags or [], forks=self.forks,
                            accept_new_host_keys=self.accept_new_host_keys, verbose=self.verbose)


@dataclass
class PlayOptions(ProvisionOptions):
    playbook: str = option(PLAYBOOK_HELP + " (required)", positional=True)


@command(ProvisionOptions)
def provision(c, o: ProvisionOptions):
    """Converge Sparks to ready-to-serve: docker, GPU checks, fabric, SSH mesh, model store."""
    finish(o.run(playbook_path(o.playbook, "provision.yaml")))


@command(PlayOptions)
def play(c, o: PlayOptions):
    """Run any playbook against the inventory."""
    finish(o.run(o.playbook))


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
