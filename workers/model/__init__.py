"""Pure-PyTorch hybrid models (Mamba2 or Gated DeltaNet + attention + MLP/MoE blocks) over explicit per-request state.

Dimension letters used in shape comments:
    b batch rows      l new tokens per row    d hidden size      v vocabulary
    h heads           p head dim              n SSM state size   g groups (of B/C, of the gated norm)
    c conv channels   W conv kernel width     k draft tokens     t tokens (flattened)
    h_v, d_k, d_v     Gated DeltaNet value heads, key and value head dims (state [h_v, d_k, d_v])
"""

from workers.model.config import SUPPORTED_MODEL_TYPES, HybridConfig
from workers.model.hybrid import HybridModel
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
