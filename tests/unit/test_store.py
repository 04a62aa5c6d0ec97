"""`invoke store`: the store fact's parser on literal output, the store module's plans on literal
facts (an in-use repo is never pruned; of a repo in use only the unused revisions go, and blobs a
kept revision links to stay), its removal script run on a real tree, and the whole command end to
end on the control machine as the only Spark (connection: local): a repo staged from the lab's hub
on loopback is listed with its size and verified files, `--prune --check` leaves every file,
`--prune` removes it, a rerun changes nothing."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sparkprov.catalog.load import load_catalog
from sparkprov.data.inventory import load_inventory
from sparkprov.engine.report import Report
from sparkprov.facts.base import ShellCtx
from sparkprov.facts.serving import ManagedContainers
from sparkprov.modules.base import FactView, HostContext
from sparkprov.modules.store import Args, Store
from sparkprov.plays.stage import StageOptions, run_stage
from sparkprov.plays.store import run_store
from sparkprov.staging.store import StoreContentsFact, parse_contents, removal_script, summarize
from helpers import local_stage_inventory

ROOT = Path(__file__).resolve().parents[2]
INVOKE = [sys.executable, "-m", "invoke", "--search-root", str(ROOT)]

A = "a" * 40      # commits
B = "b" * 40
SHA_BIG = "1" * 64    # an LFS blob (sha256), shared by both revisions
SHA_OLD = "2" * 64    # only revision B links to it
OID_CFG = "3" * 40    # a small file's git blob id

LITERAL = "\n".join([
    "store\t/home/u/vllm",
    "docker\tyes",
    "repo\tmodels--org--used",
    "repo\tmodels--org--idle",
    f"e\tf\t1000\t1700000000.5\t\thub/models--org--used/blobs/{SHA_BIG}",
    f"e\tf\t400\t1700000001.0\t\thub/models--org--used/blobs/{SHA_OLD}",
    f"e\tf\t20\t1700000002.25\t\thub/models--org--used/blobs/{OID_CFG}",
    f"e\tl\t79\t1700000003.0\t../../blobs/{SHA_BIG}\thub/models--org--used/snapshots/{A}/model.safetensors",
    f"e\tl\t79\t1700000003.0\t../../blobs/{OID_CFG}\thub/models--org--used/snapshots/{A}/config.json",
    f"e\tl\t79\t1700000003.0\t../../blobs/{SHA_BIG}\thub/models--org--used/snapshots/{B}/model.safetensors",
    f"e\tl\t79\t1700000003.0\t../../../blobs/{SHA_OLD}\thub/models--org--used/snapshots/{B}/sub/extra.bin",
    "e\tf\t41\t1700000004.0\t\thub/models--org--used/refs/main",
    f"e\tf\t7\t1700000005.0\t\thub/models--org--idle/blobs/{OID_CFG}",
    f"e\tl\t79\t1700000003.0\t../../blobs/{OID_CFG}\thub/models--org--idle/snapshots/{A}/config.json",
    f"e\tl\t79\t1700000003.0\t../../blobs/{'9' * 64}\thub/models--org--idle/snapshots/{A}/gone.safetensors",
    f"r\thub/models--org--used/refs/main\t{A}",
    f"r\thub/models--org--used/refs/old\t{B}",
    "staged\tmodels--org--idle",
    # verified: the big blob as it is now; the config blob with another mtime (touched since): not verified
    f"v\t1000\t1700000000.500000000\tsha256:{SHA_BIG}\thub/models--org--used/blobs/{SHA_BIG}",
    f"v\t20\t1600000000.0\tgit:{OID_CFG}\thub/models--org--used/blobs/{OID_CFG}",
    f"v\t400\t1700000001.0\tsha256:{'f' * 64}\thub/models--org--used/blobs/{SHA_OLD}",
    "cache\t/home/u/vllm-compile-cache\t3\t123456",
]) + "\n"


def test_parser_reads_repos_refs_snapshots_blobs_and_verified_state():
    sc = parse_contents(LITERAL)
    assert sc.store == "/home/u/vllm" and sc.docker and sc.exists
    assert sorted(sc.repos) == ["org/idle", "org/used"]
    used = sc.repos["org/used"]
    assert used.dir == "hub/models--org--used"
    assert used.refs == {"main": A, "old": B}
    assert {c: sorted(f) for c, f in used.snapshots.items()} == {A: ["config.json", "model.safetensors"],
                                                                  B: ["model.safetensors", "sub/extra.bin"]}
    assert used.snapshots[B]["sub/extra.bin"].blob == SHA_OLD
    assert {b: x.size for b, x in used.blobs.items()} == {SHA_BIG: 1000, SHA_OLD: 400, OID_CFG: 20}
    assert sc.repos["org/idle"].staged and not used.staged
    assert sc.cache == {"path": "/home/u/vllm-compile-cache", "exists": True, "entries": 3, "size": 123456}

    s = summarize(sc, used)
    assert s["size"] == 1420 and s["blobs"] == 3
    assert s["blobs_verified"] == 1  # config: mtime changed; SHA_OLD: the record's digest is another blob's
    revs = {r["commit"]: r for r in s["revisions"]}
    assert revs[A] == {"commit": A, "refs": ["main"], "files": 2, "verified": 1, "missing": 0, "size": 1020}
    assert revs[B] == {"commit": B, "refs": ["old"], "files": 2, "verified": 1, "missing": 0, "size": 1400}
    idle = summarize(sc, sc.repos["org/idle"])
    assert idle["revisions"][0]["missing"] == 1 and idle["revisions"][0]["size"] == 7
    assert idle["staging_leftovers"] is True


def test_parser_absent_store_and_unreadable_output():
    sc = parse_contents("store\t/home/u/vllm\ncache\t/home/u/cc\tabsent\n")
    assert sc.repos == {} and not sc.exists and not sc.docker and sc.cache["exists"] is False
    from sparkprov.facts.base import FactError

    with pytest.raises(FactError):
        parse_contents("", "sh: 1: cannot create: Permission denied")


# -- the module on literal facts ------------------------------------------------------------

def _recipe_with_extra_repo():
    """A catalog alias whose recipe reads two repos (model + extra), both at `main`."""
    for alias, r in load_catalog().recipes.items():
        if r.extra_repos and r.model.revision == "main" and all(x.revision == "main" for x in r.extra_repos):
            return alias, r.model.repo, r.extra_repos[0].repo
    pytest.skip("no catalog recipe with an extra repo at main")


def _literal_store(model_repo: str) -> str:
    """LITERAL with org/used renamed to a catalog model's repo."""
    return LITERAL.replace("models--org--used", "models--" + model_repo.replace("/", "--"))


