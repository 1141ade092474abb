"""The native Gated DeltaNet decode step (`csrc/gdn_decode.c`) against the PyTorch path, token by token."""

from __future__ import annotations

import pytest
import torch

from workers import ModelRunner, SamplingParams
from workers.model import load_checkpoint
from workers.model.kernels import native_recurrent
from workers.model.layers.gdn import GatedDeltaNetMixer
from workers.model.state import RecurrentState


def _first_mixer(path: str, kernel: str) -> GatedDeltaNetMixer:
    model = load_checkpoint(path, decode_kernel=kernel).model
    return next(m for m in model.modules() if isinstance(m, GatedDeltaNetMixer))


def _random_state(mixer: GatedDeltaNetMixer, batch: int, seed: int) -> RecurrentState:
    g, generator = mixer.config, torch.Generator().manual_seed(seed)
    return RecurrentState(
        torch.randn(batch, g.conv_dim, g.conv_kernel - 1, generator=generator),
        torch.randn(batch, g.num_value_heads, g.key_head_dim, g.value_head_dim, generator=generator) * 0.3,
    )


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next", "qwen3_5_wide"])
def test_native_gdn_decode_steps_equal_the_torch_path(checkpoint_dir, family):
    path = str(checkpoint_dir(family))
    mixers = {kernel: _first_mixer(path, kernel) for kernel in ("torch", "native")}
    assert (mixers["torch"].decode_kernel, mixers["native"].decode_kernel) == ("torch", "native")
    assert mixers["native"].config.num_value_heads == 2 * mixers["native"].config.num_key_heads  # heads shared
    with torch.no_grad():
        for mixer in mixers.values():  # make dt_bias, A_log and the norm weight matter
            generator = torch.Generator().manual_seed(1)
            for param in (mixer.dt_bias, mixer.A_log, mixer.norm.weight):
                param.copy_(torch.randn(param.shape, generator=generator))
    batch = 3
    states = {kernel: _random_state(mixers["torch"], batch, seed=2) for kernel in mixers}
    hidden_size = mixers["torch"].in_proj.in_features
    generator = torch.Generator().manual_seed(3)
    with torch.inference_mode():
        for _ in range(6):  # several steps: the updated windows and states feed the next one
            hidden = torch.randn(batch, 1, hidden_size, generator=generator)
            outs = {
                k: m(hidden, states[k], torch.ones(batch, dtype=torch.long), in_place=True) for k, m in mixers.items()
            }
            assert outs["native"][1] is states["native"] and outs["native"][2] is None
            torch.testing.assert_close(outs["native"][0], outs["torch"][0], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(states["native"].conv, states["torch"].conv, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(states["native"].ssm, states["torch"].ssm, atol=1e-5, rtol=1e-4)


def test_native_gdn_shapes_are_checked(checkpoint_dir):

    mixer = _first_mixer(str(checkpoint_dir("qwen3_5")), "native")
    state = _random_state(mixer, 2, seed=0)
    proj = torch.zeros(2, mixer.in_proj.out_features + 1)
    with pytest.raises(ValueError, match="shape mismatch"):
        native_recurrent.gdn_decode_step(
            proj,
            state.conv,
            mixer.conv1d.weight.squeeze(1),
            mixer.dt_bias,
            mixer.A_log,
            state.ssm,
            mixer.norm.weight,
            1e-6,
            mixer.config.num_key_heads,
        )


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next"])
def test_greedy_generation_is_the_same_with_either_gdn_kernel(checkpoint_dir, family):
    path = str(checkpoint_dir(family))
    runners = {k: ModelRunner.from_pretrained(path, decode_kernel=k, max_num_seqs=2) for k in ("torch", "native")}
    prompts = [[5, 9, 30, 31, 4, 7, 12], [8, 8, 8], [10, 3, 17, 25]]  # 3 prompts, 2 slots: admission mid-run
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    outputs = {k: [r.token_ids for r in runner.generate(prompts, params)] for k, runner in runners.items()}
    assert outputs["native"] == outputs["torch"]
