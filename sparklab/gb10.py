"""GB10 stand-ins: what a DGX Spark has that this machine lacks (GPU tools, RoCE names,
release file, container toolkit). The files live in sparklab/standins/ (also used by
vagrant/), and go into each host's private /usr/local/bin and /etc."""
from __future__ import annotations

import hashlib
import subprocess
import uuid
from pathlib import Path

from .hosts import nsexec, write_file
from .state import host_dir

STANDINS = Path(__file__).resolve().parent / "standins"
BIN_STANDINS = ("nvidia-smi", "ibdev2netdev", "nvidia-container-runtime-hook", "nvidia-ctk", "ib_write_bw")
GPU_CONF = "/etc/sparkprov-lab/gpu.conf"
DEFAULT_DRIVER = "580.95.05"
TOOLKIT_VERSION = "1.19.0-1"


def default_gpu_conf(name: str, index: int) -> dict[str, str]:
    u = uuid.UUID(bytes=hashlib.sha256(f"sparkprov-lab-{name}".encode()).digest()[:16])
    return {"DRIVER_VERSION": DEFAULT_DRIVER, "CUDA_VERSION": "13.0", "GPU_NAME": "NVIDIA GB10",
            "GPU_UUID": f"GPU-{u}", "PCI_BUS_ID": "0000000F:01:00.0",
            "TEMP_C": str(38 + index % 5), "POWER_W": "11.37", "PSTATE": "P0",
            "COMPUTE_CAP": "12.1"}


def _conf_text(values: dict[str, str]) -> str:
    return ("# sparkprov lab: what this host's GB10 stand-ins report (nvidia-smi)\n"
            + "".join(f"{k}={v}\n" for k, v in values.items()))


def read_gpu_conf(name: str) -> dict[str, str]:
    out = nsexec(name, ["cat", GPU_CONF]).stdout
    return dict(l.split("=", 1) for l in out.splitlines() if "=" in l and not l.startswith("#"))


def set_gpu_conf(name: str, **values: str) -> None:
    """Change what one host's nvidia-smi reports, e.g. set_gpu_conf('spark2',
    DRIVER_VERSION='580.82.09') to make its driver too old."""
    cur = read_gpu_conf(name)
    cur.update({k: str(v) for k, v in values.items()})
    write_file(name, GPU_CONF, _conf_text(cur))


def set_driver_version(name: str, version: str) -> None:
    set_gpu_conf(name, DRIVER_VERSION=version)


def install_standins(name: str, index: int) -> bool:
    """Copy the stand-ins into the host's /usr/local/bin (written from the root namespace:
    that directory is the host's own) and write /etc files inside the host."""
    changed = False
    bindir = host_dir(name) / "fs" / "usr-local" / "bin"
    for f in BIN_STANDINS:
        src = (STANDINS / f).read_bytes()
        dst = bindir / f
        if not dst.exists() or dst.read_bytes() != src:
            tmp = dst.with_suffix(".tmp")
            tmp.write_bytes(src)
            tmp.chmod(0o755)
            tmp.replace(dst)
            changed = True
    changed |= write_file(name, "/etc/dgx-release", (STANDINS / "dgx-release").read_text())
    if nsexec(name, ["test", "-f", GPU_CONF], check=False).returncode != 0:
        write_file(name, GPU_CONF, _conf_text(default_gpu_conf(name, index)))
        changed = True
    changed |= _register_toolkit_package(name)
    return changed


def _register_toolkit_package(name: str) -> bool:
    """Make dpkg report nvidia-container-toolkit installed, as on a Spark (no files)."""
    r = nsexec(name, ["dpkg-query", "-W", "-f=${Status}", "nvidia-container-toolkit"],
               check=False)
    if "install ok installed" in r.stdout:
        return False
    arch = subprocess.run(["dpkg", "--print-architecture"], capture_output=True,
                          text=True).stdout.strip()
    stanza = (f"\nPackage: nvidia-container-toolkit\nStatus: install ok installed\n"
              f"Priority: optional\nSection: utils\nInstalled-Size: 1\n"
              f"Maintainer: sparkprov lab stand-in <lab@sparkprov.invalid>\n"
              f"Architecture: {arch}\nVersion: {TOOLKIT_VERSION}\n"
              f"Description: NVIDIA Container toolkit (sparkprov lab stand-in)\n"
              f" Stand-in registered by the sparkprov lab; the hook and nvidia-ctk live in\n"
              f" /usr/local/bin.\n")
    script = ("set -e; s=/var/lib/dpkg/status; sed -e '$a\\' \"$s\" > \"$s.sparklab\"; "
              "cat >> \"$s.sparklab\"; mv \"$s.sparklab\" \"$s\"; "
              ": > /var/lib/dpkg/info/nvidia-container-toolkit.list")
    nsexec(name, ["sh", "-c", script], input=stanza.lstrip("\n") + "\n")
    return True
