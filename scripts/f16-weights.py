"""Copies a safetensors file with its F32 tensors stored as F16: half the bytes, for carrying a
model to a machine with a size limit on what travels (the GPU check's device machine). Ferry's
loader reads F16 and computes in F32, so both of its paths see the same rounded weights.

The format is small enough to write here (an 8-byte little-endian header length, a JSON header of
dtype, shape and data offsets, then the data), and numpy is the only dependency it needs.

    python scripts/f16-weights.py model.safetensors model-f16.safetensors
"""

import json
import struct
import sys

import numpy as np


def main(src: str, dst: str) -> None:
    with open(src, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
        data = f.read()
    metadata = header.pop("__metadata__", None)
    out, chunks, at = {}, [], 0
    for name, tensor in sorted(header.items(), key=lambda item: item[1]["data_offsets"][0]):
        begin, end = tensor["data_offsets"]
        raw, dtype = data[begin:end], tensor["dtype"]
        if dtype == "F32":
            values = np.frombuffer(raw, dtype="<f4")
            half = values.astype("<f2")
            if not np.isfinite(half).all():
                sys.exit(f"{name}: a value overflows F16 (largest magnitude {np.abs(values).max()})")
            raw, dtype = half.tobytes(), "F16"
        out[name] = {"dtype": dtype, "shape": tensor["shape"], "data_offsets": [at, at + len(raw)]}
        chunks.append(raw)
        at += len(raw)
    if metadata is not None:
        out["__metadata__"] = metadata
    text = json.dumps(out, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    with open(dst, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for chunk in chunks:
            f.write(chunk)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: f16-weights.py SRC.safetensors DST.safetensors")
    main(sys.argv[1], sys.argv[2])
