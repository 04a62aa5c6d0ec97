"""The lab engine (sparklab/engine): a vLLM stand-in. Runs it as a subprocess on 127.0.0.1."""
# Engine: the stand-in itself (its behaviour as measured on the real vLLM: docs/real-vllm.md).
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from sparklab.engine.testing import QWEN3_CONFIG, make_repo

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


@pytest.fixture
def hf_home(tmp_path):
    make_repo(str(tmp_path), "Qwen/Qwen3-0.6B")
    return tmp_path


def env_for(hf_home, **extra):
    env = dict(os.environ, HF_HOME=str(hf_home), HF_HUB_OFFLINE="1", LAB_ENGINE_LOAD_SECONDS="1",
               PYTHONPATH=str(ROOT), LAB_ENGINE_TOKEN_SECONDS="0")
    env.pop("VLLM_API_KEY", None)
    env.update(extra)
    return env


def run_cli(args, env, timeout=30, python=sys.executable):
    return subprocess.run([python, "-m", "sparklab.engine", *args], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


class Engine:
    def __init__(self, hf_home, model="Qwen/Qwen3-0.6B", args=(), python=sys.executable, **env):
        self.port = free_port()
        self.proc = subprocess.Popen([python, "-m", "sparklab.engine", "serve", model, "--host",
                                      "127.0.0.1", "--port", str(self.port), *args],
                                     env=env_for(hf_home, **env), cwd=ROOT, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)
        self.base = f"http://127.0.0.1:{self.port}"

    def request(self, path, body=None, key=None):
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.base + path, data=data)
        if key:
            req.add_header("Authorization", f"Bearer {key}")
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                raw = r.read().decode()
                return r.status, raw
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    def status(self, path="/health"):
        try:
            return self.request(path)[0]
        except (urllib.error.URLError, ConnectionError):
            return None

    def wait_ready(self, timeout=60):
        seen = []
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError("engine exited:\n" + self.proc.stdout.read())
            st = self.status()
            seen.append(st)
            if st == 200:
                return seen
            time.sleep(0.1)
        raise AssertionError(f"not ready; health codes {set(seen)}")

    def chat(self, content, key=None, **kw):
        st, raw = self.request("/v1/chat/completions",
                               {"model": "Qwen/Qwen3-0.6B", "messages": [{"role": "user", "content": content}], **kw},
                               key=key)
        return st, json.loads(raw) if raw.startswith("{") else raw

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.stdout.read()


@pytest.fixture
def engine_factory(hf_home):
    started = []

    def make(*args, model="Qwen/Qwen3-0.6B", **env):
        e = Engine(hf_home, model, args, **env)
        started.append(e)
        return e
    yield make
    for e in started:
        e.stop()


# ---------------------------------------------------------------- CLI
def test_unknown_flag_rejected(hf_home):
    r = run_cli(["serve", "Qwen/Qwen3-0.6B", "--no-such-flag"], env_for(hf_home))
    assert r.returncode == 2
    assert "unrecognized arguments: --no-such-flag" in r.stderr


@pytest.mark.parametrize("argv", [["serve", "serve", "Qwen/Qwen3-0.6B"], ["serve", "Qwen/Qwen3-0.6B", "serve"]])
def test_doubled_serve_rejected(hf_home, argv):
    r = run_cli(argv, env_for(hf_home))
    assert r.returncode == 2
    assert "unrecognized arguments: serve" in r.stderr


def test_bad_choice_rejected(hf_home):
    r = run_cli(["serve", "Qwen/Qwen3-0.6B", "--kv-cache-dtype", "int3"], env_for(hf_home))
    assert r.returncode == 2 and "invalid choice" in r.stderr


# ---------------------------------------------------------------- weights
def test_missing_model_fails(hf_home):
    r = run_cli(["serve", "Org/Absent", "--port", str(free_port())], env_for(hf_home))
    assert r.returncode == 1
    assert "LocalEntryNotFoundError" in r.stderr


def _snapshot(hf_home):
    return next((hf_home / "hub" / "models--Qwen--Qwen3-0.6B" / "snapshots").iterdir())


def test_missing_config_fails(hf_home):
    (_snapshot(hf_home) / "config.json").unlink()
    r = run_cli(["serve", "Qwen/Qwen3-0.6B", "--port", str(free_port())], env_for(hf_home))
    assert r.returncode == 1 and "config.json" in r.stderr


def test_missing_shard_fails(hf_home):
    (_snapshot(hf_home) / "model-00002-of-00002.safetensors").unlink()
    r = run_cli(["serve", "Qwen/Qwen3-0.6B", "--port", str(free_port())], env_for(hf_home))
    assert r.returncode == 1
    assert "model-00002-of-00002.safetensors" in r.stderr and "missing" in r.stderr


def test_truncated_shard_fails(hf_home):
    shard = (_snapshot(hf_home) / "model-00001-of-00002.safetensors").resolve()
    data = shard.read_bytes()
    shard.write_bytes(data[:-100])
    r = run_cli(["serve", "Qwen/Qwen3-0.6B", "--port", str(free_port())], env_for(hf_home))
    assert r.returncode == 1 and "MetadataIncompleteBuffer" in r.stderr


