"""The containers a deployment wants on each host: the exact `docker run` argv, labels and hashes.

Single node (tp 1): the catalog's rendered launch, verbatim (what `invoke recipe` prints), with
sparkprov's deployment labels added.

Ray cluster (tp N > 1), built from the same rendered launches (one per node: each node's own
VLLM_HOST_IP and NCCL/Gloo/UCX bindings from its FabricInfo):

* `sparkprov-NAME-head` on the first host: `ray start --head` on the node's fabric address, then
  (inside the container, polling `ray status`) it waits until the cluster has N GPUs, reads the
  API key file into VLLM_API_KEY and execs `vllm serve ... --tensor-parallel-size TP
  [--pipeline-parallel-size PP] --distributed-executor-backend ray` (TP x PP = N, one GPU per Spark). sparkprov watches the same `ray status` from outside, with
  progress and a timeout, and fails the bring-up naming the node that did not join.
* `sparkprov-NAME-worker` on every other host: `ray start --address HEAD:PORT --block`.

Every Ray process of both runs with Ray's token authentication (RAY_AUTH_MODE=token, the token a
0600 file of the node mounted read-only; only its path is in the environment), and the head has
no dashboard. Their ports bind every interface: the firewall module closes them to non-members.

All have host networking, `--init` (Ray leaves daemons behind the main process), the restart
policy of the recipe (a reboot brings the whole cluster back: workers retry until the head is up,
the head waits for them), and the store and compile cache mounts. The wrapper texts are constants;
the model and flags follow them as separate argv words ("$@"), as in the catalog's wrapper.
"""

from __future__ import annotations

import hashlib
import json
import shlex
from dataclasses import dataclass, field

from sparkprov.catalog.render import KEY_PATH, Launch, image_entrypoint
from sparkprov.serving import supervise

ROLE_SERVER, ROLE_HEAD, ROLE_WORKER = "server", "ray-head", "ray-worker"
ROLE_RANK0, ROLE_RANK = "rank0", "rank"  # native multi-node: rank 0 serves the API, the others --headless
SERVING_ROLES = (ROLE_SERVER, ROLE_HEAD, ROLE_RANK0)

# No `pip install` at container start (001 §6's NGC scripts do): an image without Ray fails here
# with "ray: command not found" (exit 127), as it would on a Spark that boots without internet;
# the preflight names the fix (executor native, or an image that has Ray).
HEAD_SCRIPT = "; ".join([
    "set -eu",
    "@PRE_SERVE@",
    'ray start --head --node-ip-address="$VLLM_HOST_IP" --port="$SPARKPROV_RAY_PORT" --num-gpus=1 '
    '--include-dashboard=false --disable-usage-stats',
    'echo "sparkprov: waiting for $SPARKPROV_RAY_GPUS GPUs in the Ray cluster" >&2',
    'while :; do g=$(ray status 2>/dev/null | awk \'$2=="GPU" {split($1,a,"/"); print int(a[2]); exit}\'); '
    '[ "${g:-0}" -ge "$SPARKPROV_RAY_GPUS" ] && break; sleep 2; done',
    'echo "sparkprov: Ray has $g GPUs: starting vllm serve" >&2',
    "@KEY@",
    'exec "$@"',
])
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


def _hash(argv: list[str]) -> str:
    return hashlib.sha256(json.dumps(argv).encode()).hexdigest()[:16]


def _labels(deployment: str, role: str, launch: Launch, digest: str, port: int | None, key: str | None) -> dict[str, str]:
    out = {"sparkprov.managed": "1", "sparkprov.deployment": deployment, "sparkprov.role": role,
           "sparkprov.recipe": launch.alias, "sparkprov.recipe_hash": digest, "sparkprov.tp": str(launch.tp)}
    if port is not None:
        out["sparkprov.port"] = str(port)
        out["sparkprov.model"] = launch.served_model_name
    if key:
        out["sparkprov.api_key_file"] = key
    return out


def _label_argv(labels: dict[str, str]) -> list[str]:
    return [w for k, v in labels.items() for w in ("--label", f"{k}={v}")]


def single(deployment: str, host: str, launch: Launch) -> ContainerSpec:
    """The catalog's launch as is, plus the deployment's labels (the recipe hash stays render's)."""
    argv = list(launch.argv)
    body = [w for w in argv]
    # render's labels are in argv; ours replace them (same managed/recipe/recipe_hash values)
    stripped: list[str] = []
    i = 0
    while i < len(body):
        if body[i] == "--label" and i + 1 < len(body) and body[i + 1].startswith("sparkprov."):
            i += 2
            continue
        stripped.append(body[i])
        i += 1
    labels = _labels(deployment, ROLE_SERVER, launch, launch.recipe_hash, launch.ctx.port, launch.ctx.api_key_file)
    final = stripped[:3] + _label_argv(labels) + stripped[3:]
    return ContainerSpec(deployment, host, launch.container_name, ROLE_SERVER, final, launch.recipe_hash,
                         launch.image, launch, launch.ctx.port, labels)


