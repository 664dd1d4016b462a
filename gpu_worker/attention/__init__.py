"""Paged attention behind one interface (``base.AttentionBackend``), one module per backend.

- ``base``: the interface, the cache layout every backend shares, and ``AttentionSpec``
  (what this rank's model asks of attention, fixed at start-up).
- ``torch_backend``: plain torch (SDPA), runs anywhere; the reference.
- ``cpu_kernel_backend``: the torch path with decodes through a compiled CPU kernel.
- ``flashinfer_backend``: flashinfer's paged kernels on CUDA, with CUDA-graph decode.
- ``registry``: the table of backends, in order of preference, and ``select_backend``.

Adding a backend: a module with an ``AttentionBackend`` subclass (its metadata, its
prefill and decode paths, whether its decode can be captured in a CUDA graph) and one
line in ``registry.BACKENDS``.
"""
