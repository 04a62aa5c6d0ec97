"""Serving commands as plays on the engine: `invoke cluster-up`, `cluster-down`, `status`, `nccl-check`.

    plays.py    builds each command's playbook from deployments (serving modules in sparkprov/modules/)
                and runs it on the engine (sparkprov/engine/run.py)

What serving is, as data, lives in sparkprov/serving/ (serve playbooks, container specs, the node
renderer and preflight checks); what is read on hosts, in sparkprov/facts/serving.py.

Every container sparkprov starts carries the labels sparkprov.managed=1, sparkprov.deployment,
sparkprov.role (server | ray-head | ray-worker | rank0 | rank) and sparkprov.recipe_hash (a hash of
the whole `docker run` but its labels); idempotency, cluster-down and status go by these labels only.
"""
