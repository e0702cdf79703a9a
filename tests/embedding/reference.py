"""An independent reference of the embedding model: the BERT forward pass in float64 NumPy,
written from the architecture (not from Ferry's code), with mean pooling and L2 normalisation
as sentence-transformers' all-MiniLM-L6-v2 configures them.

The weights are read from model.safetensors directly (its format is a JSON header and raw
little-endian arrays); the text is tokenized with the model's own tokenizer.json through Hugging
Face's `tokenizers`, truncated to max_seq_length as sentence-transformers does.
"""

import json
import math
import struct
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

_DTYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I64": np.int64}


def read_safetensors(path):
    raw = Path(path).read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    body = raw[8 + n :]
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        start, end = info["data_offsets"]
        array = np.frombuffer(body[start:end], dtype=_DTYPES[info["dtype"]]).reshape(info["shape"])
        tensors[name] = array.astype(np.float64) if array.dtype.kind == "f" else array
    return tensors


def _erf(x):
    return np.vectorize(math.erf)(x)


class Reference:
    def __init__(self, model_dir):
        model_dir = Path(model_dir)
        self.config = json.loads((model_dir / "config.json").read_text())
        self.max_tokens = json.loads((model_dir / "sentence_bert_config.json").read_text())["max_seq_length"]
        self.w = read_safetensors(model_dir / "model.safetensors")
        self.tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        self.tokenizer.no_padding()
        self.tokenizer.enable_truncation(self.max_tokens)

    def tokens(self, text):
        return self.tokenizer.encode(text).ids

    def _layer_norm(self, x, prefix):
        mean = x.mean(-1, keepdims=True)
        var = ((x - mean) ** 2).mean(-1, keepdims=True)
        eps = self.config.get("layer_norm_eps", 1e-12)
        return (x - mean) / np.sqrt(var + eps) * self.w[prefix + ".weight"] + self.w[prefix + ".bias"]

    def _dense(self, x, prefix):
        return x @ self.w[prefix + ".weight"].T + self.w[prefix + ".bias"]

    def embed_one(self, text):
        """One sentence, alone (no padding at all): float64 throughout."""
        ids = np.array(self.tokens(text))
        n = len(ids)
        w = self.w
        x = (
            w["embeddings.word_embeddings.weight"][ids]
            + w["embeddings.position_embeddings.weight"][:n]
            + w["embeddings.token_type_embeddings.weight"][0]
        )
        x = self._layer_norm(x, "embeddings.LayerNorm")
        heads = self.config["num_attention_heads"]
        d = self.config["hidden_size"] // heads
        for i in range(self.config["num_hidden_layers"]):
            p = f"encoder.layer.{i}"
            q = self._dense(x, p + ".attention.self.query").reshape(n, heads, d).transpose(1, 0, 2)
            k = self._dense(x, p + ".attention.self.key").reshape(n, heads, d).transpose(1, 0, 2)
            v = self._dense(x, p + ".attention.self.value").reshape(n, heads, d).transpose(1, 0, 2)
            scores = q @ k.transpose(0, 2, 1) / math.sqrt(d)
            scores = np.exp(scores - scores.max(-1, keepdims=True))
            probs = scores / scores.sum(-1, keepdims=True)
            ctx = (probs @ v).transpose(1, 0, 2).reshape(n, heads * d)
            x = self._layer_norm(self._dense(ctx, p + ".attention.output.dense") + x, p + ".attention.output.LayerNorm")
            h = self._dense(x, p + ".intermediate.dense")
            h = 0.5 * h * (1.0 + _erf(h / math.sqrt(2.0)))
            x = self._layer_norm(self._dense(h, p + ".output.dense") + x, p + ".output.LayerNorm")
        pooled = x.mean(0)
        return pooled / np.linalg.norm(pooled)

    def embed(self, texts):
        return np.stack([self.embed_one(t) for t in texts])


def cosines(a, b):
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))
