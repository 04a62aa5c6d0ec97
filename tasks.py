"""sparkprov: take DGX Spark machines from fresh to serving LLMs with vLLM.

Run `invoke --list` for the tasks and `invoke --help TASK` for a task's options.
Imports stay inside the tasks so that listing them is instant.
"""

from invoke import Collection, task

from sparkprov.cli import bench as bench_cli
from sparkprov.cli import catalog as catalog_tasks
from sparkprov.cli import cluster as cluster_cli
from sparkprov.cli import gateway as gateway_cli
from sparkprov.cli import guard as guard_cli
from sparkprov.cli import monitor as monitor_cli
from sparkprov.cli import plan as plan_cli
from sparkprov.cli import upgrade as upgrade_cli
from sparklab import tasks as lab_tasks

COMMON_HELP = {
    "hosts": "Hosts, groups or patterns to run on, comma-separated (default: all in the inventory)",
    "inventory": "Inventory file (default: $SPARKPROV_INVENTORY, ./inventory.yaml, or the repo's)",
    "playbook": "Playbook file to run",
    "check": "Check mode: show what would change, change nothing",
    "diff": "Show before/after for files and settings",
    "json": "Print one JSON document instead of the recap",
    "limit": "Further limit the selected hosts (pattern, e.g. 'spark2' or '!spark1')",
    "tags": "Only run tasks with these tags (comma-separated)",
    "skip_tags": "Skip tasks with these tags (comma-separated)",
    "forks": "How many hosts to work on at once (default 32)",
    "accept_new_host_keys": "Record host keys of hosts never seen before (a changed key is still refused)",
    "verbose": "Say where the engine splits a play's one apply call, and why",
}


def _run(playbook, **kw):
    from sparkprov.cli.common import finish, run_playbook

    finish(run_playbook(playbook=playbook, **kw))


@task(help=COMMON_HELP)
def provision(c, hosts=None, inventory=None, playbook=None, check=False, diff=False, json=False, limit=None,
              tags=None, skip_tags=None, forks=None, accept_new_host_keys=False, verbose=False):
    """Converge Sparks to ready-to-serve: docker, GPU checks, fabric, SSH mesh, model store."""
    from sparkprov.cli.common import playbook_path

    _run(playbook_path(playbook, "provision.yaml"), inventory=inventory, hosts=hosts, limit=limit, check=check,
         diff=diff, as_json=json, tags=tags, skip_tags=skip_tags, forks=forks,
         accept_new_host_keys=accept_new_host_keys, verbose=verbose)


@task(help={**COMMON_HELP, "playbook": "Playbook file to run (required)"})
def play(c, playbook, hosts=None, inventory=None, check=False, diff=False, json=False, limit=None, tags=None,
         skip_tags=None, forks=None, accept_new_host_keys=False, verbose=False):
    """Run any playbook against the inventory."""
    if isinstance(playbook, str) and playbook.startswith("-"):
        from sparkprov.cli.common import user_errors
        from sparkprov.cli.options import positional

        with user_errors():
            positional("play", "playbook", playbook)
    _run(playbook, inventory=inventory, hosts=hosts, limit=limit, check=check, diff=diff, as_json=json, tags=tags,
         skip_tags=skip_tags, forks=forks, accept_new_host_keys=accept_new_host_keys, verbose=verbose)


@task(help={k: COMMON_HELP[k] for k in ("hosts", "inventory", "json", "limit", "forks", "accept_new_host_keys")})
def facts(c, hosts=None, inventory=None, json=False, limit=None, forks=None, accept_new_host_keys=False):
    """Show each host's facts: identity, GPU, driver, CUDA, memory, fabric, docker."""
    from sparkprov.cli.facts import show_facts

    show_facts(hosts=hosts, inventory=inventory, as_json=json, limit=limit, forks=forks,
               accept_new_host_keys=accept_new_host_keys)


