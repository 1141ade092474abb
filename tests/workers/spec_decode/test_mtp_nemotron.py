"""Nemotron-H MTP drafting against an independent reference, and the Nemotron-H MTP config and layout checks.

transformers ignores `mtp.*` for nemotron_h, so the reference below is written from vLLM's
`vllm/model_executor/models/nemotron_h_mtp.py` (and the decoder layers of `nemotron_h.py` it subclasses) on the raw
checkpoint tensors, without any hybridgen code and without a cache (every draft recomputes the whole sequence):
    x = eh_proj(cat[enorm(embed(token t+1)), hnorm(h_t)])        mtp.layers.0.{enorm, hnorm, eh_proj}
    x = x + mixer_i(norm_i(x))   for i, c in enumerate(pattern)    mtp.layers.i.{norm, mixer.*}; "*" "-" "E"
    logits = lm_head(final_layernorm(x))                           mtp.layers.{last}.final_layernorm
h_t is the target's final-norm (norm_f) hidden state; draft j+1 feeds back draft j and the head's own output.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.tiny_models import NEMOTRON_MTP_FAMILIES, engine_config
from tests.workers.spec_decode.test_state_shifting import _prompts, _requests
from workers import ModelRunner, SpeculativeConfig
from workers.model import HybridConfig, load_checkpoint
from workers.model.checkpoint.config import ATTENTION, MLP, MOE
from workers.scheduler import Scheduler
from workers.spec_decode.mtp import MtpProposer

_KINDS = {"full_attention": "*", "attention": "*", "mlp": "-", "moe": "E"}


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _linear(x: torch.Tensor, w: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    out = x @ w[f"{name}.weight"].T
    return out + w[f"{name}.bias"] if f"{name}.bias" in w else out


def _relu2_mlp(x: torch.Tensor, w: dict[str, torch.Tensor], prefix: str) -> torch.Tensor:
    return _linear(torch.relu(_linear(x, w, f"{prefix}.up_proj")).square(), w, f"{prefix}.down_proj")


def _attention(x: torch.Tensor, w: dict[str, torch.Tensor], prefix: str, cfg: dict) -> torch.Tensor:
    """Causal grouped-query attention over the whole sequence, no positional encoding; x [n, d]."""
    n, heads, kv_heads, hd = x.shape[0], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    q = _linear(x, w, f"{prefix}.q_proj").view(n, heads, hd).transpose(0, 1)
    k, v = (_linear(x, w, f"{prefix}.{p}_proj").view(n, kv_heads, hd).transpose(0, 1) for p in "kv")
    k, v = k.repeat_interleave(heads // kv_heads, 0), v.repeat_interleave(heads // kv_heads, 0)
    scores = (q @ k.transpose(1, 2)) * hd**-0.5
    scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), -torch.inf)
    return _linear((scores.softmax(-1) @ v).transpose(0, 1).reshape(n, heads * hd), w, f"{prefix}.o_proj")


def _moe(x: torch.Tensor, w: dict[str, torch.Tensor], prefix: str, cfg: dict) -> torch.Tensor:
    """Grouped sigmoid routing with score-correction bias, relu² experts (per-expert keys), shared expert."""
    num_experts, num_groups = cfg["n_routed_experts"], cfg["n_group"]
    scores = torch.sigmoid(x @ w[f"{prefix}.gate.weight"].T)  # [n, E]
    choice = scores + w[f"{prefix}.gate.e_score_correction_bias"]
    groups = choice.view(-1, num_groups, num_experts // num_groups).topk(2, -1).values.sum(-1)
    keep = torch.zeros_like(groups).scatter(1, groups.topk(cfg["topk_group"], -1).indices, 1.0).bool()
    choice = choice.masked_fill(~keep.repeat_interleave(num_experts // num_groups, 1), -torch.inf)
    top = choice.topk(cfg["num_experts_per_tok"], -1).indices
    weights = scores.gather(1, top)
    if cfg.get("norm_topk_prob", True):
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    weights = weights * cfg.get("routed_scaling_factor", 1.0)
    latent = f"{prefix}.fc1_latent_proj.weight" in w
    inner = _linear(x, w, f"{prefix}.fc1_latent_proj") if latent else x
    routed = torch.zeros_like(inner)
    for token in range(x.shape[0]):
        for slot, expert in enumerate(top[token].tolist()):
            out = _relu2_mlp(inner[token], w, f"{prefix}.experts.{expert}")
            routed[token] += weights[token, slot] * out
    routed = _linear(routed, w, f"{prefix}.fc2_latent_proj") if latent else routed
    return routed + _relu2_mlp(x, w, f"{prefix}.shared_experts")


def _mtp_outputs(w: dict, cfg: dict, token_ids: list[int], hidden: torch.Tensor) -> torch.Tensor:
    """The head's final-norm outputs [n, d] for inputs (token_ids[i], hidden[i]), one uncached forward."""
    pattern = cfg.get("mtp_hybrid_override_pattern") or "".join(_KINDS[t] for t in cfg["mtp_layers_block_type"])
    eps, first, last = cfg["layer_norm_epsilon"], "mtp.layers.0", f"mtp.layers.{len(pattern) - 1}"
    embedded = w["backbone.embeddings.weight"][torch.tensor(token_ids)]
    fused = torch.cat(
        [_rms_norm(embedded, w[f"{first}.enorm.weight"], eps), _rms_norm(hidden, w[f"{first}.hnorm.weight"], eps)],
        dim=-1,
    )
    x = fused @ w[f"{first}.eh_proj.weight"].T
    for i, kind in enumerate(pattern):
        normed = _rms_norm(x, w[f"mtp.layers.{i}.norm.weight"], eps)
        mixer = f"mtp.layers.{i}.mixer"
        if kind == "*":
            x = x + _attention(normed, w, mixer, cfg)
        elif kind == "E":
            x = x + _moe(normed, w, mixer, cfg)
        else:
            x = x + _relu2_mlp(normed, w, mixer)
    return _rms_norm(x, w[f"{last}.final_layernorm.weight"], eps)


