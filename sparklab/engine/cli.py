"""`vllm serve` command line: vLLM's argument names, choices and errors."""
from __future__ import annotations

import argparse
import ast
import json
import os
import re
import sys

from . import VERSION, version_tuple

# Flags that appeared in a given vLLM version: an image whose vLLM is older rejects them
# ("unrecognized arguments") and does not list them in `vllm serve --help=all`.
# Native multi-node (torch.distributed across nodes, no Ray): vllm-project/vllm#23691, v0.12.0
# (the version sparkprov.catalog records as NATIVE_MULTINODE_SINCE).
FLAG_SINCE = {"--headless": (0, 9, 0), "--nnodes": (0, 12, 0), "--node-rank": (0, 12, 0),
              "--master-addr": (0, 12, 0), "--master-port": (0, 12, 0)}


def knows(flag: str, version: str = VERSION) -> bool:
    return version_tuple(version) >= FLAG_SINCE.get(flag, (0, 0, 0))

REASONING_PARSERS = ["deepseek_r1", "deepseek_v3", "ernie45", "glm45", "gpt_oss", "openai_gptoss",
                     "granite", "hunyuan_a13b", "kimi_k2", "minimax_m2", "minimax_m2_append_think",
                     "mistral", "olmo3", "qwen3", "seed_oss", "step3"]
TOOL_PARSERS = ["deepseek_v3", "deepseek_v31", "ernie45", "glm45", "granite", "granite-20b-fc",
                "hermes", "hunyuan_a13b", "internlm", "jamba", "kimi_k2", "llama3_json", "llama4_json",
                "llama4_pythonic", "longcat", "minimax", "minimax_m2", "mistral", "olmo3", "openai",
                "phi4_mini_json", "pythonic", "qwen3_coder", "qwen3_xml", "seed_oss", "step3", "xlam"]
QUANTIZATION = ["aqlm", "awq", "awq_marlin", "bitblas", "bitsandbytes", "compressed-tensors",
                "deepspeedfp", "experts_int8", "fbgemm_fp8", "fp8", "gguf", "gptq", "gptq_bitblas",
                "gptq_marlin", "gptq_marlin_24", "hqq", "inc", "marlin", "modelopt", "modelopt_fp4",
                "moe_wna16", "mxfp4", "petit_nvfp4", "ptpc_fp8", "quark", "rtn", "torchao", "tpu_int8",
                "auto-round"]
MOE_BACKENDS = ["auto", "triton", "deep_gemm", "cutlass", "flashinfer_trtllm", "flashinfer_cutlass",
                "flashinfer_cutedsl", "marlin", "aiter"]
ATTENTION_BACKENDS = ["FLASH_ATTN", "FLASHINFER", "TRITON_ATTN", "FLEX_ATTENTION", "TREE_ATTN",
                      "FLASHMLA", "TRITON_MLA", "CUTLASS_MLA", "FLASHINFER_MLA", "FLASH_ATTN_MLA",
                      "FLASHMLA_SPARSE", "XFORMERS", "TORCH_SDPA", "ROCM_ATTN", "ROCM_AITER_FA", "NO_ATTENTION"]
SPEC_METHODS = ["ngram", "eagle", "eagle3", "medusa", "mlp_speculator", "draft_model", "mtp",
                "deepseek_mtp", "qwen3_next_mtp", "ernie_mtp", "glm4_moe_mtp", "mimo_mtp", "suffix"]


