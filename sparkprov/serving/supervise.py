"""The rank supervisor: what runs `vllm serve` in every container of a native multi-node deployment.

Why it exists (measured on the real vLLM, docs/real-vllm.md): the engine does not fail the way a
restart policy needs. The API server exits with status 0 when its engine core dies; with a
headless rank gone, rank 0's /health stays 200 for 45 s, until a request fails; with rank 0 gone, a
headless rank runs on for minutes, and a new rank 0 hangs in start-up waiting for it, deaf to
SIGTERM. So recovery cannot wait for the survivors to die by themselves. The supervisor (python3,
standard library only, in the container beside vLLM) turns each of those into an exit that
docker's restart policy (or systemd's) acts on:

* any exit of vLLM, 0 included, ends the container with status 1;
* rank 0: a start that has no /health 200 within the start bound is killed (SIGTERM, then
  SIGKILL: the process group) and the container exits 1, to be started again;
* rank 0, once serving: liveness is one generated token (/v1/completions, max_tokens 1, with the
  API key) every few seconds; two failures in a row with the engine's counters still (a lost rank
  makes the next request fail or hang) kill the group and exit 1;
* the other ranks: rank 0's rendezvous port (master address:port) is probed; once it was seen up,
  three failed probes in a row (rank 0 died or its node rebooted) kill the rank's vLLM and exit 1,
  so that it joins the new rank 0 instead of holding a dead group.

The container's command is ``sh -c SCRIPT`` whose last step is ``exec python3 -c PROGRAM "$@"``
with ``vllm serve ...`` as the arguments: PROGRAM is the text of sparkprov/node/supervise.py (code that
runs on nodes lives in that package), its settings the SPARKPROV_SUPERVISE_* environment values. The
key is read from the mounted key file, never from an argv.

Rank 0's token counts as failed only when the engine's counters on /metrics did not move either
(node/supervise.py `worked`, the rule the node guard applies too): a busy engine whose queue delays
the token is working, and is not killed (issue 32: at concurrency 64 a token probe missed 10 s twice).
"""

from __future__ import annotations

import shlex
from pathlib import Path

from sparkprov.node import supervise as node_supervise
from sparkprov.node.supervise import (EVERY, GRACE, KEY_FILE, LIVENESS_EVERY_S, LIVENESS_FAILURES,  # noqa: F401
                                      LIVENESS_TIMEOUT_S, MASTER, MODEL, PORT, PROBE_EVERY_S, PROBE_FAILURES, ROLE,
                                      START_TIMEOUT, STOP_GRACE_S)


def program() -> str:
    """The supervisor's Python text: its file, as it is."""
    return Path(node_supervise.__file__).read_text()


def exec_line() -> str:
    """The shell step that hands the container's arguments (`vllm serve ...`) to the supervisor."""
    return f'exec python3 -c {shlex.quote(program())} "$@"'


def rank0_env(*, start_timeout_s: float, port: int, model: str, key_file: str | None) -> dict[str, str]:
    env = {ROLE: "rank0", START_TIMEOUT: f"{start_timeout_s:g}", PORT: str(port), MODEL: model}
    if key_file:
        env[KEY_FILE] = key_file
    return env


def rank_env(*, master_addr: str, master_port: int) -> dict[str, str]:
    host = f"[{master_addr}]" if ":" in master_addr else master_addr
    return {ROLE: "rank", MASTER: f"{host}:{master_port}"}
