"""A fabric link cut during the stage-weights fan-out, on the host-to-host path: spark1 is the
source (it downloads from a hub of our own in the serving image) and feeds spark2 with rsync over
spark2's fabric address (provision's SSH mesh). The rail is slowed so that the cut lands mid-way,
when some files have arrived on spark2 and one is most often partial. The run must fail for spark2 only,
naming the rsync from spark1 to spark2's fabric address; with the link back, a rerun completes and
sends (counted on spark1's rail) only the bytes spark2 did not have: finished files are not sent
again, partial ones are resumed; nothing is fetched from the hub again.
"""
# Engine: none: no model is served in this module.
from __future__ import annotations

import io
import threading
import time
from pathlib import Path

import pytest

from sparkprov.data.inventory import load_inventory
from sparkprov.engine.report import Report

from ._lab import converge, problems, write_inventory

pytestmark = [pytest.mark.lab, pytest.mark.slow]

HUB_IP = "10.77.0.1"
MODEL = "reltest/fanout-cut"
STORE = "~/relfanout"
IMAGE = "vllm/vllm-openai:cu130-nightly"   # the serving image: huggingface_hub runs in it on spark1
MiB = 1024 * 1024
TOTAL = 48 * MiB
RATE = "40mbit"                            # ~5 MB/s on the rail: the fan-out takes ~10 s
# A cut cable sends no FIN: the sender's ssh gives up after four unanswered keep-alives 5 s apart
# (staging/fanout.py SSH_BASE), the play ends a few seconds later (34 s measured; 86 s with the
# keep-alives 15 s apart that it had before)
CUT_NOTICED_BOUND_S = 50


@pytest.fixture(scope="module")
def hub():
    from sparklab.hub import RepoSpec, ensure_generated, start_in_thread
    from sparklab.hub.manage import default_root

    root = default_root()
    repo = ensure_generated(RepoSpec(MODEL, num_shards=6, total_size=TOTAL), root)
    server = start_in_thread([repo], bind=HUB_IP, port=0)
    yield server, repo
    server.shutdown()
    server.server_close()


def _stage(inv: Path, report: Report) -> dict:
    from sparkprov.plays.stage import StageOptions, run_stage

    inventory = load_inventory(inv)
    return run_stage(inventory, list(inventory.hosts), MODEL, StageOptions(image=IMAGE, streams=2), report)


def _sizes(lab, host: str, where: str) -> dict[str, int]:
    out = lab.sh(host, f"cd /home/nvidia/{STORE[2:]}/{where} 2>/dev/null && find . -type f -printf '%s %P\\n'").stdout
    return {p: int(s) for s, p in (ln.split(" ", 1) for ln in out.splitlines())}


def _blobs(repo) -> dict[str, int]:
    """blob name in the store -> size, for every file of the repo (weights: sha256, small files: git oid)."""
    return {(f.sha256 if f.lfs else f.oid): f.size for f in repo.files.values() if f.path != ".gitattributes"}


def _tx(lab, host: str, iface: str) -> int:
    return int(lab.sh(host, f"cat /sys/class/net/{iface}/statistics/tx_bytes").stdout)


def _rsyncs(lab, host: str) -> list[int]:
    from sparklab.hosts import host_pids

    out = []
    for pid in host_pids(host):
        try:
            if Path(f"/proc/{pid}/comm").read_text().strip() == "rsync":
                out.append(pid)
        except OSError:
            pass
    return out


