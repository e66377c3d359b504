"""Run as ``hf-paged run -m tests.clients.print_engine CHECKPOINT``: loads the checkpoint as an
unchanged script would and prints the model's class, its engine's max_model_len and the dtype
of its KV cache."""

import sys

from transformers import AutoModelForCausalLM

model = AutoModelForCausalLM.from_pretrained(sys.argv[1])
print(type(model).__name__, f"max_model_len={model.engine.max_model_len}",
      f"kv_cache={model.model.layers[0].self_attn.k_cache.dtype}")
