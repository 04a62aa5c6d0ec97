"""The OpenAI-compatible HTTP server (ThreadingHTTPServer) and Prometheus /metrics."""
from __future__ import annotations

import json
import math
import os
import socket
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from . import VERSION, generation


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True


class _Server6(_Server):
    address_family = socket.AF_INET6


class HTTPError(Exception):
    def __init__(self, status: int, message: str, kind: str = "BadRequestError", param=None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param


class EngineDead(Exception):
    """The engine core is gone (vllm.v1.engine.exceptions.EngineDeadError)."""


class Metrics:
    def __init__(self):
        self.lock = threading.Lock()
        self.running = 0
        self.waiting = 0
        self.kv_tokens = 0
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.success: dict = {}
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.spec_drafts = 0
        self.spec_draft_tokens = 0
        self.spec_accepted = 0
        self.e2e = []
        self.ttft = []
        self.last_log = (time.time(), 0, 0)


_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
            20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]


class Server:
    def __init__(self, args, logger):
        self.args, self.logger = args, logger
        host = args.host if args.host is not None else "0.0.0.0"
        cls = _Server6 if ":" in host else _Server
        self.httpd = cls((host, args.port), _make_handler(self))
        self.ready = False
        self.cfg = None
        self.cluster = None
        self.metrics = Metrics()
        self.prefix_cache: set = set()
        self.slots = None
        self.stop_event = threading.Event()
        # failure states (engine._engine_dead, engine._group_lost): dead -> /health 503 and every
        # generation 500; broken -> a rank of the group is gone, found by the next step
        self.dead = None
        self.broken = None
        self.on_engine_dead = None
        self.token_delay = float(os.environ.get("LAB_ENGINE_TOKEN_SECONDS", "0.002"))

    # lifecycle -------------------------------------------------------------
    def start(self):
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.1},
                                       daemon=True)
        self.thread.start()

    def set_ready(self, cfg):
        self.cfg = cfg
        self.slots = threading.BoundedSemaphore(cfg.max_num_seqs)
        host, port = self.httpd.server_address[:2]
        self.logger.info("Starting vLLM API server 0 on http://%s:%d", host, port)
        self.logger.info("Available routes are: /health, /ping, /version, /metrics, /v1/models, "
                         "/v1/chat/completions, /v1/completions")
        self.ready = True
        self.logger.info("Application startup complete.")
        if not self.args.disable_log_stats:
            threading.Thread(target=self._stats_loop, daemon=True).start()

    def healthy(self) -> bool:
        return self.ready and not self.dead

    def break_group(self, msg: str, unnoticed_s: float) -> None:
        """Native rank 0 lost a rank of its group: nothing shows (/health stays 200) until the next
        generation step fails on it (engine_step), or unnoticed_s seconds pass without one."""
        if self.broken or self.dead:
            return
        self.broken = msg

        def expire():
            if not self.stop_event.wait(unnoticed_s) and not self.dead:
                self._die(f"{msg} (no step for {unnoticed_s:g}s: the group's timeout)")
        threading.Thread(target=expire, daemon=True, name="group-timeout").start()

    def _die(self, msg: str) -> None:
        if self.on_engine_dead is not None:
            self.on_engine_dead(msg)
        else:
            self.dead = msg

    def engine_step(self) -> None:
        """What every generation step meets first: a dead engine core, or the collective of a
        broken group (which kills the engine core, as in vLLM)."""
        if self.broken and not self.dead:
            self._die(self.broken)
        if self.dead:
            raise EngineDead(self.dead)

    def wait(self):
        while not self.stop_event.wait(0.5):
            pass

    def stop(self):
        self.stop_event.set()
        self.httpd.shutdown()
        self.httpd.server_close()

    def _stats_loop(self):
        interval = float(os.environ.get("VLLM_LOG_STATS_INTERVAL", "10"))
        while not self.stop_event.wait(interval):
            m = self.metrics
            with m.lock:
                t_prev, p_prev, g_prev = m.last_log
                now = time.time()
                dp, dg = m.prompt_tokens - p_prev, m.generation_tokens - g_prev
                m.last_log = (now, m.prompt_tokens, m.generation_tokens)
                if not (dp or dg or m.running or m.waiting):
                    continue
                hit = 100.0 * m.prefix_hits / m.prefix_queries if m.prefix_queries else 0.0
                self.logger.info("Engine 000: Avg prompt throughput: %.1f tokens/s, Avg generation throughput: "
                                 "%.1f tokens/s, Running: %d reqs, Waiting: %d reqs, GPU KV cache usage: %.1f%%, "
                                 "Prefix cache hit rate: %.1f%%", dp / (now - t_prev), dg / (now - t_prev),
                                 m.running, m.waiting, 100.0 * self.kv_usage(), hit)
                if self.cfg.spec and m.spec_drafts:
                    self.logger.info("SpecDecoding metrics: Mean acceptance length: %.2f, Accepted: %d tokens, "
                                     "Drafted: %d tokens, Avg Draft acceptance rate: %.1f%%",
                                     1 + m.spec_accepted / m.spec_drafts, m.spec_accepted, m.spec_draft_tokens,
                                     100.0 * m.spec_accepted / max(1, m.spec_draft_tokens))

    def kv_usage(self) -> float:
        if not self.cfg or not self.cfg.kv_capacity:
            return 0.0
        return min(1.0, self.metrics.kv_tokens / self.cfg.kv_capacity)

    # metrics -----------------------------------------------------------------
    def render_metrics(self) -> str:
        m, cfg = self.metrics, self.cfg
        out = []
        names = cfg.served_names if cfg else [self.args.served_model_name[0] if self.args.served_model_name else self.args.model]
        lab = f'engine="0",model_name="{names[0]}"'

        def metric(name, typ, help_, samples):
            out.append(f"# HELP {name} {help_}")
            out.append(f"# TYPE {name} {typ}")
            for suffix, labels, value in samples:
                out.append(f"{name}{suffix}{{{labels}}} {float(value)}")

        with m.lock:
            metric("vllm:num_requests_running", "gauge", "Number of requests in model execution batches.",
                   [("", lab, m.running)])
            metric("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.",
                   [("", lab, m.waiting)])
            metric("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.",
                   [("", lab, self.kv_usage())])
            metric("vllm:gpu_cache_usage_perc", "gauge",
                   "GPU KV-cache usage. 1 means 100 percent usage. DEPRECATED: Use vllm:kv_cache_usage_perc.",
                   [("", lab, self.kv_usage())])
            metric("vllm:prefix_cache_queries", "counter", "Prefix cache queries, in terms of number of queried tokens.",
                   [("_total", lab, m.prefix_queries)])
            metric("vllm:prefix_cache_hits", "counter", "Prefix cache hits, in terms of number of cached tokens.",
                   [("_total", lab, m.prefix_hits)])
            metric("vllm:num_preemptions", "counter", "Cumulative number of preemption from the engine.",
                   [("_total", lab, 0)])
            metric("vllm:prompt_tokens", "counter", "Number of prefill tokens processed.",
                   [("_total", lab, m.prompt_tokens)])
            metric("vllm:generation_tokens", "counter", "Number of generation tokens processed.",
                   [("_total", lab, m.generation_tokens)])
            reasons = dict.fromkeys(("stop", "length", "abort", "error"), 0)
            reasons.update(m.success)
            metric("vllm:request_success", "counter", "Count of successfully processed requests.",
                   [("_total", f'{lab},finished_reason="{r}"', n) for r, n in sorted(reasons.items())])
            if cfg and cfg.spec:
                metric("vllm:spec_decode_num_drafts", "counter", "Number of spec decoding drafts.",
                       [("_total", lab, m.spec_drafts)])
                metric("vllm:spec_decode_num_draft_tokens", "counter", "Number of draft tokens.",
                       [("_total", lab, m.spec_draft_tokens)])
                metric("vllm:spec_decode_num_accepted_tokens", "counter", "Number of accepted tokens.",
                       [("_total", lab, m.spec_accepted)])
            for name, help_, values in (
                    ("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", m.e2e),
                    ("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", m.ttft)):
                samples = [("_bucket", f'{lab},le="{b}"', sum(1 for v in values if v <= b)) for b in _BUCKETS]
                samples.append(("_bucket", f'{lab},le="+Inf"', len(values)))
                samples.append(("_count", lab, len(values)))
                samples.append(("_sum", lab, sum(values)))
                metric(name, "histogram", help_, samples)
            if cfg:
                a = self.args
                out.append("# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig")
                out.append("# TYPE vllm:cache_config_info gauge")
                out.append(f'vllm:cache_config_info{{block_size="{cfg.block_size}",cache_dtype="{a.kv_cache_dtype}",'
                           f'enable_prefix_caching="{cfg.prefix_caching}",engine="0",'
                           f'gpu_memory_utilization="{a.gpu_memory_utilization}",'
                           f'num_gpu_blocks="{cfg.kv_capacity // cfg.block_size}"}} 1.0')
        return "\n".join(out) + "\n"

    # request processing ----------------------------------------------------
    def check_model(self, body: dict) -> str:
        name = body.get("model")
        if name is None:
            return self.cfg.served_names[0]
        if name not in self.cfg.served_names:
            raise HTTPError(404, f"The model `{name}` does not exist.", "NotFoundError", "model")
        return name

    def prefix_lookup(self, words: list) -> int:
        """Prefix caching: count cached tokens in full blocks (block_size words)."""
        if not self.cfg.prefix_caching:
            return 0
        bs = self.cfg.block_size
        hits = 0
        blocks = len(words) // bs
        h = ""
        with self.metrics.lock:
            self.metrics.prefix_queries += len(words)
            for i in range(blocks):
                h = str(hash((h, tuple(words[i * bs:(i + 1) * bs]))))
                if h in self.prefix_cache and hits == i * bs:
                    hits += bs
                self.prefix_cache.add(h)
            self.metrics.prefix_hits += hits
        return hits

    def generate(self, prompt_words: list, pieces: list, max_tokens: int, emit, request_id: str):
        """Run one request through the 'scheduler'. pieces = [(channel, [words])...] in order.

        Calls emit(channel, word_text) per token; returns (per-channel texts, n_tokens, finish_reason).
        """
        m = self.metrics
        with m.lock:
            m.waiting += 1
        t0 = time.time()
        self.slots.acquire()
        with m.lock:
            m.waiting -= 1
            m.running += 1
            m.kv_tokens += len(prompt_words)
        produced = {}
        n = 0
        finish = "stop"
        first = None
        try:
            self.engine_step()
            # vLLM counts a request's prompt tokens when its prefill step ends and each generated token at
            # the step that made it (its iteration stats feed the counters every engine step: vllm/v1/
            # metrics/loggers.py), so the counters move while a long request runs; the node guard's stall
            # rule reads exactly that
            with m.lock:
                m.prompt_tokens += len(prompt_words)
            budget = max_tokens
            for channel, words in pieces:
                taken, budget, truncated = generation.take(words, budget)
                for i, w in enumerate(taken):
                    if self.token_delay:
                        time.sleep(self.token_delay)
                    self.engine_step()
                    text = w if not produced.get(channel) else " " + w
                    produced[channel] = produced.get(channel, "") + text
                    emit(channel, text)
                    n += 1
                    if first is None:
                        first = time.time() - t0
                    with m.lock:
                        m.kv_tokens += 1
                        m.generation_tokens += 1
                if truncated:
                    finish = "length"
                    break
            return produced, n, finish
        except EngineDead:
            finish = "error"
            raise
        finally:
            with m.lock:
                m.running -= 1
                m.kv_tokens -= len(prompt_words) + n
                m.success[finish] = m.success.get(finish, 0) + 1
                m.e2e.append(time.time() - t0)
                m.ttft.append(first if first is not None else time.time() - t0)
                spec = self.cfg.spec
                if spec and n:
                    k = spec["num_speculative_tokens"]
                    rate = float(os.environ.get("LAB_ENGINE_SPEC_ACCEPTANCE", "0.6"))
                    drafts = max(1, math.ceil(n / (1 + k * rate)))
                    m.spec_drafts += drafts
                    m.spec_draft_tokens += drafts * k
                    m.spec_accepted += min(n - drafts if n > drafts else 0, round(drafts * k * rate))
            self.slots.release()


