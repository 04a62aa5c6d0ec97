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

MiB = 1024 * 1024
REPO = "filters/mini"


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    from sparkprov.lab.hub import RepoSpec, ensure_generated, start_in_thread

    root = tmp_path_factory.mktemp("hub")
    repo = ensure_generated(RepoSpec(REPO, num_shards=2, total_size=2 * MiB), root)
    server = start_in_thread([repo], bind="127.0.0.1", port=0)
    yield server, repo
    server.shutdown()
    server.server_close()


@pytest.fixture
def stage(hub, tmp_path, monkeypatch):
    server, repo = hub
    store = tmp_path / "store"
    inv_file = tmp_path / "inventory.yaml"
    inv_file.write_text(f"hosts:\n  localhost: {{connection: local}}\n"
                        f"vars:\n  model_store: {store}\n  hf_endpoint: {server.url}\n")
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HUGGING_FACE_HUB_TOKEN", raising=False)
    monkeypatch.setenv("HF_TOKEN_PATH", str(tmp_path / "no-token"))

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
