"""docker_image: an image is on this host's dockerd, the same build on every node (G34).

Absent: pulled from its registry, or (source peer, or auto when the pull fails) copied from a
peer that has it, over the fabric: this node runs `ssh PEER docker save IMAGE | docker load`
through the SSH mesh provision set up, so every change is made by the node it changes.
Exports the image ID, and its registry digest where the image came from a registry (cluster-up
--pin runs the deployment by it).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from sparkprov.modules.base import Change, Export, FactView, HostContext, Module, ModuleArgs, Plan
from sparkprov.facts.serving import ImageDigests, ImageId
from sparkprov.imageref import ImageRef
from sparkprov.modules._serving import preflight_export
from sparkprov.transport.shell import cmd



class Args(ModuleArgs):
    image: str
    source: Literal["auto", "registry", "peer"] = "auto"
    peers: list[str] = Field(default_factory=list)  # hosts to copy from (their fabric addresses)
    deployment: str = ""                             # whose preflight exported the peers' addresses
    timeout: float = Field(default=3600, gt=0, le=86400)


IMAGE_IDS: Export[dict[str, str]] = Export("images", dict, "image reference -> its ID on this host")
IMAGE_DIGESTS: Export[dict[str, str]] = Export("image_digests", dict,
                                               "image reference -> its registry digest on this host (sha256:...)")


class DockerImage(Module):
    name = "docker_image"
    Args = Args
    doc = "An image on the host (pulled, or copied from a peer over the fabric); exports its ID."

    def needs(self, args: Args, host: HostContext):
        return {"image": ImageId(args.image), "digests": ImageDigests((args.image,))}

    def plan(self, args: Args, facts: FactView, host: HostContext) -> Plan:
        got = facts.image
        if got.get("error"):
            return Plan.fail(f"{host.name}: docker cannot inspect {args.image}: {got['error']}")
        if got.get("id"):
            digest = held_digest(args.image, facts.digests)
            return Plan(msg=f"{args.image} {got['id'][7:19]}" + (f" ({digest})" if digest else ""),
                        exports={**IMAGE_IDS({args.image: got["id"]}),
                                 **(IMAGE_DIGESTS({args.image: digest}) if digest else {})})
        tries: list[str] = []
        how: list[str] = []
        if args.source in ("auto", "registry"):
            tries.append(cmd("docker", "pull", "-q", args.image) + " >/dev/null")
            how.append("pull")
        if args.source in ("auto", "peer"):
            for peer in [p for p in args.peers if p != host.name]:
                addr = preflight_export(host, peer, args.deployment).get("node_ip") if args.deployment else None
                target = addr or peer
                tries.append(cmd("ssh", "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=yes",
                                 f"{host.user}@{target}" if host.user else target, "docker", "save", args.image)
                             + " | docker load -q >/dev/null")
                how.append(f"copy from {peer}")
        if not tries:
            return Plan.fail(f"{host.name}: {args.image} is absent and no source is allowed "
                             "(fix: --image-source registry, or have a peer hold it)")
        # each way in turn until one works; the last one's error is the one reported
        script = "\n".join(["set +e", "ok=1"] + [f"[ $ok = 0 ] || {{ {t}; ok=$?; }}" for t in tries]
                           + [f'[ $ok = 0 ] || {{ echo "could not get {args.image} ({" / ".join(how)})" >&2; exit 1; }}'])
        # the digests are read back too: a pulled image's is what --pin runs by (an image copied
        # from a peer has none: docker load keeps no registry digest)
        return Plan([Change(f"get {args.image} ({', then '.join(how)})", script,
                            touches=[ImageId(args.image), ImageDigests((args.image,))],
                            timeout=args.timeout, predicts=[(ImageId(args.image), {"id": "(to be pulled)", "error": None})])])


def held_digest(image: str, digests: dict[str, str]) -> str | None:
    """The registry digest of the image a host holds: the one its docker names for the reference's
    repository (ImageDigests), or the reference's own (docker holds REPO@DIGEST by that digest only)."""
    return ImageRef.parse(image).digest or digests.get(image)
