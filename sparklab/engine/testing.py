"""A minimal Hugging Face cache generator for tests: hub/models--ORG--NAME/{blobs,refs,snapshots}."""
from __future__ import annotations

import hashlib
import json
import os
import struct

QWEN3_CONFIG = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "num_hidden_layers": 2,
                "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                "vocab_size": 256, "max_position_embeddings": 4096, "torch_dtype": "bfloat16"}


def safetensors_bytes(tensors: dict) -> bytes:
    """tensors: name -> number of bytes (dtype U8, 1-D)."""
    header, off = {}, 0
    for name, n in tensors.items():
        header[name] = {"dtype": "U8", "shape": [n], "data_offsets": [off, off + n]}
        off += n
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    return struct.pack("<Q", len(h)) + h + bytes(off)


def make_repo(hf_home: str, repo_id: str, config: dict | None = None, shards: int = 2,
              chat_template: bool = True, extra_files: dict | None = None) -> str:
    """Create a cached snapshot like huggingface_hub leaves it; return the snapshot dir."""
    config = dict(QWEN3_CONFIG if config is None else config)
    repo = os.path.join(hf_home, "hub", "models--" + repo_id.replace("/", "--"))
    commit = hashlib.sha1(repo_id.encode()).hexdigest()
    snap = os.path.join(repo, "snapshots", commit)
    os.makedirs(snap, exist_ok=True)
    os.makedirs(os.path.join(repo, "blobs"), exist_ok=True)
    os.makedirs(os.path.join(repo, "refs"), exist_ok=True)
    with open(os.path.join(repo, "refs", "main"), "w") as f:
        f.write(commit)
    files = {"config.json": json.dumps(config).encode(),
             "tokenizer.json": b'{"version": "1.0", "model": {"type": "BPE"}}',
             "tokenizer_config.json": json.dumps(
                 {"chat_template": "{% for m in messages %}{{ m.content }}{% endfor %}"} if chat_template
                 else {}).encode(),
             "generation_config.json": b'{"temperature": 0.6, "top_p": 0.95}'}
    weight_map = {}
    for i in range(shards):
        name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors" if shards > 1 else "model.safetensors"
        tensors = {f"model.layers.{i}.weight": 1024, f"model.layers.{i}.bias": 64}
        files[name] = safetensors_bytes(tensors)
        weight_map.update({t: name for t in tensors})
    if shards > 1:
        files["model.safetensors.index.json"] = json.dumps(
            {"metadata": {"total_size": 1088 * shards}, "weight_map": weight_map}).encode()
    files.update(extra_files or {})
    for name, data in files.items():
        blob = os.path.join(repo, "blobs", hashlib.sha256(data).hexdigest())
        with open(blob, "wb") as f:
            f.write(data)
        link = os.path.join(snap, name)
        if os.path.lexists(link):
            os.unlink(link)
        os.symlink(os.path.relpath(blob, snap), link)
    return snap
