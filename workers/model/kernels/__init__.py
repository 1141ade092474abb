"""The scans and decode steps the mixers run, by backend: the pure-PyTorch references (`ssd.py` for Mamba2,
`gated_delta.py` for Gated DeltaNet) that every faster path is tested against; the native C kernels for CPU float32
(`csrc/`, compiled at first use by `native.py` through the build cache of `kernel_cache.py`, with the recurrent
steps' Python entry points in `native_recurrent.py`); and the Triton kernels for CUDA (`triton_kernels/`). Nothing
here knows about layers or checkpoints; which backend runs is chosen per model at load (`decode_kernel`).
"""
