"""The lab registry and the lab serving image (sparklab.registry, sparklab.image).

Root only. The pull tests run a registry and a dockerd of their own in a temporary network
namespace (loopback only) and remove both at the end; nothing leaves the machine. The first
run builds the base layer (debootstrap + pip: minutes); later runs take it from the lab's cache (/var/cache/sparkprov-lab).
"""
# Engine: none serving: the lab images are built, pushed and inspected (the stand-in's and the real vLLM's).
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import pytest

from sparklab import image, registry
from tests.lab.conftest import missing_prerequisites, require

TOOLS = [registry.REGISTRY_BIN, "/usr/sbin/debootstrap", "/usr/sbin/dockerd", "/usr/bin/docker"]


@pytest.fixture
def image_prerequisites():
    """Root and the Debian tools; without them a skip naming them, under CI a failure."""
    require(missing_prerequisites(TOOLS))


def heavy(fn):
    """Root, the Debian tools, network namespaces: a lab test."""
    fn = pytest.mark.usefixtures("image_prerequisites")(fn)
    return pytest.mark.slow(pytest.mark.lab(fn))

REPO = Path(__file__).resolve().parents[2]
PY = sys.executable
DOCKER = "/usr/bin/docker"  # Debian's 20.10 client (a newer one may shadow it on PATH)
NS_REG = "http://127.0.0.1:5000"
CUSTOM = "ghcr.io/aeon-7/vllm-dflash:latest"  # catalog: entrypoint: custom
IMAGES = ["vllm/vllm-openai:cu130-nightly", "nvcr.io/nvidia/vllm:25.12.post1-py3",
          image.SMOKE_IMAGE, CUSTOM]

