"""ray_image: an image that can run a Ray cluster, derived once from a deployment's image that
ships no Ray (stock vllm/vllm-openai since v0.19, NGC's vLLM images: multinode-notes, 001 §6).

Never `pip install` at container start (slow, unpinned, fatal on a node that boots without
internet): the control machine fetches Ray's wheels from the package index for the image's
Python and architecture (once, cached), ships them as the build context, and this host builds
`FROM` the image's ID with `pip install --no-index`. The result is tagged by the base image and
the Ray version and labelled with the base's ID; a base that changed is built again. The other
nodes copy it from this one (docker_image, source peer).
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tarfile
from pathlib import Path

from pydantic import Field

from sparkprov.defaults import RAY_DERIVED_PREFIX, RAY_VERSION
from sparkprov.facts.serving import ImageId, ImageLabel
from sparkprov.modules.base import Change, Export, FactView, HostContext, Module, ModuleArgs, Plan
from sparkprov.transport.shell import cmd, quote

BASE_LABEL = "org.sparkprov.ray.base"
CACHE = Path(os.environ.get("SPARKPROV_CACHE", Path.home() / ".cache" / "sparkprov")) / "wheels"
# pip's platform tags per machine: manylinux wheels built on glibc 2.17 or 2.28 both run on a Spark
PLATFORMS = {"aarch64": ["manylinux2014_aarch64", "manylinux_2_17_aarch64", "manylinux_2_28_aarch64"],
             "x86_64": ["manylinux2014_x86_64", "manylinux_2_17_x86_64", "manylinux_2_28_x86_64"]}


def derived_tag(base: str, ray_version: str = RAY_VERSION) -> str:
    return f"{RAY_DERIVED_PREFIX}{ray_version}:{hashlib.sha256(base.encode()).hexdigest()[:16]}"


class Args(ModuleArgs):
    base: str
    ray_version: str = RAY_VERSION
    timeout: float = Field(default=3600, gt=0, le=86400)


def fetch_wheels(ray_version: str, python: str, machine: str, cache: Path = CACHE) -> Path:
    """Ray and what it needs, as wheels for that Python and machine, in a tar (cached by all three)."""
    if machine not in PLATFORMS:
        raise ValueError(f"no Ray wheels for machine {machine!r}")
    if not (python.isdigit() and len(python) in (2, 3)):
        raise ValueError(f"unexpected Python version {python!r}")
    folder = cache / f"ray-{ray_version}-cp{python}-{machine}"
    tar = folder.with_suffix(".tar")
    if tar.exists():
        return tar
    folder.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", "pip", "download", "--quiet", "--only-binary=:all:", "--dest", str(folder),
            "--python-version", python, "--implementation", "cp", f"ray=={ray_version}"]
    for plat in PLATFORMS[machine]:
        argv += ["--platform", plat]
    res = subprocess.run(argv, capture_output=True, text=True, timeout=1800)
    if res.returncode != 0:
        raise ValueError("pip download of Ray failed: " + ((res.stderr or res.stdout).strip().splitlines() or ["?"])[-1])
    part = tar.with_suffix(".part")
    with tarfile.open(part, "w") as tf:
        for whl in sorted(folder.glob("*.whl")):
            tf.add(whl, arcname=f"wheels/{whl.name}")
    part.replace(tar)
    return tar


RAY_IMAGE: Export[dict[str, str]] = Export("ray_image", dict, "base image -> the Ray image derived from it here")


class RayImage(Module):
    name = "ray_image"
    Args = Args
    doc = "An image with Ray, derived once from one without (wheels from the control machine; no pip at start)."

    def needs(self, args: Args, host: HostContext):
        return {"base": ImageId(args.base), "derived": ImageLabel(derived_tag(args.base, args.ray_version), BASE_LABEL)}

    def plan(self, args: Args, facts: FactView, host: HostContext) -> Plan:
        tag = derived_tag(args.base, args.ray_version)
        base = facts.base
        if not base.get("id"):
            if host.check:
                return Plan([Change(f"build {tag}: {args.base} + Ray {args.ray_version} (once the base is here)", ":")])
            return Plan.fail(f"{host.name}: {args.base} is not on the host to build from")
        have = facts.derived
        exports = RAY_IMAGE({args.base: tag})
        if have.get("id") and have.get("label") == base["id"]:
            return Plan(msg=f"{tag} {have['id'][7:19]}: {args.base} with Ray {args.ray_version}", exports=exports)
        found: dict[str, str] = {}

        def inspect(out: str) -> str | None:
            words = out.split()
            if len(words) != 2:
                return f"cannot tell the Python of {args.base}: {out.strip()[-200:]!r}"
            found["python"], found["machine"] = words
            return None

        # the image's own Python and machine decide which wheels fit (a container, not a gather)
        probe = Change(f"read {args.base}'s Python and machine",
                       cmd("docker", "run", "--rm", "--network", "none", "--entrypoint", "python3", base["id"], "-c",
                           "import sys, platform; print('%d%d' % sys.version_info[:2], platform.machine())"),
                       verify=False, outcome=inspect, timeout=300)
        remote = f".cache/sparkprov/ray-context-{tag.split(':')[1]}.tar"

        def prepare() -> list[tuple[str, str]]:
            return [(str(fetch_wheels(args.ray_version, found["python"], found["machine"])), remote)]

        dockerfile = "\n".join([
            f"FROM {base['id']}",
            "COPY wheels /tmp/sparkprov-wheels",
            "RUN python3 -m pip install --no-cache-dir --no-index --find-links /tmp/sparkprov-wheels "
            f"ray=={args.ray_version} && rm -rf /tmp/sparkprov-wheels && ray --version",
            f"LABEL {BASE_LABEL}={base['id']} org.sparkprov.ray.version={args.ray_version}",
        ]) + "\n"
        build = "\n".join([
            "c=$(mktemp -d)", "trap 'rm -rf \"$c\"' EXIT",
            f'tar -xf "$HOME"/{quote(remote)} -C "$c"', f'rm -f "$HOME"/{quote(remote)}',
            f"cat > \"$c/Dockerfile\" <<'SPARKPROV_DOCKERFILE'\n{dockerfile}SPARKPROV_DOCKERFILE",
            cmd("docker", "build", "--network", "none", "-q", "-t", tag) + ' "$c" >/dev/null',
        ])
        return Plan([probe, Change(f"build {tag}: {args.base} + Ray {args.ray_version} (wheels from this machine, "
                                   "no pip at container start)", build, touches=[facts.fact("derived")],
                                   timeout=args.timeout, prepare=prepare,
                                   predicts=[(facts.fact("derived"), {"id": "(built)", "label": base["id"]})])],
                    exports=exports)