def _content_text(content) -> tuple[str, dict]:
    """Text of an OpenAI message content + count of multimodal items per modality."""
    if content is None:
        return "", {}
    if isinstance(content, str):
        return content, {}
    texts, mm = [], {}
    if isinstance(content, list):
        for part in content:
            if not isinstance(part, dict):
                continue
            t = part.get("type")
            if t == "text":
                texts.append(str(part.get("text", "")))
            elif t in ("image_url", "input_image", "image"):
                mm["image"] = mm.get("image", 0) + 1
            elif t in ("audio_url", "input_audio"):
                mm["audio"] = mm.get("audio", 0) + 1
            elif t == "video_url":
                mm["video"] = mm.get("video", 0) + 1
    return " ".join(texts), mm


def _error_body(e: HTTPError) -> dict:
    return {"error": {"message": e.message, "type": e.kind, "param": e.param, "code": e.status}}


def _make_handler(srv: Server):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        server_version = "uvicorn"
        sys_version = ""

        def log_message(self, fmt, *a):
            if srv.args.disable_uvicorn_access_log or srv.args.uvicorn_log_level not in ("info", "debug", "trace"):
                return
            srv.logger.info('%s:%d - "%s %s HTTP/1.1" %s', self.client_address[0], self.client_address[1],
                            self.command, self.path, a[1] if len(a) > 1 else "")

        # helpers
        def _send(self, status: int, body, ctype="application/json", extra=None):
            data = body if isinstance(body, bytes) else (
                body.encode() if isinstance(body, str) else json.dumps(body).encode())
            self.send_response(status)
            self.send_header("content-type", ctype)
            self.send_header("content-length", str(len(data)))
            for k, v in (extra or {}).items():
                self.send_header(k, v)
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)

        def _authorized(self) -> bool:
            keys = srv.args.api_key
            if not keys:
                return True
            path = self.path.split("?")[0]
            if not path.startswith(("/v1", "/v2", "/inference")):
                return True
            return self.headers.get("Authorization", "") in {f"Bearer {k}" for k in keys}

        def _gate(self) -> bool:
            if not srv.ready:
                self._send(503, {"error": {"message": "Server is starting up: the model is still loading.",
                                           "type": "ServiceUnavailableError", "param": None, "code": 503}})
                return False
            if not self._authorized():
                self._send(401, {"error": "Unauthorized"})
                return False
            return True

        def do_GET(self):
            path = self.path.split("?")[0]
            if path in ("/health", "/ping"):
                return self._send(200 if srv.healthy() else 503, b"", "application/json")
            if path == "/version":
                return self._send(200, {"version": VERSION})
            if path == "/metrics":
                return self._send(200, srv.render_metrics(), "text/plain; version=0.0.4; charset=utf-8")
            if path in ("/v1/models", "/v1/chat/completions", "/v1/completions"):
                if not self._gate():
                    return
                if path != "/v1/models":
                    return self._send(405, {"detail": "Method Not Allowed"})
                cfg = srv.cfg
                data = [{"id": n, "object": "model", "created": int(time.time()), "owned_by": "vllm",
                         "root": srv.args.model, "parent": None, "max_model_len": cfg.max_model_len,
                         "permission": [{"id": f"modelperm-{uuid.uuid4().hex}", "object": "model_permission",
                                         "created": int(time.time()), "allow_create_engine": False,
                                         "allow_sampling": True, "allow_logprobs": True,
                                         "allow_search_indices": False, "allow_view": True,
                                         "allow_fine_tuning": False, "organization": "*", "group": None,
                                         "is_blocking": False}]} for n in cfg.served_names]
                return self._send(200, {"object": "list", "data": data})
            self._send(404, {"detail": "Not Found"})

        do_HEAD = do_GET

        def do_POST(self):
            path = self.path.split("?")[0]
            n = int(self.headers.get("content-length") or 0)
            raw = self.rfile.read(n) if n else b""
            if path in ("/health", "/ping", "/v1/models", "/metrics", "/version"):
                if path == "/ping":
                    return self._send(200 if srv.healthy() else 503, b"")
                return self._send(405, {"detail": "Method Not Allowed"})
            if path not in ("/v1/chat/completions", "/v1/completions"):
                return self._send(404, {"detail": "Not Found"})
            if not self._gate():
                return
            rid_hdr = self.headers.get("X-Request-Id")
            self.streaming = False
            try:
                try:
                    body = json.loads(raw or b"null")
                except ValueError as e:
                    raise HTTPError(400, f"JSON decode error: {e}")
                if not isinstance(body, dict):
                    raise HTTPError(400, "Input should be a valid dictionary")
                if path == "/v1/chat/completions":
                    self._chat(body, rid_hdr)
                else:
                    self._completion(body, rid_hdr)
            except HTTPError as e:
                self._send(e.status, _error_body(e))
            except EngineDead as e:
                # vLLM: EngineDeadError -> 500 with no body; a stream already under way gets an
                # error event and [DONE]
                try:
                    if self.streaming:
                        self._sse({"error": {"message": f"EngineCore encountered an issue: {e}",
                                             "type": "InternalServerError", "param": None, "code": 500}})
                        self._sse("[DONE]")
                    else:
                        self._send(500, b"", "application/json")
                except (BrokenPipeError, ConnectionResetError):
                    pass
            except (BrokenPipeError, ConnectionResetError):
                pass

        # ------------------------------------------------------------ common
        def _max_tokens(self, body, prompt_len):
            cfg = srv.cfg
            mt = body.get("max_completion_tokens", body.get("max_tokens"))
            if mt is None:
                mt = cfg.sampling_defaults.get("max_tokens")
            if mt is not None:
                if not isinstance(mt, int) or isinstance(mt, bool) or mt < 1:
                    raise HTTPError(400, f"max_tokens must be at least 1, got {mt}.", param="max_tokens")
                if prompt_len + mt > cfg.max_model_len:
                    raise HTTPError(400, f"This model's maximum context length is {cfg.max_model_len} tokens. "
                                    f"However, you requested {prompt_len + mt} tokens ({prompt_len} in the "
                                    f"messages, {mt} in the completion). Please reduce the length of the "
                                    "messages or completion.", param="max_tokens")
                return mt
            if prompt_len >= cfg.max_model_len:
                raise HTTPError(400, f"This model's maximum context length is {cfg.max_model_len} tokens. "
                                f"However, your request has {prompt_len} input tokens. Please reduce the "
                                "length of the input messages.")
            return cfg.max_model_len - prompt_len

        def _log_request(self, rid, prompt, max_tokens):
            if srv.args.enable_log_requests:
                limit = srv.args.max_log_len
                shown = prompt if limit is None else prompt[:limit]
                srv.logger.info("Received request %s: prompt: %r, params: SamplingParams(max_tokens=%d)",
                                rid, shown, max_tokens)

        def _start_stream(self, rid):
            self.send_response(200)
            self.send_header("content-type", "text/event-stream; charset=utf-8")
            self.send_header("cache-control", "no-cache")
            self.send_header("connection", "close")
            if srv.args.enable_request_id_headers:
                self.send_header("X-Request-Id", rid)
            self.end_headers()
            self.close_connection = True
            self.streaming = True

        def _sse(self, obj):
            data = obj if isinstance(obj, str) else json.dumps(obj)
            self.wfile.write(f"data: {data}\n\n".encode())
            self.wfile.flush()

        def _usage(self, prompt_tokens, n, cached):
            u = {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + n, "completion_tokens": n,
                 "prompt_tokens_details": None}
            if srv.args.enable_prompt_tokens_details:
                u["prompt_tokens_details"] = {"cached_tokens": cached}
            return u

        # ------------------------------------------------------------ chat
        def _chat(self, body, rid_hdr):
            cfg, args = srv.cfg, srv.args
            name = srv.check_model(body)
            if not cfg.has_chat_template:
                raise HTTPError(400, "As of transformers v4.44, default chat template is no longer allowed, "
                                "so you must provide a chat template if the tokenizer does not define one.")
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                raise HTTPError(400, "messages: Field required", param="messages")
            tools = body.get("tools") or []
            tool_choice = body.get("tool_choice", "auto" if tools else "none")
            if tool_choice == "auto" and tools and not (args.enable_auto_tool_choice and args.tool_call_parser):
                raise HTTPError(400, '"auto" tool choice requires --enable-auto-tool-choice and '
                                "--tool-call-parser to be set")
            if tool_choice not in ("none", "auto", "required") and not isinstance(tool_choice, dict):
                raise HTTPError(400, f"Invalid value for `tool_choice`: {tool_choice!r}", param="tool_choice")
            if tool_choice != "none" and tool_choice != "auto" and not tools:
                raise HTTPError(400, "When using `tool_choice`, `tools` must be set.", param="tool_choice")
            words, mm_total, last_user, last_role, last_tool = [], {}, "", None, None
            for msg in messages:
                if not isinstance(msg, dict) or "role" not in msg:
                    raise HTTPError(400, "Each message needs a `role`.", param="messages")
                text, mm = _content_text(msg.get("content"))
                words += text.split()
                for k, v in mm.items():
                    mm_total[k] = mm_total.get(k, 0) + v
                last_role = msg["role"]
                if msg["role"] == "user":
                    last_user = text
                if msg["role"] == "tool":
                    last_tool = text
            limits = args.limit_mm_per_prompt or {}
            for modality, count in mm_total.items():
                lim = limits.get(modality, 999)
                lim = lim.get("count", 999) if isinstance(lim, dict) else lim
                if count > lim:
                    raise HTTPError(400, f"At most {lim} {modality}(s) may be provided in one prompt.")
            if mm_total and ("vision_config" not in cfg.info.config or args.language_model_only):
                raise HTTPError(400, f"{cfg.info.architectures[0]} does not support multimodal inputs "
                                "(or was started with --language-model-only).")
            prompt_len = len(words)
            max_tokens = self._max_tokens(body, prompt_len)
            ctk = dict(args.default_chat_template_kwargs or {})
            ctk.update(body.get("chat_template_kwargs") or {})
            thinking = cfg.thinking_model and ctk.get("enable_thinking", cfg.thinks_by_default) is not False \
                and (cfg.thinks_by_default or ctk.get("enable_thinking") is True)
            if cfg.info.model_type.startswith("qwen3") and "/no_think" in last_user:
                thinking = False
            rid = rid_hdr or f"chatcmpl-{uuid.uuid4().hex}"
            self._log_request(rid, " ".join(words), max_tokens)
            cached = srv.prefix_lookup(words)
            # decide the output
            pieces = []  # (channel, words)
            call = None
            if cfg.degenerate:
                pieces = [("content", ["!" * 8] * max_tokens)]
            elif cfg.dummy:
                pieces = [("content", generation.gibberish(last_user, max_tokens).split())]
            else:
                if last_role != "tool" and tools:
                    call = generation.make_tool_call(tools, tool_choice, last_user)
                if last_tool is not None and last_role == "tool":
                    ans = f"Based on the tool result: {' '.join(last_tool.split()[:40])}"
                else:
                    ans = generation.answer(last_user, name)
                reason = generation.reasoning(last_user).split() if thinking else []
                if call:
                    ans = ""
                if reason and args.reasoning_parser:
                    pieces.append(("reasoning", reason))
                    pieces.append(("content", ans.split()))
                elif reason:  # thinking model without a reasoning parser: <think> stays in content
                    pieces.append(("content", ["<think>"] + reason + ["</think>"] + ans.split()))
                else:
                    pieces.append(("content", ans.split()))
                if call:
                    pieces.append(("tool", call[1].split()))
            # vLLM's extra sampling parameters: ignore_eos generates to max_tokens (what benchmark
            # clients send), min_tokens at least that many; the stop token comes no earlier
            mt = body.get("min_tokens")
            # (ignoring the stop token runs into max_tokens: finish_reason "length", as vLLM says)
            floor = max_tokens + 1 if body.get("ignore_eos") is True else (
                mt if isinstance(mt, int) and not isinstance(mt, bool) and mt > 0 else 0)
            if not call:
                pieces = generation.extend(pieces, min(floor, max_tokens + 1))
            created = int(time.time())
            role = args.response_role
            stream = bool(body.get("stream"))
            include_usage = stream and ((body.get("stream_options") or {}).get("include_usage") or
                                        args.enable_force_include_usage)
            tool_id = f"chatcmpl-tool-{uuid.uuid4().hex[:24]}"
            if stream:
                self._start_stream(rid)
                base = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": name}
                self._sse({**base, "choices": [{"index": 0, "delta": {"role": role, "content": ""},
                                                 "logprobs": None, "finish_reason": None}]})
                sent_tool = [False]

                def emit(channel, text):
                    if channel == "reasoning":
                        delta = {"reasoning_content": text, "reasoning": text}
                    elif channel == "tool":
                        fn = {"arguments": text}
                        tc = {"index": 0, "function": fn}
                        if not sent_tool[0]:
                            tc.update({"id": tool_id, "type": "function"})
                            fn["name"] = call[0]
                            sent_tool[0] = True
                        delta = {"tool_calls": [tc]}
                    else:
                        delta = {"content": text}
                    self._sse({**base, "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                                     "finish_reason": None}]})
                produced, n, finish = srv.generate(words, pieces, max_tokens, emit, rid)
                if call and finish == "stop":
                    finish = "tool_calls"
                self._sse({**base, "choices": [{"index": 0, "delta": {}, "logprobs": None,
                                                 "finish_reason": finish, "stop_reason": None}]})
                if include_usage:
                    self._sse({**base, "choices": [], "usage": self._usage(prompt_len, n, cached)})
                self._sse("[DONE]")
                return
            produced, n, finish = srv.generate(words, pieces, max_tokens, lambda c, t: None, rid)
            message = {"role": role, "content": produced.get("content") or None,
                       "refusal": None, "annotations": None, "audio": None, "function_call": None,
                       "tool_calls": [], "reasoning_content": produced.get("reasoning"),
                       "reasoning": produced.get("reasoning")}
            if call and finish == "stop":
                finish = "tool_calls"
                message["content"] = None
                message["tool_calls"] = [{"id": tool_id, "type": "function",
                                          "function": {"name": call[0], "arguments": produced.get("tool", "")}}]
            resp = {"id": rid, "object": "chat.completion", "created": created, "model": name,
                    "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": finish,
                                 "stop_reason": None}],
                    "service_tier": None, "system_fingerprint": None,
                    "usage": self._usage(prompt_len, n, cached), "prompt_logprobs": None,
                    "kv_transfer_params": None}
            extra = {"X-Request-Id": rid} if args.enable_request_id_headers else None
            self._send(200, resp, extra=extra)

        # ------------------------------------------------------------ completions
        def _completion(self, body, rid_hdr):
            cfg, args = srv.cfg, srv.args
            name = srv.check_model(body)
            prompt = body.get("prompt")
            if isinstance(prompt, list):
                if prompt and all(isinstance(p, int) for p in prompt):
                    prompt = " ".join(str(p) for p in prompt)
                elif len(prompt) == 1 and isinstance(prompt[0], str):
                    prompt = prompt[0]
                else:
                    raise HTTPError(400, "The lab engine handles a single prompt per request.", param="prompt")
            if not isinstance(prompt, str):
                raise HTTPError(400, "prompt: Field required", param="prompt")
            words = prompt.split()
            max_tokens = body.get("max_tokens")
            if max_tokens is None:
                max_tokens = cfg.sampling_defaults.get("max_tokens", 16)
            body = {**body, "max_tokens": max_tokens}
            max_tokens = self._max_tokens(body, len(words))
            rid = rid_hdr or f"cmpl-{uuid.uuid4().hex}"
            self._log_request(rid, prompt, max_tokens)
            cached = srv.prefix_lookup(words)
            if cfg.degenerate:
                out = ["!" * 8] * max_tokens
            elif cfg.dummy:
                out = generation.gibberish(prompt, max_tokens).split()
            else:
                a = generation.arithmetic(prompt)
                out = [a[1]] if a else generation.answer(prompt, name).split()
            pieces = [("content", out)]
            created = int(time.time())
            if body.get("stream"):
                self._start_stream(rid)
                base = {"id": rid, "object": "text_completion", "created": created, "model": name}

                def emit(channel, text):
                    self._sse({**base, "choices": [{"index": 0, "text": text, "logprobs": None,
                                                     "finish_reason": None, "stop_reason": None}]})
                _, n, finish = srv.generate(words, pieces, max_tokens, emit, rid)
                self._sse({**base, "choices": [{"index": 0, "text": "", "logprobs": None,
                                                 "finish_reason": finish, "stop_reason": None}]})
                if (body.get("stream_options") or {}).get("include_usage") or args.enable_force_include_usage:
                    self._sse({**base, "choices": [], "usage": self._usage(len(words), n, cached)})
                self._sse("[DONE]")
                return
            produced, n, finish = srv.generate(words, pieces, max_tokens, lambda c, t: None, rid)
            text = produced.get("content", "")
            if body.get("echo"):
                text = prompt + text
            resp = {"id": rid, "object": "text_completion", "created": created, "model": name,
                    "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish,
                                 "stop_reason": None, "prompt_logprobs": None}],
                    "service_tier": None, "system_fingerprint": None,
                    "usage": self._usage(len(words), n, cached), "kv_transfer_params": None}
            extra = {"X-Request-Id": rid} if args.enable_request_id_headers else None
            self._send(200, resp, extra=extra)

    return Handler
