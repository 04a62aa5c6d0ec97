"""gpu_smoke: `docker run --rm --gpus all IMAGE COMMAND` works for the login user.

Running a container is a change, not a read: the test runs once per image build, docker server and
driver, as the login user, and its pass is recorded (GpuSmokeRecord reads the record), so a run
with nothing to do starts no container and check mode never does. It reads DockerState, which a
new docker group membership (docker_access) changes without predicting it: the engine applies that
membership and logs in again before planning this, so the test runs in the new session.
"""

from __future__ import annotations

from sparkprov.facts.docker_run import reporting_cause
from sparkprov.facts.runtimes import DockerState, GpuSmokeRecord, SMOKE_DIR
from sparkprov.modules._provision import setting
from sparkprov.modules.base import Change, Export, FactView, HostContext, Module, ModuleArgs, Plan
from sparkprov.transport.shell import cmd
from typing import TypedDict

TOOLKIT_FIX = ("sudo apt install nvidia-container-toolkit && sudo nvidia-ctk runtime configure --runtime=docker "
               "&& sudo systemctl restart docker")


class Args(ModuleArgs):
    smoke_image: str | None = None      # default: the `smoke_image` variable; none: no smoke test
    smoke_command: list[str] | None = None  # default: the `smoke_command` variable, else the image's own
    gpus: bool = True


def smoke_setting(args, host: HostContext) -> tuple[str | None, tuple[str, ...]]:
    """The smoke image and command: the arguments, else the inventory variables of the same names
    (docker_access pulls the image with the same reading)."""
    image = setting(args.smoke_image, host, "smoke_image")
    command = setting(args.smoke_command, host, "smoke_command")
    return (str(image) if image else None), tuple(str(c) for c in command)


class GpuSmoke(TypedDict):
    image: str
    ok: bool


GPU_SMOKE: Export[GpuSmoke] = Export("gpu_smoke", GpuSmoke, "the GPU smoke test passed in this image")


class GpuSmoke(Module):
    name = "gpu_smoke"
    Args = Args
    doc = "A GPU container runs for the login user (once per image, docker and driver; the pass is recorded)."

    def needs(self, args: Args, host: HostContext):
        image, command = smoke_setting(args, host)
        return {"state": DockerState(), **({"record": GpuSmokeRecord(image, command, args.gpus)} if image else {})}

    def plan(self, args: Args, facts: FactView, host: HostContext) -> Plan:
        image, command = smoke_setting(args, host)
        if not image:
            return Plan.skip("no smoke_image set (e.g. nvcr.io/nvidia/cuda:13.0.0-base-ubuntu24.04 with "
                             "smoke_command [nvidia-smi])")
        run = "docker run --rm" + (" --gpus all " if args.gpus else " ") + " ".join([image, *command])
        if not facts.state["access"] and not host.check:
            return Plan.fail(f"{host.name}: {host.user} cannot use docker, so `{run}` cannot run")
        smoke = facts.record
        if smoke["state"] != "present" and host.check:  # the image or the membership comes first
            return Plan([Change(f"GPU smoke test: `{run}` (once docker_access is applied)", ":")])
        if smoke["state"] != "present":
            return Plan.fail(f"{host.name}: GPU smoke test could not run ({smoke['state']})")
        if smoke["passed"]:
            return Plan(msg=f"`{run}` passed", exports=GPU_SMOKE({"image": image, "ok": True}))
        argv = ["docker", "run", "--rm"] + (["--gpus", "all"] if args.gpus else []) + [image, *command]
        # what the run printed goes to stdout; on a failure its last line (docker's cause) goes to stderr
        script = (f"r=0; o=$({reporting_cause('timeout 120 ' + cmd(*argv))} 2>&1) || r=$?\n"
                  "printf '%s\\n' \"$o\" | tail -n 5\n"
                  f"[ $r = 0 ] || {{ c=$(printf '%s\\n' \"$o\" | tail -n 1); "
                  f"echo \"{run}: $c (fix: {TOOLKIT_FIX})\" >&2; exit $r; }}\n"
                  f"f={SMOKE_DIR.replace('~', '$HOME', 1)}/{smoke['key']}; mkdir -p \"$(dirname \"$f\")\"; "
                  "printf '%s\\n' \"$o\" > \"$f\"")
        record = facts.fact("record")
        # as the login user: the proof is that they can run a GPU container, not root
        return Plan([Change(f"GPU smoke test: `{run}` (once for this image, docker and driver)", script,
                            touches=[record], become=False, predicts=[(record, {**smoke, "passed": True})])])
