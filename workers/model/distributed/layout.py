"""How a model splits over the ranks of a tensor-parallel group: one rank's local config and its slices.

`shard_config(config, tp)` is the architecture *one rank* holds: every head and channel count that tensor
parallelism splits is divided by the group size, so the layers, `StatePool`, the memory plan and the kernels are
built from it unchanged and hold exactly that rank's share. Widths that stay whole (the hidden size, the vocabulary,
the router's expert count) keep their global values: the layers that split them (the vocabulary-parallel embedding
and head, the expert-parallel MoE) read the rank from `TensorParallel`.

Every split is contiguous: rank r of T gets `[r·N/T, (r+1)·N/T)` of each piece. Two counts may also be smaller than
T and then replicate: attention KV heads (rank r holds KV head `r // (T / kv)`) and Mamba2 B/C groups (rank r holds
group `r // (T / g)`, and the gated norm then spans `T / g` ranks). `check_divisible` refuses every other layout with
the field and the sizes it needs. The loader slices checkpoint tensors by the same functions (`kv_heads`,
`mamba_groups`, `split`, `vocab_rows`, `local_experts`), so the config, the loader and the preflight agree.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from workers.model.checkpoint.config import AttentionConfig, HybridConfig
from workers.model.distributed.group import SINGLE, Collectives


@dataclass(frozen=True)
class TensorParallel:
    """One rank's place in its tensor-parallel group (size 1: the whole model on one device)."""

    rank: int = 0
    size: int = 1
    expert_parallel: bool = False  # MoE experts spread whole over the ranks instead of split inside each expert
    group: Collectives = field(default=SINGLE, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"tensor parallel rank {self.rank} must lie in [0, size={self.size})")

    @property
    def parallel(self) -> bool:
        """Whether the model is split (more than one rank)."""
        return self.size > 1

    def split(self, count: int) -> tuple[int, int]:
        """(start, length) of this rank's contiguous share of `count` items (`count` divisible by the size)."""
        share = count // self.size
        return self.rank * share, share


SINGLE_TP = TensorParallel()


def kv_heads(attention: AttentionConfig, tp: TensorParallel) -> tuple[int, int]:
    """(first global KV head, count) this rank holds: kv/T heads, or one head replicated on T/kv ranks."""
    kv = attention.num_kv_heads
    if kv % tp.size == 0:
        return tp.split(kv)
    return tp.rank // (tp.size // kv), 1


def mamba_groups(num_groups: int, tp: TensorParallel) -> tuple[int, int]:
    """(first global B/C group, count) this rank holds: g/T groups, or one group replicated on T/g ranks."""
    if num_groups % tp.size == 0:
        return tp.split(num_groups)
    return tp.rank // (tp.size // num_groups), 1


