"""Whole-model state handling: prefill from a given state, extend(n) == n single steps, ragged batches."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import ALL_FAMILIES
from workers.model import ForwardBatch, StatePool, load_checkpoint

TOL = dict(atol=5e-5, rtol=1e-4)  # float32 rounding across layers; a wrong state is off by O(1)


def _run(model, pool, tokens: torch.Tensor, slots, cache_lens, num_tokens, states):
    batch = ForwardBatch(torch.tensor(slots), torch.tensor(cache_lens), torch.tensor(num_tokens))
    with torch.no_grad():
        out = model(tokens, batch, states, pool.kv_caches())
    return out.hidden, out.mamba_states


def _assert_states_close(a, b):
    for sa, sb in zip(a, b, strict=True):
        torch.testing.assert_close(sa.conv, sb.conv, **TOL)
        torch.testing.assert_close(sa.ssm, sb.ssm, **TOL)


@pytest.fixture(scope="module", params=ALL_FAMILIES)
def loaded(request, checkpoint_dir):
    return load_checkpoint(str(checkpoint_dir(request.param)))


def _tokens(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(4, 128, (1, n), generator=torch.Generator().manual_seed(seed))


def test_prefill_from_a_state_equals_one_full_prefill(loaded):
    model, config = loaded.model, loaded.config
    tokens = _tokens(37)
    full_pool = StatePool(config, 1, 64, torch.device("cpu"), torch.float32)
    full_hidden, full_states = _run(model, full_pool, tokens, [0], [0], [37], full_pool.zeros(1))
    pool = StatePool(config, 1, 64, torch.device("cpu"), torch.float32)
    _, states = _run(model, pool, tokens[:, :20], [0], [0], [20], pool.zeros(1))
    hidden, states = _run(model, pool, tokens[:, 20:], [0], [20], [17], states)
    torch.testing.assert_close(hidden, full_hidden[:, 20:], **TOL)
    _assert_states_close(states, full_states)


def test_extend_equals_single_steps(loaded):
    model, config = loaded.model, loaded.config
    tokens = _tokens(26, seed=1)
    pool_a = StatePool(config, 1, 64, torch.device("cpu"), torch.float32)
    pool_b = StatePool(config, 1, 64, torch.device("cpu"), torch.float32)
    _, start_a = _run(model, pool_a, tokens[:, :18], [0], [0], [18], pool_a.zeros(1))
    _, start_b = _run(model, pool_b, tokens[:, :18], [0], [0], [18], pool_b.zeros(1))
    extended, extended_states = _run(model, pool_a, tokens[:, 18:], [0], [18], [8], start_a)
    states, outputs = start_b, []
    for t in range(18, 26):
        out, states = _run(model, pool_b, tokens[:, t : t + 1], [0], [t], [1], states)
        outputs.append(out)
    torch.testing.assert_close(extended, torch.cat(outputs, dim=1), **TOL)
    _assert_states_close(extended_states, states)
    for slot in range(pool_a.num_slots):
        torch.testing.assert_close(pool_a.slot_kv(slot, 26)[0], pool_b.slot_kv(slot, 26)[0], **TOL)


def test_ragged_batch_rows_equal_rows_run_alone(loaded):
    model, config = loaded.model, loaded.config
    lengths = [5, 33, 1, 17]
    rows = [_tokens(n, seed=10 + i)[0] for i, n in enumerate(lengths)]
    padded = torch.full((4, max(lengths)), 7)  # padding with real token ids: they must not leak anywhere
    for i, row in enumerate(rows):
        padded[i, : len(row)] = row
    pool = StatePool(config, 6, 64, torch.device("cpu"), torch.float32)
    slots = [5, 0, 3, 1]
    hidden, states = _run(model, pool, padded, slots, [0] * 4, lengths, pool.zeros(4))
    for i, row in enumerate(rows):
        alone_pool = StatePool(config, 1, 64, torch.device("cpu"), torch.float32)
        alone, alone_states = _run(model, alone_pool, row[None], [0], [0], [len(row)], alone_pool.zeros(1))
        torch.testing.assert_close(hidden[i : i + 1, : len(row)], alone, **TOL)
        _assert_states_close([type(s)(s.conv[i : i + 1], s.ssm[i : i + 1]) for s in states], alone_states)
        n = len(row)
        torch.testing.assert_close(pool.slot_kv(slots[i], n)[0], alone_pool.slot_kv(0, n)[0], **TOL)
