"""What a derived image holds (issue 26): the pip installs a recipe's pre_serve would run at every
container start, and Ray for a Ray cluster on an image that ships none, baked once into an image
built FROM the base (modules/derived_image.py builds it; nothing is installed at start).

Pure: which pre_serve steps are plain pip installs (their requirements go into the image, the
rest still run at start, where G24 warns), and the derived image's tag.
"""

from __future__ import annotations

import hashlib
import re

from sparkprov.defaults import RAY_DERIVED_PREFIX, RAY_VERSION

# a derived image without Ray: sparkprov/derived:HASH (one with Ray keeps RAY_DERIVED_PREFIX)
DERIVED_REPO = "sparkprov/derived"
# how a plain install starts; the build always runs the image's `python3 -m pip`
_INSTALLERS = (("pip", "install"), ("pip3", "install"), ("python", "-m", "pip", "install"),
               ("python3", "-m", "pip", "install"), ("uv", "pip", "install"))
# options that change neither what is installed nor where from
_HARMLESS = {"-q", "--quiet", "--no-cache-dir", "--disable-pip-version-check", "--root-user-action=ignore"}
# a requirement specifier naming a package on an index (PEP 508 name, extras, version), not a
# path, URL, wheel file or an option
_REQUIREMENT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(\[[A-Za-z0-9._, -]+\])?\s*([<>=!~]=?[^;@/\\\s]*"
                          r"(,\s*[<>=!~]=?[^;@/\\\s]*)*)?$")


def ray_requirement(version: str = RAY_VERSION) -> str:
    return f"ray=={version}"


def plain_install(cmd: list[str]) -> list[str] | None:
    """The requirements of a pre_serve step that is a plain `pip install REQ...` (also pip3,
    `python[3] -m pip`, `uv pip`) of packages from the index; None for anything else (a shell line,
    a file, a URL, an option such as --index-url or -U: left to run at start)."""
    for prefix in _INSTALLERS:
        if tuple(cmd[:len(prefix)]) == prefix:
            words = [w for w in cmd[len(prefix):] if w not in _HARMLESS]
            if words and all(_REQUIREMENT.match(w) and not w.startswith("-") for w in words):
                return words
            return None
    return None


def baked_requirements(pre_serve: list[list[str]]) -> list[str]:
    """The requirements of the recipe's plain pip installs, in order, each once."""
    out: list[str] = []
    for cmd in pre_serve:
        for req in plain_install(cmd) or []:
            if req not in out:
                out.append(req)
    return out


def start_steps(pre_serve: list[list[str]]) -> list[list[str]]:
    """The pre_serve steps that still run at container start: all but the plain pip installs."""
    return [cmd for cmd in pre_serve if plain_install(cmd) is None]


def derived_tag(base: str, requirements: list[str]) -> str:
    """The derived image's tag: the repository says whether it holds Ray, the tag is a hash of the
    base reference and the sorted requirements. Ray alone keeps the tag images derived before pip
    steps were baked carry (a hash of the base only): their running containers stay as they are."""
    ray = [r for r in requirements if r.startswith("ray==")]
    repo = f"{RAY_DERIVED_PREFIX}{ray[0][5:]}" if ray else DERIVED_REPO
    key = base if requirements == ray and len(ray) == 1 else "\n".join([base, *sorted(set(requirements))])
    return f"{repo}:{hashlib.sha256(key.encode()).hexdigest()[:16]}"


def is_derived(image: str) -> bool:
    return image.startswith((RAY_DERIVED_PREFIX, DERIVED_REPO + ":"))
