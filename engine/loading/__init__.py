"""Finding a model (directory, .gguf, hub id) and loading its weights and tokenizer."""
