"""Every kind of bad input gets one line naming file, line, column and the fix; nothing runs."""

import subprocess
import sys
from pathlib import Path

import pytest
from invoke.exceptions import Exit

from sparkprov.cli.common import run_playbook
from sparkprov.data.inventory import load_inventory
from sparkprov.errors import InputError
from helpers import SAFE_INVENTORY

BAD = Path(__file__).resolve().parents[1] / "fixtures" / "bad"
REPO = Path(__file__).resolve().parents[2]



def expected(path: Path) -> str:
    first = path.read_text().splitlines()[0]
    assert first.startswith("# expect: ")
    return str(path) + first[len("# expect: "):]


@pytest.mark.parametrize("path", sorted((BAD / "inventory").glob("*.yaml")), ids=lambda p: p.stem)
def test_bad_inventory_message(path):
    with pytest.raises(InputError) as err:
        load_inventory(path)
    assert err.value.line() == expected(path)


@pytest.mark.parametrize("path", sorted((BAD / "playbook").glob("*.yaml")), ids=lambda p: p.stem)
def test_bad_playbook_message(path, tmp_path, capsys):
    inv = tmp_path / "inventory.yaml"
    inv.write_text(SAFE_INVENTORY)
    with pytest.raises(Exit) as err:
        run_playbook(playbook=str(path), inventory=str(inv), hosts=None)
    assert err.value.code == 1
    assert err.value.message == "sparkprov: " + expected(path)
    out = capsys.readouterr().out
    assert "unreachable" not in out and "PLAY [" not in out  # nothing was started


def test_cli_bad_input_is_one_line_exit_1(tmp_path):
    inv = tmp_path / "inventory.yaml"
    inv.write_text(SAFE_INVENTORY)
    path = BAD / "playbook" / "bad_arg.yaml"
    proc = subprocess.run([sys.executable, "-m", "invoke", "play", str(path), "--inventory", str(inv)],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert proc.stderr.strip() == "sparkprov: " + expected(path)
    assert "Traceback" not in proc.stderr + proc.stdout


def test_unknown_host_on_command_line(tmp_path):
    inv = tmp_path / "inventory.yaml"
    inv.write_text(SAFE_INVENTORY)
    with pytest.raises(Exit) as err:
        run_playbook(playbook=str(BAD.parent / "playbooks" / "files.yaml"), inventory=str(inv), hosts="s1,s3")
    assert err.value.code == 1
    assert err.value.message == ("sparkprov: --hosts: unknown host or group 's3' in --hosts "
                                 f"(fix: define it under hosts: or groups: in {inv})")