def _plan(args: dict, store_out: str, containers: dict, *, check: bool = False):
    mod = Store()
    a = Args.model_validate(args)
    ctx = HostContext("s1", {"model_store": "/home/u/vllm", "compile_cache": "/home/u/vllm-compile-cache"},
                      {"user": "u", "home": "/home/u"}, check=check, exports={}, play_hosts=["s1"], become=False)
    facts = mod.needs(a, ctx)
    values = {facts["store"].key: parse_contents(store_out), ManagedContainers().key: containers}
    return mod.plan(a, mod.view(a, FactView(values, {}), ctx), ctx)


def _containers(alias: str, status: str = "running", deployment: str = "dep1") -> dict:
    return {"access": True, "error": None, "containers": [
        {"name": f"sparkprov-{deployment}", "status": status, "labels": {
            "sparkprov.managed": "1", "sparkprov.deployment": deployment, "sparkprov.role": "server",
            "sparkprov.recipe": alias}}]}


def test_list_changes_nothing_and_says_who_uses_what():
    alias, repo, _ = _recipe_with_extra_repo()
    plan = _plan({"action": "list"}, _literal_store(repo), _containers(alias))
    assert plan.failed is None and not plan.changes
    rows = {r["repo"]: r for r in plan.exports["store"]["repos"]}
    assert rows[repo]["in_use"] == ["dep1"]
    assert {r["commit"]: r["in_use"] for r in rows[repo]["revisions"]} == {A: ["dep1"], B: []}  # refs/main -> A
    assert rows["org/idle"]["in_use"] == []
    assert "2 models" in plan.msg


def test_prune_refuses_a_repo_a_deployment_uses_even_stopped():
    alias, repo, _ = _recipe_with_extra_repo()
    for status in ("running", "exited"):
        plan = _plan({"action": "prune", "prune": [repo, "org/idle"]}, _literal_store(repo), _containers(alias, status))
        assert plan.failed and not plan.changes
        assert f"{repo} is in use by dep1 ({status})" in plan.failed
        assert "invoke cluster-down --deployments dep1" in plan.failed


