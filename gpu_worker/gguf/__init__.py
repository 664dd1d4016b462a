"""GGUF files (llama.cpp's format) served as they are.

- ``reader``: the header (metadata, tensor table) parsed without touching tensor data,
  and each tensor's raw blocks as a read-only view of the memory-mapped file.
- ``names``: which GGUF tensor is which HF parameter, per architecture (gguf's own
  name table, inverted), and what llama.cpp changed on the way (q/k row order, Gemma's
  ``1 + w`` norms); the tensors a config needs, with their shapes.
- ``config``: the file's metadata read the way llama.cpp reads it, as an HF
  ``config.json`` dict for the architectures Candor serves.
- ``tensors``: every tensor of a checked file as a ``GGUFTensor`` (GGUF name, HF name,
  ggml type, logical shape, raw rows in HF row order): what a quantized linear method
  takes.
- ``dequant``: the one place blocks become fp32 (``gguf.quants.dequantize``).
- ``weights``: the worker's view: a file of HF-named tensors the loader reads like
  safetensors (torch).

Everything but ``weights`` is torch-free: the launcher checks a file with it before any
process starts.
"""
