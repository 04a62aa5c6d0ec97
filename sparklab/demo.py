"""`make demo`: the whole path on the lab, through the real CLI code paths.

    the lab's hosts -> provision -> stage-weights lab-tiny -> cluster-up --model lab-tiny --tp 2
    --executor native -> a chat completion through the cluster's endpoint (from this machine, with
    the API key read from its 0600 file on rank 0) -> print the endpoint

lab-tiny is served by the real vLLM (the lab's vllm-cpu image; docs/real-vllm.md), one rank per
simulated Spark over the fabric, from a model trained in the lab; the lab hub publishes it like
every catalog repo. The gated catalog repos sit behind the lab token (0600 in the lab state dir),
which the demo hands to stage-weights as HF_TOKEN. Needs root (the lab). Exit status: 0 when the
chat completion answered correctly.

What `invoke lab.up` builds and pushes (sparklab/image.py lab_images: the serving images, the smoke
image, the gateway's and Prometheus's, so that every command of the README runs on the demo lab)
builds, pushes and is pulled here beside the steps, in the order they need it (Images); each step
prints what it does and, when it ends, how long it took, and the background stages' times come at
the end (their own output goes to a log file, named). Measured on this machine's kind (2 cores,
shared): 279-346 s the whole command with every cache of the lab cold, its venv made (263-324 s of steps:
the real vLLM's image and lab-tiny built, the base beside the venv: the Makefile); 86-108 s of steps with
the caches warm on new lab hosts, the machine's disk 33-79% full (136-139 s on another machine of this
kind, where the engine's CPU-bound start slowed as much as the pulls). Of the warm steps, the stand-in's
pull and then lab-tiny's image's on both hosts take 49-79 s, each host's dockerd unpacking onto a docker
disk of its own (sparklab/hosts.py docker_disk; on a folder of the machine's aged ext4 it was 80-116 s,
and the demo 131-177 s). Run again on the lab it left: 5-9 s (nothing to change: provision 2.5-4.9 s,
stage-weights 0.6-0.8, cluster-up 0.7-1.2).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

MODEL = "lab-tiny"   # the real vLLM (a CPU build) serving a model trained in the lab: docs/real-vllm.md
HOSTS = ["spark1", "spark2"]


class Steps:
    """The demo's steps, each printed when it starts and with its time when it ends."""

    def __init__(self) -> None:
        self.t0 = time.monotonic()
        self.times: list[tuple[str, float]] = []

    @contextmanager
    def step(self, what: str):
        n = len(self.times) + 1
        print(f"\n=== demo {n}: {what}  (at {time.monotonic() - self.t0:.0f}s)", flush=True)
        t = time.monotonic()
        try:
            yield
        finally:
            secs = time.monotonic() - t
            self.times.append((what, secs))
            print(f"=== demo {n}: {what.split(':')[0]} took {secs:.1f}s", flush=True)


class Images:
    """The lab's images, built (cached), pushed and pulled beside the demo's steps, in the order they need
    them, in three lines at once (each stage of a line waits for the one before it, and for its `after`):

        chain     the smoke image and a stand-in serving image (the base and torch layers, which the
                  real vLLM's image shares) pushed; lab-tiny, trained in the rootfs of the real vLLM's
                  layer as that builds (sparklab/tinymodel.py); lab-tiny's image pushed; the hub that
                  publishes lab-tiny; the catalog's other images pushed
        pull      on both hosts at once: the stand-in image (its layers arrive while the real vLLM's
                  builds), then lab-tiny's (stage-weights downloads in it, and cluster-up's image play
                  finds it there)
        services  the gateway's and Prometheus's layers (sparklab/image.py readme_images: a cache
                  folder and lock of their own), then pushed

    A build or push is `python -m sparklab.image` (or sparklab.tinymodel) in a process of its own, its
    output to `log`; a stage that pushes waits for the registry (lab.up makes it: `registry_is`)."""

    def __init__(self, log: Path):
        from sparklab.image import NORAY_IMAGE, SMOKE_IMAGE, default_images, readme_images
        from sparkprov.catalog.load import load_catalog

        self.log = log
        self.model_image = load_catalog().get(MODEL).image
        push = [sys.executable, "-m", "sparklab.image", "--registry", "{registry}"]
        first = [SMOKE_IMAGE, NORAY_IMAGE]
        rest = [i for i in default_images() if i not in first + [self.model_image]]
        # (name, what it runs, the stages it waits for besides the one before it in its line)
        self.lines = {
            "chain": [("stand-in pushed", push + first, ()),
                      ("lab-tiny", [sys.executable, "-m", "sparklab.tinymodel"], ()),
                      ("model image pushed", push + [self.model_image], ()),
                      ("hub", "hub", ()),
                      ("serving", push + rest, ())],
            "pull": [("stand-in pulled", ("pull", NORAY_IMAGE), ("stand-in pushed",)),
                     ("pulled", ("pull", self.model_image), ("model image pushed",))],
            "services": [("services built", [sys.executable, "-m", "sparklab.image", *readme_images()], ()),
                         ("readme", push + readme_images(), ())]}
        self.ready = {name: threading.Event() for line in self.lines.values() for name, _, _ in line}
        self.times: dict[str, float] = {}
        self.failed: dict[str, str] = {}
        self.registry = ""
        self._registry = threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(line,), daemon=True) for line in self.lines.values()]

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def registry_is(self, url: str) -> None:
        self.registry = url
        self._registry.set()

    def _run(self, line) -> None:
        from sparklab.hub import ensure_lab_hub
        from sparklab.state import BRIDGE_IP, HUB_PORT, STATE_DIR

        for name, what, after in line:
            for other in after:
                self.ready[other].wait()
            t = time.monotonic()
            try:
                if any(other in self.failed for other in after):
                    raise RuntimeError(f"{', '.join(after)} failed")
                if what == "hub":
                    ensure_lab_hub(STATE_DIR, BRIDGE_IP, HUB_PORT)
                elif isinstance(what, tuple):
                    self._pull(name, what[1])
                else:
                    if "{registry}" in what:
                        self._registry.wait()
                        what = [self.registry if a == "{registry}" else a for a in what]
                    with open(self.log, "a") as out:
                        r = subprocess.run(what, stdout=out, stderr=subprocess.STDOUT)
                    if r.returncode:
                        self.failed[name] = f"{' '.join(what[1:3])} exited {r.returncode} (see {self.log})"
            except Exception as e:  # noqa: BLE001 - said when a step waits for it
                self.failed[name] = f"{type(e).__name__}: {e}"
            self.times[name] = time.monotonic() - t
            self.ready[name].set()

    def _pull(self, name: str, image: str) -> None:
        """`image` pulled on every host at once (from the lab registry, as docker_image's pull does)."""
        from concurrent.futures import ThreadPoolExecutor

        from sparklab.hosts import nsexec

        with ThreadPoolExecutor(len(HOSTS)) as pool:
            for r in pool.map(lambda h: nsexec(h, ["docker", "pull", "-q", image], check=False, timeout=900), HOSTS):
                if r.returncode:
                    self.failed[name] = f"docker pull {image}: {(r.stderr or r.stdout).strip()[-300:]}"

    def wait_for(self, name: str) -> None:
        t = time.monotonic()
        self.ready[name].wait()
        waited = time.monotonic() - t
        if waited >= 1:
            print(f"demo: waited {waited:.0f}s for the images' {name} stage ({self.log})", flush=True)
        if name in self.failed:
            raise RuntimeError(f"the lab's {name} stage: {self.failed[name]}")


