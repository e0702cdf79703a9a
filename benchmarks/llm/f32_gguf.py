"""Rewrites a GGUF file with every tensor dequantized to F32 (metadata kept as it is), so that
llama.cpp computes at the precision Ferry's decoder does, on the very same weights.

    python f32_gguf.py IN.gguf OUT.gguf

Needs PyPI gguf (benchmarks/requirements.txt; scripts/bench.sh installs it).
"""

import sys

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import dequantize

source, target = sys.argv[1], sys.argv[2]
reader = GGUFReader(source)
arch = reader.fields["general.architecture"].contents()
writer = GGUFWriter(target, arch)
for name, field in reader.fields.items():
    if name.startswith("GGUF.") or name == "general.architecture":
        continue
    kind = field.types[0]
    if name == "general.file_type":
        # Every tensor is F32 now (llama.cpp's LLAMA_FTYPE_ALL_F32).
        writer.add_key_value(name, 0, kind)
        continue
    if kind == GGUFValueType.ARRAY:
        writer.add_key_value(name, field.contents(), kind, sub_type=field.types[-1])
    else:
        writer.add_key_value(name, field.contents(), kind)
for t in reader.tensors:
    values = dequantize(t.data, t.tensor_type).astype(np.float32)
    # ggml's dims are innermost first; numpy's outermost first.
    writer.add_tensor(t.name, values.reshape(list(reversed([int(d) for d in t.shape]))))
writer.write_header_to_file()
writer.write_kv_data_to_file()
writer.write_tensors_to_file()
writer.close()
print("wrote", target)
