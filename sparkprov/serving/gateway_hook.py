"""LiteLLM's proxy hook for on-demand deployments (issue 35, docs/on-demand.md).

Shipped read-only into the gateway's container next to its config.yaml (as sparkprov_ondemand.py,
with the node package as sparkprov_node/) and named in it (`litellm_settings: callbacks:
sparkprov_ondemand.proxy_handler_instance`). Before a request goes on (async_pre_call_hook) it is
held while its on-demand deployment is started (sparkprov/node/activate.py decides and asks the
nodes' guards); a request that cannot be served gets HTTP 503 with the reason. After each request
(its success or failure hook) the deployment's use is counted; a sweeper stops idle ones. When the
proxy builds it (LiteLLM's startup, in its event loop; elsewhere at its first request for an on-demand
model) it rebuilds its view from the guards and starts the sweeper.

LiteLLM's names (CustomLogger, fastapi's HTTPException) come from the proxy's own packages; the
handler is built by `make_handler` from them, so the logic is tested here without LiteLLM.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys

# The name the gateway's container loads this file under (LiteLLM imports a callback's file from the
# config's folder by its path), and the node package's there.
MODULE = "sparkprov_ondemand"
if __name__ == MODULE:  # in the gateway's container: the node package beside this file
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from sparkprov_node import activate  # type: ignore[import-not-found]
else:
    from sparkprov.node import activate

CONFIG = os.environ.get("SPARKPROV_ONDEMAND_CONFIG", "/app/ondemand.json")
# the hook's view (Activator.view), rewritten at each sweep: `invoke status` reads it on the gateway's host
VIEW = os.environ.get("SPARKPROV_ONDEMAND_VIEW", "/app/state/ondemand-view.json")
SWEEP_EVERY_S = 10.0


def write_view(path: str, view: dict) -> None:
    """The view to its file, atomically (a reader never sees half of it), readable by the host's user."""
    tmp = path + ".new"
    with open(tmp, "w") as fh:
        json.dump(view, fh)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


def make_handler(base: type, http_exception: type, load, sweep_every_s: float = SWEEP_EVERY_S,
                 view_path: str | None = VIEW) -> type:
    """The hook class over LiteLLM's CustomLogger (`base`); `load()` gives the Activator; its view
    goes to `view_path` at each sweep (None: nowhere)."""

    class SparkprovOnDemand(base):  # type: ignore[misc, valid-type]
        def __init__(self):
            super().__init__()
            self.act = None
            self.sweeper = None
            self.loading = None
            self.configured = None
            try:  # inside LiteLLM's proxy: built while its startup loads the config, in its loop
                asyncio.get_running_loop()
            except RuntimeError:
                return
            # the view and the sweeper now, not at the first request: a model that came back with its
            # host (the gateway's host rebooted) is stopped when idle though no request comes
            self._ready()

        def _configured(self):
            if self.configured is None:
                self.configured = load()
            return self.configured

        def _ready(self):
            # one view for every request: the first requests after a start of the proxy come at once,
            # and each building its own while the guards answer would start a model once per view
            if self.loading is None:
                self.loading = asyncio.ensure_future(self._load())
            return asyncio.shield(self.loading)

        async def _load(self):
            act = self._configured()
            await act.rebuild()            # after a restart of the proxy: what the guards hold
            self.act = act
            self.sweeper = asyncio.ensure_future(self._sweep())
            return act

        async def _sweep(self):
            while True:
                await asyncio.sleep(sweep_every_s)
                try:
                    await self.act.sweep()
                except Exception as e:  # noqa: BLE001 - the sweeper goes on; the next round tries again
                    print(f"sparkprov on-demand sweep: {type(e).__name__}: {e}", flush=True)
                if view_path:
                    try:
                        write_view(view_path, self.act.view())
                    except OSError as e:  # status shows no idle time then; serving goes on
                        print(f"sparkprov on-demand view: {e}", flush=True)

        async def async_pre_call_hook(self, user_api_key_dict, cache, data, call_type):
            model = str(data.get("model") or "")
            if self._configured().named(model) is None:
                return data                # not on demand: never held, not even by a rebuild under way
            act = await self._ready()
            try:
                await act.hold(model)
            except activate.Unavailable as e:
                raise http_exception(status_code=503, detail={"error": f"sparkprov on demand: {e}"}) from None
            return data

        async def async_post_call_success_hook(self, data, user_api_key_dict, response):
            if self.act is not None:
                self.act.done(str(data.get("model") or ""))

        async def async_post_call_failure_hook(self, request_data, original_exception, user_api_key_dict,
                                               traceback_str=None):
            if self.act is not None:
                model = str(request_data.get("model") or "")
                self.act.done(model)
                await self.act.recheck(model)   # a deployment stopped under its feet is started again

    return SparkprovOnDemand


def load_config(path: str = CONFIG):
    with open(path) as fh:
        return activate.activator_from(json.load(fh))


try:  # inside LiteLLM's proxy
    from fastapi import HTTPException  # type: ignore[import-not-found]
    from litellm.integrations.custom_logger import CustomLogger  # type: ignore[import-not-found]
except ImportError:  # anywhere else (sparkprov's own tests build the handler with make_handler)
    proxy_handler_instance = None
else:
    proxy_handler_instance = make_handler(CustomLogger, HTTPException, load_config)()
