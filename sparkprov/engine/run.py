"""Running playbooks: hosts in parallel, plays as barriers, one fact gather per host.

Within a play each host goes through the tasks on its own (a slow host never holds back a fast
one); the next play starts when every host finished the previous one, so a play can read what
other hosts exported (e.g. their fabric addresses). A host that fails or is unreachable stops
there; the others go on.
"""

from __future__ import annotations

import getpass
import os
import re
import secrets
import stat
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from sparkprov import modules
from sparkprov.engine.args import render_args
from sparkprov.engine.expr import ExprError, Undefined, evaluate, has_template
from sparkprov.engine.gather import build_gather, parse_gather
from sparkprov.engine.playbook import Play, Playbook, Task
from sparkprov.engine.report import CENSORED, Report, TaskResult
from sparkprov.engine.validate import validate_playbook_expressions
from sparkprov.defaults import DEFAULT_FORKS
from sparkprov.errors import InputError, SparkprovError
from sparkprov.facts.base import Fact, FactError, HostInfo, ShellCtx
from sparkprov.hosts import Host, Inventory
from sparkprov.inputfiles import MAX_SECRET, read_text_checked
from sparkprov.modules.base import FactView, HostContext, Plan
from sparkprov.transport.base import BecomeMethod, Transport, Unreachable
from sparkprov.transport.connect import make_transport  # noqa: F401 (the commands' one connect path)
from sparkprov.transport.shell import quote


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
    verbose: bool = False  # say where the engine splits a play's apply, and why


class BecomePassword:
    """The sudo password: from the host's env var or file, or asked once for the whole run."""

    def __init__(self, interactive: bool):
        self.interactive = interactive
        self._prompted: str | None = None
        self._lock = threading.Lock()

    def configured(self, host: Host) -> str | None:
        if host.become_password_env and os.environ.get(host.become_password_env):
            return _one_line(host, f"${host.become_password_env}", os.environ[host.become_password_env])
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
            # a regular file of sane size (a FIFO would hang, /dev/zero would never end)
            return _one_line(host, path, read_text_checked(path, "become_password_file", MAX_SECRET).rstrip("\n"))
        if os.environ.get("SPARKPROV_BECOME_PASSWORD"):
            return _one_line(host, "$SPARKPROV_BECOME_PASSWORD", os.environ["SPARKPROV_BECOME_PASSWORD"])
        return self._prompted

    def prompt(self) -> str | None:
        with self._lock:
            if self._prompted is None and self.interactive:
                self._prompted = getpass.getpass("sudo password: ")
            return self._prompted


