"""Structured outputs through the runner: every row that stops is valid (jsonschema, re.fullmatch), greedy output
equals transformers' with an independent grammar processor, bad constraints fail their own row only."""

from __future__ import annotations

import json
import random
import re

import jsonschema
import pytest
import torch

from tests.tiny_models import EOS
from tests.workers.structured_fixtures import (
    GrammarLogitsProcessor,
    ascii_checkpoint,
    random_regex,
    random_schema,
)
from workers import ModelRunner, SamplingParams, SpeculativeConfig, StructuredOutputsParams

NUM_ROWS = 64


@pytest.fixture(scope="module")
def ascii_model(tmp_path_factory):
    """A tiny random Mamba2/attention hybrid with the ASCII tokenizer."""
    return ascii_checkpoint("granite_dense", tmp_path_factory.mktemp("granite_ascii"))


def random_prompts(rng: random.Random, n: int) -> list[list[int]]:
    """n prompts of 3-12 random non-special tokens."""
    return [[rng.randrange(4, 128) for _ in range(rng.randint(3, 12))] for _ in range(n)]


def assert_valid(results, constraints: list[StructuredOutputsParams], min_stops: int) -> None:
    """Every row that stopped is valid under its constraint; enough rows stopped for that to mean something."""
    stops = 0
    for result, constraint in zip(results, constraints):
        assert result.finish_reason in ("stop", "length"), result.error
        if result.finish_reason != "stop":
            continue
        stops += 1
        if constraint.json is not None:
            jsonschema.validate(json.loads(result.text), constraint.json)
        elif constraint.regex is not None:
            assert re.fullmatch(constraint.regex, result.text), (constraint.regex, result.text)
        elif constraint.choice is not None:
            assert result.text in constraint.choice
    assert stops >= min_stops, f"only {stops} rows stopped"


