"""Which image a recipe's containers run, decided in one place (choose_image), and what a
derived image holds (issue 26).

The image is the one requested (cluster-up --image's, else the recipe's, by the catalog's digest
where it records one), or, where the recipe's pre_serve has plain pip installs or a Ray cluster
runs an image that ships no Ray, an image derived from it with those baked in once (built FROM
the base by modules/derived_image.py; nothing is installed at container start), or, with
cluster-up --pin, the requested one by the registry digest its nodes hold. The choice is part of
every container's recipe hash: a change here restarts containers.

Pure: which pre_serve steps are plain pip installs (their requirements go into the image, the
rest still run at start, where G24 warns), the derived image's tag, and the choice.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from sparkprov.defaults import RAY_DERIVED_PREFIX, RAY_VERSION
from sparkprov.imageref import ImageRef

if TYPE_CHECKING:
    from sparkprov.catalog.load import Catalog
    from sparkprov.catalog.models import ResolvedRecipe

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


@dataclass(frozen=True)
class ImageChoice:
    """The image a recipe's containers run, and why."""

    requested: str  # --image's reference, else the recipe's (the catalog's pinned form where it has one)
    runs: str       # what the containers run: `requested`, the image derived from it, or it by digest
    why: Literal["recipe", "--image", "derived", "pinned"]
    requirements: tuple[str, ...] = ()  # baked into the derived image (Ray first, then the recipe's pip installs)

    @property
    def derived(self) -> bool:
        return self.why == "derived"

    @property
    def ray(self) -> bool:
        """The derived image adds Ray (a Ray cluster on an image that ships none)."""
        return any(r.startswith("ray==") for r in self.requirements)


def choose_image(recipe: ResolvedRecipe, catalog: Catalog, *, override: str | None = None, ray_cluster: bool = False,
                 digest: str | None = None) -> ImageChoice:
    """The image `recipe`'s containers run: `override` (cluster-up --image) or the recipe's image;
    derived from it where its pre_serve pip installs, or for a Ray cluster (`ray_cluster`) on an
    image the catalog knows ships no Ray; else by the registry `digest` its nodes hold (cluster-up
    --pin, known once the image is on them; a derived image has none)."""
    info = catalog.image(recipe.image)
    requested = override or catalog.reference(recipe.image)
    ray = [ray_requirement()] if ray_cluster and info is not None and info.has_ray is False else []
    requirements = ray + baked_requirements(recipe.pre_serve)
    if requirements:
        return ImageChoice(requested, derived_tag(requested, requirements), "derived", tuple(requirements))
    if digest:
        return ImageChoice(requested, ImageRef.parse(requested).by_digest(digest), "pinned")
    return ImageChoice(requested, requested, "--image" if override else "recipe")
