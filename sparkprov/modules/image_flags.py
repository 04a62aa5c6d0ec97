"""image_flags: ask an image's own vLLM which serve options it knows (`vllm serve --help=all`, in
a container with no network), once per image build, and keep the answer on the control machine
(~/.cache/sparkprov/flags, keyed by the image ID), where the linter checks a launch's flags (G4).

Reading what is cached is free; asking runs a container, so it is a change (never a gather, never
in check mode). Exports each image's ID and, where the host has them, its registry digests
(what `invoke images --pin` writes).
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field

from sparkprov.catalog.knownflags import cache_path, default_cache_dir, write_cache
from sparkprov.facts.serving import ImageDigests, ImageId, help_script
from sparkprov.modules.base import Change, Export, FactView, HostContext, Module, ModuleArgs, Plan
from typing import Any, TypedDict



class Args(ModuleArgs):
    images: list[str] = Field(min_length=1)
    ask: bool = True                      # run `vllm serve --help=all` where nothing is cached
    cache_dir: str | None = None          # default: ~/.cache/sparkprov/flags on the control machine
    versions: dict[str, str | None] = Field(default_factory=dict)  # image -> the catalog's vLLM version


class ImageFlags(TypedDict):
    ids: dict[str, str]       # image reference -> its ID here
    digests: dict[str, Any]   # image reference -> its registry digests
    cache: str                # the folder the images' option lists are cached in


IMAGE_FLAGS: Export[ImageFlags] = Export("image_flags", ImageFlags, "the images' IDs and digests, where their options are cached")


class ImageFlags(Module):
    name = "image_flags"
    Args = Args
    doc = "Ask each image's own vLLM for its serve options once per build; cache them on the control machine."

    def needs(self, args: Args, host: HostContext):
        named = {"digests": ImageDigests(tuple(args.images))}
        for i, ref in enumerate(args.images):
            named[f"id{i}"] = ImageId(ref)
        return named

    def plan(self, args: Args, facts: FactView, host: HostContext) -> Plan:
        cache = Path(args.cache_dir) if args.cache_dir else default_cache_dir()
        ids = {ref: (getattr(facts, f"id{i}") or {}).get("id") for i, ref in enumerate(args.images)}
        exports = IMAGE_FLAGS({"ids": {r: i for r, i in ids.items() if i}, "digests": facts.digests,
                               "cache": str(cache)})
        changes = []
        for ref, image_id in ids.items():
            if not image_id or not args.ask or cache_path(cache, image_id).exists():
                continue

            def keep(out: str, ref=ref, image_id=image_id) -> str | None:
                try:
                    write_cache(cache, image_id, out, image=ref, vllm_version=args.versions.get(ref))
                except ValueError as exc:
                    return str(exc)
                return None

            changes.append(Change(f"ask {ref}'s vLLM for its serve options (once for {image_id[7:19]})",
                                  help_script(ref), verify=False, outcome=keep, timeout=300))
        present = sum(1 for i in ids.values() if i)
        return Plan(changes, msg=f"{present} of {len(ids)} image(s) here; their options are cached", exports=exports)
