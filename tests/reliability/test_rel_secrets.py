"""Secrets across a full run, with `invoke` as a user runs it: provision (the sudo password),
stage-weights of a GATED model from the lab hub (the lab's Hugging Face token, given in a 0600
file), cluster-up of that model as a TP=2 Ray cluster (the API key sparkprov creates on the head,
the Ray token it creates for the cluster on both nodes).

While it runs, the process lists are sampled about ten times a second: the argv of every process
on the machine (the lab hosts share its process table) and the argv and environment of every
process inside each lab host (sshd, sudo, sh, rsync, docker, the containers). Afterwards every
file the lab and the run wrote is read: the lab state dir (each host's private /etc, /home,
/root, /tmp, /var/log: its logs and shell histories), every host's docker containers (config and
json logs) and the layers written during the run, the control machine's new files in /tmp, the
output of the runs, `docker inspect` and `docker logs` of every container on every host.

The password, the Hugging Face token, the API key and the Ray token may appear only in their own
0600 files (a file that is mode 0600 and holds nothing but the secret). One allowance, by design: vLLM takes its key from
VLLM_API_KEY, so the serving processes inside the containers (and only they) carry it in their
environment, put there from the mounted 0600 file by sparkprov's wrapper, never by docker.
"""
# Engine: the stand-in (Spark recipes: where keys go, not what the engine does).
from __future__ import annotations

import os
import stat
import subprocess
import threading
import time
from pathlib import Path

import pytest

from ._lab import (LAB_HUB, TP_MODEL, TP_REPO, cli_env, converge, invoke_argv, lab_hub_token, managed_containers,
                   run_invoke, serve_playbook, token_file, write_inventory)

pytestmark = [pytest.mark.lab, pytest.mark.slow]

STORE = "~/relsecret"
KEY_FILE = "/home/nvidia/.config/sparkprov/api_key"
MiB = 1024 * 1024


def _files(roots: list[str], newer: float | None = None, skip: tuple[str, ...] = ()):
    """Regular files under roots (not following links, not under `skip`, not over 64 MiB)."""
    for root in roots:
        for dirpath, dirnames, files in os.walk(root):
            dirnames[:] = [d for d in dirnames if not os.path.join(dirpath, d).startswith(skip)]
            for name in files:
                p = os.path.join(dirpath, name)
                try:
                    st = os.lstat(p)
                except OSError:
                    continue
                if stat.S_ISREG(st.st_mode) and st.st_size <= 64 * MiB and not (newer and st.st_mtime < newer):
                    yield p


def _grep(secrets: dict[str, str], paths) -> dict[str, list[str]]:
    """secret name -> files that contain it."""
    hits: dict[str, list[str]] = {k: [] for k in secrets}
    for p in paths:
        try:
            with open(p, "rb") as fh:
                data = fh.read()
        except OSError:
            continue
        for k, s in secrets.items():
            if s.encode() in data:
                hits[k].append(p)
    return hits


def _own_file(path: str, secret: str) -> bool:
    """A secret's own file: mode 0600 and nothing in it but the secret."""
    try:
        st = os.stat(path)
        return stat.S_IMODE(st.st_mode) == 0o600 and Path(path).read_text().strip() == secret
    except (OSError, UnicodeDecodeError):
        return False


def _in_container(pid: int) -> bool:
    """True when a containerd shim is among the process's ancestors."""
    for _ in range(64):
        try:
            stat_line = Path(f"/proc/{pid}/stat").read_text()
            comm = Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            return False
        if comm.startswith("containerd-shim"):
            return True
        pid = int(stat_line.rsplit(")", 1)[1].split()[1])
        if pid <= 1:
            return False
    return False