def main() -> int:
    from invoke import Context

    from sparkprov.cli import cluster as cluster_cli
    from sparkprov.cli.common import REPO, run_playbook
    from sparkprov.cli.stage import stage_weights
    from sparkprov.data.inventory import load_inventory
    from sparkprov.engine.run import make_transport
    from sparklab import state, up as lab_up
    from sparklab.hub import lab_token

    steps = Steps()
    log = state.cache_root() / "demo-images.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    log.unlink(missing_ok=True)
    images = Images(log)
    images.start()
    print(f"demo: the lab's images build beside the steps below (log: {images.log})", flush=True)
    with steps.step("lab.up: two simulated Sparks (namespaces, sshd, dockerd, the fabric), the registry"):
        res = lab_up.up(2, images=False, hub=False)
        images.registry_is(res.registry_url)
    # the inventory the README's commands use (inventory.yaml as shipped points at this lab; it asks
    # more than the lab's own, e.g. the GPU smoke test): the README's first command after the demo
    # is then a second run, changed=0 (with the lab's own, it changed three things on each host)
    inv_path = str(REPO / "inventory.yaml")
    os.environ["SPARKPROV_INVENTORY"] = inv_path
    inv = load_inventory(inv_path)
    os.environ["HF_TOKEN"] = lab_token(state.STATE_DIR)

    with steps.step("provision"):
        if any(h.vars.get("smoke_image") for h in inv.hosts.values()):  # its GPU smoke test's image
            images.wait_for("stand-in pushed")
        code = run_playbook(playbook=str(REPO / "playbooks" / "provision.yaml"), inventory=inv_path, hosts=None)
        if code:
            print("demo: provision failed", file=sys.stderr)
            return code

    with steps.step(f"stage-weights {MODEL} (from the lab hub, once lab-tiny is trained)"):
        images.wait_for("hub")
        images.wait_for("model image pushed")  # the download runs in the model's image
        stage_weights(Context(), MODEL, inventory=inv_path)

    with steps.step(f"cluster-up --model {MODEL} --tp 2 --executor native (the real vLLM, one rank per Spark)"):
        images.wait_for("model image pushed")
        try:
            cluster_cli.cluster_up(Context(), model=MODEL, tp=2, executor="native", hosts=",".join(HOSTS),
                                   inventory=inv_path)
        except SystemExit as exc:  # cluster-up ends through finish(): only a failure stops the demo
            if exc.code:
                print("demo: cluster-up failed", file=sys.stderr)
                return int(exc.code)

    with steps.step("a chat completion through the cluster"):
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

    with steps.step("the catalog's and the README's other images (gateway, Prometheus) in the lab registry"):
        for stage in ("serving", "readme", "pulled"):
            images.wait_for(stage)

    print(f"\nendpoint: {endpoint}  (model {model}, API key in {HOSTS[0]}:{key_file}; "
          f"ssh -i {state.key_path()} nvidia@{host.address} cat {key_file})")
    print("The lab hub's gated repos take the lab's token: export HF_TOKEN=$(cat "
          f"{state.STATE_DIR / 'hf_token'}). `invoke cluster-down` removes the cluster, `invoke lab.down` the lab.")
    print(f"\ndemo took {time.monotonic() - steps.t0:.0f}s:")
    for n, (what, secs) in enumerate(steps.times, 1):
        print(f"  {n}. {what.split(' (')[0]:<70} {secs:6.1f}s")
    print("  beside them, " + ", ".join(f"{k} {v:.0f}s" for k, v in images.times.items()) + f" ({images.log})")
    return 0 if ok else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except RuntimeError as e:  # a build or push beside the steps failed: its line, and where its log is
        print(f"demo: {e}", file=sys.stderr)
        sys.exit(1)
