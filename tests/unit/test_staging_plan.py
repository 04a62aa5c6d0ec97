"""Staging: pure planning, the store fact's parser, the verify/publish shell, the download script."""

from __future__ import annotations

import hashlib
import os
import subprocess

from sparkprov.facts.base import ShellCtx
from sparkprov.staging import fetch, verify
from sparkprov.staging.facts import StoreState
from sparkprov.staging.plan import (Entry, Item, Record, Status, StoreFacts, check_disk, format_mtime,
                                    parse_mtime, parse_verified, plan_host, split_streams)

C = "c" * 40


def item(path, data=None, size=None, large=True, dest=None):
    data = data if data is not None else path.encode() * 10
    size = len(data) if size is None else size
    sha = hashlib.sha256(data).hexdigest()
    oid = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
    return Item("org/m", "main", C, path, size, oid, sha if large else None, dest)


def test_item_layout_matches_huggingface_hub_cache():
    i = item("sub/model.safetensors")
    assert i.rel == f"hub/models--org--m/blobs/{i.sha256}"
    assert i.link == f"hub/models--org--m/snapshots/{C}/sub/model.safetensors"
    assert i.link_target == f"../../../blobs/{i.sha256}"
    assert i.staged == f".sparkprov/staging/{i.rel}"
    small = item("config.json", large=False)
    assert small.blob == small.oid and small.digest == f"git:{small.oid}"
    plain = item("parser.py", dest="plugins/parser.py")
    assert plain.rel == "plugins/parser.py" and plain.link is None


def test_mtime_round_trip_and_verified_file_last_line_wins():
    assert parse_mtime("1732245123.1234567890") == 1732245123123456789
    assert parse_mtime(format_mtime(1732245123000000042)) == 1732245123000000042
    recs = parse_verified("1\t1.5\tsha256:a\tp\nbad line\n2\t2.0\tsha256:b\tp\n")
    assert recs == {"p": Record(2, 2_000_000_000, "sha256:b")}


def _facts(**entries):
    return StoreFacts(store="/s", free=10**12, entries=entries)


def test_statuses():
    ok, unv, wrong, staged, partial, missing, over = (item(n) for n in "abcdefg")
    f = _facts()
    f.entries[ok.rel] = Entry("f", ok.size, 5, "")
    f.verified[ok.rel] = Record(ok.size, 5, ok.digest)
    f.entries[unv.rel] = Entry("f", unv.size, 6, "")
    f.verified[unv.rel] = Record(unv.size, 5, unv.digest)  # touched since it was hashed
    f.entries[wrong.rel] = Entry("f", wrong.size + 1, 5, "")
    f.entries[staged.staged] = Entry("f", staged.size, 5, "")
    f.entries[partial.staged] = Entry("f", 3, 5, "")
    f.entries[over.staged] = Entry("f", over.size + 9, 5, "")
    p = plan_host("h", [ok, unv, wrong, staged, partial, missing, over], f)
    st = {i.path: p.files[i.rel].status for i in (ok, unv, wrong, staged, partial, missing, over)}
    assert st == {"a": Status.OK, "b": Status.UNVERIFIED, "c": Status.WRONG, "d": Status.STAGED,
                  "e": Status.PARTIAL, "f": Status.MISSING, "g": Status.MISSING}
    assert p.files[partial.rel].have == 3
    assert p.files[over.rel].remove == [over.staged]
    assert p.need_bytes == wrong.size + partial.size - 3 + missing.size + over.size
    assert plan_host("h", [ok], f, rehash=True).files[ok.rel].status is Status.UNVERIFIED


def test_an_empty_staged_file_is_missing_not_partial():
    """A receiver that opened the file before a cut link let any byte through leaves it empty: nothing
    to resume, so the publish play's message does not say partial files are kept (CI, 2026-11-29:
    tests/reliability/test_rel_stage_faults.py saw the claim with a 0-byte file)."""
    a = item("a")
    f = _facts()
    f.entries[a.staged] = Entry("f", 0, 5, "")
    fs = plan_host("h", [a], f).files[a.rel]
    assert fs.status is Status.MISSING and fs.have == 0


def test_complete_host_is_a_noop_plan():
    a = item("a")
    f = _facts()
    f.entries[a.rel] = Entry("f", a.size, 5, "")
    f.verified[a.rel] = Record(a.size, 5, a.digest)
    f.entries[a.link] = Entry("l", 0, 5, a.link_target)
    f.refs["hub/models--org--m/refs/main"] = C
    assert plan_host("h", [a], f).complete
    f.entries[a.link] = Entry("l", 0, 5, "../../blobs/other")
    assert plan_host("h", [a], f).links == [a]


def test_disk_check_reports_numbers():
    a = item("a", size=5 * 10**9)
    f = _facts()
    f.free = 2 * 10**9
    problem = check_disk(plan_host("spark2", [a], f), "/home/nvidia/vllm")
    assert problem.message() == ("spark2: not enough space in /home/nvidia/vllm: the stage needs 5.0 GB "
                                 "(+536.9 MB kept free), 2.0 GB free")


def test_split_streams_balances_bytes():
    items = [item(str(n), size=s) for n, s in enumerate([9, 7, 5, 3, 1])]
    groups = split_streams(items, 2)
    assert sorted(sum(i.size for i in g) for g in groups) == [12, 13]
    assert len(split_streams(items[:1], 4)) == 1


