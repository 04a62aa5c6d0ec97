"""Issue 12: systemd units for real Sparks, of the container cluster-up runs assembled in the
foreground (`invoke recipe ALIAS --systemd` prints them), checked by systemd's own parser
(`systemd-analyze verify`)."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from sparkprov.catalog.load import load_catalog
from sparkprov.catalog.render import HostServeContext, render_launch
from sparkprov.serving import spec, systemd


def _specs(foreground: bool):
    cat = load_catalog()
    r = cat.get("llama-3.3-70b")
    ctx = dict(host_known=True, model_store="/home/nvidia/vllm", compile_cache="/home/nvidia/vllm-compile-cache",
               api_key_file="/home/nvidia/.config/sparkprov/api_key", fabric_ifaces=["enp1s0f1np1"],
               ib_hcas=["rocep1s0f1"], cluster_size=2)
    launches = [render_launch(r, HostServeContext(host=h, node_ip=ip, container_name=f"sparkprov-l-rank{n}", **ctx),
                              2, None, catalog=cat)
                for n, (h, ip) in enumerate((("spark1", "192.168.100.11"), ("spark2", "192.168.100.12")))]
    single = render_launch(cat.get("qwen3.6-27b"), HostServeContext(host="spark1", **{**ctx, "cluster_size": None}),
                           1, None, catalog=cat)
    return [spec.single("one", "spark1", single, foreground=foreground),
            spec.native_rank("l", "spark1", launches[0], rank=0, nnodes=2, pp=1, master_addr="192.168.100.11",
                             master_port=29501, foreground=foreground),
            spec.ray_rank("l", "spark2", launches[1], rank=1, nnodes=2, head_ip="192.168.100.11", ray_port=6379,
                          rank0_id="0123456789ab", foreground=foreground)]


def _foreground(detached: list[str]) -> list[str]:
    """A detached `docker run` as systemd runs it: --rm for -d, no restart policy."""
    i = detached.index("--restart")
    return detached[:2] + ["--rm"] + [w for w in detached[2:i] + detached[i + 2:] if w != "-d"]


def _exec_argv(unit: str, key: str) -> list[str]:
    """systemd's own reading of an Exec line (systemd.syntax(7)): words split on spaces, double
    quotes group, C escapes inside them (\\\\, \\", \\n); then $$ and %% undone."""
    line = next(ln for ln in unit.splitlines() if ln.startswith(key + "="))[len(key) + 1:]
    escapes = {"\\": "\\", '"': '"', "n": "\n", "t": "\t"}
    words, cur, quoted, i = [], None, False, 0
    while i < len(line):
        ch = line[i]
        if quoted and ch == "\\":
            cur += escapes[line[i + 1]]
            i += 2
            continue
        if ch == '"':
            quoted, cur = not quoted, cur if cur is not None else ""
        elif ch == " " and not quoted:
            if cur is not None:
                words.append(cur)
            cur = None
        else:
            cur = (cur or "") + ch
        i += 1
    assert not quoted, "an unclosed quote in " + key
    if cur is not None:
        words.append(cur)
    return [w.replace("$$", "$").replace("%%", "%") for w in words]


@pytest.mark.parametrize("which", range(3))
def test_unit_runs_the_spec_in_the_foreground_and_verifies(tmp_path, which):
    s, detached = _specs(True)[which], _specs(False)[which]
    unit = systemd.render(s, user="nvidia", start_timeout_s=900)
    assert "Restart=always" in unit and "Restart=on-failure" not in unit and "TimeoutStartSec=900" in unit and "User=nvidia" in unit
    assert 'ExecStartPre=+/bin/sh -c "sync && echo 3 > /proc/sys/vm/drop_caches"' in unit  # G15, as root
    argv = _exec_argv(unit, "ExecStart")
    assert argv[1:] == s.argv[1:] and argv[0] == "/usr/bin/docker"
    assert "-d" not in s.argv and "--restart" not in s.argv and s.argv[:3] == ["docker", "run", "--rm"]
    # the detached container otherwise (its recipe hash too): every flag, label and the wrapper script
    # survive systemd's quoting
    assert s.argv == _foreground(detached.argv) and s.hash == detached.hash
    if shutil.which("systemd-analyze") is None:
        pytest.fail("systemd-analyze is not installed (make deps installs systemd)")
    path = tmp_path / systemd.unit_name(s)
    path.write_text(unit)
    # docker as the lab machine has it or not: verify needs the binary to exist
    res = subprocess.run(["systemd-analyze", "verify", "--man=no", str(path)], capture_output=True, text=True)
    problems = [ln for ln in (res.stderr + res.stdout).splitlines()
                if str(path.name) in ln or "Unknown" in ln or "Invalid" in ln or "Failed" in ln]
    problems = [p for p in problems if "docker.service" not in p and "Command /usr/bin/docker" not in p]
    assert not problems, res.stderr


def test_invoke_recipe_systemd_prints_the_unit_of_what_cluster_up_runs(capsys):
    """The unit `invoke recipe ALIAS --systemd --host H` prints runs, in the foreground, the container
    cluster-up starts for `cluster-up --model ALIAS --hosts H` (rendered as the golden file's are)."""
    from invoke import Context

    from sparkprov.catalog.load import load_catalog
    from sparkprov.cli import catalog as cli
    from sparkprov.data.inventory import load_inventory
    from tests.fixtures.golden import make

    cli.recipe(Context(), "qwen3.6-27b", host="spark1", inventory=str(make.INVENTORY), systemd=True)
    unit = capsys.readouterr().out
    assert unit.startswith("# spark1: /etc/systemd/system/sparkprov-qwen3.6-27b.service\n[Unit]")
    up = make.deployment_cases(load_catalog(), load_inventory(make.INVENTORY), "qwen3.6-27b", ["spark1"],
                               {"name": "qwen3.6-27b"})["spark1"]
    assert _exec_argv(unit, "ExecStart")[1:] == _foreground(up["argv"])[1:]
    assert f"(recipe {up['hash']})" in unit and "User=nvidia" in unit