def reference_draft_logits(w: dict, cfg: dict, tokens: list[int], hidden: torch.Tensor, k: int) -> torch.Tensor:
    """Logits [k, v] of k chained greedy drafts after `tokens` (N of them), from the target's final-norm hidden
    states `hidden` [N-1, d] of positions 0 … N-2: draft 1 reads (h_t, token t+1) for every t, draft j+1 also
    (the head's output at the previous last position, draft j)."""
    lm_head = w.get("lm_head.weight", w["backbone.embeddings.weight"])
    inputs, states, logits = list(tokens[1:]), hidden, []
    for _ in range(k):
        out = _mtp_outputs(w, cfg, inputs, states)[-1]
        logits.append(out @ lm_head.T)
        inputs.append(int(logits[-1].argmax()))
        states = torch.cat([states, out[None]])
    return torch.stack(logits)


class _LogitsTap:
    """The target model as the proposer sees it; every `logits` call (a chain step's draft logits) is kept."""

    def __init__(self, model, calls: list[torch.Tensor]):
        self._model, self._calls = model, calls

    def __getattr__(self, name: str):
        return getattr(self._model, name)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        self._calls.append(self._model.logits(hidden))
        return self._calls[-1]


class RecordingMtp(MtpProposer):
    """The MTP proposer, recording for every drafting row: its tokens, the target hidden states it was handed
    (`observe_target`), each chain step's logits and the drafts."""

    def __init__(self, model, num_speculative_tokens: int):
        self.calls: list[torch.Tensor] = []
        super().__init__(_LogitsTap(model, self.calls), num_speculative_tokens)
        self.target_hidden: dict[int, torch.Tensor] = {}  # request index → [positions observed, d]
        self.records: list[tuple[int, list[int], torch.Tensor, torch.Tensor, list[int]]] = []

    def observe_target(self, requests, hidden, cache_lens, num_tokens) -> None:
        super().observe_target(requests, hidden, cache_lens, num_tokens)
        for row, request in enumerate(requests):
            old = self.target_hidden.get(request.index, hidden.new_zeros(0, hidden.shape[-1]))
            assert old.shape[0] == cache_lens[row]
            self.target_hidden[request.index] = torch.cat([old, hidden[row, : num_tokens[row]]])

    def propose(self, requests, num_drafts):
        self.calls.clear()
        proposal = super().propose(requests, num_drafts)
        active = [i for i, k in enumerate(num_drafts) if k > 0]
        for position, i in enumerate(active):
            k, request = num_drafts[i], requests[i]
            if self.plan is not None:  # the MTP plan keeps every step's logits
                logits = self.plan.logits[:k, position].clone()
            else:
                logits = torch.stack([call[position] for call in self.calls[:k]])
            tokens = request.prompt + request.output
            hidden = self.target_hidden[request.index].clone()
            self.records.append((request.index, tokens, hidden, logits, proposal.token_ids[i, :k].tolist()))
        return proposal


