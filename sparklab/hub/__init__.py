"""The lab's Hugging Face Hub: generated model repos served over the Hub's HTTP protocol.

    from sparklab.hub import ensure_hub, ensure_lab_hub, lab_token, stop_hub, HubControl, RepoSpec
    url = ensure_lab_hub(state_dir, "10.77.0.1", 8080)   # what lab.up runs: every catalog repo, small
    url = ensure_hub(state_dir, "10.77.0.1", 8080, repos=["Qwen/Qwen3.5-122B-A10B-FP8", ...], token=tok)
    # clients: HF_ENDPOINT=url HF_HUB_DISABLE_XET=1 (hf download, snapshot_download, ...)
    HubControl(url).set(throttle_bps=50_000_000)
    stop_hub(state_dir)

See server.py for the protocol and the /_lab control API, repos.py for what a generated repo holds.
"""

from .manage import (DEFAULT_REPOS, HubControl, catalog_repos, default_root, ensure_hub, ensure_lab_hub, hub_status,
                     lab_repos, lab_token, stop_hub)
from .repos import GeneratedRepo, RepoSpec, coerce_spec, ensure_generated, load_spec_file
from .server import HubServer, HubState, check_bind_address, start_in_thread

__all__ = [
    "DEFAULT_REPOS", "GeneratedRepo", "HubControl", "HubServer", "HubState", "RepoSpec", "check_bind_address",
    "catalog_repos", "coerce_spec", "default_root", "ensure_generated", "ensure_hub", "ensure_lab_hub", "hub_status",
    "lab_repos", "lab_token", "load_spec_file", "start_in_thread", "stop_hub",
]
