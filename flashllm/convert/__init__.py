"""Checkpoints in, flash model folders out: source readers (safetensors, GGUF), the converter, the
GGUF vocabulary rebuild and the models.toml registry (pull, convert once, resolve a name)."""
