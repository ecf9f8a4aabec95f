"""GGUF files: the reader, the dequantizers and the tokenizers stored in them."""
