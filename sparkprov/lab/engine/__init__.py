"""The lab engine: a stand-in for vLLM that behaves like vLLM wherever sparkprov touches it.

Run as ``python3 -m sparkprov.lab.engine serve MODEL [flags]`` (the lab image's ``vllm``
wrapper does exactly that). Standard library only, plus ``ray`` for tensor parallelism with
Ray (an image without Ray fails there as vLLM does).
sparkprov's product code never imports this package.

VERSION is the vLLM version this engine claims (``vllm --version``, ``/version``, the start-up
log). A lab image carries its catalog image's version in the file ``image_version`` next to this
one (see sparkprov.lab.image); without it the engine claims DEFAULT_VERSION. Which flags the
engine accepts follows the version (cli.FLAG_SINCE), as with the real vLLM.
"""
import os as _os

DEFAULT_VERSION = "0.19.0"


def _image_version() -> str:
    path = _os.path.join(_os.path.dirname(__file__), "image_version")
    try:
        with open(path) as fh:
            v = fh.read().strip()
    except OSError:
        return DEFAULT_VERSION
    return v or DEFAULT_VERSION


VERSION = _image_version()


def version_tuple(v: str = VERSION) -> tuple:
    """(major, minor, patch) of a version string ("0.19.0", "0.23", "0.11.0rc1")."""
    import re
    out = [int(m) for m in re.findall(r"^(\d+)|(?<=\.)(\d+)", v) for m in m if m][:3]
    return tuple(out + [0] * (3 - len(out)))
