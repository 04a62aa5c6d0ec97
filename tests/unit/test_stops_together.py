"""nccl-check's hosts are one group (issue 36): when one host fails, none starts a rank; a rank
that does start gives up at its rendezvous bound; the image is one the hosts hold, and it says
which. The engine runs here, on this machine (connection: local), with stand-ins for what is not
ours on PATH: `ibdev2netdev` and `ip` replaying a Spark's (tests/fixtures/gb10: its ibdev2netdev
capture, its enp1s0f1np1 stanza as `ip -j addr` prints it), `docker` answering the image inspect,
the NCCL probe (a line of tests/fixtures/nccl/h100-probes.txt) and logging every run, and `getent`
giving the login user a home in the test's folder (what the probe keeps goes there)."""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

import pytest

from sparkprov.data.inventory import load_inventory
from sparkprov.engine.report import Report
from sparkprov.engine.run import RunOptions
from sparkprov.modules import allreduce
from sparkprov.plays import cluster
from sparkprov.serving import node

FIX = Path(__file__).resolve().parents[1] / "fixtures"
IMAGE = "sparkprov/lab-vllm-cpu:0.32.0"
IP_JSON = json.dumps([{"ifname": "enp1s0f1np1", "mtu": 9000, "flags": ["BROADCAST", "MULTICAST", "UP", "LOWER_UP"],
                       "operstate": "UP", "address": "3c:6d:66:cc:b3:b7",
                       "addr_info": [{"family": "inet", "local": "192.168.100.10", "prefixlen": 24, "scope": "global"}]}])
PROBE_LINE = (FIX / "nccl" / "h100-probes.txt").read_text().splitlines()[0]
DOCKER = r"""#!/bin/sh
printf '%s\n' "$*" >> "$DOCKER_LOG"
case "$1 $2" in
  "image inspect") echo "sha256:$(printf %064d 7)" ;;
  "rm -f") ;;
  run*) case "$*" in
          *torch.distributed.run*) sleep "${RANK_SLEEP:-0}"; echo "rank ran alone" ;;
          *) cat "$PROBE_FILE" ;;
        esac ;;
  *) echo "stand-in docker: unexpected: $*" >&2; exit 2 ;;
esac
"""