def _one_line(host: Host, where: str, password: str) -> str:
    """sudo reads one line: a password with a line break would be cut, the rest read as input."""
    if any(c in password for c in "\n\r\0"):
        raise SparkprovError(f"{host.name}: the sudo password from {where} holds a line break or NUL",
                             fix="put only the password, on one line")
    return password


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
            # every `when:` and template against the names each host will have, before the first
            # connection: an undefined name found at run time would leave a play half-applied
            validate_playbook_expressions(
                self.playbook, {h: set(self.inventory.hosts[h].vars) | set(self.options.extra_vars) for h in self.runs},
                hosts_of_play=lambda p: [h for h in self.inventory.resolve(p.hosts, where=p.where, what="play hosts")
                                         if h in self.runs])
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
                together = [h for h in play.stops_together if h in self.runs] or live
                if play.any_errors_fatal and any(self.runs[h].dead for h in together):
                    for h in together:
                        if not self.runs[h].dead:
                            self.runs[h].dead = True
                            self.report.record(TaskResult(h, play.name, "stopped", "-", "skipped",
                                                          "another host of this play failed, so every host of it "
                                                          "stops here (any_errors_fatal)" if h in live else
                                                          "another node of its group failed, so every node of it "
                                                          "stops here (any_errors_fatal)", subject=play.subject))
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
    # A play costs at most three round trips per host: one gather, one call applying every change
    # the play plans (each task planned against what the earlier ones predict, as in check mode),
    # one re-read of the touched facts to verify. The engine splits the apply only where it must:
    # a task reading a fact an earlier change touched without predicting it, a change that needs
    # another user (become) or files from the control machine. --verbose names each split.
    def _play_host(self, play: Play, hr: HostRun, play_hosts: list[str]) -> None:
        name = hr.host.name
        try:
            if hr.transport is None:
                hr.transport = make_transport(hr.host, self.options.accept_new_host_keys)
                hr.transport.connect()
            tasks = self._selected_tasks(play)
            become = play.become or any(t.become for t in tasks)
            ahead = (self._later_facts(play, hr, root=become) if self.options.gather_ahead and not hr.info
                     else [])
            self._gather(play, hr, tasks, become=become, extra=ahead, play_hosts=play_hosts)
            batch = _Batch()
            for task in tasks:
                if not self._plan_task(play, hr, task, play_hosts, batch):
                    return
            for handler in play.handlers:
                if handler.name in hr.notified:
                    if not self._plan_task(play, hr, handler, play_hosts, batch):
                        return
            self._flush(play, hr, play_hosts, batch)
            hr.notified.clear()
        except Unreachable as exc:
            hr.dead = True
            self.report.record(TaskResult(name, play.name, "connect", "-", "unreachable", exc.line(),
                                          subject=play.subject))
        except SparkprovError as exc:
            hr.dead = True
            self.report.record(TaskResult(name, play.name, "setup", "-", "failed", exc.line(), subject=play.subject))

    def _later_facts(self, play: Play, hr: HostRun, root: bool = True) -> list[Fact]:
        """The facts the host's tasks in the plays after `play` will read, as far as they can be
        known before those plays run (a task whose arguments need exports is left to its play).
        root False (a gather without become): not the facts that need root of a task with become,
        which only a gather with become reads as root (read without it, a 0600 root file's digest
        fails, and that error would stand for the task)."""
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
                    facts = self._task_facts(p, hr, task, info, live) or []
                except (SparkprovError, KeyError, ValueError):
                    continue
                as_root = self._become(p, task)
                out += [f for f in facts if root or not (f.needs_root and as_root)]
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

    def _plan_task(self, play: Play, hr: HostRun, task: Task, play_hosts: list[str], batch: "_Batch") -> bool:
        """Plan one task against what the host holds plus what the batch's changes predict; queue
        its changes (or record its result). False when the host must stop."""
        name = hr.host.name
        module = modules.registry()[task.module]()
        result = TaskResult(name, play.name, task.name, task.module, "ok", subject=play.subject)
        variables = self._variables(play, hr.host, hr.info)
        try:
            if task.when is not None and not evaluate(task.when, variables):
                result.status, result.msg = "skipped", f"condition false: {task.when}"
                return self._finish_task(hr, task, result, batch)
            args = render_args(task, variables)
            ctx = self._ctx(play, hr, task, play_hosts)
            become = self._become(play, task)
            facts = module.facts(args, ctx)
            stale = module.stale(args, ctx)
            unknown = [f for f in facts + stale if f.key in batch.unknown]
            if batch.items and not ctx.check and (unknown or batch.opaque or task.ignore_errors):
                # this task reads what an earlier change made and did not predict: apply first
                self._note(hr, f"{task.name}: needs what earlier changes made ("
                           + (", ".join(str(f) for f in unknown) or "a command's effects") + "): applying them first")
                opaque = batch.opaque
                if not self._flush(play, hr, play_hosts, batch):
                    return False
                if opaque:  # anything may have changed: read again what this task reads
                    stale = stale + facts
            for f in stale:
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
                # what later tasks plan against: the predictions, or "unknown until applied"
                for change in plan.changes:
                    predicted = {fact.key for fact, _ in change.predicts}
                    for fact, value in change.predicts:
                        hr.values[fact.key] = value
                        hr.errors.pop(fact.key, None)
                    if not ctx.check:
                        batch.unknown |= {f.key for f in change.touches if f.key not in predicted}
                        batch.opaque = batch.opaque or change.opaque
                if not ctx.check:
                    batch.entries.append(_Pending(task, module, args, ctx, plan, result, become))
                    if plan.exports:
                        self.exports[name].update(plan.exports)
                    hr.notified.update(task.notify)
                    if task.ignore_errors:
                        # the tasks after it plan against what it really did, failed or not
                        return self._flush(play, hr, play_hosts, batch)
                    return True
            if plan.exports and plan.failed is None:
                self.exports[name].update(plan.exports)
        except (ExprError, Undefined) as exc:
            result.status, result.msg = "failed", f"when: {exc}"
        except InputError as exc:
            result.status, result.msg = "failed", exc.line()
        except FactError as exc:
            result.status, result.msg = "failed", f"could not read state: {exc}"
        if result.status == "failed" and not task.ignore_errors and batch.items:
            # what was planned before this failure is applied, as it would have been task by task
            self._flush(play, hr, play_hosts, batch)
        return self._finish_task(hr, task, result, batch)

    def _finish_task(self, hr: HostRun, task: Task, result: TaskResult, batch: "_Batch") -> bool:
        if task.no_log:
            result.msg, result.diff = (CENSORED if result.msg else ""), []
        if batch.items:
            batch.entries.append(result)  # reported in task order, once the changes before it are applied
        else:
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

    def _note(self, hr: HostRun, text: str) -> None:
        if self.options.verbose:
            self.report.note(hr.host.name, text)

    def _flush(self, play: Play, hr: HostRun, play_hosts: list[str], batch: "_Batch") -> bool:
        """Apply every queued change (one call, split only where it must be), read back what was
        touched (one call) and re-plan each task: it converged only if nothing is left to do.
        Records the queued tasks' results in order; False when one failed."""
        entries = batch.entries
        batch.entries, batch.unknown, batch.opaque = [], set(), False
        items = [e for e in entries if isinstance(e, _Pending)]
        if not items:
            for r in entries:
                self.report.record(r)
            return True
        failed_at: int | None = None
        changes = [(i, c) for i, p in enumerate(items) for c in p.plan.changes]
        for group in _call_groups(changes, lambda ic: items[ic[0]].become):
            run_as_root = _as_root(group[0][1], items[group[0][0]].become)
            if run_as_root and hr.transport.become_method is None:
                # a change that alone needs root, in a task that does not: settle sudo now (one call)
                self._gather(play, hr, [], become=True, play_hosts=play_hosts)
            why = self._run_group(hr, group, run_as_root)
            if why is not None:
                failed_at, msg = why
                items[failed_at].plan = Plan.fail(msg)
                break
        applied = items if failed_at is None else items[:failed_at]
        if any(c.reconnect for p in applied for c in p.plan.changes):
            # a membership counts only in a new login: verify from one (the tasks that read what
            # it touched waited for this apply, as those facts were unknown until it ran)
            hr.transport.close()
            hr.transport.connect()
        touched = {f.key: f for p in applied for c in p.plan.changes for f in c.touches}
        for key in touched:
            hr.values.pop(key, None)
            hr.errors.pop(key, None)
        verify = [p for p in applied if all(c.verify for c in p.plan.changes)]
        if verify:
            extra = list(touched.values()) + [f for p in verify for f in p.module.facts(p.args, p.ctx)]
            self._gather(play, hr, [], become=any(p.become for p in verify), extra=extra, play_hosts=play_hosts)
        for entry in entries:
            if not isinstance(entry, _Pending):
                self.report.record(entry)
                continue
            p = entry
            i = items.index(p)
            if failed_at is not None and i > failed_at:
                break  # never ran: the host stops at the failed task, as it would task by task
            if i == failed_at:
                self._fill(p.result, p.plan, p.task)
            else:
                plan = p.plan
                if p in verify:
                    try:
                        again = p.module.plan(p.args, p.module.view(p.args, FactView(hr.values, hr.errors), p.ctx), p.ctx)
                    except FactError as exc:
                        again = Plan.fail(f"could not read state back: {exc}")
                    if again.failed:
                        plan = Plan.fail(f"after applying: {again.failed}")
                    elif again.changes:
                        plan = Plan.fail("applied, but the host still differs: "
                                         + "; ".join(c.summary for c in again.changes))
                    else:
                        plan.exports = {**plan.exports, **again.exports}
                for c in plan.changes:
                    plan.exports.update(c.exports)
                self._fill(p.result, plan, p.task, applied=True)
                if plan.failed is None and plan.exports:
                    self.exports[hr.host.name].update(plan.exports)
            if p.task.no_log:
                p.result.msg, p.result.diff = (CENSORED if p.result.msg else ""), []
            self.report.record(p.result)
            if p.result.status == "failed" and not p.task.ignore_errors:
                hr.dead = True
                return False
        return True

    def _run_group(self, hr: HostRun, group: list, as_root: bool) -> tuple[int, str] | None:
        """One remote call for these (task index, change) pairs, each change in a subshell between
        markers; the script stops at the first change that fails. (index, message) of a failure."""
        first = group[0][1]
        if first.prepare is not None:
            try:
                for local, remote in first.prepare():
                    hr.transport.put(local, remote)
            except (OSError, ValueError, SparkprovError) as exc:
                return group[0][0], f"{first.summary}: failed to prepare: {exc}"
        nonce = secrets.token_hex(6)
        parts = []
        for n, (_, c) in enumerate(group):
            parts.append(f"printf '\\n@@A:{nonce}:{n}:B\\n'\n( set -e\n{c.script}\n)\n__sp_rc=$?\n"
                         f"printf '\\n@@A:{nonce}:{n}:E:%s\\n' \"$__sp_rc\"\n[ $__sp_rc = 0 ] || exit $__sp_rc\n")
        timeouts = [c.timeout for _, c in group]
        timeout = sum(timeouts) if all(timeouts) else None
        res = hr.transport.run_script("".join(parts), become=as_root, timeout=timeout)
        outputs = _split_outputs(res.stdout, nonce, len(group))
        for n, (i, c) in enumerate(group):
            out, rc = outputs.get(n, ("", None))
            c.last_output = out
            if rc is None or rc != 0:
                detail = (res.stderr.strip() or out.strip()).splitlines()
                code = rc if rc is not None else res.rc
                why = detail[-1] if detail else f"exit status {code}"
                return i, f"{c.summary}: failed (rc={code}): {why}"
            if c.outcome is not None:
                why = c.outcome(out)
                if why:
                    return i, f"{c.summary}: {why}"
        return None

