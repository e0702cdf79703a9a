"""A GGUF file requantized to Q8_0 with PyPI gguf's own quantizer: every tensor of SRC read to
f32 with gguf's dequantizers, its matrices quantized to Q8_0 (the vectors, norms, stay f32), the
metadata copied. llm/tests/quantized.rs compares the decoder's logits on it with those on SRC's
own f32 values.

    python requantize.py SRC.gguf OUT.gguf
"""

import sys

import gguf
import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import GGUFValueType as V

source, out = sys.argv[1], sys.argv[2]
reader = gguf.GGUFReader(source)
writer = gguf.GGUFWriter(out, reader.fields["general.architecture"].contents())
for name, field in reader.fields.items():
    # The header's own counts and the architecture, which the writer writes itself.
    if name.startswith("GGUF.") or name == "general.architecture":
        continue
    if name == "general.file_type":
        writer.add_key_value(name, int(gguf.LlamaFileType.MOSTLY_Q8_0), V.UINT32)
        continue
    kind = field.types[0]
    sub = field.types[1] if kind == V.ARRAY else None
    writer.add_key_value(name, field.contents(), kind, sub_type=sub)
for tensor in reader.tensors:
    values = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
    values = values.reshape([int(n) for n in reversed(tensor.shape)])
    if values.ndim == 2 and values.shape[1] % 32 == 0:
        writer.add_tensor(tensor.name, gguf.quants.quantize(values, T.Q8_0), raw_dtype=T.Q8_0)
    else:
        writer.add_tensor(tensor.name, values)
writer.write_header_to_file()
writer.write_kv_data_to_file()
writer.write_tensors_to_file()
writer.close()
