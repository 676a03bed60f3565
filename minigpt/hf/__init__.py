"""Hugging Face interop: import a model folder or hub id, export ours as one, and the tensor and tokenizer maps."""