def test_prune_named_unused_repo_removes_its_folder_and_staging_leftovers():
    alias, repo, _ = _recipe_with_extra_repo()
    plan = _plan({"action": "prune", "prune": ["org/idle", "org/absent"]}, _literal_store(repo), _containers(alias))
    assert plan.failed is None
    (change,) = plan.changes
    assert change.summary.startswith("remove org/idle (")
    assert "rm -rf -- hub/models--org--idle .sparkprov/staging/hub/models--org--idle\n" in change.script
    assert "org/idle" in change.diff.before and "org/idle" not in change.diff.after
    assert repo in change.diff.after


def test_prune_unused_removes_only_unused_revisions_and_their_own_blobs(tmp_path):
    """Run the planned script on a real tree laid out as the literal facts say."""
    alias, repo, _ = _recipe_with_extra_repo()
    out = _literal_store(repo)
    plan = _plan({"action": "prune", "unused": True}, out, _containers(alias))
    assert plan.failed is None
    (change,) = plan.changes
    assert "org/idle" in change.summary and f"{repo}: 1 unused revision" in change.summary

    store = tmp_path / "vllm"
    sc = parse_contents(out)
    for rc in sc.repos.values():
        for name, b in rc.blobs.items():
            p = store / rc.dir / "blobs" / name
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_bytes(b"x" * b.size)
        for commit, files in rc.snapshots.items():
            for rel, f in files.items():
                link = store / rc.dir / "snapshots" / commit / rel
                link.parent.mkdir(parents=True, exist_ok=True)
                link.symlink_to(os.path.relpath(store / rc.dir / "blobs" / f.blob, link.parent))
        for ref, commit in rc.refs.items():
            (store / rc.dir / "refs").mkdir(parents=True, exist_ok=True)
            (store / rc.dir / "refs" / ref).write_text(commit)
    (store / ".sparkprov/staging/hub/models--org--idle").mkdir(parents=True)
    d = "hub/models--" + repo.replace("/", "--")
    (store / ".sparkprov/verified").write_text(
        f"1000\t1.0\tsha256:{SHA_BIG}\t{d}/blobs/{SHA_BIG}\n400\t1.0\tsha256:{SHA_OLD}\t{d}/blobs/{SHA_OLD}\n"
        f"7\t1.0\tgit:{OID_CFG}\thub/models--org--idle/blobs/{OID_CFG}\n")
    script = change.script.replace("S=/home/u/vllm", f"S={store}")
    subprocess.run(["bash", "-c", script], check=True)

    kept = sorted(str(p.relative_to(store)) for p in store.rglob("*") if p.is_file() or p.is_symlink())
    assert kept == sorted([".sparkprov/verified", f"{d}/blobs/{SHA_BIG}", f"{d}/blobs/{OID_CFG}",
                           f"{d}/refs/main", f"{d}/snapshots/{A}/config.json", f"{d}/snapshots/{A}/model.safetensors"])
    assert (store / ".sparkprov/verified").read_text() == f"1000\t1.0\tsha256:{SHA_BIG}\t{d}/blobs/{SHA_BIG}\n"
    # the kept revision reads to the end through its links
    assert (store / d / "snapshots" / A / "model.safetensors").read_bytes() == b"x" * 1000

    # read back with the fact's own script: nothing is left to prune
    fact = StoreContentsFact(str(store), str(tmp_path / "cc"))
    res = subprocess.run(["sh", "-c", fact.command(ShellCtx(str(tmp_path)))], capture_output=True, text=True, check=True)
    again = _plan({"action": "prune", "unused": True}, res.stdout.replace(str(store), "/home/u/vllm"), _containers(alias))
    assert again.failed is None and not again.changes and again.msg.startswith("nothing to prune")


def test_prune_unused_keeps_every_revision_when_the_used_one_is_unknown():
    alias, repo, _ = _recipe_with_extra_repo()
    out = "\n".join(line for line in _literal_store(repo).splitlines() if "refs/main" not in line)
    plan = _plan({"action": "prune", "unused": True}, out, _containers(alias))
    (change,) = plan.changes
    assert change.summary.startswith("remove org/idle (") and repo not in change.summary


def test_compile_cache_is_never_emptied_while_a_deployment_runs():
    alias, repo, _ = _recipe_with_extra_repo()
    plan = _plan({"action": "prune", "compile_cache": True}, _literal_store(repo), _containers(alias))
    assert plan.failed and "dep1 runs here" in plan.failed
    stopped = _plan({"action": "prune", "compile_cache": True}, _literal_store(repo), _containers(alias, "exited"))
    (change,) = stopped.changes
    assert change.script == "find /home/u/vllm-compile-cache -mindepth 1 -delete"
    assert change.diff.after == "empty\n"


