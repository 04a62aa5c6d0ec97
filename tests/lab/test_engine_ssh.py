"""The engine over real SSH against the lab's sshd: real host keys and known_hosts, a sudo
password, a small playbook of simple modules. State is checked with plain ssh commands, not
with sparkprov's own facts."""
# Engine: none: no model is served in this module.

from __future__ import annotations

import os
from pathlib import Path

import pytest

from sparkprov.data.inventory import load_inventory
from sparkprov.data.playbook import load_playbook
from sparkprov.engine.report import Report
from sparkprov.engine.run import Runner, RunOptions

pytestmark = pytest.mark.lab

PLAYBOOK = """
- name: engine e2e
  hosts: sparks
  become: true
  tasks:
    - name: group
      group: {name: sp-e2e}
    - name: membership
      user_groups: {groups: [sp-e2e]}
    - name: dir
      directory: {path: /srv/sp-e2e, mode: "0750", owner: nvidia, group: sp-e2e}
    - name: config
      file: {path: /srv/sp-e2e/app.conf, content: "answer = 42\\n", mode: "0640", owner: root, group: sp-e2e}
    - name: user file
      file: {path: ~/sp-e2e.txt, content: "mine\\n", mode: "0600", owner: nvidia}
"""

CLEANUP = "rm -rf /srv/sp-e2e /home/nvidia/sp-e2e.txt; gpasswd -d nvidia sp-e2e >/dev/null 2>&1; groupdel sp-e2e >/dev/null 2>&1; true"


def write_inventory(lab, path: Path, *, known_hosts: Path | None = None, password_file: Path | None = None) -> Path:
    return lab.write_inventory(path, known_hosts=known_hosts, password_file=password_file)


def failures(report: Report) -> list[str]:
    return [f"{r.host} {r.task}: {r.msg}" for r in report.results if r.status in ("failed", "unreachable")]


def run(inv: Path, book: Path, **opts) -> Report:
    report = Report(open(os.devnull, "w"))
    inventory = load_inventory(inv)
    Runner(inventory, load_playbook(book), list(inventory.hosts), RunOptions(**opts), report).run()
    return report


@pytest.fixture
def clean(lab):
    for h in lab.names:
        lab.sh(h, CLEANUP)
    yield
    for h in lab.names:
        lab.sh(h, CLEANUP)


@pytest.fixture
def book(tmp_path):
    p = tmp_path / "e2e.yaml"
    p.write_text(PLAYBOOK)
    return p


def test_converge_idempotent_check_over_ssh(lab, clean, book, tmp_path):
    inv = write_inventory(lab, tmp_path / "inv.yaml")
    check = run(inv, book, check=True)
    assert check.exit_code() == 0
    for h in lab.names:
        assert check.hosts[h].changed == 5
        # check mode touched nothing: plain ssh sees no group, no directory
        assert lab.ssh(h, "getent group sp-e2e").returncode == 2
        assert lab.ssh(h, "test -e /srv/sp-e2e").returncode == 1

    first = run(inv, book)
    assert first.exit_code() == 0, failures(first)
    for h in lab.names:
        assert first.hosts[h].changed == 5
        # independent verification with plain commands
        assert "sp-e2e" in lab.ssh(h, "id -Gn").stdout.split()  # a new login sees the membership
        assert lab.ssh(h, "stat -c '%a %U %G' /srv/sp-e2e").stdout.strip() == "750 nvidia sp-e2e"
        assert lab.ssh(h, "stat -c '%a %U %G' /srv/sp-e2e/app.conf").stdout.strip() == "640 root sp-e2e"
        assert lab.ssh(h, "cat /srv/sp-e2e/app.conf").stdout == "answer = 42\n"
        assert lab.ssh(h, "stat -c '%a %U' ~/sp-e2e.txt").stdout.strip() == "600 nvidia"

    second = run(inv, book)
    for h in lab.names:
        assert second.hosts[h].changed == 0 and second.hosts[h].ok == 5
        # a run that changes nothing costs one remote execution per host after connecting
        assert second.hosts[h].remote_calls == 1


