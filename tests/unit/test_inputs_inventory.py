"""Inventory input at the door (issue 24), through the real tasks with hosts that listen on
nothing (a check made after connecting would print a PLAY or end in "unreachable", exit 4):
- a sudo password from the environment with a line break is one line at the inventory setting
  that names the variable, before the play (it was a failure per host inside the play);
- an inventory over its size bound (inputfiles.MAX_INVENTORY) is refused before it is parsed
  (a 5 MB one took 7 to 58 s to be refused on a 2-core machine, now well under a second)."""

import contextlib
import io

import pytest
from invoke import Context

from sparkprov.cli.cluster import cluster_up
from sparkprov.cli.common import run_playbook
from sparkprov.cli.store import store
from sparkprov.inputfiles import MAX_INVENTORY
from helpers import refused

PLAYBOOK = "- hosts: all\n  tasks:\n    - name: t\n      command: {argv: [\"true\"]}\n"
INV_PW = ("defaults: {port: 9, connect_timeout: 1, become_password_env: SPARK_SUDO_PASSWORD}\n"
          "hosts:\n  s1: {address: 127.0.0.1}\n  s2: {address: 127.0.0.1, become_password_env: OTHER_PW}\n")


@pytest.fixture
def inv_pw(tmp_path, monkeypatch):
    for var in ("SPARK_SUDO_PASSWORD", "OTHER_PW", "SPARKPROV_BECOME_PASSWORD"):
        monkeypatch.delenv(var, raising=False)
    path = tmp_path / "inventory.yaml"
    path.write_text(INV_PW)
    (tmp_path / "play.yaml").write_text(PLAYBOOK)
    return path


@pytest.mark.parametrize("password", ["pw\nrm -rf /", "pw\r", "\npw", "pw\r\nsecond"])
def test_sudo_password_with_a_line_break_is_one_line_before_the_play(inv_pw, monkeypatch, password):
    monkeypatch.setenv("SPARK_SUDO_PASSWORD", password)
    want = (f"{inv_pw}:1:62: become_password_env of host s1: the sudo password in $SPARK_SUDO_PASSWORD holds a "
            "line break or NUL (fix: set SPARK_SUDO_PASSWORD to the password alone, on one line)")
    play = inv_pw.parent / "play.yaml"
    assert refused(lambda: run_playbook(playbook=str(play), inventory=str(inv_pw), hosts=None)) == want
    assert refused(lambda: store(Context(), inventory=str(inv_pw))) == want
    assert refused(lambda: cluster_up(Context(), model="llama-3.3-70b", tp=2, inventory=str(inv_pw),
                                      check=True)) == want
    assert password not in want


def test_host_setting_is_named_at_its_own_line(inv_pw, monkeypatch):
    monkeypatch.setenv("OTHER_PW", "a\nb")
    msg = refused(lambda: store(Context(), inventory=str(inv_pw)))
    assert msg.startswith(f"{inv_pw}:4:") and "host s2" in msg and "$OTHER_PW" in msg, msg


def test_fallback_password_variable_too(inv_pw, tmp_path, monkeypatch):
    monkeypatch.setenv("SPARKPROV_BECOME_PASSWORD", "pw\n")
    plain = tmp_path / "plain.yaml"
    plain.write_text("defaults: {port: 9, connect_timeout: 1}\nhosts:\n  s1: {address: 127.0.0.1}\n")
    assert refused(lambda: store(Context(), inventory=str(plain))) == (
        "the sudo password in $SPARKPROV_BECOME_PASSWORD holds a line break or NUL "
        "(fix: set SPARKPROV_BECOME_PASSWORD to the password alone, on one line)")


def test_a_good_password_goes_on_to_the_hosts(inv_pw, monkeypatch):
    monkeypatch.setenv("SPARK_SUDO_PASSWORD", "pw with spaces and $(quotes)'")
    with contextlib.redirect_stdout(io.StringIO()):
        code = run_playbook(playbook=str(inv_pw.parent / "play.yaml"), inventory=str(inv_pw), hosts=None)
    assert code == 4  # unreachable: the check let it through


def _inventory_text(size: int) -> str:
    """A well-formed inventory of many hosts, `size` bytes or a little more."""
    lines, total, i = ["hosts:"], 7, 0
    while total < size:
        lines.append(f"  host{i}: {{address: 10.0.{i // 250 % 250}.{i % 250 + 1}, user: nvidia}}")
        total += len(lines[-1]) + 1
        i += 1
    return "\n".join(lines) + "\n"


def test_a_5_mb_inventory_is_refused_before_it_is_parsed(tmp_path):
    path = tmp_path / "inventory.yaml"
    path.write_text(_inventory_text(5_000_000))
    (tmp_path / "play.yaml").write_text(PLAYBOOK)
    assert refused(lambda: run_playbook(playbook=str(tmp_path / "play.yaml"), inventory=str(path), hosts=None)) == (
        f"{path}: inventory: is 5 MiB, more than the 256 KiB such a file may be (fix: check that this is the right file)")


def test_an_inventory_just_under_the_bound_loads(tmp_path):
    from sparkprov.data.inventory import load_inventory

    path = tmp_path / "inventory.yaml"
    text = _inventory_text(MAX_INVENTORY - 200)
    path.write_text(text)
    assert len(text.encode()) <= MAX_INVENTORY
    assert len(load_inventory(path).hosts) == text.count("\n") - 1