@task
def schema(c):
    """Write JSON Schemas for inventory and playbook files to schemas/ (for editors)."""
    from sparkprov.cli.common import user_errors
    from sparkprov.data.schema import write_schemas

    with user_errors():
        try:
            paths = write_schemas()
        except OSError as exc:  # a read-only checkout, a file where schemas/ should be
            from sparkprov.errors import SparkprovError

            raise SparkprovError(f"cannot write schemas: {exc.strerror}: {exc.filename}",
                                 fix="run it in a writable checkout") from None
    for path in paths:
        print(path)


def _stage_help():
    from sparkprov.cli.stage import STAGE_HELP

    return STAGE_HELP


# streams and progress_interval default to None so that Invoke hands their text over as typed
# (an int or float default makes Invoke cast it itself, and `--streams abc` ends in a traceback);
# sparkprov.cli.options parses and range-checks them.
@task(help=_stage_help())
def stage_weights(c, model, hosts=None, inventory=None, limit=None, check=False, rehash=False, json=False,
                  source=None, streams=None, image=None, accept_new_host_keys=False, progress_interval=None,
                  forks=None, revision=None, include=None, exclude=None):
    """Stage a model's weights into every host's store: download once, fan out over the fabric, verify."""
    from sparkprov.cli.common import user_errors
    from sparkprov.cli.options import float_option, int_option, positional
    from sparkprov.cli.stage import stage_weights as run

    with user_errors():
        positional("stage-weights", "model", model)
        streams = int_option("streams", streams, 1, 64, default=4)
        progress_interval = float_option("progress-interval", progress_interval, 0, 3600, default=5.0, unit="seconds")
    run(c, model, hosts=hosts, inventory=inventory, limit=limit, check=check, rehash=rehash, json=json,
        source=source, streams=streams, image=image, accept_new_host_keys=accept_new_host_keys,
        progress_interval=progress_interval, forks=forks, revision=revision, include=include, exclude=exclude)


def _store_help():
    from sparkprov.cli.store import HELP

    return HELP


@task(help=_store_help())
def store(c, hosts=None, inventory=None, limit=None, prune=None, prune_unused=False, compile_cache=False, verify=None,
          check=False, json=False, forks=None, accept_new_host_keys=False):
    """Per host: each model in the store (revision, size, verified, in use by); --verify MODEL; prune what no deployment uses."""
    from sparkprov.cli.store import store as run

    run(c, hosts=hosts, inventory=inventory, limit=limit, prune=prune, prune_unused=prune_unused,
        compile_cache=compile_cache, verify=verify, check=check, json=json, forks=forks,
        accept_new_host_keys=accept_new_host_keys)


ns = Collection(provision, play, facts, schema, stage_weights, catalog_tasks.models, catalog_tasks.recipe,
                catalog_tasks.lint, catalog_tasks.images)
ns.add_task(task(cluster_cli.cluster_up, name="cluster-up", help=cluster_cli.UP_HELP, iterable=["recipes"]))
ns.add_task(task(cluster_cli.cluster_down, name="cluster-down", help=cluster_cli.DOWN_HELP))
ns.add_task(task(cluster_cli.status, help=cluster_cli.STATUS_HELP))
ns.add_task(task(cluster_cli.nccl_check, name="nccl-check", help=cluster_cli.NCCL_HELP))
ns.add_task(task(monitor_cli.monitor, help=monitor_cli.HELP))
ns.add_task(task(bench_cli.bench, help=bench_cli.HELP))
ns.add_task(task(plan_cli.plan, help=plan_cli.HELP, iterable=["recipes"]))
ns.add_task(task(gateway_cli.gateway, help=gateway_cli.HELP))
ns.add_task(task(guard_cli.guard, help=guard_cli.HELP))
ns.add_task(task(upgrade_cli.history, help=upgrade_cli.HISTORY_HELP))
ns.add_task(task(upgrade_cli.rollback, help=upgrade_cli.ROLLBACK_HELP))
ns.add_task(store)
ns.add_collection(lab_tasks.ns, "lab")
