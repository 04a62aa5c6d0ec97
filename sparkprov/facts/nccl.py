"""Which NCCL a serving image's vLLM loads: the system's or a pip wheel's (issue 25, the drift gate).

NGC images (nvcr.io/nvidia/vllm:*) link the system NCCL (`libnccl.so.2` under /usr/lib/<arch>-linux-gnu,
torch built against it); images built from PyPI wheels carry `nvidia-nccl-cu12`/`nvidia-nccl-cu13`
(`.../site-packages/nvidia/nccl/lib/libnccl.so.2`), which torch loads. What decides is what the image's
own Python loads, so PROBE runs there (`docker run --rm --network none --entrypoint python3 IMAGE -c
PROBE`, no GPU needed): it imports torch, opens NCCL as vLLM's pynccl does (`VLLM_NCCL_SO_PATH`, else
`libnccl.so.2` once torch is imported: vllm/distributed/device_communicators/pynccl_wrapper.py,
find_nccl_library), asks the library its version (ncclGetVersion) and torch its own
(torch.cuda.nccl.version()), reads the mapped libnccl paths from /proc/self/maps and the installed
nvidia-nccl-* distributions (importlib.metadata), and prints one line: MARKER and a JSON object. It
never raises: what failed is in the JSON.

`parse_probe` turns that line (or what the container printed instead) into a record, pure:
"pip" (the library mapped from site-/dist-packages/nvidia/nccl), "system" (from /usr/lib or /usr/local),
"none" (a CPU build of torch: no NCCL, the lab's image), "unknown" (the probe failed; `why` says why).

The answer is the image build's: it is kept on the node, one file per image ID
(~/.cache/sparkprov/nccl/<id>.txt), read by NcclCache, so a rerun probes nothing.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Literal, TypedDict

from sparkprov.facts.docker_run import reporting_cause
from sparkprov.facts.base import Fact, ShellCtx
from sparkprov.transport.shell import cmd, quote

MARKER = "sparkprov-nccl"
FAILED = "sparkprov-nccl-failed"   # the container did not run the probe (no python3 in it): rc, last line
CACHE_DIR = "~/.cache/sparkprov/nccl"

# Runs in the image's python3 (any version from 3.8); stdlib and torch only.
PROBE = r'''
import json, os, sys
r = {"python": sys.executable, "errors": []}
try:
    from importlib import metadata
    r["dists"] = {d.metadata["Name"].lower(): d.version for d in metadata.distributions()
                  if (d.metadata["Name"] or "").lower().startswith("nvidia-nccl")}
except Exception as e:
    r["errors"].append("importlib.metadata: %s: %s" % (type(e).__name__, e))
r["so_path"] = os.environ.get("VLLM_NCCL_SO_PATH") or None
if r["so_path"]:
    r["so_real"] = os.path.realpath(r["so_path"])
try:
    import torch
    r["torch"] = torch.__version__
    r["torch_cuda"] = torch.version.cuda
    if torch.version.cuda is not None:
        try:
            v = torch.cuda.nccl.version()
            r["torch_nccl"] = list(v) if isinstance(v, tuple) else v
        except Exception as e:
            r["errors"].append("torch.cuda.nccl.version: %s: %s" % (type(e).__name__, e))
        try:
            import ctypes
            lib = ctypes.CDLL(r["so_path"] or "libnccl.so.2")
            code = ctypes.c_int()
            if lib.ncclGetVersion(ctypes.byref(code)) == 0:
                r["lib_version"] = code.value
        except Exception as e:
            r["errors"].append("open NCCL: %s: %s" % (type(e).__name__, e))
except Exception as e:
    r["errors"].append("import torch: %s: %s" % (type(e).__name__, e))
try:
    with open("/proc/self/maps") as f:
        seen = []
        for line in f:
            p = line.split()[-1] if len(line.split()) >= 6 else ""
            if "/libnccl" in p and p not in seen:
                seen.append(p)
    r["maps"] = seen
except Exception as e:
    r["errors"].append("/proc/self/maps: %s: %s" % (type(e).__name__, e))
print("''' + MARKER + r''' " + json.dumps(r, sort_keys=True))
'''

Source = Literal["pip", "system", "none", "unknown"]


class NcclRecord(TypedDict):
    source: Source
    version: str | None   # "2.27.3": the loaded library's own, else torch's
    path: str | None      # the libnccl the image's vLLM loads
    wheel: str | None     # "nvidia-nccl-cu12 2.27.3": an nvidia-nccl-* distribution installed in the image
    torch: str | None     # the image's torch version
    why: str | None       # unknown: what failed; otherwise a note (a wheel installed but not loaded)


_PIP = re.compile(r"/(site|dist)-packages/nvidia/nccl/")


def nccl_version(code: Any) -> str | None:
    """"2.27.3" from ncclGetVersion's code (X*10000+Y*100+Z since NCCL 2.9, X*1000+Y*100+Z before) or
    torch.cuda.nccl.version() (a tuple, (2, 27, 3) or with a suffix; an int in old torch)."""
    if isinstance(code, (list, tuple)):
        nums = [str(x) for x in code[:3] if isinstance(x, int)]
        return ".".join(nums) if len(nums) == 3 else None
    if isinstance(code, int) and not isinstance(code, bool) and code > 0:
        if code >= 20900:
            return f"{code // 10000}.{code % 10000 // 100}.{code % 100}"
        return f"{code // 1000}.{code % 1000 // 100}.{code % 100}"
    return None


def classify_path(path: str) -> Source | None:
    """pip: inside an nvidia-nccl-* wheel's tree (site-packages, or dist-packages as Debian's pip
    installs); system: anywhere else under /usr/lib or /usr/local; None: neither."""
    if _PIP.search(path):
        return "pip"
    if path.startswith(("/usr/lib/", "/usr/local/", "/lib/")):
        return "system"
    return None


def _record(source: Source, *, version=None, path=None, wheel=None, torch=None, why=None) -> NcclRecord:
    return {"source": source, "version": version, "path": path, "wheel": wheel, "torch": torch, "why": why}


def parse_probe(out: str) -> NcclRecord:
    """The record of what PROBE printed (the last MARKER line), or "unknown" saying why. Pure."""
    lines = [ln.strip() for ln in out.splitlines() if ln.strip()]
    failed = [ln for ln in lines if ln.startswith(FAILED + " ")]
    found = [ln for ln in lines if ln.startswith(MARKER + " ")]
    if not found:
        said = failed[-1][len(FAILED) + 1:] if failed else (lines[-1] if lines else "nothing")
        return _record("unknown", why=f"the probe did not run in the image's python3: {said[:300]}")
    try:
        r = json.loads(found[-1][len(MARKER) + 1:])
        if not isinstance(r, dict):
            raise ValueError("not an object")
    except ValueError as exc:
        return _record("unknown", why=f"the probe's output is not JSON: {exc}")
    errors = [str(e) for e in r.get("errors") or []]
    dists = r.get("dists") or {}
    wheel = ", ".join(f"{n} {v}" for n, v in sorted(dists.items())) or None
    torch = r.get("torch")
    if torch is None:
        why = next((e for e in errors if e.startswith("import torch")), "torch is not in the image's python3")
        return _record("unknown", wheel=wheel, why=f"{why} (python {r.get('python')})")
    if r.get("torch_cuda") is None:
        return _record("none", wheel=wheel, torch=torch, why="a CPU build of torch: no NCCL")
    maps = [str(p) for p in r.get("maps") or []]
    wanted = r.get("so_real") or r.get("so_path")
    # the library vLLM opens: VLLM_NCCL_SO_PATH where set (resolved: it may be a link), else the one
    # torch mapped (libnccl.so.2 resolves to it once torch is imported)
    path = (wanted if wanted in maps else None) or (maps[0] if maps else None)
    version = nccl_version(r.get("lib_version")) or nccl_version(r.get("torch_nccl"))
    if path is None:
        return _record("unknown", version=version, wheel=wheel, torch=torch,
                       why="torch is a CUDA build but no libnccl is mapped" + (f" ({'; '.join(errors)})" if errors else ""))
    source = classify_path(path)
    if source is None:
        return _record("unknown", version=version, path=path, wheel=wheel, torch=torch,
                       why=f"{path} is neither a pip wheel's (site-packages/nvidia/nccl) nor the system's (/usr/lib, /usr/local)")
    note = []
    if len(maps) > 1:
        note.append("also mapped: " + ", ".join(p for p in maps if p != path))
    if source == "system" and wheel and not any(classify_path(p) == "pip" for p in maps):
        note.append(f"{wheel} is installed but not loaded")
    elif source == "system" and wheel:
        # VLLM_NCCL_SO_PATH names the system's: vLLM's own communicator uses it, torch its wheel
        # (captured on an H100 host: tests/fixtures/nccl/h100-probes.txt)
        note.append(f"torch loads {wheel}, vLLM the library VLLM_NCCL_SO_PATH names")
    return _record(source, version=version, path=path, wheel=wheel, torch=torch, why="; ".join(note) or None)


def describe(rec: NcclRecord | None) -> str:
    """`pip NCCL 2.27.3 (nvidia-nccl-cu12 2.27.3)`, `system NCCL 2.28.9`, `no NCCL (...)`, `NCCL unknown (...)`."""
    if not rec:
        return "NCCL not probed"
    src = rec.get("source")
    if src == "none":
        return f"no NCCL ({rec.get('why')})"
    if src == "unknown":
        return f"NCCL unknown ({rec.get('why')})"
    text = f"{src} NCCL {rec.get('version') or '(version unknown)'}"
    if src == "pip" and rec.get("wheel"):
        text += f" ({rec['wheel']})"
    elif rec.get("path"):
        text += f" ({rec['path']})"
    return text


def probe_script(image: str, image_id: str, cache_dir: str) -> str:
    """POSIX sh: run PROBE in the image (no network, no GPU) and keep what it printed on the node, one
    file per image ID in `cache_dir` (CACHE_DIR, expanded). A container that ran (the probe, or an image with no python3: rc 126/127) is the
    build's answer and is kept; docker's own failure (rc 125: the daemon, the image gone) is not."""
    f = cache_file(image_id)
    run = cmd("docker", "run", "--rm", "--network", "none", "--entrypoint", "python3", image, "-c", PROBE)
    return (f'd={quote(cache_dir)}; f="$d/{f}"\n'
            # (under the engine's `set -e` a failed substitution ends the script: `|| rc=$?` keeps it)
            f"rc=0; out=$({reporting_cause(run)} 2>&1) || rc=$?\n"
            'printf \'%s\\n\' "$out"\n'
            '[ "$rc" = 125 ] && exit 125\n'
            'mkdir -p "$d" || exit 1\n'
            f'line=$(printf \'%s\\n\' "$out" | grep \'^{MARKER} \' | tail -n 1)\n'
            f'[ -n "$line" ] || line="{FAILED} rc=$rc $(printf \'%s\\n\' "$out" | tail -n 1)"\n'
            'printf \'%s\\n\' "$line" > "$f.tmp" && mv -f "$f.tmp" "$f"\n')


def cache_file(image_id: str) -> str:
    return image_id.split(":", 1)[-1][:64] + ".txt"


@dataclass(frozen=True)
class NcclCache(Fact):
    """What the probe answered for each image build on this node: {cache file name: its line}."""

    def command(self, sh: ShellCtx) -> str:
        return (f"d={sh.path(CACHE_DIR)}\n"
                'for f in "$d"/*.txt; do [ -f "$f" ] && printf \'%s %s\\n\' "${f##*/}" "$(head -n 1 "$f")"; done; true')

    def parse(self, out: str, err: str, rc: int) -> dict[str, str]:
        found = {}
        for line in out.splitlines():
            name, _, rest = line.partition(" ")
            if name.endswith(".txt") and rest:
                found[name] = rest
        return found
