"""A deployment's container as a systemd service, as the seed notes run them on real Sparks
(002 §2): the page cache dropped as root before each start (G15), restart whatever the exit status
(the real vLLM's API server exits 0 when its engine dies: docs/real-vllm.md), a start
timeout long enough for a cold load (G20), the container in the foreground so that systemd sees
it die. The container is assembled as cluster-up's (serving/spec.py) with foreground=True: no -d
and no docker restart policy (systemd restarts it), --rm (each start a fresh container of the same
name). `invoke recipe ALIAS --systemd` prints the units; `systemd-analyze verify` checks them in the
tests. (The lab has no systemd: there docker's restart policy brings containers back.)
"""

from __future__ import annotations

from sparkprov.serving.spec import ContainerSpec

UNIT_DIR = "/etc/systemd/system"


def unit_name(spec: ContainerSpec) -> str:
    return f"{spec.name}.service"


def _word(arg: str) -> str:
    """One argument for ExecStart=: systemd's own quoting (not a shell's): backslash and double
    quote escaped, a line break as the C escape \\n (a unit's line cannot hold one; the rank
    supervisor's program has them), `$` and `%` doubled so that systemd expands neither."""
    return '"' + (arg.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
                  .replace("$", "$$").replace("%", "%%")) + '"'


def render(spec: ContainerSpec, *, user: str, start_timeout_s: int = 900, docker: str = "/usr/bin/docker") -> str:
    """The unit of a container assembled with foreground=True."""
    if "-d" in spec.argv[:3]:
        raise ValueError(f"{spec.name} is assembled detached (-d): a unit needs foreground=True")
    name = spec.name
    exec_start = " ".join(_word(w) for w in [docker] + spec.argv[1:])
    return "\n".join([
        "[Unit]",
        f"Description=sparkprov {spec.deployment}: {spec.role} of {spec.launch.alias} (recipe {spec.hash})",
        "After=docker.service network-online.target",
        "Wants=network-online.target",
        "Requires=docker.service",
        "",
        "[Service]",
        "Type=simple",
        f"User={user}",
        # always, not on-failure: the API server exits 0 when its engine core dies (docs/real-vllm.md)
        "Restart=always",
        "RestartSec=30",
        f"TimeoutStartSec={start_timeout_s}",
        "TimeoutStopSec=120",
        # "+": these run as root although the service runs as the login user (the notes'
        # PermissionsStartOnly, which systemd deprecated)
        f"ExecStartPre=+{docker} rm -f {_word(name)}",
        "ExecStartPre=+/bin/sh -c \"sync && echo 3 > /proc/sys/vm/drop_caches\"",
        f"ExecStart={exec_start}",
        f"ExecStop={docker} stop -t 60 {_word(name)}",
        "",
        "[Install]",
        "WantedBy=multi-user.target",
        "",
    ])
