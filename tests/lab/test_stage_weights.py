"""`invoke stage-weights` against the lab: a hub of our own on the lab bridge, the control machine
as a Spark (the source: it downloads), spark1 and spark2 as receivers over SSH with rsync.

The control machine as the source needs no node-to-node keys: it reaches the Sparks with the
inventory's key and known_hosts. Host-to-host fan-out over fabric addresses (and the download in
the serving image on a Spark) need provision's ssh mesh, FabricInfo and the lab image; the test at
the end runs that path when they are there and says what is missing when they are not.
"""
# Engine: none: no model is served in this module.

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from sparkprov.data.inventory import load_inventory
from sparkprov.engine.report import Report
from sparkprov.plays.stage import StageOptions, run_stage

REPO_ROOT = Path(__file__).resolve().parents[2]
HUB_IP = "10.77.0.1"
TOKEN = "hf_sparkprovLabStageToken" + "x7Q2v9Kp4Lm8Rt3Wz6Yb1Nc5Hd0Jf"
STORE = "~/stagetest"
MiB = 1024 * 1024


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    from sparklab.hub import RepoSpec, ensure_generated, start_in_thread
    from sparklab.hub.manage import default_root

    root = default_root()
    specs = [RepoSpec("stagetest/qwen-mini", num_shards=3, total_size=24 * MiB),
             RepoSpec("stagetest/qwen-kill", num_shards=4, total_size=32 * MiB),
             RepoSpec("stagetest/gemma-gated", num_shards=2, total_size=4 * MiB, gated=True)]
    repos = {s.repo_id: ensure_generated(s, root) for s in specs}
    server = start_in_thread(list(repos.values()), bind=HUB_IP, port=0, token=TOKEN)
    yield server, repos
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def setup(lab, hub, tmp_path_factory):
    server, repos = hub
    d = tmp_path_factory.mktemp("stage")
    store = d / "store"
    inv = d / "inventory.yaml"
    inv.write_text(yaml.safe_dump({
        "defaults": {"user": "nvidia", "ssh_key": str(lab.key), "known_hosts": str(lab.known_hosts),
                     "become_password_file": str(lab.password_file)},
        "hosts": {"localhost": {"connection": "local", "vars": {"model_store": str(store)}},
                  **{n: {"address": a} for n, a in lab.hosts.items()}},
        "vars": {"model_store": STORE, "hf_endpoint": server.url}}, sort_keys=False))
    for n in lab.names:
        lab.ssh(n, f"rm -rf {STORE}")
    return {"inv": inv, "store": store, "server": server, "repos": repos, "lab": lab, "dir": d}