# A stand-in for the lab engine, so these tests check the image machinery whether or not
# sparklab/engine/ exists yet; test_real_engine_in_image uses the real one.
FAKE_MAIN = """\
import sys
import huggingface_hub
try:
    import ray
    have = ray.__version__
except ImportError:
    have = "absent"
print("fake-labvllm", " ".join(sys.argv[1:]), "ray", have)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def fake_engine(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("engine") / "engine"
    d.mkdir()
    (d / "__init__.py").write_text("")
    (d / "__main__.py").write_text(FAKE_MAIN)
    return d


@pytest.fixture(scope="module")
def netns():
    """A throwaway network namespace with only loopback; every process in it is ours."""
    name = f"sprkimg{os.getpid()}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        subprocess.run(["ip", "netns", "exec", name, "ip", "link", "set", "lo", "up"], check=True)
        yield name
    finally:
        _kill_ns_pids(name)
        subprocess.run(["ip", "netns", "del", name], check=False)


def _ns_pids(name: str) -> list[int]:
    out = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def _kill_ns_pids(name: str, grace: float = 10.0) -> None:
    for sig in (15, 9):
        for pid in _ns_pids(name):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace
        while _ns_pids(name) and time.monotonic() < deadline:
            time.sleep(0.2)
        if not _ns_pids(name):
            return


def _in_ns(ns: str, code: str, *args: str, timeout: float = 1800) -> str:
    """Run python code inside the namespace (repo importable); return stdout."""
    r = subprocess.run(["ip", "netns", "exec", ns, PY, "-c", code, *args], cwd=REPO,
                       capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"rc={r.returncode}\n{r.stdout}\n{r.stderr}"
    return r.stdout


@pytest.fixture(scope="module")
def ns_state(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("regstate")


@pytest.fixture(scope="module")
def ns_registry(netns, ns_state) -> str:
    """The lab registry (main listener on :5000, alias on :80) inside the namespace."""
    state = ns_state
    _in_ns(netns, "import sys; from pathlib import Path; from sparklab.registry import "
           "ensure_registry; print(ensure_registry(Path(sys.argv[1]), '127.0.0.1', 5000))",
           str(state))
    yield NS_REG
    subprocess.run(["ip", "netns", "exec", netns, PY, "-c",
                    "import sys; from pathlib import Path; from sparklab.registry import "
                    "stop_registry; stop_registry(Path(sys.argv[1]))", str(state)], cwd=REPO)


def _push_in_ns(ns: str, engine_dir: Path, images: list[str]) -> tuple[dict, str, float]:
    t0 = time.monotonic()
    r = subprocess.run(["ip", "netns", "exec", ns, PY, "-m", "sparklab.image",
                        "--registry", NS_REG, "--engine-dir", str(engine_dir), *images],
                       cwd=REPO, capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout), r.stderr, time.monotonic() - t0


@pytest.fixture(scope="module")
def pushed(netns, ns_registry, fake_engine):
    result, log, secs = _push_in_ns(netns, fake_engine, IMAGES)
    print(f"\n[timing] build+push of {len(IMAGES)} images: {secs:.1f}s")
    return result


@pytest.fixture(scope="module")
def ns_dockerd(netns, ns_registry, pushed):
    """A dockerd of our own inside the namespace, configured as a lab host's is."""
    d = Path(tempfile.mkdtemp(prefix="sprkd", dir="/tmp"))  # short: socket paths are limited
    settings = registry.client_settings(ns_registry, image.registry_hostnames(IMAGES))
    (d / "daemon.json").write_text(json.dumps(settings["daemon"]))
    shutil.copyfile("/etc/hosts", d / "hosts")
    with open(d / "hosts", "a") as fh:
        fh.write("".join(line + "\n" for line in settings["etc_hosts"]))
    from sparklab.hosts import cgroup_mount_lines

    cg = cgroup_mount_lines()
    script = "\n".join([
        "set -e", *cg,
        f"mount --bind {d}/hosts /etc/hosts",
        f"exec dockerd --config-file {d}/daemon.json --data-root {d}/data --exec-root {d}/x "
        f"--pidfile {d}/docker.pid -H unix://{d}/docker.sock --bridge=none --iptables=false "
        "--ip-masq=false --userland-proxy=false",
    ])
    # The lab's NVIDIA hook stand-in on dockerd's PATH makes `--gpus all` work (lab-notes).
    (d / "bin").mkdir()
    (d / "bin" / "nvidia-container-runtime-hook").symlink_to(
        REPO / "sparklab/standins/nvidia-container-runtime-hook")
    env = {"PATH": f"{d}/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOME": "/root", "LANG": "C.UTF-8"}
    log = open(d / "dockerd.log", "wb")
    proc = subprocess.Popen(["ip", "netns", "exec", netns, "sh", "-c", script],
                            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                            env=env, start_new_session=True)
    sock = f"unix://{d}/docker.sock"
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                break
            if subprocess.run([DOCKER, "-H", sock, "version"], capture_output=True).returncode == 0:
                break
            time.sleep(0.5)
        if subprocess.run([DOCKER, "-H", sock, "version"], capture_output=True).returncode:
            pytest.fail("dockerd did not start:\n" + (d / "dockerd.log").read_text()[-3000:])
        yield sock
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        # containerd and shims run in the namespace too; end them before removing files.
        for pid in _ns_pids(netns):
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if str(d).encode() in cmd:
                try:
                    os.kill(pid, 15)
                except ProcessLookupError:
                    pass
        time.sleep(1)
        log.close()
        if not image._mounts_under(d):  # mounts lived in the namespace's own mount table
            shutil.rmtree(d, ignore_errors=True)


