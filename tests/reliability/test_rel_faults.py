"""Faults during real runs on the lab: a host's sshd killed mid-run, sparkprov itself SIGKILLed
mid-run, a fabric link cut between configuring the fabric and verifying the mesh, a host's
dockerd killed, and a man in the middle (a lab host's host key replaced). Each ends with the
lab converged again (a run that changes nothing)."""
# Engine: none: no model is served in this module.
from __future__ import annotations

import os
import select
import signal
import subprocess
import time
from pathlib import Path

import pytest

from sparkprov.engine.report import Report, TaskResult

from ._lab import (NETPLAN, changed, converge, invoke_argv, invoke_env, problems, provision, run_invoke,
                   write_inventory)

pytestmark = [pytest.mark.lab, pytest.mark.slow]

DAMAGE = ("gpasswd -d nvidia docker >/dev/null 2>&1; ip link set dev enp1s0f1np1 mtu 1500; "
          "ip addr flush dev enP2p1s0f1np1 scope global; rm -f " + NETPLAN + "; "
          "chown root:root /home/nvidia/vllm/hub")


@pytest.fixture(scope="module")
def inv(lab, tmp_path_factory):
    path = write_inventory(lab, tmp_path_factory.mktemp("faults") / "inventory.yaml")
    converge(path)
    yield path
    converge(path)  # leave the lab as the next test expects it


def _sshd_pids(host: str) -> list[int]:
    """The host's sshd: its listener and every session it serves (processes of that host only)."""
    from sparklab.hosts import host_pids

    out = []
    for pid in host_pids(host):
        try:
            if Path(f"/proc/{pid}/comm").read_text().strip() == "sshd":
                out.append(pid)
        except OSError:
            pass
    return out


def _run_until(args: list[str], pattern: str, timeout: float = 180) -> tuple[subprocess.Popen, str]:
    """Start `invoke ARGS`; return once a line of its output contains `pattern`."""
    proc = subprocess.Popen(invoke_argv(*args), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=invoke_env())
    seen = b""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        r, _, _ = select.select([proc.stdout], [], [], 0.5)
        if r:
            chunk = os.read(proc.stdout.fileno(), 65536)
            if not chunk:
                break
            seen += chunk
            if pattern.encode() in seen:
                return proc, seen.decode(errors="replace")
    proc.kill()
    proc.wait()
    raise AssertionError(f"never saw {pattern!r} in:\n{seen.decode(errors='replace')}")


def _finish(proc: subprocess.Popen, seen: str, timeout: float = 300) -> str:
    out, _ = proc.communicate(timeout=timeout)
    return seen + out.decode(errors="replace")


def test_sshd_killed_mid_run_that_host_unreachable_others_finish_limit_rerun_completes(lab, inv):
    from sparklab import faults

    victim, other = "spark2", "spark1"
    lab.sh(victim, DAMAGE)
    proc, seen = _run_until(["provision", "--inventory", str(inv)], f"{victim}   | ok       | driver and GPU")
    killed = _sshd_pids(victim)
    assert killed
    for pid in killed:
        os.kill(pid, signal.SIGKILL)
    try:
        out = _finish(proc, seen)
    finally:
        faults.start_sshd(victim)
    assert proc.returncode == 4, out
    assert "Traceback" not in out
    recap = {ln.split()[0]: ln for ln in out.split("PLAY RECAP", 1)[1].splitlines() if ln.strip()}
    assert "unreachable=1" in recap[victim] and "failed=0" in recap[victim], out
    assert "unreachable=0" in recap[other] and "failed=0" in recap[other], out
    assert f"{victim}   | unreachable | connect: {victim}: " in out, out  # one line naming the host

    rerun = run_invoke("provision", "--inventory", str(inv), "--limit", victim)
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    assert f"PLAY [Prepare each host] on {victim}\n" in rerun.stdout
    assert "docker" in lab.ssh(victim, "id -nG").stdout.split()
    assert lab.sh(victim, f"stat -c '%a' {NETPLAN}").stdout == "600\n"
    final = provision(inv)
    assert not problems(final) and not changed(final), (changed(final), problems(final))


def test_sparkprov_killed_mid_run_then_rerun_converges(lab, inv):
    for h in lab.names:
        lab.sh(h, DAMAGE)
    # a play applies all its changes in one call (issue 14): killed once the run has begun, before
    # that call, nothing of it is repaired yet; a script already handed to a host runs to its end
    proc, seen = _run_until(["provision", "--inventory", str(inv)], "PLAY [Prepare each host]")
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    time.sleep(1)  # a script already handed to a host's shell runs to its end there

    rerun = provision(inv)
    assert not problems(rerun), problems(rerun)
    assert changed(rerun), "the killed run cannot have finished every repair"
    third = provision(inv)
    assert not problems(third) and not changed(third), changed(third)
    for h in lab.names:
        state = lab.sh(h, f"id -nG nvidia; ip -o link show enp1s0f1np1; stat -c '%a %U' {NETPLAN} /home/nvidia/vllm/hub; "
                          "ls -a /etc/netplan /home/nvidia/.ssh").stdout
        assert "docker" in state.splitlines()[0].split()
        assert "mtu 9000" in state and "600 root\n755 nvidia\n" in state, state
        assert ".sparkprov-tmp" not in state, f"{h}: a temp file of the killed run is left: {state}"


