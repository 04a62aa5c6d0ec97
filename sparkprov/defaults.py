"""Defaults that several commands share: one place, so recipe rendering, staging, provisioning
and serving agree when the inventory leaves a setting unset.

The defaults of inventory variables are declared in sparkprov/inventory_vars.py (a reader gets a
variable with `inventory_vars.value`); the names here are for code that needs the default itself.
Paths starting with `~/` mean the login user's home on that host.
"""

from __future__ import annotations

from sparkprov.inventory_vars import default

# The inventory variables' defaults (declared, with their sources, in sparkprov/inventory_vars.py):
MODEL_STORE = default("model_store")        # HF_HOME with the hub layout (G22)
COMPILE_CACHE = default("compile_cache")    # mounted at /root/.cache/vllm
API_KEY_FILE = default("api_key_file")      # 0600, read into VLLM_API_KEY
SERVE_PORT = default("serve_port")
SERVE_BIND = default("serve_bind")
RAY_PORT = 6379                                 # Ray head's GCS port
MASTER_PORT = 29501                             # vLLM native multi-node rendezvous (--master-port)
RAY_VERSION = "2.60.0"  # baked into a derived image when a deployment's image ships no Ray (never pip at start)
RAY_DERIVED_PREFIX = "sparkprov/ray-"  # those derived images: sparkprov/ray-VERSION:BASE-HASH
DEFAULT_FORKS = 32                              # --forks: hosts worked on at once


def expand_home(path: str, home: str) -> str:
    """`~` and `~/x` against a known home; other paths unchanged."""
    if home and (path == "~" or path.startswith("~/")):
        return home.rstrip("/") + path[1:]
    return path
