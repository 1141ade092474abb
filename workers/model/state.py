"""Explicit per-request state: recurrent states (Mamba2 or Gated DeltaNet), attention KV caches, held in slots.

A recurrent layer's state is a conv window plus a float32 matrix state: Mamba2's SSM state [h, p, n] or the
Gated DeltaNet's delta-rule state [h_v, d_k, d_v]. A model has one recurrent kind, so the pool stacks its layers.
The model reads states as values and returns new ones (`RecurrentState`); the runner decides what to keep and
writes it back into the request's slot. KV caches are slot-indexed buffers the model writes new keys into;
entries past a slot's committed length are scratch and get overwritten (that is what lets speculative
verification write k+1 positions and keep only the accepted ones).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from workers.model.config import ATTENTION, RECURRENT_KINDS, HybridConfig


@dataclass
class RecurrentState:
    """Recurrent state of one Mamba2 or Gated DeltaNet layer for a batch of requests."""

    conv: torch.Tensor  # [b, conv_dim, W-1], model dtype
    ssm: torch.Tensor  # [b, h, p, n] (Mamba2) or [b, h_v, d_k, d_v] (Gated DeltaNet), float32


MambaState = RecurrentState  # the name the Mamba2-only code grew up with


@dataclass
class ScanInputs:
    """What one Mamba2 layer computed from its input tokens: enough to rebuild its state after any prefix."""

    conv_in: torch.Tensor  # [b, l, conv_dim] inputs of the causal conv (xBC before the conv)
    x: torch.Tensor  # [b, l, h, p] SSM input (after conv + silu)
    B: torch.Tensor  # [b, l, g, n]
    dt: torch.Tensor  # [b, l, h] float32, after softplus/clamp, 0 at padding


@dataclass
class DeltaScanInputs:
    """What one Gated DeltaNet layer computed from its input tokens: enough to rebuild its state after any prefix."""

    conv_in: torch.Tensor  # [b, l, conv_dim] inputs of the causal conv (q, k, v before the conv)
    k: torch.Tensor  # [b, l, h_v, d_k] float32, l2-normalised, repeated to the value heads
    v: torch.Tensor  # [b, l, h_v, d_v] float32
    g: torch.Tensor  # [b, l, h_v] float32 log decay, 0 at padding
    beta: torch.Tensor  # [b, l, h_v] float32 write strength, 0 at padding


@dataclass
class KVCache:
    """Key/value buffers of one attention layer, indexed by slot."""

    key: torch.Tensor  # [num_slots, kv_heads, capacity, head_dim]
    value: torch.Tensor  # [num_slots, kv_heads, capacity, head_dim]


@dataclass
class ForwardBatch:
    """Where the rows of one forward pass live and how many of their tokens are real."""

    slot_ids: torch.Tensor  # [b] int64: the slot of each row in the KV caches
    cache_lens: torch.Tensor  # [b] int64: tokens already cached = position of the row's first new token
    num_tokens: torch.Tensor  # [b] int64: valid new tokens in the row (the rest is right padding)
    slots_are_prefix: bool = False  # slot_ids == 0 … b-1: caches can be sliced instead of gathered
    one_token_each: bool = False  # every row has exactly one new token (decode): attention's direct path


class StatePool:
    """Per-slot storage for every layer's state, allocated once per `generate` call."""

    def __init__(self, config: HybridConfig, num_slots: int, capacity: int, device: torch.device, dtype: torch.dtype):
        a = config.attention
        num_recurrent = sum(kind in RECURRENT_KINDS for kind in config.block_kinds)
        num_attention = sum(kind == ATTENTION for kind in config.block_kinds)
        conv_shape, state_shape = config.recurrent_state_shapes()
        self.num_slots, self.capacity = num_slots, capacity
        # [layers, slots, ...]; a slot's recurrent state is always written (prefill, admit) before it is read.
        self.conv = torch.empty(num_recurrent, num_slots, *conv_shape, device=device, dtype=dtype)
        self.ssm = torch.empty(num_recurrent, num_slots, *state_shape, device=device, dtype=torch.float32)
        # Zeros, not empty: masked attention still multiplies stale values by a zero weight (NaN would spread).
        kv_shape = (num_attention, num_slots, a.num_kv_heads, capacity, a.head_dim)
        self.key = torch.zeros(kv_shape, device=device, dtype=dtype)
        self.value = torch.zeros(kv_shape, device=device, dtype=dtype)

    def kv_caches(self) -> list[KVCache]:
        """Views of each attention layer's buffers (writes go to the pool)."""
        return [KVCache(self.key[i], self.value[i]) for i in range(self.key.shape[0])]

    def read(self, slot_ids: torch.Tensor) -> list[RecurrentState]:
        """Copies of the recurrent states of the given slots, one `RecurrentState` per recurrent layer."""
        return [RecurrentState(self.conv[i, slot_ids], self.ssm[i, slot_ids]) for i in range(self.conv.shape[0])]

    def prefix(self, batch_size: int) -> list[RecurrentState]:
        """Views (not copies) of the recurrent states of slots 0 … batch_size-1."""
        return [RecurrentState(self.conv[i, :batch_size], self.ssm[i, :batch_size]) for i in range(self.conv.shape[0])]

    def move(self, source: int, target: int) -> None:
        """Copy every layer's state of slot `source` into slot `target` (slot compaction)."""
        for buffer in (self.conv, self.ssm, self.key, self.value):
            buffer[:, target] = buffer[:, source]

    def write(self, slot_ids: torch.Tensor, states: list[RecurrentState]) -> None:
        """Store new recurrent states into the given slots."""
        for i, state in enumerate(states):
            self.conv[i, slot_ids] = state.conv
            self.ssm[i, slot_ids] = state.ssm

    def zeros(self, batch_size: int) -> list[RecurrentState]:
        """Fresh (all-zero) recurrent states for `batch_size` new requests."""
        return [
            RecurrentState(
                self.conv.new_zeros(batch_size, *self.conv.shape[2:]),
                self.ssm.new_zeros(batch_size, *self.ssm.shape[2:]),
            )
            for _ in range(self.conv.shape[0])
        ]
