"""Running playbooks: hosts in parallel, plays as barriers, one fact gather per host.

Within a play each host goes through the tasks on its own (a slow host never holds back a fast
one); the next play starts when every host finished the previous one, so a play can read what
other hosts exported (e.g. their fabric addresses). A host that fails or is unreachable stops
there; the others go on.
"""

from __future__ import annotations

import getpass
import os
import stat
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from sparkprov import modules
from sparkprov.data.inventory import Host, Inventory
from sparkprov.data.playbook import Play, Playbook, Task, render_args
from sparkprov.engine.expr import ExprError, Undefined, evaluate, has_template
from sparkprov.engine.facts import Fact, FactError, HostInfo, ShellCtx, build_gather, parse_gather
from sparkprov.engine.module import FactView, HostContext, Plan
from sparkprov.engine.report import CENSORED, Report, TaskResult
from sparkprov.errors import InputError, SparkprovError
from sparkprov.transport.base import BecomeMethod, Transport, Unreachable
from sparkprov.transport.shell import quote

DEFAULT_FORKS = 32


@dataclass
class RunOptions:
    check: bool = False
    diff: bool = False
    tags: set[str] = field(default_factory=set)
    skip_tags: set[str] = field(default_factory=set)
    forks: int = DEFAULT_FORKS
    accept_new_host_keys: bool = False
    extra_vars: dict[str, Any] = field(default_factory=dict)
    interactive: bool | None = None  # may we prompt for a sudo password? (default: stdin is a tty)
    # Read the facts of every play a host takes part in at first contact (one call), not play by
    # play. For playbooks whose later plays' facts do not depend on what earlier plays change on
    # that host except through `touches` (the serving and staging plays are built that way), so
    # that a run with nothing to do costs one remote call per host.
    gather_ahead: bool = False


class BecomePassword:
    """The sudo password: from the host's env var or file, or asked once for the whole run."""

    def __init__(self, interactive: bool):
        self.interactive = interactive
        self._prompted: str | None = None
        self._lock = threading.Lock()

    def configured(self, host: Host) -> str | None:
        if host.become_password_env and os.environ.get(host.become_password_env):
            return os.environ[host.become_password_env]
        if host.become_password_file:
            path = os.path.expanduser(host.become_password_file)
            try:
                st = os.stat(path)
            except OSError:
                raise SparkprovError(f"{host.name}: become_password_file {path} does not exist",
                                     fix="create it (mode 0600) or remove the setting") from None
            if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
                raise SparkprovError(f"{host.name}: {path} is readable by others (mode {oct(st.st_mode & 0o777)})",
                                     fix=f"chmod 600 {path}")
            with open(path, encoding="utf-8") as fh:
                return fh.read().rstrip("\n")
        if os.environ.get("SPARKPROV_BECOME_PASSWORD"):
            return os.environ["SPARKPROV_BECOME_PASSWORD"]
        return self._prompted

    def prompt(self) -> str | None:
        with self._lock:
            if self._prompted is None and self.interactive:
                self._prompted = getpass.getpass("sudo password: ")
            return self._prompted


class HostRun:
    """One host's state across the run."""

    def __init__(self, host: Host):
        self.host = host
        self.transport: Transport | None = None
        self.info: dict[str, str] = {}
        self.values: dict[tuple, Any] = {}
        self.errors: dict[tuple, str] = {}
        self.dead = False  # failed or unreachable: takes no further part
        self.notified: set[str] = set()

    def shell_ctx(self) -> ShellCtx:
        return ShellCtx(self.info.get("home"))


def make_transport(host: Host, accept_new_host_keys: bool) -> Transport:
    if host.connection == "local":
        from sparkprov.transport.local import LocalTransport

        return LocalTransport(host.name)
    from sparkprov.transport.ssh import SSHTransport

    return SSHTransport(host.name, host.address, user=host.user, port=host.port, key_file=host.ssh_key,
                        known_hosts=host.known_hosts, accept_new_host_keys=accept_new_host_keys,
                        connect_timeout=host.connect_timeout)


