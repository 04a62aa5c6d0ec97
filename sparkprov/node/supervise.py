"""The rank supervisor, run in every container of a native multi-node deployment as
`python3 -c TEXT vllm serve ...` (TEXT: this file; why it exists: sparkprov/serving/supervise.py).
Settings come from the SPARKPROV_SUPERVISE_* environment; the API key from its mounted file.
Also the rule it shares with the node guard: an engine whose counters on /metrics move is working.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

ROLE = "SPARKPROV_SUPERVISE_ROLE"            # rank0 | rank
START_TIMEOUT = "SPARKPROV_SUPERVISE_START_S"
PORT = "SPARKPROV_SUPERVISE_PORT"            # rank 0's API port (on 127.0.0.1)
MODEL = "SPARKPROV_SUPERVISE_MODEL"          # rank 0's served model name
MASTER = "SPARKPROV_SUPERVISE_MASTER"        # the other ranks: rank 0's rendezvous HOST:PORT
KEY_FILE = "SPARKPROV_SUPERVISE_KEY_FILE"    # rank 0: the API key file inside the container
EVERY = "SPARKPROV_SUPERVISE_EVERY_S"        # optional: seconds between liveness checks
GRACE = "SPARKPROV_SUPERVISE_GRACE_S"        # optional: seconds between SIGTERM and SIGKILL

# Seconds between liveness checks (rank 0) and rendezvous probes (other ranks), the failures in a
# row that end the group, and how long vLLM gets between SIGTERM and SIGKILL.
LIVENESS_EVERY_S = 5
LIVENESS_TIMEOUT_S = 15
LIVENESS_FAILURES = 2
PROBE_EVERY_S = 1
PROBE_FAILURES = 3
STOP_GRACE_S = 10

# -- the engine's work, read from vLLM's /metrics ------------------------------------------------
# vLLM's counters of tokens done (prompt tokens count when a request's prefill ends) and the gauges its
# scheduler sets after every engine step (requests running and waiting, KV-cache use, which moves with
# each chunk of a long prefill): while the engine core steps, one of them changes; a stopped or wedged
# core changes none (the API server keeps answering, /health 200). prometheus_client serves only the
# names asked for (`name[]`); a server that ignores it sends all, and the parser reads what it needs.
ENGINE_SAMPLES = ("vllm:generation_tokens_total", "vllm:prompt_tokens_total", "vllm:num_requests_running",
                  "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")
ENGINE_METRICS_PATH = "/metrics?" + "&".join("name[]=" + n for n in ENGINE_SAMPLES)
_SAMPLE = re.compile(r"^(vllm:[a-z_]+)(?:\{[^}]*\})?\s+([-+0-9.eE]+|NaN)\s*$", re.M)


def parse_engine(text: str | None) -> dict[str, float] | None:
    """ENGINE_SAMPLES' values (summed over engines and label sets) from /metrics, by short name:
    generation, prompt, running, waiting, kv. None when the text has no token counter."""
    if not text:
        return None
    sums: dict[str, float] = {}
    for name, value in _SAMPLE.findall(text):
        if name in ENGINE_SAMPLES and value != "NaN":
            sums[name] = sums.get(name, 0.0) + float(value)
    if "vllm:generation_tokens_total" not in sums:
        return None
    short = ("generation", "prompt", "running", "waiting", "kv")
    return {k: sums.get(n, 0.0) for k, n in zip(short, ENGINE_SAMPLES)}


def worked(before: dict | None, after: dict | None) -> bool:
    """Whether the engine stepped between two readings: a token counted, or a gauge its scheduler
    sets after each step changed. Unknown (a reading missing) is not work."""
    if not before or not after:
        return False
    return any(before.get(k) != after.get(k) for k in ("generation", "prompt", "running", "waiting", "kv"))


def work_done(before: dict | None, after: dict | None) -> str:
    """What changed between two readings, for a log line or the guard's journal."""
    if not before or not after:
        return "no reading"
    parts = [f"+{after[k] - before[k]:g} {k} tokens" for k in ("generation", "prompt") if after[k] != before[k]]
    parts += [f"{k} {before[k]:g} -> {after[k]:g}" for k in ("running", "waiting", "kv") if after[k] != before[k]]
    return ", ".join(parts) or "nothing"


