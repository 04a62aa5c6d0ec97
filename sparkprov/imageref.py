"""Image references (REGISTRY/REPOSITORY[:TAG][@sha256:DIGEST]): the one parser of them.

Every part of sparkprov that needs a piece of a reference (its tag, its digest, the repository
docker names in RepoDigests) asks `ImageRef.parse`; `IMAGE_RE` is what a reference given by a
user may look like (the catalog, --image, the inventory's *_image vars).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

IMAGE_RE = re.compile(r"^[a-z0-9][a-z0-9._/-]*(:[A-Za-z0-9_.-]+)?(@sha256:[0-9a-f]{64})?\Z")  # \Z: `$` lets a trailing newline through

# the prefixes docker leaves out of Docker Hub's repositories in RepoDigests
_HUB_PREFIXES = ("docker.io/library/", "docker.io/", "index.docker.io/")


@dataclass(frozen=True)
class ImageRef:
    name: str                   # REGISTRY/REPOSITORY as written: no tag, no digest
    tag: str | None = None      # after the last ':' of the last path part (a registry's port is not a tag)
    digest: str | None = None   # sha256:..., after '@'

    @classmethod
    def parse(cls, ref: str) -> ImageRef:
        named, at, digest = ref.partition("@")
        head, slash, last = named.rpartition("/")
        last, colon, tag = last.partition(":")
        return cls(head + slash + last, tag if colon else None, digest if at else None)

    @property
    def tagged(self) -> str:
        """The reference without its digest (REPOSITORY[:TAG]): how the catalog's images are keyed."""
        return self.name + (f":{self.tag}" if self.tag is not None else "")

    @property
    def repository(self) -> str:
        """The repository as docker names it in RepoDigests (no tag, no digest; Docker Hub's
        docker.io/ and library/ prefixes dropped)."""
        name = self.name
        for prefix in _HUB_PREFIXES:
            if name.startswith(prefix):
                name = name[len(prefix):]
                break
        return name.removeprefix("library/")

    def by_digest(self, digest: str) -> str:
        """REPOSITORY@DIGEST: this image by a registry digest; a reference that carries a digest
        already is its own."""
        return str(self) if self.digest else f"{self.repository}@{digest}"

    def __str__(self) -> str:
        return self.tagged + (f"@{self.digest}" if self.digest is not None else "")