class Runner:
    def __init__(self, inventory: Inventory, playbook: Playbook, hosts: list[str], options: RunOptions,
                 report: Report):
        self.inventory = inventory
        self.playbook = playbook
        self.options = options
        self.report = report
        self.selected = hosts
        self.runs = {name: HostRun(inventory.hosts[name]) for name in hosts}
        self.exports: dict[str, dict[str, Any]] = {name: {} for name in hosts}
        interactive = options.interactive if options.interactive is not None else sys.stdin.isatty()
        self.password = BecomePassword(interactive)
        report.set_hosts(hosts)

    # -- the run ------------------------------------------------------------------------
    def run(self) -> Report:
        try:
            self._validate_templated_args()
            for play in self.playbook.plays:
                targets = [h for h in self.inventory.resolve(play.hosts, where=play.where, what="play hosts")
                           if h in self.runs]
                live = [h for h in targets if not self.runs[h].dead]
                self.report.play(play.name, live)
                if not live:
                    continue
                with ThreadPoolExecutor(max_workers=max(1, min(self.options.forks, len(live)))) as pool:
                    list(pool.map(lambda h: self._play_host(play, self.runs[h], live), live))
        finally:
            for hr in self.runs.values():
                if hr.transport is not None:
                    self.report.hosts[hr.host.name].remote_calls = hr.transport.remote_calls
                    hr.transport.close()
        return self.report

    def _validate_templated_args(self) -> None:
        """Catch bad templated arguments before touching any host, using what we know without
        connecting (inventory vars; the login user and home stand in with plausible values)."""
        for play in self.playbook.plays:
            for name in [h for h in self.inventory.resolve(play.hosts, where=play.where, what="play hosts") if h in self.runs]:
                host = self.inventory.hosts[name]
                user = host.user or getpass.getuser()
                variables = self._variables(play, host, {"user": user, "home": f"/home/{user}", "hostname": name})
                for task in play.tasks + play.handlers:
                    if has_template(task.args):
                        render_args(task, variables)

    def _variables(self, play: Play, host: Host, info: dict[str, str]) -> dict[str, Any]:
        return {**host.vars, **play.vars, **self.options.extra_vars, **info,
                "inventory_hostname": host.name, "inventory_hosts": list(self.inventory.hosts),
                "exports": self.exports, "groups": self.inventory.groups}

    def _selected_tasks(self, play: Play) -> list[Task]:
        out = []
        for task in play.tasks:
            tags = set(task.tags)
            if self.options.tags and not (tags & self.options.tags or "always" in tags):
                continue
            if tags & self.options.skip_tags:
                continue
            out.append(task)
        return out

    # -- one host, one play ---------------------------------------------------------------
    def _play_host(self, play: Play, hr: HostRun, play_hosts: list[str]) -> None:
        name = hr.host.name
        try:
            if hr.transport is None:
                hr.transport = make_transport(hr.host, self.options.accept_new_host_keys)
                hr.transport.connect()
            tasks = self._selected_tasks(play)
            become = play.become or any(t.become for t in tasks)
            ahead = self._later_facts(play, hr) if self.options.gather_ahead and not hr.info else []
            self._gather(play, hr, tasks, become=become, extra=ahead, play_hosts=play_hosts)
            for task in tasks:
                if not self._run_task(play, hr, task, play_hosts):
                    return
            for handler in play.handlers:
                if handler.name in hr.notified:
                    if not self._run_task(play, hr, handler, play_hosts):
                        return
            hr.notified.clear()
        except Unreachable as exc:
            hr.dead = True
            self.report.record(TaskResult(name, play.name, "connect", "-", "unreachable", exc.line()))
        except SparkprovError as exc:
            hr.dead = True
            self.report.record(TaskResult(name, play.name, "setup", "-", "failed", exc.line()))

    def _later_facts(self, play: Play, hr: HostRun) -> list[Fact]:
        """The facts the host's tasks in the plays after `play` will read, as far as they can be
        known before those plays run (a task whose arguments need exports is left to its play)."""
        plays = self.playbook.plays
        later = plays[plays.index(play) + 1:]
        info = self._pre_info(hr)
        out: list[Fact] = []
        for p in later:
            targets = self.inventory.resolve(p.hosts, where=p.where, what="play hosts")
            if hr.host.name not in targets:
                continue
            live = [h for h in targets if h in self.runs]
            for task in self._selected_tasks(p):
                try:
                    out += self._task_facts(p, hr, task, info, live) or []
                except (SparkprovError, KeyError, ValueError):
                    continue
        return out

    def _pre_info(self, hr: HostRun) -> dict[str, str]:
        if hr.info:
            return hr.info
        user = getattr(getattr(hr.transport, "conn", None), "user", None) or hr.host.user or getpass.getuser()
        return {"user": user, "hostname": hr.host.name}

    def _task_facts(self, play: Play, hr: HostRun, task: Task, info: dict[str, str],
                    play_hosts: list[str]) -> list[Fact] | None:
        """The facts a task will read, or None when its arguments need facts not known yet."""
        try:
            args = render_args(task, self._variables(play, hr.host, info))
        except InputError:
            return None
        module = modules.registry()[task.module]()
        return module.facts(args, self._ctx(play, hr, task, play_hosts, info))

    def _ctx(self, play: Play, hr: HostRun, task: Task, play_hosts: list[str], info: dict[str, str] | None = None) -> HostContext:
        return HostContext(hr.host.name, self._variables(play, hr.host, info or hr.info), info or hr.info,
                           check=self._check(task), exports=self.exports, play_hosts=play_hosts,
                           become=self._become(play, task))

    def _check(self, task: Task) -> bool:
        return task.check_mode if task.check_mode is not None else self.options.check

    @staticmethod
    def _become(play: Play, task: Task) -> bool:
        return task.become if task.become is not None else play.become

    def _gather(self, play: Play, hr: HostRun, tasks: list[Task], *, become: bool, extra: list[Fact] = (),
                play_hosts: list[str] = ()) -> None:
        """One remote call: host info (first time), the become probe (first time it is needed),
        and every fact the remaining tasks will read that we do not hold."""
        info = self._pre_info(hr)
        wanted: dict[tuple, Fact] = {}
        if not hr.info:
            wanted[HostInfo().key] = HostInfo()
        for f in extra:
            wanted[f.key] = f
        for task in tasks + list(play.handlers):
            for f in self._task_facts(play, hr, task, info, list(play_hosts)) or []:
                wanted[f.key] = f
        missing = [f for k, f in wanted.items() if k not in hr.values and k not in hr.errors]
        probe = become and hr.transport.become_method is None
        if not missing and not probe:
            return
        t = hr.transport
        password = (t.become_password if t.become_method is BecomeMethod.PASSWORD
                    else self.password.configured(hr.host) if probe or become else None)
        gs = build_gather(missing, hr.shell_ctx(), become=become, password=password, probe_become=probe)
        result = hr.transport.run_script(gs.script)
        parsed = parse_gather(gs, result.stdout)
        if result.rc != 0:
            # the script died before some sections: say how, instead of only "no output"
            tail = (result.stderr.strip().splitlines() or [""])[-1]
            for key, msg in parsed.errors.items():
                if msg.startswith("no output"):
                    parsed.errors[key] = f"{msg}: exit status {result.rc}" + (f": {tail}" if tail else "")
        hr.values.update(parsed.values)
        hr.errors.update(parsed.errors)
        if HostInfo().key in parsed.values:
            hr.info = parsed.values[HostInfo().key]
        elif not hr.info:
            raise SparkprovError(f"{hr.host.name}: cannot read host facts: {parsed.errors.get(HostInfo().key) or result.stderr.strip()}")
        if probe:
            self._settle_become(hr, parsed.become, password)
            if parsed.become == "password-needed" and hr.transport.become_method is BecomeMethod.PASSWORD:
                # Facts that needed root could not be read before we had the password.
                for f in missing:
                    if f.needs_root:
                        hr.values.pop(f.key, None)
                        hr.errors.pop(f.key, None)
                self._gather(play, hr, tasks, become=become, extra=extra, play_hosts=play_hosts)

    def _settle_become(self, hr: HostRun, how: str | None, password: str | None) -> None:
        settle_become(hr, how, password, self.password)

    def _run_task(self, play: Play, hr: HostRun, task: Task, play_hosts: list[str]) -> bool:
        """Run one task on one host; False when the host must stop."""
        name = hr.host.name
        module = modules.registry()[task.module]()
        result = TaskResult(name, play.name, task.name, task.module, "ok")
        variables = self._variables(play, hr.host, hr.info)
        try:
            if task.when is not None and not evaluate(task.when, variables):
                result.status, result.msg = "skipped", f"condition false: {task.when}"
                self.report.record(result)
                return True
            args = render_args(task, variables)
            ctx = self._ctx(play, hr, task, play_hosts)
            become = self._become(play, task)
            facts = module.facts(args, ctx)
            for f in module.stale(args, ctx):
                hr.values.pop(f.key, None)
                hr.errors.pop(f.key, None)
            if any(f.key not in hr.values and f.key not in hr.errors for f in facts):
                # Read what this task needs together with what the tasks after it need.
                selected = self._selected_tasks(play)
                ahead = selected[selected.index(task):] if task in selected else [task]
                self._gather(play, hr, ahead, become=become or play.become, extra=facts, play_hosts=play_hosts)
            plan = module.plan(args, module.view(args, FactView(hr.values, hr.errors), ctx), ctx)
            self._fill(result, plan, task)
            if plan.failed is None and plan.skipped is None and plan.changes:
                if ctx.check:
                    for change in plan.changes:
                        for fact, value in change.predicts:
                            hr.values[fact.key] = value
                            hr.errors.pop(fact.key, None)
                else:
                    plan = self._apply(play, hr, task, module, args, ctx, plan, become)
                    self._fill(result, plan, task, applied=True)
            if plan.exports and plan.failed is None:
                self.exports[name].update(plan.exports)
        except (ExprError, Undefined) as exc:
            result.status, result.msg = "failed", f"when: {exc}"
        except InputError as exc:
            result.status, result.msg = "failed", exc.line()
        except FactError as exc:
            result.status, result.msg = "failed", f"could not read state: {exc}"
        if task.no_log:
            result.msg, result.diff = (CENSORED if result.msg else ""), []
        self.report.record(result)
        if result.status == "changed":
            hr.notified.update(task.notify)
        if result.status == "failed" and not task.ignore_errors:
            hr.dead = True
            return False
        return True

    def _fill(self, result: TaskResult, plan: Plan, task: Task, applied: bool = False) -> None:
        result.warnings = list(plan.warnings)
        if plan.failed is not None:
            result.status, result.msg = "failed", plan.failed
        elif plan.skipped is not None:
            result.status, result.msg = "skipped", plan.skipped
        elif plan.changes:
            result.status = "changed"
            prefix = "" if applied or not self._check(task) else "would: "
            result.msg = prefix + "; ".join(c.summary for c in plan.changes)
            result.diff = [c.diff.as_dict() for c in plan.changes if c.diff]
        else:
            result.status, result.msg = "ok", plan.msg

    def _apply(self, play: Play, hr: HostRun, task: Task, module, args, ctx: HostContext, plan: Plan,
               become: bool) -> Plan:
        """Apply, read back what was touched, and re-plan: the task converged only if the
        re-plan finds nothing left to do."""
        for group in _call_groups(plan.changes, become):
            run_as_root = group[0].become if group[0].become is not None else become
            if run_as_root and hr.transport.become_method is None:
                # a change that alone needs root, in a task that does not: settle sudo now (one call)
                self._gather(play, hr, [], become=True, play_hosts=ctx.play_hosts)
            script = "set -e\n" + "\n".join(c.script for c in group) + "\n"
            timeout = sum(c.timeout for c in group) if all(c.timeout for c in group) else None
            res = hr.transport.run_script(script, become=run_as_root, timeout=timeout)
            group[-1].last_output = res.stdout
            if res.rc != 0:
                detail = (res.stderr.strip() or res.stdout.strip()).splitlines()
                why = detail[-1] if detail else f"exit status {res.rc}"
                return Plan.fail(f"{group[0].summary}: failed (rc={res.rc}): {why}")
            if group[-1].outcome is not None:
                why = group[-1].outcome(res.stdout)
                if why:
                    return Plan.fail(f"{group[-1].summary}: {why}")
            for c in group:
                plan.exports.update(c.exports)
        touched = [f for c in plan.changes for f in c.touches]
        for f in touched:
            hr.values.pop(f.key, None)
            hr.errors.pop(f.key, None)
        if any(c.reconnect for c in plan.changes):
            hr.transport.close()
            hr.transport.connect()
        if not all(c.verify for c in plan.changes):
            return plan
        self._gather(play, hr, [], become=become, extra=module.facts(args, ctx), play_hosts=ctx.play_hosts)
        again = module.plan(args, module.view(args, FactView(hr.values, hr.errors), ctx), ctx)
        if again.failed:
            return Plan.fail(f"after applying: {again.failed}")
        if again.changes:
            return Plan.fail("applied, but the host still differs: " + "; ".join(c.summary for c in again.changes))
        # Keep the summaries and diffs of what was done; take exports from the fresh plan.
        plan.exports = {**plan.exports, **again.exports}
        return plan


