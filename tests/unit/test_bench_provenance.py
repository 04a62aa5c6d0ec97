"""What a bench run records about what it measured (sparkprov/serving/bench.py): the registry digest
of the running image, the model commit the container's store resolves, the driver (the gather's
nvidia-smi section), the kernel and OS (the host identity every gather reads), the recipe hash and
the layout.

Real captures used: tests/fixtures/gb10/nvidia-smi.txt and dgx-release (DGX Spark output, see that
folder's README) and tests/fixtures/h200/os-release.txt; the refs reader runs for real with python3
over a store laid out as huggingface_hub lays it out.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from invoke import Context, Exit

from sparkprov.cli.bench import bench
from sparkprov.facts import hardware as hw
from sparkprov.facts.base import HostInfo
from sparkprov.serving import bench as sb

FIX = Path(__file__).parents[1] / "fixtures"
COMMIT = "a19cfe00be84568a6867111c9a68c9c44fdcffe6"


def host_info_output() -> str:
    """HostInfo's output on a Spark: its own lines, then os-release and dgx-release through its sed."""
    lines = ["user=nvidia", "uid=1000", "home=/home/nvidia", "hostname=spark1", "arch=aarch64",
             "kernel=6.11.0-1016-nvidia"]
    for line in (FIX / "h200" / "os-release.txt").read_text().splitlines():
        if line.split("=", 1)[0] in ("ID", "VERSION_ID", "PRETTY_NAME"):
            lines.append("os_" + line)
    lines += (FIX / "gb10" / "dgx-release").read_text().splitlines()
    return "\n".join(lines) + "\n"


def test_system_facts_from_the_gathered_nvidia_smi_and_host_identity():
    q = "0, NVIDIA GB10, GPU-b0, 12.1, 580.95.05, [N/A], [N/A], 0000000F:01:00.0\n"
    gpu = hw.parse_nvidia_smi(f"@query\n{q}@rc=0\n@table\n{(FIX / 'gb10' / 'nvidia-smi.txt').read_text()}")
    info = HostInfo().parse(host_info_output(), "", 0)
    assert sb.system_facts(gpu, info) == {
        "driver_version": "580.95.05", "cuda_version": "13.0", "gpu": "NVIDIA GB10", "gpu_count": 1,
        "kernel": "6.11.0-1016-nvidia", "os": "Ubuntu 24.04.3 LTS", "system": "NVIDIA DGX Spark"}
    # a host without nvidia-smi (or whose fact failed) records no driver, and still its kernel
    assert sb.system_facts(hw.parse_nvidia_smi("@absent\n"), info)["driver_version"] is None
    assert sb.system_facts(None, info)["kernel"] == "6.11.0-1016-nvidia"


def test_the_refs_reader_lists_the_stores_refs(tmp_path):
    repo = tmp_path / "hub" / "models--sparkprov--lab-tiny"
    (repo / "refs" / "pr").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)  # huggingface_hub writes the commit, no newline
    (repo / "refs" / "pr" / "1").write_text("b" * 40 + "\n")
    r = subprocess.run([sys.executable, "-c", sb.REFS_PROGRAM, "models--sparkprov--lab-tiny"], capture_output=True,
                       text=True, env={"HF_HOME": str(tmp_path)}, timeout=30)
    refs = json.loads(r.stdout)
    assert refs == {"main": COMMIT, "pr/1": "b" * 40}
    assert sb.commit_of("sparkprov/lab-tiny", "main", refs) == COMMIT
    assert sb.commit_of("sparkprov/lab-tiny", "refs/pr/1", refs) == "b" * 40
    empty = subprocess.run([sys.executable, "-c", sb.REFS_PROGRAM, "models--not--staged"], capture_output=True,
                           text=True, env={"HF_HOME": str(tmp_path)}, timeout=30)
    assert json.loads(empty.stdout) == {}


def test_revision_and_commit_from_the_command_line():
    # a native rank's container: sh -c SCRIPT $0 vllm serve MODEL ...
    argv = ["-c", "exec \"$@\"", "sparkprov-rank0", "vllm", "serve", "org/m", "--revision", "v1.0", "--port", "8000"]
    assert sb.revision_of(argv) == "v1.0" and sb.revision_of(["vllm", "serve", "org/m", "--revision=dev"]) == "dev"
    assert sb.revision_of(["vllm", "serve", "org/m"]) == "main"
    assert sb.commit_of("org/m", COMMIT, {}) == COMMIT  # pinned by commit
    assert sb.commit_of(f"/models/hub/models--org--m/snapshots/{COMMIT}", "main", {}) == COMMIT  # a snapshot path
    assert sb.commit_of("org/m", "main", {"main": "not-a-commit"}) is None
    assert sb.commit_of("org/m", "main", None) is None


