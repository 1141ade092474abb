"""Pure-PyTorch hybrid models (Mamba2 or Gated DeltaNet + attention + MLP/MoE blocks) over explicit per-request state.

Packages, by role: `layers/` (the modules: mixers, feed-forward, norms, blocks, `HybridModel`), `kernels/` (the
scans and decode steps: PyTorch references, native C, Triton), `checkpoint/` (configs, weight maps, the loader),
`steps/` (whole decode steps planned ahead: the CPU decode plan, the MTP plan, draft chains, CUDA graphs).
`state.py` and `kv_blocks.py` hold the per-request state and the paged KV bookkeeping every package passes around.

Dimension letters used in shape comments:
    b batch rows      l new tokens per row    d hidden size      v vocabulary
    h heads           p head dim              n SSM state size   g groups (of B/C, of the gated norm)
    c conv channels   W conv kernel width     k draft tokens     t tokens (flattened)
    h_v, d_k, d_v     Gated DeltaNet value heads, key and value head dims (state [h_v, d_k, d_v])
"""

from workers.model.checkpoint.config import HybridConfig
from workers.model.checkpoint.families import SUPPORTED_MODEL_TYPES
from workers.model.layers.hybrid import HybridModel
from workers.model.loader import LoadedCheckpoint, load_checkpoint
from workers.model.state import ForwardBatch, KVCache, MambaState, RecurrentState, StatePool

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "ForwardBatch",
    "HybridConfig",
    "HybridModel",
    "KVCache",
    "LoadedCheckpoint",
    "MambaState",
    "RecurrentState",
    "StatePool",
    "load_checkpoint",
]
