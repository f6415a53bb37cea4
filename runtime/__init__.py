"""Backends (torch, onnxruntime, tensorrt), beam and greedy search, tokenizer."""