@pytest.fixture
def here(tmp_path, monkeypatch):
    """This machine as host `a` with the stand-ins on PATH; host `b` a Spark that cannot be reached
    (loopback, a port nothing listens on: refused at once)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    # getent: the login user's home is the test's (the engine reads it from the passwd entry)
    getent = f"#!/bin/sh\n[ \"$1\" = passwd ] && echo \"$(id -un):x:$(id -u):$(id -g)::{tmp_path / 'home'}:/bin/sh\"\n"
    for name, text in {"docker": DOCKER, "ibdev2netdev": f"#!/bin/sh\ncat {FIX / 'gb10' / 'ibdev2netdev.txt'}\n",
                       "ip": f"#!/bin/sh\ncat {tmp_path / 'ip.json'}\n", "getent": getent}.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    (tmp_path / "ip.json").write_text(IP_JSON)
    (tmp_path / "probe.txt").write_text(PROBE_LINE + "\n")
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("DOCKER_LOG", str(tmp_path / "docker.log"))
    monkeypatch.setenv("PROBE_FILE", str(tmp_path / "probe.txt"))
    (tmp_path / "home").mkdir()
    inv = tmp_path / "inventory.yaml"
    inv.write_text("hosts:\n  a: {connection: local}\n  b: {address: 127.0.0.1, port: 1, connect_timeout: 2}\n")
    return load_inventory(inv), tmp_path / "docker.log"


def test_a_host_that_fails_stops_the_others_before_any_rank_starts(here):
    inv, log = here
    report = Report(io.StringIO(), quiet=True)
    result = cluster.nccl_check(inv, ["a", "b"], IMAGE, RunOptions(gather_ahead=True), report, backend="gloo",
                                threshold=1.0, max_bytes=2**20, iters=2)
    assert result is None and report.exit_code() == 4, [(r.host, r.play, r.status, r.msg) for r in report.results]
    runs = [line for line in log.read_text().splitlines() if line.startswith("run")]
    assert runs and not [r for r in runs if "torch.distributed.run" in r], runs  # the probe ran, no rank did
    stopped = [(r.host, r.play) for r in report.results if r.task == "stopped"]
    assert stopped == [("a", "nccl-check: hosts")], [(r.host, r.play, r.status, r.msg) for r in report.results]


def test_every_play_of_nccl_check_stops_together():
    from sparkprov.plays.serve import nccl_book

    book = nccl_book(["spark1", "spark2", "spark3"], IMAGE, backend="gloo")
    assert [p.name for p in book.plays] == ["nccl-check: hosts", "nccl-check: same NCCL", "nccl-check: all-reduce"]
    assert all(p.any_errors_fatal and p.stops_together == ("spark1", "spark2", "spark3") for p in book.plays)


def test_a_rank_waits_for_the_others_only_as_long_as_its_bound():
    """torchrun's static rendezvous waited 900 s (its default) for a rank that never came: the rank's
    command gives torchrun the bound, and each collective the same once the ranks met."""
    args = allreduce.Args(phase="run", hosts=["spark1", "spark2"], image=IMAGE, backend="gloo", rendezvous_timeout=30)
    script = _run_script(args)
    words = script.split()
    assert words[words.index("--rdzv-conf") + 1] == "timeout=30"
    assert words[words.index("/opt/sparkprov/allreduce_bench.py") + words[words.index(
        "/opt/sparkprov/allreduce_bench.py"):].index("--timeout") + 1] == "30"
    with pytest.raises(ValueError):
        allreduce.Args(phase="run", hosts=["a", "b"], image=IMAGE, rendezvous_timeout=0)


@pytest.mark.parametrize("rank", [0, 1])
def test_a_rank_that_waited_out_its_bound_says_so(rank):
    """torchrun's stderr when rank 0, then rank 1, waited alone (tests/fixtures/nccl/rdzv-rank*-alone.txt:
    the lab image's torch 2.13, captured on the lab), as the rank's script tails it."""
    said = (FIX / "nccl" / f"rdzv-rank{rank}-alone.txt").read_text()
    args = allreduce.Args(phase="run", hosts=["spark1", "spark2"], image=IMAGE, backend="gloo", rendezvous_timeout=30)
    why = allreduce._judge(f"{said}\n@rc=1\n", args, "spark1", rank, "192.168.100.10:29500", None)
    assert why == ("spark1: rank %d waited 30s at the rendezvous (192.168.100.10:29500) for the other 1 rank(s), which "
                   "did not all come (fix: see the other hosts' results; every host must run its rank at once)" % rank)


def _run_script(args: allreduce.Args) -> str:
    from sparkprov.modules.base import FactView, HostContext

    exports = {"spark1": {"allreduce_addr": "192.168.100.10"}, "spark2": {"allreduce_addr": "192.168.100.11"}}
    host = HostContext("spark1", {}, {"user": "nvidia", "home": "/home/nvidia"}, check=False, exports=exports,
                       play_hosts=["spark1", "spark2"], become=False)
    m = allreduce.Allreduce()
    fab = {"node_ip": "192.168.100.10", "nccl_socket_ifname": "enp1s0f1np1", "gloo_socket_ifname": "enp1s0f1np1",
           "ucx_net_devices": "enp1s0f1np1", "nccl_ib_hca": "rocep1s0f1"}
    needs = m.needs(args, host)
    view = m.view(args, FactView({needs["fabric"].key: fab, needs["image"].key: {"id": "sha256:1", "error": None}}, {}),
                  host)
    (change,) = m.plan(args, view, host).changes
    return change.script


# -- which image -------------------------------------------------------------------------------------

def running(name, deployment, image, role="rank0"):
    return {"name": name, "status": "running", "image": image,
            "labels": {"sparkprov.managed": "1", "sparkprov.deployment": deployment, "sparkprov.role": role}}


def test_the_image_is_the_one_a_deployment_runs_on_every_host():
    """After `make demo`: lab-tiny on both Sparks; a gateway on spark1 is no serving image."""
    gw = running("sparkprov-gateway", "gateway", "ghcr.io/berriai/litellm:main-stable", "gateway")
    held = {"spark1": [gw, running("sparkprov-lab-tiny-rank0", "lab-tiny", IMAGE)],
            "spark2": [running("sparkprov-lab-tiny-rank1", "lab-tiny", IMAGE, "rank")]}
    assert node.running_image(held, ["spark1", "spark2"]) == (IMAGE, "lab-tiny")
    # two single-node deployments of one image, one on each host, hold it too
    split = {"spark1": [running("sparkprov-one", "one", IMAGE, "server")],
             "spark2": [running("sparkprov-two", "two", IMAGE, "server")]}
    assert node.running_image(split, ["spark1", "spark2"]) == (IMAGE, "one, two")
    # a stopped container, or an image on one host alone, is none
    stopped = {**held, "spark2": [{**held["spark2"][0], "status": "exited"}]}
    assert node.running_image(stopped, ["spark1", "spark2"]) is None
    assert node.running_image({"spark1": held["spark1"]}, ["spark1", "spark2"]) is None


# -- cluster-up ----------------------------------------------------------------------------------------

def test_cluster_up_asks_the_engine_to_stop_a_failed_cluster_as_a_whole():
    """Every play of a multi-node deployment (its stage plays with --stage too) stops all its nodes
    when one fails (the engine's part: tests/unit/test_engine_local.py); a single-node deployment's
    plays stop only their host, and one deployment's failure never stops another's nodes."""
    from sparkprov.engine.playbook import Playbook
    from sparkprov.plays.book import play, task
    from sparkprov.plays.serve import UpOptions, up_book
    from sparkprov.serving.deployment import Deployment

    pair = Deployment(name="pair", model="lab-tiny", hosts=["spark1", "spark2"], tp=2, executor="native")
    one = Deployment(name="one", model="lab-tiny", hosts=["spark3"])
    staged = {"pair": Playbook("stage", [play("stage: store", ["spark1", "spark2"],
                                              [task("store", "weights_store", {}, ("stage", None, None))])])}
    book = up_book([pair, one], UpOptions(), staged=staged)
    mine = [p for p in book.plays if p.name.startswith("pair: ")]
    assert "pair: stage: store" in [p.name for p in mine] and "pair: ready" in [p.name for p in mine]
    assert all(p.any_errors_fatal and p.stops_together == ("spark1", "spark2") for p in mine), \
        [(p.name, p.any_errors_fatal, p.stops_together) for p in mine]
    assert not [p for p in book.plays if p.name.startswith("one: ") and (p.any_errors_fatal or p.stops_together)]


def test_the_status_read_names_each_containers_image(tmp_path, monkeypatch):
    """The image comes from the status play's own read of the containers (facts/probe.py, run here on
    a stand-in docker that fills `docker inspect --format`'s fields with lab-tiny's rank 0): found on
    the demo lab, where nccl-check read no image before (a KeyError)."""
    from sparkprov.facts import probe
    from sparkprov.transport.local import LocalTransport

    fields = {"{{.Name}}": "/sparkprov-lab-tiny-rank0", "{{.Id}}": "c0ffee", "{{.State.Status}}": "running",
              "{{.State.ExitCode}}": "0", "{{.RestartCount}}": "0", "{{.State.StartedAt}}": "2026-11-28T14:20:00Z",
              "{{json .Config.Labels}}": json.dumps({"sparkprov.managed": "1", "sparkprov.deployment": "lab-tiny",
                                                     "sparkprov.role": "rank0"}), "{{.Config.Image}}": IMAGE}
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "docker").write_text(f"""#!/usr/bin/env python3
import sys
fields = {fields!r}
if sys.argv[1] == "ps":
    print("c0ffee")
elif sys.argv[1] == "inspect" and sys.argv[2] == "--format":
    out = sys.argv[3]
    for k, v in fields.items():
        out = out.replace(k, v)
    print(out)
""")
    (bin_dir / "docker").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    doc = probe.parse(LocalTransport("local").run_script(probe.status_script()).stdout)
    (c,) = doc["containers"]
    assert c["image"] == IMAGE and c["labels"]["sparkprov.deployment"] == "lab-tiny"
    assert node.running_image({"spark1": [c]}, ["spark1"]) == (IMAGE, "lab-tiny")
