"""Serving internals let no one in (issue 27), proven from the outside on the lab.

Two deployments across spark1 and spark2, one after the other: a Ray TP 2 deployment (the stand-in
engine: the real vLLM's CPU build refuses Ray; Ray itself is the real Ray 2.60.0 of the lab's Ray
image) and a native TP 2 deployment of lab-tiny on the real vLLM. For each: every port its
containers listen on (read with `ss` in the hosts) is refused to the management network (the root
namespace on the lab bridge: where a laptop on a Spark owner's LAN would be) and to a stranger on
the fabric (spark3 when the lab has one; in the two-host lab, an extra fabric address on the peer
that no member has), while a member still reaches it; the chat through the API with its key works;
`status --ports` reports the API port as keyed and nothing else open to everyone, and fails when a
port is opened on purpose; `cluster-down` leaves no sparkprov table and no rule file. Ray: a driver
without the token, or with a wrong one, is refused even from a member's fabric address; with the
right one (inside the worker's container) it joins; the token is in no argv, `docker inspect` output or container log.

Run time on the 2-core CI machine: about 5 minutes (the passing run: 291 s, provision and staging of both
models included: bring-ups of 69 s (native) and 132 s (Ray, with its checks); the connection checks run in parallel, 0.7 s
timeouts).
"""
# Engine: both: the stand-in for Ray (the CPU build refuses Ray), the real vLLM for native.

from __future__ import annotations

import io
import json
import os
import socket
import subprocess
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from sparkprov.data.inventory import load_inventory
from sparkprov.engine.report import Report
from sparklab.prebuild import RAY_VENV, ensure_ray_venv

REPO_ROOT = Path(__file__).resolve().parents[2]
INVOKE = str(REPO_ROOT / ".venv" / "bin" / "invoke")
STORE = "~/portstest"
RAY_MODEL, NATIVE_MODEL = "llama-3.3-70b", "lab-tiny"
MEMBERS = ["spark1", "spark2"]
FABRIC = {"spark1": "192.168.100.11", "spark2": "192.168.100.12"}  # rail 0 as provision addresses it
STRANGER_IP = "192.168.100.99"  # two-host lab: an address on spark2's rail that no member has
OPEN_PORTS = {22}  # sshd; the API port is added per deployment
RAY_PY = RAY_VENV / "bin" / "python"


def cli(env, task, *args, timeout=900):
    p = subprocess.run([INVOKE, task, "--inventory", str(env["inv"]), *args, "--json"], cwd=REPO_ROOT,
                       capture_output=True, text=True, timeout=timeout)
    try:
        doc = json.loads(p.stdout)
    except ValueError:
        doc = {}
    return p.returncode, doc, p.stderr[-3000:] + p.stdout[-3000:]


