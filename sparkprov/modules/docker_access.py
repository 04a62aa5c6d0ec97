"""docker_access: the login user can run GPU containers.

- the docker engine is installed and running (started with systemctl where it is not);
- the NVIDIA container toolkit is present (nvidia-ctk, the runtime hook, or the package);
- the `docker` group exists (created if missing) and the login user is in it. Membership only
  counts in a new login, so the engine reconnects before verifying, and the proof is
  `docker info` run as that user in the new session, not the group file;
- the smoke image pulled when absent (`smoke_image` / `smoke_command` from the arguments or the
  inventory variables of the same names, e.g. nvcr.io/nvidia/cuda:13.0.0-base-ubuntu24.04 and
  [nvidia-smi]); the test itself is the gpu_smoke module's, the task after this one, so that it runs
  in the new login session.

Exports `docker`: {server_version, runtimes, toolkit, smoke}.
"""

from __future__ import annotations

import re

from pydantic import field_validator

from sparkprov.modules.base import Change, Diff, Export, FactView, HostContext, Module, ModuleArgs, Plan
from sparkprov.facts.accounts import GroupInfo, UserInfo
from sparkprov.facts.runtimes import DockerDaemon, DockerState, GpuSmokeRecord
from sparkprov.modules.gpu_smoke import smoke_setting as _smoke
from sparkprov.transport.shell import cmd
from typing import Any, TypedDict

TOOLKIT_FIX = ("sudo apt install nvidia-container-toolkit && sudo nvidia-ctk runtime configure --runtime=docker "
               "&& sudo systemctl restart docker")


class Args(ModuleArgs):
    group: str = "docker"
    smoke_image: str | None = None      # default: the `smoke_image` variable; none: no smoke test
    smoke_command: list[str] | None = None  # default: the `smoke_command` variable, else the image's own
    gpus: bool = True

    @field_validator("group")
    @classmethod
    def _group(cls, v):
        if not re.fullmatch(r"[a-z_][a-z0-9_-]{0,31}", v):
            raise ValueError(f"{v!r} is not a valid group name")
        return v


class Docker(TypedDict):
    server_version: str | None
    runtimes: list[str]
    toolkit: dict[str, Any]   # the NVIDIA container toolkit: package, ctk, hook
    smoke: None


DOCKER: Export[Docker] = Export("docker", Docker, "the docker daemon the login user reaches, and its runtimes")


class DockerAccessModule(Module):
    name = "docker_access"
    Args = Args
    doc = "Docker running, NVIDIA container toolkit present, login user in the docker group (new session), smoke image pulled."

    def needs(self, args: Args, host: HostContext):
        image, command = _smoke(args, host)
        out = {"state": DockerState(), "daemon": DockerDaemon(), "group": GroupInfo(args.group), "user": UserInfo(host.user)}
        if image:
            out.update(image=DockerDaemon(image))
        return out

    def plan(self, args: Args, facts: FactView, host: HostContext) -> Plan:
        h, user, group = host.name, host.user, args.group
        image, command = _smoke(args, host)
        state, daemon, grp, uinfo = facts.state, facts.daemon, facts.group, facts.user
        # the membership and the pull change what the GPU smoke test (gpu_smoke, next) can read
        smoke_facts = [facts.fact("image"), GpuSmokeRecord(image, command, args.gpus)] if image else []
        every = [facts.fact(n) for n in ("state", "daemon", "group", "user")] + smoke_facts
        if not state["cli"]:
            return Plan.fail(f"{h}: docker is not installed. Fix: install Docker Engine (DGX OS ships it: "
                             "`sudo apt install docker-ce docker-ce-cli containerd.io`)")
        changes: list[Change] = []
        if not daemon["running"]:
            if not state["systemctl"]:
                return Plan.fail(f"{h}: the docker daemon is not running ({daemon['error']}). Fix: start dockerd")
            changes.append(Change("start the docker daemon (systemctl enable --now docker)",
                                  cmd("systemctl", "enable", "--now", "docker"), Diff("docker daemon", "stopped\n", "running\n"),
                                  every))
        tk = state["toolkit"]
        if not (tk["ctk"] or tk["hook"] or tk["package"]):
            return Plan.fail(f"{h}: the NVIDIA container toolkit is not installed: `docker run --gpus all` cannot "
                             f"work. Fix: {TOOLKIT_FIX}")
        if grp is None:
            changes.append(Change(f"create group {group}", cmd("groupadd", "--system", group),
                                  Diff(f"group {group}", "absent\n", "present\n"), every,
                                  predicts=[(GroupInfo(group), {"name": group, "gid": None, "members": []})]))
        sock = state["socket"]
        if sock and sock["group"] != group and sock["owner"] == "root":
            changes.append(Change(f"{sock['path']}: group {sock['group']} -> {group}",
                                  cmd("chgrp", group, sock["path"]) + "\n" + cmd("chmod", "0660", sock["path"]),
                                  Diff(sock["path"], f"root:{sock['group']}\n", f"root:{group} 0660\n"), every))
        if uinfo is None:
            return Plan.fail(f"{h}: login user {user} not found in the user database")
        member = group in uinfo["groups"]
        if not member:
            after = " ".join(sorted(set(uinfo["groups"]) | {group}))
            changes.append(Change(f"add {user} to group {group} (takes effect in a new login: reconnecting)",
                                  cmd("usermod", "-a", "-G", group, user),
                                  Diff(f"groups of {user}", " ".join(sorted(uinfo["groups"])) + "\n", after + "\n"),
                                  every, reconnect=True,
                                  predicts=[(UserInfo(user), {**uinfo, "groups": sorted(set(uinfo["groups"]) | {group})})]))
        if image and facts.image.get("image") == "absent":
            changes.append(Change(f"pull {image} for the GPU smoke test", cmd("docker", "pull", "-q", image) + " >/dev/null",
                                  Diff("docker images", "", image + "\n"), smoke_facts))
        if changes:
            return Plan(changes)
        if not state["access"]:
            return Plan.fail(f"{h}: {user} is in group {group}, yet `docker info` fails in a new session: "
                             f"{state['error']}. Fix: check the owner of the docker socket "
                             f"({sock['path'] + ' ' + sock['owner'] + ':' + sock['group'] if sock else 'not found'})")
        found = Docker(server_version=state["server_version"], runtimes=state["runtimes"], toolkit=tk, smoke=None)
        parts = [f"docker {state['server_version']} running; {user} reaches it in a new session (group {group})",
                 "NVIDIA container toolkit " + (tk["ctk"] or tk["package"] or "hook " + (tk["hook"] or ""))]
        if image:
            parts.append(f"smoke image {image} present (gpu_smoke runs the test)")
        else:
            parts.append("GPU smoke test skipped: no smoke_image set (e.g. nvcr.io/nvidia/cuda:13.0.0-base-ubuntu24.04 "
                         "with smoke_command [nvidia-smi])")
        return Plan(msg="; ".join(parts), exports=DOCKER(found))
