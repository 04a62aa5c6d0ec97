"""The lab engine across lab hosts in the lab's images, run by hand (no sparkprov supervisor):
vLLM's native multi-node over the fabric, and what a bare group does when a node is power-cycled,
as the real vLLM was measured to (docs/real-vllm.md): a lost headless rank leaves rank 0 answering
/health until a request fails (or its group timeout passes), then it exits 0 and its restart
policy lets the group form again; a lost rank 0 strands the headless rank, so the group never
comes back by itself. (tests/lab/test_real_vllm.py and test_cluster.py show sparkprov's rank
supervisor bringing both back.)"""
# Engine: the stand-in, run by hand without sparkprov's supervisor (what a bare group does).
from __future__ import annotations

import json
import shutil
import time
import urllib.error
import urllib.request

import pytest

from sparklab import faults, image, state
from sparklab.engine.testing import make_repo
from tests.lab.conftest import require

pytestmark = pytest.mark.lab

DOCKER = "docker -H unix:///run/docker.sock"
RAIL = "enp1s0f1np1"
ADDR = {"spark1": "192.168.177.11", "spark2": "192.168.177.12"}
NETPLAN = "/etc/netplan/40-sparkprov-fabric.yaml"
IMAGE = "nvcr.io/nvidia/vllm:26.04-py3"   # its lab image has no Ray, like the real one
MPORT = 29555
NAME = "mn-native"
GROUP_TIMEOUT = 10   # seconds a rank waits for a silent peer (a peer that lost power says nothing)
LOST_RANK = 5        # seconds rank 0 keeps /health 200 with no request after a rank is lost (45 measured)


def _netplan(addr: str) -> str:
    return ("network:\n  version: 2\n  ethernets:\n    enp1s0f1np1:\n      dhcp4: false\n"
            f"      dhcp6: false\n      mtu: 9000\n      addresses: [{addr}/24]\n")


def _health(addr: str, port: int = 8000) -> int | None:
    try:
        with urllib.request.urlopen(f"http://{addr}:{port}/health", timeout=3) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except (urllib.error.URLError, OSError):
        return None


def _chat(addr: str) -> str:
    body = json.dumps({"messages": [{"role": "user", "content": "What is 17 + 25? /no_think"}]}).encode()
    with urllib.request.urlopen(urllib.request.Request(f"http://{addr}:8000/v1/chat/completions", data=body),
                                timeout=30) as r:
        return json.loads(r.read())["choices"][0]["message"]["content"]


def _wait(pred, timeout: float):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.5)
    return bool(pred())


@pytest.fixture(scope="module")
def fabric(lab):
    """Both rails' first twin addressed live and persisted in netplan, as provision leaves them."""
    for h, a in ADDR.items():
        saved = lab.sh(h, "mkdir -p /root/netplan-saved && cp -a /etc/netplan/. /root/netplan-saved/ "
                          "2>/dev/null; rm -f /etc/netplan/*.yaml; true")
        assert saved.returncode == 0
        assert lab.sh(h, f"umask 077; mkdir -p /etc/netplan; cat > {NETPLAN}", input=_netplan(a)).returncode == 0
        # the rail as this test persists it, and only that: earlier tests of the session provisioned
        # other addresses on it, which a real rail would not carry beside these
        assert lab.sh(h, f"ip addr flush dev {RAIL} scope global && ip addr replace {a}/24 dev {RAIL} "
                         f"&& ip link set {RAIL} mtu 9000 up").returncode == 0
    assert lab.sh("spark1", f"ping -c 1 -W 2 -M do -s 8972 {ADDR['spark2']}").returncode == 0
    yield ADDR
    for h in ADDR:
        lab.sh(h, "rm -f /etc/netplan/*.yaml; cp -a /root/netplan-saved/. /etc/netplan/ 2>/dev/null; "
                  f"rm -rf /root/netplan-saved; ip addr flush dev {RAIL}; ip link set {RAIL} mtu 1500")


@pytest.fixture(scope="module")
def hf_store(lab):
    """A tiny model in each host's /home/mn-hf (mounted as HF_HOME), removed afterwards."""
    dirs = [state.host_dir(h) / "fs" / "home" / "mn-hf" for h in ADDR]
    for d in dirs:
        make_repo(str(d), "Qwen/Qwen3-0.6B")
    yield
    for d in dirs:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def served_image(lab, hf_store):
    url = state.LabRecord.load().registry_url
    require([] if url else ["the lab registry (lab.up did not start it: docker-registry, make deps)"])
    image.ensure_images(url, [IMAGE])
    for h in ADDR:
        r = lab.sh(h, f"{DOCKER} pull -q {IMAGE}", timeout=300)
        assert r.returncode == 0, r.stderr
    return IMAGE


