"""Export formats, one module each: hf (a Hugging Face model folder) and folder (the --overwrite-safe writing
they share); gguf (one GGUF file for llama.cpp), with gguf_vocab (its tokenizer) and gguf_file (its safe writing)."""
