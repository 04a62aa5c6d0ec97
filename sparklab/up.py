"""lab.up / lab.down / lab.status: bring the simulated Spark fleet up, tear it all down."""
from __future__ import annotations

import os
import shutil
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from . import dockerd, gb10, hosts, net, sshd, state
from .state import (BRIDGE_IP, CACHE_DIR, HUB_PORT, STATE_DIR, HostRecord, LabRecord,
                    host_address, host_name)


def _say(msg: str) -> None:
    print(f"lab: {msg}", flush=True)


def require_root() -> None:
    if os.geteuid() != 0:
        raise hosts.LabError("the lab needs root (network and mount namespaces)")


@dataclass
class UpResult:
    hosts: dict[str, str]                 # name -> address
    inventory: Path
    changed: list[str] = field(default_factory=list)
    registry_url: str = ""
    hub_url: str = ""
    seconds: float = 0.0


def _optional(modname: str, attr: str):
    """An attribute of a shared-service module other engineers own, or None (with a note)."""
    import importlib
    try:
        mod = importlib.import_module(f"sparklab.{modname}")
        return getattr(mod, attr)
    except (ImportError, AttributeError):
        _say(f"note: sparklab.{modname}.{attr} is not available yet; skipped")
        return None


def _password() -> str:
    p = state.password_path()
    if p.exists() and p.read_text().strip():
        return p.read_text().strip()
    pw = hosts.new_password()
    fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(pw + "\n")
    return pw


def inventory_text(rec: LabRecord, hf_endpoint: str) -> str:
    from .image import PROMETHEUS_IMAGE

    names = sorted(rec.hosts, key=lambda n: rec.hosts[n].index)
    return state.lab_inventory(
        {n: rec.hosts[n].address for n in names},
        defaults={"ssh_key": state.key_path(), "known_hosts": state.known_hosts_path(),
                  "become_password_file": state.password_path()},
        # `invoke monitor up`: Prometheus from Debian's package, pushed to the lab registry
        vars={"hf_endpoint": hf_endpoint, "prometheus_image": PROMETHEUS_IMAGE})


def _write_if_changed(path: Path, text: str, mode: int = 0o644) -> bool:
    if path.exists() and path.read_text() == text:
        return False
    path.write_text(text)
    os.chmod(path, mode)
    return True