def test_the_registry_digest_of_the_running_image():
    d1, d2 = "sha256:" + "1" * 64, "sha256:" + "2" * 64
    digests = [f"nvcr.io/nvidia/vllm@{d1}", f"vllm/vllm-openai@{d2}"]
    assert sb.pick_digest("vllm/vllm-openai:v0.19.0", digests) == f"vllm/vllm-openai@{d2}"
    assert sb.pick_digest("docker.io/vllm/vllm-openai:v0.19.0", digests) == f"vllm/vllm-openai@{d2}"
    assert sb.pick_digest("nvcr.io/nvidia/vllm:25.12.post1-py3", digests) == f"nvcr.io/nvidia/vllm@{d1}"
    assert sb.pick_digest(f"vllm/vllm-openai@{d2}", []) == f"vllm/vllm-openai@{d2}"  # started by digest
    assert sb.pick_digest("10.77.0.1:5000/sparkprov/lab-vllm-cpu:0.32.0",
                          [f"10.77.0.1:5000/sparkprov/lab-vllm-cpu@{d1}"]) == f"10.77.0.1:5000/sparkprov/lab-vllm-cpu@{d1}"
    assert sb.pick_digest("sparkprov-ray/vllm:abc", []) is None  # built on the host: no registry digest
    assert sb.pick_digest("ubuntu:24.04", [f"library/ubuntu@{d1}"]) == f"library/ubuntu@{d1}"


def test_layout_from_the_labels():
    assert sb.layout_of({"sparkprov.tp": "1"}) == {"tp": 1, "pp": 1, "dp": 1, "nodes": 1, "executor": "single",
                                                   "hosts": []}
    ray = sb.layout_of({"sparkprov.tp": "2", "sparkprov.nodes": "2", "sparkprov.executor": "ray"}, ["spark1", "spark2"])
    assert (ray["tp"], ray["pp"], ray["nodes"], ray["executor"], ray["hosts"]) == (2, 1, 2, "ray", ["spark1", "spark2"])
    pp = sb.layout_of({"sparkprov.tp": "1", "sparkprov.nodes": "2", "sparkprov.executor": "native"})
    assert (pp["tp"], pp["pp"]) == (1, 2)
    dp = sb.layout_of({"sparkprov.tp": "1", "sparkprov.nodes": "2", "sparkprov.dp": "2", "sparkprov.executor": "native"})
    assert (dp["tp"], dp["pp"], dp["dp"]) == (1, 1, 2)


def test_a_record_carries_its_provenance():
    labels = {"sparkprov.recipe": "lab-tiny", "sparkprov.recipe_hash": "0123456789abcdef", "sparkprov.tp": "1",
              "sparkprov.model": "lab-tiny", "sparkprov.port": "8000"}
    doc = {"container": "sparkprov-one", "image_id": "sha256:" + "ab" * 32,
           "image": "sparkprov/lab-vllm-cpu:0.32.0", "repo_digests": ["sparkprov/lab-vllm-cpu@sha256:" + "cd" * 32],
           "tokenizer": "sparkprov/lab-tiny", "args": ["serve", "sparkprov/lab-tiny"], "refs": {"main": COMMIT},
           "server_version": "0.32.0", "max_model_len": 2048, "rows": []}
    info = HostInfo().parse(host_info_output(), "", 0)
    rec = sb.record("spark1", "one", labels, {"concurrency": [1]}, doc, sb.system_facts(None, info), "arena")
    prov = sb.with_hosts(rec, ["spark1"])["provenance"]
    assert prov["image_digest"] == "sparkprov/lab-vllm-cpu@sha256:" + "cd" * 32
    assert (prov["model_repo"], prov["model_revision"], prov["model_commit"]) == ("sparkprov/lab-tiny", "main", COMMIT)
    assert (prov["vllm_version"], prov["kernel"], prov["recipe_hash"]) == ("0.32.0", "6.11.0-1016-nvidia",
                                                                           "0123456789abcdef")
    assert prov["layout"]["hosts"] == ["spark1"] and rec["profile"] == "arena"


def test_bench_reads_everything_it_records_in_one_round_trip(tmp_path, capsys):
    """On this machine (connection: local, no serving container): the status, the driver and the
    host identity come back in one gather, one remote call; nothing else runs."""
    inv = tmp_path / "inventory.yaml"
    inv.write_text("hosts:\n  localhost: {connection: local}\n")
    with pytest.raises(Exit) as e:
        bench(Context(), "nosuch", inventory=str(inv), results=str(tmp_path / "r"), json=True)
    doc = json.loads(capsys.readouterr().out)
    assert doc["hosts"]["localhost"]["remote_calls"] == 1, doc
    assert e.value.code == 2 and doc["bench"]["runs"] == [] and not (tmp_path / "r").exists()


LAB = FIX / "bench-lab"  # real captures of a lab run on the real vLLM (see its README.md)


def test_digest_and_revision_from_the_labs_real_docker_output():
    args = json.loads((LAB / "container-args.json").read_text())
    image = (LAB / "container-config-image.txt").read_text().strip()
    digests = json.loads((LAB / "image-repo-digests.json").read_text())
    assert sb.pick_digest(image, digests) == digests[0] and digests[0].startswith("sparkprov/lab-vllm-cpu@sha256:")
    assert sb.revision_of(args) == "main"
    stored = json.loads((LAB / "stored-run.json").read_text())
    prov = stored["provenance"]
    # what that run recorded is what these reads give
    assert prov["image_digest"] == sb.pick_digest(image, digests) and prov["model_revision"] == sb.revision_of(args)
    assert len(prov["model_commit"]) == 40 and prov["driver_version"] and prov["kernel"] and prov["vllm_version"]
