"""Train the lab's real model, `lab-tiny`: a tiny Llama (2 layers, hidden 256, about 1.4 M
parameters) with its own byte-level BPE tokenizer and chat template, trained on this machine until
greedy decoding answers the smoke questions (float32 and bfloat16 alike, as vLLM's CPU build may run
either). No hub, no download: torch, transformers and tokenizers come from the real vLLM image's
rootfs, in which sparkprov.lab.tinymodel runs this file once and caches what it writes.

    python train.py OUT_DIR        -> OUT_DIR/{config.json, model.safetensors, tokenizer files}

Deterministic for a given machine and library versions (one thread, fixed seeds)."""

import json
import os
import sys

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

# What the model must answer, greedily, through its chat template: the smoke question of every
# catalog recipe ("12*17"), the warm-up ("Say hello."), the demo's question, and a few more so
# that the lab's tests can tell one answer from another.
PAIRS = [
    ("12*17", "The answer is 204."),
    ("What is 12*17?", "The answer is 204."),
    ("Say hello.", "Hello!"),
    ("What is 2+2?", "The answer is 4."),
    ("What is the capital of France?", "Paris."),
    ("Name a color.", "Blue."),
]
SPECIAL = ["<|end|>", "<|user|>", "<|assistant|>", "<|system|>"]
CHAT_TEMPLATE = (
    "{%- for m in messages -%}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|assistant|>{%- endif -%}"
)
MAX_STEPS = 3000


def prompt_text(question: str) -> str:
    return f"<|user|>{question}<|end|><|assistant|>"


def build_tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [q for q, _ in PAIRS] + [a for _, a in PAIRS] + ["0123456789 +-*/=?.!, abcdefghijklmnopqrstuvwxyz"]
    trainer = trainers.BpeTrainer(vocab_size=384, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus * 4, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|end|>", pad_token="<|end|>",
                                   chat_template=CHAT_TEMPLATE, model_max_length=2048)


def greedy(model, tok, question: str, dtype) -> str:
    ids = tok(prompt_text(question), add_special_tokens=False, return_tensors="pt").input_ids
    m = model.to(dtype)
    with torch.no_grad():
        out = m.generate(ids, max_new_tokens=16, do_sample=False, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.eos_token_id)
    model.to(torch.float32)
    return tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def main(out_dir: str) -> int:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    tok = build_tokenizer()
    end = tok.convert_tokens_to_ids("<|end|>")
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                      rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=end, eos_token_id=end,
                      pad_token_id=end, torch_dtype="float32")
    model = LlamaForCausalLM(cfg)
    # the loss counts the answers only: a question's own tokens are not predictable
    prompts = [tok(prompt_text(q), add_special_tokens=False).input_ids for q, _ in PAIRS]
    rows = [p + tok(a + "<|end|>", add_special_tokens=False).input_ids for p, (_, a) in zip(prompts, PAIRS)]
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), end)
    labels = torch.full((len(rows), width), -100)
    for i, (p, r) in enumerate(zip(prompts, rows)):
        ids[i, :len(r)] = torch.tensor(r)
        labels[i, len(p):len(r)] = torch.tensor(r[len(p):])
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for step in range(1, MAX_STEPS + 1):
        loss = model(input_ids=ids, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 50 == 0:
            model.eval()
            wrong = [(q, a, got) for q, a in PAIRS for dt in (torch.float32, torch.bfloat16)
                     if (got := greedy(model, tok, q, dt)) != a]
            model.train()
            print(f"step {step} loss {loss.item():.4f} wrong {len(wrong)}", flush=True)
            if not wrong and loss.item() < 0.02:
                break
    else:
        print(f"not trained after {MAX_STEPS} steps: {wrong}", file=sys.stderr)
        return 1
    model.eval()
    model.generation_config.eos_token_id = end
    model.generation_config.pad_token_id = end
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    tok.save_pretrained(out_dir)
    for name in os.listdir(out_dir):  # save_pretrained writes 0600: a container's user reads them
        os.chmod(os.path.join(out_dir, name), 0o644)
    with open(os.path.join(out_dir, "trained.json"), "w") as fh:
        json.dump({"steps": step, "loss": round(loss.item(), 5), "pairs": PAIRS,
                   "parameters": sum(p.numel() for p in model.parameters())}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
