"""LoRA adapters as PEFT saves them: read, checked against the base model, held as plain data."""
