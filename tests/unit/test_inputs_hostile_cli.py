"""The hostile command lines (issue 24), run through the real command line: each case in
tests/fixtures/hostile/cli/*.yaml is one `invoke ...` with the files it needs, run by invoke's own
Program in process against tasks.py (as test_inputs_properties.py does), from an empty folder, with
an inventory whose hosts and hub listen on nothing (port 9). Each must end with its exit code and
exactly its one line on stderr, print nothing before it, never a traceback, and create or change
nothing (the case folder holds what it held, the working folder stays empty).

A case file:
    argv: [cluster-up, --playbook, "{dir}/serve.yaml", --inventory, "{inventory}", --check]
    files: {serve.yaml: "...", big.yaml: {repeat: "line\\n", times: 1000}}   # written first
    fifos: [pipe]                       # named pipes made first
    symlinks: {zero.yaml: /dev/zero}    # links made first
    env: {SPARK_SUDO_PASSWORD: "pw\\nx"}
    exit: 1                             # default 1
    stderr: "sparkprov: {dir}/serve.yaml:6:34: ..."   # the one line, exactly
{dir} is the case's folder, {inventory} the safe inventory in it (unless the case writes
inventory.yaml itself). Hugging Face tokens are unset for every case.
Each case takes well under a second in process; as separate `invoke` processes the set was
measured once by hand (the report of the commit that added it), none near 5 s."""

import os
import stat
from pathlib import Path

import pytest
import yaml

from test_inputs_properties import invoke

CASES = sorted((Path(__file__).resolve().parents[1] / "fixtures" / "hostile" / "cli").glob("*.yaml"))
INVENTORY = ("defaults: {port: 9, connect_timeout: 1}\nhosts:\n  s1: {address: 127.0.0.1}\n"
             "  s2: {address: 127.0.0.1}\ngroups:\n  sparks: [s1, s2]\nvars:\n  hf_endpoint: http://127.0.0.1:9\n")


def snapshot(d: Path) -> dict[str, tuple]:
    """Every entry under d (links not followed): kind, size and mtime, so a change shows."""
    out = {}
    for root, dirs, files in os.walk(d):
        for name in dirs + files:
            p = Path(root) / name
            st = p.lstat()
            out[str(p.relative_to(d))] = (stat.S_IFMT(st.st_mode), st.st_size, st.st_mtime_ns)
    return out


def prepare(case: dict, d: Path) -> None:
    (d / "inventory.yaml").write_text(INVENTORY)
    for name, content in (case.get("files") or {}).items():
        text = content["repeat"] * content["times"] if isinstance(content, dict) else content
        (d / name).parent.mkdir(parents=True, exist_ok=True)
        (d / name).write_text(text)
    for name in case.get("fifos") or []:
        os.mkfifo(d / name)
    for name, target in (case.get("symlinks") or {}).items():
        (d / name).symlink_to(target.format(dir=d))


@pytest.mark.parametrize("path", CASES, ids=lambda p: p.stem)
def test_hostile_command_line_is_one_line_and_changes_nothing(path, tmp_path, monkeypatch):
    case = yaml.safe_load(path.read_text())
    d, cwd = tmp_path / "case", tmp_path / "cwd"
    d.mkdir()
    cwd.mkdir()
    prepare(case, d)
    for var in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "SPARKPROV_INVENTORY", "SPARKPROV_BECOME_PASSWORD"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_TOKEN_PATH", str(d / "no-token"))
    for var, value in (case.get("env") or {}).items():
        monkeypatch.setenv(var, value)
    monkeypatch.chdir(cwd)
    subst = {"dir": str(d), "inventory": str(d / "inventory.yaml")}
    before = snapshot(d)
    code, out, err = invoke(*[a.format(**subst) for a in case["argv"]])
    assert "Traceback" not in out + err
    assert err.splitlines() == [case["stderr"].format(**subst)], err
    assert out == "", out  # nothing before the error: no table, no PLAY
    assert code == case.get("exit", 1)
    assert snapshot(d) == before  # nothing created, removed or changed
    assert list(cwd.iterdir()) == []