def _docker(sock: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    r = subprocess.run([DOCKER, "-H", sock, *args], capture_output=True, text=True,
                       timeout=timeout)
    assert r.returncode == 0, f"docker {' '.join(args)}: rc={r.returncode}\n{r.stdout}\n{r.stderr}"
    return r


# ----------------------------------------------------------------------------- tests


@heavy
def test_registry_lifecycle(tmp_path):
    port = _free_port()
    t0 = time.monotonic()
    url = registry.ensure_registry(tmp_path, "127.0.0.1", port, alias=False)
    cold = time.monotonic() - t0
    try:
        assert url == f"http://127.0.0.1:{port}"
        assert registry.registry_running(tmp_path)
        with registry._NO_PROXY.open(url + "/v2/") as resp:
            assert resp.status == 200
            assert resp.headers["Docker-Distribution-Api-Version"] == "registry/2.0"
        assert (tmp_path / "registry" / "storage").is_dir()
        pids = registry._processes(tmp_path / "registry" / "config.yml")
        t0 = time.monotonic()
        assert registry.ensure_registry(tmp_path, "127.0.0.1", port, alias=False) == url
        warm = time.monotonic() - t0
        assert registry._processes(tmp_path / "registry" / "config.yml") == pids  # untouched
        print(f"\n[timing] registry start {cold:.2f}s, ensure when running {warm:.3f}s")
        # Another address: restarted there.
        port2 = _free_port()
        url2 = registry.ensure_registry(tmp_path, "127.0.0.1", port2, alias=False)
        assert url2.endswith(f":{port2}") and registry.registry_running(tmp_path)
        assert len(registry._processes(tmp_path / "registry" / "config.yml")) == 1
    finally:
        registry.stop_registry(tmp_path)
    assert not registry.registry_running(tmp_path)
    assert registry._processes(tmp_path / "registry" / "config.yml") == []



@heavy
def test_a_blob_another_push_uploaded_is_mounted_not_uploaded_again(tmp_path):
    """Two pushes in two processes (the demo's stand-in push, then the real vLLM's, sharing the base
    and torch layers): the second finds the blob in the first's repository and mounts it."""
    import hashlib

    port = _free_port()
    url = registry.ensure_registry(tmp_path, "127.0.0.1", port, alias=False)
    try:
        data = b"a layer both images share" * 1000
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        assert image._Registry(url).push_blob("sparkprov/lab-vllm", digest, len(data), data) == "uploaded"
        second = image._Registry(url)   # a new push: it has seen nothing
        assert second.push_blob("sparkprov/lab-vllm-cpu", digest, len(data), data) == "mounted"
        assert second.has_blob("sparkprov/lab-vllm-cpu", digest)
        assert second.push_blob("sparkprov/lab-vllm-cpu", digest, len(data), data) == "present"
        other = b"a layer of its own"
        assert second.push_blob("sparkprov/smoke", "sha256:" + hashlib.sha256(other).hexdigest(),
                                len(other), other) == "uploaded"
    finally:
        registry.stop_registry(tmp_path)

def test_parse_ref():
    r = image.parse_ref("vllm/vllm-openai:cu130-nightly")
    assert (r.host, r.path, r.tag) == ("docker.io", "vllm/vllm-openai", "cu130-nightly")
    r = image.parse_ref("nvcr.io/nvidia/vllm:25.12.post1-py3")
    assert (r.host, r.path, r.tag) == ("nvcr.io", "nvidia/vllm", "25.12.post1-py3")
    assert image.parse_ref("busybox").path == "library/busybox"
    assert image.parse_ref("busybox").tag == "latest"
    assert image.parse_ref("localhost:5000/a/b:1").host == "localhost:5000"
    assert image.registry_hostnames(IMAGES) == ["ghcr.io", "nvcr.io"]
    pinned = image.parse_ref("vllm/vllm-openai:x@sha256:" + "1" * 64)
    assert (pinned.path, pinned.tag, pinned.pinned) == ("vllm/vllm-openai", "x", "sha256:" + "1" * 64)
    with pytest.raises(image.ImageError):
        image.parse_ref("vllm/vllm-openai@sha256:" + "0" * 64)
    s = registry.client_settings("http://10.77.0.1:5000", ["ghcr.io", "nvcr.io"])
    assert s["etc_hosts"] == ["10.77.0.1 ghcr.io nvcr.io"]
    assert s["daemon"] == {"registry-mirrors": ["http://10.77.0.1:5000"],
                           "insecure-registries": ["10.77.0.1:5000", "ghcr.io", "nvcr.io"]}


@heavy
def test_build_is_cached(fake_engine):
    t0 = time.monotonic()
    first = image.build_images(IMAGES, engine_dir=fake_engine)
    t1 = time.monotonic()
    second = image.build_images(IMAGES, engine_dir=fake_engine)
    t2 = time.monotonic()
    base = image.ensure_base()
    print(f"\n[timing] build (cold if the cache was empty) {t1 - t0:.1f}s, warm {t2 - t1:.2f}s; "
          f"base built in {base.meta['timings_s']}; base layer {base.layer.size / 1e6:.0f} MB "
          f"gzip, {base.meta['rootfs_bytes'] / 1e6:.0f} MB unpacked")
    assert [b.digest for b in first] == [b.digest for b in second]
    assert t2 - t1 < 10
    # The engine layer follows the engine's source.
    (fake_engine / "extra.py").write_text("X = 1\n")
    try:
        third = image.build_images(IMAGES[:1], engine_dir=fake_engine)
    finally:
        (fake_engine / "extra.py").unlink()
    assert third[0].layers[0].digest == first[0].layers[0].digest      # same base
    assert third[0].layers[-2].digest == first[0].layers[-2].digest    # same torch (or base) layer
    assert third[0].layers[-1].digest != first[0].layers[-1].digest    # new engine layer


@heavy
def test_torch_is_its_own_cached_layer_over_the_base(fake_engine, tmp_path):
    base = image.ensure_base()
    base_meta = (base.dir / "meta.json").read_text()
    wheel, why = image.find_torch_wheel(base.python)
    t0 = time.monotonic()
    built = image.build_images(IMAGES[:1], engine_dir=fake_engine)[0]
    t1 = time.monotonic()
    labels = json.loads(built.config)["config"]["Labels"]
    # no wheel: the images are built without torch, and say why (nccl-check shows it)
    without = image.build_images(IMAGES[:1], engine_dir=fake_engine, find_links=[tmp_path])[0]
    variant = [layer.digest for layer in built.layers[-3:-1]]   # no Ray, vLLM version (catalog)
    assert [layer.digest for layer in without.layers] == [base.layer.digest, *variant,
                                                          built.layers[-1].digest]
    no_label = json.loads(without.config)["config"]["Labels"]["org.sparkprov.lab.torch"]
    assert no_label.startswith("absent: no torch wheel for cp311") and str(tmp_path) in no_label
    if wheel is None:
        pytest.skip(f"this machine has no torch wheel ({why}): only the image without torch was checked")
    torch = image.ensure_torch_layer(base)
    print(f"\n[timing] build with the torch layer cached: {t1 - t0:.1f}s; torch layer cold build "
          f"{torch.meta['timings_s']}; {torch.layer.size / 1e6:.0f} MB gzip, "
          f"{torch.meta['unpacked_bytes'] / 1e6:.0f} MB unpacked, {torch.meta['paths']} paths")
    assert [layer.digest for layer in built.layers] == [base.layer.digest, torch.layer.digest,
                                                         *variant, built.layers[-1].digest]
    assert labels["org.sparkprov.lab.torch"] == torch.version and torch.version.startswith("2.")
    assert torch.meta["wheel"] == wheel.name
    # built once: the base is untouched, a second build is the cache
    assert (base.dir / "meta.json").read_text() == base_meta
    t2 = time.monotonic()
    again = image.ensure_torch_layer(base)
    assert again.layer == torch.layer and time.monotonic() - t2 < 15
    with tarfile.open(torch.layer.path, "r:gz") as tar:
        names = {ti.name for ti in tar}
    assert any(n.startswith("opt/venv/lib/python3.11/site-packages/torch/") for n in names)
    assert "opt/venv/bin/torchrun" in names and len(names) == torch.meta["paths"] + torch.meta["whiteouts"]
    assert not any(n.split("/")[0] in ("dev", "proc", "sys", "tmp") and "/" in n for n in names)


@heavy
def test_push_is_idempotent_with_real_entrypoints(netns, ns_registry, pushed, fake_engine):
    assert set(pushed["images"]) == set(IMAGES)
    again, log, secs = _push_in_ns(netns, fake_engine, IMAGES)
    print(f"\n[timing] second ensure (nothing to push): {secs:.2f}s")
    assert again["images"] == pushed["images"]
    assert "pushed" not in log and "uploaded" not in log
    cfgs = json.loads(_in_ns(netns, "import json, sys; from sparklab.image import "
                             "image_config; print(json.dumps({n: image_config(sys.argv[1], n) "
                             "for n in sys.argv[2:]}))", NS_REG, *IMAGES))
    openai = cfgs["vllm/vllm-openai:cu130-nightly"]["config"]
    assert openai["Entrypoint"] == ["vllm", "serve"]
    assert any(e.startswith("PATH=/opt/venv/bin:") for e in openai["Env"])
    assert cfgs["nvcr.io/nvidia/vllm:25.12.post1-py3"]["config"].get("Entrypoint") is None
    catalog = image._load_catalog()
    for name in IMAGES[:2] + IMAGES[3:]:
        kind = image.image_kind(image.parse_ref(name), catalog)
        assert cfgs[name]["config"].get("Entrypoint") == image.ENTRYPOINTS[kind], name
        assert cfgs[name]["config"]["Labels"]["org.sparkprov.lab.entrypoint"] == kind
    assert cfgs[image.SMOKE_IMAGE]["config"]["Cmd"] == ["sh"]
    assert len(cfgs[image.SMOKE_IMAGE]["rootfs"]["diff_ids"]) == 1


@heavy
def test_docker_pull_through_mirror_and_alias(ns_dockerd, pushed, ns_state):
    sock = ns_dockerd
    for name in IMAGES:
        t0 = time.monotonic()
        _docker(sock, "pull", name, timeout=600)
        print(f"\n[timing] docker pull {name}: {time.monotonic() - t0:.1f}s")
        got = json.loads(_docker(sock, "image", "inspect", name).stdout)[0]
        assert got["RepoDigests"], got
        assert any(d.endswith(pushed["images"][name]) for d in got["RepoDigests"])
    # Docker Hub names came through the mirror (main listener), nvcr.io through the alias.
    def docker_lines(log: str) -> list[str]:
        return [ln for ln in log.splitlines() if '"docker/' in ln and "/v2/" in ln]

    main_log = docker_lines((ns_state / "registry" / "registry.log").read_text())
    alias_log = docker_lines((ns_state / "registry" / "alias.log").read_text())
    assert any("/v2/vllm/vllm-openai/manifests/cu130-nightly " in ln for ln in main_log)
    assert any("/v2/nvidia/vllm/manifests/25.12.post1-py3 " in ln for ln in alias_log)
    assert not any("/v2/nvidia/" in ln for ln in main_log)
    assert any("/v2/aeon-7/vllm-dflash/manifests/latest " in ln for ln in alias_log)
    assert not any("/v2/vllm/" in ln for ln in alias_log)
    ep = json.loads(_docker(sock, "image", "inspect", IMAGES[0]).stdout)[0]["Config"]
    assert ep["Entrypoint"] == ["vllm", "serve"]
    size = json.loads(_docker(sock, "image", "inspect", IMAGES[0]).stdout)[0]["Size"]
    print(f"[size] {IMAGES[0]} in dockerd: {size / 1e6:.0f} MB")

    # vllm/vllm-openai: the entrypoint reaches the engine stand-in with "serve ...".
    # A stock image of vLLM >= 0.19 has no Ray (like the real one).
    out = _docker(sock, "run", "--rm", "--network", "none", IMAGES[0], "--help").stdout
    assert out.startswith("fake-labvllm serve --help ray absent"), out
    # The venv is the rootfs's own python, first on PATH.
    out = _docker(sock, "run", "--rm", "--network", "none", "--entrypoint", "python3", IMAGES[0],
                  "-c", "import sys; print(sys.executable, sys._base_executable)").stdout
    assert out.split()[0] == "/opt/venv/bin/python3", out
    assert out.split()[1].startswith("/usr/bin/python3"), out
    # NGC name: no entrypoint, a full command.
    out = _docker(sock, "run", "--rm", "--network", "none", IMAGES[1], "vllm", "serve", "m").stdout
    assert out.startswith("fake-labvllm serve m"), out
    # NGC's images ship no Ray: `ray` is not found (127) and `import ray` fails.
    r = subprocess.run([DOCKER, "-H", sock, "run", "--rm", "--network", "none", IMAGES[1], "sh", "-c",
                        "ray --version"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 127 and "not found" in r.stderr, r
    r = subprocess.run([DOCKER, "-H", sock, "run", "--rm", "--network", "none", IMAGES[1], "python3", "-c",
                        "import ray"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "No module named 'ray'" in r.stderr, r
    # A third-party build keeps its Ray: ray start / status work inside.
    out = _docker(sock, "run", "--rm", "--network", "none", "--shm-size", "512m", "--entrypoint", "sh",
                  CUSTOM, "-c", "ray start --head --node-ip-address 127.0.0.1 --num-cpus 1 "
                  "--num-gpus 1 --disable-usage-stats >/dev/null && ray status && ray stop",
                  timeout=300).stdout
    assert "GPU" in out, out
    # ghcr.io through the alias too; a "custom" image's own entrypoint is not vLLM's.
    kind = image.image_kind(image.parse_ref(CUSTOM), image._load_catalog())
    if kind == "custom":
        r = subprocess.run([DOCKER, "-H", sock, "run", "--rm", "--network", "none", CUSTOM,
                            "serve", "m"], capture_output=True, text=True, timeout=120)
        assert r.returncode == 64 and "--entrypoint" in r.stderr, r
        out = _docker(sock, "run", "--rm", "--network", "none", "--entrypoint", "vllm", CUSTOM,
                      "serve", "m").stdout
        assert out.startswith("fake-labvllm serve m"), out
    # The smoke image.
    out = _docker(sock, "run", "--rm", "--network", "none", "--gpus", "all", image.SMOKE_IMAGE,
                  "sh", "-c", "echo smoke-ok; id -u").stdout
    assert out.split() == ["smoke-ok", "0"], out


@pytest.mark.skipif(not (image.ENGINE_DIR / "__main__.py").exists(),
                    reason="sparklab/engine/ not written yet")
@heavy
def test_real_engine_in_image(netns, ns_registry, ns_dockerd):
    name = "vllm/vllm-openai:sparkprov-engine-test"
    result, _log, _secs = _push_in_ns(netns, image.ENGINE_DIR, [name])
    _docker(ns_dockerd, "pull", name, timeout=600)
    r = subprocess.run([DOCKER, "-H", ns_dockerd, "run", "--rm", "--network", "none", name,
                        "--help"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "usage" in (r.stdout + r.stderr).lower()


def test_which_lab_images_have_ray():
    """Each catalog image maps to the lab image with Ray or the one without, as the real one is."""
    catalog = image._load_catalog()
    names = image.default_images(catalog)
    assert image.RAY_IMAGE in names and image.NORAY_IMAGE in names

    def has(name):
        return image.has_ray(image.parse_ref(name), catalog)
    assert has(image.RAY_IMAGE) and not has(image.NORAY_IMAGE)
    for name in names:
        ref = image.parse_ref(name)
        if image.image_kind(ref, catalog) == "smoke":
            continue
        img = catalog.image(name)
        if ref.host == "nvcr.io":
            assert not has(name), name            # NVIDIA ships no Ray
        elif ref.path == "vllm/vllm-openai" and img is not None and img.vllm_at_least("0.19") is not False:
            assert not has(name), name            # stock >= v0.19 (or a newer moving tag)
    assert not has("nvcr.io/nvidia/vllm:26.04-py3")
    assert has("ghcr.io/aeon-7/vllm-dflash:latest")
    old = image.parse_ref("vllm/vllm-openai:gemma4")    # v0.18.2: before Ray became optional
    assert catalog.image("vllm/vllm-openai:gemma4").vllm == "0.18.2" and image.has_ray(old, catalog)


def test_lab_image_versions_follow_the_catalog():
    assert image.catalog_version("0.19.0") == "0.19.0"
    assert image.catalog_version("0.23") == "0.23.0"
    assert image.catalog_version(">=0.21") == "0.21.0"
    assert image.catalog_version("<0.15.1") == "0.15.0"
    assert image.catalog_version("<0.15.0") == "0.14.0"
    assert image.catalog_version(None) is None


@heavy
def test_no_ray_layer_whites_out_exactly_rays_files(fake_engine):
    base = image.ensure_base()
    layer = image.noray_layer(base)
    with tarfile.open(layer.path, "r:gz") as tar:
        names = sorted(ti.name for ti in tar if ti.isfile())
    site = f"opt/venv/lib/python{base.python}/site-packages"
    assert f"{site}/.wh.ray" in names and "opt/venv/bin/.wh.ray" in names
    assert any(n.startswith(f"{site}/.wh.ray-") and n.endswith(".dist-info") for n in names)
    # nothing but whiteouts, and none of ray's dependencies
    assert all(n.rsplit("/", 1)[-1].startswith(".wh.") for n in names)
    assert not any("msgpack" in n or "protobuf" in n for n in names)
    built = {b.ref.name: b for b in image.build_images(
        ["nvcr.io/nvidia/vllm:26.04-py3", image.RAY_IMAGE], engine_dir=fake_engine)}
    ngc = json.loads(built["nvcr.io/nvidia/vllm:26.04-py3"].config)["config"]["Labels"]
    assert ngc["org.sparkprov.lab.ray"] == "absent" and ngc["org.sparkprov.lab.vllm"] == "0.19.0"
    assert layer.digest in [x.digest for x in built["nvcr.io/nvidia/vllm:26.04-py3"].layers]
    ray = json.loads(built[image.RAY_IMAGE].config)["config"]["Labels"]
    assert ray["org.sparkprov.lab.ray"] == image.RAY_VERSION