def test_prune_fails_when_docker_will_not_say_what_runs():
    plan = _plan({"action": "prune", "prune": ["org/idle"]}, LITERAL,
                 {"access": False, "error": "permission denied while trying to connect", "containers": []})
    assert plan.failed and "cannot tell which deployments use the store" in plan.failed
    listed = _plan({"action": "list"}, LITERAL, {"access": False, "error": "permission denied", "containers": []})
    assert listed.failed is None and listed.warnings


def test_prune_refuses_while_a_container_of_an_unknown_recipe_exists():
    plan = _plan({"action": "prune", "unused": True}, LITERAL, _containers("no-such-alias"))
    assert plan.failed and "cannot tell which repos" in plan.failed and "no-such-alias" in plan.failed


def test_removal_script_refuses_paths_outside_the_hub():
    from sparkprov.staging.store import Removal

    for bad in ("hub/models--x/../../etc", "/etc", "hub/other", ".sparkprov/verified"):
        with pytest.raises(ValueError):
            removal_script("/s", [Removal("x/y", True, [bad])])


def test_args_refuse_a_repo_id_that_is_not_one():
    from pydantic import ValidationError

    for bad in ("../x", "a", "a/b/c", "a--b/c", "a/b c"):
        with pytest.raises(ValidationError):
            Args.model_validate({"action": "prune", "prune": [bad]})


# -- end to end on the control machine ------------------------------------------------------

MiB = 1024 * 1024
REPO = "store/mini"


@pytest.fixture
def local(local_hub, tmp_path, monkeypatch):
    server, repo = local_hub
    store, cache = tmp_path / "store", tmp_path / "cc"
    inv = local_stage_inventory(tmp_path, server, monkeypatch, model_store=store, compile_cache=cache)
    report = Report(io.StringIO())
    run_stage(load_inventory(inv), ["localhost"], REPO, StageOptions(), report)
    assert report.exit_code() == 0, [r.as_dict() for r in report.results]
    return {"inv": inv, "store": store, "cache": cache, "repo": repo, "dir": tmp_path}


def invoke(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING_FACE", "SPARKPROV_"))}
    env.update({"HF_TOKEN_PATH": str(cwd / "no-token"), "NO_COLOR": "1"})
    return subprocess.run(INVOKE + args, cwd=cwd, capture_output=True, text=True, timeout=120, env=env)


def tree(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): (p.lstat().st_size if p.is_symlink() else p.stat().st_size)
            for p in root.rglob("*") if p.is_file() or p.is_symlink()}


def test_store_lists_prunes_with_check_then_for_real_and_reruns_as_noop(local):
    repo, store, d = local["repo"], local["store"], local["dir"]
    staged_bytes = sum(p.stat().st_size for p in (store / "hub" / "models--store--mini" / "blobs").iterdir())

    listed = invoke(["store", "--inventory", str(local["inv"]), "--json"], d)
    assert listed.returncode == 0, listed.stderr
    doc = json.loads(listed.stdout)
    (row,) = doc["store"]["localhost"]["repos"]
    (rev,) = row["revisions"]
    assert row["repo"] == REPO and rev["commit"] == repo.commit and rev["refs"] == ["main"]
    assert row["size"] == staged_bytes == rev["size"]
    assert rev["files"] == rev["verified"] == row["blobs"] == row["blobs_verified"] > 0
    assert doc["hosts"]["localhost"]["changed"] == 0 and doc["hosts"]["localhost"]["remote_calls"] == 1

    table = invoke(["store", "--inventory", str(local["inv"]), "--hosts", "localhost"], d)
    assert table.returncode == 0, table.stderr
    assert REPO in table.stdout and f"main@{repo.commit[:12]}" in table.stdout
    assert f"{rev['files']}/{rev['files']}" in table.stdout and "PLAY RECAP" in table.stdout

    before = tree(store)
    check = invoke(["store", "--inventory", str(local["inv"]), "--prune", REPO, "--check", "--json"], d)
    assert check.returncode == 0, check.stderr
    res = [r for r in json.loads(check.stdout)["results"] if r["task"] == "store: prune"]
    assert res[0]["status"] == "changed" and res[0]["msg"].startswith(f"would: remove {REPO}")
    assert tree(store) == before

    pruned = invoke(["store", "--inventory", str(local["inv"]), "--prune", REPO, "--json"], d)
    assert pruned.returncode == 0, pruned.stderr
    doc = json.loads(pruned.stdout)
    assert doc["hosts"]["localhost"]["changed"] == 1
    assert doc["store"]["localhost"]["repos"] == []  # what the re-read after the apply found
    assert not (store / "hub" / "models--store--mini").exists()
    assert all(REPO.replace("/", "--") not in line for line in (store / ".sparkprov/verified").read_text().splitlines())

    again = invoke(["store", "--inventory", str(local["inv"]), "--prune", REPO, "--json"], d)
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["hosts"]["localhost"]["changed"] == 0


