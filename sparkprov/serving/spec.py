"""The containers a deployment wants on each host: the exact `docker run` argv, labels and hashes,
every one assembled by `assemble` from the rendered launch's parts (catalog/render.py); the roles
and variants (single server, Ray head and worker, native ranks, systemd's foreground) are its
parameters.

Single node: the recipe's server (what `invoke recipe` prints, with the same recipe hash), with
sparkprov's deployment labels.

Ray cluster (tp N > 1), built from the same rendered launches (one per node: each node's own
VLLM_HOST_IP and NCCL/Gloo/UCX bindings from its FabricInfo):

* `sparkprov-NAME-head` on the first host: `ray start --head` on the node's fabric address, then
  (inside the container, polling `ray status`) it waits until the cluster has N GPUs, reads the
  API key file into VLLM_API_KEY and execs `vllm serve ... --tensor-parallel-size TP
  [--pipeline-parallel-size PP] --distributed-executor-backend ray` (TP x PP = N, one GPU per
  Spark). sparkprov watches the same `ray status` from outside, with progress and a timeout, and
  fails the bring-up naming the node that did not join.
* `sparkprov-NAME-worker` on every other host: `ray start --address HEAD:PORT --block`.

Every Ray process of both runs with Ray's token authentication (RAY_AUTH_MODE=token, the token a
0600 file of the node mounted read-only; only its path is in the environment), and the head has
no dashboard. Their ports bind every interface: the firewall module closes them to non-members.

All have host networking, `--init` (Ray leaves daemons behind the main process), the restart
policy of the recipe (a reboot brings the whole cluster back: workers retry until the head is up,
the head waits for them, and leaves for a fresh start when its own Ray is gone), and the store and
compile cache mounts. The wrapper texts are constants; the model and flags follow them as separate
argv words ("$@"), as in the catalog's wrapper.
"""

from __future__ import annotations

import hashlib
import json
import shlex
from dataclasses import dataclass, field, replace

from sparkprov.catalog.render import KEY_PATH, WRAPPER_NAME, Launch
from sparkprov.node.ondemand import IDLE_STOP_LABEL, ON_DEMAND_LABEL, UTILIZATION_LABEL
from sparkprov.serving import supervise

ROLE_SERVER, ROLE_HEAD, ROLE_WORKER = "server", "ray-head", "ray-worker"
ROLE_RANK0, ROLE_RANK = "rank0", "rank"  # native multi-node: rank 0 serves the API, the others --headless
SERVING_ROLES = (ROLE_SERVER, ROLE_HEAD, ROLE_RANK0)