class _CutAfter(Report):
    """A report that runs `action` once, right after `host` recorded `task` (in that host's
    thread, so before the play's barrier releases the next play)."""

    def __init__(self, host: str, task: str, action):
        import io

        super().__init__(io.StringIO())
        self._when, self._action, self.fired = (host, task), action, False

    def record(self, result: TaskResult) -> None:
        super().record(result)
        if (result.host, result.task) == self._when and not self.fired:
            self.fired = True
            self._action()


def test_fabric_link_cut_after_fabric_before_mesh_check_is_a_clear_failure(lab, inv):
    from sparkprov.data.inventory import load_inventory
    from sparkprov.data.playbook import load_playbook
    from sparkprov.engine.run import Runner, RunOptions
    from sparklab import faults
    from sparkprov.modules import fabric_mesh

    from ._lab import PLAYBOOK

    report = _CutAfter("spark2", "mesh key", lambda: faults.cut_link("spark2", "enp1s0f1np1"))
    inventory = load_inventory(inv)
    try:
        Runner(inventory, load_playbook(PLAYBOOK), lab.names, RunOptions(), report).run()
    finally:
        faults.restore_link("spark2", "enp1s0f1np1")
    assert report.fired
    assert report.exit_code() == 2
    mesh = {r.host: r for r in report.results if r.task == "jumbo frames and ssh on every rail"}
    # each link is pinged from one end: every link to spark2 fails once, on the host that checks it
    names = list(lab.names)
    checkers = {names[i] for i in range(len(names)) for k in range(1, len(names))
                if "spark2" in (names[i], names[(i + k) % len(names)]) and fabric_mesh.pings_the_pair(i, k, len(names))}
    assert checkers and {h for h, r in mesh.items() if r.status == "failed"} == checkers, mesh
    for h in checkers:
        assert "on enp1s0f1np1" in mesh[h].msg and "`ping -M do -s 8972` failed" in mesh[h].msg, mesh[h].msg
        assert "spark2" in mesh[h].msg and "on enP2p1s0f1np1" not in mesh[h].msg, mesh[h].msg  # the other rail is fine
        assert "Fix:" in mesh[h].msg
    time.sleep(1)  # carrier back on both ends
    again = provision(inv)
    assert not problems(again), problems(again)
    assert {r.host: r.status for r in again.results if r.task == "jumbo frames and ssh on every rail"} == \
        {h: "ok" for h in lab.names}


def test_dockerd_killed_is_a_clear_failure_of_that_host_only(lab, inv):
    from sparklab import dockerd, faults

    faults.kill_dockerd("spark2")
    try:
        report = provision(inv)
    finally:
        faults.start_dockerd("spark2")
        dockerd.wait_dockerd("spark2")
    docker = {r.host: r for r in report.results if r.task == "docker and GPU containers"}
    assert docker["spark2"].status == "failed"
    assert docker["spark2"].msg.startswith("start the docker daemon"), docker["spark2"].msg
    assert len(docker["spark2"].msg.splitlines()) == 1
    assert report.hosts["spark1"].failed == 0 and report.hosts["spark2"].failed == 1
    assert [r.task for r in report.results if r.host == "spark2"][-1] == "docker and GPU containers"  # stopped there
    again = provision(inv)
    assert not problems(again) and not changed(again), (problems(again), changed(again))


def test_replaced_host_key_is_refused_also_with_accept_new_host_keys(lab, inv, tmp_path):
    """A man in the middle: spark2 answers with another host key (regenerated inside the host,
    sshd restarted). known_hosts is never touched; the other host completes."""
    from sparklab import sshd

    known_before = lab.known_hosts.read_text()
    key = sshd.HOST_KEY
    lab.sh("spark2", f"cp -p {key} {key}.relbak && cp -p {key}.pub {key}.pub.relbak && rm -f {key} {key}.pub && "
                     f"ssh-keygen -q -t ed25519 -N '' -C mitm -f {key}", check=True)
    try:
        sshd.stop_sshd("spark2")
        sshd.start_sshd("spark2")
        new_fp = lab.sh("spark2", f"ssh-keygen -lf {key}.pub").stdout.split()[1]
        old_fp = lab.sh("spark2", f"ssh-keygen -lf {key}.pub.relbak").stdout.split()[1]
        for accept in (False, True):
            report = provision(inv, accept_new_host_keys=accept)
            [bad] = [r for r in report.results if r.host == "spark2"]
            assert bad.status == "failed" and bad.task == "setup", bad
            assert bad.msg.startswith(f"spark2: host key for {lab.hosts['spark2']} CHANGED: got {new_fp}, "
                                      f"known_hosts has {old_fp}; refusing (possible man-in-the-middle)"), bad.msg
            assert "ssh-keygen -R" in bad.msg and len(bad.msg.splitlines()) == 1
            assert report.hosts["spark1"].failed == 0 and report.hosts["spark1"].unreachable is False
            assert lab.known_hosts.read_text() == known_before
        cli = run_invoke("provision", "--inventory", str(inv), "--accept-new-host-keys")
        assert cli.returncode == 2 and "Traceback" not in cli.stdout + cli.stderr
        assert "CHANGED" in cli.stdout and "man-in-the-middle" in cli.stdout
    finally:
        lab.sh("spark2", f"mv -f {key}.relbak {key} && mv -f {key}.pub.relbak {key}.pub", check=True)
        sshd.stop_sshd("spark2")
        sshd.start_sshd("spark2")
    assert lab.known_hosts.read_text() == known_before
    again = provision(inv)
    assert not problems(again) and not changed(again), (problems(again), changed(again))