def test_sudo_password_never_on_a_command_line(lab, clean, book, tmp_path):
    """While a become run happens, sample every process's argv on the host: no password."""
    import threading

    inv = write_inventory(lab, tmp_path / "inv.yaml")
    seen: list[str] = []
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            for h in lab.names:
                seen.append(lab.sh(h, "cat /proc/[0-9]*/cmdline 2>/dev/null | tr '\\0' ' '").stdout)

    t = threading.Thread(target=sample)
    t.start()
    try:
        report = run(inv, book)
    finally:
        stop.set()
        t.join()
    assert report.exit_code() == 0, failures(report)
    assert len(seen) >= 2 and any("sshd" in s for s in seen)
    assert not any(lab.password in s for s in seen)


def test_unknown_host_key_refused_then_accepted_with_flag(lab, clean, book, tmp_path):
    empty = tmp_path / "known_hosts"
    empty.write_text("")
    inv = write_inventory(lab, tmp_path / "inv.yaml", known_hosts=empty)
    report = run(inv, book)
    assert report.exit_code() == 2
    for h in lab.names:
        fail = [r for r in report.results if r.host == h][0]
        assert fail.status == "failed"
        assert f"{h}: host key for {lab.hosts[h]} is not in {empty}" in fail.msg
        assert "--accept-new-host-keys" in fail.msg
    assert empty.read_text() == ""  # nothing recorded without the flag

    accepted = run(inv, book, accept_new_host_keys=True)
    assert accepted.exit_code() == 0
    recorded = empty.read_text()
    for h, addr in lab.hosts.items():
        assert recorded.count(addr + " ssh-ed25519 ") == 1
    assert run(inv, book).exit_code() == 0  # strict again, keys now known


def test_changed_host_key_refused_even_with_accept_new(lab, clean, book, tmp_path):
    """A man in the middle: known_hosts holds another key for the address."""
    forged = tmp_path / "known_hosts"
    other = tmp_path / "other_key"
    os.system(f"ssh-keygen -q -t ed25519 -N '' -f {other}")
    pub = (tmp_path / "other_key.pub").read_text().split()
    first = lab.names[0]
    lines = [line for line in lab.known_hosts.read_text().splitlines()
             if not line.startswith(lab.hosts[first] + " ")]
    lines.append(f"{lab.hosts[first]} {pub[0]} {pub[1]}")
    forged.write_text("\n".join(lines) + "\n")
    inv = write_inventory(lab, tmp_path / "inv.yaml", known_hosts=forged)
    for accept in (False, True):
        report = run(inv, book, accept_new_host_keys=accept)
        bad = [r for r in report.results if r.host == first][0]
        assert bad.status == "failed"
        assert "CHANGED" in bad.msg and "man-in-the-middle" in bad.msg and "ssh-keygen -R" in bad.msg
        others = [h for h in lab.names if h != first]
        assert all(report.hosts[h].failed == 0 and report.hosts[h].changed + report.hosts[h].ok == 5 for h in others)
    assert forged.read_text().count(lab.hosts[first] + " ") == 1  # never replaced


def test_wrong_sudo_password_is_a_clear_per_host_failure(lab, clean, book, tmp_path):
    bad = tmp_path / "pw"
    bad.write_text("not-the-password\n")
    bad.chmod(0o600)
    inv = write_inventory(lab, tmp_path / "inv.yaml", password_file=bad)
    report = run(inv, book)
    assert report.exit_code() == 2
    for h in lab.names:
        [r] = [r for r in report.results if r.host == h]
        assert r.status == "failed" and r.msg.startswith(f"{h}: sudo rejected the password for nvidia")
        assert lab.ssh(h, "getent group sp-e2e").returncode == 2  # nothing applied


def test_stopped_sshd_unreachable_while_others_finish(lab, clean, book, tmp_path):
    from sparklab import faults

    inv = write_inventory(lab, tmp_path / "inv.yaml")
    down, up = lab.names[0], lab.names[1:]
    faults.stop_sshd(down)
    try:
        report = run(inv, book)
    finally:
        faults.start_sshd(down)
    assert report.hosts[down].unreachable
    assert report.exit_code() == 4
    for h in up:
        assert report.hosts[h].changed == 5 and report.hosts[h].failed == 0
    # the rerun limited to the failed host converges it
    inventory = load_inventory(inv)
    rerun = Report(open(os.devnull, "w"))
    Runner(inventory, load_playbook(book), [down], RunOptions(), rerun).run()
    assert rerun.exit_code() == 0 and rerun.hosts[down].changed == 5
