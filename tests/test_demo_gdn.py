"""The shipped GDN demo (examples/models/demo-gdn, examples/demo-gdn.yaml): trained, exact against transformers,
its MTP head read as trained, greedy MTP speculation equal to plain decoding, and the yaml job runs."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from jobs import demo_gdn
from workers import ModelRunner, SamplingParams, SpeculativeConfig
from workers.model import ForwardBatch, StatePool
from workers.model.state import paged_kv_cache

ROOT = Path(__file__).parents[1]
MODEL = ROOT / "examples" / "models" / "demo-gdn"
# Held-out perplexity on the first 40 prompts: measured 41.5 when trained (the pair: 36.3 and 42.4); the bound
# leaves ~30% headroom, while an untrained or broken file scores in the thousands.
MAX_PERPLEXITY = 54.0
# Share of positions of the first 8 prompts where the MTP head's argmax is token t+2: measured 0.384 when trained,
# ~0 untrained.
MIN_MTP_ACCURACY = 0.30


def _texts(count: int) -> list[str]:
    lines = (ROOT / "examples" / "prompts.jsonl").read_text().splitlines()[:count]
    return [json.loads(line)["prompt"] for line in lines]


@pytest.fixture(scope="module")
def runner() -> ModelRunner:
    # Fixed k: the test counts drafts and acceptance, which the adaptive policy's timing-driven choices would make
    # depend on how busy the machine is.
    speculative = SpeculativeConfig("mtp", 3, policy="fixed")
    return ModelRunner.from_pretrained(str(MODEL), dtype="float32", speculative=speculative)


@pytest.fixture(scope="module")
def hf_model():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()


def test_demo_gdn_is_a_trained_qwen3_5_checkpoint_with_the_demo_tokenizer(runner):
    config = json.loads((MODEL / "config.json").read_text())
    assert config["model_type"] == "qwen3_5_text" and config["dtype"] == "bfloat16"
    assert "full_attention" in config["layer_types"] and "linear_attention" in config["layer_types"]
    with safe_open(MODEL / "model.safetensors", "pt") as f:
        keys = set(f.keys())
    assert {"mtp.fc.weight", "mtp.norm.weight", "mtp.layers.0.self_attn.q_proj.weight"} <= keys
    target_tokenizer = ROOT / "examples" / "models" / "demo-target" / "tokenizer.json"
    assert (MODEL / "tokenizer.json").read_text() == target_tokenizer.read_text()
    sequences = [runner.tokenizer.encode(t) for t in _texts(40)]
    scores = runner.score(sequences)
    total = sum(sum(s.token_logprobs) for s in scores)
    perplexity = math.exp(-total / sum(len(s.token_logprobs) for s in scores))
    print(f"demo-gdn: held-out perplexity {perplexity:.2f}")
    assert perplexity < MAX_PERPLEXITY


def test_demo_gdn_agrees_with_transformers(runner, hf_model):
    """Log-probs of prompt + greedy continuation against one uncached transformers forward of the whole sequence,
    and every greedy token is transformers' argmax there (unless the top two are a near-tie)."""
    prompts = [runner.tokenizer.encode(t) for t in _texts(3)]
    plain = ModelRunner.from_pretrained(str(MODEL), dtype="float32")
    generated = plain.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    for prompt, result in zip(prompts, generated):
        ids = prompt + result.token_ids
        with torch.no_grad():
            logprobs = hf_model(torch.tensor([ids])).logits.float().log_softmax(-1)[0]
        reference = logprobs[:-1].gather(-1, torch.tensor(ids[1:])[:, None]).squeeze(-1)
        ours = torch.tensor(plain.score([ids])[0].token_logprobs)
        assert (ours - reference).abs().max() < 1e-3
        for position, token in enumerate(result.token_ids, start=len(prompt) - 1):
            top2 = logprobs[position].topk(2)
            assert token == int(top2.indices[0]) or top2.values[0] - top2.values[1] < 1e-3


def test_mtp_head_is_read_as_trained(runner, hf_model):
    """hybridgen's MTP head on the loaded weights equals the training script's head (transformers' modules) on the
    same checkpoint, and it predicts token t+2 well above chance."""
    head = demo_gdn.MtpHead(hf_model.config)
    with safe_open(MODEL / "model.safetensors", "pt") as f:
        head.load_state_dict({k[len("mtp.") :]: f.get_tensor(k).float() for k in f.keys() if k.startswith("mtp.")})
    model = runner.model
    correct = total = 0
    for text in _texts(8):
        ids = runner.tokenizer.encode(text)
        n = len(ids)
        with torch.no_grad():
            hf_hidden = hf_model.model(input_ids=torch.tensor([ids])).last_hidden_state
            reference = head.eval()(hf_model, torch.tensor([ids[1:]]), hf_hidden[:, :-1])[0]  # [n-1, vocab]
            pool = StatePool(model.config, 1, n + 1, torch.device("cpu"), torch.float32)
            batch = ForwardBatch(torch.tensor([0]), torch.tensor([0]), torch.tensor([n - 1]))
            hidden = model(torch.tensor([ids[:-1]]), batch, None, pool.kv_caches()).hidden
            caches = [paged_kv_cache(pool.blocks, model.config, torch.device("cpu"), torch.float32)]  # one attention
            ours = model.logits(model.mtp(torch.tensor([ids[1:]]), hidden, model.embed_tokens, batch, caches))[0]
        torch.testing.assert_close(ours, reference, atol=2e-3, rtol=1e-3)
        correct += int((reference[:-1].argmax(-1) == torch.tensor(ids[2:])).sum())
        total += n - 2
    print(f"MTP top-1 accuracy on token t+2: {correct / total:.3f}")
    assert correct / total > MIN_MTP_ACCURACY


def test_greedy_mtp_speculation_equals_plain_and_accepts(runner):
    prompts = [runner.tokenizer.encode(t) for t in _texts(12)]
    params = SamplingParams(temperature=0, max_tokens=32)
    plain = ModelRunner.from_pretrained(str(MODEL), dtype="float32").generate(prompts, params)
    assert [r.token_ids for r in runner.generate(prompts, params)] == [r.token_ids for r in plain]
    stats = runner.spec_stats()
    assert stats["num_drafts"] > 50 and stats["acceptance_rate"] > 0.3


def test_demo_gdn_yaml_runs_a_few_rows(monkeypatch):
    """The yaml parses into a job with `--speculative mtp` (preflight included); a worker runs its first rows and
    writes what plain decoding writes."""
    import jobs.generate as generate
    from pipeline.cli import parse_sections
    from pipeline.config import GenerateJobConfig
    from pipeline.generate import build_generate_job
    from workers.actor import ShardTask, ShardWorker

    monkeypatch.chdir(ROOT)
    config = GenerateJobConfig(**parse_sections("demo-gdn", generate.SECTIONS, ["--config", "examples/demo-gdn.yaml"]))
    assert (config.model.model, config.speculative.speculative) == ("examples/models/demo-gdn", "mtp")
    job = build_generate_job(config)
    assert job.worker.speculative.method == "mtp"
    worker = ShardWorker(job.worker)
    assert "error" not in worker.ready()
    output = worker.process(ShardTask(0, 0, job.rows.data.table.slice(0, 4)))
    assert output.stats["num_drafts"] > 0
    plain = ModelRunner.from_pretrained(config.model.model, dtype="float32")
    expected = plain.generate(
        [plain.tokenizer.encode(t) for t in _texts(4)],
        SamplingParams(temperature=0, max_tokens=config.sampling.max_tokens),
    )
    assert output.columns["generated_token_ids"] == [r.token_ids for r in expected]
