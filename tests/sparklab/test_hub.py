"""The lab hub against the real huggingface_hub client (loopback only, no root needed)."""
# Engine: none: no model is served in this module.

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import httpx2
import pytest
from huggingface_hub import HfApi, hf_hub_download, snapshot_download
from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError
from huggingface_hub.file_download import http_get
from huggingface_hub.hf_api import RepoFile, RepoFolder

from sparklab.hub import (
    HubControl,
    RepoSpec,
    check_bind_address,
    ensure_generated,
    ensure_hub,
    hub_status,
    start_in_thread,
    stop_hub,
)
from sparklab.hub.__main__ import parse_rate
from sparklab.hub.repos import read_safetensors_header
from sparklab.hub.server import read_token_file
from tests.lab.conftest import require

REPO = Path(__file__).resolve().parents[2]   # `python -m sparklab.hub` runs from here (the lab is in no wheel)
TOKEN = "hf_lab_" + "x" * 30
MB = 1_000_000
QWEN = "Qwen/Qwen3.5-122B-A10B-FP8"
GEMMA = "google/gemma-4-31b-it"
MANY = "sparkprov-lab/many-files"
BIG = "sparkprov-lab/big-shard"
MiB = 1024 * 1024
SPECS = [
    RepoSpec(QWEN, num_shards=3, total_size=6 * MB),  # 3 shards of ~2 MB
    RepoSpec(GEMMA, num_shards=2, total_size=1 * MB, gated=True),
    RepoSpec(MANY, num_shards=1, total_size=64 * 1024, extra_files=1100),
    RepoSpec(BIG, num_shards=1, total_size=12 * MiB),  # one shard over the client's 10 MiB read chunk
]
HF_BIN = Path(sys.executable).with_name("hf")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("hub-root")


@pytest.fixture(scope="module")
def hub(tmp_path_factory, root):
    state = tmp_path_factory.mktemp("hub-state")
    port = _free_port()
    url = ensure_hub(state, "127.0.0.1", port, repos=SPECS, token=TOKEN, root=root)
    repos = {s.repo_id: ensure_generated(s, root) for s in SPECS}
    yield {"url": url, "state": state, "port": port, "ctl": HubControl(url), "repos": repos}
    stop_hub(state)


@pytest.fixture(autouse=True)
def _clean(request):
    if "hub" in request.fixturenames:
        ctl: HubControl = request.getfixturevalue("hub")["ctl"]
        ctl.set(clear_faults=True, throttle_bps=None, require_token=False)
        ctl.clear_requests()


def _files(repo, lfs: bool | None = None) -> list:
    return [f for f in repo.files.values() if lfs is None or f.lfs == lfs]


def _shard(hub) -> object:
    return hub["repos"][QWEN].files["model-00001-of-00003.safetensors"]


# --------------------------------------------------------------------------------------------- generation


def test_generation_is_deterministic_and_valid(tmp_path):
    spec = RepoSpec(QWEN, num_shards=3, total_size=2 * MB)
    a = ensure_generated(spec, tmp_path / "a")
    b = ensure_generated(spec, tmp_path / "b")
    assert a.commit == b.commit and len(a.commit) == 40 and int(a.commit, 16) >= 0
    assert {p: f.sha256 for p, f in a.files.items()} == {p: f.sha256 for p, f in b.files.items()}
    shards = sorted(p for p in a.files if p.endswith(".safetensors"))
    assert shards == [f"model-{i:05d}-of-00003.safetensors" for i in (1, 2, 3)]
    index = json.loads(a.file_path("model.safetensors.index.json").read_text())
    names_in_shards = {}
    for shard in shards:
        header = read_safetensors_header(a.file_path(shard))  # raises if offsets do not match the file
        assert header["__metadata__"] == {"format": "pt"}
        names_in_shards.update({k: shard for k in header if k != "__metadata__"})
    assert index["weight_map"] == names_in_shards
    assert "model.layers.0.self_attn.q_proj.weight" in names_in_shards
    assert 1.5 * MB < sum(a.files[s].size for s in shards) < 2.5 * MB
    cfg = json.loads(a.file_path("config.json").read_text())
    for key in ("num_hidden_layers", "num_key_value_heads", "head_dim", "hidden_size", "num_attention_heads",
                "torch_dtype", "model_type", "architectures"):
        assert key in cfg
    assert cfg["quantization_config"]["quant_method"] == "fp8"
    # a second ensure reuses the files (no rewrite), a changed spec gives other bytes and another commit
    mtime = a.file_path(shards[0]).stat().st_mtime_ns
    assert ensure_generated(spec, tmp_path / "a").file_path(shards[0]).stat().st_mtime_ns == mtime
    c = ensure_generated(RepoSpec(QWEN, num_shards=3, total_size=2 * MB, seed="other"), tmp_path / "a")
    assert c.commit != a.commit and c.files[shards[0]].sha256 != a.files[shards[0]].sha256
    over = ensure_generated(RepoSpec("x/y", num_shards=1, config={"num_hidden_layers": 3}), tmp_path / "a")
    assert json.loads(over.file_path("config.json").read_text())["num_hidden_layers"] == 3
    assert "model.safetensors" in over.files and "model.safetensors.index.json" not in over.files


