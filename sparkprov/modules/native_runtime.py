"""native_runtime: a host that runs vLLM outside containers has CUDA 13's nvcc and ptxas where
a login shell finds them, and TRITON_PTXAS_PATH set (G36: without nvcc Triton falls back to
interpreter mode, about 1 tok/s).

When a CUDA 13 toolkit is installed but a login shell does not find it, the module writes
/etc/profile.d/sparkprov-cuda.sh (CUDA_HOME, PATH, TRITON_PTXAS_PATH). When no CUDA 13 toolkit
is installed: failure if the host must run natively (`required`, default the `native_runtime`
variable), else skipped (vLLM runs in containers there).
"""

from __future__ import annotations

from sparkprov.modules.base import Change, Diff, FactView, HostContext, Module, ModuleArgs, Plan
from sparkprov.facts.files import PathState
from sparkprov.facts.hardware import CudaToolkit
from sparkprov.modules._provision import setting, write_file_script


class Args(ModuleArgs):
    required: bool | None = None  # default: the `native_runtime` variable, else false
    cuda_major: int = 13
    profile_file: str = "/etc/profile.d/sparkprov-cuda.sh"


def _major(v: str | None) -> int | None:
    return int(v.split(".")[0]) if v else None


def profile_text(bindir: str) -> str:
    home = bindir.rsplit("/bin", 1)[0]
    return ("# Managed by sparkprov (native_runtime): CUDA toolkit for vLLM outside containers (G36).\n"
            f"export CUDA_HOME={home}\n"
            f'case ":$PATH:" in *":{bindir}:"*) ;; *) PATH="{bindir}:$PATH" ;; esac\nexport PATH\n'
            f"export TRITON_PTXAS_PATH={bindir}/ptxas\n")


class NativeRuntimeModule(Module):
    name = "native_runtime"
    Args = Args
    doc = "CUDA 13 nvcc/ptxas on a login shell's PATH and TRITON_PTXAS_PATH set, for vLLM outside containers."

    def needs(self, args: Args, host: HostContext):
        return {"toolkit": CudaToolkit(), "profile": PathState(args.profile_file, with_content=True)}

    def plan(self, args: Args, facts: FactView, host: HostContext) -> Plan:
        tk = facts.toolkit
        required = bool(setting(args.required, host, "native_runtime"))
        want = args.cuda_major
        ok_nvcc = _major(tk["nvcc_version"]) == want
        ok_ptxas = _major(tk["ptxas_version"]) == want
        ok_triton = bool(tk["triton_ptxas_path"])
        if ok_nvcc and ok_ptxas and ok_triton:
            return Plan(msg=f"nvcc {tk['nvcc_version']} ({tk['nvcc']}), ptxas {tk['ptxas_version']}, "
                            f"TRITON_PTXAS_PATH={tk['triton_ptxas_path']}")
        kits = [k for k in tk["toolkits"] if _major(k["nvcc"]) == want and _major(k["ptxas"]) == want]
        kits.sort(key=lambda k: (k["bin"] == "/usr/local/cuda/bin", k["bin"]))
        if not kits:
            found = f"login shell finds nvcc {tk['nvcc_version'] or 'none'}"
            if not required:
                return Plan.skip(f"no CUDA {want} toolkit ({found}): vLLM runs in containers on this host "
                                 "(set native_runtime: true where it runs natively)")
            return Plan.fail(f"{host.name}: no CUDA {want} toolkit ({found}): Triton would fall back to interpreter "
                             f"mode, about 1 tok/s (G36). Fix: sudo apt install cuda-toolkit-{want}-0")
        bindir = kits[0]["bin"]
        text = profile_text(bindir)
        fact = facts.fact("profile")
        state = facts.profile
        before = (state.get("content") or b"").decode(errors="replace") if state["exists"] else ""
        if state["exists"] and before == text and state.get("mode") == 0o644:
            # the file is right, yet a login shell still misses it: something later overrides PATH
            return Plan.fail(f"{host.name}: {args.profile_file} puts {bindir} first, but a login shell finds nvcc "
                             f"{tk['nvcc_version'] or 'none'} and TRITON_PTXAS_PATH={tk['triton_ptxas_path'] or 'unset'}: "
                             "check ~/.profile and ~/.bashrc for PATH changes (G36)")
        change = Change(f"put CUDA {want} ({bindir}) on the login PATH and set TRITON_PTXAS_PATH (G36)",
                        write_file_script(args.profile_file, text.encode(), mode="0644", owner="root", group="root"),
                        Diff(args.profile_file, before, text), [fact, CudaToolkit()])
        return Plan([change])
