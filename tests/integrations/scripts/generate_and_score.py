"""A plain transformers script (nothing in it knows hf_paged): load a causal LM and its
tokenizer, generate for a padded batch, chat through a pipeline, and score a sentence.

usage: python generate_and_score.py CHECKPOINT
"""

import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline

path = sys.argv[1]
tokenizer = AutoTokenizer.from_pretrained(path)
model = AutoModelForCausalLM.from_pretrained(path, dtype="auto", device_map="auto")
model.eval()
print("model class:", type(model).__module__.split(".")[0], type(model).__name__)

prompts = ["The river starts", "Tell me a story about a cat who lived"]
batch = tokenizer(prompts, return_tensors="pt", padding=True).to(model.device)
with torch.no_grad():
    out = model.generate(**batch, max_new_tokens=12, do_sample=False)
width = batch["input_ids"].shape[1]
for text in tokenizer.batch_decode(out[:, width:], skip_special_tokens=True):
    print("generate:", repr(text))

generator = pipeline("text-generation", model=model, tokenizer=tokenizer)
chat = [{"role": "user", "content": "What is the capital of France?"}]
reply = generator(chat, max_new_tokens=8, do_sample=False)[0]["generated_text"][-1]
print("chat:", repr(reply["content"]))
for result in generator(["Once upon a time", "Numbers: 1 2 3"], max_new_tokens=6,
                        do_sample=False, batch_size=2):
    print("pipeline:", repr(result[0]["generated_text"]))

enc = tokenizer(["A good question is worth more than a quick answer."],
                return_tensors="pt").to(model.device)
with torch.no_grad():
    loss = model(**enc, labels=enc["input_ids"]).loss
print(f"loss: {loss.item():.4f}")