def test_store_state_parses_what_its_command_prints(tmp_path):
    a = item("model.safetensors")
    s = tmp_path / "store"
    (s / "hub/models--org--m/blobs").mkdir(parents=True)
    (s / a.rel).write_bytes(b"x" * a.size)
    (s / "hub/models--org--m/snapshots" / C).mkdir(parents=True)
    os.symlink(a.link_target, s / a.link)
    (s / "hub/models--org--m/refs").mkdir()
    (s / "hub/models--org--m/refs/main").write_text(C)
    (s / ".sparkprov/staging/x").mkdir(parents=True)
    (s / ".sparkprov/staging/x/part").write_bytes(b"abc")
    (s / ".sparkprov/verified").write_text(f"{a.size}\t1.0\t{a.digest}\t{a.rel}\n")
    fact = StoreState(str(s), ("org/m",), ("plugins/p.py",))
    out = subprocess.run(["sh", "-c", fact.command(ShellCtx("/root"))], capture_output=True, text=True)
    facts = fact.parse(out.stdout, out.stderr, out.returncode)
    assert facts.store == str(s) and facts.free > 0 and "sha256sum" in facts.tools
    assert facts.entries[a.rel].size == a.size and facts.entries[a.link].target == a.link_target
    assert facts.entries[".sparkprov/staging/x/part"].size == 3
    assert facts.refs == {"hub/models--org--m/refs/main": C}
    assert facts.verified[a.rel].digest == a.digest


def test_verify_script_publishes_good_files_and_removes_bad_ones(tmp_path):
    good, bad, small = item("good.safetensors"), item("bad.safetensors"), item("config.json", large=False)
    s = tmp_path / "store"
    for i, data in ((good, b"good.safetensors" * 10), (bad, b"X" * bad.size), (small, b"config.json" * 10)):
        p = s / i.staged
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
    checks = [verify.Check("staged", i) for i in (good, bad, small)]
    res = subprocess.run(["sh", "-s"], input=verify.script(str(s), checks, refs={"hub/models--org--m/refs/main": C}),
                         capture_output=True, text=True)
    found = verify.parse(res.stdout)
    assert found[good.rel][0] and found[small.rel][0] and not found[bad.rel][0], res
    assert (s / good.link).resolve() == (s / good.rel).resolve() and (s / good.link).read_bytes().startswith(b"good")
    assert not (s / bad.staged).exists() and not (s / bad.rel).exists() and not (s / bad.link).exists()
    assert (s / "hub/models--org--m/refs/main").read_text() == C
    recs = parse_verified((s / ".sparkprov/verified").read_text())
    assert set(recs) == {good.rel, small.rel}
    assert recs[good.rel].mtime_ns == (s / good.rel).stat().st_mtime_ns


def test_download_program_carries_no_token_and_the_job():
    job = {"endpoint": "http://127.0.0.1:1", "store": "/s", "files": [], "refs": {}}
    prog = fetch.program(job)
    assert "def run_job" in prog and "http://127.0.0.1:1" in prog
    compile(prog, "<fetch>", "exec")


def test_docker_download_script_keeps_the_token_out_of_argv_and_env():
    from types import SimpleNamespace

    from sparkprov.modules.weights_download import Args, WeightsDownload

    token, endpoint = "hf_SECRETtoken123", "http://10.77.0.1:8080"
    args = Args(model="m", items=[{"repo": "o/m", "revision": "main", "commit": "c" * 40, "path": "config.json",
                                   "size": 2, "oid": "a" * 40, "sha256": None}],
                endpoint=endpoint, hosts=["spark1"], source="spark1", image="vllm/vllm-openai:cu130-nightly")
    host = SimpleNamespace(name="spark1")
    facts = StoreFacts(store="/home/nvidia/vllm", uid=1000, gid=1001, tools={"docker"}, image="present")
    script = WeightsDownload._script(args, host, facts, {"endpoint": endpoint, "store": "/home/nvidia/vllm",
                                                         "files": [], "refs": {}}, token, False)
    assert script.count(token) == 1
    lines = script.splitlines()
    at = lines.index(token)
    assert lines[at - 1].endswith("<<'SPARKPROV_TOKEN'") and "umask 077" in lines[at - 1]
    run = next(line for line in lines if line.startswith("docker run"))
    assert "--user 1000:1001" in run and "--network host" in run and "HF_TOKEN" not in run
    assert f"$T/token\":{fetch.TOKEN_MOUNT}:ro" in run and "HF_HUB_DISABLE_XET=1" in run
    assert "docker rm -f sparkprov-stage-" in script


def test_control_machine_sends_to_fabric_only_when_on_that_link():
    """A control machine that is not on the fabric must not try fabric addresses: they would
    go out through its default gateway. Pure local computation, nothing is sent."""
    import json
    import subprocess

    from sparkprov.staging.fanout import on_local_link

    ifaces = json.loads(subprocess.run(["ip", "-j", "addr", "show"], capture_output=True, text=True).stdout)
    own = [a["local"] for i in ifaces for a in i.get("addr_info", [])
           if a.get("family") == "inet" and not a["local"].startswith("127.")]
    import ipaddress

    nets = [ipaddress.ip_interface(f"{a['local']}/{a['prefixlen']}").network
            for i in ifaces for a in i.get("addr_info", [])]
    if own:
        assert on_local_link(own[0])
    # documentation ranges; pick one that no interface of this machine is on
    elsewhere = next(c for c in ("198.51.100.7", "203.0.113.7", "192.0.2.7")
                     if not any(ipaddress.ip_address(c) in n for n in nets))
    assert not on_local_link(elsewhere)
    assert not on_local_link("127.0.0.1")      # loopback never counts as a fabric link
    assert not on_local_link("not-an-address")