@pytest.fixture(scope="module")
def env(lab, tmp_path_factory):
    from sparkprov.cli.common import run_playbook
    from sparklab.hub import ensure_lab_hub, lab_token
    from sparklab.image import VLLM_CPU_IMAGE, ensure_images
    from sparklab.state import BRIDGE_IP, HUB_PORT, REGISTRY_PORT
    from sparkprov.plays.stage import StageOptions, run_stage

    hub = ensure_lab_hub(lab.state_dir, BRIDGE_IP, HUB_PORT)
    ensure_ray_venv()  # the driver that knocks without the token: the lab's Ray 2.60.0
    ensure_images(f"http://{BRIDGE_IP}:{REGISTRY_PORT}")
    ensure_images(f"http://{BRIDGE_IP}:{REGISTRY_PORT}", [VLLM_CPU_IMAGE])
    d = tmp_path_factory.mktemp("ports")
    inv = lab.write_inventory(d / "inventory.yaml", store=STORE, extra_vars=f"  hf_endpoint: {hub}\n")
    # The rails as provision leaves them, and only that: earlier lab tests addressed them otherwise
    # (test_lab_multinode's 192.168.177.0/24, booted from its netplan), and a guard started in such
    # a boot still listens on the address it found then (its /metrics on every rail address, the
    # stale one included, which --ports rightly flags). Provision below addresses the rails again
    # and starts the guard anew.
    for h in MEMBERS:
        lab.sh(h, "ip addr flush dev enp1s0f1np1 scope global; ip addr flush dev enP2p1s0f1np1 scope global; "
                  "pid=$(cat /run/sparkprov-guard.pid 2>/dev/null); [ -z \"$pid\" ] || kill \"$pid\" 2>/dev/null; true")
    assert run_playbook(playbook=str(REPO_ROOT / "playbooks" / "provision.yaml"), inventory=str(inv),
                        hosts=None, as_json=True) == 0
    loaded = load_inventory(inv)
    saved = os.environ.get("HF_TOKEN")
    os.environ["HF_TOKEN"] = lab_token(lab.state_dir)  # llama-3.3-70b is gated (the lab hub's token)
    try:
        for alias in (RAY_MODEL, NATIVE_MODEL):
            rep = Report(io.StringIO())
            run_stage(loaded, MEMBERS, alias, StageOptions(), rep)
            assert rep.exit_code() == 0, [r.msg for r in rep.results if r.status == "failed"]
    finally:
        os.environ.pop("HF_TOKEN", None) if saved is None else os.environ.__setitem__("HF_TOKEN", saved)
    if "spark3" in lab.hosts:
        stranger = ("spark3", None)
    else:  # a host on the fabric that is not a member: an address of the rail no member has
        lab.sh("spark2", f"ip addr add {STRANGER_IP}/24 dev enp1s0f1np1")
        stranger = ("spark2", STRANGER_IP)
    yield {"inv": inv, "lab": lab, "stranger": stranger}
    if stranger[1]:
        lab.sh("spark2", f"ip addr del {STRANGER_IP}/24 dev enp1s0f1np1")
    subprocess.run([INVOKE, "cluster-down", "--inventory", str(inv)], cwd=REPO_ROOT, capture_output=True, timeout=300)
    for n in MEMBERS:
        lab.ssh(n, f"rm -rf {STORE}")


@pytest.fixture(autouse=True)
def nothing_left_running(env):
    """A test that fails half-way leaves no deployment (nor rule) for the next one."""
    yield
    subprocess.run([INVOKE, "cluster-down", "--inventory", str(env["inv"])], cwd=REPO_ROOT, capture_output=True,
                   timeout=300)


def internal_ports(env, deployment, api_port):
    """{host: [(address, port)]} of every TCP socket the deployment's containers listen on but the
    API port: `ss -H -tulpn` in each host (status --ports names each socket's container, through its
    cgroup; the guard's and sshd's sockets are not the deployment's)."""
    rc, doc, out = cli(env, "status", "--ports")
    assert doc.get("hosts"), out
    return {h: sorted({(r["address"], r["port"]) for r in doc["hosts"][h]["ports"] if r["proto"] == "tcp"
                       and r["deployment"] == deployment and r["port"] != api_port
                       and r["reach"] != "loopback"}) for h in MEMBERS}


PROBE = ("import socket, sys, json\nfrom concurrent.futures import ThreadPoolExecutor\n"
         "src, targets = sys.argv[1] or None, json.loads(sys.argv[2])\n"
         "def go(t):\n  s = socket.socket(); s.settimeout(0.7)\n"
         "  try:\n    src and s.bind((src, 0)); s.connect((t[0], t[1])); return True\n"
         "  except OSError:\n    return False\n  finally:\n    s.close()\n"
         "print(json.dumps(list(ThreadPoolExecutor(32).map(go, targets))))")


def reachable_from(lab, where, source, targets):
    """For each (address, port): whether a TCP connection from `where` succeeds (None: the root
    namespace, the lab's management network), bound to `source` when given."""
    if where is None:
        def go(t):
            try:
                socket.create_connection(t, timeout=0.7).close()
                return True
            except OSError:
                return False
        return list(ThreadPoolExecutor(32).map(go, targets))
    out = lab.exec(where, ["python3", "-c", PROBE, source or "", json.dumps(targets)], check=True).stdout
    return json.loads(out)


