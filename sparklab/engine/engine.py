"""Start-up: validate the configuration and the model, bring up parallel workers, then serve."""
from __future__ import annotations

import os
import threading
import time

from . import VERSION, distributed
from .cli import SPEC_METHODS
from .core import NAME as CORE_NAME, EngineCore
from .model import EngineError, load_model

# Quantization methods that need the checkpoint's own quantization config.
_CHECKPOINT_QUANT = {"awq", "awq_marlin", "gptq", "gptq_marlin", "gptq_marlin_24", "gptq_bitblas",
                     "modelopt", "modelopt_fp4", "compressed-tensors", "mxfp4", "aqlm", "marlin",
                     "bitblas", "quark", "auto-round", "gguf", "petit_nvfp4"}
_QUANT_COMPAT = {"gptq": {"gptq_marlin", "gptq_bitblas", "marlin", "gptq_marlin_24"},
                 "awq": {"awq_marlin"}, "modelopt": {"modelopt_fp4"}, "modelopt_fp4": {"modelopt"},
                 "fp8": {"fbgemm_fp8", "ptpc_fp8"}, "mxfp4": set(), "compressed-tensors": set()}
# Models whose chat template thinks by default (with the reasoning parser splitting it out).
_THINK_DEFAULT_ON = ("qwen3", "qwen3_moe", "qwen3_next", "qwen3_vl", "qwen3_vl_moe", "deepseek_v3",
                     "deepseek_r1", "glm4_moe", "minimax_m2", "gpt_oss", "seed_oss", "kimi_k2", "olmo3")
