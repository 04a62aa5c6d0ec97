"""Resolving a model (HF cache or local path), validating its files, reading config.json.

Never contacts a hub: the cache is the only source, as with HF_HUB_OFFLINE=1.
"""
from __future__ import annotations

import glob
import json
import os
import re
import struct
from dataclasses import dataclass, field


class EngineError(Exception):
    """A startup failure, reported as vLLM would (exception type name + message)."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind

    def __str__(self):
        return f"{self.kind}: {self.args[0]}"


def hub_cache_dir(download_dir: str | None = None) -> str:
    if download_dir:
        return download_dir
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    if os.environ.get("HF_HOME"):
        return os.path.join(os.environ["HF_HOME"], "hub")
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(xdg, "huggingface", "hub")


_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")


def resolve_snapshot(model: str, revision: str | None = None,
                     download_dir: str | None = None) -> str:
    """Return the directory holding the model's files (a snapshot or a local path)."""
    if os.path.isdir(model):
        return os.path.abspath(model)
    if not _REPO_ID.match(model) or ".." in model:
        raise EngineError(
            "huggingface_hub.errors.HFValidationError",
            f"Repo id must be in the form 'repo_name' or 'namespace/repo_name': '{model}'. "
            "Use `repo_type` argument if needed.")
    cache = hub_cache_dir(download_dir)
    repo_dir = os.path.join(cache, "models--" + model.replace("/", "--"))
    rev = revision or "main"
    commit = None
    if re.fullmatch(r"[0-9a-f]{40}", rev) and os.path.isdir(os.path.join(repo_dir, "snapshots", rev)):
        commit = rev
    else:
        ref = os.path.join(repo_dir, "refs", rev)
        if os.path.isfile(ref):
            with open(ref) as f:
                commit = f.read().strip()
    snap = os.path.join(repo_dir, "snapshots", commit) if commit else None
    if not snap or not os.path.isdir(snap):
        offline = os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE")
        why = ("outgoing traffic has been disabled (HF_HUB_OFFLINE=1)" if offline else
               "the lab engine never contacts a hub")
        raise EngineError(
            "huggingface_hub.errors.LocalEntryNotFoundError",
            f"Cannot find an appropriate cached snapshot folder for the specified revision "
            f"('{rev}') of '{model}' on the local disk (cache: {cache}) and {why}. "
            "To enable repo look-ups and downloads online, set 'HF_HUB_OFFLINE=0' as environment variable.")
    return snap


def safetensors_tensors(path: str) -> dict:
    """Parse a safetensors header and check the file is exactly as long as it declares."""
    name = os.path.basename(path)
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise EngineError("safetensors_rust.SafetensorError",
                              f"Error while deserializing header: HeaderTooSmall ({name})")
        (n,) = struct.unpack("<Q", head)
        if n > 100_000_000 or 8 + n > size:
            raise EngineError("safetensors_rust.SafetensorError",
                              f"Error while deserializing header: MetadataIncompleteBuffer ({name}: "
                              f"header of {n} bytes, file of {size} bytes)")
        try:
            header = json.loads(f.read(n))
        except ValueError:
            raise EngineError("safetensors_rust.SafetensorError",
                              f"Error while deserializing header: InvalidHeaderDeserialization ({name})")
    end = 0
    tensors = {}
    for key, info in header.items():
        if key == "__metadata__":
            continue
        try:
            start, stop = info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise EngineError("safetensors_rust.SafetensorError",
                              f"Error while deserializing header: InvalidHeaderDeserialization ({name})")
        end = max(end, stop)
        tensors[key] = info
    if 8 + n + end != size:
        raise EngineError("safetensors_rust.SafetensorError",
                          f"Error while deserializing header: MetadataIncompleteBuffer ({name}: "
                          f"expected {8 + n + end} bytes, file has {size})")
    return tensors


