"""sparkprov: take DGX Spark machines from fresh to serving LLMs with vLLM.

Run `invoke --list` for the tasks and `invoke --help TASK` for a task's options.

Every task is an Invoke task made with @task beside its function in its sparkprov/cli module, and
listed once in TASKS below.
"""

from invoke import Collection, task

from sparklab import tasks as lab  # the lab's tasks, lab.* (sparklab: this repo, never the wheel)
from sparkprov.cli import bench, catalog, cluster, facts, gateway, guard, monitor, plan, provision, stage, store, upgrade

TASKS = [
    provision.provision, provision.play, provision.schema, facts.facts, stage.stage_weights, store.store,
    catalog.models, catalog.recipe, catalog.lint, catalog.images, plan.plan,
    bench.bench, gateway.gateway, guard.guard, monitor.monitor,
    # cli/cluster.py and cli/upgrade.py (serving's core, changed with it) still define plain functions:
    # the same @task, applied here until it sits above each of them
    task(cluster.cluster_up, help=cluster.UP_HELP, iterable=["recipes"]),
    task(cluster.cluster_down, help=cluster.DOWN_HELP),
    task(cluster.status, help=cluster.STATUS_HELP),
    task(cluster.nccl_check, help=cluster.NCCL_HELP),
    task(upgrade.history, help=upgrade.HISTORY_HELP),
    task(upgrade.rollback, help=upgrade.ROLLBACK_HELP),
]

ns = Collection(*TASKS)
ns.add_collection(lab.ns, "lab")
