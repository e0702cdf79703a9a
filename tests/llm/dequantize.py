"""Random blocks of every quantized GGUF format Ferry decodes, and what PyPI gguf's own numpy
dequantizers make of them: llm/tests/dequantize.rs reads the file with Ferry's reader and compares.

    python dequantize.py OUT_DIR    # writes OUT_DIR/blocks.gguf and OUT_DIR/expected.json

Every byte of every block is random except the f16 scales and minimums, which are finite values
in [-2, 2] (random bytes there would be infinities and NaNs, which no quantizer writes)."""

import json
import sys
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as T

# Each format, and the byte offsets of the f16 fields in its block.
FORMATS = {
    T.Q8_0: [0],
    T.Q4_0: [0],
    T.Q4_1: [0, 2],
    T.Q5_0: [0],
    T.Q5_1: [0, 2],
    T.Q4_K: [0, 2],
    T.Q5_K: [0, 2],
    T.Q6_K: [208],
}
ROWS, COLS = 3, 512

out = Path(sys.argv[1])
rng = np.random.default_rng(27)
writer = gguf.GGUFWriter(out / "blocks.gguf", "llama")
expected = {}
for kind, halves in FORMATS.items():
    block, size = gguf.GGML_QUANT_SIZES[kind]
    blocks = ROWS * COLS // block
    raw = rng.integers(0, 256, size=(blocks, size), dtype=np.uint8)
    for at in halves:
        raw[:, at : at + 2] = rng.uniform(-2, 2, blocks).astype(np.float16).view(np.uint8).reshape(blocks, 2)
    raw = raw.reshape(ROWS, -1)
    writer.add_tensor(kind.name, raw, raw_dtype=kind)
    expected[kind.name] = gguf.quants.dequantize(raw, kind).astype(np.float32).ravel().tolist()
writer.write_header_to_file()
writer.write_kv_data_to_file()
writer.write_tensors_to_file()
writer.close()
(out / "expected.json").write_text(json.dumps(expected))