# -- the supervisor --------------------------------------------------------------------------------

def log(msg: str) -> None:
    print("sparkprov-supervise: " + msg, file=sys.stderr, flush=True)


# Long on purpose: one loop whose closures share the child process (stop, http, rendezvous_up); it is
# sent into each rank's container as this file's text.
def main(argv: list[str]) -> None:
    env = os.environ
    role = env[ROLE]
    start_s = float(env.get(START_TIMEOUT) or 900)
    every_s = float(env.get(EVERY) or LIVENESS_EVERY_S)
    grace_s = float(env.get(GRACE) or STOP_GRACE_S)
    child = subprocess.Popen(argv, start_new_session=True, stdin=subprocess.DEVNULL)

    def stop(code: int, why: str) -> None:
        log(why + ("; stopping vLLM" if child.poll() is None else ""))
        for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5)):
            if child.poll() is not None:
                break
            try:
                os.killpg(child.pid, sig)
            except ProcessLookupError:
                break
            try:
                child.wait(wait)
            except subprocess.TimeoutExpired:
                pass
        sys.exit(code)

    signal.signal(signal.SIGTERM, lambda *a: stop(0, "SIGTERM"))
    signal.signal(signal.SIGINT, lambda *a: stop(0, "SIGINT"))
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    def http(path: str, body: dict | None = None, timeout: float = 5) -> tuple[int | None, str]:
        req = urllib.request.Request("http://127.0.0.1:%s%s" % (env[PORT], path),
                                     data=None if body is None else json.dumps(body).encode())
        req.add_header("Content-Type", "application/json")
        kf = env.get(KEY_FILE)
        if kf:
            try:
                with open(kf) as fh:
                    req.add_header("Authorization", "Bearer " + fh.read().strip())
            except OSError:
                pass
        try:
            with opener.open(req, timeout=timeout) as r:
                return r.status, r.read().decode("utf-8", "replace")
        except urllib.error.HTTPError as e:
            return e.code, ""
        except Exception:
            return None, ""

    def rendezvous_up() -> bool:
        host, _, port = env[MASTER].rpartition(":")
        try:
            socket.create_connection((host.strip("[]"), int(port)), timeout=2).close()
            return True
        except OSError:
            return False

    t0, serving, failures, seen_up, last = time.time(), False, 0, False, None
    while True:
        time.sleep(PROBE_EVERY_S if role != "rank0" or not serving else every_s)
        code = child.poll()
        if code is not None:
            log("vLLM exited with status %s" % code)
            sys.exit(1)
        if role == "rank0":
            if not serving:
                if http("/health")[0] == 200:
                    serving, last = True, parse_engine(http(ENGINE_METRICS_PATH)[1])
                    log("serving after %.0fs" % (time.time() - t0))
                elif time.time() - t0 > start_s:
                    stop(1, "no /health 200 within %.0fs of the start" % start_s)
                continue
            st, _ = http("/v1/completions", {"model": env[MODEL], "prompt": "1", "max_tokens": 1, "temperature": 0},
                         timeout=LIVENESS_TIMEOUT_S)
            now = parse_engine(http(ENGINE_METRICS_PATH)[1])
            if st == 200:
                failures = 0
            elif worked(last, now):
                # a busy engine: its queue delays our token, its counters show it working
                log("liveness: one token -> %s, but the engine worked (%s): not a failure" % (st, work_done(last, now)))
                failures = 0
            else:
                failures += 1
                log("liveness: one token -> %s (%d in a row)" % (st, failures))
            last = now
            if failures >= LIVENESS_FAILURES:
                stop(1, "no token generated %d times in a row: a rank is lost or the engine is hung" % failures)
        else:
            if rendezvous_up():
                seen_up, failures = True, 0
            elif seen_up:
                failures += 1
                if failures >= PROBE_FAILURES:
                    stop(1, "the rendezvous of rank 0 (%s) is gone (rank 0 died or restarted)" % env[MASTER])


if __name__ == "__main__":
    main(sys.argv[1:])
