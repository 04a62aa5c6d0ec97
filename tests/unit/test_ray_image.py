"""Issue 12: Ray without installs at container start. The derived image's plan, and the Ray
head/worker scripts that no longer install anything."""

from __future__ import annotations

import tarfile

from sparkprov.facts.serving import ImageId, ImageLabel
from sparkprov.modules import ray_image
from sparkprov.modules.base import FactView, HostContext
from sparkprov.serving import spec


def ctx(check=False):
    return HostContext("spark1", {}, {"user": "nvidia", "home": "/home/nvidia"}, check=check, exports={},
                       play_hosts=["spark1", "spark2"], become=False)


def plan(base_id, derived, check=False):
    args = ray_image.Args(base="vllm/vllm-openai:cu130-nightly")
    tag = ray_image.derived_tag(args.base)
    values = {ImageId(args.base).key: {"id": base_id, "error": None},
              ImageLabel(tag, ray_image.BASE_LABEL).key: derived}
    m = ray_image.RayImage()
    return m.plan(args, m.view(args, FactView(values, {}), ctx(check)), ctx(check)), tag


def test_built_once_and_reused():
    p, tag = plan("sha256:aaa", {"id": "sha256:bbb", "label": "sha256:aaa"})
    assert not p.changes and p.exports == {"ray_image": {"vllm/vllm-openai:cu130-nightly": tag}}
    assert tag.startswith("sparkprov/ray-2.60.0:")


def test_built_when_absent_or_when_the_base_changed():
    for derived in ({"id": None, "label": None}, {"id": "sha256:bbb", "label": "sha256:old"}):
        p, tag = plan("sha256:aaa", derived)
        probe, build = p.changes
        assert "python3" in probe.script and "--network none" in probe.script and probe.outcome is not None
        assert build.prepare is not None and f"-t {tag}" in build.script
        assert "FROM sha256:aaa" in build.script and "--no-index" in build.script
        assert "LABEL org.sparkprov.ray.base=sha256:aaa" in build.script


def test_wheels_come_for_the_image_python_and_machine():
    p, _ = plan("sha256:aaa", {"id": None, "label": None})
    probe, build = p.changes
    assert probe.outcome("311 x86_64\n") is None
    assert probe.outcome("garbage") is not None


def test_no_container_command_installs_anything():
    """The Ray head and worker scripts never pip install (001 §6's scripts did, at every start)."""
    for script in (spec.HEAD_SCRIPT, spec.WORKER_SCRIPT, spec.NATIVE_SCRIPT):
        assert "pip" not in script


def test_wheel_cache_is_a_tar_of_wheels(tmp_path, monkeypatch):
    """fetch_wheels packs what pip downloaded; a second call uses the cache (no pip)."""
    folder = tmp_path / "ray-2.60.0-cp311-x86_64"
    folder.mkdir()
    (folder / "ray-2.60.0-cp311-cp311-manylinux2014_x86_64.whl").write_bytes(b"PK")
    calls = []

    def fake_run(argv, **kw):  # pip itself is not ours: stand in for the package index
        calls.append(argv)

        class R:
            returncode, stdout, stderr = 0, "", ""
        return R()

    monkeypatch.setattr(ray_image.subprocess, "run", fake_run)
    tar = ray_image.fetch_wheels("2.60.0", "311", "x86_64", cache=tmp_path)
    assert calls and "--python-version" in calls[0] and "manylinux2014_x86_64" in calls[0]
    with tarfile.open(tar) as tf:
        assert tf.getnames() == ["wheels/ray-2.60.0-cp311-cp311-manylinux2014_x86_64.whl"]
    calls.clear()
    assert ray_image.fetch_wheels("2.60.0", "311", "x86_64", cache=tmp_path) == tar and not calls