def json_arg(value: str):
    try:
        return json.loads(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid JSON: {value!r}")


def human_int(value: str) -> int:
    """vLLM's human-readable ints: 32768, 32k, 32K (=32768), 1m, 1M."""
    m = re.fullmatch(r"(-?\d+(?:\.\d+)?)([kKmMgG]?)", value.strip())
    if not m:
        raise argparse.ArgumentTypeError(f"Invalid value {value!r}: expected an integer like 32768, 32k or 1M")
    num, suf = m.groups()
    base = {"": 1, "k": 1000, "m": 1000 ** 2, "g": 1000 ** 3, "K": 1024, "M": 1024 ** 2, "G": 1024 ** 3}[suf]
    return int(float(num) * base)


def media_io_kwargs_arg(value: str) -> dict:
    """--media-io-kwargs: a JSON object of per-modality objects, e.g. '{"video": {"num_frames": 40}}'."""
    doc = json_arg(value)
    if not isinstance(doc, dict) or not all(isinstance(v, dict) for v in doc.values()):
        raise argparse.ArgumentTypeError(f"expected a JSON object of objects per modality, got {value!r}")
    return doc


def attention_backend_arg(value: str):
    """vLLM parses --attention-backend as AttentionBackendEnum[value.upper()] ("auto": None), so
    `flashinfer`, `triton_attn` and `FLASHINFER` are the same backend."""
    if value.lower() == "auto":
        return None
    if value.upper() not in ATTENTION_BACKENDS:
        raise argparse.ArgumentTypeError(f"invalid choice: {value!r} (choose from auto, "
                                         + ", ".join(ATTENTION_BACKENDS) + "; case-insensitive)")
    return value.upper()


def compilation_arg(value: str):
    if re.fullmatch(r"\d+", value):
        return {"level": int(value)}
    return json_arg(value)


def build_parser() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    top = argparse.ArgumentParser(prog="vllm", description="vLLM CLI")
    top.add_argument("-v", "--version", action="version", version=VERSION)
    subs = top.add_subparsers(dest="subparser", required=True)
    p = subs.add_parser("serve", help="Start the vLLM OpenAI Compatible API server.",
                        usage="vllm serve [model_tag] [options]")
    B = argparse.BooleanOptionalAction
    p.add_argument("model_tag", nargs="?", help="The model tag to serve (optional if specified in config)")
    if knows("--headless"):
        p.add_argument("--headless", action="store_true", default=False,
                       help="Run in headless mode: this node runs engine ranks only, no API server.")
    # Frontend
    f = p.add_argument_group("Frontend")
    f.add_argument("--host", default=None)
    f.add_argument("--port", type=int, default=8000)
    f.add_argument("--api-key", nargs="+", default=None)
    f.add_argument("--uvicorn-log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug", "trace"])
    f.add_argument("--disable-uvicorn-access-log", action="store_true")
    f.add_argument("--chat-template", default=None)
    f.add_argument("--chat-template-content-format", default="auto", choices=["auto", "string", "openai"])
    f.add_argument("--default-chat-template-kwargs", type=json_arg, default=None)
    f.add_argument("--response-role", default="assistant")
    f.add_argument("--enable-auto-tool-choice", action="store_true")
    f.add_argument("--tool-call-parser", default=None,
                   metavar="{" + ",".join(TOOL_PARSERS) + "} or name registered in --tool-parser-plugin")
    f.add_argument("--tool-parser-plugin", default="")
    f.add_argument("--max-log-len", type=int, default=None)
    f.add_argument("--enable-prompt-tokens-details", action="store_true")
    f.add_argument("--enable-force-include-usage", action="store_true")
    f.add_argument("--enable-request-id-headers", action="store_true")
    f.add_argument("--enable-log-requests", action=B, default=False)
    f.add_argument("--disable-log-requests", action="store_true",
                   help="[DEPRECATED] Disable logging requests.")
    f.add_argument("--disable-log-stats", action="store_true")
    # Model
    m = p.add_argument_group("ModelConfig")
    m.add_argument("--model", default=None)
    m.add_argument("--tokenizer", default=None)
    m.add_argument("--tokenizer-mode", default="auto", choices=["auto", "hf", "slow", "mistral", "custom"])
    m.add_argument("--skip-tokenizer-init", action=B, default=False)
    m.add_argument("--trust-remote-code", action=B, default=False)
    m.add_argument("--dtype", default="auto", choices=["auto", "half", "float16", "bfloat16", "float", "float32"])
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--revision", default=None)
    m.add_argument("--code-revision", default=None)
    m.add_argument("--tokenizer-revision", default=None)
    m.add_argument("--max-model-len", type=human_int, default=None)
    m.add_argument("--quantization", "-q", default=None, choices=QUANTIZATION)
    m.add_argument("--enforce-eager", action=B, default=False)
    m.add_argument("--max-logprobs", type=int, default=20)
    m.add_argument("--served-model-name", nargs="+", default=None)
    m.add_argument("--config-format", default="auto", choices=["auto", "hf", "mistral"])
    m.add_argument("--hf-overrides", type=json_arg, default=None)
    m.add_argument("--generation-config", default="auto")
    m.add_argument("--override-generation-config", type=json_arg, default=None)
    m.add_argument("--disable-sliding-window", action=B, default=False)
    m.add_argument("--allowed-local-media-path", default="",
                   help="Allow API requests to read local images or videos from directories under this path")
    # Load
    lo = p.add_argument_group("LoadConfig")
    lo.add_argument("--load-format", default="auto",
                    choices=["auto", "pt", "safetensors", "npcache", "dummy", "tensorizer", "sharded_state",
                             "gguf", "bitsandbytes", "mistral", "runai_streamer", "runai_streamer_sharded",
                             "fastsafetensors"])
    lo.add_argument("--download-dir", default=None)
    # Parallel
    pa = p.add_argument_group("ParallelConfig")
    pa.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    pa.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1)
    pa.add_argument("--distributed-executor-backend", default=None,
                    choices=["ray", "mp", "uni", "external_launcher"])
    pa.add_argument("--enable-expert-parallel", action=B, default=False)
    if knows("--nnodes"):
        pa.add_argument("--nnodes", "-n", type=int, default=1,
                        help="Number of nodes for multi-node distributed inference (mp executor).")
        pa.add_argument("--node-rank", "-r", type=int, default=0,
                        help="Rank of this node for multi-node distributed inference.")
        pa.add_argument("--master-addr", default="127.0.0.1",
                        help="Address of the master node (node rank 0) for multi-node inference.")
        pa.add_argument("--master-port", type=int, default=29501,
                        help="Port of the master node for multi-node inference.")
    pa.add_argument("--disable-custom-all-reduce", action=B, default=False)
    # Cache
    c = p.add_argument_group("CacheConfig")
    c.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    c.add_argument("--kv-cache-dtype", default="auto",
                   choices=["auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc", "fp8_ds_mla"])
    c.add_argument("--block-size", type=int, default=None, choices=[1, 8, 16, 32, 64, 128])
    c.add_argument("--enable-prefix-caching", action=B, default=None)
    c.add_argument("--swap-space", type=float, default=4)
    c.add_argument("--cpu-offload-gb", type=float, default=0)
    # Scheduler
    s = p.add_argument_group("SchedulerConfig")
    s.add_argument("--max-num-seqs", type=int, default=None)
    s.add_argument("--max-num-batched-tokens", type=human_int, default=None)
    s.add_argument("--enable-chunked-prefill", action=B, default=None)
    s.add_argument("--max-num-partial-prefills", type=int, default=1)
    s.add_argument("--async-scheduling", action=B, default=None)
    # Kernels / attention
    k = p.add_argument_group("KernelConfig")
    k.add_argument("--moe-backend", default="auto", choices=MOE_BACKENDS)
    k.add_argument("--attention-backend", default=None, type=attention_backend_arg,
                   metavar="{auto," + ",".join(ATTENTION_BACKENDS) + "} (case-insensitive)")
    # Structured outputs / reasoning
    so = p.add_argument_group("StructuredOutputsConfig")
    so.add_argument("--reasoning-parser", default=None,
                    metavar="{" + ",".join(REASONING_PARSERS) + "} or name registered in --reasoning-parser-plugin")
    so.add_argument("--reasoning-parser-plugin", default="")
    # Speculative / compilation / multimodal
    p.add_argument("--speculative-config", type=json_arg, default=None)
    p.add_argument("--compilation-config", "-O", type=compilation_arg, default=None)
    p.add_argument("--max-cudagraph-capture-size", type=int, default=None)
    p.add_argument("--cuda-graph-sizes", type=int, nargs="+", default=None)
    mm = p.add_argument_group("MultiModalConfig")
    mm.add_argument("--limit-mm-per-prompt", type=json_arg, default=None)
    mm.add_argument("--media-io-kwargs", type=media_io_kwargs_arg, default={})
    mm.add_argument("--mm-encoder-tp-mode", default="weights", choices=["weights", "data"])
    mm.add_argument("--language-model-only", action=B, default=False)
    return top, p