def assert_locked(env, deployment, api_port):
    """Every internal port of every member: refused to the management network (through the host's
    LAN address: a LAN cannot route to the fabric) and to the stranger on the fabric, reached by the
    other member over the fabric. In a two-host lab the stranger is an extra rail address of spark2:
    to spark2's own ports that is local traffic (it never crosses the fabric), so it probes spark1's."""
    lab = env["lab"]
    for host, ports in internal_ports(env, deployment, api_port).items():
        assert ports, f"{host}: the deployment listens on nothing but the API"
        via_fabric = [(FABRIC[host], p) for _, p in ports]
        via_lan = [(lab.hosts[host], p) for a, p in ports if a in ("0.0.0.0", "*", "::")]
        assert not any(reachable_from(lab, None, None, via_lan)), (host, via_lan)
        if env["stranger"][0] != host:
            assert not any(reachable_from(lab, *env["stranger"], via_fabric)), (host, ports, env["stranger"])
        peer = next(h for h in MEMBERS if h != host)
        got = reachable_from(lab, peer, FABRIC[peer], via_fabric)
        assert all(got), ("a member is refused", host, [t for t, ok in zip(via_fabric, got) if not ok])


def assert_ports_report(env, api_port):
    rc, doc, out = cli(env, "status", "--ports")
    # In the two-host lab the stranger's address is an extra address of spark2's rail, and spark2's
    # guard serves /metrics on every address of its fabric interfaces, that one included: flagged,
    # rightly, since it is not the host's fabric address. A real stranger is another machine.
    stray = env["stranger"][1]
    flagged = {h: [r for r in d.get("ports") or [] if r["flag"] and r["address"] != stray]
               for h, d in (doc.get("hosts") or {}).items()}
    assert rc == 0 or (stray and not any(flagged.values())), json.dumps(flagged, default=str)[:6000]
    for host in MEMBERS:
        everyone = [r for r in doc["hosts"][host]["ports"] if r["reach"] == "everyone" and r["address"] != stray]
        assert {(r["port"], bool(r["flag"])) for r in everyone} <= {(22, False), (api_port, False)}, everyone
        assert not flagged[host]
    api = [r for r in doc["hosts"]["spark1"]["ports"] if r["port"] == api_port]
    assert api and "keyed" in api[0]["why"] and api[0]["deployment"], api


def assert_no_rule_left(env):
    for host in MEMBERS:
        rules = env["lab"].sh(host, "nft list ruleset").stdout
        files = env["lab"].sh(host, "ls /etc/sparkprov/nftables").stdout
        assert "sparkprov" not in rules and files.strip() == "", (host, rules, files)


