"""The catalog's images as a table, and pinning them to digests on a host (G4).

Pure functions. What a host runs for them (`docker image inspect` for the digests a tag resolved
to, `vllm serve --help=all` inside an image for its options) lives with the other serving facts
(sparkprov/facts/serving.py); `invoke images --host` and cluster-up run it as plays on the engine
(the image_flags module).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import yaml

from sparkprov.catalog.knownflags import recorded_set_name
from sparkprov.imageref import ImageRef

if TYPE_CHECKING:
    from sparkprov.catalog.load import Catalog

@dataclass(frozen=True)
class ImageRow:
    ref: str
    vllm: str
    digest: str
    executors: str
    ray: str
    gb10: str
    flag_set: str
    used_by: tuple[str, ...]

    def cells(self) -> tuple[str, ...]:
        return (self.ref, self.vllm, self.digest, self.executors, self.ray, self.gb10, self.flag_set,
                ",".join(self.used_by))


def _yes_no(v: bool | None) -> str:
    return "?" if v is None else ("yes" if v else "no")


def image_rows(catalog: "Catalog") -> list[ImageRow]:
    """One row per catalog image: vLLM version, digest (or `unpinned`), multi-node executors."""
    used: dict[str, set[str]] = {}
    for r in catalog.recipes.values():
        used.setdefault(ImageRef.parse(r.image).tagged, set()).add(r.alias)
    rows = []
    for img in catalog.image_table.values():
        rows.append(ImageRow(ref=img.ref, vllm=img.vllm or "?", digest=img.digest or "unpinned",
                             executors=",".join(img.executors) or "single-node only (as far as known)",
                             ray=_yes_no(img.has_ray), gb10=_yes_no(img.gb10),
                             flag_set=recorded_set_name(img) or "none", used_by=tuple(sorted(used.get(img.ref, ())))))
    return rows


def pinned_images_yaml(catalog: "Catalog", digests: dict[str, str], *, host: str) -> str:
    """A user recipe file (`images:` only) with each resolved image pinned, its source saying where
    the digest came from. Load it with `--recipes FILE` (later files override the package's)."""
    out = []
    for ref, digest in sorted(digests.items()):
        img = catalog.image_table.get(ref)
        if img is None:
            continue
        data = img.model_dump(mode="json", exclude_none=True, exclude_defaults=True)
        data.update(ref=img.ref, entrypoint=img.entrypoint, source=str(img.source), digest=digest,
                    digest_source=f"user images --pin: docker image inspect on {host}")
        out.append(data)
    return ("# Written by `invoke images --pin`: images pinned to the digests their tags resolved to.\n"
            + yaml.safe_dump({"images": out}, sort_keys=False, allow_unicode=True))