def _as_root(change, task_become: bool) -> bool:
    return change.become if change.become is not None else task_become


def _call_groups(changes: list, become_of) -> list[list]:
    """Consecutive changes that run as the same user share one remote call; a change that prepares
    files on the control machine starts one."""
    groups: list[list] = []
    for item in changes:
        _, c = item
        as_root = _as_root(c, become_of(item))
        prev = groups[-1] if groups else None
        if prev and _as_root(prev[0][1], become_of(prev[0])) == as_root and c.prepare is None:
            prev.append(item)
        else:
            groups.append([item])
    return groups


def _split_outputs(stdout: str, nonce: str, n: int) -> dict[int, tuple[str, int | None]]:
    """Each change's own output and exit status from the markers of a combined apply."""
    out: dict[int, tuple[str, int | None]] = {}
    for i in range(n):
        begin = f"\n@@A:{nonce}:{i}:B\n"
        if begin not in stdout:
            continue
        body = stdout.split(begin, 1)[1]
        m = re.search(rf"\n@@A:{nonce}:{i}:E:(\d+)\n", body)
        out[i] = (body[:m.start()] if m else body.split(f"\n@@A:{nonce}:", 1)[0], int(m.group(1)) if m else None)
    return out


@dataclass
class _Pending:
    task: Task
    module: Any
    args: Any
    ctx: HostContext
    plan: Plan
    result: TaskResult
    become: bool


@dataclass
class _Batch:
    entries: list = field(default_factory=list)  # queued tasks (_Pending) and finished results, in task order
    unknown: set = field(default_factory=set)    # facts queued changes touch without predicting
    opaque: bool = False                         # a queued change's effects are unknown

    @property
    def items(self) -> list[_Pending]:
        return [e for e in self.entries if isinstance(e, _Pending)]


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