def _call_groups(changes: list, become: bool) -> list[list]:
    """Consecutive changes that run as the same user share one remote call; a change whose
    output is judged (outcome) ends its call, so that it reads its own output."""
    groups: list[list] = []
    for c in changes:
        as_root = c.become if c.become is not None else become
        prev = groups[-1] if groups else None
        if prev and (prev[0].become if prev[0].become is not None else become) == as_root and prev[-1].outcome is None:
            prev.append(c)
        else:
            groups.append([c])
    return groups


def become_from_probe(t: Transport, how: str | None, password: str | None) -> bool:
    """Set the transport's become method from the gather probe's answer (`how`) where that
    answer settles it; False when it does not (a password is missing or wrong, no sudo)."""
    if how == "root":
        t.become_method = BecomeMethod.NONE
    elif how == "nopasswd":
        t.become_method = BecomeMethod.PASSWORDLESS
    elif how == "password-ok":
        t.become_method, t.become_password = BecomeMethod.PASSWORD, password
    else:
        return False
    return True


def settle_become(hr: HostRun, how: str | None, password: str | None, passwords: BecomePassword) -> None:
    """Set how the host's transport becomes root from what the gather script's probe found
    (`how`), prompting once for a password where sudo needs one. Raises with the host and the fix."""
    t = hr.transport
    name = hr.host.name
    if become_from_probe(t, how, password):
        return
    if how == "password-bad":
        raise SparkprovError(f"{name}: sudo rejected the password for {hr.info.get('user')}",
                             fix="check become_password_env / become_password_file in the inventory")
    elif how == "nosudo":
        raise SparkprovError(f"{name}: become is needed but sudo is not installed", fix="install sudo or connect as root")
    elif how == "password-needed":
        pw = passwords.prompt()
        if pw is None:
            raise SparkprovError(f"{name}: sudo needs a password for {hr.info.get('user')}",
                                 fix="set become_password_env or become_password_file in the inventory, "
                                     "or SPARKPROV_BECOME_PASSWORD, or run interactively")
        check = t.run_script("printf '%s\\n' " + quote(pw) + " | sudo -k -S -p '' true")
        if check.rc != 0:
            raise SparkprovError(f"{name}: sudo rejected the password for {hr.info.get('user')}",
                                 fix="check the password")
        t.become_method, t.become_password = BecomeMethod.PASSWORD, pw
    else:
        raise SparkprovError(f"{name}: could not tell how to become root")
