"""Run as ``hf-paged run -m tests.clients.print_engine CHECKPOINT``: loads the checkpoint as an
unchanged script would and prints the model's class and its engine's max_model_len."""

import sys

from transformers import AutoModelForCausalLM

model = AutoModelForCausalLM.from_pretrained(sys.argv[1])
print(type(model).__name__, f"max_model_len={model.engine.max_model_len}")