def test_git_ids_match_git(tmp_path):
    git = shutil.which("git")
    require([] if git else ["git (not installed: apt-get install git)"])
    repo = ensure_generated(RepoSpec("a/b", num_shards=2, total_size=64 * 1024, extra_files=2), tmp_path / "r")
    work = tmp_path / "w"
    shutil.copytree(repo.directory / "files", work)
    for f in _files(repo, lfs=True):  # what git stores for an LFS file is its pointer
        (work / f.path).write_bytes(
            f"version https://git-lfs.github.com/spec/v1\noid sha256:{f.sha256}\nsize {f.size}\n".encode())
    env = {**os.environ, "GIT_CONFIG_GLOBAL": "/dev/null", "GIT_CONFIG_SYSTEM": "/dev/null"}
    subprocess.run([git, "init", "-q"], cwd=work, check=True, env=env)
    subprocess.run([git, "add", "-A"], cwd=work, check=True, env=env)
    tree = subprocess.run([git, "write-tree"], cwd=work, check=True, env=env, capture_output=True, text=True)
    assert tree.stdout.strip() == repo.trees[""]


# --------------------------------------------------------------------------------------------- downloads


def test_snapshot_download_and_checksums(hub, tmp_path):
    repo = hub["repos"][QWEN]
    path = Path(snapshot_download(QWEN, cache_dir=tmp_path, endpoint=hub["url"], token=False))
    assert path.name == repo.commit
    assert sorted(p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file()) == sorted(repo.files)
    for f in _files(repo, lfs=True):  # our own hash of every large file
        assert _sha256(path / f.path) == f.sha256
        assert (tmp_path / f"models--{QWEN.replace('/', '--')}" / "blobs" / f.sha256).is_file()
    result = HfApi(endpoint=hub["url"], token=False).verify_repo_checksums(QWEN, cache_dir=tmp_path)
    assert result.mismatches == [] and result.missing_paths == [] and result.extra_paths == []
    assert result.checked_count == len(repo.files) and result.revision == repo.commit

    log = hub["ctl"].requests()
    paths = [(r["method"], r["path"].split("?")[0], r["status"]) for r in log]
    assert ("GET", f"/api/models/{QWEN}/revision/main", 200) in paths
    assert ("GET", f"/api/models/{QWEN}/tree/{repo.commit}", 200) in paths
    for f in repo.files:
        assert ("HEAD", f"/{QWEN}/resolve/{repo.commit}/{f}", 200) in paths
        assert ("GET", f"/{QWEN}/resolve/{repo.commit}/{f}", 200) in paths
    assert not any(r["auth"] for r in log)

    # a corrupted blob is caught by the client's own verification
    blob = tmp_path / f"models--{QWEN.replace('/', '--')}" / "blobs" / repo.files["model-00002-of-00003.safetensors"].sha256
    data = bytearray(blob.read_bytes())
    data[-1] ^= 0xFF
    blob.chmod(0o644)
    blob.write_bytes(bytes(data))
    bad = HfApi(endpoint=hub["url"], token=False).verify_repo_checksums(QWEN, cache_dir=tmp_path)
    assert [m["path"] for m in bad.mismatches] == ["model-00002-of-00003.safetensors"]
    assert bad.mismatches[0]["algorithm"] == "sha256"


