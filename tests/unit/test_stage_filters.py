"""stage-weights --include / --exclude / --revision, end to end on the control machine as the only
Spark (connection: local) against the lab's hub on loopback: the plan, the download, the verify
and the no-op rerun all honour the filter. The store is read back with plain file reads."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from sparkprov.data.inventory import load_inventory
from sparkprov.engine.report import Report
from sparkprov.errors import SparkprovError
from sparkprov.plays.stage import StageOptions, run_stage
from helpers import local_stage_inventory

MiB = 1024 * 1024
REPO = "filters/mini"


@pytest.fixture
def stage(local_hub, tmp_path, monkeypatch):
    server, repo = local_hub
    store = tmp_path / "store"
    inv_file = local_stage_inventory(tmp_path, server, monkeypatch, model_store=store)

    def run(model=REPO, **kw):
        inv = load_inventory(inv_file)
        report = Report(io.StringIO())
        summary = run_stage(inv, ["localhost"], model, StageOptions(**kw), report)
        return report, summary

    run.store, run.repo = store, repo
    return run


def snapshot(store: Path, repo) -> set[str]:
    """The files the store's snapshot holds (relative paths), each readable to the end."""
    snap = store / "hub" / f"models--{REPO.replace('/', '--')}" / "snapshots" / repo.commit
    if not snap.is_dir():
        return set()
    files = {str(p.relative_to(snap)) for p in snap.rglob("*") if p.is_symlink() or p.is_file()}
    for f in files:
        (snap / f).read_bytes()
    return files


def test_include_stages_only_matching_files_and_rerun_is_a_noop(stage):
    every = {p for p in stage.repo.files if p != ".gitattributes"}
    json_files = {p for p in every if p.endswith(".json")}
    assert json_files and json_files != every
    report, summary = stage(include=["*.json"])
    assert report.exit_code() == 0
    assert summary["files"] == len(json_files)
    assert snapshot(stage.store, stage.repo) == json_files
    again, _ = stage(include=["*.json"])
    assert again.exit_code() == 0 and again.hosts["localhost"].changed == 0
    assert again.hosts["localhost"].remote_calls == 1
    # the rest, with --exclude: the files already there are not fetched again
    rest, summary = stage(exclude=["*.json"])
    assert rest.exit_code() == 0
    assert summary["files"] == len(every - json_files)
    assert snapshot(stage.store, stage.repo) == every


def test_revision_pins_the_commit(stage):
    report, summary = stage(revision=stage.repo.commit, include=["config.json"])
    assert report.exit_code() == 0
    assert summary["repos"] == {f"{REPO}@{stage.repo.commit}": stage.repo.commit}
    assert snapshot(stage.store, stage.repo) == {"config.json"}


@pytest.mark.parametrize("kw, message", [
    ({"include": ["*.bin"]}, "--include '*.bin' matches no file of filters/mini@main"),
    ({"exclude": ["*.gguf"]}, "--exclude '*.gguf' matches no file of filters/mini@main"),
    ({"include": ["*.json"], "exclude": ["*"]}, "--include/--exclude leave no file of filters/mini@main"),
    ({"model": REPO + "@main", "revision": "v2"}, "names revision 'main' and --revision says 'v2'"),
    ({"revision": "no-such-branch"}, "revision 'no-such-branch' not found"),
])
def test_bad_filters_fail_before_any_host(stage, kw, message):
    with pytest.raises(SparkprovError) as e:
        stage(**kw)
    assert message in str(e.value)
    assert not stage.store.exists()


def test_rehash_hashes_again_and_ends_verified(stage):
    """--rehash hashes every file once more (the record of earlier hashes is not trusted) and the
    run ends with the store verified: the verify step does not ask for another hash."""
    first, _ = stage(include=["*.json"])
    assert first.exit_code() == 0
    again, _ = stage(include=["*.json"], rehash=True)
    failed = [(r.task, r.msg) for r in again.results if r.status == "failed"]
    assert again.exit_code() == 0, failed
    assert snapshot(stage.store, stage.repo) == {p for p in stage.repo.files if p.endswith(".json")}
