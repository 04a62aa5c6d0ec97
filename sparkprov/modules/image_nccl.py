"""image_nccl: which NCCL the serving image's vLLM loads on this node, the system's or a pip wheel's, and
its version (facts/nccl.py: the probe and its parser), probed once per image build and kept on the node
(~/.cache/sparkprov/nccl/<image ID>.txt), so a rerun reads one file list and runs nothing.

Like image_flags, probing runs a container, so it is a change (never a gather, never in check mode:
check mode says it would probe and reads what is kept). Exports `image_nccl` (image -> NcclRecord);
drift's compare phase with `nccl: true` refuses nodes of one deployment whose images load different
NCCL, naming both.
"""

from __future__ import annotations

from pydantic import Field

from sparkprov.facts.nccl import CACHE_DIR, NcclCache, NcclRecord, cache_file, describe, parse_probe, probe_script
from sparkprov.facts.serving import ImageId
from sparkprov.modules.base import Change, Export, FactView, HostContext, Module, ModuleArgs, Plan


class Args(ModuleArgs):
    images: list[str] = Field(min_length=1)


IMAGE_NCCL: Export[dict[str, NcclRecord]] = Export(
    "image_nccl", dict, "image -> the NCCL its vLLM loads here (source pip|system|none|unknown, version, path)")


class ImageNccl(Module):
    name = "image_nccl"
    Args = Args
    doc = "Probe once per image build which NCCL the image's vLLM loads (system or pip wheel) and its version."

    def needs(self, args: Args, host: HostContext):
        named = {"cache": NcclCache()}
        for i, ref in enumerate(args.images):
            named[f"id{i}"] = ImageId(ref)
        return named

    def plan(self, args: Args, facts: FactView, host: HostContext) -> Plan:
        kept = facts.cache
        found: dict[str, NcclRecord] = {}
        changes, absent = [], []
        for i, ref in enumerate(args.images):
            image_id = (getattr(facts, f"id{i}") or {}).get("id")
            if not image_id or image_id.startswith("("):   # absent, or (check mode) to be pulled first
                absent.append(ref)
                continue
            line = kept.get(cache_file(image_id))
            if line is not None:
                found[ref] = parse_probe(line)
                continue
            changes.append(Change(f"probe which NCCL {ref} loads (once for {image_id.split(':')[-1][:12]})",
                                  probe_script(ref, image_id, host.path(CACHE_DIR)), touches=[facts.fact("cache")],
                                  timeout=300))
        if changes:
            return Plan(changes)
        msg = "; ".join(f"{ref}: {describe(rec)}" for ref, rec in found.items())
        if absent:
            msg = "; ".join(filter(None, [msg, f"not here yet (probed once present): {', '.join(absent)}"]))
        warnings = [f"{ref}: {describe(rec)}" for ref, rec in found.items() if rec["source"] == "unknown"]
        return Plan(msg=msg, warnings=warnings, exports=IMAGE_NCCL(found) if found else {})