def test_fabric_link_cut_during_fan_out_then_rerun_sends_only_missing_bytes(lab, hub, tmp_path):
    from sparklab import faults

    server, repo = hub
    inv = write_inventory(lab, tmp_path / "inventory.yaml", store=STORE, extra_vars={"hf_endpoint": server.url})
    from sparklab.image import ensure_images
    from sparklab.state import BRIDGE_IP, REGISTRY_PORT

    # the serving image the download runs in, in the lab registry (lab.up does not push it; run alone,
    # on a fresh lab, this test found no image and its download failed before any byte moved)
    ensure_images(f"http://{BRIDGE_IP}:{REGISTRY_PORT}", [IMAGE])
    converge(inv)  # the SSH mesh and the fabric addresses the fan-out uses
    folder = "hub/models--" + MODEL.replace("/", "--")
    blobs = _blobs(repo)
    assert sum(blobs.values()) > 0.95 * TOTAL
    for h in lab.names:
        lab.sh(h, f"rm -rf /home/nvidia/{STORE[2:]}")
    fabric = lab.sh("spark2", "ip -o -4 addr show scope global | grep -v enP7s7").stdout
    addr = next(ln.split()[3].split("/")[0] for ln in fabric.splitlines() if " enp1s0f1np1 " in ln)
    iface = "enp1s0f1np1"

    report = Report(io.StringIO())
    box: dict = {}

    def first():
        try:
            box["summary"] = _stage(inv, report)
        except BaseException as exc:  # noqa: BLE001 - reported below
            box["error"] = exc

    faults.slow_link("spark1", iface, rate=RATE)
    cut = 0.0
    try:
        t = threading.Thread(target=first, daemon=True)
        t.start()
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and t.is_alive():
            arrived = sum(_sizes(lab, "spark2", ".sparkprov/staging").values()) + \
                sum(s for p, s in _sizes(lab, "spark2", f"{folder}/blobs").items())
            if arrived > TOTAL // 2:
                faults.cut_link("spark2", iface)
                cut = time.monotonic()
                break
            time.sleep(0.2)
        assert cut, ("the fan-out ended before the cut", box, report.results)
        t.join(timeout=180)
        assert not t.is_alive(), "the stage did not notice the cut link"
        noticed = time.monotonic() - cut
        assert noticed < CUT_NOTICED_BOUND_S, f"the stage took {noticed:.0f}s to notice the cut link"
        # The receiving `rsync --server` on spark2 does not time out: its generator's keep-alives go
        # into the socket buffer (rsync counts that as progress) and sshd has no ClientAlive. It
        # holds its files open, idle, until TCP gives up; the rerun goes on beside it (--append
        # --inplace: what it wrote is on disk; sha256 at publish guards the rest).
        stale = _rsyncs(lab, "spark2")
    finally:
        faults.restore_link("spark2", iface)
        faults.unslow_link("spark1", iface)
    assert "error" not in box, box
    summary = box["summary"]
    assert summary["source"] == "spark1" and summary["hosts"]["spark2"]["fabric_address"] == addr, summary
    res = {(r.host, r.task): r for r in report.results}
    assert report.hosts["spark1"].failed == 0 and report.hosts["spark2"].failed >= 1, report.results
    assert res[("spark1", f"download {MODEL}")].status == "changed"
    recv = res[("spark2", f"publish {MODEL}")]
    assert recv.status == "failed" and f"rsync spark1 -> spark2 ({addr}) failed" in recv.msg, recv.msg
    assert "files still missing" in recv.msg and len(recv.msg.splitlines()) == 1, recv.msg

    # what spark2 kept: whole files (published or staged) and partial ones
    published = {p.rsplit("/", 1)[-1]: s for p, s in _sizes(lab, "spark2", f"{folder}/blobs").items()}
    staged = {p.rsplit("/", 1)[-1]: s for p, s in _sizes(lab, "spark2", f".sparkprov/staging/{folder}/blobs").items()}
    assert set(published) | set(staged) <= set(blobs), (published, staged)  # no rsync temp files left
    kept = sum(min(s, blobs[b]) for b, s in {**staged, **published}.items())
    whole = [b for b, s in {**staged, **published}.items() if s == blobs[b]]
    partial = [b for b, s in staged.items() if 0 < s < blobs[b]]
    missing = sum(blobs.values()) - kept
    # The message says partial files are kept only when spark2 holds some: a cut that lands between
    # two files (the sender waiting on the hub for the next one) leaves none (CI, stop 30). Files
    # only grow after the re-read (a stale receiver may still drain its socket), so the claim
    # implies them on disk.
    if "partial files are kept" in recv.msg:
        assert partial, (recv.msg, staged)
    print(f"the cut noticed after {noticed:.1f}s; before the rerun spark2 has {kept / MiB:.1f} MiB: {len(whole)} "
          f"whole files, {len(partial)} partial; {len(stale)} stale rsync receivers")
    assert whole and kept > TOTAL // 3 and missing > 4 * MiB, (published, staged)

    deadline = time.monotonic() + 10  # carrier back on both ends
    while lab.sh("spark1", f"ping -n -c 1 -W 1 {addr}").returncode != 0 and time.monotonic() < deadline:
        time.sleep(0.2)
    before_log, before_tx = len(server.state.log), _tx(lab, "spark1", iface)
    again = Report(io.StringIO())
    _stage(inv, again)
    sent = _tx(lab, "spark1", iface) - before_tx
    assert again.exit_code() == 0, problems(again)
    msg = {(r.host, r.task): r.msg for r in again.results if r.status == "changed"}
    assert set(msg) <= {("spark1", f"send {MODEL}"), ("spark2", f"publish {MODEL}"), ("spark2", f"store {MODEL}")}, msg
    assert "to spark2 " in msg[("spark1", f"send {MODEL}")] and f"over {addr}" in msg[("spark1", f"send {MODEL}")], msg
    assert not [r for r in server.state.log[before_log:] if "/resolve/" in r["path"]], "nothing fetched again"
    print(f"rerun sent {sent / MiB:.1f} MiB over {iface} for {missing / MiB:.1f} MiB missing: {msg}")
    assert sent <= missing * 1.08 + 1 * MiB, (sent, missing, kept)   # the finished bytes were not sent again
    assert sent >= missing * 0.9, (sent, missing)                    # (and the counter saw the transfer)
    got = lab.sh("spark2", f"cd /home/nvidia/{STORE[2:]}/{folder}/blobs && sha256sum * | sort").stdout
    lfs = {f.sha256 for f in repo.files.values() if f.lfs}
    assert {ln.split()[1]: ln.split()[0] for ln in got.splitlines() if ln.split()[1] in lfs} == {b: b for b in lfs}, got
    for h in lab.names:
        lab.sh(h, f"rm -rf /home/nvidia/{STORE[2:]}")
