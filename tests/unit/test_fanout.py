"""The pipelined fan-out's plan and shell (sparkprov/staging/fanout.py), on literal data: which
file goes where, that the shell parses (sh -n) with hostile names quoted, and how its report
is read. The lab runs it for real (tests/lab/test_stage_weights.py, tests/reliability)."""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
from pathlib import Path

from sparkprov.staging import fanout
from sparkprov.staging.plan import Item
from sparkprov.transport.shell import quote


def item(path: str, size: int = 10, sha: str | None = "a" * 64) -> Item:
    return Item(repo="org/model", revision="main", commit="c" * 40, path=path, size=size, oid="b" * 40,
                sha256=sha)


ITEMS = [item("model-00001.safetensors"), item("config.json", sha=None), item("it's $(touch pwned).json", sha="d" * 64)]
RECEIVERS = [
    fanout.Receiver("spark2", "nvidia", "/home/nvidia/vllm", [("192.168.100.12", fanout.SSH_BASE)]),
    fanout.Receiver("spark3", "nvidia", "/home/nv idia/vllm", [("192.168.100.13", fanout.SSH_BASE),
                                                                ("10.0.0.13", fanout.SSH_BASE + ["-p", "2222"])]),
]


def test_pipeline_shell_parses_and_queues_each_file_for_its_receivers(tmp_path):
    wants = {"spark2": [ITEMS[0].rel, ITEMS[2].rel], "spark3": [ITEMS[0].rel]}
    start, feed, finish = fanout.pipeline("/home/nvidia/vllm", RECEIVERS, ITEMS, wants, streams=3)
    script = start + fanout.queue_now([ITEMS[2].rel], ITEMS) + "{ true\n} | " + feed + "\n" + finish
    assert subprocess.run(["sh", "-n"], input=script, text=True).returncode == 0
    # the send script written by `start` parses on its own too
    send = start.split("<<'SPARKPROV_SEND'\n", 1)[1].split("SPARKPROV_SEND", 1)[0]
    assert subprocess.run(["sh", "-n"], input=send, text=True).returncode == 0
    assert "xargs -r -d '\\n' -n 1 -P 3 " in start
    # item 0 goes to both receivers, item 2 to spark2 only, item 1 to no one
    queue = start.split("__sp_queue() {", 1)[1]
    assert "0) printf '%s\\n' '0 0 c' '1 0 c' >&3;;" in queue and "2) printf '%s\\n' '0 2 c' >&3;;" in queue
    assert "1)" not in queue
    assert fanout.queue_now([ITEMS[2].rel], ITEMS) == "__sp_queue 2\n"