# No `pip install` at container start (001 §6's NGC scripts do): an image without Ray fails here
# with "ray: command not found" (exit 127), as it would on a Spark that boots without internet;
# the preflight names the fix (executor native, or an image that has Ray).
# A `ray status` that finds no GCS fails after about 40 s (measured with Ray 2.60, the lab image's):
# three in a row is Ray gone from the head for two minutes, not a slow answer under load.
RAY_GONE_CHECKS = 3
HEAD_SCRIPT = "; ".join([
    "set -eu",
    "@PRE_SERVE@",
    'ray start --head --node-ip-address="$VLLM_HOST_IP" --port="$SPARKPROV_RAY_PORT" --num-gpus=1 '
    '--include-dashboard=false --disable-usage-stats',
    'echo "sparkprov: waiting for $SPARKPROV_RAY_GPUS GPUs in the Ray cluster" >&2',
    # the workers may be away for long (a node powered off): wait for them without a bound; but
    # Ray itself gone from this head (its GCS or raylet killed: OOM, a stray `ray stop`) never comes
    # back while this loop runs, so after RAY_GONE_CHECKS failed `ray status` in a row the container
    # exits and its restart policy starts a fresh Ray
    "n=0",
    'while :; do if s=$(ray status 2>/dev/null); then n=0; '
    'g=$(printf "%s\\n" "$s" | awk \'$2=="GPU" {split($1,a,"/"); print int(a[2]); exit}\'); '
    '[ "${g:-0}" -ge "$SPARKPROV_RAY_GPUS" ] && break; else n=$((n+1)); '
    '[ "$n" -lt @RAY_GONE_CHECKS@ ] || { echo "sparkprov: Ray on this head stopped answering (ray status failed '
    '@RAY_GONE_CHECKS@ times in a row): exiting, for the restart policy to start it again" >&2; exit 75; }; fi; '
    'sleep 2; done',
    'echo "sparkprov: Ray has $g GPUs: starting vllm serve" >&2',
    "@KEY@",
    'exec "$@"',
]).replace("@RAY_GONE_CHECKS@", str(RAY_GONE_CHECKS))
KEY_LINES = "; ".join([
    f"k=$(cat {KEY_PATH})",
    '[ -n "$k" ] || { echo "sparkprov: the API key file is empty" >&2; exit 78; }',
    "VLLM_API_KEY=$k", "export VLLM_API_KEY", "unset k",
])
WORKER_SCRIPT = "; ".join([
    "set -eu",
    'exec ray start --address="$SPARKPROV_RAY_HEAD" --node-ip-address="$VLLM_HOST_IP" --num-gpus=1 '
    '--disable-usage-stats --block',
])
# Ray token authentication (Ray >= 2.52: RAY_AUTH_MODE=token, the token read from the file
# RAY_AUTH_TOKEN_PATH names). The token is a 0600 file on each member, made once per deployment
# (modules/ray_token.py) and mounted read-only: docker inspect shows the path, never the token.
RAY_TOKEN_PATH = "/run/sparkprov/ray_token"
RAY_TOKEN_NAME = "ray_token"  # in the deployment's directory on the node (ray_token_file)


def ray_token_file(home: str, deployment: str) -> str:
    """The Ray token of a deployment on a node: under the deployment's own directory (0700)."""
    return f"{home.rstrip('/')}/.config/sparkprov/deployments/{deployment}/{RAY_TOKEN_NAME}"


