"""Serving: `invoke cluster-up` / `cluster-down` / `status` / `nccl-check`.

    playbook.py    the serve playbook (deployments: which model runs where, TP, overrides)
    facts.py       what one gather reads on a host: sparkprov's containers, image IDs, the key file,
                   listeners on the serving ports, the probe of running servers
    spec.py        the containers a deployment wants on each host (docker argv, labels, hashes)
    probe.py       the host-side HTTP probe (health, models, metrics, warm-up, smoke test)
    bringup.py     preflight, start, wait, smoke test, report, rollback on failure
    manage.py      cluster-down and status
    progress.py    long waits: rich on a terminal, plain lines otherwise
    nccl.py        nccl-check: allreduce_bench.py across the hosts inside the serving image

Every container sparkprov starts carries the labels sparkprov.managed=1, sparkprov.deployment,
sparkprov.role (server | ray-head | ray-worker) and sparkprov.recipe_hash (a hash of the whole
`docker run` but its labels); idempotency, cluster-down and status go by these labels only.
"""