def stage(setup, model, *, env_token=None, **kw):
    inv = load_inventory(setup["inv"])
    hosts = list(inv.hosts)
    buf = io.StringIO()
    report = Report(buf)
    old = {k: os.environ.get(k) for k in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_TOKEN_PATH")}
    os.environ.pop("HF_TOKEN", None)
    os.environ.pop("HUGGING_FACE_HUB_TOKEN", None)
    os.environ["HF_TOKEN_PATH"] = str(setup["dir"] / "no-token")
    if env_token:
        os.environ["HF_TOKEN"] = env_token
    try:
        summary = run_stage(inv, hosts, model, StageOptions(**kw), report)
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return report, summary, buf.getvalue()


def host_hashes(setup, host, repo_id):
    """path -> sha256 of every file under the snapshot, read through the symlinks, on one host."""
    repo = setup["repos"][repo_id]
    snap = f"hub/models--{repo_id.replace('/', '--')}/snapshots/{repo.commit}"
    script = f"cd {snap} && find . -type l -printf '%P\\n' | sort | while read f; do printf '%s  %s\\n' \"$(sha256sum < \"$f\" | cut -c1-64)\" \"$f\"; done"
    if host == "localhost":
        out = subprocess.run(["sh", "-c", f"cd {setup['store']} && {script}"], capture_output=True, text=True).stdout
    else:
        out = setup["lab"].ssh(host, f"cd {STORE} && {script}").stdout
    return dict(reversed(line.split("  ", 1)) for line in out.splitlines())


def hub_hashes(setup, repo_id):
    import hashlib

    repo = setup["repos"][repo_id]
    return {p: (f.sha256 if f.lfs else hashlib.sha256(repo.file_path(p).read_bytes()).hexdigest())
            for p, f in repo.files.items() if p != ".gitattributes"}


def test_cold_stage_lands_identical_verified_files(setup):
    rep, summary, out = stage(setup, "stagetest/qwen-mini")
    assert rep.exit_code() == 0, out
    want = hub_hashes(setup, "stagetest/qwen-mini")
    for host in ["localhost", *setup["lab"].names]:
        assert host_hashes(setup, host, "stagetest/qwen-mini") == want, host
    # downloaded once: every file body left the hub exactly once
    gets = [r for r in setup["server"].state.log if r["method"] == "GET" and "/resolve/" in r["path"]
            and "qwen-mini" in r["path"]]
    assert len(gets) == len(want), gets
    # pipelined: each file went on to both Sparks as it landed, and each hashed it as it arrived,
    # so the send play had nothing left to send and the publish play nothing left to hash
    dl = next(r for r in rep.results if r.host == "localhost" and r.module == "weights_download")
    assert dl.status == "changed" and "each file on to spark1, spark2 as it lands" in dl.msg, dl.msg
    sent = next(r for r in rep.results if r.host == "localhost" and r.module == "weights_send")
    assert sent.status == "ok" and sent.msg == "nothing to send from here", sent.msg
    for h in setup["lab"].names:
        pub = next(r for r in rep.results if r.host == h and r.task.startswith("publish "))
        assert pub.status in ("ok", "changed") and "hash" not in pub.msg, (h, pub.msg)
    # offline serving: huggingface_hub finds the snapshot without the network
    code = ("from huggingface_hub import snapshot_download as s; import sys; "
            "print(s('stagetest/qwen-mini'))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "HF_HOME": str(setup["store"]), "HF_HUB_OFFLINE": "1"})
    assert res.returncode == 0 and setup["repos"]["stagetest/qwen-mini"].commit in res.stdout, res.stderr
    # nothing partial or unverified is left in staging
    assert not [p for p in (setup["store"] / ".sparkprov" / "staging").rglob("*") if p.is_file()]


def test_rerun_is_a_noop_at_one_call_per_host(setup):
    before = len(setup["server"].state.log)
    rep, _, out = stage(setup, "stagetest/qwen-mini")
    assert rep.exit_code() == 0, out
    for name, t in rep.hosts.items():
        assert t.changed == 0 and t.remote_calls == 1, (name, t, out)
    assert not [r for r in setup["server"].state.log[before:] if "/resolve/" in r["path"]]


def test_check_mode_plans_and_transfers_nothing(setup):
    lab = setup["lab"]
    n = len(hub_hashes(setup, "stagetest/qwen-mini"))
    lab.ssh("spark2", f"rm -f {STORE}/hub/models--stagetest--qwen-mini/blobs/*")
    before = len(setup["server"].state.log)
    read = f"find {STORE} -printf '%p %s %T@ %l\\n' 2>/dev/null | sort; docker ps -aq"
    hosts_before = {h: lab.ssh(h, read).stdout for h in lab.names}
    local_before = sorted((str(p), p.stat().st_size) for p in setup["store"].rglob("*") if p.is_file())
    rep, _, out = stage(setup, "stagetest/qwen-mini", check=True)
    # read back with plain ssh: nothing anywhere changed, no container ran, nothing was fetched
    assert {h: lab.ssh(h, read).stdout for h in lab.names} == hosts_before
    assert sorted((str(p), p.stat().st_size) for p in setup["store"].rglob("*") if p.is_file()) == local_before
    assert f"would: send {n} files" in out and "to spark2" in out, out
    assert f"would: hash and publish {n} files as they arrive" in out, out
    assert rep.hosts["spark1"].changed == 0 and rep.hosts["spark2"].changed == 1 and rep.hosts["localhost"].changed == 1
    assert lab.ssh("spark2", f"ls {STORE}/hub/models--stagetest--qwen-mini/blobs | wc -l").stdout.strip() == "0"
    assert not [r for r in setup["server"].state.log[before:] if "/resolve/" in r["path"]]
    rep, _, out = stage(setup, "stagetest/qwen-mini")  # and put it back
    assert rep.exit_code() == 0 and f"send {n} files" in out, out


def test_corrupt_shard_is_detected_and_repaired_from_a_peer(setup):
    lab = setup["lab"]
    repo = setup["repos"]["stagetest/qwen-mini"]
    shard = next(f for p, f in repo.files.items() if p.endswith(".safetensors"))
    blob = f"{STORE}/hub/models--stagetest--qwen-mini/blobs/{shard.sha256}"
    lab.ssh("spark2", f"printf 'garbage!' | dd of={blob} bs=1 seek=4096 conv=notrunc 2>/dev/null")
    before = len(setup["server"].state.log)
    rep, _, out = stage(setup, "stagetest/qwen-mini")
    assert rep.exit_code() == 0, out
    assert "hash 1 files" in out and "send 1 files" in out and "to spark2" in out, out
    assert host_hashes(setup, "spark2", "stagetest/qwen-mini") == hub_hashes(setup, "stagetest/qwen-mini")
    assert not [r for r in setup["server"].state.log[before:] if "/resolve/" in r["path"]], "repaired from a peer"


def test_killed_download_resumes_without_refetching_finished_bytes(setup):
    server = setup["server"]
    repo = setup["repos"]["stagetest/qwen-kill"]
    total = sum(f.size for f in repo.files.values() if f.path != ".gitattributes")
    server.state.control({"throttle_bps": 6 * MiB})
    env = {**os.environ, "HF_TOKEN_PATH": str(setup["dir"] / "no-token"), "PYTHONPATH": str(REPO_ROOT)}
    env.pop("HF_TOKEN", None)
    code = ("import sys; from invoke import Context; from sparkprov.cli.stage import stage_weights; "
            f"stage_weights(Context(), 'stagetest/qwen-kill', inventory={str(setup['inv'])!r}, hosts='localhost')")
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    staging = setup["store"] / ".sparkprov" / "staging" / "hub" / "models--stagetest--qwen-kill" / "blobs"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        partial = sum(p.stat().st_size for p in staging.glob("*")) if staging.exists() else 0
        if partial > 8 * MiB:
            break
        time.sleep(0.1)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    time.sleep(1.5)  # the downloader notices its run is gone and exits
    kept = {p.name: p.stat().st_size for p in staging.glob("*")}
    assert sum(kept.values()) > 8 * MiB, (kept, proc.stdout.read().decode(errors="replace")[-3000:])
    server.state.control({"throttle_bps": None})
    before = len(server.state.log)
    rep, summary, out = stage(setup, "stagetest/qwen-kill")
    assert rep.exit_code() == 0, out
    assert "resuming" in out, out
    log = [r for r in server.state.log[before:] if "/resolve/" in r["path"] and r["method"] == "GET"]
    for blob, size in kept.items():
        mine = [r for r in log if blob in (repo.files[r["path"].split(repo.commit + "/", 1)[1]].sha256,)]
        assert mine and mine[0]["range"] == f"bytes={size}-", (blob, size, mine)
    sent = sum(r["bytes_sent"] for r in log)
    assert sent <= total - sum(kept.values()) + 64 * 1024, (sent, total, kept)
    want = hub_hashes(setup, "stagetest/qwen-kill")
    for host in ["localhost", *setup["lab"].names]:
        assert host_hashes(setup, host, "stagetest/qwen-kill") == want, host


def test_gated_without_token_fails_before_any_transfer(setup):
    before = len(setup["server"].state.log)
    with pytest.raises(Exception) as exc:
        stage(setup, "stagetest/gemma-gated")
    msg = str(exc.value)
    assert "gated" in msg and "no Hugging Face token" in msg and "fix:" in msg and "HF_TOKEN" in msg, msg
    assert not [r for r in setup["server"].state.log[before:] if "/resolve/" in r["path"]]
    assert setup["lab"].ssh("spark1", f"ls {STORE}/hub | grep -c gemma || true").stdout.strip() == "0"


def test_token_goes_only_to_the_downloader_and_never_to_argv_logs_or_files(setup):
    seen: list[str] = []
    stop = threading.Event()

    def watch_ps() -> None:
        while not stop.is_set():
            seen.append(subprocess.run(["ps", "-eww", "-o", "args="], capture_output=True, text=True).stdout)
            for n in setup["lab"].names:  # inside each host too (own /proc in its pid view)
                seen.append(setup["lab"].sh(n, "ps -eww -o args=").stdout)
            time.sleep(0.05)

    t = threading.Thread(target=watch_ps, daemon=True)
    t.start()
    setup["server"].state.control({"throttle_bps": 2 * MiB})
    try:
        rep, summary, out = stage(setup, "stagetest/gemma-gated", env_token=TOKEN)
    finally:
        setup["server"].state.control({"throttle_bps": None})
        stop.set()
        t.join()
    assert rep.exit_code() == 0, out
    assert len(seen) > 10
    assert not [s for s in seen if TOKEN in s], "token in a process list"
    assert TOKEN not in out and TOKEN not in str(summary)
    assert not [r for r in setup["server"].state.log if r["auth"] and "gemma" not in r["path"]]
    # the token was used (gated repo) and reached no file left behind, locally or on a Spark
    grep = subprocess.run(["grep", "-rl", TOKEN, str(setup["dir"]), "/tmp"], capture_output=True, text=True)
    assert grep.stdout.strip() == "", grep.stdout
    for n in setup["lab"].names:
        res = setup["lab"].sh(n, f"grep -rl {TOKEN} /home /tmp 2>/dev/null")
        assert res.stdout.strip() == "", (n, res.stdout)
    want = hub_hashes(setup, "stagetest/gemma-gated")
    for host in ["localhost", *setup["lab"].names]:
        assert host_hashes(setup, host, "stagetest/gemma-gated") == want, host


def test_not_enough_space_fails_with_numbers_before_any_transfer(setup, tmp_path):
    import shutil

    inv_text = setup["inv"].read_text()
    small = tmp_path / "tiny-fs"
    small.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(small)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip("cannot mount a small tmpfs here")
    try:
        doc = yaml.safe_load(inv_text)
        doc["hosts"]["localhost"]["vars"]["model_store"] = f"{small}/store"
        setup["inv"].write_text(yaml.safe_dump(doc, sort_keys=False))
        before = len(setup["server"].state.log)
        rep, _, out = stage(setup, "stagetest/qwen-kill")
        assert rep.exit_code() == 2
        assert "not enough space" in out and "MB free" in out and "the stage needs 33." in out, out
        assert not [r for r in setup["server"].state.log[before:] if "/resolve/" in r["path"]]
    finally:
        setup["inv"].write_text(inv_text)
        subprocess.run(["umount", str(small)])
        shutil.rmtree(small, ignore_errors=True)


def test_host_to_host_fan_out_over_fabric(setup):
    """spark1 downloads in the serving image and feeds spark2 over its fabric address."""
    lab = setup["lab"]
    # The host-to-host path stands on provision (fabric addresses, the SSH mesh pinned for them)
    # and the serving image in the lab registry: make sure both are there, as an owner would.
    from sparkprov.cli.common import run_playbook
    from sparklab.image import ensure_images
    from sparklab.state import BRIDGE_IP, REGISTRY_PORT

    ensure_images(f"http://{BRIDGE_IP}:{REGISTRY_PORT}")
    prov = lab.write_inventory(setup["inv"].parent / "provision-inventory.yaml")
    assert run_playbook(playbook=str(Path(__file__).resolve().parents[2] / "playbooks" / "provision.yaml"),
                        inventory=str(prov), hosts=None, as_json=True) == 0
    addr = lab.sh("spark2", "ip -4 -o addr show dev enp1s0f1np1 | awk '{print $4}' | cut -d/ -f1").stdout.strip()
    assert lab.ssh("spark1", f"ssh -o BatchMode=yes -o ConnectTimeout=3 nvidia@{addr} true").returncode == 0
    inv_text = setup["inv"].read_text()
    doc = yaml.safe_load(inv_text)
    del doc["hosts"]["localhost"]
    setup["inv"].write_text(yaml.safe_dump(doc, sort_keys=False))
    try:
        for n in lab.names:
            lab.ssh(n, f"rm -rf {STORE}")
        rep, summary, out = stage(setup, "stagetest/qwen-mini", image="vllm/vllm-openai:cu130-nightly")
        assert rep.exit_code() == 0, out
        assert summary["source"] == "spark1" and summary["hosts"]["spark2"]["fabric_address"], summary
        for n in lab.names:
            assert host_hashes(setup, n, "stagetest/qwen-mini") == hub_hashes(setup, "stagetest/qwen-mini")
        owners = lab.ssh("spark1", f"find {STORE} ! -user nvidia | head -3").stdout.strip()
        assert owners == "", f"root-owned files in the store (G23): {owners}"
    finally:
        setup["inv"].write_text(inv_text)