@pytest.mark.parametrize("decode_plan", [False, True])
def test_every_stopped_row_is_valid(ascii_model, decode_plan):
    """64 random schemas and 64 random regexes, greedy and sampled, per executor."""
    rng = random.Random(1 + decode_plan)
    runner = ModelRunner.from_pretrained(str(ascii_model), max_num_seqs=NUM_ROWS, decode_plan=decode_plan)
    constraints = [StructuredOutputsParams(json=random_schema(rng)) for _ in range(NUM_ROWS)]
    constraints += [StructuredOutputsParams(regex=random_regex(rng)) for _ in range(NUM_ROWS)]
    params = [
        SamplingParams(max_tokens=64, temperature=i % 2, seed=i, structured_outputs=c)
        for i, c in enumerate(constraints)
    ]
    results = runner.generate(random_prompts(rng, len(params)), params)
    assert_valid(results, constraints, min_stops=len(params) // 2)
    lengths = [r for r in results if r.finish_reason == "length"]
    assert all(len(r.token_ids) == 64 for r in lengths)  # `length` only at max_tokens


@pytest.mark.parametrize(
    "options",
    [
        {"cuda_graphs": True},  # the graph plan's eager form on CPU
        {"enable_prefix_caching": True, "max_num_batched_tokens": 16},  # chunked prefill, shared prefixes
    ],
    ids=["graph_plan", "prefix_cache_chunked"],
)
def test_other_executors_and_prefill_paths_keep_constrained_greedy_output(ascii_model, options):
    rng = random.Random(5)
    prefix = random_prompts(rng, 1)[0] * 3  # a shared prefix longer than a prefill chunk
    prompts = [prefix + p for p in random_prompts(rng, 16)]
    constraints = [StructuredOutputsParams(json=random_schema(rng)) for _ in range(8)]
    constraints += [StructuredOutputsParams(regex=random_regex(rng)) for _ in range(8)]
    params = [SamplingParams(max_tokens=32, temperature=0, structured_outputs=c) for c in constraints]
    expected = ModelRunner.from_pretrained(str(ascii_model), max_num_seqs=16).generate(prompts, params)
    runner = ModelRunner.from_pretrained(str(ascii_model), max_num_seqs=16, **options)
    results = runner.generate(prompts, params)
    assert [r.token_ids for r in results] == [r.token_ids for r in expected]
    assert_valid(results, constraints, min_stops=8)


@pytest.mark.slow
def test_greedy_matches_transformers_with_its_own_grammar_processor(ascii_model, hf_model):
    """The oracle: transformers' `generate` with a logits processor applying the same constraint through separate
    xgrammar matchers, greedy, token for token (eos included)."""
    import xgrammar

    hf = hf_model(ascii_model)
    runner = ModelRunner.from_pretrained(str(ascii_model), max_num_seqs=8)
    info = xgrammar.TokenizerInfo.from_huggingface(runner.tokenizer, vocab_size=runner.config.vocab_size)
    compiler = xgrammar.GrammarCompiler(info)
    rng = random.Random(7)
    schema = {"type": "object", "properties": {"id": {"type": "integer"}, "ok": {"type": "boolean"}}}
    cases = [
        (StructuredOutputsParams(json=schema), compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)),
        (StructuredOutputsParams(regex="[a-f]{2,5}-[0-9]+"), compiler.compile_regex("[a-f]{2,5}-[0-9]+")),
        (
            StructuredOutputsParams(choice=["cat", "dog", "null"]),
            compiler.compile_grammar('root ::= "cat" | "dog" | "null"'),
        ),
        (
            StructuredOutputsParams(grammar='root ::= "(" [a-z]* ")"'),
            compiler.compile_grammar('root ::= "(" [a-z]* ")"'),
        ),
    ]
    compared = 0
    for constraint, compiled in cases:
        for prompt in random_prompts(rng, 2):
            ours = runner.generate(
                [prompt], SamplingParams(temperature=0, max_tokens=24, structured_outputs=constraint)
            )
            processor = GrammarLogitsProcessor(compiled, 1, runner.config.vocab_size, [EOS])
            with torch.no_grad():
                out = hf.generate(
                    torch.tensor([prompt]),
                    max_new_tokens=24,
                    do_sample=False,
                    eos_token_id=EOS,
                    pad_token_id=0,
                    logits_processor=[processor],
                )
            assert ours[0].token_ids == out[0, len(prompt) :].tolist()
            compared += ours[0].finish_reason == "stop"
    assert compared >= 4  # most rows end by the grammar (eos), not at max_tokens


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({}, "exactly one of json, regex, choice, grammar, got none"),
        ({"regex": "a", "choice": ["a"]}, "got regex, choice"),
        ({"choice": []}, "non-empty list"),
        ({"choice": ["a", ""]}, "non-empty list"),
        ({"json": "{not json"}, "not valid JSON text"),
        ({"json": 3}, "a JSON schema"),
        ({"grammar": "  "}, "EBNF grammar"),
    ],
)
def test_bad_params_are_refused_at_construction(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        StructuredOutputsParams(**kwargs)


def test_sampling_params_takes_only_structured_outputs_params():
    with pytest.raises(ValueError, match="structured_outputs"):
        SamplingParams(structured_outputs={"json": {}})


def test_a_constraint_that_cannot_compile_fails_its_own_row(ascii_model):
    runner = ModelRunner.from_pretrained(str(ascii_model), max_num_seqs=4)
    good = StructuredOutputsParams(regex="[a-c]{3}")
    bad = [
        StructuredOutputsParams(regex="a("),
        StructuredOutputsParams(json={"type": "frob"}),
        StructuredOutputsParams(grammar="root ::= undefined_rule"),
    ]
    params = [SamplingParams(temperature=0, max_tokens=8, structured_outputs=c) for c in [good, *bad, good]]
    results = runner.generate([[5, 6, 7]] * len(params), params)
    assert [r.finish_reason for r in results] == ["stop", "error", "error", "error", "stop"]
    assert "structured_outputs.regex cannot be compiled" in results[1].error
    assert "frob" in results[2].error
    assert "undefined_rule" in results[3].error
    assert re.fullmatch("[a-c]{3}", results[4].text)


def test_stop_means_complete_length_means_max_tokens(ascii_model):
    """A row whose grammar needs more tokens than max_tokens says `length`; with ignore_eos (no stop token) a row
    finishes `stop` as soon as its output is complete; eos is never chosen where the output is incomplete."""
    runner = ModelRunner.from_pretrained(str(ascii_model), max_num_seqs=4)
    long = StructuredOutputsParams(regex="[a-z]{40}")
    short = StructuredOutputsParams(regex="[a-z]{3}x*")
    results = runner.generate(
        [[5, 6, 7]] * 3,
        [
            SamplingParams(temperature=0, max_tokens=8, structured_outputs=long),
            SamplingParams(temperature=0, max_tokens=30, structured_outputs=short, ignore_eos=True),
            SamplingParams(temperature=0, max_tokens=60, structured_outputs=long),
        ],
    )
    assert results[0].finish_reason == "length" and len(results[0].token_ids) == 8
    assert results[1].finish_reason == "stop" and re.fullmatch("[a-z]{3}", results[1].text)
    assert EOS not in results[1].token_ids
    assert results[2].finish_reason == "stop" and re.fullmatch("[a-z]{40}", results[2].text)
    assert results[2].token_ids[-1] == EOS and EOS not in results[2].token_ids[:-1]


def test_an_empty_output_with_nothing_to_end_it_fails_its_own_row(ascii_model):
    """A constraint the empty output satisfies, on a row with no stop token (ignore_eos): the row could only end
    before its first token, which the runner always generates; it gets an error naming the way out, the others run
    (with a stop token the same constraint runs: eos ends the row)."""
    runner = ModelRunner.from_pretrained(str(ascii_model), max_num_seqs=4)
    nullable = [StructuredOutputsParams(regex="[0-9]*"), StructuredOutputsParams(grammar='root ::= "" | "yes"')]
    params = [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, structured_outputs=c) for c in nullable]
    params.append(SamplingParams(temperature=0, max_tokens=8, structured_outputs=nullable[0]))
    results = runner.generate([[5, 6, 7]] * len(params), params)
    assert [r.finish_reason for r in results[:2]] == ["error", "error"]
    assert all("accepts the empty output" in r.error and "stop_token_ids" in r.error for r in results[:2])
    assert results[2].error is None and re.fullmatch("[0-9]*", results[2].text)


