"""llama.cpp's OpenAI-compatible server (PyPI xllamacpp) on 127.0.0.1:PORT, serving a GGUF model
with N_PARALLEL slots, until killed. Prints one line when it listens. With EXACT (`exact`), its
KV cache holds f32 and attention runs without flash attention (whose CPU kernel rounds queries to
f16): the precision of Ferry's decoder with --kv-cache-dtype f32.

    python llama_server.py MODEL.gguf PORT N_PARALLEL [exact]
"""

import sys
import time

import xllamacpp as xlc

params = xlc.CommonParams()
params.model.path = sys.argv[1]
params.hostnames = ["127.0.0.1"]
params.port = int(sys.argv[2])
params.n_parallel = int(sys.argv[3])
params.n_ctx = 2048 * params.n_parallel
params.cpuparams.n_threads = 2
params.cpuparams_batch.n_threads = 2
params.endpoint_metrics = True
if sys.argv[4:] == ["exact"]:
    params.cache_type_k = xlc.ggml_type.GGML_TYPE_F32
    params.cache_type_v = xlc.ggml_type.GGML_TYPE_F32
    params.flash_attn_type = 0
server = xlc.Server(params)
print("llama server listening on", server.listening_address, flush=True)
while True:
    time.sleep(3600)
