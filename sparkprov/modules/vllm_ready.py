"""vllm_ready: the deployment's serving container answers, and its answer is right.

Reads (ServeReady) the serving container's ID and state, /health, and the smoke-test answer
recorded for that container ID. Running, healthy and already smoke-tested: nothing to do (a
no-op run sends no request to the model). Otherwise the change is the wait, in one remote call
on the serving host: the container keeps running (a restart or exit fails at once, with its log),
Ray sees every node's GPU (executor ray), /health answers; then a warm-up request and the smoke
question (thinking set explicitly, G28), whose answer is recorded under the container ID. The
verify step reads that record back and checks the answer (G8: degenerate output fails).
"""

from __future__ import annotations

from pydantic import Field

from sparkprov.modules.base import Change, Export, FactView, HostContext, Module, Plan
from sparkprov.facts import probe
from sparkprov.facts.fabric import FabricInfo
from sparkprov.facts.serving import SMOKE_DIR, ServeReady
from sparkprov.modules._serving import ServeArgs
from sparkprov.serving import node
from typing import TypedDict


class Args(ServeArgs):
    ray_timeout: float = Field(default=300, gt=0, le=86400)
    health_timeout: float | None = Field(default=None, gt=0, le=86400)  # default: the recipe's
    verify: bool = False  # smoke-test again although this container passed already


class Serving(TypedDict):
    model: str              # the served model name clients ask for
    port: int
    api_key_file: str | None


SERVING: Export[dict[str, Serving]] = Export("serving", dict, "deployment -> what its server here answers as")


class VllmReady(Module):
    name = "vllm_ready"
    Args = Args
    doc = "The serving container answers /health and the smoke test (waits for Ray and the load)."

    def needs(self, args: Args, host: HostContext):
        dep = args.deployment
        named = {"ready": ServeReady(node.container_name(dep, host.name), node.base_url(dep, host.vars),
                                     node.key_file(host.vars))}
        if dep.cluster:
            named["fabric"] = FabricInfo()
        return named

    def plan(self, args: Args, facts: FactView, host: HostContext) -> Plan:
        dep, h = args.deployment, host.name
        st = facts.ready
        name = node.container_name(dep, h)
        recipe = node.catalog_for(dep).get(dep.model)
        smoke = recipe.smoke
        launch = node.launch(dep, h, host.vars, host.home, facts.fabric if dep.cluster else None, None)
        exports = SERVING({dep.name: {"model": launch.served_model_name, "port": dep.port_on(host.vars),
                                      "api_key_file": launch.ctx.api_key_file}})
        if st["status"] not in ("running", "restarting") and not host.check:
            return Plan.fail(f"{h}: {name} is {st['status']}" + (f" (restarts {st['restarts']})" if st["restarts"] else "")
                             + f": {probe.why_stopped(st.get('logs'))}")
        record = st.get("smoke")
        if record is not None and st.get("health") == 200 and not args.verify:
            problems = self._judge(record, smoke)
            if problems:
                return Plan.fail(f"{h}: smoke test {smoke.prompt!r} -> {(record.get('content') or '')[:80]!r}: "
                                 + "; ".join(problems))
            return Plan(msg=f"{name} serving; smoke test passed: {smoke.prompt} -> "
                            f"{(record.get('content') or '').strip()[:60]!r}", exports=exports)
        kwargs = dict(smoke.chat_template_kwargs) or {"enable_thinking": False}
        health = args.health_timeout or recipe.startup.health_timeout_s
        wait = health + (args.ray_timeout if dep.cluster and dep.executor == "ray" else 0)
        spec = {"container": name, "timeout": wait, "model": launch.served_model_name, "prompt": smoke.prompt,
                "max_tokens": smoke.max_tokens, "kwargs": kwargs, "smoke_timeout": 900, "record_dir": SMOKE_DIR,
                "ray_gpus": dep.nodes if dep.cluster and dep.executor == "ray" else 0}
        what = (f"wait for Ray to see {dep.nodes} nodes and GPUs, then " if spec["ray_gpus"] else "wait for ") + \
               f"/health (up to {wait:.0f}s), warm up, smoke test {smoke.prompt!r}"

        def outcome(out: str) -> str | None:
            try:
                doc = probe.parse(out)
            except ValueError:
                return f"the readiness probe printed no result: {out.strip()[-200:]!r}"
            if doc.get("failed"):
                fix = (" (fix: a first start compiles and autotunes for minutes (G20): raise --health-timeout)"
                       if "timed out" in doc["failed"] else "")
                return doc["failed"] + fix
            s = doc.get("smoke") or {}
            if (s.get("warmup") or {}).get("status") != 200:
                return f"warm-up request failed: HTTP {(s.get('warmup') or {}).get('status')}: {(s.get('warmup') or {}).get('error')}"
            return None

        return Plan([Change(what, probe.script("ready", node.base_url(dep, host.vars), node.key_file(host.vars), spec),
                            touches=[facts.fact("ready")], timeout=wait + 2 * 900 + 60, outcome=outcome)],
                    exports=exports)

    @staticmethod
    def _judge(record: dict, smoke) -> list[str]:
        if record.get("status") != 200:
            return [f"smoke request failed: HTTP {record.get('status')}: {record.get('error')}"]
        content = record.get("content")
        if not (content or "").strip() and record.get("finish") == "length" and record.get("reasoning"):
            return [f"content empty with finish_reason length: thinking used all {smoke.max_tokens} tokens (G28)"]
        return smoke.check(content)