def test_hf_cli_download_and_cache_verify(hub, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(HF_ENDPOINT=hub["url"], HF_HUB_DISABLE_XET="1", HF_HOME=str(tmp_path / "hf"),
               HF_HUB_DISABLE_TELEMETRY="1", NO_COLOR="1")
    dl = subprocess.run([str(HF_BIN), "download", QWEN, "--format", "quiet"], env=env, capture_output=True,
                        text=True, timeout=120)
    assert dl.returncode == 0, dl.stderr
    snap = Path(dl.stdout.strip().splitlines()[-1])
    assert snap.name == hub["repos"][QWEN].commit and (snap / "config.json").is_file()
    ok = subprocess.run([str(HF_BIN), "cache", "verify", QWEN, "--fail-on-missing-files", "--fail-on-extra-files"],
                        env=env, capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    shard = snap / "model-00003-of-00003.safetensors"
    blob = shard.resolve()
    blob.chmod(0o644)
    with open(blob, "r+b") as f:
        f.seek(100)
        f.write(b"\0" * 8 if f.read(8) != b"\0" * 8 else b"\1" * 8)
    bad = subprocess.run([str(HF_BIN), "cache", "verify", QWEN], env=env, capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode != 0
    assert "model-00003-of-00003.safetensors" in bad.stdout + bad.stderr


def test_api_model_info_paths_info_refs(hub):
    api = HfApi(endpoint=hub["url"], token=False)
    repo = hub["repos"][QWEN]
    info = api.model_info(QWEN, files_metadata=True)
    assert info.sha == repo.commit and info.gated is False
    sib = {s.rfilename: s for s in info.siblings}
    assert set(sib) == set(repo.files)
    shard = _shard(hub)
    assert sib[shard.path].lfs.sha256 == shard.sha256 and sib[shard.path].size == shard.size
    assert sib["config.json"].lfs is None and sib["config.json"].blob_id == repo.files["config.json"].oid
    assert info.safetensors.total > 0
    assert api.model_info(GEMMA).gated == "manual"

    got = api.get_paths_info(QWEN, [shard.path, "config.json", "does-not-exist"], revision=repo.commit)
    assert [type(x) for x in got] == [RepoFile, RepoFile]
    assert got[0].lfs.sha256 == shard.sha256 and got[0].lfs.pointer_size > 0
    many = hub["repos"][MANY]
    folder = api.get_paths_info(MANY, ["extras"], expand=True)
    assert isinstance(folder[0], RepoFolder) and folder[0].tree_id == many.trees["extras"]
    assert folder[0].last_commit.oid == many.commit

    refs = api.list_repo_refs(QWEN)
    assert [(b.name, b.target_commit) for b in refs.branches] == [("main", repo.commit)]
    assert [c.commit_id for c in api.list_repo_commits(QWEN)] == [repo.commit]
    assert HfApi(endpoint=hub["url"], token=TOKEN).whoami()["name"] == "sparkprov-lab"
    with pytest.raises(RepositoryNotFoundError):
        api.model_info("nobody/nothing")
    with pytest.raises(HfHubHTTPError) as e:
        api.model_info(QWEN, revision="v9")
    assert e.value.response.headers["X-Error-Code"] == "RevisionNotFound"


def test_tree_pagination(hub):
    api = HfApi(endpoint=hub["url"], token=False)
    many = hub["repos"][MANY]
    entries = list(api.list_repo_tree(MANY, recursive=True))
    files = sorted(e.path for e in entries if isinstance(e, RepoFile))
    assert files == sorted(many.files) and len(files) > 1100
    assert [e.path for e in entries if isinstance(e, RepoFolder)] == ["extras"]
    tree_calls = [r for r in hub["ctl"].requests() if "/tree/" in r["path"]]
    assert len(tree_calls) == 2 and "cursor=" in tree_calls[1]["path"]

    top = list(api.list_repo_tree(MANY))  # not recursive: the folder, not its files
    assert any(isinstance(e, RepoFolder) and e.path == "extras" for e in top)
    assert not any(e.path.startswith("extras/") for e in top)
    sub = list(api.list_repo_tree(MANY, path_in_repo="extras"))
    assert len(sub) == 1100

    hub["ctl"].clear_requests()
    expanded = list(api.list_repo_tree(MANY, recursive=True, expand=True))
    assert len(expanded) == len(entries)
    assert all(e.last_commit.oid == many.commit for e in expanded)
    assert len([r for r in hub["ctl"].requests() if "/tree/" in r["path"]]) == -(-len(entries) // 50)


def test_range_requests_and_resume(hub, tmp_path):
    shard = _shard(hub)
    repo = hub["repos"][QWEN]
    data = repo.file_path(shard.path).read_bytes()
    url = f"{hub['url']}/{QWEN}/resolve/main/{shard.path}"

    def get(range_header: str):
        req = urllib.request.Request(url, headers={"Range": range_header})
        return urllib.request.urlopen(req, timeout=10)

    with get("bytes=100-199") as r:
        assert r.status == 206 and r.headers["Content-Range"] == f"bytes 100-199/{shard.size}"
        assert r.read() == data[100:200]
    with get("bytes=-10") as r:
        assert r.status == 206 and r.read() == data[-10:]
    with pytest.raises(urllib.error.HTTPError) as e:
        get(f"bytes={shard.size}-")
    assert e.value.code == 416 and e.value.headers["Content-Range"] == f"bytes */{shard.size}"

    head = urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=10)
    assert head.headers["X-Repo-Commit"] == repo.commit
    assert head.headers["X-Linked-Etag"] == f'"{shard.sha256}"' and head.headers["ETag"] == f'"{shard.sha256}"'
    assert int(head.headers["X-Linked-Size"]) == shard.size == int(head.headers["Content-Length"])
    small = urllib.request.urlopen(
        urllib.request.Request(f"{hub['url']}/{QWEN}/resolve/main/config.json", method="HEAD"), timeout=10)
    assert small.headers["ETag"] == f'"{repo.files["config.json"].oid}"' and "X-Linked-Etag" not in small.headers

    # the client's own resume path: half the file on disk, http_get asks for the rest with Range
    half = shard.size // 2
    out = tmp_path / "part"
    with open(out, "wb") as f:
        f.write(data[:half])
        http_get(url, f, resume_size=half, expected_size=shard.size)
    assert _sha256(out) == shard.sha256
    gets = [r for r in hub["ctl"].requests() if r["method"] == "GET" and r["range"] == f"bytes={half}-"]
    assert len(gets) == 1 and gets[0]["status"] == 206 and gets[0]["bytes_sent"] == shard.size - half


def test_gated_repo_needs_the_token(hub, tmp_path):
    repo = hub["repos"][GEMMA]
    with pytest.raises(GatedRepoError) as e:
        hf_hub_download(GEMMA, "config.json", cache_dir=tmp_path / "a", endpoint=hub["url"], token=False)
    assert e.value.response.status_code == 401
    assert e.value.response.headers["X-Error-Code"] == "GatedRepo"
    with pytest.raises(HfHubHTTPError) as e:
        hf_hub_download(GEMMA, "config.json", cache_dir=tmp_path / "b", endpoint=hub["url"], token="hf_wrong")
    assert e.value.response.status_code == 401
    assert e.value.response.headers["X-Error-Message"] == "Invalid credentials in Authorization header"

    path = Path(snapshot_download(GEMMA, cache_dir=tmp_path / "c", endpoint=hub["url"], token=TOKEN))
    for f in _files(repo, lfs=True):
        assert _sha256(path / f.path) == f.sha256

    log = hub["ctl"].requests()
    denied = [r for r in log if r["status"] == 401]
    assert denied and all("/resolve/" in r["path"] for r in denied)
    assert any(not r["auth"] for r in denied) and any(r["auth"] for r in denied)
    assert all(r["auth"] for r in log if r["status"] == 200 and "/resolve/" in r["path"])
    raw = urllib.request.urlopen(f"{hub['url']}/_lab/requests", timeout=10).read().decode()
    assert TOKEN not in raw and "hf_wrong" not in raw
    assert TOKEN not in (hub["state"] / "hub" / "hub.log").read_text()

    # at run time: every repo gated
    hub["ctl"].set(require_token=True)
    with pytest.raises(GatedRepoError):
        hf_hub_download(QWEN, "config.json", cache_dir=tmp_path / "d", endpoint=hub["url"], token=False)
    assert hf_hub_download(QWEN, "config.json", cache_dir=tmp_path / "e", endpoint=hub["url"], token=TOKEN)


def test_throttle_slows_transfers(hub, tmp_path):
    shard = _shard(hub)
    assert shard.size > 1.9 * MB
    hub["ctl"].set(throttle_bps=1 * MB)
    t0 = time.monotonic()
    p = hf_hub_download(QWEN, shard.path, cache_dir=tmp_path / "slow", endpoint=hub["url"], token=False)
    slow = time.monotonic() - t0
    assert _sha256(Path(p)) == shard.sha256
    assert 1.5 <= slow < 30, slow
    hub["ctl"].set(throttle_bps=None)
    t0 = time.monotonic()
    hf_hub_download(QWEN, shard.path, cache_dir=tmp_path / "fast", endpoint=hub["url"], token=False)
    fast = time.monotonic() - t0
    assert fast < slow / 3, (fast, slow)
    assert hub["ctl"].settings()["throttle_bps"] is None


def test_drop_mid_file_client_retries(hub, tmp_path):
    # huggingface_hub reads the body in 10 MiB chunks and only counts (and keeps) whole chunks: after a drop
    # inside the first chunk it starts the file again from byte 0, without Range.
    shard = _shard(hub)
    hub["ctl"].set(drop={"after_bytes": 300_000, "count": 1, "path_glob": f"*/{shard.path}"})
    p = hf_hub_download(QWEN, shard.path, cache_dir=tmp_path, endpoint=hub["url"], token=False)
    assert _sha256(Path(p)) == shard.sha256
    gets = [r for r in hub["ctl"].requests() if r["method"] == "GET"]
    assert [(g["dropped"], g["bytes_sent"], g["range"], g["status"]) for g in gets] == [
        (True, 300_000, None, 200),
        (False, shard.size, None, 200),
    ]


def test_drop_mid_file_client_resumes_with_range(hub, tmp_path):
    # past the first 10 MiB chunk the client resumes with `Range: bytes=10485760-` and gets a 206
    big = hub["repos"][BIG].files["model.safetensors"]
    assert big.size > 11 * MiB and big.lfs
    hub["ctl"].set(drop={"after_bytes": 11 * MiB, "count": 1, "path_glob": "*/model.safetensors"})
    p = hf_hub_download(BIG, "model.safetensors", cache_dir=tmp_path, endpoint=hub["url"], token=False)
    assert _sha256(Path(p)) == big.sha256
    gets = [r for r in hub["ctl"].requests() if r["method"] == "GET"]
    chunk = 10 * MiB
    assert [(g["dropped"], g["bytes_sent"], g["range"], g["status"]) for g in gets] == [
        (True, 11 * MiB, None, 200),
        (False, big.size - chunk, f"bytes={chunk}-", 206),
    ]


def test_drop_every_time_client_gives_up(hub, tmp_path):
    shard = _shard(hub)
    hub["ctl"].set(drop={"after_bytes": 0, "path_glob": f"*/{shard.path}"})
    with pytest.raises(httpx2.RemoteProtocolError):
        hf_hub_download(QWEN, shard.path, cache_dir=tmp_path, endpoint=hub["url"], token=False)
    # the hub logs a dropped request after closing it: the client may give up first
    deadline = time.monotonic() + 5
    while True:
        gets = [r for r in hub["ctl"].requests() if r["method"] == "GET"]
        if len(gets) >= 6 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert len(gets) == 6 and all(g["dropped"] and g["bytes_sent"] == 0 for g in gets)
    assert not list(tmp_path.rglob(shard.path))  # nothing half-written left as the file


def test_fault_500(hub, tmp_path):
    repo = hub["repos"][QWEN]
    ctl = hub["ctl"]
    # a 500 on the tree listing: the client retries (backoff) and the download completes
    ctl.set(fail_next={"path_glob": "/api/models/*/tree/*", "status": 500, "count": 1})
    path = Path(snapshot_download(QWEN, cache_dir=tmp_path / "a", endpoint=hub["url"], token=False,
                                  allow_patterns=["*.json"]))
    assert (path / "config.json").is_file()
    tree = [(r["status"], r["fault"]) for r in ctl.requests() if "/tree/" in r["path"]]
    assert tree == [(500, True), (200, False)]

    # a 500 on the file body (GET is not retried on 5xx): the download fails, the next attempt works
    ctl.clear_requests()
    shard = _shard(hub)
    ctl.set(fail_next={"path_glob": f"*/resolve/*/{shard.path}", "method": "GET", "status": 500, "count": 1})
    with pytest.raises(HfHubHTTPError) as e:
        hf_hub_download(QWEN, shard.path, cache_dir=tmp_path / "b", endpoint=hub["url"], token=False)
    assert e.value.response.status_code == 500
    assert ctl.settings()["fail_next"] == []
    p = hf_hub_download(QWEN, shard.path, cache_dir=tmp_path / "b", endpoint=hub["url"], token=False)
    assert _sha256(Path(p)) == shard.sha256
    statuses = [(r["method"], r["status"]) for r in ctl.requests()]
    assert statuses == [("HEAD", 200), ("GET", 500), ("HEAD", 200), ("GET", 200)]
    assert ctl.requests()[-1]["path"] == f"/{QWEN}/resolve/main/{shard.path}"
    assert Path(p).parent.name == repo.commit  # X-Repo-Commit of the HEAD names the snapshot


def test_control_api_rejects_bad_input(hub):
    req = urllib.request.Request(f"{hub['url']}/_lab/control", data=b'{"throttle": 5}', method="POST",
                                 headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=10)
    assert e.value.code == 400
    assert hub["ctl"].settings()["throttle_bps"] is None


# --------------------------------------------------------------------------------------------- process


def test_ensure_hub_idempotent_restart_and_stop(hub, tmp_path, root):
    st = hub_status(hub["state"])
    assert st is not None and st["url"] == hub["url"]
    assert ensure_hub(hub["state"], "127.0.0.1", hub["port"], repos=SPECS, token=TOKEN, root=root) == hub["url"]
    assert hub_status(hub["state"])["pid"] == st["pid"]
    token_file = hub["state"] / "hub" / "token"
    assert token_file.stat().st_mode & 0o777 == 0o600
    assert TOKEN.encode() not in Path(f"/proc/{st['pid']}/cmdline").read_bytes()

    other = tmp_path / "state"
    port = _free_port()
    url = ensure_hub(other, "127.0.0.1", port, repos=[SPECS[0]], root=root)
    pid = hub_status(other)["pid"]
    url2 = ensure_hub(other, "127.0.0.1", port, repos=[SPECS[0]], root=root, throttle_bps=5 * MB)
    assert url2 == url and hub_status(other)["pid"] != pid  # settings changed: restarted
    assert HubControl(url).settings()["throttle_bps"] == 5 * MB
    assert stop_hub(other) is True
    assert hub_status(other) is None and not Path(f"/proc/{pid}").exists()
    assert stop_hub(other) is False
    with pytest.raises(OSError):
        HubControl(url, timeout=2).health()


def test_only_loopback_or_lab_addresses(tmp_path):
    for ip in ("127.0.0.1", "10.77.0.1"):
        assert check_bind_address(ip) == ip
    for ip in ("0.0.0.0", "192.168.1.10", "10.77.1.1", "8.8.8.8"):
        with pytest.raises(ValueError):
            check_bind_address(ip)
        with pytest.raises(ValueError):
            ensure_hub(tmp_path, ip, _free_port(), repos=[])
    repo = ensure_generated(RepoSpec("a/b", total_size=4096, num_shards=1), tmp_path / "r")
    server = start_in_thread([repo], "127.0.0.1", 0)
    try:
        assert server.control_allowed("127.0.0.1")
        assert not server.control_allowed("10.77.0.11")  # a simulated Spark cannot change the faults
    finally:
        server.shutdown()
        server.server_close()


def test_token_file_and_rate_parsing(tmp_path):
    f = tmp_path / "tok"
    f.write_text(TOKEN + "\n")
    f.chmod(0o644)
    with pytest.raises(PermissionError):
        read_token_file(f)
    f.chmod(0o600)
    assert read_token_file(f) == TOKEN
    assert parse_rate("1000000") == 1_000_000
    assert parse_rate("50M") == 50_000_000
    assert parse_rate("20MiB") == 20 * 2**20
    assert parse_rate("500k") == 500_000


def test_cli_generate_only_with_yaml_spec(tmp_path):
    spec = tmp_path / "repos.yaml"
    spec.write_text("repos:\n  - repo_id: org/cli-model\n    num_shards: 2\n    total_size: 65536\n    gated: true\n"
                    "    config: {num_hidden_layers: 4}\n")
    out = subprocess.run([sys.executable, "-m", "sparklab.hub", "--generate-only", "--spec", str(spec),
                          "--root", str(tmp_path / "root")], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    repo = ensure_generated(RepoSpec("org/cli-model", num_shards=2, total_size=65536, gated=True,
                                     config={"num_hidden_layers": 4}), tmp_path / "root")
    assert f"repo org/cli-model commit {repo.commit}" in out.stdout and "gated" in out.stdout
    assert json.loads(repo.file_path("config.json").read_text())["num_hidden_layers"] == 4
    bad = subprocess.run([sys.executable, "-m", "sparklab.hub", "--bind", "0.0.0.0", "--generate-only"],
                         cwd=REPO, capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "refusing to bind" in bad.stderr


def test_lab_hub_serves_every_catalog_repo_gated_behind_the_lab_token(tmp_path, root):
    """What lab.up starts (ensure_lab_hub): every catalog repo, small, with the catalog's config.json
    values; the catalog's gated repos need the lab token (0600 in the state dir); a second call
    (the next lab.up, the demo) keeps the same hub running."""
    from sparkprov.catalog.load import load_catalog
    from sparklab.hub import catalog_repos, ensure_lab_hub, lab_repos, lab_token

    infos = load_catalog().repos()
    assert {s.repo_id for s in catalog_repos()} == {i.repo for i in infos}
    assert all(s.total_size <= 8 * MiB for s in lab_repos())
    state, port = tmp_path / "state", _free_port()
    state.mkdir()
    os.environ["SPARKPROV_LAB_CACHE"] = str(root.parent / "lab-cache")
    try:
        t0 = time.monotonic()
        url = ensure_lab_hub(state, "127.0.0.1", port)
        cold = time.monotonic() - t0
        pid = hub_status(state)["pid"]
        t0 = time.monotonic()
        assert ensure_lab_hub(state, "127.0.0.1", port) == url
        warm = time.monotonic() - t0
        print(f"\n[timing] lab hub with {len(infos)} catalog repos: cold {cold:.1f}s, again {warm:.2f}s")
        assert hub_status(state)["pid"] == pid  # not restarted
        tok = state / "hf_token"
        assert (tok.stat().st_mode & 0o777) == 0o600 and tok.read_text().strip() == lab_token(state)
        api = HfApi(endpoint=url)
        gated = [i for i in infos if i.gated]
        open_ = [i for i in infos if not i.gated]
        assert gated and open_
        for info in infos:
            files = api.list_repo_files(info.repo, token=lab_token(state))
            assert "config.json" in files and any(f.endswith(".safetensors") for f in files)
        info = gated[0]
        with pytest.raises(GatedRepoError):
            hf_hub_download(info.repo, "config.json", endpoint=url, cache_dir=tmp_path / "c1", token=False)
        p = hf_hub_download(info.repo, "config.json", endpoint=url, cache_dir=tmp_path / "c2",
                            token=lab_token(state))
        cfg = json.loads(Path(p).read_text())
        assert all(cfg[k] == v for k, v in (info.config or {}).items()), (cfg, info.config)
        hf_hub_download(open_[0].repo, "config.json", endpoint=url, cache_dir=tmp_path / "c3", token=False)
    finally:
        os.environ.pop("SPARKPROV_LAB_CACHE", None)
        stop_hub(state)


def _stage_items(hub) -> list:
    """The QWEN repo as stage-weights lists it (sparkprov/staging/hub.py) from the lab hub."""
    from sparkprov.staging.hub import list_stage, spec_for

    return list_stage(spec_for(QWEN), hub["url"], None)[0]


def _download_job(hub, items: list, store: Path, *, in_turn: bool) -> dict:
    """The downloader's job for ITEMS as the download play builds it (weights_download.download_job)."""
    from sparkprov.modules.weights_download import Args, download_job
    from sparkprov.plays.stage import item_args

    args = Args(model=QWEN, items=item_args(items), endpoint=hub["url"], hosts=["spark1"], source="spark1")
    return download_job(args, str(store), items, {}, in_turn=in_turn)


@pytest.mark.parametrize("in_turn", [True, False])
def test_the_pipelined_download_fetches_the_weights_one_after_another(hub, tmp_path, in_turn):
    """stage-weights sends each weight file on to the other hosts as soon as it lands. For that
    the downloader (sparkprov/staging/fetch.py) fetches the weights one at a time (the job's
    large_in_turn): the first shard is ready after a third of the time. Side by side, as without
    a fan-out, all three finish together at the end, leaving nothing to send while the rest
    downloads."""
    from sparkprov.staging import fetch

    items = _stage_items(hub)
    assert sum(i.large for i in items) == 3
    job = _download_job(hub, items, tmp_path / "store", in_turn=in_turn)
    hub["ctl"].set(throttle_bps=4 * MB)
    out = fetch.run_job(job)
    assert out["summary"]["ok"], out
    spans = sorted((r["time"] - r["duration_s"], r["time"]) for r in hub["ctl"].requests()
                   if r["method"] == "GET" and r["path"].endswith(".safetensors") and r["bytes_sent"] > MB)
    assert len(spans) == 3, spans
    overlaps = [a_end - b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:]) if b_start < a_end - 0.05]
    if in_turn:
        assert not overlaps, spans  # each shard's download starts after the one before it ended
    else:
        assert len(overlaps) == 2, spans  # side by side


def test_a_resumed_download_is_verified_by_the_hash_taken_as_it_was_written(hub, tmp_path):
    """fetch.py hashes each chunk as http_get writes it (after hashing the bytes a resumed file
    already had), so a finished file is not read again. A good partial from an earlier run
    resumes and verifies at the first attempt; a partial holding wrong bytes fails its hash and
    is fetched once more, whole."""
    from sparkprov.staging import fetch

    shard = _shard(hub)
    items = [i for i in _stage_items(hub) if i.path == shard.path]
    source = Path(hf_hub_download(QWEN, shard.path, cache_dir=tmp_path / "whole", endpoint=hub["url"], token=False))
    head = source.read_bytes()[: shard.size // 3]
    for prefix, attempts in ((head, 1), (bytes(len(head)), 2)):
        store = tmp_path / f"store-{attempts}"
        staged = store / ".sparkprov" / "staging" / items[0].rel
        staged.parent.mkdir(parents=True)
        staged.write_bytes(prefix)
        (res,) = fetch.run_job(_download_job(hub, items, store, in_turn=True))["results"]
        assert res["ok"] and res["resumed_from"] == len(head) and res["attempts"] == attempts, res
        assert _sha256(store / items[0].rel) == shard.sha256
