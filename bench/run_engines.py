"""sparkprov vs ansible-core vs pyinfra: the same provisioning work on the same lab hosts.

    sudo .venv/bin/python bench/run_engines.py [--hosts 2,8,16] [--runs 3] [--no-readme] [--down]

One command: creates bench/.venv (pinned ansible-core and pyinfra) if missing, brings the lab to
each host count (light hosts: no dockerd), and for each count times, in one session:

  cold  every host reset (group, membership, dirs, files removed; not timed), then one run;
  warm  every host already converged (nothing to change), then one run;

for each tool, --runs times, the tools interleaved within each repetition so that the machine's
noise is shared. The work (bench/work/): a group, the login user in it, five directories with
owners and modes, a config file, a netplan-like file, a check of nvidia-smi's driver version.

Counted per run and host, from the host's sshd log (LogLevel VERBOSE): SSH connections
("Accepted publickey") and sessions started on them ("Starting session: command | subsystem
'sftp' | shell"): every session is one remote execution. Also each tool's own count:
sparkprov's recap (remote_calls), Ansible's ControlMaster sockets (its SSH connections).
After each cold run the hosts are checked (owners, modes, bytes, membership) to be what the
work asks; before the warm runs the hosts are converged by each tool in turn and every later
tool must find nothing to change (the three do the same work).

Writes bench/results/engines-<date>.json and the engines section of bench/README.md.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (BENCH, BENCH_VENV, PINS, REPO, RESULTS, RUN_DIR, SshdLogs, in_hosts,  # noqa: E402
                     lab_down, lab_paths, lab_up, machine, median, pip_version, verbose_sshd,
                     write_section)

WORK = BENCH / "work"
TOOLS = ("sparkprov", "ansible", "pyinfra")

RESET = ("gpasswd -d nvidia sparkbench >/dev/null 2>&1; groupdel sparkbench 2>/dev/null; "
         "rm -rf /etc/sparkbench /opt/sparkbench /var/log/sparkbench /etc/netplan/40-sparkbench.yaml "
         "/home/nvidia/.ansible /tmp/pyinfra-* /tmp/.pyinfra*; rmdir /etc/netplan 2>/dev/null; true")

# What every host must look like after a run (checked after each cold run, not timed).
EXPECTED_DIRS = {"/etc/sparkbench": "755 root root", "/etc/netplan": "755 root root",
                 "/opt/sparkbench": "775 root sparkbench", "/opt/sparkbench/models": "755 nvidia nvidia",
                 "/var/log/sparkbench": "750 root adm"}
EXPECTED_FILES = {"/etc/sparkbench/bench.conf": ("644 root root", WORK / "files" / "bench.conf"),
                  "/etc/netplan/40-sparkbench.yaml": ("600 root root", WORK / "files" / "40-sparkbench.yaml")}
VERIFY = ("for p in " + " ".join(list(EXPECTED_DIRS) + list(EXPECTED_FILES)) + "; do "
          "printf '%s %s\\n' \"$p\" \"$(stat -c '%a %U %G' \"$p\" 2>/dev/null || echo missing)\"; done; "
          "for f in " + " ".join(EXPECTED_FILES) + "; do printf 'sha %s %s\\n' \"$f\" "
          "\"$(sha256sum < \"$f\" 2>/dev/null | cut -d' ' -f1)\"; done; "
          "printf 'groups %s\\n' \"$(id -nG nvidia)\"")


# -- the bench venv --------------------------------------------------------------------------
def ensure_venv() -> None:
    py = BENCH_VENV / "bin" / "python"
    want = {p.split("==")[0]: p.split("==")[1] for p in PINS}
    if py.exists() and all(pip_version(py, d) == v for d, v in want.items()):
        return
    print(f"bench: creating {BENCH_VENV} with {' '.join(PINS)}", flush=True)
    if not py.exists():
        subprocess.run([sys.executable, "-m", "venv", str(BENCH_VENV)], check=True)
    subprocess.run([str(py), "-m", "pip", "install", "-q", *PINS], check=True)


def check_work_files() -> None:
    """The file contents in sparkprov.yaml must be the bytes of bench/work/files/* (which
    Ansible and pyinfra upload)."""
    import yaml

    book = yaml.safe_load((WORK / "sparkprov.yaml").read_text())
    contents = {t["file"]["path"]: t["file"]["content"] for t in book[0]["tasks"] if "file" in t}
    for path, (_, src) in EXPECTED_FILES.items():
        if contents.get(path) != src.read_text():
            raise SystemExit(f"bench/work/sparkprov.yaml: {path} differs from {src}")


# -- per host count: inventories and configs -------------------------------------------------
def write_configs(hosts: dict[str, str]) -> Path:
    paths = lab_paths()
    d = RUN_DIR / str(len(hosts))
    if d.exists():
        shutil.rmtree(d)
    (d / "cp").mkdir(parents=True)
    n = len(hosts)
    (d / "ansible_hosts.ini").write_text(
        "[sparks]\n" + "".join(f"{h} ansible_host={a}\n" for h, a in hosts.items())
        + f"\n[sparks:vars]\nansible_user=nvidia\nansible_ssh_private_key_file={paths['key']}\n")
    (d / "ansible.cfg").write_text(f"""\
[defaults]
inventory = {d / 'ansible_hosts.ini'}
forks = {max(n, 5)}
gathering = explicit
interpreter_python = /usr/bin/python3
host_key_checking = True
retry_files_enabled = False
nocolor = True

[ssh_connection]
pipelining = True
ssh_args = -o ControlMaster=auto -o ControlPersist=60s -o IdentitiesOnly=yes -o StrictHostKeyChecking=yes -o UserKnownHostsFile={paths['known_hosts']} -o GlobalKnownHostsFile=/dev/null
control_path_dir = {d / 'cp'}

[privilege_escalation]
become_method = sudo
""")
    (d / "pyinfra_inventory.py").write_text(f'''\
"""pyinfra inventory for the lab (generated by bench/run_engines.py)."""
from pathlib import Path

_data = {{
    "ssh_user": "nvidia",
    "ssh_key": {str(paths['key'])!r},
    "ssh_known_hosts_file": {str(paths['known_hosts'])!r},
    "ssh_strict_host_key_checking": "yes",
    # sudo's password from the lab's 0600 file, never on a command line
    "_sudo_password": Path({str(paths['password'])!r}).read_text().strip(),
}}
sparks = [
''' + "".join(f'    ({h!r}, {{**_data, "ssh_hostname": {a!r}}}),\n' for h, a in hosts.items()) + "]\n")
    return d


def command(tool: str, d: Path, n: int, verbose: bool = False) -> tuple[list[str], dict[str, str]]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "NO_COLOR": "1"}
    env.pop("SPARKPROV_BECOME_PASSWORD", None)
    if tool == "sparkprov":
        return ([str(REPO / ".venv" / "bin" / "invoke"), "play", str(WORK / "sparkprov.yaml"),
                 "--inventory", str(lab_paths()["inventory"])], env)
    if tool == "ansible":
        env["ANSIBLE_CONFIG"] = str(d / "ansible.cfg")
        argv = [str(BENCH_VENV / "bin" / "ansible-playbook"), str(WORK / "ansible.yaml"),
                "--become-password-file", str(lab_paths()["password"])]
        return (argv + (["-vvv"] if verbose else []), env)
    if tool == "pyinfra":
        argv = [str(BENCH_VENV / "bin" / "pyinfra"), "-y", "--sudo", "--parallel", str(n),
                str(d / "pyinfra_inventory.py"), str(WORK / "pyinfra_deploy.py")]
        return (argv[:1] + (["-vv"] if verbose else []) + argv[1:], env)
    raise ValueError(tool)


def parse(tool: str, out: str, hosts: dict[str, str]) -> dict:
    """changed: hosts' changed counts as the tool reports them; own_calls: the tool's own
    remote-call count per host where it reports one."""
    res: dict = {"changed": None, "own_calls": None}
    if tool == "sparkprov":
        rows = re.findall(r"^(\S+)\s+: ok=(\d+)\s+changed=(\d+)\s+failed=(\d+).*remote_calls=(\d+)", out, re.M)
        res["changed"] = {h: int(c) for h, _, c, _, _ in rows}
        res["own_calls"] = {h: int(r) for h, _, _, _, r in rows}
    elif tool == "ansible":
        rows = re.findall(r"^(\S+)\s+: ok=(\d+)\s+changed=(\d+)", out, re.M)
        res["changed"] = {h: int(c) for h, _, c in rows}
    elif tool == "pyinfra":
        # the results table's last row: "Grand total  HOST-OPS  SUCCESS  ERROR  NO-CHANGE"
        # (Success = operations that changed something, summed over hosts; "-" is 0)
        m = re.search(r"^\s*Grand total\s+(\d+)\s+(\S+)\s+(\S+)\s+(\S+)\s*$", out, re.M)
        if m:
            res["changed"] = {"all hosts": 0 if m.group(2) == "-" else int(m.group(2))}
    return res


def ansible_masters(d: Path) -> int:
    """Ansible's own connection count: the ControlMaster sockets it made; closes them."""
    socks = [p for p in (d / "cp").iterdir()]
    for s in socks:
        subprocess.run(["ssh", "-o", f"ControlPath={s}", "-O", "exit", "x"], capture_output=True, timeout=10)
    for s in socks:
        s.unlink(missing_ok=True)
    return len(socks)


def run_once(tool: str, d: Path, hosts: dict[str, str], logs: SshdLogs, verbose: bool = False) -> dict:
    argv, env = command(tool, d, len(hosts), verbose)
    logs.mark()
    t0 = time.perf_counter()
    r = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=str(REPO), timeout=900)
    wall = time.perf_counter() - t0
    out = r.stdout + "\n" + r.stderr
    counts = logs.counts()
    rec = {"tool": tool, "wall_s": round(wall, 3), "rc": r.returncode, "sshd": counts, **parse(tool, out, hosts)}
    if tool == "ansible":
        rec["own_connections"] = ansible_masters(d)
    if verbose:
        rec["verbose_out"] = out
    if r.returncode != 0:
        rec["tail"] = out[-3000:]
        print(f"  {tool}: rc={r.returncode}\n{out[-2000:]}", flush=True)
    return rec


def run_timed(tool: str, d: Path, hosts: dict[str, str], logs: SshdLogs, retried: list) -> dict:
    """A timed run; a run that exits 1 (bad input: sparkprov's tree is edited by others while
    this runs) is retried once, and the failed attempt is kept in the results."""
    rec = run_once(tool, d, hosts, logs)
    if rec["rc"] == 1:
        retried.append({"tool": tool, "tail": rec.get("tail", "")[-500:]})
        rec = run_once(tool, d, hosts, logs)
    return rec


def verify(names: list[str]) -> list[str]:
    problems = []
    import hashlib

    shas = {p: hashlib.sha256(src.read_bytes()).hexdigest() for p, (_, src) in EXPECTED_FILES.items()}
    for n, r in zip(names, in_hosts(names, VERIFY)):
        lines = dict(l.split(" ", 1) for l in r.stdout.splitlines() if " " in l)
        for p, want in EXPECTED_DIRS.items():
            if lines.get(p) != want:
                problems.append(f"{n}: {p}: {lines.get(p)} (want {want})")
        for p, (want, _) in EXPECTED_FILES.items():
            if lines.get(p) != want:
                problems.append(f"{n}: {p}: {lines.get(p)} (want {want})")
        for l in r.stdout.splitlines():
            if l.startswith("sha "):
                _, p, sha = (l.split(" ") + [""])[:3]
                if sha != shas[p]:
                    problems.append(f"{n}: {p}: content differs")
        if "sparkbench" not in lines.get("groups", "").split():
            problems.append(f"{n}: nvidia not in sparkbench ({lines.get('groups')})")
    return problems


def summarize(runs: list[dict], n: int) -> dict:
    walls = [r["wall_s"] for r in runs]
    per_host = lambda key: median([sum(c[key] for c in r["sshd"].values()) / n for r in runs])  # noqa: E731
    s = {"runs": len(runs), "wall_s": walls, "median_s": round(median(walls), 3),
         "sessions_per_host": round(per_host("sessions"), 2), "exec_per_host": round(per_host("exec"), 2),
         "sftp_per_host": round(per_host("sftp"), 2), "connections_per_host": round(per_host("connections"), 2),
         "max_sessions_one_host": max(max(c["sessions"] for c in r["sshd"].values()) for r in runs),
         "failed_runs": sum(1 for r in runs if r["rc"] != 0)}
    own = [r.get("own_calls") for r in runs if r.get("own_calls")]
    if own:
        s["own_calls_per_host"] = round(median([sum(o.values()) / n for o in own]), 2)
    conns = [r.get("own_connections") for r in runs if r.get("own_connections") is not None]
    if conns:
        s["own_connections_per_host"] = round(median([c / n for c in conns]), 2)
    ch = [r.get("changed") for r in runs if r.get("changed")]
    if ch:
        s["changed_per_host"] = round(median([sum(c.values()) / n for c in ch]), 2)
    return s


def bench_count(n: int, runs: int, tools: tuple[str, ...]) -> dict:
    print(f"bench: lab with {n} light hosts", flush=True)
    t0 = time.monotonic()
    hosts = lab_up(n)
    names = list(hosts)
    print(f"bench: lab up in {time.monotonic() - t0:.1f}s", flush=True)
    verbose_sshd(names)
    d = write_configs(hosts)
    logs = SshdLogs(names)
    out: dict = {"hosts": n, "cold": {t: [] for t in tools}, "warm": {t: [] for t in tools},
                 "problems": [], "cross_tool_warm": {}, "retried": []}
    # cold: reset, run, verify; the tools interleaved in each repetition (order rotated)
    for i in range(runs):
        order = tools[i % len(tools):] + tools[:i % len(tools)]
        for tool in order:
            in_hosts(names, RESET)
            rec = run_timed(tool, d, hosts, logs, out["retried"])
            bad = verify(names)
            if bad:
                out["problems"].append({"tool": tool, "mode": "cold", "run": i, "problems": bad[:10]})
                print(f"  {tool} cold: {bad[:3]}", flush=True)
            out["cold"][tool].append(rec)
            print(f"  n={n} cold {tool:9} {rec['wall_s']:7.2f}s rc={rec['rc']}", flush=True)
    # warm: converge with each tool in turn; the later ones must find nothing to change
    in_hosts(names, RESET)
    for j, tool in enumerate(tools):
        rec = run_once(tool, d, hosts, logs)
        out["cross_tool_warm"][tool] = {"after": list(tools[:j]), "changed": rec.get("changed"), "rc": rec["rc"]}
    bad = verify(names)
    if bad:
        out["problems"].append({"mode": "warm-setup", "problems": bad[:10]})
    for i in range(runs):
        order = tools[i % len(tools):] + tools[:i % len(tools)]
        for tool in order:
            rec = run_timed(tool, d, hosts, logs, out["retried"])
            out["warm"][tool].append(rec)
            print(f"  n={n} warm {tool:9} {rec['wall_s']:7.2f}s rc={rec['rc']} changed={rec.get('changed')}",
                  flush=True)
    in_hosts(names, RESET)
    out["summary"] = {mode: {t: summarize(out[mode][t], n) for t in tools} for mode in ("cold", "warm")}
    return out


def audit(tools: tuple[str, ...]) -> dict:
    """One verbose run per tool and mode on the current lab: each tool's own log of what it
    executed, to check the sshd counts against (not timed)."""
    from sparklab.state import LabRecord

    rec = LabRecord.load()
    hosts = {n: h.address for n, h in sorted(rec.hosts.items(), key=lambda kv: kv[1].index)}
    names = list(hosts)
    d = RUN_DIR / str(len(hosts))
    logs = SshdLogs(names)
    res: dict = {}
    for mode in ("cold", "warm"):
        for tool in tools:
            if mode == "cold":
                in_hosts(names, RESET)
            else:
                in_hosts(names, RESET)
                run_once(tool, d, hosts, logs)
            r = run_once(tool, d, hosts, logs, verbose=True)
            text = r.pop("verbose_out")
            own: dict[str, int] = {}
            for h, a in hosts.items():
                if tool == "ansible":
                    own[h] = len(re.findall(rf"^<{re.escape(a)}> SSH: EXEC (?:ssh|sftp|scp)", text, re.M))
                elif tool == "pyinfra":
                    own[h] = len(re.findall(rf"^\s*\[{h}\] >>> ", text, re.M))
                else:
                    own[h] = (r.get("own_calls") or {}).get(h, 0)
            res[f"{tool}/{mode}"] = {"own": own, "sshd_sessions": {h: c["sessions"] for h, c in r["sshd"].items()},
                                     "sshd_connections": {h: c["connections"] for h, c in r["sshd"].items()}}
    in_hosts(names, RESET)
    return res


# -- the report ----------------------------------------------------------------------------
def table(result: dict) -> str:
    tools = result["tools"]
    lines = ["| hosts | mode | " + " | ".join(f"{t} (s)" for t in tools)
             + " | ansible / sparkprov | pyinfra / sparkprov | "
             + " | ".join(f"{t} execs/host (conns)" for t in tools) + " |",
             "|---:|---|" + "---:|" * (len(tools) * 2 + 2)]
    for c in result["counts"]:
        for mode in ("cold", "warm"):
            s = c["summary"][mode]
            base = s["sparkprov"]["median_s"]
            walls = " | ".join(f"{s[t]['median_s']:.2f}" for t in tools)
            ratios = " | ".join(f"{s[t]['median_s'] / base:.1f}x" for t in ("ansible", "pyinfra"))
            execs = " | ".join(f"{s[t]['sessions_per_host']:g} ({s[t]['connections_per_host']:g})" for t in tools)
            when = f" ({c['date']})" if c.get("date") and c["date"] != result["date"] else ""
            lines.append(f"| {c['hosts']}{when} | {mode} | {walls} | {ratios} | {execs} |")
    return "\n".join(lines)


def readme_text(result: dict, json_rel: str) -> str:
    m, v = result["machine"], result["versions"]
    problems = [p for c in result["counts"] for p in c["problems"]]
    retried = [(c["hosts"], r["tool"]) for c in result["counts"] for r in c.get("retried", [])]
    # the untimed converge runs before the warm runs count too: a failure there is a failure
    setup_failed = [(c["hosts"], t, x["rc"]) for c in result["counts"] for t, x in c["cross_tool_warm"].items()
                    if x["rc"] != 0]
    failed = [(c["hosts"], mode, t, c["summary"][mode][t]["failed_runs"]) for c in result["counts"]
              for mode in ("cold", "warm") for t in result["tools"] if c["summary"][mode][t]["failed_runs"]]
    cross = []
    for c in result["counts"]:
        for t, x in c["cross_tool_warm"].items():
            if x["after"]:
                total = sum((x["changed"] or {}).values()) if x["changed"] else "?"
                cross.append(f"{t} after {'+'.join(x['after'])}: changed={total} (n={c['hosts']})")
    own_lines = []
    for c in result["counts"]:
        s = c["summary"]
        for mode in ("cold", "warm"):
            sp = s[mode]["sparkprov"]
            own_lines.append(f"n={c['hosts']} {mode}: sparkprov remote_calls/host {sp.get('own_calls_per_host')} "
                             f"vs sshd sessions/host {sp['sessions_per_host']}; ansible ControlMaster "
                             f"sockets/host {s[mode]['ansible'].get('own_connections_per_host')} vs sshd "
                             f"connections/host {s[mode]['ansible']['connections_per_host']}")
    audit_lines = [f"{k}: tool's own {sum(a['own'].values())} vs sshd sessions {sum(a['sshd_sessions'].values())}"
                   for k, a in (result.get("audit") or {}).items()]
    return f"""## Engines: sparkprov vs ansible-core vs pyinfra

    sudo .venv/bin/python bench/run_engines.py            # --hosts 2,8,16 --runs 3 (defaults)

The same provisioning work three ways (bench/work/): [`sparkprov.yaml`](work/sparkprov.yaml)
(run with the real CLI: `.venv/bin/invoke play bench/work/sparkprov.yaml --inventory
/run/sparkprov-lab/inventory.yaml`), [`ansible.yaml`](work/ansible.yaml) (`ansible-playbook`),
[`pyinfra_deploy.py`](work/pyinfra_deploy.py) (`pyinfra -y --sudo --parallel N`): a system
group `sparkbench`, user nvidia appended to it, five directories with owners and modes, a config
file (0644), a netplan-like file (0600, not applied), and a check that nvidia-smi answers with
driver >= 580 (the GB10 stand-in replays a real capture), all with sudo and its password.

Setup, as each tool's users would run it:

- **sparkprov**: the lab inventory (`become_password_file`, 0600); defaults (forks 32).
- **Ansible**: `ansible.cfg` written per host count (bench/.run/N/): `pipelining = True`,
  `forks` = hosts, `gathering = explicit` (nothing here needs facts), `interpreter_python`
  fixed (no discovery round trip), `ControlMaster=auto ControlPersist=60s`, strict host keys
  against the lab's known_hosts; the sudo password by `--become-password-file`. Files are
  `copy`'d from bench/work/files/, directories are one `file` task with a loop (one module
  run per item, as users write it). The ControlMaster sockets are closed after every run (not
  timed), so each run starts without a connection, as sparkprov's and pyinfra's do.
- **pyinfra**: a generated inventory.py with `ssh_key`, `ssh_known_hosts_file`,
  `ssh_strict_host_key_checking=yes` and `_sudo_password` read from the lab's password file;
  `--sudo --parallel N`; files `files.put` from bench/work/files/; the nvidia-smi check is a
  `server.Command` fact asserted in the deploy. (pyinfra hands the password to sudo through
  an askpass helper it uploads, with the password in the remote command's environment.)

Runs: **cold** = every host reset first (group and membership, directories and files removed,
through `nsenter`, not through sshd and not timed), **warm** = nothing to change. Each
repetition runs the three tools one after the other (order rotated), so they share the
machine's noise; the figure is the median of {result['runs']} runs. Lab hosts are *light*
(`invoke lab.up --light`: no dockerd); every host is a network namespace with its own sshd
on the same 2-core machine, so the numbers include the hosts' own CPU work.

**Remote executions** are counted on the hosts, from each lab sshd's log (`LogLevel VERBOSE`,
/var/log/sshd.log inside the host): one per `Starting session:` line, i.e. every SSH channel a
tool opened to run something: an exec (`command`), a file transfer (`subsystem 'sftp'`) or a
`shell`. Connections are the `Accepted publickey` lines. Cross-checks: sparkprov's recap
counts its own `remote_calls`; Ansible's own connection count is the ControlMaster sockets
it made; a verbose run of each tool (`-vvv` / `-vv`, not timed) counts what it says it ran.

Latest results ({result['date']}; machine: {m['cpus']} cores ({m['cpu']}), {m['memory_gib']} GiB,
{m['os']}, kernel {m['kernel']}, {m['openssh']}; sparkprov {v['sparkprov']} (Python {v['python']},
paramiko {v['sparkprov_paramiko']}), ansible-core {v['ansible-core']}, pyinfra {v['pyinfra']}
(paramiko {v['bench_paramiko']}, gevent {v['gevent']})). Raw figures: `{json_rel}`.

Wall time in seconds (median); ratios are the tool's median over sparkprov's; execs/host =
sshd sessions per host (connections per host in brackets).

{table(result)}

Checks of this run:

- hosts verified after every cold run (modes, owners, bytes, membership): {'all as wanted' if not problems else f'{len(problems)} problem(s), see the JSON'}
- failed runs: {'none' if not failed else failed}; runs retried after exit 1 (the source tree was being edited): {retried or 'none'}; failed converge runs before the warm runs (hosts, tool, exit code): {setup_failed or 'none'}
- the work is the same: after converging with one tool, the next found nothing to change: {'; '.join(cross) or '-'}
- own counts: {'; '.join(own_lines)}
- verbose audit at the smallest host count: {'; '.join(audit_lines) or 'not run'}
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hosts", default="2,8,16", help="host counts, comma-separated (default 2,8,16)")
    ap.add_argument("--runs", type=int, default=3, help="timed runs per tool, mode and host count (default 3)")
    ap.add_argument("--no-readme", action="store_true", help="write the JSON only, not bench/README.md")
    ap.add_argument("--down", action="store_true", help="tear the lab down at the end (invoke lab.down)")
    ap.add_argument("--merge", action="store_true",
                    help="keep today's results for the host counts not rerun (redo one count, e.g. "
                         "after another lab user disturbed it); the table shows each count's date")
    args = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("run as root (the lab needs it): sudo .venv/bin/python bench/run_engines.py")
    counts = [int(x) for x in args.hosts.split(",") if x]
    ensure_venv()
    check_work_files()
    bpy = BENCH_VENV / "bin" / "python"
    result = {"date": dt.datetime.now().strftime("%Y-%m-%d %H:%M"), "runs": args.runs, "tools": list(TOOLS),
              "machine": machine(),
              "versions": {"sparkprov": pip_version(Path(sys.executable), "sparkprov"),
                           "python": sys.version.split()[0],
                           "sparkprov_paramiko": pip_version(Path(sys.executable), "paramiko"),
                           "ansible-core": pip_version(bpy, "ansible-core"), "pyinfra": pip_version(bpy, "pyinfra"),
                           "bench_paramiko": pip_version(bpy, "paramiko"), "gevent": pip_version(bpy, "gevent")},
              "git": subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True, text=True,
                                    cwd=str(REPO)).stdout.strip(),
              "loadavg_start": os.getloadavg(), "counts": []}
    t0 = time.monotonic()
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"engines-{dt.date.today().isoformat()}.json"
    from sparklab.hosts import LabError

    kept = []
    if args.merge and path.exists():
        prev = json.loads(path.read_text())
        kept = [c for c in prev.get("counts", []) if c["hosts"] not in counts]
        if prev.get("audit") and min(counts) > min([c["hosts"] for c in kept] or [10**6]):
            result["audit"] = prev["audit"]
    for i, n in enumerate(counts):
        try:
            c = bench_count(n, args.runs, TOOLS)
            c["date"] = result["date"]
            result["counts"].append(c)
            result["counts"] = sorted(kept + [x for x in result["counts"] if x not in kept],
                                      key=lambda x: x["hosts"])
            if i == 0 and "audit" not in result:
                result["audit"] = audit(TOOLS)
        except LabError as exc:
            # the lab is shared: another `invoke lab.up` (tests, another engineer) rebuilt it
            result["interrupted"] = f"at {n} hosts: {exc}"
            print(f"bench: interrupted at {n} hosts ({exc}): someone else took the lab; "
                  f"rerun when it is free", flush=True)
            break
        finally:
            result["seconds"] = round(time.monotonic() - t0, 1)
            result["loadavg_end"] = os.getloadavg()
            path.write_text(json.dumps(result, indent=1))  # what is done so far survives
    if not result["counts"]:
        return 3
    result["counts"] = sorted(kept + [x for x in result["counts"] if x not in kept], key=lambda x: x["hosts"])
    print(table(result))
    print(f"bench: wrote {path.relative_to(REPO)} in {result['seconds']}s")
    if not args.no_readme and "interrupted" not in result:
        write_section("engines", readme_text(result, str(path.relative_to(BENCH))))
        print("bench: updated bench/README.md (engines section)")
    if args.down:
        lab_down()
    return 3 if "interrupted" in result else 0


if __name__ == "__main__":
    sys.exit(main())
