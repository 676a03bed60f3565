"""Export formats, one module each: hf (a Hugging Face model folder) and folder (the --overwrite-safe writing
they share)."""