HELP_TIP = ("Tip: Use `vllm [serve|run-batch|bench <bench_type>] --help=<keyword>` to explore "
            "arguments from help.\n   - To view a argument group:     --help=ModelConfig\n"
            "   - To view a single argument:    --help=max-model-len\n"
            "   - To search by keyword:         --help=max\n   - To list all groups:           --help=listgroup\n"
            "   - To view help with pager:      --help=page\n   - To show every option:         --help=all")


def _groups(parser: argparse.ArgumentParser):
    return [g for g in parser._action_groups if g._group_actions]


def serve_help(parser: argparse.ArgumentParser, what: str | None) -> str:
    """vLLM's `vllm serve --help[=all|=GROUP|=KEYWORD|=listgroup]` (FlexibleArgumentParser)."""
    if what is None:
        lines = [parser.format_usage().rstrip(), "", "positional arguments:",
                 "  model_tag             The model tag to serve (optional if specified in config)", "",
                 "options:", "  -h, --help            show this help message and exit", "",
                 HELP_TIP]
        return "\n".join(lines) + "\n"
    if what == "all":
        return parser.format_help()
    groups = _groups(parser)
    if what == "listgroup":
        return "\n".join(["Available argument groups:"] + [f"  {g.title}" for g in groups]) + "\n"
    for g in groups:
        if g.title.lower() == what.lower():
            fmt = parser._get_formatter()
            fmt.start_section(g.title)
            fmt.add_text(g.description)
            fmt.add_arguments(g._group_actions)
            fmt.end_section()
            return fmt.format_help()
    key = what.lower().lstrip("-").replace("_", "-")
    hits = [a for a in parser._actions if any(key in o.lstrip("-") for o in a.option_strings)]
    if not hits:
        return f"No group or argument matching '{what}'.\n" + HELP_TIP + "\n"
    fmt = parser._get_formatter()
    fmt.start_section(f"Arguments matching '{what}'")
    fmt.add_arguments(hits)
    fmt.end_section()
    return fmt.format_help()