def _run_rank(lab, host: str, rank: int) -> None:
    extra = "--headless" if rank else ""
    cmd = (f"{DOCKER} run -d --name {NAME} --restart unless-stopped --network host "
           f"-e HF_HOME=/hf -e HF_HUB_OFFLINE=1 -e GLOO_SOCKET_IFNAME={RAIL} -e VLLM_HOST_IP={ADDR[host]} "
           "-e LAB_ENGINE_LOAD_SECONDS=0.5 -e LAB_ENGINE_COLLECTIVE_BYTES=1048576 -v /home/mn-hf:/hf "
           f"-e LAB_ENGINE_GROUP_TIMEOUT={GROUP_TIMEOUT} -e LAB_ENGINE_LOST_RANK_SECONDS={LOST_RANK} {IMAGE} vllm serve Qwen/Qwen3-0.6B --port 8000 -tp 2 --nnodes 2 --node-rank {rank} "
           f"--master-addr {ADDR['spark1']} --master-port {MPORT} {extra}")
    r = lab.sh(host, cmd)
    assert r.returncode == 0, r.stderr


def _state(lab, host):
    return lab.sh(host, f"{DOCKER} inspect -f '{{{{.State.Status}}}} {{{{.RestartCount}}}}' {NAME}").stdout.split()


def test_native_group_over_the_fabric_and_a_lost_rank0_without_a_supervisor(lab, fabric, served_image):
    """A bare group (no sparkprov supervisor) serves over the fabric; with rank 0's node rebooted,
    the headless rank is stranded in the old group (it neither exits nor rejoins, as measured), so
    the new rank 0 never serves. (A lost headless rank: test_lab_engine.py shows rank 0's /health
    staying 200 until a request fails; test_real_vllm.py reboots each node of a supervised group on
    the real vLLM and sees it serve again.)"""
    head = lab.hosts["spark1"]
    for h in ADDR:
        lab.sh(h, f"{DOCKER} rm -f {NAME}")
    try:
        # no Ray in this image: a Ray cluster cannot even start there
        r = lab.sh("spark1", f"{DOCKER} run --rm --entrypoint sh {IMAGE} -c 'ray --version'")
        assert r.returncode == 127, (r.returncode, r.stdout, r.stderr)
        _run_rank(lab, "spark1", 0)
        time.sleep(3)
        assert _health(head) == 503   # rank 0 waits for the other node
        _run_rank(lab, "spark2", 1)
        assert _wait(lambda: _health(head) == 200, 120), lab.sh("spark1", f"{DOCKER} logs {NAME}").stderr
        assert "42" in _chat(head)
        logs = lab.sh("spark1", f"{DOCKER} logs {NAME}").stderr
        assert f"all-reduce OK over {ADDR['spark1']} (GLOO_SOCKET_IFNAME={RAIL})" in logs, logs
        assert _health(lab.hosts["spark2"]) is None   # headless: no API
        restarts_before = int(_state(lab, "spark2")[1])

        t0 = time.monotonic()
        out = faults.apply("reboot", "spark1")
        assert f"{RAIL}: up, mtu 9000, address {ADDR['spark1']}/24" in out, out
        time.sleep(GROUP_TIMEOUT + LOST_RANK + 10)
        assert _state(lab, "spark2") == ["running", str(restarts_before)], _state(lab, "spark2")
        assert _health(head) != 200, "a bare group came back although its headless rank was stranded"
        assert _state(lab, "spark1")[0] == "running"
        print("native TP2, no supervisor: reboot of spark1 -> the headless rank stays stranded, "
              f"rank 0 not serving {time.monotonic() - t0:.1f}s later")
    finally:
        for h in ADDR:
            lab.sh(h, f"{DOCKER} rm -f {NAME}")


def test_native_group_does_not_come_back_without_a_persisted_fabric(lab, fabric, served_image):
    head = lab.hosts["spark1"]
    for h in ADDR:
        lab.sh(h, f"{DOCKER} rm -f {NAME}")
    lab.sh("spark2", f"mv {NETPLAN} /root/fabric.yaml.off")
    try:
        _run_rank(lab, "spark1", 0)
        _run_rank(lab, "spark2", 1)
        assert _wait(lambda: _health(head) == 200, 120)
        faults.apply("reboot", "spark2")
        # spark2's rank comes back (restart policy) but cannot join: no address on its rail
        def logs():
            r = lab.sh("spark2", f"{DOCKER} logs --tail 40 {NAME}")
            return r.stdout + r.stderr
        assert _wait(lambda: "Unable to find address for: enp1s0f1np1" in logs(), 90), logs()
        # rank 0 heard nothing (a power cut sends no FIN, and spark2's rail has no address to
        # answer from): it notices by the group's timeout, dies, restarts, and waits for a rank
        # that never joins
        t0 = time.monotonic()
        assert _wait(lambda: _health(head) != 200, GROUP_TIMEOUT + 30)
        print(f"native TP2, no fabric after reboot: rank 0 unhealthy {time.monotonic() - t0:.1f}s later")
        time.sleep(5)
        assert _health(head) != 200
        assert lab.sh("spark1", f"ping -c 1 -W 1 {ADDR['spark2']}").returncode != 0
    finally:
        lab.sh("spark2", f"mv /root/fabric.yaml.off {NETPLAN}; ip addr replace {ADDR['spark2']}/24 dev {RAIL}; "
                         f"ip link set {RAIL} mtu 9000")
        for h in ADDR:
            lab.sh(h, f"{DOCKER} rm -f {NAME}")


