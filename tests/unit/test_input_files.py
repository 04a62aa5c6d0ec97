"""Every file sparkprov reads is a regular file of sane size before it is read: a FIFO must not
block the run, /dev/zero must not be read until memory runs out, a directory or a huge file is one
line naming the file. Driven through the real command line with a timeout (a hang fails the test),
with loopback-only inventories (port 9: nothing listens).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from sparkprov.data.inventory import load_inventory
from sparkprov.errors import InputError
from sparkprov.inputfiles import MAX_KEY, MAX_KNOWN_HOSTS, MAX_SECRET, MAX_YAML, read_text_checked
from sparkprov.yamlpos import load_yaml
from helpers import SAFE_INVENTORY

REPO = Path(__file__).resolve().parents[2]
GOOD_PLAYBOOK = "- hosts: all\n  tasks:\n    - name: t\n      command: {argv: [\"true\"]}\n"


def invoke(args: list[str], cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(("SPARKPROV_", "HF_"))}
    full_env.update(env or {})
    # 60 s: a FIFO that blocks an open() or a /dev/zero read would hang far longer
    return subprocess.run([sys.executable, "-m", "invoke", "--search-root", str(REPO), *args], cwd=cwd,
                          capture_output=True, text=True, timeout=60, env=full_env)


def one_line_exit_1(proc: subprocess.CompletedProcess, *needles: str) -> str:
    out = proc.stdout + proc.stderr
    assert "Traceback" not in out, out
    assert proc.returncode == 1, (proc.returncode, out)
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    for n in needles:
        assert n in lines[0], (n, lines[0])
    assert "PLAY [" not in proc.stdout
    return lines[0]


@pytest.fixture
def d(tmp_path):
    (tmp_path / "inventory.yaml").write_text(SAFE_INVENTORY)
    (tmp_path / "good.yaml").write_text(GOOD_PLAYBOOK)
    os.mkfifo(tmp_path / "fifo")
    os.mkdir(tmp_path / "dir")
    with open(tmp_path / "huge.yaml", "wb") as fh:  # sparse: bytes that take no disk
        fh.truncate(max(MAX_YAML, MAX_KNOWN_HOSTS, MAX_KEY, MAX_SECRET) + 1)
    return tmp_path


BAD_FILES = {
    "fifo": "is a FIFO (named pipe), not a regular file",
    "/dev/zero": "is a character device, not a regular file",
    "dir": "is a directory",
    "huge.yaml": "more than the 8 MiB such a file may be",
    "missing.yaml": "file not found",
}


def _path(d: Path, name: str) -> str:
    return name if name.startswith("/") else str(d / name)


@pytest.mark.parametrize("name", BAD_FILES)
def test_inventory_file(d, name):
    # an inventory has its own, smaller bound (inputfiles.MAX_INVENTORY)
    line = one_line_exit_1(invoke(["play", str(d / "good.yaml"), "--inventory", _path(d, name)], d),
                           BAD_FILES[name].replace("8 MiB", "256 KiB"), "inventory")
    assert line.startswith(f"sparkprov: {_path(d, name)}: ")


@pytest.mark.parametrize("name", BAD_FILES)
def test_playbook_file(d, name):
    one_line_exit_1(invoke(["play", _path(d, name), "--inventory", str(d / "inventory.yaml")], d),
                    BAD_FILES[name], "playbook")


@pytest.mark.parametrize("name", ["fifo", "/dev/zero", "dir"])
def test_inventory_from_environment(d, name):
    one_line_exit_1(invoke(["facts"], d, {"SPARKPROV_INVENTORY": _path(d, name)}), BAD_FILES[name])


@pytest.mark.parametrize("setting", ["become_password_file", "ssh_key", "known_hosts"])
@pytest.mark.parametrize("name", ["fifo", "/dev/zero", "dir", "huge.yaml"])
def test_files_named_in_the_inventory_are_checked_before_any_host(d, setting, name):
    """The error points at the setting in the inventory; no host is contacted."""
    inv = d / "files.yaml"
    inv.write_text(f"defaults: {{port: 9, connect_timeout: 1, {setting}: '{_path(d, name)}'}}\n"
                   "hosts:\n  s1: {address: 127.0.0.1}\n")
    line = one_line_exit_1(invoke(["play", str(d / "good.yaml"), "--inventory", str(inv)], d), setting,
                           "of host s1")
    assert line.startswith(f"sparkprov: {inv}:1:")
    if name != "huge.yaml":
        assert BAD_FILES[name].split(",")[0] in line


def test_missing_known_hosts_is_fine(d):
    """--accept-new-host-keys creates it: a missing known_hosts is not an input error."""
    inv = d / "files.yaml"
    inv.write_text(f"hosts:\n  s1: {{address: 127.0.0.1, port: 9, connect_timeout: 1, known_hosts: '{d}/kh'}}\n")
    proc = invoke(["play", str(d / "good.yaml"), "--inventory", str(inv), "--check"], d)
    assert proc.returncode == 4 and "Traceback" not in proc.stdout + proc.stderr


@pytest.mark.parametrize("name", ["fifo", "/dev/zero", "dir"])
def test_recipe_file(d, name):
    proc = invoke(["models", "--recipes", _path(d, name)], d)
    assert "Traceback" not in proc.stdout + proc.stderr
    assert proc.returncode == 1
    assert BAD_FILES[name] in proc.stderr and len(proc.stderr.splitlines()) == 1


@pytest.mark.parametrize("name", ["fifo", "/dev/zero", "dir"])
def test_hf_token_file(d, name):
    """stage-weights reads huggingface_hub's token file: a FIFO there must not block it."""
    inv = d / "hub.yaml"
    inv.write_text(SAFE_INVENTORY + "vars: {hf_endpoint: 'http://127.0.0.1:9'}\n")
    one_line_exit_1(invoke(["stage-weights", "org/name", "--inventory", str(inv), "--check"], d,
                           {"HF_TOKEN_PATH": _path(d, name)}), "Hugging Face token file", BAD_FILES[name])


