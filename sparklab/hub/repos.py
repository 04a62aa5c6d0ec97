"""Deterministic generated model repositories for the lab hub.

A `RepoSpec` describes a repo (name, shard count, total tensor bytes, gating, config values). From a spec,
`ensure_generated(spec, root)` writes the repo's files once into `root` (reused across runs) and returns a
`GeneratedRepo`: every file with its size, sha256 and git object id, the git tree ids of its folders and a
stable, real git commit id. Same spec -> same bytes -> same hashes -> same commit.

Files of a repo: .gitattributes, README.md, config.json, generation_config.json, tokenizer.json,
tokenizer_config.json, model-0000i-of-0000N.safetensors + model.safetensors.index.json (a single shard is
named model.safetensors, without index, as on the real Hub) and optionally `extra_files` small files under
extras/ (to exercise tree pagination and folders).

The safetensors shards are valid: 8-byte little-endian header length, JSON header (dtype, shape,
data_offsets, padded with spaces to 8 bytes), then the tensor data, pseudo-random bytes from SHAKE-128 of
(seed, tensor name, chunk index).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import fnmatch
import hashlib
import json
import math
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

GENERATOR_VERSION = 1
MiB = 1024 * 1024
LFS_THRESHOLD = 10 * MiB  # the Hub refuses non-LFS files over 10 MB
COMMIT_EPOCH = 1735689600  # 2025-01-01T00:00:00Z: fixed, so commit ids are stable
COMMIT_AUTHOR = "sparkprov-lab <lab@sparkprov.invalid>"
DTYPE_BYTES = {"BF16": 2, "F16": 2, "F32": 4, "F8_E4M3": 1, "I8": 1, "U8": 1}
GITATTRIBUTES_LFS = [
    "*.7z", "*.arrow", "*.bin", "*.bz2", "*.ckpt", "*.ftz", "*.gz", "*.h5", "*.joblib", "*.mlmodel",
    "*.model", "*.msgpack", "*.npy", "*.npz", "*.onnx", "*.ot", "*.parquet", "*.pb", "*.pickle", "*.pkl",
    "*.pt", "*.pth", "*.rar", "*.safetensors", "*.tar", "*.tflite", "*.tgz", "*.wasm", "*.xz", "*.zip",
    "*.zst", "*tfevents*", "*.gguf",
]
_REPO_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")


@dataclass(frozen=True)
class RepoSpec:
    """What to generate for one repo. `config` values override the defaults guessed from the name."""

    repo_id: str
    num_shards: int = 2
    total_size: int = 4 * MiB  # bytes of tensor data over all shards (approximate, see `tensor_plan`)
    gated: bool = False
    seed: str = ""  # default: the repo id
    config: dict = field(default_factory=dict)
    dtype: str = ""  # tensor dtype of the weights; default BF16, F8_E4M3 for "*FP8*" repos
    extra_files: int = 0  # small files under extras/ (tree pagination, folders)
    # A directory of real model files (a trained model: sparklab.tinymodel) published as they
    # are instead of generated ones; the directory's name changes with its content.
    files_dir: str = ""

    def __post_init__(self) -> None:
        if not _REPO_ID_RE.match(self.repo_id) or ".." in self.repo_id:
            raise ValueError(f"invalid repo id {self.repo_id!r}")
        if self.num_shards < 1:
            raise ValueError("num_shards must be >= 1")
        if self.total_size < 1024:
            raise ValueError("total_size must be >= 1024 bytes")
        if self.dtype and self.dtype not in DTYPE_BYTES:
            raise ValueError(f"unknown dtype {self.dtype!r}; one of {sorted(DTYPE_BYTES)}")
        if self.extra_files < 0:
            raise ValueError("extra_files must be >= 0")

    @property
    def effective_seed(self) -> str:
        return self.seed or self.repo_id

    @property
    def weight_dtype(self) -> str:
        if self.dtype:
            return self.dtype
        return "F8_E4M3" if "fp8" in self.repo_id.lower() else "BF16"

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    def key(self) -> str:
        """Hash of everything that determines the bytes (spec + generator version)."""
        blob = json.dumps({"v": GENERATOR_VERSION, "spec": self.to_json()}, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()


def coerce_spec(item: "RepoSpec | str | dict") -> RepoSpec:
    """A RepoSpec from a spec, a bare repo id, or a dict of RepoSpec fields (unknown keys are refused)."""
    if isinstance(item, RepoSpec):
        return item
    if isinstance(item, str):
        return RepoSpec(repo_id=item)
    if isinstance(item, dict):
        known = {f.name for f in dataclasses.fields(RepoSpec)}
        unknown = set(item) - known
        if unknown:
            raise ValueError(f"unknown repo spec keys {sorted(unknown)} (known: {sorted(known)})")
        return RepoSpec(**item)
    raise TypeError(f"cannot make a RepoSpec from {type(item).__name__}")


def load_spec_file(path: Path) -> list[RepoSpec]:
    """A JSON or YAML file: a list of repo specs, or {"repos": [...]}."""
    text = Path(path).read_text()
    if str(path).endswith((".yaml", ".yml")):
        import yaml

        data = yaml.safe_load(text)
    else:
        data = json.loads(text)
    if isinstance(data, dict):
        data = data.get("repos", [])
    specs = [coerce_spec(x) for x in data]
    ids = [s.repo_id for s in specs]
    if len(set(ids)) != len(ids):
        raise ValueError("duplicate repo ids in spec")
    return specs


# ---------------------------------------------------------------------------------------------- config


def default_config(spec: RepoSpec) -> dict:
    """A realistic transformers config for the repo's family (by name), overridden by spec.config."""
    name = spec.repo_id.lower()
    moe = re.search(r"-a\d+(\.\d+)?b", name) is not None
    if "qwen" in name:
        cfg: dict[str, Any] = {
            "architectures": ["Qwen3MoeForCausalLM" if moe else "Qwen3ForCausalLM"],
            "model_type": "qwen3_moe" if moe else "qwen3",
            "hidden_size": 4096, "num_hidden_layers": 48, "num_attention_heads": 32,
            "num_key_value_heads": 4, "head_dim": 128, "intermediate_size": 12288,
            "vocab_size": 151936, "max_position_embeddings": 262144, "rope_theta": 10000000.0,
            "rms_norm_eps": 1e-06, "tie_word_embeddings": False, "bos_token_id": 151643,
            "eos_token_id": 151645,
        }
        if moe:
            cfg.update({"num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 1536})
    elif "gemma" in name:
        cfg = {
            "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
            "hidden_size": 5376, "num_hidden_layers": 62, "num_attention_heads": 32,
            "num_key_value_heads": 16, "head_dim": 128, "intermediate_size": 21504,
            "vocab_size": 262208, "max_position_embeddings": 131072, "rope_theta": 1000000.0,
            "rms_norm_eps": 1e-06, "sliding_window": 1024, "tie_word_embeddings": True,
            "bos_token_id": 2, "eos_token_id": 1,
        }
    elif "gpt-oss" in name:
        cfg = {
            "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss",
            "hidden_size": 2880, "num_hidden_layers": 36, "num_attention_heads": 64,
            "num_key_value_heads": 8, "head_dim": 64, "intermediate_size": 2880,
            "vocab_size": 201088, "max_position_embeddings": 131072, "rope_theta": 150000.0,
            "rms_norm_eps": 1e-05, "num_local_experts": 128, "num_experts_per_tok": 4,
            "tie_word_embeddings": False, "bos_token_id": 199998, "eos_token_id": 200002,
        }
    elif "mistral" in name or "ministral" in name:
        cfg = {
            "architectures": ["MistralForCausalLM"], "model_type": "mistral",
            "hidden_size": 5120, "num_hidden_layers": 40, "num_attention_heads": 32,
            "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 32768,
            "vocab_size": 131072, "max_position_embeddings": 131072, "rope_theta": 1000000000.0,
            "rms_norm_eps": 1e-05, "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
        }
    else:
        cfg = {
            "architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
            "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 14336,
            "vocab_size": 128256, "max_position_embeddings": 131072, "rope_theta": 500000.0,
            "rms_norm_eps": 1e-05, "tie_word_embeddings": False, "bos_token_id": 128000,
            "eos_token_id": 128009,
        }
    cfg["torch_dtype"] = "bfloat16"
    cfg["hidden_act"] = "silu"
    cfg["attention_bias"] = False
    cfg["transformers_version"] = "4.57.1"
    cfg["use_cache"] = True
    if spec.weight_dtype == "F8_E4M3":
        cfg["quantization_config"] = {
            "activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
            "weight_block_size": [128, 128],
        }
    cfg.update(spec.config)
    if "head_dim" not in cfg:
        cfg["head_dim"] = cfg["hidden_size"] // cfg["num_attention_heads"]
    return dict(sorted(cfg.items()))


# ---------------------------------------------------------------------------------------------- tensors


@dataclass(frozen=True)
class Tensor:
    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE_BYTES[self.dtype]


def _real_tensors(cfg: dict, weight_dtype: str) -> list[tuple[str, str, tuple[int, ...], bool]]:
    """(name, dtype, real shape, is_quantized_linear) of a decoder-only model, in checkpoint order."""
    h, layers = int(cfg["hidden_size"]), int(cfg["num_hidden_layers"])
    nh, kv, hd = int(cfg["num_attention_heads"]), int(cfg["num_key_value_heads"]), int(cfg["head_dim"])
    inter, vocab = int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"]), int(cfg["vocab_size"])
    experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
    out: list[tuple[str, str, tuple[int, ...], bool]] = [("model.embed_tokens.weight", "BF16", (vocab, h), False)]
    for i in range(layers):
        p = f"model.layers.{i}"
        out.append((f"{p}.input_layernorm.weight", "BF16", (h,), False))
        out.append((f"{p}.self_attn.q_proj.weight", weight_dtype, (nh * hd, h), True))
        out.append((f"{p}.self_attn.k_proj.weight", weight_dtype, (kv * hd, h), True))
        out.append((f"{p}.self_attn.v_proj.weight", weight_dtype, (kv * hd, h), True))
        out.append((f"{p}.self_attn.o_proj.weight", weight_dtype, (h, nh * hd), True))
        out.append((f"{p}.post_attention_layernorm.weight", "BF16", (h,), False))
        if experts:
            out.append((f"{p}.mlp.gate.weight", "BF16", (experts, h), False))
        out.append((f"{p}.mlp.gate_proj.weight", weight_dtype, (inter, h), True))
        out.append((f"{p}.mlp.up_proj.weight", weight_dtype, (inter, h), True))
        out.append((f"{p}.mlp.down_proj.weight", weight_dtype, (h, inter), True))
    out.append(("model.norm.weight", "BF16", (h,), False))
    if not cfg.get("tie_word_embeddings"):
        out.append(("lm_head.weight", "BF16", (vocab, h), False))
    return out


def tensor_plan(spec: RepoSpec, cfg: dict) -> list[Tensor]:
    """The tensors of the checkpoint: real names, shapes scaled down (same proportions) to ~total_size."""
    real = _real_tensors(cfg, spec.weight_dtype)
    real_bytes = sum(math.prod(s) * DTYPE_BYTES[d] for _, d, s, _ in real)
    f = math.sqrt(spec.total_size / real_bytes)  # 2-D tensors dominate: scale each dimension by sqrt
    tensors: list[Tensor] = []
    for name, dtype, shape, quantized in real:
        scaled = tuple(max(1, round(d * f)) for d in shape)
        tensors.append(Tensor(name, dtype, scaled))
        if quantized and dtype == "F8_E4M3":
            blocks = tuple(max(1, math.ceil(d / 128)) for d in scaled)
            tensors.append(Tensor(name + "_scale_inv", "F32", blocks))
    return tensors


def split_shards(tensors: list[Tensor], n: int) -> list[list[Tensor]]:
    """Consecutive groups of about equal bytes; every shard gets at least one tensor."""
    n = min(n, len(tensors))
    total = sum(t.nbytes for t in tensors)
    shards: list[list[Tensor]] = [[] for _ in range(n)]
    acc, idx = 0, 0
    for pos, t in enumerate(tensors):
        left_tensors, left_shards = len(tensors) - pos, n - idx
        if shards[idx] and idx < n - 1 and (acc >= total * (idx + 1) / n or left_tensors <= left_shards - 1):
            idx += 1
        shards[idx].append(t)
        acc += t.nbytes
    return shards


def _tensor_bytes(seed: str, t: Tensor) -> Iterable[bytes]:
    left, chunk = t.nbytes, 0
    while left > 0:
        n = min(left, MiB)
        yield hashlib.shake_128(f"{seed}\0{t.name}\0{chunk}".encode()).digest(n)
        left -= n
        chunk += 1


def write_safetensors(path: Path, tensors: list[Tensor], seed: str) -> None:
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    off = 0
    for t in tensors:
        header[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [off, off + t.nbytes]}
        off += t.nbytes
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * (-len(hb) % 8)
    with open(path, "wb") as f:
        f.write(len(hb).to_bytes(8, "little"))
        f.write(hb)
        for t in tensors:
            for chunk in _tensor_bytes(seed, t):
                f.write(chunk)


def read_safetensors_header(path: Path) -> dict:
    """Parse (and sanity-check) a safetensors header: used by tests and by anyone checking a shard."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    size = Path(path).stat().st_size
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    if 8 + n + end != size:
        raise ValueError(f"{path}: header says {8 + n + end} bytes, file has {size}")
    return header


# ---------------------------------------------------------------------------------------------- small files


def _bytes_to_unicode() -> dict[int, str]:
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


def _tokenizer_files(cfg: dict) -> tuple[dict, dict]:
    byte_chars = sorted(_bytes_to_unicode().values())
    vocab = {ch: i for i, ch in enumerate(byte_chars)}
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    added = []
    for s in specials:
        vocab[s] = len(vocab)
        added.append({"id": vocab[s], "content": s, "single_word": False, "lstrip": False, "rstrip": False,
                      "normalized": False, "special": True})
    tokenizer = {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab, "merges": []},
    }
    tok_config = {
        "add_bos_token": False, "bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "model_max_length": int(cfg.get("max_position_embeddings", 32768)),
        "tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False,
        "chat_template": (
            "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
        ),
    }
    return tokenizer, tok_config


def _readme(spec: RepoSpec, cfg: dict) -> str:
    front = ["---", "license: apache-2.0", "library_name: transformers", "pipeline_tag: text-generation"]
    if spec.gated:
        front.append("extra_gated_prompt: You agree to use this lab model only for testing sparkprov.")
    front.append("---")
    return "\n".join(front) + (
        f"\n\n# {spec.repo_id} (sparkprov lab stand-in)\n\n"
        "Generated by the sparkprov lab hub. The weights are deterministic pseudo-random bytes in valid\n"
        f"safetensors files with the tensor names of a {cfg['model_type']} checkpoint, scaled down.\n"
        "It is not a usable model.\n"
    )


def _dump_json(obj: Any) -> bytes:
    return (json.dumps(obj, indent=2, ensure_ascii=False) + "\n").encode()


def small_files(spec: RepoSpec, cfg: dict, index: dict | None) -> dict[str, bytes]:
    tokenizer, tok_config = _tokenizer_files(cfg)
    files = {
        ".gitattributes": "".join(f"{p} filter=lfs diff=lfs merge=lfs -text\n" for p in GITATTRIBUTES_LFS).encode(),
        "README.md": _readme(spec, cfg).encode(),
        "config.json": _dump_json(cfg),
        "generation_config.json": _dump_json({
            "bos_token_id": cfg.get("bos_token_id"), "eos_token_id": cfg.get("eos_token_id"),
            "do_sample": True, "temperature": 0.7, "top_k": 20, "top_p": 0.8,
            "transformers_version": cfg.get("transformers_version"),
        }),
        "tokenizer.json": (json.dumps(tokenizer, ensure_ascii=False) + "\n").encode(),
        "tokenizer_config.json": _dump_json(tok_config),
    }
    if index is not None:
        files["model.safetensors.index.json"] = _dump_json(index)
    for i in range(1, spec.extra_files + 1):
        files[f"extras/note-{i:05d}.txt"] = f"{spec.repo_id} extra file {i}\n".encode()
    return files


# ---------------------------------------------------------------------------------------------- git ids


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def lfs_pointer(sha256: str, size: int) -> bytes:
    return f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {size}\n".encode()


def is_lfs_path(path: str, size: int) -> bool:
    name = path.rsplit("/", 1)[-1]
    return size >= LFS_THRESHOLD or any(fnmatch.fnmatchcase(name, p) for p in GITATTRIBUTES_LFS)


def _git_trees(files: dict[str, str]) -> dict[str, str]:
    """Git tree ids of every folder ('' = root) from {path: blob id}."""
    trees: dict[str, str] = {}

    def build(prefix: str) -> str:
        entries: dict[str, tuple[str, str]] = {}
        for path, oid in files.items():
            if not path.startswith(prefix):
                continue
            rest = path[len(prefix):]
            head, sep, _ = rest.partition("/")
            if sep:
                if head not in entries:
                    entries[head] = ("40000", build(prefix + head + "/"))
            else:
                entries[head] = ("100644", oid)
        body = b"".join(
            f"{mode} {name}".encode() + b"\0" + bytes.fromhex(oid)
            for name, (mode, oid) in sorted(entries.items(), key=lambda kv: kv[0] + ("/" if kv[1][0] == "40000" else ""))
        )
        tid = hashlib.sha1(b"tree %d\0" % len(body) + body).hexdigest()
        trees[prefix.rstrip("/")] = tid
        return tid

    build("")
    return trees


def git_commit_id(tree: str, message: str) -> str:
    body = (
        f"tree {tree}\nauthor {COMMIT_AUTHOR} {COMMIT_EPOCH} +0000\n"
        f"committer {COMMIT_AUTHOR} {COMMIT_EPOCH} +0000\n\n{message}\n"
    ).encode()
    return hashlib.sha1(b"commit %d\0" % len(body) + body).hexdigest()


# ---------------------------------------------------------------------------------------------- repo on disk


@dataclass(frozen=True)
class RepoFile:
    path: str
    size: int
    sha256: str
    oid: str  # git blob id (of the LFS pointer for LFS files)
    lfs: bool
    pointer_size: int = 0


@dataclass
class GeneratedRepo:
    spec: RepoSpec
    directory: Path  # the repo files live in directory/"files"
    commit: str
    commit_title: str
    files: dict[str, RepoFile]
    trees: dict[str, str]  # folder path ('' = root) -> git tree id
    config: dict
    parameters: dict[str, int]  # dtype -> element count

    def file_path(self, path: str) -> Path:
        return self.directory / "files" / path

    @property
    def repo_id(self) -> str:
        return self.spec.repo_id

    def folders(self) -> list[str]:
        return sorted(p for p in self.trees if p)


def _folder_name(repo_id: str) -> str:
    return "models--" + repo_id.replace("/", "--")


def _hash_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(4 * MiB):
            h.update(chunk)
    return h.hexdigest()


def _load_manifest(d: Path, spec: RepoSpec) -> GeneratedRepo | None:
    try:
        m = json.loads((d / "manifest.json").read_text())
    except (OSError, ValueError):
        return None
    if m.get("generator") != GENERATOR_VERSION or m.get("spec_key") != spec.key():
        return None
    files = {p: RepoFile(**v) for p, v in m["files"].items()}
    for rf in files.values():
        fp = d / "files" / rf.path
        if not fp.is_file() or fp.stat().st_size != rf.size:
            return None
    return GeneratedRepo(spec=spec, directory=d, commit=m["commit"], commit_title=m["commit_title"], files=files,
                         trees=m["trees"], config=m["config"], parameters=m["parameters"])


@contextlib.contextmanager
def _locked(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as lf:
        fcntl.flock(lf, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lf, fcntl.LOCK_UN)


def ensure_generated(spec: RepoSpec, root: Path, verify: bool = False) -> GeneratedRepo:
    """Generate the repo under root (once); reuse it if present with the same spec key.

    `verify=True` also re-hashes every file against the manifest (and regenerates on mismatch).
    """
    root = Path(root)
    d = root / _folder_name(spec.repo_id) / spec.key()[:16]
    with _locked(root / ".locks" / f"{_folder_name(spec.repo_id)}.lock"):
        repo = _load_manifest(d, spec)
        if repo is not None and verify:
            if any(_hash_file(repo.file_path(f.path)) != f.sha256 for f in repo.files.values()):
                repo = None
        if repo is not None:
            return repo
        if d.exists():
            shutil.rmtree(d)
        d.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".gen-", dir=d.parent))
        try:
            _generate_into(spec, tmp)
            os.replace(tmp, d)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        repo = _load_manifest(d, spec)
        assert repo is not None, "freshly generated repo failed its own manifest check"
        return repo


def _copy_real_files(spec: RepoSpec, fdir: Path) -> tuple[dict, dict[str, int]]:
    """A real model's files into fdir (plus .gitattributes and a README); its config and parameters."""
    src = Path(spec.files_dir)
    fdir.mkdir(parents=True)
    for p in sorted(src.iterdir()):
        if p.is_file() and p.name != "trained.json":
            shutil.copyfile(p, fdir / p.name)
    cfg = json.loads((fdir / "config.json").read_text())
    small = small_files(spec, cfg, None)
    for name in (".gitattributes", "README.md"):
        (fdir / name).write_bytes(small[name])
    params: dict[str, int] = {}
    for shard in fdir.glob("*.safetensors"):
        for name, t in read_safetensors_header(shard).items():
            if name != "__metadata__":
                params[t["dtype"]] = params.get(t["dtype"], 0) + math.prod(t["shape"])
    return cfg, params


def _generate_into(spec: RepoSpec, d: Path) -> None:
    fdir = d / "files"
    if spec.files_dir:
        cfg, params = _copy_real_files(spec, fdir)
    else:
        cfg, params = _generate_files(spec, fdir)
    _write_manifest(spec, d, fdir, cfg, params)


def _generate_files(spec: RepoSpec, fdir: Path) -> tuple[dict, dict[str, int]]:
    cfg = default_config(spec)
    tensors = tensor_plan(spec, cfg)
    shards = split_shards(tensors, spec.num_shards)
    n = len(shards)
    names = ["model.safetensors"] if n == 1 else [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    fdir.mkdir(parents=True)
    for name, group in zip(names, shards):
        write_safetensors(fdir / name, group, spec.effective_seed)
    index = None
    if n > 1:
        index = {
            "metadata": {"total_size": sum(t.nbytes for t in tensors)},
            "weight_map": dict(sorted((t.name, name) for name, group in zip(names, shards) for t in group)),
        }
    for path, data in small_files(spec, cfg, index).items():
        (fdir / path).parent.mkdir(parents=True, exist_ok=True)
        (fdir / path).write_bytes(data)
    params: dict[str, int] = {}
    for t in tensors:
        params[t.dtype] = params.get(t.dtype, 0) + math.prod(t.shape)
    return cfg, params


def _write_manifest(spec: RepoSpec, d: Path, fdir: Path, cfg: dict, params: dict[str, int]) -> None:

    files: dict[str, dict] = {}
    for fp in sorted(p for p in fdir.rglob("*") if p.is_file()):
        rel = fp.relative_to(fdir).as_posix()
        size = fp.stat().st_size
        sha = _hash_file(fp)
        if is_lfs_path(rel, size):
            ptr = lfs_pointer(sha, size)
            files[rel] = dataclasses.asdict(RepoFile(rel, size, sha, git_blob_id(ptr), True, len(ptr)))
        else:
            files[rel] = dataclasses.asdict(RepoFile(rel, size, sha, git_blob_id(fp.read_bytes()), False, 0))
    trees = _git_trees({p: v["oid"] for p, v in files.items()})
    title = f"Upload {spec.repo_id} (sparkprov lab)"
    manifest = {
        "generator": GENERATOR_VERSION, "spec_key": spec.key(), "spec": spec.to_json(),
        "commit": git_commit_id(trees[""], title), "commit_title": title, "trees": trees,
        "config": cfg, "parameters": params, "files": files,
    }
    (d / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True))