def vocab_rows(vocab_size: int, tp: TensorParallel) -> tuple[int, int]:
    """(first vocabulary row, rows present) of this rank's embedding / LM head shard. Every rank holds
    `ceil(V / T)` rows; the last rank's are zero-padded past V, so `present` may be smaller."""
    per_rank = -(-vocab_size // tp.size)
    start = tp.rank * per_rank
    return start, max(0, min(vocab_size, start + per_rank) - start)


def vocab_shard_size(vocab_size: int, tp: TensorParallel) -> int:
    """Rows of every rank's embedding / LM head shard: `ceil(V / T)`."""
    return -(-vocab_size // tp.size)


def local_experts(num_experts: int, tp: TensorParallel) -> tuple[int, int]:
    """(first global expert, count) this rank holds: all of them, or E/T whole experts under expert parallelism."""
    return tp.split(num_experts) if tp.expert_parallel else (0, num_experts)


def _attention(a: AttentionConfig, tp: TensorParallel) -> AttentionConfig:
    replicas = 1 if a.num_kv_heads % tp.size == 0 else tp.size // a.num_kv_heads
    return dataclasses.replace(
        a, num_heads=a.num_heads // tp.size, num_kv_heads=kv_heads(a, tp)[1], kv_replicas=replicas
    )


def shard_config(config: HybridConfig, tp: TensorParallel) -> HybridConfig:
    """The architecture rank `tp.rank` holds (its local head and channel counts); `config` itself at size 1.
    Call `check_divisible` first: this function assumes the layout is allowed."""
    if not tp.parallel:
        return config
    t = tp.size
    changes: dict = {"attention": _attention(config.attention, tp)}
    changes["block_attention"] = tuple(None if a is None else _attention(a, tp) for a in config.block_attention)
    if config.mamba is not None:
        m = config.mamba
        groups = mamba_groups(m.num_groups, tp)[1]
        span = 1 if m.num_groups % t == 0 else t // m.num_groups
        changes["mamba"] = dataclasses.replace(m, num_heads=m.num_heads // t, num_groups=groups, norm_span=span)
    if config.gdn is not None:
        g = config.gdn
        changes["gdn"] = dataclasses.replace(
            g, num_key_heads=g.num_key_heads // t, num_value_heads=g.num_value_heads // t
        )
    if config.mamba1 is not None:
        changes["mamba1"] = dataclasses.replace(config.mamba1, intermediate_size=config.mamba1.intermediate_size // t)
    if config.short_conv is not None:
        changes["short_conv"] = dataclasses.replace(config.short_conv, channels=config.hidden_size // t)
    if config.kda is not None:
        changes["kda"] = dataclasses.replace(config.kda, num_heads=config.kda.num_heads // t)
    if config.mla is not None:
        changes["mla"] = dataclasses.replace(config.mla, num_heads=config.mla.num_heads // t)
    ff = config.feed_forward
    changes["feed_forward"] = dataclasses.replace(
        ff,
        intermediate_size=ff.intermediate_size // t,
        shared_expert_intermediate_size=ff.shared_expert_intermediate_size // t,
        expert_intermediate_size=ff.expert_intermediate_size // (1 if tp.expert_parallel else t),
    )
    if config.shared_block is not None:
        s = config.shared_block
        changes["shared_block"] = dataclasses.replace(s, intermediate_size=s.intermediate_size // t)
    return dataclasses.replace(config, **changes)


def _requirements(config: HybridConfig, size: int, expert_parallel: bool) -> list[tuple[str, int, bool]]:
    """(field, value, replication allowed) for every count tensor parallelism splits in this model."""
    needs: list[tuple[str, int, bool]] = []
    attentions = [config.attention] + [a for a in config.block_attention if a is not None]
    uses_attention = any(k in ("attention", "parallel", "shared_attention") for k in config.block_kinds)
    if uses_attention and config.mla is None:
        for a in attentions:
            needs += [("num_attention_heads", a.num_heads, False), ("num_key_value_heads", a.num_kv_heads, True)]
    if config.mamba is not None:
        needs += [("mamba_num_heads", config.mamba.num_heads, False), ("mamba_n_groups", config.mamba.num_groups, True)]
    if config.gdn is not None:
        needs += [("linear_num_key_heads", config.gdn.num_key_heads, False)]
        needs += [("linear_num_value_heads", config.gdn.num_value_heads, False)]
    if config.mamba1 is not None:
        needs += [("mamba_d_inner", config.mamba1.intermediate_size, False)]
    if config.short_conv is not None:
        needs += [("hidden_size (short conv channels)", config.hidden_size, False)]
    if config.kda is not None:
        needs += [("linear_attn_config.num_heads", config.kda.num_heads, False)]
    if config.mla is not None:
        needs += [("num_attention_heads (latent attention)", config.mla.num_heads, False)]
    ff = config.feed_forward
    if any(k == "mlp" for k in config.block_kinds) or config.shared_block is not None:
        needs += [("intermediate_size", ff.intermediate_size, False)]
    if ff.num_experts:
        if expert_parallel:
            needs += [("num_experts (expert parallel)", ff.num_experts, False)]
        else:
            needs += [("moe_intermediate_size", ff.expert_intermediate_size, False)]
        if ff.shared_expert_intermediate_size:
            needs += [("shared_expert_intermediate_size", ff.shared_expert_intermediate_size, False)]
    if config.shared_block is not None:
        needs += [("shared intermediate_size", config.shared_block.intermediate_size, False)]
    return needs


def check_divisible(config: HybridConfig, size: int, expert_parallel: bool = False) -> None:
    """`ValueError` naming the first count `size` ranks cannot split (and the sizes that would), else nothing."""
    if size < 1:
        raise ValueError(f"tensor_parallel_size must be an integer ≥ 1, got {size}")
    if size == 1:
        return
    if config.mamba1 is not None and config.mamba1.dt_rank <= 0:
        raise ValueError("a Mamba1 model without dt_rank cannot be split")
    for name, value, replicable in _requirements(config, size, expert_parallel):
        if value % size == 0 or (replicable and size % value == 0):
            continue
        fits = [t for t in range(2, 65) if value % t == 0 or (replicable and t % value == 0)][:6]
        hint = f"sizes that split it: {', '.join(map(str, fits))}" if fits else "no tensor_parallel_size > 1 splits it"
        raise ValueError(f"tensor_parallel_size={size} does not divide {name}={value} ({hint})")
    full_width_norm = any(a.qk_norm and a.qk_norm_full_width for a in [config.attention])
    if full_width_norm and config.attention.num_kv_heads % size:
        raise ValueError(
            f"tensor_parallel_size={size} would replicate the {config.attention.num_kv_heads} KV heads, which a "
            "full-width q/k norm (OLMo) cannot span; use a size that divides num_key_value_heads"
        )