@dataclass
class ModelInfo:
    name: str                     # what was asked for (repo id or path)
    path: str                     # snapshot directory
    config: dict
    weight_files: list = field(default_factory=list)
    weight_bytes: int = 0
    tokenizer_config: dict = field(default_factory=dict)
    has_chat_template: bool = False
    generation_config: dict = field(default_factory=dict)
    hf_quant_config: dict = field(default_factory=dict)

    def text(self, key, default=None):
        """A field of the language model config (nested text_config for multimodal models)."""
        if key in self.config:
            return self.config[key]
        tc = self.config.get("text_config") or {}
        return tc.get(key, default)

    @property
    def model_type(self) -> str:
        return str(self.config.get("model_type", ""))

    @property
    def architectures(self) -> list:
        return list(self.config.get("architectures") or [])

    @property
    def num_experts(self) -> int:
        for k in ("num_experts", "num_local_experts", "n_routed_experts"):
            v = self.text(k)
            if isinstance(v, int) and v > 0:
                return v
        return 0

    @property
    def quant_method(self) -> str | None:
        q = self.config.get("quantization_config") or {}
        if q.get("quant_method"):
            return str(q["quant_method"])
        if self.hf_quant_config:
            return "modelopt"
        return None

    @property
    def is_fp4(self) -> bool:
        q = self.config.get("quantization_config") or {}
        algo = str(q.get("quant_algo") or (self.hf_quant_config.get("quantization") or {}).get("quant_algo") or "")
        if algo.upper() in ("NVFP4", "FP4"):
            return True
        if str(q.get("format", "")).startswith("nvfp4"):
            return True
        for group in (q.get("config_groups") or {}).values():
            w = (group or {}).get("weights") or {}
            if w.get("num_bits") == 4 and w.get("type") == "float":
                return True
            if str(group.get("format", "")).startswith("nvfp4"):
                return True
        return False

    @property
    def is_fp4_moe(self) -> bool:
        return self.is_fp4 and self.num_experts > 0

    @property
    def max_position_embeddings(self) -> int | None:
        for k in ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length"):
            v = self.text(k)
            if isinstance(v, int) and v > 0:
                return v
        return None


def _load_json(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def load_model(model: str, revision: str | None = None, download_dir: str | None = None,
               load_format: str = "auto", hf_overrides: dict | None = None,
               check_weights: bool = True) -> ModelInfo:
    """Resolve and validate a model as vLLM's loader would; raise EngineError on failure."""
    path = resolve_snapshot(model, revision, download_dir)
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise EngineError(
            "ValueError",
            f"Invalid repository ID or local directory specified: '{model}'.\n"
            "Please verify the following requirements:\n"
            "1. Provide a valid Hugging Face repository ID.\n"
            "2. Specify a local directory that contains a recognized configuration file.\n"
            "   - For Hugging Face models: ensure the presence of a 'config.json'.\n"
            "   - For Mistral models: ensure the presence of a 'params.json'.")
    try:
        config = _load_json(cfg_path)
    except ValueError as e:
        raise EngineError("OSError", f"It looks like the config file at '{cfg_path}' is not a valid JSON file. ({e})")
    if hf_overrides:
        for k, v in hf_overrides.items():
            if isinstance(v, dict) and isinstance(config.get(k), dict):
                config[k] = {**config[k], **v}
            else:
                config[k] = v
    info = ModelInfo(name=model, path=path, config=config)
    for fname, attr in (("tokenizer_config.json", "tokenizer_config"),
                        ("generation_config.json", "generation_config"),
                        ("hf_quant_config.json", "hf_quant_config")):
        p = os.path.join(path, fname)
        if os.path.isfile(p):
            try:
                setattr(info, attr, _load_json(p))
            except ValueError:
                raise EngineError("OSError", f"Unable to parse {fname} in '{path}' as JSON.")
    info.has_chat_template = bool(info.tokenizer_config.get("chat_template")) or \
        os.path.isfile(os.path.join(path, "chat_template.jinja")) or \
        os.path.isfile(os.path.join(path, "chat_template.json"))
    if check_weights and load_format != "dummy":
        check_weight_files(info)
    return info


def check_weight_files(info: ModelInfo) -> None:
    path = info.path
    index_path = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index_path):
        try:
            index = _load_json(index_path)
        except (ValueError, OSError) as e:
            raise EngineError("OSError", f"Unable to read model.safetensors.index.json in '{path}': {e}")
        weight_map = index.get("weight_map") or {}
        shards: dict[str, list] = {}
        for tensor, shard in weight_map.items():
            shards.setdefault(shard, []).append(tensor)
        if not shards:
            raise EngineError("RuntimeError", f"Cannot find any model weights with `{info.name}`")
        missing = [s for s in sorted(shards) if not os.path.isfile(os.path.join(path, s))]
        if missing:
            raise EngineError(
                "FileNotFoundError",
                f"Weight shard(s) listed in model.safetensors.index.json are missing from "
                f"'{path}': {', '.join(missing)} ({len(missing)} of {len(shards)} shards). "
                "The download is incomplete.")
        files = sorted(shards)
    else:
        files = sorted(os.path.basename(p) for p in glob.glob(os.path.join(path, "*.safetensors")))
        shards = {}
        if not files:
            raise EngineError("RuntimeError", f"Cannot find any model weights with `{info.name}`")
    total = 0
    for s in files:
        full = os.path.join(path, s)
        tensors = safetensors_tensors(full)
        absent = [t for t in shards.get(s, []) if t not in tensors]
        if absent:
            raise EngineError(
                "ValueError",
                f"Following weights were not initialized from checkpoint: {set(absent[:5])} "
                f"(shard {s} does not contain them)")
        total += os.path.getsize(full)
    info.weight_files = files
    info.weight_bytes = total