def ask(env, summary, name, question):
    d = summary["deployments"][name]
    host, path = d["api_key_file"].split(":", 1)
    key = env["lab"].ssh(host, f"cat {path}").stdout.strip()
    body = json.dumps({"model": d["model"], "max_tokens": 16, "temperature": 0,
                       "messages": [{"role": "user", "content": question}]}).encode()
    req = urllib.request.Request(d["endpoint"] + "/chat/completions", data=body,
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
    with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(req, timeout=120) as r:
        return json.loads(r.read())["choices"][0]["message"]["content"]


DRIVER = ("import ray, sys\ntry:\n  ray.init(address=sys.argv[1], log_to_driver=False)\n"
          "  print('JOINED', ray.cluster_resources().get('GPU'))\nexcept Exception as e:\n"
          "  print('REFUSED', type(e).__name__, str(e)[:300])")


def ray_driver(lab, token_env):
    """A Ray driver (the lab's Ray 2.60.0) on spark2, a member, joining the head over the fabric."""
    env = {"PATH": "/usr/bin:/bin", "HOME": "/tmp", "RAY_DISABLE_USAGE_STATS": "1", **token_env}
    r = lab.exec("spark2", ["env", *(f"{k}={v}" for k, v in env.items()), str(RAY_PY), "-c", DRIVER,
                            f"{FABRIC['spark1']}:6379"], check=False, timeout=180)
    return r.stdout + r.stderr


def test_ray_tp2_internals_are_closed_and_need_the_token(env):
    lab = env["lab"]
    rc, doc, out = cli(env, "cluster-up", "--model", RAY_MODEL, "--tp", "2", "--hosts", ",".join(MEMBERS),
                       "--ray-timeout", "120", "--health-timeout", "180")
    assert rc == 0, out
    assert "42" in ask(env, doc["cluster"], RAY_MODEL, "What is 21*2?")
    assert_locked(env, RAY_MODEL, 8000)
    assert_ports_report(env, 8000)

    path = f"~/.config/sparkprov/deployments/{RAY_MODEL}/ray_token"
    token = lab.ssh("spark1", f"cat {path}").stdout.strip()
    assert len(token) == 64 and lab.ssh("spark2", f"cat {path}").stdout.strip() == token
    assert {lab.ssh(h, f"stat -c %a {path}").stdout.strip() for h in MEMBERS} == {"600"}
    for token_env in ({}, {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "0" * 64}):
        said = ray_driver(lab, token_env)
        assert "REFUSED" in said and "uthenticat" in said, said[-2000:]
    # with the token (the worker container's mounted file) a driver joins: the refusals were the token's
    said = lab.exec("spark2", ["docker", "exec", f"sparkprov-{RAY_MODEL}-worker", "python3", "-c", DRIVER,
                               f"{FABRIC['spark1']}:6379"], check=False, timeout=180)
    assert "JOINED 2.0" in said.stdout, (said.stdout + said.stderr)[-2000:]
    for host, name in (("spark1", f"sparkprov-{RAY_MODEL}-head"), ("spark2", f"sparkprov-{RAY_MODEL}-worker")):
        seen = lab.ssh(host, f"docker inspect {name}; docker logs {name} 2>&1").stdout
        assert "RAY_AUTH_TOKEN_PATH=/run/sparkprov/ray_token" in seen and token not in seen
    argvs = [Path(f"/proc/{p}/cmdline").read_bytes() for p in os.listdir("/proc") if p.isdigit()
             and os.path.exists(f"/proc/{p}/cmdline")]
    assert not any(token.encode() in a for a in argvs)

    # a port opened on purpose to everyone: reported and status fails
    opened = lab.sh("spark1", "nohup python3 -m http.server 8765 --bind 0.0.0.0 >/dev/null 2>&1 & echo $!").stdout
    try:
        lab.sh("spark1", "for i in $(seq 50); do ss -H -tln | grep -q :8765 && break; sleep 0.1; done")
        rc, doc, out = cli(env, "status", "--ports")
        assert rc == 2, out
        assert [r["port"] for r in doc["hosts"]["spark1"]["ports"] if r["flag"]] == [8765], out
    finally:
        lab.sh("spark1", f"kill {opened.strip()}")

    rc, doc, out = cli(env, "cluster-down")
    assert rc == 0, out
    assert_no_rule_left(env)


def test_native_tp2_internals_are_closed(env):
    rc, doc, out = cli(env, "cluster-up", "--model", NATIVE_MODEL, "--tp", "2", "--executor", "native", "--hosts",
                       ",".join(MEMBERS), "--health-timeout", "300")
    assert rc == 0, out
    assert "204" in ask(env, doc["cluster"], NATIVE_MODEL, "What is 12*17?")
    assert_locked(env, NATIVE_MODEL, 8000)
    assert_ports_report(env, 8000)
    # a power cycle loses the kernel's rules; the boot loads them again before docker starts
    from sparklab import boot

    before = env["lab"].sh("spark2", f"nft list table inet sparkprov-{NATIVE_MODEL}").stdout
    res = boot.reboot("spark2")
    assert res["killed"] > 0
    assert env["lab"].sh("spark2", f"nft list table inet sparkprov-{NATIVE_MODEL}").stdout == before != ""
    rc, doc, out = cli(env, "cluster-down")
    assert rc == 0, out
    assert_no_rule_left(env)
