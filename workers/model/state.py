"""Explicit per-request state: recurrent states (Mamba2 or Gated DeltaNet), attention KV caches, held in slots.

A recurrent layer's state is a conv window plus a float32 matrix state: Mamba2's SSM state [h, p, n] or the
Gated DeltaNet's delta-rule state [h_v, d_k, d_v]. A model has one recurrent kind, so the pool stacks its layers.
The model reads states as values and returns new ones (`RecurrentState`); the runner decides what to keep and
writes it back into the request's slot. KV caches are paged (`kv_blocks.py`): the model writes new keys at the
positions of each row's slot; entries past a slot's committed length are scratch and get overwritten (that is what lets speculative
verification write k+1 positions and keep only the accepted ones).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from workers.model.checkpoint.config import ATTENTION_KINDS, RECURRENT_KINDS, SHARED_ATTENTION, HybridConfig
from workers.model.kv_blocks import BlockTable

DEFAULT_BLOCK_SIZE = 16  # positions per KV block (vLLM's default)


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
    """Key/value storage of one attention layer, paged: `blocks` says where each slot's positions live."""

    key: torch.Tensor  # [kv_heads, num_blocks · block_size, head_dim]
    value: torch.Tensor  # [kv_heads, num_blocks · block_size, head_dim]
    blocks: BlockTable

    def token_index(self, slot_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Token indices into `key`/`value` of `positions` [b, …] of the rows' slots `slot_ids` [b]."""
        size = self.blocks.block_size
        block = self.blocks.tables[slot_ids.view(-1, *([1] * (positions.dim() - 1))), positions // size]
        return block * size + positions % size

    def write(self, slot_ids: torch.Tensor, positions: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        """Store key, value [n, kv_heads, head_dim] at `positions` [n] of slots `slot_ids` [n]."""
        where = self.token_index(slot_ids, positions)
        self.key[:, where] = key.transpose(0, 1)
        self.value[:, where] = value.transpose(0, 1)

    def read(self, slot_ids: torch.Tensor, span: int, contiguous_start: int | None = None) -> tuple[torch.Tensor, ...]:
        """Keys and values of positions 0 … span-1 of each row's slot, [b, kv_heads, span, head_dim] (positions a
        slot has no block for read the null block's zeros). `contiguous_start`: one row whose positions lie in
        consecutive blocks from that token index — returned as views, nothing copied."""
        if contiguous_start is not None:
            stop = contiguous_start + span
            return self.key[None, :, contiguous_start:stop], self.value[None, :, contiguous_start:stop]
        where = self.token_index(slot_ids, torch.arange(span, device=slot_ids.device)[None, :])  # [b, span]
        return self.key[:, where].transpose(0, 1), self.value[:, where].transpose(0, 1)


@dataclass
class ForwardBatch:
    """Where the rows of one forward pass live and how many of their tokens are real."""

    slot_ids: torch.Tensor  # [b] int64: the slot of each row in the KV caches
    cache_lens: torch.Tensor  # [b] int64: tokens already cached = position of the row's first new token
    num_tokens: torch.Tensor  # [b] int64: valid new tokens in the row (the rest is right padding)
    slots_are_prefix: bool = False  # slot_ids == 0 … b-1: caches can be sliced instead of gathered
    one_token_each: bool = False  # every row has exactly one new token (decode): attention's direct path


class StatePool:
    """Per-slot storage for every layer's state: recurrent states per slot, KV caches paged over `blocks`."""

    def __init__(
        self,
        config: HybridConfig,
        num_slots: int,
        capacity: int,
        device: torch.device,
        dtype: torch.dtype,
        blocks: BlockTable | None = None,
    ):
        """`capacity`: positions one request may use. `blocks`: the block table to page the KV caches over (shared
        with the scheduler, and with a draft model's pool); None gives every slot `capacity` positions up front."""
        a = config.attention
        num_recurrent = sum(kind in RECURRENT_KINDS for kind in config.block_kinds)
        num_attention = sum(kind in ATTENTION_KINDS for kind in config.block_kinds)
        num_attention += config.block_kinds.count(SHARED_ATTENTION)  # Zamba2: each use of a shared block has its KV
        conv_shape, state_shape = config.recurrent_state_shapes()
        self.num_slots, self.capacity = num_slots, capacity
        # [layers, slots, ...]; a slot's recurrent state is always written (prefill, admit) before it is read.
        self.conv = torch.empty(num_recurrent, num_slots, *conv_shape, device=device, dtype=dtype)
        self.ssm = torch.empty(num_recurrent, num_slots, *state_shape, device=device, dtype=torch.float32)
        if blocks is None:
            blocks = BlockTable.fully_assigned(num_slots, capacity, DEFAULT_BLOCK_SIZE, device)
        self.blocks = blocks
        kv_shape = (num_attention, a.num_kv_heads, blocks.num_blocks * blocks.block_size, a.head_dim)
        value_shape = (*kv_shape[:-1], a.cache_widths[1])  # latent attention caches no value (width 0)
        # Empty, zeroed block by block as blocks are handed out: memory no request uses is never touched (on CPU
        # it is never paged in).
        self.key = torch.empty(kv_shape, device=device, dtype=dtype)
        self.value = torch.empty(value_shape, device=device, dtype=dtype)
        if num_attention:
            blocks.attach([self.key, self.value])

    def release(self) -> None:
        """Free this pool's storage now, whoever still holds its tensors (before a larger pool is allocated: two
        pools sized by the memory plan would exceed it). Nothing may run on the pool afterwards."""
        for tensor in (self.conv, self.ssm, self.key, self.value):
            free_storage(tensor)

    def kv_caches(self) -> list[KVCache]:
        """Views of each attention layer's buffers (writes go to the pool)."""
        return [KVCache(self.key[i], self.value[i], self.blocks) for i in range(self.key.shape[0])]

    def read(self, slot_ids: torch.Tensor) -> list[RecurrentState]:
        """Copies of the recurrent states of the given slots, one `RecurrentState` per recurrent layer."""
        return [RecurrentState(self.conv[i, slot_ids], self.ssm[i, slot_ids]) for i in range(self.conv.shape[0])]

    def prefix(self, batch_size: int) -> list[RecurrentState]:
        """Views (not copies) of the recurrent states of slots 0 … batch_size-1."""
        return [RecurrentState(self.conv[i, :batch_size], self.ssm[i, :batch_size]) for i in range(self.conv.shape[0])]

    def move(self, source: int, target: int) -> None:
        """Copy every recurrent state of slot `source` into slot `target` (slot compaction; the KV blocks are
        handed over by the block table's `move`, which the owner of the table calls once)."""
        for buffer in (self.conv, self.ssm):
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

    def slot_kv(self, slot: int, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of positions 0 … num_tokens-1 of `slot` in every attention layer, each
        [layers, kv_heads, num_tokens, head_dim] (a gather through the block table)."""
        where = KVCache(self.key[0], self.value[0], self.blocks).token_index(
            torch.tensor([slot], device=self.key.device), torch.arange(num_tokens, device=self.key.device)[None]
        )[0]
        return self.key[:, :, where], self.value[:, :, where]

    def kv_bytes_per_token(self) -> int:
        """Bytes of KV cache one position takes across this pool's attention layers."""
        layers, heads, _, head_dim = self.key.shape
        return layers * heads * (head_dim + self.value.shape[-1]) * self.key.element_size()


def free_storage(tensor: torch.Tensor) -> None:
    """Free a tensor's memory in place: every view and holder of it sees an empty storage from now on."""
    tensor.untyped_storage().resize_(0)


def paged_kv_cache(blocks: BlockTable, config: HybridConfig, device: torch.device, dtype: torch.dtype) -> KVCache:
    """A standalone attention-layer cache paged over `blocks` (an MTP head's, following the target's positions)."""
    a = config.attention
    shape = (a.num_kv_heads, blocks.num_blocks * blocks.block_size, a.head_dim)
    value_shape = (*shape[:-1], a.cache_widths[1])
    cache = KVCache(
        torch.empty(shape, device=device, dtype=dtype), torch.empty(value_shape, device=device, dtype=dtype), blocks
    )
    blocks.attach([cache.key, cache.value])
    return cache
