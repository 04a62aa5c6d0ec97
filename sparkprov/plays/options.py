"""cluster-up's options: one object from the parsed command line to the plays (issue 37).

Each field is declared once with its help and kind (sparkprov/options.py): the command line is made
of it (sparkprov/cli/cluster.py), plays/cluster.py runs with it, plays/serve.py builds the plays'
module arguments from it, and a rollback (plays/upgrade.py, `invoke rollback`) starts a recorded
start again with it. Adding an option: a field here, and the code that uses it.

Light on purpose: the command line imports it when `invoke --list` loads the tasks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sparkprov.options import (DEPLOYMENT, Choice, Excludes, Files, Flag, Image, Int, Needs, Number, Text, Words, common,
                               option)
from sparkprov.serving.bench import DEFAULT_GATE_RATIO, RESULTS_DIR

_PER_DEPLOYMENT = "a playbook sets pp:, dp: and ep: per deployment"


def _needs_model(name: str, fix: str = _PER_DEPLOYMENT) -> Needs:
    return Needs(name, lambda o: o.model is not None, "--model", fix=fix)


def _needs_bench_gate(name: str, what: str) -> Needs:
    return Needs(name, lambda o: o.gate == "bench", "--gate bench",
                 fix=f"give --gate bench --{name.replace('_', '-')} {what}, or leave it out")


@dataclass
class UpOptions:
    model: str | None = option("Serve this catalog model without a playbook (invoke models lists them); with --tp, "
                               "--hosts, --name", Text(max_len=256))
    tp: int | None = option("Tensor-parallel size (with --model: of the new deployment; else start the playbook's "
                            "deployments of this size). Without --model or --playbook, 1 reads playbooks/serve.yaml "
                            "and N > 1 playbooks/cluster.yaml", Int(1, 64))
    pp: int = option("With --model: pipeline-parallel size (default 1): a cluster spans tp x pp Sparks", Int(1, 64),
                     default=1)
    dp: int = option("With --model: data-parallel replicas (default 1), one Spark each, behind rank 0's API (executor "
                     "native): the deployment spans tp x pp x dp Sparks", Int(1, 64), default=1)
    ep: bool = option("With --model: --enable-expert-parallel (MoE recipes; experts split over tp x dp)", Flag())
    hosts: str | None = common("hosts", "Hosts, groups or patterns to act on, comma-separated (default: every host "
                                        "the playbook names)")
    name: str | None = option("Deployment name for --model (default: the model alias)", DEPLOYMENT)
    executor: str | None = option("Multi-node executor: ray (default: a Ray cluster) or native (vLLM's own "
                                  "--nnodes/--node-rank)", Choice(("ray", "native")))
    playbook: str | None = option("Serve playbook (deployments: model, hosts, tp, overrides). Default: "
                                  "playbooks/cluster.yaml (playbooks/serve.yaml with --tp 1)")
    inventory: str | None = common("inventory")
    check: bool = option("Preflight and plan only: say what would start or be replaced, change nothing", Flag())
    json: bool = common("json")
    deployments: list[str] | None = option("Only these deployments of the playbook (comma-separated names)",
                                           Words())
    recipes: list[str] = option("A user recipe file merged over the catalog (repeatable)", Files())
    stage: bool = option("Stage the weights first, as stage-weights does, in the same run (with --check: says what "
                         "it would stage)", Flag())
    unload_ollama: bool = option("Unload models an Ollama server holds in unified memory before the load (G14)",
                                 Flag())
    drop_caches: bool = option("Drop the page cache as root before a load (G15; default on, --no-drop-caches to "
                               "skip)", Flag(), default=True)
    image_source: str = option("Where a node missing the image gets it: auto (registry, then a peer over the "
                               "fabric), registry, or peer", Choice(("auto", "registry", "peer")), default="auto")
    ray_timeout: float = option("Seconds to wait for every Ray node and GPU to join (default 300)",
                                Number(0, 86400, unit="seconds"), default=300.0)
    health_timeout: float | None = option("Seconds to wait for /health (default: the recipe's "
                                          "startup.health_timeout_s)", Number(0, 86400, unit="seconds"))
    verify: bool = option("Also warm up and smoke-test deployments that are already up and unchanged", Flag())
    limit: str | None = common("limit")
    forks: int = common("forks")
    accept_new_host_keys: bool = common("accept_new_host_keys")
    image: str | None = option("Run this image instead of the recipe's (one deployment: how a new build is tried); "
                               "if its start fails its smoke test, every node goes back to the deployment's last "
                               "good start (invoke history)", Image())
    force_degraded_fabric: bool = option("Start a multi-node deployment even over a node whose last fabric "
                                         "qualification (invoke provision) recorded a degraded rail (refused without "
                                         "it, naming the rail)", Flag())
    gate: str = option("What an upgrade (a start replacing a running one) must pass to be kept: smoke (default: its "
                       "smoke test) or bench (also invoke bench at the parameters of the last good start's stored "
                       "run, keeping --gate-ratio of its output tok/s); a start that fails goes back to the last "
                       "good start", Choice(("smoke", "bench")), default="smoke")
    gate_ratio: float = option("With --gate bench: the share of the last good start's output tok/s to keep "
                               f"(default {DEFAULT_GATE_RATIO})", Number(0.01, 10), default=DEFAULT_GATE_RATIO)
    results: str = option("With --gate bench: the folder invoke bench stores its runs in, where the last good "
                          "start's run is found and the gate's run is stored (default ~/.local/share/sparkprov/bench)",
                          default=RESULTS_DIR)
    replace: bool = option("Make room on the deployment's hosts: the other deployments serving there are removed "
                           "first (on every host they run on) and, if the new one fails, started again from their "
                           "last good start", Flag())
    pin: bool = option("Run each deployment by the registry digest its nodes' docker holds for its image "
                       "(REPO@sha256:..., after the image play): a restart or a later tag move cannot change what "
                       "runs. Refused before any container starts when a node's image has no registry digest (built "
                       "or copied there) or the nodes hold different digests; a pinned deployment started again with "
                       "--pin is left running", Flag())
    park: bool = option("Park the deployments: every step of a start (preflight, image, weights) but the start "
                        "itself: their containers are created and left stopped, labelled on demand (as a serve "
                        "playbook's on_demand: true); the gateway starts one when a request asks for its model "
                        "(docs/on-demand.md)", Flag())
    # not an option: per deployment, the other deployments removed before it starts (plays/replace.py)
    replacing: dict[str, list[str]] = field(default_factory=dict)

    RULES = (_needs_bench_gate("gate_ratio", "R"), _needs_bench_gate("results", "DIR"),
             # it names the deployment --model makes; a playbook names its own
             _needs_model("name", "give --model ALIAS --name NAME, or leave out --name"),
             _needs_model("pp"), _needs_model("dp"), _needs_model("ep"),
             Excludes("model", "playbook", "both say what to start: --model one catalog model, --playbook the "
                                           "deployments it lists"),
             Excludes("model", "deployments", "both say what to start: --deployments selects a playbook's "
                                              "deployments, --model starts one of its own"))