def up(n_hosts: int = 2, *, images: bool = True, ollama: bool = False,
       quiet: bool = False, light: bool = False, hub: bool = True, topology: str | None = None) -> UpResult:
    """Bring up (or keep) a lab of n_hosts simulated Sparks. Idempotent.

    images: every image of image.lab_images() built (cached) and pushed; hub: the lab hub started
    (its lab-tiny is trained with the real vLLM's image layer). Both run beside the hosts' setup
    (cold: minutes of one core; the hosts: seconds of the other). topology: how the fabric is cabled
    (state.LAB_TOPOLOGIES: pair, mesh, ring, switch); None: a pair at two hosts, a switch above (as
    always); another topology than the lab's rebuilds it. light: hosts without dockerd (for scale
    runs: many hosts on a small machine). Nothing is pushed to the registry (images is ignored), no
    dockerd is started or waited for; a host that already runs one keeps it. Everything else (sshd,
    users, stand-ins, fabric) is made."""
    require_root()
    if n_hosts < 1 or n_hosts > 200:
        raise hosts.LabError("hosts must be between 1 and 200")
    t0 = time.monotonic()
    say = (lambda m: None) if quiet else _say
    changed: list[str] = []
    with state.lab_lock():
        rec = LabRecord.load()
        try:
            topology = state.topology_record(topology, n_hosts)
        except ValueError as e:
            raise hosts.LabError(str(e)) from None
        if rec.hosts and (len(rec.hosts) != n_hosts or rec.topology != topology):
            say(f"lab has {len(rec.hosts)} host(s); rebuilding with {n_hosts}")
            down(purge=False, quiet=quiet)
            rec = LabRecord()
        STATE_DIR.mkdir(parents=True, exist_ok=True)
        os.chmod(STATE_DIR, 0o700)
        if sshd.ensure_control_key():
            changed.append("control key")
        password = _password()
        names = [host_name(i) for i in range(1, n_hosts + 1)]
        for i, name in enumerate(names, 1):
            rec.hosts.setdefault(name, HostRecord(name=name, index=i, address=host_address(i)))
        rec.topology = topology
        rec.save()  # before anything is made, so lab.down finds it after a crash

        # namespaces, management links, anchors
        for name in names:
            h = rec.hosts[name]
            if net.ensure_netns(name):
                changed.append(f"{name}: netns")
            if net.ensure_mgmt(name, h.index, h.address):
                changed.append(f"{name}: {state.MGMT_IFACE} {h.address}")
            if not hosts.anchor_alive(h):
                left = hosts.host_pids(name)
                if left:
                    hosts.kill_pids(left)
                hosts.start_anchor(h)
                rec.save()
                changed.append(f"{name}: namespaces (anchor pid {h.anchor_pid})")
        if net.ensure_fabric([(n, rec.hosts[n].index) for n in names], topology):
            changed.append(f"fabric ({topology})")

        # shared services on the bridge
        registry_settings = None
        etc_hosts: list[str] = []
        ensure_registry = _optional("registry", "ensure_registry")
        if ensure_registry:
            try:
                rec.registry_url = ensure_registry(STATE_DIR, BRIDGE_IP)
            except Exception as e:  # the hosts stay usable without it; say so loudly
                say(f"WARNING: registry not started: {e}")
                rec.registry_url = ""
        if rec.registry_url:
            client_settings = _optional("registry", "client_settings")
            hostnames_of = _optional("image", "registry_hostnames")
            lab_images = _optional("image", "lab_images")
            try:
                hostnames = (hostnames_of(lab_images())
                             if hostnames_of and lab_images else [])
            except Exception as e:
                say(f"WARNING: image names unavailable ({type(e).__name__}: {e}); "
                    "only the Docker Hub mirror is configured")
                hostnames = []
            if client_settings:
                cs = client_settings(rec.registry_url, hostnames)
                registry_settings, etc_hosts = cs["daemon"], cs["etc_hosts"]
        rec.save()

        def images_and_hub() -> str:
            """The hub started (its lab-tiny trained in the rootfs of the real vLLM's layer as that
            builds), then the lab images pushed: beside the hosts' setup. The hub's URL ("" if none)."""
            url = ""
            ensure_hub = _optional("hub", "ensure_lab_hub") if hub else None
            if ensure_hub:
                try:
                    url = ensure_hub(STATE_DIR, BRIDGE_IP)
                except Exception as e:
                    say(f"WARNING: hub not started: {e}")
            if rec.registry_url and images and not light:
                ensure_images = _optional("image", "ensure_images")
                lab_images = _optional("image", "lab_images")
                if ensure_images and lab_images:
                    try:
                        ensure_images(rec.registry_url, lab_images())
                    except Exception as e:
                        say(f"WARNING: lab images not pushed: {type(e).__name__}: {e}")
            return url

        beside = ThreadPoolExecutor(max_workers=1)
        built = beside.submit(images_and_hub)

        # per-host configuration, in parallel
        def configure(name: str) -> list[str]:
            h = rec.hosts[name]
            c = []
            if hosts.ensure_host_files(name, etc_hosts):
                c.append(f"{name}: /etc/hosts")
            if hosts.ensure_login_user(name, password):
                c.append(f"{name}: user nvidia")
            if gb10.install_standins(name, h.index):
                c.append(f"{name}: GB10 stand-ins")
            sshd_files = sshd.ensure_host_sshd_files(name)
            if sshd_files:
                c.append(f"{name}: sshd config/keys")
            if sshd.start_sshd(name):
                c.append(f"{name}: sshd started")
            elif sshd_files and sshd.reload_sshd(name):
                c.append(f"{name}: sshd reloaded")
            if not light and dockerd.start_dockerd_async(name, registry_settings or {}):
                c.append(f"{name}: dockerd started")
            return c

        with ThreadPoolExecutor(max_workers=min(8, len(names))) as ex:
            for c in ex.map(configure, names):
                changed.extend(c)
        if sshd.write_known_hosts({n: rec.hosts[n].address for n in names}):
            changed.append("known_hosts")
        if not light:
            with ThreadPoolExecutor(max_workers=min(8, len(names))) as ex:
                list(ex.map(dockerd.wait_dockerd, names))
        rec.hub_url = built.result()
        beside.shutdown()
        if ollama:
            from . import ollama as ol
            for name in names:
                if ol.start_ollama(name):
                    changed.append(f"{name}: ollama stand-in")
        hf = rec.hub_url or f"http://{BRIDGE_IP}:{HUB_PORT}"
        if _write_if_changed(state.inventory_path(), inventory_text(rec, hf)):
            changed.append("inventory")
        rec.save()
    res = UpResult(hosts={n: rec.hosts[n].address for n in names},
                   inventory=state.inventory_path(), changed=changed,
                   registry_url=rec.registry_url, hub_url=rec.hub_url,
                   seconds=time.monotonic() - t0)
    if not quiet:
        for c in changed:
            say(f"made {c}")
        if not changed:
            say("nothing to change")
        for n, a in res.hosts.items():
            say(f"{n}  {a}  (ssh -i {state.key_path()} -o UserKnownHostsFile="
                f"{state.known_hosts_path()} nvidia@{a})")
        say(f"inventory: {res.inventory}")
        if res.registry_url:
            say(f"registry: {res.registry_url}")
        say(f"up in {res.seconds:.1f}s")
    return res


