"""Multi-LoRA serving: adapters in PEFT's format over one (quantized) base, mixed in one batch."""