class Sampler:
    """Process lists at ~10 Hz while the runs go: unique texts only (what, pid, text, in a container)."""

    def __init__(self, hosts: list[str]):
        self.hosts = hosts
        self.seen: set[tuple[str, int, str]] = set()
        self.found: list[tuple[str, int, str, bool]] = []
        self.rounds = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _add(self, what: str, pid: int, text: str) -> None:
        if (what, pid, text) not in self.seen:
            self.seen.add((what, pid, text))
            self.found.append((what, pid, text, what.endswith("environ") and _in_container(pid)))

    def _loop(self) -> None:
        from sparklab.hosts import host_pids

        while not self._stop.is_set():
            ps = subprocess.run(["ps", "-eww", "-o", "pid=,args="], capture_output=True, text=True).stdout
            for line in ps.splitlines():
                pid, _, args = line.strip().partition(" ")
                self._add("ps", int(pid), args)
            for h in self.hosts:
                for pid in host_pids(h):
                    for what in ("cmdline", "environ"):
                        try:
                            text = Path(f"/proc/{pid}/{what}").read_bytes().replace(b"\0", b"\n")
                        except OSError:
                            continue
                        self._add(f"{h}:{what}", pid, text.decode(errors="replace"))
            self.rounds += 1
            time.sleep(0.1)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def test_password_token_and_api_key_only_in_their_0600_files(lab, tmp_path):
    from sparklab.hub import HubControl
    from sparklab.state import STATE_DIR

    hf_token = lab_hub_token(lab)
    password = lab.password
    tok = token_file(tmp_path / "hf-token", hf_token)
    env = cli_env(tok)
    inv = write_inventory(lab, tmp_path / "inventory.yaml", store=STORE, extra_vars={"hf_endpoint": LAB_HUB})
    pb = serve_playbook(tmp_path / "cluster.yaml", "relsecret")
    from sparklab.image import ensure_images
    from sparklab.state import BRIDGE_IP, REGISTRY_PORT

    ensure_images(f"http://{BRIDGE_IP}:{REGISTRY_PORT}")  # the serving images in the lab registry (lab.up does not push them)
    converge(inv)
    assert run_invoke("cluster-down", "--inventory", str(inv), env=env).returncode == 0
    for h in lab.names:  # something for provision to do under sudo; a fresh store; a new API key
        lab.sh(h, "gpasswd -d nvidia docker >/dev/null 2>&1; ip link set dev enp1s0f1np1 mtu 1500; "
                  f"rm -rf /home/nvidia/{STORE[2:]} {KEY_FILE}")
    hub = HubControl(LAB_HUB)
    seq = max([r["seq"] for r in hub.requests()] or [0])
    started = time.time()

    runs = {}
    try:
        with Sampler(lab.names) as sampler:
            for name, argv in (("provision", ["provision", "--inventory", str(inv)]),
                               ("stage", ["stage-weights", TP_MODEL, "--inventory", str(inv)]),
                               ("up", ["cluster-up", "--inventory", str(inv), "--playbook", str(pb), "--tp", "2",
                                       "--ray-timeout", "120", "--health-timeout", "180"])):
                runs[name] = subprocess.run(invoke_argv(*argv), capture_output=True, text=True, env=env, timeout=420)
                if runs[name].returncode:  # all of it, in the captured output (pytest shortens the message)
                    print(runs[name].stdout, runs[name].stderr)
                assert runs[name].returncode == 0, (name, runs[name].stdout[-3000:] + runs[name].stderr[-2000:])
                time.sleep(0.5)  # a last sample of this step's processes
        api_key = lab.sh("spark1", f"cat {KEY_FILE}").stdout.strip()
        assert len(api_key) >= 32, "cluster-up created the API key on the head"
        assert "API key created, 0600" in runs["up"].stdout, runs["up"].stdout[-3000:]
        token_file_path = "/home/nvidia/.config/sparkprov/deployments/relsecret/ray_token"
        ray_token = lab.sh("spark1", f"cat {token_file_path}").stdout.strip()
        assert len(ray_token) == 64 and lab.sh("spark2", f"cat {token_file_path}").stdout.strip() == ray_token
        secrets = {"sudo password": password, "HF token": hf_token, "API key": api_key, "Ray token": ray_token}
        gated = [r for r in hub.requests() if r["seq"] > seq and TP_REPO in r["path"] and "/resolve/" in r["path"]]
        assert gated and all(r["auth"] and r["status"] in (200, 206) for r in gated), "the gated repo was read with the token"

        # 1. process lists: argv everywhere, environment inside the hosts
        assert sampler.rounds > 20, sampler.rounds
        assert any("sudo" in t for w, _, t, _ in sampler.found if w.endswith("cmdline")), "the sampler saw sudo"
        assert any("rsync" in t or "docker run" in t for w, _, t, _ in sampler.found), "the sampler saw the transfer"
        for k, s in secrets.items():
            leaks = [(w, pid, t[:300]) for w, pid, t, container in sampler.found if s in t
                     and not (k == "API key" and container and f"VLLM_API_KEY={s}" in t.splitlines()
                              and sum(s in ln for ln in t.splitlines()) == 1)]
            assert not leaks, f"{k} in a process list: {leaks}"
        assert any(api_key in t for w, _, t, c in sampler.found if c), "the serving processes were sampled"

        # 2. what the runs printed
        for name, r in runs.items():
            for k, s in secrets.items():
                assert s not in r.stdout + r.stderr, f"{k} in the output of {name}"

        # 3. files: the lab state dir (hosts' /etc /home /root /tmp /var/log: logs, histories), docker's
        #    containers (config, logs) and what was written during the run, the control machine's new /tmp
        docker_dirs = sorted(STATE_DIR.glob("hosts/*/docker"))
        everything = [str(STATE_DIR), str(tmp_path)]
        paths = list(_files(everything, skip=(str(STATE_DIR / "registry"), *map(str, docker_dirs))))
        paths += list(_files([str(d / "containers") for d in docker_dirs]))
        paths += list(_files([str(d) for d in docker_dirs], newer=started, skip=tuple(str(d / "containers")
                                                                                   for d in docker_dirs)))
        paths += list(_files(["/tmp"], newer=started, skip=(str(tmp_path),)))
        assert any(p.endswith("/var-log/upper/sshd.log") for p in paths), "the hosts' logs are read"
        hits = _grep(secrets, sorted(set(paths)))
        own = {k: [p for p in v if _own_file(p, secrets[k])] for k, v in hits.items()}
        assert str(lab.password_file) in own["sudo password"], hits      # the scan finds what is there ...
        assert str(tok) in own["HF token"] and str(STATE_DIR / "hf_token") in own["HF token"], hits
        assert any(p.endswith("/.config/sparkprov/api_key") for p in own["API key"]), hits
        assert sum(p.endswith("/deployments/relsecret/ray_token") for p in own["Ray token"]) == 2, hits  # both hosts
        for k in secrets:                                                 # ... and nothing else holds a secret
            assert sorted(set(hits[k]) - set(own[k])) == [], f"{k} in {sorted(set(hits[k]) - set(own[k]))}"
        for h in lab.names:
            hist = lab.sh(h, "cat /root/.bash_history /root/.ash_history /home/nvidia/.bash_history "
                             "/home/nvidia/.python_history 2>/dev/null").stdout
            assert not [k for k, s in secrets.items() if s in hist], h

        # 4. docker: every container on every host (configuration, environment, arguments, mounts, logs)
        seen_containers = 0
        for h in lab.names:
            ids = lab.sh(h, "docker ps -aq").stdout.split()
            seen_containers += len(ids)
            if ids:
                inspect = lab.sh(h, "docker inspect " + " ".join(ids)).stdout
                logs = lab.sh(h, "for i in " + " ".join(ids) + "; do docker logs $i 2>&1; done").stdout
                for k, s in secrets.items():
                    assert s not in inspect, f"{k} in docker inspect on {h}"
                    assert s not in logs, f"{k} in docker logs on {h}"
        assert seen_containers >= 2 and managed_containers(lab, "spark1") == ["sparkprov-relsecret-head"]
        for h in lab.names:
            assert lab.sh(h, f"stat -c '%a %U' {KEY_FILE} 2>/dev/null").stdout in ("", "600 nvidia\n")
    finally:
        run_invoke("cluster-down", "--inventory", str(inv), env=env)
        for h in lab.names:
            lab.sh(h, f"rm -rf /home/nvidia/{STORE[2:]}")
    converge(inv)