@pytest.mark.parametrize("family", NEMOTRON_MTP_FAMILIES)
def test_mtp_drafts_match_the_reference(family, checkpoint_dir, hf_model):
    """Every proposal's first draft logits and its chained greedy drafts equal the uncached reference on the
    hidden states the proposer was handed (1e-5, float32), and those are transformers' final-norm states."""
    path = checkpoint_dir(family)
    weights = load_file(path / "model.safetensors")
    cfg = json.loads((path / "config.json").read_text())
    model = load_checkpoint(str(path), mtp=True).model
    proposer = RecordingMtp(model, 3)
    scheduler = Scheduler(model, engine_config(4, 3, decode_plan=True), _requests(_prompts()), proposer)
    while scheduler.has_work():
        scheduler.step()
    assert len(proposer.records) > 100 and sum(len(drafts) for *_, drafts in proposer.records) > 300
    for _, tokens, hidden, logits, drafts in proposer.records:
        assert hidden.shape[0] == len(tokens) - 1  # h_t for t = 0 … N-2, none missing, none rejected
        expected = reference_draft_logits(weights, cfg, tokens, hidden, len(drafts))
        torch.testing.assert_close(logits, expected, atol=1e-5, rtol=0)
        assert drafts == expected.argmax(-1).tolist()
    # The hidden states handed over are the target's final-norm ones (transformers' last_hidden_state, after norm_f):
    # each request's last record holds all it was handed.
    last = {index: (tokens, hidden) for index, tokens, hidden, *_ in proposer.records}
    with torch.no_grad():
        for tokens, hidden in last.values():
            hf_hidden = hf_model(path).model(input_ids=torch.tensor([tokens[:-1]])).last_hidden_state[0]
            torch.testing.assert_close(hidden, hf_hidden, atol=5e-5, rtol=0)


def test_nemotron_mtp_pattern_is_read_from_either_config_field(checkpoint_dir):
    raw = json.loads((checkpoint_dir("nemotron_moe") / "config.json").read_text())
    assert HybridConfig.from_hf_dict(raw).mtp_block_kinds == (ATTENTION, MOE)  # transformers 5's list
    legacy = {k: v for k, v in raw.items() if k != "mtp_layers_block_type"} | {"mtp_hybrid_override_pattern": "*-E"}
    assert HybridConfig.from_hf_dict(legacy).mtp_block_kinds == (ATTENTION, MLP, MOE)  # hub configs' string
    bare = {k: v for k, v in raw.items() if not k.startswith(("mtp_", "num_nextn"))}
    assert HybridConfig.from_hf_dict(bare).mtp_block_kinds == (ATTENTION, MOE)  # transformers' default


def _variant(checkpoint_dir, tmp_path, family: str, **config) -> str:
    """A copy of `family`'s checkpoint with config.json fields replaced."""
    path = tmp_path / "model"
    shutil.copytree(checkpoint_dir(family), path)
    raw = json.loads((path / "config.json").read_text()) | config
    (path / "config.json").write_text(json.dumps(raw))
    return str(path)


@pytest.mark.parametrize(
    "config, message",
    [
        (
            dict(mtp_layers_block_type=["linear_attention", "moe"]),
            r"MTP pattern 'ME' is not supported.*recurrent \(M\)",
        ),
        (dict(num_nextn_predict_layers=2), "declares 2 MTP layers; speculative method 'mtp' serves exactly one"),
    ],
)
def test_unservable_nemotron_mtp_layouts_are_refused(config, message, checkpoint_dir, tmp_path):
    path = _variant(checkpoint_dir, tmp_path, "nemotron_moe", **config)
    ModelRunner.from_pretrained(path)  # fine without speculation
    with pytest.raises(ValueError, match=message):
        ModelRunner.from_pretrained(path, speculative=SpeculativeConfig("mtp"))


def test_a_partial_nemotron_mtp_head_names_the_missing_keys(checkpoint_dir, tmp_path):
    path = tmp_path / "model"
    shutil.copytree(checkpoint_dir("nemotron_dense"), path)
    tensors = load_file(path / "model.safetensors")
    del tensors["mtp.layers.3.final_layernorm.weight"], tensors["mtp.layers.0.hnorm.weight"]
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(
        ValueError, match=r"pattern '\*-\*-'\): missing mtp\.layers\.0\.hnorm\.weight, mtp\.layers\.3\."
    ):
        load_checkpoint(str(path), mtp=True)


def test_the_memory_plan_holds_every_mtp_attention_block(checkpoint_dir):
    path = str(checkpoint_dir("nemotron_dense"))  # one attention layer ("M-*-M-"); its MTP layer "*-*-" has two
    plain = ModelRunner.from_pretrained(path).memory_plan.bytes_per_block
    with_mtp = ModelRunner.from_pretrained(path, speculative=SpeculativeConfig("mtp")).memory_plan.bytes_per_block
    assert with_mtp == 3 * plain
