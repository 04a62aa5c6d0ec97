"""LiteLLM's proxy hook for on-demand deployments (issue 35, docs/on-demand.md).

Shipped read-only into the gateway's container next to its config.yaml (as sparkprov_ondemand.py,
with the node package as sparkprov_node/) and named in it (`litellm_settings: callbacks:
sparkprov_ondemand.proxy_handler_instance`). Before a request goes on (async_pre_call_hook) it is
held while its on-demand deployment is started (sparkprov/node/activate.py decides and asks the
nodes' guards); a request that cannot be served gets HTTP 503 with the reason. Each request held
ends once, where LiteLLM 1.108.7 ends it: an answer at its success hook, a stream where the stream
ends (its iterator hook: the last chunk, an error, or the client gone; the proxy calls no success
hook for a stream), a failure at the failure hook (also after a stream's error: counted once); a
sweeper stops idle ones. When the
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


def request_key(data: dict) -> str | None:
    """What names one request in every one of LiteLLM's hooks: its call id, set before the pre-call
    hook (a uuid, or the client's x-litellm-call-id). Not its logging object: the proxy takes that out
    of the data before the failure hook (proxy/utils.py post_call_failure_hook)."""
    key = data.get("litellm_call_id")
    return str(key) if key else None


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
            self.held: dict[str, list[str]] = {}   # request_key -> the model of each request held under it
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
            except activate.Unavailable as e:   # hold counted its end already: nothing held
                raise http_exception(status_code=503, detail={"error": f"sparkprov on demand: {e}"}) from None
            key = request_key(data)
            if key is not None:                  # a list: a client may give concurrent requests one id
                self.held.setdefault(key, []).append(model)
            return data

        def _ended(self, data: dict) -> str:
            """The request's end, counted once however many of LiteLLM's hooks report it; its model."""
            key = request_key(data)
            if key is None:                      # not identifiable: counted by its model, as it comes
                model = str(data.get("model") or "")
            else:
                held = self.held.get(key)
                if not held:                     # never held (not on demand, refused) or ended already
                    return str(data.get("model") or "")
                model = held.pop()
                if not held:
                    del self.held[key]
            if self.act is not None:
                self.act.done(model)
            return model

        async def async_post_call_success_hook(self, data, user_api_key_dict, response):
            self._ended(data)

        async def async_post_call_streaming_iterator_hook(self, user_api_key_dict, response, request_data):
            # a stream's end: its last chunk, an error from upstream, or the client gone (the proxy
            # closes this generator then); the chunks pass unchanged
            try:
                async for chunk in response:
                    yield chunk
            finally:
                self._ended(request_data)

        async def async_post_call_failure_hook(self, request_data, original_exception, user_api_key_dict,
                                               traceback_str=None):
            model = self._ended(request_data)
            if self.act is not None:
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