# -- the reader itself ---------------------------------------------------------------------------
def test_read_text_checked_limits_and_utf8(tmp_path):
    f = tmp_path / "f"
    f.write_bytes(b"a: 1\n")
    assert read_text_checked(f, "thing", 5) == "a: 1\n"
    with pytest.raises(InputError, match="more than the 4 bytes"):
        read_text_checked(f, "thing", 4)
    f.write_bytes(b"a: 1\nb: \xff\n")
    with pytest.raises(InputError) as err:
        read_text_checked(f, "thing", 100)
    assert err.value.line() == f"{f}:2:4: not UTF-8: byte 0xff (invalid start byte) (fix: save the file as UTF-8)"


def test_symlink_to_a_fifo_is_refused(tmp_path):
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "link.yaml").symlink_to(tmp_path / "fifo")
    with pytest.raises(InputError, match="FIFO"):
        load_inventory(tmp_path / "link.yaml")


# -- YAML: merge keys, and where an unclosed quote is reported -------------------------------------
def test_merge_key_override_is_not_a_duplicate(tmp_path):
    f = tmp_path / "inventory.yaml"
    f.write_text("hosts:\n"
                 "  s1: &base {address: 127.0.0.1, port: 22}\n"
                 "  s2:\n"
                 "    <<: *base\n"
                 "    port: 2222\n")
    inv = load_inventory(f)
    assert inv.hosts["s2"].port == 2222 and inv.hosts["s2"].address == "127.0.0.1"
    assert inv.hosts["s1"].port == 22


def test_merge_keys_follow_yaml_semantics(tmp_path):
    """The first listed base wins over later ones; the mapping's own key over both (as PyYAML)."""
    import yaml

    text = ("a: &a {k: 1, x: a}\nb: &b {k: 2, y: b}\n"
            "m:\n  <<: [*a, *b]\n  x: own\n"
            "again: *a\n")
    f = tmp_path / "m.yaml"
    f.write_text(text)
    data, _ = load_yaml(f)
    assert data == yaml.safe_load(text)
    assert data["m"] == {"k": 1, "x": "own", "y": "b"}


def test_unclosed_quote_names_the_line_it_opens_on(tmp_path):
    f = tmp_path / "inventory.yaml"
    f.write_text('hosts:\n  s1: {address: "127.0.0.1}\n  s2: {}\n  s3: {}\n')
    with pytest.raises(InputError) as err:
        load_inventory(f)
    assert err.value.line().startswith(f"{f}:2:")