def _rank_container(deployment: str, host: str, name: str, role: str, launch: Launch, env_extra: dict[str, str],
                    script: str, args: list[str], extra_labels: dict[str, str],
                    extra_mounts: tuple[str, ...] = ()) -> ContainerSpec:
    d = launch.recipe.docker
    opts = ["docker", "run", "-d", "--name", name, "--restart", d.restart, "--gpus", "all", f"--ipc={d.ipc}",
            "--network", "host", "--init"]
    if d.shm_size:
        opts += ["--shm-size", d.shm_size]
    for u in d.ulimits:
        opts += ["--ulimit", u]
    body: list[str] = []
    for e in launch.env:
        body += ["-e", f"{e.name}={e.value}"]
    for k, v in env_extra.items():
        body += ["-e", f"{k}={v}"]
    for m in launch.mounts:
        if role not in SERVING_ROLES and m.container == KEY_PATH:
            continue  # the API server runs on the head only: the key stays there
        body += ["-v", m.spec()]
    body += list(extra_mounts)
    kind = image_entrypoint(launch.recipe.image, launch.image_info)
    dollar0 = "sparkprov-" + role
    if kind == "passthrough" and launch.command == "full":
        tail = [launch.image, "sh", "-c", script, dollar0, *args]  # keep NGC's entrypoint (G5)
    else:
        tail = ["--entrypoint", "sh", launch.image, "-c", script, dollar0, *args]
    digest = _hash(opts + body + tail)
    port = launch.ctx.port if role in SERVING_ROLES else None
    key = launch.ctx.api_key_file if role in SERVING_ROLES else None
    labels = {**_labels(deployment, role, launch, digest, port, key), **extra_labels}
    return ContainerSpec(deployment, host, name, role, opts + _label_argv(labels) + body + tail, digest,
                         launch.image, launch, port, labels)


def _pre_and_key(launch: Launch, serves: bool) -> tuple[str, str]:
    pre = "; ".join(shlex.join(c) for c in launch.recipe.pre_serve) or ":"
    return pre, (KEY_LINES if serves and launch.ctx.api_key_file else ":")


def ray_rank(deployment: str, host: str, launch: Launch, *, rank: int, nnodes: int, head_ip: str,
             ray_port: int, rank0_id: str = "", token_file: str | None = None) -> ContainerSpec:
    """Rank 0: the Ray head, which waits for every node's GPU and then runs vLLM; the others:
    Ray workers joining the head at HEAD_IP:RAY_PORT (over the fabric). `token_file`: the node's
    Ray token (token authentication for every Ray process of the container; the head's dashboard
    is off)."""
    labels = {"sparkprov.executor": "ray", "sparkprov.rank": str(rank), "sparkprov.nodes": str(nnodes)}
    auth_env, auth_mount = ray_auth(token_file)
    if rank == 0:
        pre, key = _pre_and_key(launch, True)
        script = HEAD_SCRIPT.replace("@PRE_SERVE@", pre).replace("@KEY@", key)
        return _rank_container(deployment, host, f"sparkprov-{deployment}-head", ROLE_HEAD, launch,
                               {"SPARKPROV_RAY_PORT": str(ray_port), "SPARKPROV_RAY_GPUS": str(nnodes), **auth_env},
                               script, ["vllm", "serve", *ray_head_argv(launch, nnodes=nnodes)], labels,
                               tuple(auth_mount))
    return _rank_container(deployment, host, f"sparkprov-{deployment}-worker", ROLE_WORKER, launch,
                           {"SPARKPROV_RAY_HEAD": f"{head_ip}:{ray_port}", **_member_of(rank0_id), **auth_env},
                           WORKER_SCRIPT, [], labels, tuple(auth_mount))


def _member_of(rank0_id: str) -> dict[str, str]:
    """The other ranks name rank 0's container: a group does not re-admit a lost member, so when
    rank 0 is replaced, every rank is (its hash changes with rank 0's ID)."""
    return {"SPARKPROV_RANK0": rank0_id[:12]} if rank0_id else {}