def _lab_host_names() -> list[str]:
    names = set(LabRecord.load().hosts)
    hd = STATE_DIR / "hosts"
    if hd.is_dir():
        names.update(p.name for p in hd.iterdir() if p.is_dir())
    return sorted(names)


def _cgroup_dirs(name: str) -> list[Path]:
    root = Path("/sys/fs/cgroup")
    out = []
    if root.is_dir():
        for hier in root.iterdir():
            p = hier / dockerd.cgroup_parent(name)
            if p.is_dir():
                out.append(p)
    return out


def _kill_cgroups(name: str) -> None:
    """Kill what containers of this host left in its cgroup parent, then remove the cgroups."""
    for _ in range(3):
        pids = set()
        for d in _cgroup_dirs(name):
            for procs in d.rglob("cgroup.procs"):
                try:
                    pids.update(int(x) for x in procs.read_text().split())
                except OSError:
                    pass
        if not pids:
            break
        hosts.kill_pids(sorted(pids), grace=2)
    for d in _cgroup_dirs(name):
        for sub in sorted((p for p in d.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
            try:
                sub.rmdir()
            except OSError:
                pass
        try:
            d.rmdir()
        except OSError:
            pass


def _mounts_under(path: Path) -> list[str]:
    out = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        mnt = line.split()[4].replace("\\040", " ")
        if mnt == str(path) or mnt.startswith(str(path) + "/"):
            out.append(mnt)
    return out


def down(purge: bool = False, *, quiet: bool = False) -> list[str]:
    """Remove every namespace, link, bridge, mount, process and file the lab made.
    Robust to a partial up or a crash; a second run finds nothing to do."""
    require_root()
    say = (lambda m: None) if quiet else _say
    removed: list[str] = []
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    with state.lab_lock():
        rec = LabRecord.load()
        names = _lab_host_names()
        for name in names:
            h = rec.hosts.get(name)
            if h and hosts.anchor_alive(h):
                try:
                    if dockerd.stop_dockerd(name, wait=15):
                        removed.append(f"{name}: dockerd")
                except Exception as e:  # keep tearing down
                    say(f"{name}: stopping dockerd: {e}")
            pids = hosts.host_pids(name)
            if pids:
                hosts.kill_pids(pids)
                removed.append(f"{name}: {len(pids)} process(es)")
            _kill_cgroups(name)
        for modname, attr in (("registry", "stop_registry"), ("hub", "stop_hub")):
            try:
                import importlib
                stop = getattr(importlib.import_module(f"sparklab.{modname}"), attr)
            except (ImportError, AttributeError):
                continue
            try:
                stop(STATE_DIR)
            except Exception as e:
                say(f"{modname}: {attr}: {e}")
        before = set(net.netns_list()) | set(net.lab_root_links())
        net.teardown(names)
        gone = before - (set(net.netns_list()) | set(net.lab_root_links()))
        removed += sorted(gone)
        for m in reversed(_mounts_under(STATE_DIR)):
            subprocess.run(["umount", "-l", m], capture_output=True)
            removed.append(f"mount {m}")
        if any(STATE_DIR.iterdir()):
            removed.append(str(STATE_DIR))
    shutil.rmtree(STATE_DIR, ignore_errors=True)
    if purge and CACHE_DIR.exists():
        subprocess.run(["rm", "-rf", "--one-file-system", str(CACHE_DIR)])
        removed.append(str(CACHE_DIR))
    for r in removed:
        say(f"removed {r}")
    if not removed:
        say("nothing to remove")
    return removed


def status() -> dict:
    """What the lab has: hosts, addresses, anchors, daemons, fabric link states."""
    rec = LabRecord.load()
    out = {"state_dir": str(STATE_DIR), "topology": rec.topology,
           "registry_url": rec.registry_url, "hub_url": rec.hub_url, "hosts": {}}
    for name, h in sorted(rec.hosts.items(), key=lambda kv: kv[1].index):
        info = {"address": h.address, "anchor_pid": h.anchor_pid,
                "running": hosts.anchor_alive(h)}
        if info["running"]:
            info["sshd_pid"] = sshd.sshd_pid(name)
            info["dockerd_pid"] = dockerd.dockerd_pid(name)
            links = net.links(name)
            info["fabric"] = {i: {"state": links[i].get("operstate"), "mtu": links[i].get("mtu")}
                              for i in state.FABRIC_IFACES if i in links}
            try:
                from . import ollama as ol
                info["ollama"] = ol.ollama_running(name)
            except ImportError:
                pass
        out["hosts"][name] = info
    return out
