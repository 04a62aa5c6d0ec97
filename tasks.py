"""sparkprov: take DGX Spark machines from fresh to serving LLMs with vLLM.

Run `invoke --list` for the tasks and `invoke --help TASK` for a task's options.

Every task is an Invoke task made beside its function in its sparkprov/cli module, by
@command(ITS_OPTIONS) (sparkprov/cli/command.py: the options declared once, parsed before the task
runs) or, without options, @task; each listed once in TASKS below.
"""

from invoke import Collection

from sparklab import tasks as lab  # the lab's tasks, lab.* (sparklab: this repo, never the wheel)
from sparkprov.cli import bench, catalog, cluster, facts, gateway, guard, monitor, plan, provision, stage, store, upgrade

TASKS = [
    provision.provision, provision.play, provision.schema, facts.facts, stage.stage_weights, store.store,
    catalog.models, catalog.recipe, catalog.lint, catalog.images, plan.plan,
    bench.bench, gateway.gateway, guard.guard, monitor.monitor,
    cluster.cluster_up, cluster.cluster_down, cluster.status, cluster.nccl_check, upgrade.history, upgrade.rollback,
]

ns = Collection(*TASKS)
ns.add_collection(lab.ns, "lab")