RAY_IMAGE = image.RAY_IMAGE
RAY_NAME = "mn-ray"


def test_ray_tp2_engine_dies_when_the_worker_node_reboots(lab, fabric, hf_store):
    """The issue-12 report: after spark2 went away the head kept serving as a healthy TP 2
    engine with Ray reporting 1 node. Real vLLM dies with its Ray worker; so must the lab's."""
    import threading
    url = state.LabRecord.load().registry_url
    require([] if url else ["the lab registry (lab.up did not start it: docker-registry, make deps)"])
    image.ensure_images(url, [RAY_IMAGE])
    head = lab.hosts["spark1"]
    env = (f"-e HF_HOME=/hf -e HF_HUB_OFFLINE=1 -e GLOO_SOCKET_IFNAME={RAIL} -e LAB_ENGINE_LOAD_SECONDS=0.5 "
           "-e LAB_ENGINE_COLLECTIVE_BYTES=1048576 -e RAY_USAGE_STATS_ENABLED=0 -v /home/mn-hf:/hf")
    for h in ADDR:
        assert lab.sh(h, f"{DOCKER} pull -q {RAY_IMAGE}", timeout=300).returncode == 0
        lab.sh(h, f"{DOCKER} rm -f {RAY_NAME}")
    try:
        r = lab.sh("spark1", f"{DOCKER} run -d --name {RAY_NAME} --network host --shm-size 1g {env} "
                             f"-e VLLM_HOST_IP={ADDR['spark1']} {RAY_IMAGE} ray start --head --block "
                             f"--node-ip-address {ADDR['spark1']} --port 6379 --num-gpus 1 --num-cpus 2 "
                             "--include-dashboard=false --disable-usage-stats")
        assert r.returncode == 0, r.stderr
        r = lab.sh("spark2", f"{DOCKER} run -d --name {RAY_NAME} --network host --shm-size 1g {env} "
                             f"-e VLLM_HOST_IP={ADDR['spark2']} {RAY_IMAGE} ray start --block "
                             f"--address {ADDR['spark1']}:6379 --node-ip-address {ADDR['spark2']} "
                             "--num-gpus 1 --num-cpus 2 --disable-usage-stats")
        assert r.returncode == 0, r.stderr
        gpus = ("python -c \"import ray; ray.init(address='auto', logging_level='ERROR'); "
                "print(int(ray.cluster_resources().get('GPU', 0)))\"")
        assert _wait(lambda: lab.sh("spark1", f"{DOCKER} exec {RAY_NAME} {gpus}").stdout.strip()[-1:] == "2",
                     180), lab.sh("spark1", f"{DOCKER} logs --tail 20 {RAY_NAME}").stderr
        r = lab.sh("spark1", f"{DOCKER} exec -d {RAY_NAME} sh -c 'vllm serve Qwen/Qwen3-0.6B --port 8000 -tp 2 "
                             "--distributed-executor-backend ray > /tmp/engine.log 2>&1'")
        assert r.returncode == 0, r.stderr
        assert _wait(lambda: _health(head) == 200, 180), \
            lab.sh("spark1", f"{DOCKER} exec {RAY_NAME} tail -n 30 /tmp/engine.log").stdout
        assert "42" in _chat(head)
        # power-cycle the worker; watch the head's /health meanwhile
        t0 = time.monotonic()
        gone: list[float] = []

        def watch():
            while time.monotonic() - t0 < 60:
                if _health(head) is None:
                    gone.append(time.monotonic() - t0)
                    return
                time.sleep(0.2)
        w = threading.Thread(target=watch)
        w.start()
        faults.apply("reboot", "spark2")
        w.join()
        log = lab.sh("spark1", f"{DOCKER} exec {RAY_NAME} cat /tmp/engine.log").stdout
        assert gone, "the head kept answering /health after its Ray worker node went away:\n" + log[-2000:]
        print(f"ray TP2: reboot of spark2 began -> head /health gone after {gone[0]:.1f}s")
        assert "EngineCore encountered a fatal error." in log, log[-2000:]
        assert lab.sh("spark1", f"{DOCKER} exec {RAY_NAME} pgrep -f 'sparklab.engine'").returncode != 0
    finally:
        for h in ADDR:
            lab.sh(h, f"{DOCKER} rm -f {RAY_NAME}")
