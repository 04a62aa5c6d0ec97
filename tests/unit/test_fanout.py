"""The pipelined fan-out's plan and shell (sparkprov/staging/fanout.py), on literal data: which
file goes where, that the shell parses (sh -n) with hostile names quoted, and how its report
is read. The lab runs it for real (tests/lab/test_stage_weights.py, tests/reliability)."""

from __future__ import annotations

import subprocess

from sparkprov.staging import fanout
from sparkprov.staging.plan import Item


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
    assert "0) printf '%s\\n' '0 0' '1 0' >&3;;" in queue and "2) printf '%s\\n' '0 2' >&3;;" in queue
    assert "1)" not in queue
    assert fanout.queue_now([ITEMS[2].rel], ITEMS) == "__sp_queue 2\n"


def test_a_queued_job_runs_its_case_lines_with_hostile_names_quoted(tmp_path):
    """The send script's case tables, run by a real shell up to the transfer: the names arrive
    whole, nothing in them runs."""
    wants = {"spark3": [ITEMS[2].rel]}
    start, _, _ = fanout.pipeline("/home/nvidia/vllm", RECEIVERS, ITEMS, wants, streams=1)
    send = start.split("<<'SPARKPROV_SEND'\n", 1)[1].split("SPARKPROV_SEND", 1)[0]
    head = send.split("rc=255; v=none", 1)[0]
    probe = head + 'printf "%s\\n" "$DEST" "$REL" "$#" "$2" "$3" "$5"\n'
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
    assert errors["spark3"].startswith("model-00001.safetensors to spark3: rsync exit status 255: ssh: connect")
    assert errors["spark2"] == f"{ITEMS[2].path} to spark2: its hash check said bad"


def test_routes_from_a_spark_use_the_fabric_and_from_the_control_machine_the_inventory():
    assert fanout.routes("spark1", "spark2", fabric="192.168.100.12", address="10.77.0.12", local_hosts=[],
                         ssh_options=["-i", "k"]) == [("192.168.100.12", fanout.SSH_BASE)]
    # the control machine is on no fabric link here: the inventory address, with its options
    assert fanout.routes("localhost", "spark2", fabric="192.168.100.12", address="10.77.0.12",
                         local_hosts=["localhost"], ssh_options=["-i", "k"]) == [
        ("10.77.0.12", fanout.SSH_BASE + ["-i", "k"])]