def test_prune_unused_and_compile_cache_on_the_engine(local):
    cache = local["cache"]
    (cache / "torch_compile_cache" / "abc").mkdir(parents=True)
    (cache / "torch_compile_cache" / "abc" / "graph.py").write_text("x" * 100)
    (local["store"] / "hub" / "models--other--thing" / "blobs").mkdir(parents=True)
    (local["store"] / "hub" / "models--other--thing" / "blobs" / ("4" * 64)).write_bytes(b"y" * 10)
    inv = load_inventory(local["inv"])
    args = {"action": "prune", "prune": [], "unused": True, "compile_cache": True}

    report = Report(io.StringIO())
    found = run_store(inv, ["localhost"], args, report, check=True)
    assert report.exit_code() == 0 and report.hosts["localhost"].changed == 1
    assert {r["repo"] for r in found["localhost"]["repos"]} == {REPO, "other/thing"}
    assert (cache / "torch_compile_cache" / "abc" / "graph.py").exists()

    report = Report(io.StringIO())
    found = run_store(inv, ["localhost"], args, report)
    assert report.exit_code() == 0, [r.as_dict() for r in report.results]
    assert found["localhost"]["repos"] == [] and found["localhost"]["compile_cache"]["entries"] == 0
    assert cache.is_dir() and not any(cache.iterdir())
    assert not (local["store"] / "hub" / "models--store--mini").exists()

    report = Report(io.StringIO())
    run_store(inv, ["localhost"], args, report)
    assert report.exit_code() == 0 and report.hosts["localhost"].changed == 0


def test_verify_hashes_again_and_removes_a_bad_blob(local):
    blobs = local["store"] / "hub" / "models--store--mini" / "blobs"
    proc = invoke(["store", "--inventory", str(local["inv"]), "--verify", REPO, "--json"], local["dir"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(proc.stdout)
    (row,) = doc["store"]["localhost"]["repos"]
    assert row["blobs"] == row["blobs_verified"] == len(list(blobs.iterdir()))
    (res,) = [r for r in doc["results"] if r["task"] == "store: verify"]
    assert res["status"] == "changed" and res["msg"].startswith(f"hash {row['blobs']} blobs")

    # one blob's bytes changed in place (same size, mtime put back): the record still trusts it,
    # the hash does not
    big = max(blobs.iterdir(), key=lambda p: p.stat().st_size)
    st = big.stat()
    data = bytearray(big.read_bytes())
    data[0] ^= 0xFF
    big.write_bytes(bytes(data))
    os.utime(big, ns=(st.st_atime_ns, st.st_mtime_ns))
    proc = invoke(["store", "--inventory", str(local["inv"]), "--verify", "all", "--json"], local["dir"])
    assert proc.returncode == 2, proc.stdout + proc.stderr
    doc = json.loads(proc.stdout)
    (res,) = [r for r in doc["results"] if r["task"] == "store: verify"]
    assert res["status"] == "failed" and "1 blobs hashed wrong and were removed" in res["msg"] and big.name in res["msg"]
    assert not big.exists()
    listed = invoke(["store", "--inventory", str(local["inv"]), "--json"], local["dir"])
    (row,) = json.loads(listed.stdout)["store"]["localhost"]["repos"]
    assert row["revisions"][0]["missing"] == 1 and row["blobs"] == row["blobs_verified"]


def test_bad_options_are_one_line(tmp_path):
    for args, needle in ((["--prune", "../etc"], "--prune"), (["--prune", "a--b/c"], "--prune"),
                         (["--verify", "x/y", "--prune-unused"], "--verify")):
        proc = invoke(["store", *args], tmp_path)
        assert proc.returncode == 1 and needle in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