def test_local_path_serves(engine_factory, hf_home):
    e = engine_factory(model=str(_snapshot(hf_home)))
    e.wait_ready()
    st, raw = e.request("/v1/models")
    assert st == 200 and json.loads(raw)["data"][0]["id"] == str(_snapshot(hf_home))


# ---------------------------------------------------------------- serving
def test_health_then_chat(engine_factory):
    e = engine_factory("--served-model-name", "Qwen/Qwen3-0.6B", "qwen", "--max-model-len", "2k",
                       LAB_ENGINE_LOAD_SECONDS="2")
    seen = e.wait_ready()
    assert 503 in seen and seen[-1] == 200
    st, raw = e.request("/v1/models")
    models = json.loads(raw)["data"]
    assert [m["id"] for m in models] == ["Qwen/Qwen3-0.6B", "qwen"]
    assert models[0]["max_model_len"] == 2000
    st, body = e.chat("What is 17 + 25?", chat_template_kwargs={"enable_thinking": False})
    assert st == 200
    msg = body["choices"][0]["message"]
    assert "42" in msg["content"] and body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["prompt_tokens"] == 5
    assert body["usage"]["completion_tokens"] == len(msg["content"].split())
    st, body = e.chat("Compute 6*7")
    assert "42" in body["choices"][0]["message"]["content"]
    # completions API + streaming
    st, raw = e.request("/v1/completions", {"model": "qwen", "prompt": "12 * 12 =", "max_tokens": 5})
    assert st == 200 and json.loads(raw)["choices"][0]["text"].strip() == "144"
    st, raw = e.request("/v1/chat/completions", {"messages": [{"role": "user", "content": "What is 2+3?"}],
                                                 "stream": True, "stream_options": {"include_usage": True}})
    events = [l[6:] for l in raw.splitlines() if l.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(x) for x in events[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert "5" in text and chunks[-1]["usage"]["prompt_tokens"] == 3
    # unknown model
    st, raw = e.request("/v1/chat/completions", {"model": "nope", "messages": [{"role": "user", "content": "x"}]})
    assert st == 404 and "does not exist" in raw


def test_thinking_small_max_tokens(engine_factory):
    e = engine_factory("--reasoning-parser", "qwen3")
    e.wait_ready()
    st, body = e.chat("What is 17 + 25?", max_tokens=8)
    ch = body["choices"][0]
    assert ch["message"]["content"] is None and ch["finish_reason"] == "length"
    assert ch["message"]["reasoning_content"]
    st, body = e.chat("What is 17 + 25?", max_tokens=500)
    ch = body["choices"][0]
    assert ch["message"]["reasoning_content"] and "42" in ch["message"]["content"]


def test_gemma_does_not_think_by_default(tmp_path, engine_factory):
    cfg = dict(QWEN3_CONFIG, model_type="gemma3_text", architectures=["Gemma3ForCausalLM"])
    make_repo(str(tmp_path), "google/gemma-3-1b-it", cfg)
    e = Engine(tmp_path, "google/gemma-3-1b-it", ("--reasoning-parser", "deepseek_r1"))
    try:
        e.wait_ready()
        st, body = e.chat("What is 17 + 25?", max_tokens=8, model="google/gemma-3-1b-it")
        assert body["choices"][0]["message"]["reasoning_content"] is None
        assert "42" in body["choices"][0]["message"]["content"]
    finally:
        e.stop()


def test_tool_choice_auto_needs_flags(engine_factory):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    e = engine_factory()
    e.wait_ready()
    st, body = e.chat("What is the weather in Paris?", tools=tools, tool_choice="auto")
    assert st == 400
    assert body["error"]["message"] == ('"auto" tool choice requires --enable-auto-tool-choice and '
                                        "--tool-call-parser to be set")
    e2 = engine_factory("--enable-auto-tool-choice", "--tool-call-parser", "hermes")
    e2.wait_ready()
    st, body = e2.chat("What is the weather in Paris?", tools=tools)
    ch = body["choices"][0]
    assert st == 200 and ch["finish_reason"] == "tool_calls"
    call = ch["message"]["tool_calls"][0]["function"]
    assert call["name"] == "get_weather" and json.loads(call["arguments"]) == {"city": "Paris"}


def test_api_key(engine_factory):
    e = engine_factory("--api-key", "sekrit")
    e.wait_ready()  # /health is open
    assert e.status("/v1/models") == 401
    st, _ = e.chat("What is 1+1?")
    assert st == 401
    st, body = e.chat("What is 1+1?", key="sekrit")
    assert st == 200 and "2" in body["choices"][0]["message"]["content"]
    assert e.status("/metrics") == 200


def test_api_key_from_env(engine_factory):
    e = engine_factory(VLLM_API_KEY="envkey")
    e.wait_ready()
    assert e.status("/v1/models") == 401
    assert e.request("/v1/models", key="envkey")[0] == 200


def test_metrics(engine_factory):
    e = engine_factory("--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3, '
                       '"prompt_lookup_max": 4}')
    e.wait_ready()
    e.chat("What is 3 + 4?")
    st, text = e.request("/metrics")
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:gpu_cache_usage_perc", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
                 "vllm:request_success_total", "vllm:spec_decode_num_drafts_total",
                 "vllm:spec_decode_num_draft_tokens_total", "vllm:spec_decode_num_accepted_tokens_total"):
        assert name + "{" in text, name
    assert 'vllm:prompt_tokens_total{engine="0",model_name="Qwen/Qwen3-0.6B"} 5.0' in text


def test_fp4_moe_without_marlin_is_degenerate(tmp_path):
    cfg = dict(QWEN3_CONFIG, model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], num_experts=8,
               quantization_config={"quant_method": "modelopt", "quant_algo": "NVFP4"})
    make_repo(str(tmp_path), "nvidia/Qwen3-30B-A3B-FP4", cfg)
    e = Engine(tmp_path, "nvidia/Qwen3-30B-A3B-FP4", ("--chat-template", "{{ messages }}"))
    try:
        e.wait_ready()
        st, body = e.chat("What is 17 + 25?", max_tokens=4, model="nvidia/Qwen3-30B-A3B-FP4")
        content = body["choices"][0]["message"]["content"]
        assert content.startswith("!!!!!!!!") and "42" not in content
    finally:
        e.stop()
    e = Engine(tmp_path, "nvidia/Qwen3-30B-A3B-FP4", ("--moe-backend", "marlin"))
    try:
        e.wait_ready()
        st, body = e.chat("What is 17 + 25?", model="nvidia/Qwen3-30B-A3B-FP4",
                          chat_template_kwargs={"enable_thinking": False})
        assert "42" in body["choices"][0]["message"]["content"]
    finally:
        e.stop()


