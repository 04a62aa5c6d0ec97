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
  API key) every few seconds; two failures in a row (a lost rank makes the next request fail or
  hang) kill the group and exit 1;
* the other ranks: rank 0's rendezvous port (master address:port) is probed; once it was seen up,
  three failed probes in a row (rank 0 died or its node rebooted) kill the rank's vLLM and exit 1,
  so that it joins the new rank 0 instead of holding a dead group.

The container's command is ``sh -c SCRIPT`` whose last step is ``exec python3 -c PROGRAM "$@"``
with ``vllm serve ...`` as the arguments; its settings come from the SPARKPROV_SUPERVISE_*
environment values below. The key is read from the mounted key file, never from an argv.
"""

from __future__ import annotations

import shlex

# environment of the supervised container
ROLE = "SPARKPROV_SUPERVISE_ROLE"            # rank0 | rank
START_TIMEOUT = "SPARKPROV_SUPERVISE_START_S"
PORT = "SPARKPROV_SUPERVISE_PORT"            # rank 0's API port (on 127.0.0.1)
MODEL = "SPARKPROV_SUPERVISE_MODEL"          # rank 0's served model name
MASTER = "SPARKPROV_SUPERVISE_MASTER"        # the other ranks: rank 0's rendezvous HOST:PORT
KEY_FILE = "SPARKPROV_SUPERVISE_KEY_FILE"    # rank 0: the API key file inside the container
EVERY = "SPARKPROV_SUPERVISE_EVERY_S"        # optional: seconds between liveness checks
GRACE = "SPARKPROV_SUPERVISE_GRACE_S"        # optional: seconds between SIGTERM and SIGKILL

# Seconds between liveness checks (rank 0) and rendezvous probes (other ranks), the failures in a
# row that end the group, and how long vLLM gets between SIGTERM and SIGKILL (the first and the
# last may be set per container through EVERY and GRACE).
LIVENESS_EVERY_S = 5
LIVENESS_TIMEOUT_S = 15
LIVENESS_FAILURES = 2
PROBE_EVERY_S = 1
PROBE_FAILURES = 3
STOP_GRACE_S = 10

PROGRAM = r'''
import json, os, signal, socket, subprocess, sys, time, urllib.error, urllib.request
E = os.environ
role = E["@ROLE@"]
start_s = float(E.get("@START@") or 900)
every_s = float(E.get("@EVERY_ENV@") or @EVERY@)
grace_s = float(E.get("@GRACE_ENV@") or @GRACE@)
def log(msg):
    print("sparkprov-supervise: " + msg, file=sys.stderr, flush=True)
child = subprocess.Popen(sys.argv[1:], start_new_session=True, stdin=subprocess.DEVNULL)
def stop(code, why):
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
def http(path, body=None, timeout=5):
    req = urllib.request.Request("http://127.0.0.1:%s%s" % (E["@PORT@"], path),
                                 data=None if body is None else json.dumps(body).encode())
    req.add_header("Content-Type", "application/json")
    kf = E.get("@KEY_FILE@")
    if kf:
        try:
            with open(kf) as fh:
                req.add_header("Authorization", "Bearer " + fh.read().strip())
        except OSError:
            pass
    try:
        with opener.open(req, timeout=timeout) as r:
            r.read()
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except Exception:
        return None
def rendezvous_up():
    host, _, port = E["@MASTER@"].rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=2).close()
        return True
    except OSError:
        return False
t0, serving, failures, seen_up = time.time(), False, 0, False
while True:
    time.sleep(@PROBE@ if role != "rank0" or not serving else every_s)
    code = child.poll()
    if code is not None:
        log("vLLM exited with status %s" % code)
        sys.exit(1)
    if role == "rank0":
        if not serving:
            if http("/health") == 200:
                serving = True
                log("serving after %.0fs" % (time.time() - t0))
            elif time.time() - t0 > start_s:
                stop(1, "no /health 200 within %.0fs of the start" % start_s)
            continue
        st = http("/v1/completions", {"model": E["@MODEL@"], "prompt": "1", "max_tokens": 1, "temperature": 0},
                  timeout=@TIMEOUT@)
        failures = 0 if st == 200 else failures + 1
        if failures:
            log("liveness: one token -> %s (%d in a row)" % (st, failures))
        if failures >= @FAILURES@:
            stop(1, "no token generated %d times in a row: a rank is lost or the engine is hung" % failures)
    else:
        if rendezvous_up():
            seen_up, failures = True, 0
        elif seen_up:
            failures += 1
            if failures >= @PFAILURES@:
                stop(1, "the rendezvous of rank 0 (%s) is gone (rank 0 died or restarted)" % E["@MASTER@"])
'''


def program() -> str:
    """The supervisor's Python text, with its settings' names and bounds filled in."""
    return (PROGRAM.strip("\n")
            .replace("@ROLE@", ROLE).replace("@START@", START_TIMEOUT).replace("@PORT@", PORT)
            .replace("@MODEL@", MODEL).replace("@MASTER@", MASTER).replace("@KEY_FILE@", KEY_FILE)
            .replace("@EVERY_ENV@", EVERY).replace("@GRACE_ENV@", GRACE)
            .replace("@GRACE@", str(STOP_GRACE_S)).replace("@PROBE@", str(PROBE_EVERY_S))
            .replace("@EVERY@", str(LIVENESS_EVERY_S)).replace("@TIMEOUT@", str(LIVENESS_TIMEOUT_S))
            .replace("@FAILURES@", str(LIVENESS_FAILURES)).replace("@PFAILURES@", str(PROBE_FAILURES)))


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