def parse(argv: list[str], logger):
    top, serve = build_parser()
    if argv and argv[0] == "serve":
        for a in argv[1:]:
            if a in ("-h", "--help") or a.startswith("--help="):
                sys.stdout.write(serve_help(serve, a.split("=", 1)[1] if "=" in a else None))
                raise SystemExit(0)
    if argv and argv[0] == "serve":
        # vLLM moves `--model X` to the model_tag position (with a deprecation warning).
        for i, a in enumerate(argv):
            if a == "--model" and i + 1 < len(argv) or a.startswith("--model="):
                tag = argv[i + 1] if a == "--model" else a.split("=", 1)[1]
                rest = argv[i + 2:] if a == "--model" else argv[i + 1:]
                logger.warning("With `vllm serve`, you should provide the model as a positional argument "
                               "or in a config file instead of via the `--model` option. The `--model` "
                               "option will be removed in a future version.")
                argv = ["serve", tag, *argv[1:i], *rest]
                break
    args, extras = top.parse_known_args(argv)
    if args.subparser == "serve":
        positional = [e for e in extras if not e.startswith("-")]
        if args.model_tag == "serve" and positional:
            # `vllm serve serve MODEL`: the first "serve" is the stray word.
            args.model_tag = positional[0]
            extras.remove(positional[0])
            extras.insert(0, "serve")
    if extras:
        top.error("unrecognized arguments: " + " ".join(extras))
    if not args.model_tag:
        serve.error("the following arguments are required: model_tag (or --model)")
    args.model = args.model_tag
    return args, serve


def plugin_names(path: str, manager: str, parser: argparse.ArgumentParser) -> list[str]:
    """Names a parser plugin file registers (`@<manager>.register_module("name")`)."""
    if not os.path.isfile(path):
        parser.error(f"plugin file not found: {path}")
    try:
        tree = ast.parse(open(path).read(), path)
    except SyntaxError as e:
        parser.error(f"cannot import plugin {path}: {e}")
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr == "register_module":
            owner = node.func.value
            if isinstance(owner, ast.Name) and owner.id != manager:
                continue
            vals = list(node.args[:1]) + [kw.value for kw in node.keywords if kw.arg in ("name", "names")]
            for v in vals:
                try:
                    lit = ast.literal_eval(v)
                except ValueError:
                    continue
                names.extend([lit] if isinstance(lit, str) else [x for x in lit if isinstance(x, str)])
    return names


def main(argv: list[str] | None = None, *, run=None) -> int:
    """Parse and check like vLLM, then hand the arguments to `run` (the engine: __main__ passes
    it in, so that the engine may use this parser without an import cycle)."""
    from .log import get_logger
    logger = get_logger()
    argv = list(sys.argv[1:] if argv is None else argv)
    args, serve_parser = parse(argv, logger)
    # Parser validation that vLLM does at argument-parse time.
    reasoning = list(REASONING_PARSERS)
    if args.reasoning_parser_plugin:
        reasoning += plugin_names(args.reasoning_parser_plugin, "ReasoningParserManager", serve_parser)
    if args.reasoning_parser and args.reasoning_parser not in reasoning:
        serve_parser.error(f"argument --reasoning-parser: invalid choice: '{args.reasoning_parser}' "
                           f"(choose from {', '.join(reasoning)})")
    tools = list(TOOL_PARSERS)
    if args.tool_parser_plugin:
        tools += plugin_names(args.tool_parser_plugin, "ToolParserManager", serve_parser)
    if args.tool_call_parser and args.tool_call_parser not in tools:
        raise SystemExit(_fatal(logger, "KeyError",
                                f"invalid tool call parser: {args.tool_call_parser} (chose from {{ {','.join(tools)} }})"))
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        raise SystemExit(_fatal(logger, "TypeError",
                                "Error: --enable-auto-tool-choice requires --tool-call-parser"))
    if args.api_key is None and os.environ.get("VLLM_API_KEY"):
        args.api_key = [os.environ["VLLM_API_KEY"]]
    return run(args, logger)


def _fatal(logger, kind, msg) -> int:
    logger.error("%s: %s", kind, msg)
    return 1