def ray_auth(token_file: str | None) -> tuple[dict[str, str], list[str]]:
    """(environment, extra -v words) that make every Ray process of the container use the token."""
    if not token_file:
        return {}, []
    return ({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": RAY_TOKEN_PATH},
            ["-v", f"{token_file}:{RAY_TOKEN_PATH}:ro"])


# vLLM's own multi-node: every rank runs `vllm serve` under the rank supervisor (serving/supervise.py:
# the real engine neither exits non-zero nor dies with a lost rank); rank 0 reads the key, the others
# serve no API.
NATIVE_SCRIPT = "; ".join(["set -eu", "@PRE_SERVE@", "@KEY@", supervise.exec_line()])


@dataclass
class ContainerSpec:
    deployment: str
    host: str
    name: str
    role: str
    argv: list[str]
    hash: str
    image: str
    launch: Launch
    port: int | None = None
    labels: dict[str, str] = field(default_factory=dict)

    @property
    def serves(self) -> bool:
        return self.role in SERVING_ROLES


@dataclass(frozen=True)
class Command:
    """What the container runs after its image: `script` under `sh -c` ($0 `dollar0`, then `args`
    as "$@"), or without a script `args` alone (to the image's own entrypoint)."""

    args: list[str]
    script: str | None = None
    dollar0: str = ""


def assemble(launch: Launch, *, name: str, role: str, labels: dict[str, str], command: Command,
             env: dict[str, str] | None = None, mounts: tuple[str, ...] = (), init: bool = False,
             labels_after_detach: bool = False, foreground: bool = False, deployment: str = "",
             host: str = "") -> ContainerSpec:
    """The one `docker run` of every serving container, from the launch's parts. `labels` get the
    recipe hash added: the hash of the detached container without its labels, so that a container
    started earlier with the same parts carries the same one (cluster-up leaves it running).
    `role`: which roles serve the API get the API key mount. `env`/`mounts`: the role's own, after
    the launch's. `init`: docker's init process (Ray leaves daemons behind the main process).
    `labels_after_detach`: the labels right after `-d` (where a single server has them) rather than
    after the options. `foreground`: for a service manager (systemd): no -d and no restart policy,
    --rm (each start a fresh container of the same name)."""
    serves = role in SERVING_ROLES

    def options(detach: bool) -> list[str]:
        out = ["docker", "run", "-d" if detach else "--rm", "--name", name]
        for option in launch.docker_options:
            if option.words[0] == "--restart" and not detach:
                continue
            out += option.words
            if option.words[0] == "--network" and init:
                out.append("--init")  # after the network option, where the ranks' containers have it
        return out

    body: list[str] = []
    for e in launch.env:
        body += ["-e", f"{e.name}={e.value}"]
    for k, v in (env or {}).items():
        body += ["-e", f"{k}={v}"]
    for m in launch.mounts:
        if m.container == KEY_PATH and not serves:
            continue  # the API server runs on rank 0 only: the key stays there
        body += ["-v", m.spec()]
    body += list(mounts)
    if command.script is None:
        tail = [launch.image, *command.args]
    elif launch.entrypoint_kind == "passthrough" and launch.command == "full":
        tail = [launch.image, "sh", "-c", command.script, command.dollar0, *command.args]  # NGC's entrypoint (G5)
    else:
        tail = ["--entrypoint", "sh", launch.image, "-c", command.script, command.dollar0, *command.args]
    digest = hashlib.sha256(json.dumps(options(True) + body + tail).encode()).hexdigest()[:16]
    labels = {**labels, "sparkprov.recipe_hash": digest}
    label_words = [w for k, v in labels.items() for w in ("--label", f"{k}={v}")]
    opts = options(not foreground)
    argv = (opts[:3] + label_words + opts[3:] if labels_after_detach else opts + label_words) + body + tail
    return ContainerSpec(deployment, host, name, role, argv, digest, launch.image, launch,
                         launch.ctx.port if serves else None, labels)


def parked(spec: ContainerSpec, idle_stop_s: int | None, utilization: float) -> ContainerSpec:
    """The container of an on-demand deployment, created and left stopped (cluster-up --park): the
    same `docker run -d` argv as `docker create`, with the on-demand labels after its own (its
    idle_stop_s and its --gpu-memory-utilization, which the gateway's admission reads). Labels are
    outside the recipe hash: it is the hash a start of the same container carries."""
    if spec.argv[:3] != ["docker", "run", "-d"]:
        raise ValueError(f"{spec.name}: only a detached container can be parked")
    extra = {ON_DEMAND_LABEL: "1", **({IDLE_STOP_LABEL: str(idle_stop_s)} if idle_stop_s else {}),
             UTILIZATION_LABEL: f"{utilization:g}"}
    last = max(i for i, w in enumerate(spec.argv) if w == "--label") + 2
    words = [w for k, v in extra.items() for w in ("--label", f"{k}={v}")]
    argv = ["docker", "create", *spec.argv[3:last], *words, *spec.argv[last:]]
    return replace(spec, argv=argv, labels={**spec.labels, **extra})


def _deployment_labels(deployment: str, role: str, launch: Launch, extra: dict[str, str]) -> dict[str, str]:
    """The labels of a deployment's container; the recipe hash goes between recipe and tp."""
    serves = role in SERVING_ROLES
    out = {"sparkprov.managed": "1", "sparkprov.deployment": deployment, "sparkprov.role": role,
           "sparkprov.recipe": launch.alias, "sparkprov.recipe_hash": "", "sparkprov.tp": str(launch.tp)}
    if serves:
        out["sparkprov.port"] = str(launch.ctx.port)
        out["sparkprov.model"] = launch.served_model_name
        if launch.ctx.api_key_file:
            out["sparkprov.api_key_file"] = launch.ctx.api_key_file
    return {**out, **extra}


def _pre_serve(launch: Launch) -> str:
    return "; ".join(shlex.join(c) for c in launch.start_steps) or ":"


def _key_lines(launch: Launch) -> str:
    return KEY_LINES if launch.ctx.api_key_file else ":"


def wrapper_script(launch: Launch) -> str:
    """One server's sh wrapper: the recipe's pre_serve steps, the API key read into its environment
    (never argv), then `vllm serve` ("$@")."""
    return "; ".join(["set -eu", *(shlex.join(c) for c in launch.start_steps),
                      *([KEY_LINES] if launch.ctx.api_key_file else []), 'exec "$@"'])


def server_command(launch: Launch) -> Command:
    """One server: `vllm serve` with the launch's arguments, under sparkprov's wrapper where it
    needs one (the API key, pre_serve, an image's own entrypoint), else to the image's entrypoint."""
    if launch.wrapped:
        return Command(["vllm", "serve", *launch.vllm_argv], wrapper_script(launch), WRAPPER_NAME)
    return Command(launch.vllm_argv if launch.command == "bare" else ["vllm", "serve", *launch.vllm_argv])


def recipe_container(launch: Launch) -> ContainerSpec:
    """The recipe's server as `invoke recipe` prints it: no deployment, the recipe's labels."""
    return assemble(launch, name=launch.container_name, role=ROLE_SERVER, command=server_command(launch),
                    labels={"sparkprov.managed": "1", "sparkprov.recipe": launch.alias}, host=launch.ctx.host)


def single(deployment: str, host: str, launch: Launch, *, foreground: bool = False) -> ContainerSpec:
    """A single-node deployment's server: the recipe's container with the deployment's labels."""
    return assemble(launch, name=launch.container_name, role=ROLE_SERVER, command=server_command(launch),
                    labels=_deployment_labels(deployment, ROLE_SERVER, launch, {}), labels_after_detach=True,
                    foreground=foreground, deployment=deployment, host=host)


def _rank(deployment: str, host: str, name: str, role: str, launch: Launch, *, env: dict[str, str], script: str,
          args: list[str], labels: dict[str, str], mounts: tuple[str, ...] = (), foreground: bool) -> ContainerSpec:
    return assemble(launch, name=name, role=role, command=Command(args, script, "sparkprov-" + role),
                    labels=_deployment_labels(deployment, role, launch, labels), env=env, mounts=mounts, init=True,
                    foreground=foreground, deployment=deployment, host=host)


def ray_rank(deployment: str, host: str, launch: Launch, *, rank: int, nnodes: int, head_ip: str,
             ray_port: int, rank0_id: str = "", token_file: str | None = None,
             foreground: bool = False) -> ContainerSpec:
    """Rank 0: the Ray head, which waits for every node's GPU and then runs vLLM; the others:
    Ray workers joining the head at HEAD_IP:RAY_PORT (over the fabric). `token_file`: the node's
    Ray token (token authentication for every Ray process of the container; the head's dashboard
    is off)."""
    labels = {"sparkprov.executor": "ray", "sparkprov.rank": str(rank), "sparkprov.nodes": str(nnodes)}
    auth_env, auth_mount = ray_auth(token_file)
    if rank == 0:
        script = HEAD_SCRIPT.replace("@PRE_SERVE@", _pre_serve(launch)).replace("@KEY@", _key_lines(launch))
        return _rank(deployment, host, f"sparkprov-{deployment}-head", ROLE_HEAD, launch,
                     env={"SPARKPROV_RAY_PORT": str(ray_port), "SPARKPROV_RAY_GPUS": str(nnodes), **auth_env},
                     script=script, args=["vllm", "serve", *ray_head_args(launch, nnodes=nnodes)], labels=labels,
                     mounts=tuple(auth_mount), foreground=foreground)
    return _rank(deployment, host, f"sparkprov-{deployment}-worker", ROLE_WORKER, launch,
                 env={"SPARKPROV_RAY_HEAD": f"{head_ip}:{ray_port}", **_member_of(rank0_id), **auth_env},
                 script=WORKER_SCRIPT, args=[], labels=labels, mounts=tuple(auth_mount), foreground=foreground)


def _member_of(rank0_id: str) -> dict[str, str]:
    """The other ranks name rank 0's container: a group does not re-admit a lost member, so when
    rank 0 is replaced, every rank is (its hash changes with rank 0's ID)."""
    return {"SPARKPROV_RANK0": rank0_id[:12]} if rank0_id else {}


def ray_head_args(launch: Launch, *, nnodes: int) -> list[str]:
    """`vllm serve`'s arguments on the Ray head: the launch's, with the engine's pipeline stages
    (--pipeline-parallel-size, tp x pp = nnodes) and the Ray executor where the launch has none
    (a tp 1 x pp 2 launch has no executor of its own: vLLM would start a one-GPU server)."""
    argv = list(launch.vllm_argv)
    pp = max(1, nnodes // max(1, launch.tp))  # one GPU per Spark
    if pp > 1 and not launch.has("--pipeline-parallel-size"):
        argv += ["--pipeline-parallel-size", str(pp)]
    if nnodes > 1 and not launch.has("--distributed-executor-backend"):
        argv += ["--distributed-executor-backend", "ray"]
    return argv


DP_OPTIONS = ("--data-parallel-size", "--data-parallel-size-local", "--data-parallel-start-rank",
              "--data-parallel-address", "--data-parallel-rpc-port")


def native_args(launch: Launch, *, rank: int, nnodes: int, pp: int, master_addr: str, master_port: int,
                dp: int = 1) -> list[str]:
    """`vllm serve`'s arguments for one rank of vLLM's own multi-node: the launch's, but the
    layout's options its own (the Ray executor and the pipeline stages are not the launch's here;
    a rank > 0 serves no API: no --host/--port), then --nnodes/--node-rank/--master-addr/--master-port
    (and --headless off rank 0). With `dp` > 1 every rank is a data-parallel replica on its own
    Spark (vLLM's data-parallel deployment): rank 0 serves the API with --data-parallel-size/
    -size-local/-address/-rpc-port (rank 0's fabric address and the deployment's master port), the
    others are --headless engines from --data-parallel-start-rank RANK."""
    layout_own = {"--distributed-executor-backend", "--pipeline-parallel-size"}
    layout_own |= {"--host", "--port"} if rank else set()
    layout_own |= set(DP_OPTIONS) if dp > 1 else set()
    argv = [w for a in launch.vllm_args if a.flag not in layout_own for w in a.argv()]
    if dp > 1:
        argv += ["--data-parallel-size", str(dp), "--data-parallel-size-local", "1",
                 "--data-parallel-address", master_addr, "--data-parallel-rpc-port", str(master_port)]
        if rank:
            argv += ["--data-parallel-start-rank", str(rank), "--headless"]
        return argv
    if pp > 1:
        argv += ["--pipeline-parallel-size", str(pp)]
    argv += ["--nnodes", str(nnodes), "--node-rank", str(rank), "--master-addr", master_addr,
             "--master-port", str(master_port)]
    if rank:
        argv.append("--headless")
    return argv


def native_rank(deployment: str, host: str, launch: Launch, *, rank: int, nnodes: int, pp: int, master_addr: str,
                master_port: int, rank0_id: str = "", dp: int = 1, foreground: bool = False) -> ContainerSpec:
    labels = {"sparkprov.executor": "native", "sparkprov.rank": str(rank), "sparkprov.nodes": str(nnodes)}
    if dp > 1:
        labels["sparkprov.dp"] = str(dp)
    key = _key_lines(launch) if rank == 0 else ":"
    script = NATIVE_SCRIPT.replace("@PRE_SERVE@", _pre_serve(launch) if rank == 0 else ":").replace("@KEY@", key)
    args = native_args(launch, rank=rank, nnodes=nnodes, pp=pp, master_addr=master_addr, master_port=master_port,
                       dp=dp)
    member = _member_of(rank0_id)
    if rank == 0:
        env = supervise.rank0_env(start_timeout_s=launch.recipe.startup.health_timeout_s, port=launch.ctx.port,
                                  model=launch.served_model_name, key_file=KEY_PATH if launch.ctx.api_key_file else None)
    else:
        # what the rank watches of rank 0: its rendezvous, or with dp its API (vLLM closes the data-parallel
        # handshake port once the engines have started; the API listens as long as rank 0 serves)
        watch = launch.ctx.port if dp > 1 else master_port
        env = {**member, **supervise.rank_env(master_addr=master_addr, master_port=watch)}
    return _rank(deployment, host, f"sparkprov-{deployment}-rank{rank}", ROLE_RANK0 if rank == 0 else ROLE_RANK,
                 launch, env=env, script=script, args=["vllm", "serve", *args], labels=labels, foreground=foreground)

