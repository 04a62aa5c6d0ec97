"""Code that runs on the nodes: standard library only, imports nothing of sparkprov but itself
(.importlinter's contract "node"), so that a bare Spark's python3 runs it.

- guard.py: the node guard (a daemon as root: the `guard` module installs this package's files on
  the node and runs `python3 -m sparkprov_node.guard`); decide.py its pure decisions, readings.py
  the parsers of what it reads (/proc/meminfo, /proc/buddyinfo, the kernel log, NVML), docker.py
  the Docker Engine API over its socket, metrics.py its /metrics text, requalify.py the fabric
  qualified again after a boot, settings.py every setting (one table, plain data).
- supervise.py: the rank supervisor that runs `vllm serve` in a native multi-node container; it
  travels as its file's text (`python3 -c TEXT`), and holds the rule both it and the guard use to
  tell a busy engine from a stalled one (the engine's counters on vLLM's /metrics).
- probe.py: the status/ready/state probe `invoke status` and cluster-up run on a host (its
  text sent over SSH).
- rail.py: the ib_write_bw parser and the rail judgement (provision, cluster-up and the guard).

Inside the package imports are relative: on a node it is the top-level package `sparkprov_node`
(NODE_LIB/sparkprov_node), here `sparkprov.node`.
"""

from __future__ import annotations

# Where the package lives on a node (root's; /var/lib persists across reboots).
NODE_LIB = "/var/lib/sparkprov/lib"
NODE_PACKAGE = "sparkprov_node"