_DTYPE_BYTES = {"float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2}


class Config:
    """Everything the server needs, derived from args + model."""

    def __init__(self, args, info):
        self.args = args
        self.info = info
        self.served_names = args.served_model_name or [args.model]
        self.max_model_len = 0
        self.kv_capacity = 0
        self.thinks_by_default = info.model_type in _THINK_DEFAULT_ON
        self.thinking_model = self.thinks_by_default or info.model_type.startswith(("gemma3", "gemma4"))
        self.degenerate = info.is_fp4_moe and args.moe_backend != "marlin"
        self.dummy = args.load_format == "dummy"
        self.spec = args.speculative_config
        self.prefix_caching = args.enable_prefix_caching is not False
        self.max_num_seqs = args.max_num_seqs or 256
        self.block_size = args.block_size or 16
        self.sampling_defaults: dict = {}


def _nondefault(args) -> dict:
    from .cli import build_parser
    _, p = build_parser()
    defaults = {a.dest: a.default for a in p._actions}
    return {k: v for k, v in vars(args).items()
            if k in defaults and v != defaults[k] and k not in ("subparser", "api_key")}


def validate(args, info, logger) -> Config:
    cfg = Config(args, info)
    if args.allowed_local_media_path:  # vLLM's MediaConnector checks it when the engine starts
        media = args.allowed_local_media_path
        if not os.path.exists(media):
            raise EngineError("ValueError", f"Invalid `--allowed-local-media-path`: The path {media} does not exist.")
        if not os.path.isdir(media):
            raise EngineError("ValueError", f"Invalid `--allowed-local-media-path`: The path {media} must be a "
                                            "directory.")
    archs = info.architectures
    if info.config.get("auto_map") and not args.trust_remote_code:
        raise EngineError("ValueError",
                          f"The repository {args.model} contains custom code which must be executed to "
                          "correctly load the model. You can inspect the repository content at "
                          f"{info.path}. Please pass the argument `trust_remote_code=True` to allow "
                          "custom code to be run.")
    if not archs:
        raise EngineError("ValueError", "No model architectures are specified in config.json "
                          "(field `architectures`).")
    logger.info("Resolved architecture: %s", archs[0])
    logger.info("Model config: model_type=%s, num_hidden_layers=%s, hidden_size=%s, "
                "num_attention_heads=%s, num_key_value_heads=%s, vocab_size=%s, experts=%s, "
                "quantization=%s%s", info.model_type or "?", info.text("num_hidden_layers"),
                info.text("hidden_size"), info.text("num_attention_heads"),
                info.text("num_key_value_heads", info.text("num_attention_heads")),
                info.text("vocab_size"), info.num_experts or "none", info.quant_method or "none",
                " (FP4)" if info.is_fp4 else "")
    # tokenizer
    has_tok = any(os.path.exists(os.path.join(info.path, n)) for n in
                  ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "tekken.json", "vocab.json"))
    if not has_tok and not args.skip_tokenizer_init:
        raise EngineError("OSError", f"Can't load tokenizer for '{args.model}'. Make sure '{info.path}' "
                          "is the correct path to a directory containing all relevant files for a "
                          "tokenizer (tokenizer.json, tokenizer_config.json).")
    # quantization
    qm = info.quant_method
    if args.quantization:
        if qm and args.quantization != qm and args.quantization not in _QUANT_COMPAT.get(qm, set()):
            raise EngineError("ValueError",
                              f"Quantization method specified in the model config ({qm}) does not match "
                              f"the quantization method specified in the `quantization` argument "
                              f"({args.quantization}).")
        if not qm and args.quantization in _CHECKPOINT_QUANT:
            raise EngineError("ValueError", f"Cannot find the config file for {args.quantization}")
    if qm:
        logger.info("Using %s quantization%s", "modelopt_fp4" if qm == "modelopt" and info.is_fp4 else qm,
                    " (checkpoint config)" if not args.quantization else "")
    if info.is_fp4_moe:
        chosen = "MARLIN" if args.moe_backend == "marlin" else (
            args.moe_backend.upper() if args.moe_backend != "auto" else "FLASHINFER_CUTLASS")
        logger.info("Using '%s' NvFp4 MoE backend out of potential backends: ['FLASHINFER_TRTLLM', "
                    "'FLASHINFER_CUTLASS', 'CUTLASS', 'MARLIN']", chosen)
    # max_model_len
    derived = info.max_position_embeddings
    rope = info.text("rope_scaling") or {}
    if derived and isinstance(rope, dict) and rope.get("factor") and rope.get("rope_type", rope.get("type")) in ("yarn", "dynamic", "longrope"):
        derived = int(derived * float(rope["factor"]))
    if args.max_model_len is not None and args.max_model_len not in (-1,):
        if derived and args.max_model_len > derived and os.environ.get("VLLM_ALLOW_LONG_MAX_MODEL_LEN") != "1":
            raise EngineError("ValueError",
                              f"User-specified max_model_len ({args.max_model_len}) is greater than the derived "
                              f"max_model_len (max_position_embeddings={derived} or model_max_length=None in "
                              "model's config.json). To allow overriding this maximum, set the env var "
                              "VLLM_ALLOW_LONG_MAX_MODEL_LEN=1.")
        cfg.max_model_len = args.max_model_len
    else:
        cfg.max_model_len = derived or 2048
    # parallel / cache / scheduler checks
    if args.tensor_parallel_size < 1 or args.pipeline_parallel_size < 1:
        raise EngineError("ValueError", "tensor_parallel_size and pipeline_parallel_size must be >= 1")
    heads = info.text("num_attention_heads")
    if isinstance(heads, int) and heads % args.tensor_parallel_size:
        raise EngineError("ValueError", f"Total number of attention heads ({heads}) must be divisible by "
                          f"tensor parallel size ({args.tensor_parallel_size}).")
    layers = info.text("num_hidden_layers")
    if isinstance(layers, int) and args.pipeline_parallel_size > layers:
        raise EngineError("ValueError", f"pipeline_parallel_size ({args.pipeline_parallel_size}) exceeds "
                          f"num_hidden_layers ({layers}).")
    if not 0 < args.gpu_memory_utilization <= 1:
        raise EngineError("ValueError", "GPU memory utilization must be less than 1.0. Got "
                          f"{args.gpu_memory_utilization}.")
    mnbt = args.max_num_batched_tokens
    if mnbt is not None:
        if mnbt < cfg.max_num_seqs:
            raise EngineError("ValueError", f"max_num_batched_tokens ({mnbt}) must be greater than or equal to "
                              f"max_num_seqs ({cfg.max_num_seqs}).")
        if args.enable_chunked_prefill is False and mnbt < cfg.max_model_len:
            raise EngineError("ValueError",
                              f"max_num_batched_tokens ({mnbt}) is smaller than max_model_len "
                              f"({cfg.max_model_len}). This effectively limits the maximum sequence length "
                              "to max_num_batched_tokens and makes vLLM reject longer sequences. Please "
                              "increase max_num_batched_tokens or decrease max_model_len.")
    if args.max_num_partial_prefills > 1 and args.enable_chunked_prefill is False:
        raise EngineError("ValueError", "Chunked prefill must be enabled to set max_num_partial_prefills > 1.")
    if args.async_scheduling and args.pipeline_parallel_size > 1:
        raise EngineError("ValueError", "Async scheduling is not supported with pipeline-parallel-size > 1.")
    if args.limit_mm_per_prompt is not None:
        if not isinstance(args.limit_mm_per_prompt, dict) or not all(
                isinstance(v, (int, dict)) for v in args.limit_mm_per_prompt.values()):
            raise EngineError("ValueError", "--limit-mm-per-prompt expects a JSON object like '{\"image\": 2}'")
    # chat template
    if args.chat_template:
        ct = args.chat_template
        if any(ch in ct for ch in "{}\n"):
            logger.info("Using supplied chat template (inline string)")
        elif os.path.isfile(ct):
            logger.info("Using supplied chat template: %s", ct)
        else:
            raise EngineError("ValueError", f"The supplied chat template string ({ct}) appears path-like, "
                              "but doesn't exist!")
        cfg.has_chat_template = True
    else:
        cfg.has_chat_template = info.has_chat_template
    # speculative decoding
    if cfg.spec is not None:
        if not isinstance(cfg.spec, dict):
            raise EngineError("ValueError", "--speculative-config must be a JSON object")
        method = cfg.spec.get("method") or ("draft_model" if cfg.spec.get("model") else None)
        if method not in SPEC_METHODS:
            raise EngineError("ValueError", f"Unsupported speculative method: {method!r}. "
                              f"Expected one of {SPEC_METHODS}.")
        k = cfg.spec.get("num_speculative_tokens")
        if not isinstance(k, int) or k < 1:
            raise EngineError("ValueError", "num_speculative_tokens must be provided with speculative model "
                              "or ngram and be a positive integer.")
        if cfg.spec.get("model") and method in ("eagle", "eagle3", "medusa", "mlp_speculator", "draft_model"):
            draft = load_model(cfg.spec["model"], cfg.spec.get("revision"), args.download_dir,
                               args.load_format)
            logger.info("Speculative draft model %s resolved (%d weight files)", cfg.spec["model"],
                        len(draft.weight_files))
        cfg.spec = {**cfg.spec, "method": method}
        logger.info("Speculative decoding: method=%s, num_speculative_tokens=%d", method, k)
    # generation config
    if args.generation_config == "auto":
        gen = info.generation_config
    elif args.generation_config == "vllm":
        gen = {}
    else:
        gp = os.path.join(args.generation_config, "generation_config.json")
        if not os.path.isfile(gp):
            raise EngineError("OSError", f"{args.generation_config} does not appear to have a file named "
                              "generation_config.json.")
        import json
        gen = json.load(open(gp))
    defaults = {k: gen[k] for k in ("temperature", "top_p", "top_k", "repetition_penalty") if k in gen}
    if "max_new_tokens" in gen:
        defaults["max_tokens"] = gen["max_new_tokens"]
    defaults.update(args.override_generation_config or {})
    if defaults:
        logger.info("Default sampling parameters have been overridden by the model's Hugging Face "
                    "generation config recommended from the model creator. If this is not intended, "
                    "please relaunch vLLM instance with `--generation-config vllm`.")
    cfg.sampling_defaults = defaults
    return cfg


