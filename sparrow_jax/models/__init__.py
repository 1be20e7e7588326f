"""Models: Qwen3 (dense forward + attention hook), LoRA linears, chunked LM head, HF I/O."""
