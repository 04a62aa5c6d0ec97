"""`make demo`: the whole path on the lab, through the real CLI code paths.

    lab.up (2 Sparks) -> provision -> stage-weights MODEL -> cluster-up --tp 2 -> a chat completion
    through the cluster's endpoint (from this machine, with the API key read from its 0600 file on
    the head) -> print the endpoint

The lab hub serves every catalog repo (lab.up generates them small, with the catalog's config.json
values); the model is gated in the catalog (G26), so the lab hub gates it behind the lab token
(0600 in the lab state dir), which the demo hands to stage-weights as HF_TOKEN. Needs root (the lab). Exit status: 0 when the chat completion answered correctly.
"""

from __future__ import annotations

import io
import json
import os
import sys
import time
import urllib.request

PLAYBOOK = "cluster.yaml"


def _step(n: int, text: str) -> None:
    print(f"\n=== demo {n}: {text}", flush=True)


def _hub_token() -> str:
    """The lab hub (as lab.up left it: every catalog repo; nothing restarted) and its token."""
    from sparkprov.lab.hub import ensure_lab_hub, lab_token
    from sparkprov.lab.state import BRIDGE_IP, HUB_PORT, STATE_DIR

    ensure_lab_hub(STATE_DIR, BRIDGE_IP, HUB_PORT)
    return lab_token(STATE_DIR)


def main() -> int:
    from sparkprov.cli import cluster as cluster_cli
    from sparkprov.cli.common import REPO, engine_options, playbook_path, run_playbook
    from sparkprov.cli.stage import stage_weights
    from sparkprov.plays import serve as plays
    from sparkprov.engine.report import Report
    from sparkprov.serving.playbook import load_serve_playbook
    from sparkprov.data.inventory import load_inventory
    from sparkprov.engine.run import make_transport
    from sparkprov.lab import state, up as lab_up

    t0 = time.monotonic()
    _step(1, "lab.up: two simulated Sparks, registry with the serving images, hub")
    res = lab_up.up(2)
    inv_path = str(res.inventory)
    os.environ["SPARKPROV_INVENTORY"] = inv_path
    inv = load_inventory(inv_path)
    book = load_serve_playbook(playbook_path(None, PLAYBOOK), inv)
    dep = next(d for d in book.deployments if d.cluster)
    os.environ["HF_TOKEN"] = _hub_token()

    _step(2, "provision")
    code = run_playbook(playbook=str(REPO / "playbooks" / "provision.yaml"), inventory=inv_path, hosts=None)
    if code:
        print("demo: provision failed", file=sys.stderr)
        return code

    _step(3, f"stage-weights {dep.model}")
    stage_weights(None, dep.model, inventory=inv_path)

    _step(4, f"cluster-up --model {dep.model} --tp 2")
    cluster_cli.cluster_up(None, model=dep.model, tp=2, hosts=",".join(dep.hosts), inventory=inv_path)

    _step(5, "a chat completion through the cluster")
    runner = plays.run_book(inv, plays.status_book(dep.hosts), dep.hosts, engine_options(),
                            Report(io.StringIO(), quiet=True))
    st = {h: (runner.exports.get(h) or {}).get("serving_status") or {} for h in dep.hosts}
    head = next(c for c in st[dep.head]["containers"] if c["labels"].get("sparkprov.role") == "ray-head")
    head["model"] = head["labels"]["sparkprov.model"]
    host = inv.hosts[dep.head]
    endpoint = f"http://{host.address}:{head['port']}/v1"
    t = make_transport(host, False)
    t.connect()
    try:
        labels = t.run_script(f"docker inspect --format '{{{{index .Config.Labels \"sparkprov.api_key_file\"}}}}' {head['name']}")
        key_file = labels.stdout.strip()
        key = t.run_script(f"cat '{key_file}'").stdout.strip()
    finally:
        t.close()
    body = {"model": head["model"], "max_tokens": 300, "chat_template_kwargs": {"enable_thinking": False},
            "messages": [{"role": "user", "content": "What is 12*17?"}]}
    req = urllib.request.Request(endpoint + "/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
    with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(req, timeout=300) as r:
        reply = json.loads(r.read())
    answer = reply["choices"][0]["message"]["content"]
    print(f"Q: What is 12*17?\nA: {answer}")
    ok = "204" in (answer or "")
    _step(6, "done")
    print(f"endpoint: {endpoint}  (model {head['model']}, API key in {dep.head}:{key_file}; "
          f"ssh -i {state.key_path()} nvidia@{host.address} cat {key_file})")
    print(f"demo took {time.monotonic() - t0:.0f}s; `invoke cluster-down` removes the cluster, `invoke lab.down` the lab")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
