"""The model's modules: the sequence mixers (Mamba2, Gated DeltaNet, attention with its long-context path), the
feed-forward blocks (MLP, MoE), norms and linears, the residual block around each mixer, the multi-token-prediction
head, and `HybridModel`, which stacks the blocks. Mixers are handed their per-request state (`workers/model/state.py`):
the recurrent ones return the state they end in, attention writes its new keys and values into the request's KV
cache blocks. Their scans and decode steps come from `workers/model/kernels/`.
"""