def test_max_model_len_too_long_fails(hf_home):
    r = run_cli(["serve", "Qwen/Qwen3-0.6B", "--port", str(free_port()), "--max-model-len", "100000"],
                env_for(hf_home))
    assert r.returncode == 1 and "max_model_len" in r.stderr


# ---------------------------------------------------------------- Ray tensor parallel
@pytest.fixture(scope="session")
def ray_py():
    """A Python with Ray and the lab engine's packages, as the lab's Ray image has them: this one
    if it imports ray (or $LAB_ENGINE_RAY_PYTHON), else a venv in the lab's cache made once with the
    versions of the lab image's pip layer. Never a skip: a fresh machine installs it."""
    from sparklab.prebuild import ensure_ray_venv

    for py in (sys.executable, os.environ.get("LAB_ENGINE_RAY_PYTHON")):
        if py and os.path.exists(py) and subprocess.run([py, "-c", "import ray"],
                                                        capture_output=True).returncode == 0:
            return py
    return ensure_ray_venv()


def cluster_processes(temp_dir: str) -> set[int]:
    """The processes of the Ray cluster started with `--temp-dir temp_dir`: those whose command line
    names it (GCS, raylet, monitors: each is given a path under it) and all their descendants (the
    agents and workers the raylet starts rename themselves, ray::...)."""
    parent, named = {}, set()
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
            argv = (d / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        parent[int(d.name)] = int(stat.rsplit(")", 1)[1].split()[1])
        if any(a == temp_dir.encode() or temp_dir.encode() + b"/" in a for a in argv):
            named.add(int(d.name))
    found, grew = set(named), True
    while grew:
        more = {pid for pid, ppid in parent.items() if ppid in found} - found
        found |= more
        grew = bool(more)
    return found


def stop_cluster(temp_dir: str) -> None:
    """SIGKILL this test's Ray cluster alone. Not `ray stop`: it kills every Ray process the machine's
    PID namespace shows, the lab's containers' included (seen in CI: the lab's Ray deployment lost
    its raylets, SIGKILLed on both hosts at once, when this teardown ran beside the lab's tests)."""
    for _ in range(50):
        pids = cluster_processes(temp_dir)
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.2)
    raise AssertionError(f"the Ray cluster of {temp_dir} outlived SIGKILL: {sorted(cluster_processes(temp_dir))}")