def test_stop_strings_still_stop(ascii_model):
    runner = ModelRunner.from_pretrained(str(ascii_model), max_num_seqs=2)
    constraint = StructuredOutputsParams(regex="a[bc]{5,}")
    results = runner.generate([[5, 6]], SamplingParams(temperature=0, stop="c", structured_outputs=constraint))
    assert results[0].finish_reason == "stop" and "c" not in results[0].text


@pytest.mark.slow
@pytest.mark.parametrize("method", [None, "draft", "mtp"])
def test_trained_demo_models_write_valid_json(method):
    """The shipped trained demo models: constrained rows are valid, greedy and sampled; with the demo draft model
    or the demo GDN model's MTP head, greedy rows equal plain greedy."""
    from pathlib import Path

    models = Path(__file__).resolve().parents[2] / "examples" / "models"
    demo = models / ("demo-gdn" if method == "mtp" else "demo-target")
    speculative = None
    if method is not None:
        draft = str(models / "demo-draft") if method == "draft" else None
        speculative = SpeculativeConfig(method, 3, draft_model=draft, policy="fixed")
    runner = ModelRunner.from_pretrained(str(demo), max_num_seqs=32, speculative=speculative)
    rng = random.Random(3)
    texts = ["def parse(line):\n", "config = ", "# settings\n", "import json\n"]
    prompts = [runner.tokenizer.encode(rng.choice(texts)) for _ in range(32)]
    constraints = [StructuredOutputsParams(json=random_schema(rng)) for _ in range(32)]
    params = [
        SamplingParams(max_tokens=96, temperature=i % 2, seed=i, structured_outputs=c)
        for i, c in enumerate(constraints)
    ]
    results = runner.generate(prompts, params)
    assert_valid(results, constraints, min_stops=16)
    if method is not None:
        plain = ModelRunner.from_pretrained(str(demo), max_num_seqs=32).generate(prompts, params)
        assert [r.token_ids for r in results[::2]] == [r.token_ids for r in plain[::2]]  # the greedy rows


def test_n_samples_each_follow_the_constraint(ascii_model):
    """Each of a prompt's n samples has its own matcher: every sample valid, greedy samples equal."""
    runner = ModelRunner.from_pretrained(str(ascii_model), max_num_seqs=8)
    regex = "[a-f]{2,6}-[0-9]{1,3}"
    constraint = StructuredOutputsParams(regex=regex)
    sampled = SamplingParams(n=4, temperature=1.0, seed=1, max_tokens=24, structured_outputs=constraint)
    greedy = SamplingParams(n=3, temperature=0, max_tokens=24, structured_outputs=constraint)
    results = runner.generate([[5, 6, 7], [8, 9]], [sampled, greedy])
    assert [r.sample_index for r in results] == [0, 1, 2, 3, 0, 1, 2]
    assert all(r.finish_reason == "stop" and re.fullmatch(regex, r.text) for r in results)
    assert len({r.text for r in results[:4]}) > 1 and len({r.text for r in results[4:]}) == 1


def test_processed_logprobs_see_the_grammar_mask(ascii_model):
    """Processed logprobs are those of the masked distribution: tokens the grammar forbids at a position are −inf
    there, and the top entries are legal ones; raw logprobs stay the model's own."""
    constraint = StructuredOutputsParams(regex="[0-9]{4}")
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=5, structured_outputs=constraint)
    processed = ModelRunner.from_pretrained(str(ascii_model), logprobs_mode="processed").generate([[5, 6, 7]], params)
    raw = ModelRunner.from_pretrained(str(ascii_model)).generate([[5, 6, 7]], params)
    assert processed[0].token_ids == raw[0].token_ids
    tokenizer = ModelRunner.from_pretrained(str(ascii_model)).tokenizer
    for position in processed[0].logprobs[:-1]:  # before eos, every token with a finite logprob spells digits
        finite = [t for t, value in position.items() if value > float("-inf")]
        assert finite and all(tokenizer.decode([t]).isdigit() for t in finite)
    assert any(not tokenizer.decode([t]).isdigit() and value > float("-inf") for t, value in raw[0].logprobs[0].items())
