"""Defaults that several commands share: one place, so recipe rendering, staging, provisioning
and serving agree when the inventory leaves a setting unset.

Each is read from the host's inventory vars first (the variable named beside it), then from here.
Paths starting with `~/` mean the login user's home on that host.
"""

from __future__ import annotations

from typing import Any

MODEL_STORE = "~/vllm"                          # var model_store: HF_HOME with the hub layout (G22)
COMPILE_CACHE = "~/vllm-compile-cache"          # var compile_cache: mounted at /root/.cache/vllm
API_KEY_FILE = "~/.config/sparkprov/api_key"    # var api_key_file: 0600, read into VLLM_API_KEY
SERVE_PORT = 8000                               # var serve_port
SERVE_BIND = "0.0.0.0"                          # var serve_bind
RAY_PORT = 6379                                 # Ray head's GCS port
MASTER_PORT = 29501                             # vLLM native multi-node rendezvous (--master-port)
RAY_VERSION = "2.60.0"  # baked into a derived image when a deployment's image ships no Ray (never pip at start)
RAY_DERIVED_PREFIX = "sparkprov/ray-"  # those derived images: sparkprov/ray-VERSION:BASE-HASH
DEFAULT_FORKS = 32                              # --forks: hosts worked on at once

HOST_VAR_DEFAULTS: dict[str, Any] = {
    "model_store": MODEL_STORE,
    "compile_cache": COMPILE_CACHE,
    "api_key_file": API_KEY_FILE,
    "serve_port": SERVE_PORT,
    "serve_bind": SERVE_BIND,
}


def host_setting(host_vars: dict[str, Any], name: str) -> Any:
    """A shared setting for one host: its inventory var when set (an explicit empty value such as
    `api_key_file: ""` means "none"), else the default."""
    if name in host_vars and host_vars[name] is not None:
        return host_vars[name]
    return HOST_VAR_DEFAULTS[name]


def expand_home(path: str, home: str) -> str:
    """`~` and `~/x` against a known home; other paths unchanged."""
    if home and (path == "~" or path.startswith("~/")):
        return home.rstrip("/") + path[1:]
    return path