def plan_kv_cache(cfg: Config, logger) -> None:
    a, info = cfg.args, cfg.info
    total = float(os.environ.get("LAB_ENGINE_GPU_MEMORY_GIB", "119.7")) * (1 << 30)
    world = a.tensor_parallel_size * a.pipeline_parallel_size
    weights = info.weight_bytes / world if not cfg.dummy else 0
    budget = total * a.gpu_memory_utilization - weights - 1.5 * (1 << 30)  # activations, graphs
    layers = info.text("num_hidden_layers") or 1
    heads = info.text("num_attention_heads") or 1
    kv_heads = info.text("num_key_value_heads") or heads
    head_dim = info.text("head_dim") or ((info.text("hidden_size") or 128 * heads) // heads)
    dtype = a.dtype if a.dtype != "auto" else str(info.text("torch_dtype") or info.config.get("dtype") or "bfloat16")
    elt = 1 if a.kv_cache_dtype.startswith("fp8") else _DTYPE_BYTES.get(dtype, 2)
    per_token = max(1, 2 * layers * kv_heads * head_dim * elt // world)
    logger.info("Model loading took %.4f GiB memory", weights / (1 << 30))
    if budget <= 0:
        raise EngineError("ValueError", "No available memory for the cache blocks. Try increasing "
                          "`gpu_memory_utilization` when initializing the engine.")
    cfg.kv_capacity = int(budget // per_token) // cfg.block_size * cfg.block_size
    logger.info("Available KV cache memory: %.2f GiB", budget / (1 << 30))
    if cfg.kv_capacity < cfg.max_model_len:
        raise EngineError("ValueError",
                          f"To serve at least one request with the models's max seq len ({cfg.max_model_len}), "
                          f"({cfg.max_model_len * per_token / (1 << 30):.2f} GiB KV cache is needed, which is "
                          f"larger than the available KV cache memory ({budget / (1 << 30):.2f} GiB). Based on "
                          f"the available memory, the estimated maximum model length is {cfg.kv_capacity}. "
                          "Try increasing `gpu_memory_utilization` or decreasing `max_model_len` when "
                          "initializing the engine.")
    logger.info("GPU KV cache size: %s tokens", f"{cfg.kv_capacity:,}")
    logger.info("Maximum concurrency for %s tokens per request: %.2fx", f"{cfg.max_model_len:,}",
                cfg.kv_capacity / cfg.max_model_len)


def run(args, logger) -> int:
    from .server import Server
    if args.disable_log_requests:
        logger.warning("--disable-log-requests is deprecated and will be removed; request logging is "
                       "off unless --enable-log-requests is given.")
    headless = bool(getattr(args, "headless", False))
    nnodes = getattr(args, "nnodes", 1)
    if headless:
        logger.info("vLLM version %s (headless: engine ranks only, no API server)", VERSION)
    else:
        logger.info("vLLM API server version %s", VERSION)
    logger.info("non-default args: %s", _nondefault(args))
    server = None
    if not headless:
        # vLLM's API server starts its engine core as a process of its own (core.py); it is
        # forked before any thread of the server starts.
        core = EngineCore()
        logger.info("Started engine core %s (pid %d)", CORE_NAME, core.pid)
        try:
            server = Server(args, logger)
        except OSError as e:
            logger.error("OSError: [Errno %s] error while attempting to bind on address (%r, %d): %s",
                         e.errno, args.host or "0.0.0.0", args.port, e.strerror)
            return 1
        server.start()

    def lost(msg: str) -> None:
        _engine_dead(logger, server, msg)

    def group_lost(msg: str) -> None:
        _group_lost(logger, server, msg, lost)
    if server is not None:
        server.on_engine_dead = lost
        core.watch(lost)
    try:
        t0 = time.time()
        info = load_model(args.model, args.revision, args.download_dir, args.load_format, args.hf_overrides,
                          check_weights=False)
        cfg = validate(args, info, logger)
        logger.info("Using max model len %d", cfg.max_model_len)
        world = args.tensor_parallel_size * args.pipeline_parallel_size
        backend = args.distributed_executor_backend
        if nnodes > 1:
            if backend == "ray":
                raise EngineError("ValueError", "--nnodes > 1 runs vLLM's multiprocessing executor across "
                                  "nodes; it cannot be combined with --distributed-executor-backend ray.")
            backend = "mp"
        elif world > 1 and backend in (None, "uni"):
            backend = "ray" if world > distributed.local_gpu_count() else "mp"
        if backend == "uni" and world > 1:
            raise EngineError("ValueError", "The 'uni' executor backend supports world_size 1 only.")
        spec = {"model": args.model, "revision": args.revision, "download_dir": args.download_dir,
                "load_format": args.load_format, "hf_overrides": args.hf_overrides}
        logger.info("Initializing a V1 LLM engine (v%s) with config: model=%r, served_model_name=%s, "
                    "dtype=%s, max_seq_len=%d, download_dir=%r, load_format=%s, tensor_parallel_size=%d, "
                    "pipeline_parallel_size=%d, distributed_executor_backend=%s, quantization=%s, "
                    "kv_cache_dtype=%s, enforce_eager=%s, enable_prefix_caching=%s, "
                    "enable_chunked_prefill=%s, max_num_seqs=%d, swap_space=%g, seed=%d, "
                    "speculative_config=%s, compilation_config=%s, async_scheduling=%s, "
                    "attention_backend=%s, moe_backend=%s, mm_encoder_tp_mode=%s, limit_mm_per_prompt=%s, "
                    "media_io_kwargs=%s, allowed_local_media_path=%r, disable_custom_all_reduce=%s",
                    VERSION, args.model, cfg.served_names, args.dtype, cfg.max_model_len, args.download_dir,
                    args.load_format, args.tensor_parallel_size, args.pipeline_parallel_size, backend,
                    info.quant_method or args.quantization, args.kv_cache_dtype, args.enforce_eager,
                    cfg.prefix_caching, args.enable_chunked_prefill is not False, cfg.max_num_seqs,
                    args.swap_space, args.seed, cfg.spec, args.compilation_config, bool(args.async_scheduling),
                    args.attention_backend or "auto", args.moe_backend, args.mm_encoder_tp_mode,
                    args.limit_mm_per_prompt, args.media_io_kwargs, args.allowed_local_media_path,
                    args.disable_custom_all_reduce)
        cluster = None
        if nnodes > 1:
            from .native import NativeGroup
            cluster = NativeGroup(args, spec, logger, group_lost).start()
        elif world > 1 and backend == "ray":
            cluster = distributed.start_ray(world, spec, logger)
            distributed.monitor_ray(cluster, lost)
        elif world > 1:
            cluster = distributed.start_mp(world, spec, logger)
        else:
            load_model(args.model, args.revision, args.download_dir, args.load_format, args.hf_overrides)
        info_full = load_model(args.model, args.revision, args.download_dir, args.load_format, args.hf_overrides)
        cfg.info.weight_files, cfg.info.weight_bytes = info_full.weight_files, info_full.weight_bytes
        if args.attention_backend:
            logger.info("Using %s attention backend.", args.attention_backend)
        load_s = float(os.environ.get("LAB_ENGINE_LOAD_SECONDS", "2"))
        logger.info("Starting to load model %s...", args.model)
        time.sleep(load_s * (0.8 if not args.enforce_eager else 1.0))
        logger.info("Loading weights took %.2f seconds (%d safetensors files)", load_s * 0.8,
                    len(cfg.info.weight_files))
        plan_kv_cache(cfg, logger)
        if args.enforce_eager:
            logger.info("Cudagraph is disabled under eager mode")
        else:
            time.sleep(load_s * 0.2)
            logger.info("Graph capturing finished in %.0f secs", load_s * 0.2)
        if server is not None:
            server.cluster = cluster
        if args.async_scheduling:
            logger.info("Asynchronous scheduling is enabled.")
        logger.info("init engine (profile, create kv cache, warmup model) took %.2f seconds", time.time() - t0)
    except EngineError as e:
        logger.error("EngineCore failed to start.")
        for line in str(e).splitlines():
            logger.error("%s", line)
        if server is not None:
            server.stop()
        return 1
    if server is None:
        logger.info("Headless node ready: engine rank(s) %s serve node rank 0's API server",
                    [r["rank"] for r in (cluster or {}).get("results", [])])
        try:
            threading.Event().wait()
        except KeyboardInterrupt:
            pass
        return 0
    server.set_ready(cfg)
    try:
        server.wait()
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
    return 0


def dead_exit_seconds() -> float:
    """Seconds between the engine's death and the API server's exit (measured: 2-5 s)."""
    return float(os.environ.get("LAB_ENGINE_DEAD_EXIT_SECONDS", "3"))


def lost_rank_seconds() -> float:
    """Native rank 0: how long a lost rank goes unnoticed when no request comes (measured: 45 s)."""
    return float(os.environ.get("LAB_ENGINE_LOST_RANK_SECONDS", "45"))


_death = threading.Lock()


def _engine_dead(logger, server, msg: str) -> None:
    """The engine core is gone: its process was killed, or (Ray) a rank of its group died, or
    (native rank 0) a generation step's collective found a rank gone.

    As measured on the real vLLM (lab-notes.md, "The real vLLM on the CPU"): /health turns 503 at
    once, a request in flight gets HTTP 500 and so does every later one, and the API server exits
    with status **0** a few seconds later (LAB_ENGINE_DEAD_EXIT_SECONDS, 3; measured 2-5 s).
    Only a restart policy that restarts on exit 0 too (docker's unless-stopped/always, systemd's
    Restart=always, or a supervisor that turns it into a failure) brings it back.

    Before the server was ready the start fails instead: exit 1 at once, as a failed start of
    vLLM does. (Ray: that a lost Ray worker ends like a killed engine core is inferred from where
    vLLM runs its Ray executor, in the engine core; the CPU build's Ray was not measured.)"""
    if not _death.acquire(blocking=False):
        return  # dying already
    serving = server is not None and server.ready
    if server is not None:
        server.dead = msg  # /health 503, generation 500 (what is in flight too)
    logger.error("EngineCore encountered a fatal error.")
    for line in msg.splitlines():
        logger.error("%s", line)
    if server is not None:
        logger.error("AsyncLLM output_handler failed.")
        logger.error("vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue. See stack "
                     "trace (above) for the root cause.")
    if not serving:
        if server is not None:
            logger.error("Engine core initialization failed. See root cause above.")
        _exit(logger, server, 1)

    def shutdown():
        time.sleep(dead_exit_seconds())
        _exit(logger, server, 0)
    threading.Thread(target=shutdown, daemon=True, name="api-server-shutdown").start()


def _exit(logger, server, code: int) -> None:
    if server is not None:
        logger.info("Shutting down FastAPI HTTP server.")
        try:
            server.httpd.socket.close()
        except OSError:
            pass
        if code == 0:
            logger.info("Application shutdown complete.")
            logger.info("Finished server process [%d]", os.getpid())
    for h in logger.handlers:
        try:
            h.flush()
        except Exception:  # noqa: BLE001
            pass
    os._exit(code)


def _group_lost(logger, server, msg: str, engine_dead) -> None:
    """Native multi-node: this node's part of the group lost a peer (a rank, or node rank 0).

    Measured on the real vLLM (lab-notes.md, "The real vLLM on the CPU"), and reproduced here:

    * node rank 0 does not notice: /health stays 200 and nothing is logged until the next
      generation step runs a collective over the group: that request gets HTTP 500 and the engine
      dies as a killed engine core does (/health 503, exit 0 a few seconds later). With no request,
      the engine dies by itself after LAB_ENGINE_LOST_RANK_SECONDS (45, as measured). The real
      engine finds the loss in the step's collective (which may hang first); the stand-in keeps
      what its heartbeats found and fails the next step with it (the observable effect: the
      status, /health and the exit are the same; it does not hang);
    * a headless node does not die: it stays, stranded in the old group, and never joins a new
      node rank 0 (which then waits for it in its rendezvous: native.py)."""
    if server is None:
        logger.warning("%s", msg)
        logger.warning("The process group lost a member; this headless node keeps its engine rank(s) in "
                       "the old group (it does not exit, and it cannot join a new one): restart it.")
        return
    if not server.ready:
        return engine_dead(msg)  # still starting: the start fails
    logger.debug("process group: %s (found by the next collective)", msg)
    server.break_group(msg, lost_rank_seconds())