def drop_options(argv: list[str], *, valued: tuple[str, ...] = (), bare: tuple[str, ...] = ()) -> list[str]:
    """argv without some options: `valued` ones with their value (`--x v` or `--x=v`), `bare` ones alone."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        w = argv[i]
        if w in valued:
            i += 2
            continue
        if w in bare or any(w.startswith(v + "=") for v in valued):
            i += 1
            continue
        out.append(w)
        i += 1
    return out


def _pp_of(launch: Launch, nnodes: int) -> int:
    """The pipeline stages of an engine over `nnodes` Sparks at the launch's TP (one GPU per Spark)."""
    return max(1, nnodes // max(1, launch.tp))


def ray_head_argv(launch: Launch, *, nnodes: int) -> list[str]:
    """`vllm serve` on the Ray head: the launch's arguments, with the engine's pipeline stages
    (--pipeline-parallel-size, tp x pp = nnodes) and the Ray executor wherever they are missing
    (a tp 1 x pp 2 launch has no executor of its own: vLLM would start a one-GPU server)."""
    argv = list(launch.vllm_argv)
    pp = _pp_of(launch, nnodes)
    if pp > 1 and "--pipeline-parallel-size" not in argv:
        argv += ["--pipeline-parallel-size", str(pp)]
    if nnodes > 1 and not any(w == "--distributed-executor-backend" or w.startswith("--distributed-executor-backend=")
                              for w in argv):
        argv += ["--distributed-executor-backend", "ray"]
    return argv


DP_VALUED = ("--data-parallel-size", "--data-parallel-size-local", "--data-parallel-start-rank",
             "--data-parallel-address", "--data-parallel-rpc-port")


def native_argv(launch: Launch, *, rank: int, nnodes: int, pp: int, master_addr: str, master_port: int,
                dp: int = 1) -> list[str]:
    """`vllm serve` for one rank of vLLM's own multi-node: the launch's arguments without Ray's
    executor flag, plus --nnodes/--node-rank/--master-addr/--master-port (and --headless off rank 0,
    which serves no API: its --host/--port are dropped, vLLM ignores them there). With `dp` > 1
    every rank is a data-parallel replica on its own Spark (vLLM's data-parallel deployment): rank 0
    serves the API with --data-parallel-size/-size-local/-address/-rpc-port (rank 0's fabric address
    and the deployment's master port), the others are --headless engines from
    --data-parallel-start-rank RANK."""
    valued = ("--distributed-executor-backend", "--pipeline-parallel-size") + (("--host", "--port") if rank else ())
    argv = drop_options(list(launch.vllm_argv), valued=valued + (DP_VALUED if dp > 1 else ()))
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
                master_port: int, rank0_id: str = "", dp: int = 1) -> ContainerSpec:
    labels = {"sparkprov.executor": "native", "sparkprov.rank": str(rank), "sparkprov.nodes": str(nnodes)}
    if dp > 1:
        labels["sparkprov.dp"] = str(dp)
    pre, key = _pre_and_key(launch, rank == 0)
    script = NATIVE_SCRIPT.replace("@PRE_SERVE@", pre if rank == 0 else ":").replace("@KEY@", key)
    argv = native_argv(launch, rank=rank, nnodes=nnodes, pp=pp, master_addr=master_addr, master_port=master_port,
                       dp=dp)
    if rank == 0:
        env = supervise.rank0_env(start_timeout_s=launch.recipe.startup.health_timeout_s, port=launch.ctx.port,
                                  model=launch.served_model_name, key_file=KEY_PATH if launch.ctx.api_key_file else None)
    else:
        # what the rank watches of rank 0: its rendezvous, or with dp its API (vLLM closes the data-parallel
        # handshake port once the engines have started; the API listens as long as rank 0 serves)
        watch = launch.ctx.port if dp > 1 else master_port
        env = {**_member_of(rank0_id), **supervise.rank_env(master_addr=master_addr, master_port=watch)}
    return _rank_container(deployment, host, f"sparkprov-{deployment}-rank{rank}", ROLE_RANK0 if rank == 0 else ROLE_RANK,
                           launch, env, script, ["vllm", "serve", *argv], labels)


def cluster(deployment: str, launches: list[tuple[str, Launch]], ray_port: int) -> list[ContainerSpec]:
    """Every rank of a Ray cluster: head on the first (host, launch), workers on the others."""
    head_ip = launches[0][1].env_value("VLLM_HOST_IP") or ""
    return [ray_rank(deployment, h, launch, rank=i, nnodes=len(launches), head_ip=head_ip, ray_port=ray_port)
            for i, (h, launch) in enumerate(launches)]