@pytest.fixture
def ray_cluster(tmp_path, hf_home, ray_py):
    clusters = []

    def start(gpus):
        ray_bin = str(Path(ray_py).parent / "ray")
        port = free_port()
        # Ray registers the node under its non-loopback IP whatever --node-ip-address says, so
        # VLLM_HOST_IP stays unset (the engine then finds the same IP as Ray); the collective
        # itself runs on lo through GLOO_SOCKET_IFNAME.
        env = env_for(hf_home, GLOO_SOCKET_IFNAME="lo", RAY_ADDRESS=f"127.0.0.1:{port}")
        env.pop("VLLM_HOST_IP", None)
        tmp = f"/tmp/rl{port}"
        r = subprocess.run([ray_bin, "start", "--head", "--node-ip-address", "127.0.0.1", "--port", str(port),
                            "--num-gpus", str(gpus), "--num-cpus", "2", "--include-dashboard=false",
                            "--temp-dir", tmp, "--disable-usage-stats"],
                           env=env, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stdout + r.stderr
        clusters.append((ray_bin, env, tmp))
        return env
    yield start
    for _ray_bin, _env, tmp in clusters:
        stop_cluster(tmp)
        shutil.rmtree(tmp, ignore_errors=True)


def test_ray_tp2(ray_cluster, hf_home, ray_py):
    env = ray_cluster(2)
    e = Engine(hf_home, "Qwen/Qwen3-0.6B", ("--tensor-parallel-size", "2", "--distributed-executor-backend", "ray"),
               python=ray_py, **{k: env[k] for k in ("GLOO_SOCKET_IFNAME", "RAY_ADDRESS")})
    try:
        e.wait_ready(timeout=120)
        st, body = e.chat("What is 17 + 25?", chat_template_kwargs={"enable_thinking": False})
        assert "42" in body["choices"][0]["message"]["content"]
    finally:
        out = e.stop()
    assert "Gloo ring all-reduce verified across 2 ranks" in out
    assert "measured ring bandwidth" in out


def test_ray_tp2_cannot_be_placed(ray_cluster, hf_home, ray_py):
    env = ray_cluster(1)
    t0 = time.time()
    r = run_cli(["serve", "Qwen/Qwen3-0.6B", "--port", str(free_port()), "-tp", "2"],
                dict(env, LAB_ENGINE_PG_TIMEOUT="5"), timeout=120, python=ray_py)
    assert r.returncode == 1
    assert "exceeds the total number of available GPUs" in r.stderr
    assert time.time() - t0 < 60


def test_ray_pg_timeout_when_gpus_are_taken(ray_cluster, hf_home, ray_py):
    env = ray_cluster(2)
    # Another job holds one GPU: the placement group can never be satisfied.
    holder = subprocess.Popen([ray_py, "-c", "import ray,time; ray.init(address='auto');"
                               "from ray.util.placement_group import placement_group as pg;"
                               "p=pg([{'GPU':1}]); ray.get(p.ready()); print('held', flush=True); time.sleep(300)"],
                              env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        t0 = time.time()
        r = run_cli(["serve", "Qwen/Qwen3-0.6B", "--port", str(free_port()), "-tp", "2"],
                    dict(env, LAB_ENGINE_PG_TIMEOUT="4"), timeout=120, python=ray_py)
        assert r.returncode == 1
        assert "Cannot provide a placement group" in r.stderr
        assert time.time() - t0 < 60
    finally:
        holder.kill()
        holder.wait()


def test_gloo_interface_missing(hf_home):
    from sparklab.engine import collective
    with pytest.raises(collective.GlooError, match="Unable to find address for: nosuch0"):
        collective.interface_ipv4("nosuch0")


def test_mp_backend_tp2(engine_factory):
    e = engine_factory("-tp", "2", "--distributed-executor-backend", "mp", LAB_ENGINE_LOCAL_GPUS="2",
                       GLOO_SOCKET_IFNAME="lo")
    e.wait_ready()
    out = e.stop()
    assert "Gloo ring all-reduce verified across 2 ranks" in out


# ---------------------------------------------------------------- flags as the real vLLM parses them
@pytest.mark.parametrize("value,shown", [("flashinfer", "FLASHINFER"), ("triton_attn", "TRITON_ATTN"),
                                         ("FLASH_ATTN", "FLASH_ATTN"), ("Triton_Attn", "TRITON_ATTN")])
def test_attention_backend_is_case_insensitive(engine_factory, value, shown):
    # vLLM: AttentionConfig.validate_backend_before -> AttentionBackendEnum[value.upper()]
    e = engine_factory("--attention-backend", value)
    e.wait_ready()
    out = e.stop()
    assert f"Using {shown} attention backend." in out, out[-2000:]


def test_attention_backend_auto_and_unknown(hf_home, engine_factory):
    r = run_cli(["serve", "Qwen/Qwen3-0.6B", "--attention-backend", "no_such_attn"], env_for(hf_home))
    assert r.returncode == 2 and "--attention-backend" in r.stderr and "invalid choice" in r.stderr
    e = engine_factory("--attention-backend", "auto")
    e.wait_ready()
    out = e.stop()
    assert "attention_backend=auto" in out and "Using " not in out.split("attention_backend=auto")[1].split("\n")[0]


def test_disable_custom_all_reduce_accepted(engine_factory, hf_home):
    e = engine_factory("--disable-custom-all-reduce")
    e.wait_ready()
    assert "disable_custom_all_reduce=True" in e.stop()
    # a BooleanOptionalAction in vLLM: the --no- form exists too; a value is refused
    e2 = engine_factory("--no-disable-custom-all-reduce")
    e2.wait_ready()
    assert "disable_custom_all_reduce=False" in e2.stop()
    r = run_cli(["serve", "Qwen/Qwen3-0.6B", "--disable-custom-all-reduce", "yes"], env_for(hf_home))
    assert r.returncode == 2 and "unrecognized arguments: yes" in r.stderr


def test_media_io_kwargs_json(engine_factory, hf_home):
    e = engine_factory("--media-io-kwargs", '{"video": {"num_frames": 40}}')
    e.wait_ready()
    assert "media_io_kwargs={'video': {'num_frames': 40}}" in e.stop()
    for bad in ("{video: 40}", '{"video": 40}'):
        r = run_cli(["serve", "Qwen/Qwen3-0.6B", "--media-io-kwargs", bad], env_for(hf_home))
        assert r.returncode == 2 and "--media-io-kwargs" in r.stderr, (bad, r.stderr)


def test_allowed_local_media_path(engine_factory, hf_home, tmp_path):
    media = tmp_path / "media"
    media.mkdir()
    e = engine_factory("--allowed-local-media-path", str(media))
    e.wait_ready()
    assert f"allowed_local_media_path='{media}'" in e.stop()
    r = run_cli(["serve", "Qwen/Qwen3-0.6B", "--port", str(free_port()), "--allowed-local-media-path",
                 str(tmp_path / "absent")], env_for(hf_home))
    assert r.returncode == 1 and "Invalid `--allowed-local-media-path`" in r.stderr and "does not exist" in r.stderr


# ---------------------------------------------------------------- failures, as the real vLLM fails
class LoggedEngine:
    """An engine whose output goes to a file (readable while it runs)."""

    def __init__(self, hf_home, tmp_path, name, args, python=sys.executable, port=None, **env):
        self.port = port or free_port()
        self.log = tmp_path / f"{name}.log"
        self.fh = open(self.log, "w")
        self.proc = subprocess.Popen([python, "-m", "sparklab.engine", "serve", "Qwen/Qwen3-0.6B",
                                      "--host", "127.0.0.1", "--port", str(self.port), *args],
                                     env=env_for(hf_home, **env), cwd=ROOT, stdout=self.fh,
                                     stderr=subprocess.STDOUT, text=True)
        self.base = f"http://127.0.0.1:{self.port}"

    def health(self):
        try:
            with urllib.request.urlopen(self.base + "/health", timeout=5) as r:
                return r.status
        except urllib.error.HTTPError as e:
            return e.code
        except (urllib.error.URLError, ConnectionError, OSError):
            return None

    def text(self):
        return self.log.read_text()

    def wait_for(self, pred, timeout=60):
        deadline = time.time() + timeout
        while time.time() < deadline:
            if pred():
                return True
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        return pred()

    def stop(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        self.fh.close()


@pytest.fixture
def logged(hf_home, tmp_path):
    started = []

    def make(name, *args, **kw):
        e = LoggedEngine(hf_home, tmp_path, name, args, **kw)
        started.append(e)
        return e
    yield make
    for e in started:
        e.stop()


def _native(node_rank, nnodes, master_port, *extra):
    return ("-tp", str(nnodes), "--nnodes", str(nnodes), "--node-rank", str(node_rank),
            "--master-addr", "127.0.0.1", "--master-port", str(master_port), *extra)


NATIVE_ENV = {"GLOO_SOCKET_IFNAME": "lo", "LAB_ENGINE_COLLECTIVE_BYTES": str(1 << 20)}


def _post(base, path, body, timeout=30):
    """(status, body) of one POST; None when the connection failed."""
    req = urllib.request.Request(base + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except (urllib.error.URLError, ConnectionError, OSError) as e:
        return None, str(e)


def _ask(base, **kw):
    return _post(base, "/v1/chat/completions",
                 {"messages": [{"role": "user", "content": "What is 17 + 25? /no_think"}], **kw})


def _health_codes(e, seconds):
    """/health of e every 0.25 s for `seconds`."""
    codes, deadline = [], time.monotonic() + seconds
    while time.monotonic() < deadline:
        codes.append(e.health())
        time.sleep(0.25)
    return codes


def _dead_then_exit_0(e, t0):
    """/health 503 while the API server lingers, then exit status 0: (seconds to 503, to the exit)."""
    assert e.wait_for(lambda: e.health() != 200, 5), e.text()
    t_503 = time.monotonic() - t0
    assert e.health() == 503, e.text()
    rc = e.proc.wait(30)
    t_exit = time.monotonic() - t0
    assert rc == 0, e.text()
    assert e.health() is None
    return t_503, t_exit


def _native_pair(logged, **env):
    mport = free_port()
    r0 = logged("rank0", *_native(0, 2, mport), **NATIVE_ENV, **env)
    r1 = logged("rank1", *_native(1, 2, mport, "--headless"), **NATIVE_ENV, **env)
    assert r0.wait_for(lambda: r0.health() == 200, 60), r0.text()
    assert r1.wait_for(lambda: "Headless node ready" in r1.text(), 30), r1.text()
    return mport, r0, r1


def test_engine_core_killed_in_flight_500_health_503_then_exit_0(logged):
    """measured: lab-notes.md, The real vLLM on the CPU: engine core killed -> the in-flight request
    gets 500, /health 503 within 0.2 s, the API server exits with status 0 after 2-5 s (not 1)."""
    e = logged("core", LAB_ENGINE_TOKEN_SECONDS="0.05")
    assert e.wait_for(lambda: e.health() == 200, 60), e.text()
    pid = int(re.search(r"Started engine core EngineCore_DP0 \(pid (\d+)\)", e.text()).group(1))
    assert Path(f"/proc/{pid}/comm").read_text().strip() == "EngineCore_DP0"
    assert _ask(e.base, max_tokens=4)[0] == 200
    inflight = {}
    t = threading.Thread(target=lambda: inflight.update(r=_ask(e.base, max_tokens=400, ignore_eos=True)))
    t.start()
    assert e.wait_for(lambda: 'vllm:num_requests_running{engine="0",model_name="Qwen/Qwen3-0.6B"} 1.0'
                      in urllib.request.urlopen(e.base + "/metrics", timeout=5).read().decode(), 10)
    os.kill(pid, signal.SIGKILL)
    t0 = time.monotonic()
    assert e.wait_for(lambda: e.health() == 503, 5), e.text()
    t_503 = time.monotonic() - t0
    assert _ask(e.base, max_tokens=4)[0] == 500   # a request after the death: 500 too
    t.join(30)
    assert inflight["r"][0] == 500, inflight
    rc = e.proc.wait(30)
    t_exit = time.monotonic() - t0
    print(f"engine core killed -> /health 503 after {t_503:.2f}s, API server exited {rc} after {t_exit:.2f}s")
    assert rc == 0 and t_503 < 1.0 and 1.5 < t_exit < 10
    assert e.health() is None
    out = e.text()
    assert "Engine core proc EngineCore_DP0 died unexpectedly" in out and "EngineDeadError" in out


def test_a_stream_in_flight_gets_an_error_event_when_the_engine_core_dies(logged):
    """measured: lab-notes.md, The real vLLM on the CPU (engine core killed -> the request in flight
    fails, exit 0); a stream, already answered 200, ends with vLLM's error event and [DONE]."""
    e = logged("stream", LAB_ENGINE_TOKEN_SECONDS="0.05", LAB_ENGINE_DEAD_EXIT_SECONDS="1")
    assert e.wait_for(lambda: e.health() == 200, 60), e.text()
    pid = int(re.search(r"Started engine core EngineCore_DP0 \(pid (\d+)\)", e.text()).group(1))
    threading.Timer(1.0, os.kill, (pid, signal.SIGKILL)).start()
    st, raw = _ask(e.base, max_tokens=400, ignore_eos=True, stream=True)
    events = [x[6:] for x in raw.splitlines() if x.startswith("data: ")]
    assert st == 200 and events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == 500, raw[-500:]
    assert e.proc.wait(30) == 0


def test_native_multinode_rank0_waits_serves_and_a_lost_rank_shows_on_the_next_request(logged):
    """measured: lab-notes.md, The real vLLM on the CPU: native TP 2, rank 1 (headless) killed ->
    rank 0's /health stays 200, the next request gets 500, then rank 0 exits with status 0."""
    mport = free_port()
    r0 = logged("rank0", *_native(0, 2, mport), **NATIVE_ENV)
    # rank 0 waits for the other node: its API answers, but not healthy
    assert r0.wait_for(lambda: "Waiting for 1 other node(s) to join" in r0.text(), 30), r0.text()
    time.sleep(2)
    assert r0.proc.poll() is None and r0.health() == 503
    r1 = logged("rank1", *_native(1, 2, mport, "--headless"), **NATIVE_ENV)
    assert r0.wait_for(lambda: r0.health() == 200, 60), r0.text()
    out0 = r0.text()
    assert "Gloo ring all-reduce verified across 2 ranks" in out0
    assert "node 1 (" in out0 and "joined: ranks [1]" in out0
    st, raw = _ask(r0.base)
    assert st == 200 and "42" in json.loads(raw)["choices"][0]["message"]["content"]
    # the headless node serves no API, though it was given a port
    assert r1.wait_for(lambda: "Headless node ready" in r1.text(), 30), r1.text()
    assert r1.health() is None
    # a lost rank: rank 0 notices nothing (and says nothing) until a request needs the group
    r1.proc.kill()
    assert set(_health_codes(r0, 3)) == {200} and r0.proc.poll() is None
    assert "EngineCore encountered a fatal error." not in r0.text()
    t0 = time.monotonic()
    st, _ = _ask(r0.base)
    assert st == 500
    t_503, t_exit = _dead_then_exit_0(r0, t0)
    print(f"native: rank 1 killed -> rank 0 /health 200 until a request: 500, 503 after {t_503:.2f}s, "
          f"exit 0 after {t_exit:.2f}s")
    assert t_exit < 15
    out0 = r0.text()
    assert "EngineCore encountered a fatal error." in out0 and "EngineDeadError" in out0


def test_native_rank0_without_requests_dies_after_the_group_timeout(logged):
    """measured: lab-notes.md, The real vLLM on the CPU: with rank 1 killed, rank 0's /health stays
    200 for 45 s (here LAB_ENGINE_LOST_RANK_SECONDS=4), then 503 and exit status 0."""
    _, r0, r1 = _native_pair(logged, LAB_ENGINE_LOST_RANK_SECONDS="4", LAB_ENGINE_DEAD_EXIT_SECONDS="1")
    r1.proc.kill()
    t0 = time.monotonic()
    assert set(_health_codes(r0, 2)) == {200}
    assert r0.wait_for(lambda: r0.health() != 200, 15), r0.text()
    t_503, t_exit = _dead_then_exit_0(r0, t0)
    print(f"native: rank 1 killed, no request -> rank 0 503 after {t_503:.2f}s, exit 0 after {t_exit:.2f}s")
    assert 3 < t_503 < 12


def test_native_multinode_headless_is_stranded_when_rank0_dies(logged):
    """measured: lab-notes.md, The real vLLM on the CPU: rank 0 killed -> the headless rank runs on
    (stranded); a new rank 0 hangs in start-up (never healthy) and ignores SIGTERM."""
    mport, r0, r1 = _native_pair(logged)
    # a second node 1 finds the group formed: it is refused and keeps retrying
    late = logged("late", *_native(1, 2, mport, "--headless"), **NATIVE_ENV)
    assert late.wait_for(lambda: "already formed" in late.text(), 30), late.text()
    assert late.proc.poll() is None and r0.health() == 200
    late.stop()
    r0.proc.kill()
    r0.proc.wait(10)
    assert r1.wait_for(lambda: "keeps its engine rank(s) in the old group" in r1.text(), 30), r1.text()
    time.sleep(3)
    assert r1.proc.poll() is None, r1.text()       # stranded, not exited
    assert "EngineCore encountered a fatal error." not in r1.text()
    # a new rank 0 on the same master waits for a node that does not come, and ignores SIGTERM
    new0 = logged("new0", *_native(0, 2, mport), **NATIVE_ENV)
    assert new0.wait_for(lambda: "Waiting for 1 other node(s) to join" in new0.text(), 30), new0.text()
    new0.proc.send_signal(signal.SIGTERM)
    codes = _health_codes(new0, 4)
    assert new0.proc.poll() is None, new0.text()
    # its log line may come after the probes on a loaded machine (seen in CI beside the lab's tests)
    assert new0.wait_for(lambda: "Received SIGTERM while waiting for node(s) [1] to join" in new0.text(), 15), \
        new0.text()
    assert new0.proc.poll() is None, new0.text()
    assert 200 not in codes and set(codes) == {503}, codes
    assert r1.proc.poll() is None


def test_native_multinode_bad_layouts_fail(hf_home):
    env = env_for(hf_home, **NATIVE_ENV)
    r = run_cli(["serve", "Qwen/Qwen3-0.6B", "--port", str(free_port()), "-tp", "1", "--nnodes", "2"], env)
    assert r.returncode == 1 and "must be divisible by nnodes (2)" in r.stderr, r.stderr
    r = run_cli(["serve", "Qwen/Qwen3-0.6B", "--port", str(free_port()), *_native(1, 2, free_port(), "--headless"),
                 "--distributed-executor-backend", "ray"], env)
    assert r.returncode == 1 and "cannot be combined with --distributed-executor-backend ray" in r.stderr
    # nobody at the master: the node gives up after the rendezvous timeout
    r = run_cli(["serve", "Qwen/Qwen3-0.6B", *_native(1, 2, free_port(), "--headless")],
                dict(env, LAB_ENGINE_DIST_TIMEOUT="3"))
    assert r.returncode == 1 and "The client socket has timed out after 3s" in r.stderr, r.stderr
    # the master alone times out waiting for the others
    r = run_cli(["serve", "Qwen/Qwen3-0.6B", "--port", str(free_port()), *_native(0, 2, free_port())],
                dict(env, LAB_ENGINE_DIST_TIMEOUT="3"))
    assert r.returncode == 1 and "waiting for clients. 1/2 clients joined" in r.stderr, r.stderr


# ---------------------------------------------------------------- what an image's vLLM says about itself
def test_version_and_help_all(hf_home):
    from sparklab.engine import VERSION
    env = env_for(hf_home)
    r = run_cli(["--version"], env)
    assert r.returncode == 0 and r.stdout.strip() == VERSION
    r = run_cli(["serve", "--help=all"], env)
    assert r.returncode == 0
    for flag in ("--tensor-parallel-size", "--pipeline-parallel-size", "--distributed-executor-backend",
                 "--nnodes", "--node-rank", "--master-addr", "--master-port", "--headless",
                 "--max-model-len", "--api-key"):
        assert flag in r.stdout, flag
    r = run_cli(["serve", "--help=ParallelConfig"], env)
    assert r.returncode == 0 and "--nnodes" in r.stdout and "--max-model-len" not in r.stdout
    r = run_cli(["serve", "--help"], env)
    assert r.returncode == 0 and "--help=all" in r.stdout and "--nnodes" not in r.stdout


def test_an_old_vllm_knows_no_native_multinode(hf_home, tmp_path):
    # the lab image of an older vLLM carries its version in image_version next to the engine
    pkg = tmp_path / "pkg"
    shutil.copytree(ROOT / "sparklab" / "engine", pkg / "sparklab" / "engine",
                    ignore=shutil.ignore_patterns("__pycache__"))
    (pkg / "sparklab" / "__init__.py").write_text("")
    (pkg / "sparklab" / "engine" / "image_version").write_text("0.10.2\n")
    env = env_for(hf_home, PYTHONPATH=str(pkg))

    def old(*args):
        return subprocess.run([sys.executable, "-m", "sparklab.engine", *args], env=env, cwd=pkg,
                              capture_output=True, text=True, timeout=30)
    r = old("--version")
    assert r.stdout.strip() == "0.10.2"
    r = old("serve", "--help=all")
    assert r.returncode == 0 and "--nnodes" not in r.stdout and "--headless" in r.stdout
    r = old("serve", "Qwen/Qwen3-0.6B", "--nnodes", "2")
    assert r.returncode == 2 and "unrecognized arguments: --nnodes 2" in r.stderr


def test_ray_tp2_dies_when_a_rank_is_lost(ray_cluster, hf_home, tmp_path, ray_py):
    """A lost Ray worker kills the engine core, which ends as a killed engine core does (measured:
    lab-notes.md, The real vLLM on the CPU: /health 503, exit status 0). Ray on the CPU build was
    not measured: that the worker's death reaches the engine core is vLLM's design (its Ray
    executor runs there)."""
    env = ray_cluster(2)
    e = LoggedEngine(hf_home, tmp_path, "ray", ("-tp", "2", "--distributed-executor-backend", "ray"),
                     python=ray_py, **{k: env[k] for k in ("GLOO_SOCKET_IFNAME", "RAY_ADDRESS")},
                     LAB_ENGINE_COLLECTIVE_BYTES=str(1 << 20))
    try:
        assert e.wait_for(lambda: e.health() == 200, 120), e.text()
        import re
        pid = int(re.search(r"rank 1: node \S+ \(ip .*?, pid (\d+)\)", e.text()).group(1))
        os.kill(pid, 9)   # the rank's worker (its GPU) is gone
        t0 = time.monotonic()
        # the engine core dies with its Ray worker: as a killed engine core (measured: lab-notes.md,
        # The real vLLM on the CPU), /health 503, then the API server exits with status 0
        t_503, t_exit = _dead_then_exit_0(e, t0)
        print(f"ray: rank 1 killed -> rank 0 /health 503 after {t_503:.2f}s, exited 0 after {t_exit:.2f}s")
        assert t_exit < 20
        assert "EngineCore encountered a fatal error." in e.text()
    finally:
        e.stop()


# ---------------------------------------------------------------- vllm bench serve (the client's stand-in)
def test_ignore_eos_generates_to_max_tokens(engine_factory):
    e = engine_factory()
    e.wait_ready()
    st, short = e.chat("What is 1+1?", max_tokens=40, chat_template_kwargs={"enable_thinking": False})
    assert st == 200 and short["usage"]["completion_tokens"] < 40  # the answer stops by itself
    st, long = e.chat("What is 1+1?", max_tokens=40, ignore_eos=True, chat_template_kwargs={"enable_thinking": False})
    assert st == 200 and long["usage"]["completion_tokens"] == 40 and long["choices"][0]["finish_reason"] == "length"
    st, some = e.chat("What is 1+1?", max_tokens=40, min_tokens=25, chat_template_kwargs={"enable_thinking": False})
    assert st == 200 and some["usage"]["completion_tokens"] == 25


def test_bench_serve_measures_and_writes_vllms_result_file(engine_factory, hf_home, tmp_path):
    e = engine_factory("--api-key", "sekrit", LAB_ENGINE_TOKEN_SECONDS="0.002")
    e.wait_ready()
    argv = ["bench", "serve", "--backend", "openai-chat", "--endpoint", "/v1/chat/completions", "--base-url", e.base,
            "--model", "Qwen/Qwen3-0.6B", "--dataset-name", "random", "--random-input-len", "64",
            "--random-output-len", "16", "--ignore-eos", "--num-prompts", "8", "--max-concurrency", "4",
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99", "--save-result",
            "--result-dir", str(tmp_path), "--result-filename", "c4.json"]
    r = run_cli(argv, env_for(hf_home, OPENAI_API_KEY="sekrit"))
    assert r.returncode == 0, r.stdout + r.stderr
    doc = json.loads((tmp_path / "c4.json").read_text())
    assert doc["completed"] == 8 and doc["failed"] == 0 and doc["max_concurrency"] == 4
    assert doc["total_output_tokens"] == 8 * 16 and doc["total_input_tokens"] >= 8 * 64
    assert 0 < doc["p50_ttft_ms"] <= doc["p99_ttft_ms"] and doc["p50_itl_ms"] > 0 and doc["p99_e2el_ms"] > 0
    assert doc["output_throughput"] == pytest.approx(doc["total_output_tokens"] / doc["duration"])
    # a wrong key: vLLM's client stops at its first request, exit status 1
    r = run_cli(argv, env_for(hf_home, OPENAI_API_KEY="wrong"))
    assert r.returncode == 1 and "Initial test run failed" in r.stderr and "401" in r.stderr


def test_the_counters_move_while_a_long_request_runs(engine_factory):
    """vLLM counts prompt tokens when a request's prefill step ends and each generated token at the step
    that made it (vllm/v1/metrics/loggers.py: iteration stats every engine step), so a healthy engine's
    counters move while a long request runs: what the node guard's stall rule reads. The stand-in
    counted them at the request's end, so a long healthy request on it looked like a stall."""
    import re
    import threading

    e = engine_factory(LAB_ENGINE_TOKEN_SECONDS="0.15")
    e.wait_ready()
    done = threading.Thread(target=e.chat, args=("Count from one to a hundred.",), kwargs={"max_tokens": 30})
    done.start()
    time.sleep(2.0)
    _, text = e.request("/metrics")
    done.join()

    def value(name):
        return float(re.search(rf"^{re.escape(name)}\{{[^}}]*\}} (\S+)$", text, re.M).group(1))

    assert value("vllm:num_requests_running") == 1.0
    assert value("vllm:prompt_tokens_total") > 0 and value("vllm:generation_tokens_total") >= 5