def test_a_queued_job_runs_its_case_lines_with_hostile_names_quoted(tmp_path):
    """The send script's case tables, run by a real shell up to the transfer: the names arrive
    whole, nothing in them runs."""
    wants = {"spark3": [ITEMS[2].rel]}
    start, _, _ = fanout.pipeline("/home/nvidia/vllm", RECEIVERS, ITEMS, wants, streams=1)
    send = start.split("<<'SPARKPROV_SEND'\n", 1)[1].split("SPARKPROV_SEND", 1)[0]
    head = send.split("rc=255; v=none", 1)[0]
    probe = head + 'eval "dest=$QDEST"; printf "%s\\n" "$dest" "$REL" "$#" "$2" "$3" "$5"\n'
    out = subprocess.run(["sh", "-c", probe, "send", str(tmp_path), "1 2"], capture_output=True, text=True,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    dest, rel, nargs, host1, rsync1, host2 = out.stdout.splitlines()
    assert dest == "/home/nv idia/vllm" and rel == ITEMS[2].rel and nargs == "6"
    assert host1 == "nvidia@192.168.100.13" and rsync1 == "nvidia@192.168.100.13:/home/nv idia/vllm/.sparkprov/staging/"
    assert host2 == "nvidia@10.0.0.13"
    assert not (tmp_path / "pwned").exists()


def test_sent_report_is_read_per_receiver():
    out = "\n".join([
        "SPARKPROV-FETCH {}",
        "@sent\t0\t0\t0\tok\t",
        "@sent\t1\t0\t255\tnone\tssh: connect to host 192.168.100.13 port 22: No route to host",
        "@sent\t0\t2\t0\tbad\t",
        "@sent\t9\t0\t0\tok\t",        # no such receiver: ignored
    ])
    delivered, errors = fanout.parse_sent(out, RECEIVERS, ITEMS)
    assert delivered == {"spark2": [ITEMS[0].rel]}
    assert errors["spark3"].startswith("model-00001.safetensors to spark3: send exit status 255: ssh: connect")
    assert errors["spark2"] == f"{ITEMS[2].path} to spark2: its hash check said bad"


def test_routes_from_a_spark_use_the_fabric_and_from_the_control_machine_the_inventory():
    assert fanout.routes("spark1", "spark2", fabric="192.168.100.12", address="10.77.0.12", local_hosts=[],
                         ssh_options=["-i", "k"]) == [("192.168.100.12", fanout.SSH_BASE)]
    # the control machine is on no fabric link here: the inventory address, with its options
    assert fanout.routes("localhost", "spark2", fabric="192.168.100.12", address="10.77.0.12",
                         local_hosts=["localhost"], ssh_options=["-i", "k"]) == [
        ("10.77.0.12", fanout.SSH_BASE + ["-i", "k"])]


def fake_ssh(tmp_path):
    """An ssh that runs the remote command here, through a shell, as sshd would: options, then the
    host, then the command's words joined by spaces."""
    fake = tmp_path / "bin"
    fake.mkdir()
    # port 2222 stands for a host that cannot be reached (ssh's own failure: 255); each call is logged
    (fake / "ssh").write_text('#!/bin/sh\ncase "$*" in *" 2222 "*) echo dead;; *) echo call;; esac >> "$(dirname "$0")/calls"\n'
                              'while [ $# -gt 0 ]; do case $1 in -O) exit 0;; -p) [ "$2" = 2222 ] && exit 255; shift 2;; '
                              '-[oilcF]) shift 2;; -*) shift;; *) break;; esac; done\nshift\nexec sh -c "$*"\n')
    (fake / "ssh").chmod(0o755)
    return {**os.environ, "PATH": f"{fake}:{os.environ['PATH']}"}


def weights(src, sizes: dict[int, int]) -> dict[int, Item]:
    out = {}
    for n, size in sizes.items():
        data = os.urandom(size)
        out[n] = item(ITEMS[n].path, size=size, sha=hashlib.sha256(data).hexdigest())
        (src / out[n].rel).parent.mkdir(parents=True, exist_ok=True)
        (src / out[n].rel).write_bytes(data)
    return out


def run_pipeline(tmp_path, start, runner, feed, finish, env) -> subprocess.CompletedProcess:
    script = ('set -e\nT=$(mktemp -d)\ntrap \'kill ${__sp_life:-} 2>/dev/null || true; rm -rf "$T"\' EXIT\n' + start
              + "{ " + runner + "\n} | " + feed + "\n" + finish)
    return subprocess.run(["sh", "-c", script], capture_output=True, text=True, cwd=tmp_path, timeout=60, env=env)


def test_a_weight_streams_to_the_receivers_while_it_downloads(tmp_path):
    """SPARKPROV-FETCHING n: the weight's staging file is followed as it grows and sent on one
    channel to each receiver that lacks it, which checks it when its size is reached; the file
    is done on the receivers about when its download is. A download that dies half-way leaves
    each receiver a partial file to resume, and the pipeline ends (it never waits on a file
    that stopped growing)."""
    env = fake_ssh(tmp_path)
    src, dst = tmp_path / "src", tmp_path / "dst"
    blobs = weights(src, {0: 400_000})
    items = [blobs[0], ITEMS[1], ITEMS[2]]
    rec = fanout.Receiver("spark2", "nvidia", str(dst), [("127.0.0.1", fanout.SSH_BASE)])
    start, feed, finish = fanout.pipeline(str(src), [rec], items, {"spark2": [blobs[0].rel]}, streams=1)
    assert "__sp_stream() { case $1 in 0) printf '%s\\n' '0 0 s' >&4;;" in start
    data = (src / blobs[0].rel).read_bytes()
    (src / blobs[0].rel).unlink()
    staging = src / ".sparkprov" / "staging" / blobs[0].rel
    staging.parent.mkdir(parents=True)
    (tmp_path / "data").write_bytes(data)
    # a downloader: the file grows in four pieces, then is published and reported
    grow = " ".join(f"dd if=data bs=100000 skip={k} count=1 status=none >> {quote(str(staging))}; sleep 0.2;"
                    for k in range(4))
    runner = (f": > {quote(str(staging))}; echo 'SPARKPROV-FETCHING 0'; {grow} mv {quote(str(staging))} "
              f"{quote(str(src / blobs[0].rel))}; echo 'SPARKPROV-FETCHED 0'")
    out = run_pipeline(tmp_path, start, runner, feed, finish, env)
    delivered, errors = fanout.parse_sent(out.stdout, [rec], items)
    assert delivered == {"spark2": [blobs[0].rel]} and not errors, (out.stdout, out.stderr)
    assert (dst / blobs[0].rel).read_bytes() == data
    assert out.stdout.count("@sent\t") == 1  # streamed, not sent again after the download
    # the download dies after two pieces: the stream ends with the script, not after a timeout
    dst2 = tmp_path / "dst2"
    rec2 = fanout.Receiver("spark2", "nvidia", str(dst2), [("127.0.0.1", fanout.SSH_BASE)])
    start, feed, finish = fanout.pipeline(str(src), [rec2], items, {"spark2": [blobs[0].rel]}, streams=1)
    (src / blobs[0].rel).unlink()
    staging.write_bytes(b"")
    died = "echo 'SPARKPROV-FETCHING 0'; " + ";".join(grow.split(";")[:4]) + "; exit 3"
    out = run_pipeline(tmp_path, start, died, feed, finish, env)
    delivered, errors = fanout.parse_sent(out.stdout, [rec2], items)
    assert not delivered and "spark2" in errors, out.stdout
    assert (dst2 / ".sparkprov" / "staging" / blobs[0].rel).stat().st_size == 200_000  # resumable
    assert not (dst2 / blobs[0].rel).exists()
    # a download so fast that the weight is published before its stream opens the staging file:
    # the whole file goes on one channel instead
    dst3 = tmp_path / "dst3"
    rec3 = fanout.Receiver("spark2", "nvidia", str(dst3), [("127.0.0.1", fanout.SSH_BASE)])
    start, feed, finish = fanout.pipeline(str(src), [rec3], items, {"spark2": [blobs[0].rel]}, streams=1)
    fast = (f"cp data {quote(str(src / blobs[0].rel))}; rm -f {quote(str(staging))}; "
            "echo 'SPARKPROV-FETCHING 0'; echo 'SPARKPROV-FETCHED 0'")
    out = run_pipeline(tmp_path, start, fast, feed, finish, env)
    assert fanout.parse_sent(out.stdout, [rec3], items) == ({"spark2": [blobs[0].rel]}, {}), out.stdout
    assert (dst3 / blobs[0].rel).read_bytes() == data
    # a receiver that cannot be reached: the stream fails once, and is not tried again whole (the
    # send play resumes it, once): the warm-up's connection and the stream's, exit status 255
    dead = fanout.Receiver("spark3", "nvidia", str(tmp_path / "dst4"), [("127.0.0.1", fanout.SSH_BASE + ["-p", "2222"])])
    start, feed, finish = fanout.pipeline(str(src), [dead], items, {"spark3": [blobs[0].rel]}, streams=1)
    (tmp_path / "bin" / "calls").unlink()
    out = run_pipeline(tmp_path, start, fast, feed, finish, env)
    delivered, errors = fanout.parse_sent(out.stdout, [dead], items)
    assert not delivered and "send exit status 255" in errors["spark3"], out.stdout
    assert (tmp_path / "bin" / "calls").read_text().splitlines() == ["dead", "dead"]


def test_a_file_the_receiver_lacks_goes_on_one_channel_and_a_partial_one_by_rsync(tmp_path):
    """The pipeline run by a real shell, rsync and the receiver's hash-and-publish shell, with an
    ssh that runs the remote command here (as sshd would, through a shell): a file the receiver
    has no byte of arrives whole on one channel, is hashed and published; a file it holds part
    of is resumed by rsync --append-verify and then checked. Hostile names arrive whole."""
    env = fake_ssh(tmp_path)
    src, dst = tmp_path / "src store", tmp_path / "dst 'store'"
    blobs = weights(src, {0: 300_000, 2: 5000})
    items = [blobs[0], ITEMS[1], blobs[2]]
    staged = dst / ".sparkprov" / "staging" / blobs[0].rel
    staged.parent.mkdir(parents=True)
    staged.write_bytes((src / blobs[0].rel).read_bytes()[:100_000])  # an earlier run's part
    rec = fanout.Receiver("spark2", "nvidia", str(dst), [("127.0.0.1", fanout.SSH_BASE)],
                          partial=frozenset({blobs[0].rel}))
    start, feed, finish = fanout.pipeline(str(src), [rec], items, {"spark2": [blobs[0].rel, blobs[2].rel]}, streams=2)
    assert "'0 0 r'" in start and "'0 2 c'" in start
    out = run_pipeline(tmp_path, start + fanout.queue_now([blobs[0].rel, blobs[2].rel], items), "true", feed,
                       finish, env)
    delivered, errors = fanout.parse_sent(out.stdout, [rec], items)
    assert sorted(delivered["spark2"]) == sorted([blobs[0].rel, blobs[2].rel]), (out.stdout, out.stderr)
    assert not errors
    for n in (0, 2):
        assert (dst / blobs[n].rel).read_bytes() == (src / blobs[n].rel).read_bytes()
    assert not (tmp_path / "pwned").exists() and not staged.exists()
    assert blobs[2].rel in (dst / ".sparkprov" / "verified").read_text()


def test_a_ring_relay_puts_the_bytes_on_every_hop_as_they_pass(tmp_path):
    """relay_put run by a real shell: the first receiver keeps the file and tees it on to the next,
    which does the same; each hashes and publishes its copy, and the hops' checks come back up the
    chain as @hop lines. `ssh` is a stand-in that runs the remote command here (the lab runs it over
    real links: tests/lab/test_topology.py); one hop needs no file and only relays it."""
    from sparkprov.staging.verify import FUNCS

    data = os.urandom(300_000)
    it = item("model-00001.safetensors", size=len(data), sha=hashlib.sha256(data).hexdigest())
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    (bin_ / "ssh").write_text('#!/bin/sh\nfor last; do :; done\nexec sh -c "$last"\n')
    (bin_ / "ssh").chmod(0o755)
    stores = [tmp_path / f"store{i}" for i in range(4)]
    recs = [fanout.Receiver(f"spark{i + 2}", "nvidia", str(s), []) for i, s in enumerate(stores)]
    check = " ".join(quote(str(w)) for w in ("__sp_check", "staged", it.rel, it.size, int(it.large), it.digest, "", ""))
    # spark2 keeps and relays to spark3, which only relays (it holds the file) to spark4, which keeps it
    chain = [(1, recs[1], "192.168.101.13", False), (2, recs[2], "192.168.102.14", True)]
    put = fanout.relay_put(it, check, chain, True)
    env = {**os.environ, "PATH": f"{bin_}:{os.environ['PATH']}"}
    out = subprocess.run(["sh", "-c", FUNCS + put, "sh", str(stores[0])], input=data, capture_output=True, env=env)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.decode().splitlines()
    assert sorted(ln.split("\t")[:6] for ln in lines if ln.startswith("@hop")) == [
        ["@hop", "1", "0", "R", it.rel, "relayed"], ["@hop", "2", "0", "R", it.rel, "ok"]]
    assert lines[-1].startswith(f"R\t{it.rel}\tok")
    for s in (stores[0], stores[2]):
        published = s / it.rel
        assert published.read_bytes() == data, s
    assert not (stores[1] / it.rel).exists() and not (stores[1] / ".sparkprov" / "staging" / it.rel).exists()
    # the source reads each hop's verdict as that receiver's
    sent = "".join(f"@sent\t{ln.split(chr(9))[1]}\t0\t0\t{ln.split(chr(9))[5]}\trelayed\n"
                   for ln in lines if ln.startswith("@hop"))
    delivered, errors = fanout.parse_sent(sent + "@sent\t0\t0\t0\tok\t\n", recs, [it])
    assert delivered == {"spark2": [it.rel], "spark4": [it.rel]} and errors == {}


def test_the_relay_hops_connections_open_while_the_download_starts(tmp_path):
    """relay_warm run by a real shell: the first receiver opens its connection to the next, through
    which the next opens its own, each with the ControlPath the relayed puts reuse, in ring order; the
    pipeline starts one warm-up per receiver it sends to (the chains' first hops), none for a receiver
    reached through another."""
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    # an ssh that logs its destination and options, then runs the remote command here
    (bin_ / "ssh").write_text('#!/bin/sh\nfor last; do :; done\n'
                              'printf "%s\\n" "$*" >> "$(dirname "$0")/calls"\nexec sh -c "$last"\n')
    (bin_ / "ssh").chmod(0o755)
    recs = [fanout.Receiver(f"spark{i}", "nvidia", str(tmp_path / f"store{i}"), []) for i in (2, 3, 4)]
    chain = [(1, recs[1], "192.168.101.13"), (2, recs[2], "192.168.102.14")]
    env = {**os.environ, "PATH": f"{bin_}:{os.environ['PATH']}", "HOME": str(tmp_path)}
    out = subprocess.run(["sh", "-c", fanout.relay_warm(chain)], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    calls = (bin_ / "calls").read_text().splitlines()
    assert [re.search(r"nvidia@(\S+)", c).group(1) for c in calls] == ["192.168.101.13", "192.168.102.14"], calls
    assert all("ControlPath=~/.cache/sparkprov/relay-%C" in c and "ControlPersist=15" in c for c in calls)
    assert fanout.relay_warm([]) == "true"
    # a ring from spark1: spark2 relays to spark3; spark4 alone on the other way round
    head = fanout.Receiver("spark2", "nvidia", "/s", [("192.168.100.12", fanout.SSH_BASE)],
                           relay=((1, "192.168.101.13"),))
    other = fanout.Receiver("spark4", "nvidia", "/s", [("192.168.103.14", fanout.SSH_BASE)])
    ring = [head, fanout.Receiver("spark3", "nvidia", "/s", []), other]
    wants = {"spark2": [ITEMS[0].rel], "spark3": [ITEMS[0].rel], "spark4": [ITEMS[0].rel]}
    start, _, _ = fanout.pipeline("/src", ring, ITEMS, wants, streams=4)
    assert [ln.split()[3] for ln in start.splitlines() if " - w'" in ln] == ["'0", "'2"]
    assert "0) QWARM=" in start and "1) QWARM=" not in start and "2) QWARM=" not in start


def small_files(src, names: list[str]) -> list[Item]:
    """Git-blob files (config, tokenizer: no sha256) written into the source store."""
    out = []
    for k, name in enumerate(names):
        data = os.urandom(1000 + 997 * k)
        oid = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
        it = Item(repo="org/model", revision="main", commit="c" * 40, path=name, size=len(data), oid=oid, sha256=None)
        (src / it.rel).parent.mkdir(parents=True, exist_ok=True)
        (src / it.rel).write_bytes(data)
        out.append(it)
    return out


SMALL = ["config.json", "tokenizer.json", "it's $(touch pwned).json", "generation_config.json"]


def fan_out_here(tmp_path, receivers, items, wants) -> list[str]:
    """The pipeline run by real shells, every file the source holds queued at once; each receiver's
    store checked for its files; the ssh calls it made."""
    env = fake_ssh(tmp_path)
    src = tmp_path / "src"
    start, feed, finish = fanout.pipeline(str(src), receivers, items, wants, streams=4)
    out = run_pipeline(tmp_path, start + fanout.queue_now([it.rel for it in items], items), "true", feed, finish,
                       {**env, "HOME": str(tmp_path)})
    delivered, errors = fanout.parse_sent(out.stdout, receivers, items)
    assert not errors, (out.stdout, out.stderr)
    assert {r: sorted(v) for r, v in delivered.items()} == {r: sorted(v) for r, v in wants.items()}, (out.stdout,
                                                                                                        out.stderr)
    stores = {r.name: Path(r.store) for r in receivers}
    for name, rels in wants.items():
        for rel in rels:
            assert (stores[name] / rel).read_bytes() == (src / rel).read_bytes(), (name, rel)
        assert not list((stores[name] / ".sparkprov" / "staging").rglob("*.json"))
    assert not (tmp_path / "pwned").exists()
    return (tmp_path / "bin" / "calls").read_text().splitlines()


def test_a_ring_gets_the_small_files_on_one_channel_per_hop(tmp_path):
    """The pipeline on a 4-ring from spark1, run by real shells with an ssh that runs the remote
    command here: spark2 relays to spark3, spark4 is the other way round. The small files (git blobs)
    go to each neighbour as one batch, and on through the relay as one batch, each hashed and
    published on every receiver; a weight goes on its own channel. The SSH sessions the fan-out opens
    do not grow with the number of small files: per way round, a warm-up, the batch and the weight,
    each one session per hop it crosses (spark1-spark2-spark3 and spark1-spark4: 3 + 3 + 2, the
    weight stopping at spark2, as spark3 holds it); one session per file and hop before, and no warm-up
    (14 here)."""
    src = tmp_path / "src"
    items = [weights(src, {0: 200_000})[0]] + small_files(src, SMALL)
    ring = [fanout.Receiver("spark2", "nvidia", str(tmp_path / "spark2"), [("192.168.100.12", fanout.SSH_BASE)],
                            relay=((1, "192.168.101.13"),)),
            fanout.Receiver("spark3", "nvidia", str(tmp_path / "spark3"), []),
            fanout.Receiver("spark4", "nvidia", str(tmp_path / "spark4"), [("192.168.103.14", fanout.SSH_BASE)])]
    every = [it.rel for it in items]
    # spark3 holds the weight already: spark2 relays it only as far as spark2 itself needs it
    wants = {"spark2": every, "spark3": every[1:], "spark4": every}
    assert fan_out_here(tmp_path, ring, items, wants) == ["call"] * 8
    # the refs the publish play would write, written by whichever file landed last; not on spark3,
    # which lacks the weight (its snapshot link dangles)
    ref = Path("hub/models--org--model/refs/main")
    assert (tmp_path / "spark2" / ref).read_text() == (tmp_path / "spark4" / ref).read_text() == "c" * 40
    assert not (tmp_path / "spark3" / ref).exists()


def test_a_pair_gets_the_small_files_on_one_channel(tmp_path):
    """The same for a pair: the warm-up, the batch of small files, the weight: 3 SSH sessions (5 before:
    one per file and the weight)."""
    src = tmp_path / "src"
    items = [weights(src, {0: 200_000})[0]] + small_files(src, SMALL)
    pair = [fanout.Receiver("spark2", "nvidia", str(tmp_path / "spark2"), [("192.168.100.12", fanout.SSH_BASE)])]
    assert fan_out_here(tmp_path, pair, items, {"spark2": [it.rel for it in items]}) == ["call"] * 3


def test_a_batch_whose_next_hop_dies_still_lands_every_file_here(tmp_path):
    """batch_put run by a real shell: the next hop cannot be reached (ssh's 255 at once); this
    receiver still reads every file to its size, in step with the stream (tee -p), and publishes
    them; the next hop's files are reported lost, for the send play to send from a neighbour."""
    from sparkprov.staging.verify import FUNCS

    src = tmp_path / "src"
    items = small_files(src, SMALL)
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    (bin_ / "ssh").write_text('#!/bin/sh\ncase "$*" in *192.168.101.13*) exit 255;; esac\n'
                              'for last; do :; done\nexec sh -c "$last"\n')
    (bin_ / "ssh").chmod(0o755)
    here, nxt = tmp_path / "spark2", fanout.Receiver("spark3", "nvidia", str(tmp_path / "spark3"), [])
    batch = [(it, fanout._check(it), True) for it in items]
    put = fanout.batch_put(batch, [(1, nxt, "192.168.101.13", [True] * len(items))])
    data = b"".join((src / it.rel).read_bytes() for it in items)
    env = {**os.environ, "PATH": f"{bin_}:{os.environ['PATH']}", "HOME": str(tmp_path)}
    out = subprocess.run(["sh", "-c", FUNCS + put, "sh", str(here)], input=data, capture_output=True, env=env,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.decode().splitlines()
    assert sorted(ln.split("\t")[1] for ln in lines if ln.startswith("R\t") and ln.split("\t")[2] == "ok") == sorted(
        it.rel for it in items), lines
    for it in items:
        assert (here / it.rel).read_bytes() == (src / it.rel).read_bytes()
    assert [ln.split("\t")[:3] + ln.split("\t")[5:6] for ln in lines if ln.startswith("@hop")] == [
        ["@hop", "1", "255", "lost"]]
    assert not (tmp_path / "spark3").exists()


def test_the_refs_are_the_fan_outs_only_for_a_stage_that_has_them_and_lists_its_links_in_full():
    pinned = [Item(repo="org/model", revision="c" * 40, commit="c" * 40, path="config.json", size=1, oid="b" * 40,
                   sha256=None)]
    assert fanout.refs_fn(pinned) == ""                       # a commit asked for: no refs file
    assert fanout.refs_fn(ITEMS).count("[ -f \"$S/$l\" ]") == 1
    fn = fanout.refs_fn(ITEMS)
    assert all(quote(it.link) in fn for it in ITEMS) and "refs/main" in fn
    many = [item(f"model-{k:05d}.safetensors") for k in range(fanout.MAX_REF_LINKS + 1)]
    assert fanout.refs_fn(many) == ""                         # left to the publish play
    assert subprocess.run(["sh", "-n"], input=fn, text=True).returncode == 0
