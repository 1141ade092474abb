"""hybridgen against llama.cpp on the same random-weight preset, same machine, same run (issue 27's comparison).

Builds llama.cpp from the `llama-cpp-python` sdist (cached), converts the preset checkpoint with llama.cpp's own
`convert_hf_to_gguf.py` to f32 GGUF, quantizes it to q8_0, then times `llama-batched-bench` and hybridgen (float32,
int8, bfloat16 where the runner takes it) in alternating rounds. Output tok/s = batch × new tokens / (prefill +
new tokens − 1 decode steps), as benchmarks/quantization_speed.py counts them; medians over rounds. Optional tooling:
never run in CI, never imported by tests. Nothing downloaded or built goes into the repository.

python benchmarks/llamacpp_compare.py --presets bench gdn-bench --rounds 3 --threads 2 --json llamacpp.json
python benchmarks/llamacpp_compare.py --isa avx2   # both built for AVX2 + FMA only: an AVX2 machine, on any x86
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import torch

from bench.generation import PRESETS, build_preset, random_prompts
from workers import ModelRunner, SamplingParams
from workers.model.kernels import native

BUILD_TARGETS = ("llama-batched-bench", "llama-quantize")
CMAKE_FLAGS = ("-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_SERVER=OFF",
               "-DLLAMA_BUILD_APP=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_UI=OFF")  # fmt: skip
# llama.cpp's own switches for an AVX2 + FMA build (no AVX-512), the counterpart of hybridgen's "avx2" kernels.
AVX2_CMAKE_FLAGS = (
    "-DGGML_NATIVE=OFF",
    "-DGGML_AVX=ON",
    "-DGGML_AVX2=ON",
    "-DGGML_FMA=ON",
    "-DGGML_F16C=ON",
    "-DGGML_BMI2=ON",
    "-DGGML_AVX512=OFF",
)
HYBRIDGEN_VARIANTS = {"float32": {}, "int8": {"quantization": "int8"}, "bfloat16": {"dtype": "bfloat16"}}
LLAMA_VARIANTS = ("f32", "q8_0")
GREEDY_PROMPT = "The quick brown fox jumps over the lazy dog and then"
# Runs llama.cpp's converter unchanged but for two gaps between it and a random-weight preset: (1) no tokenizer files:
# use the GPT-NeoX vocabulary llama.cpp ships (as its Mamba2 converter does), cut to the model's vocab size; (2)
# Qwen3.5 without MTP layers needs `--no-mtp`. Config spellings are fixed on a staged copy (`staged_checkpoint`).
CONVERT_SHIM = """
import json, runpy, sys
from pathlib import Path
script, sys.argv = sys.argv[1], sys.argv[1:]
sys.path[0] = str(Path(script).parent)
from conversion import get_model_class
from conversion.base import TextModel
checkpoint = Path(sys.argv[1])
config = json.loads((checkpoint / "config.json").read_text())
if not any((checkpoint / name).exists() for name in ("tokenizer.json", "tokenizer.model")):
    TextModel._set_vocab_gpt2 = lambda self: self._set_vocab_builtin("gpt-neox", self.hparams["vocab_size"])
model_class = get_model_class(config["architectures"][0])
if getattr(model_class, "supports_mtp_export", False) and not config.get("mtp_num_hidden_layers"):
    model_class.no_mtp = True
runpy.run_path(script, run_name="__main__")
"""


def llama_source(cache: Path) -> Path:
    """The unpacked `vendor/llama.cpp` of the newest `llama-cpp-python` sdist in `cache` (downloaded if none)."""
    sdists = sorted(cache.glob("llama_cpp_python-*.tar.gz"))
    if not sdists:
        cache.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--no-binary",
                ":all:",
                "llama-cpp-python",
                "-d",
                str(cache),
            ],
            check=True,
        )
        sdists = sorted(cache.glob("llama_cpp_python-*.tar.gz"))
    source = cache / sdists[-1].name.removesuffix(".tar.gz") / "vendor" / "llama.cpp"
    if not (source / "CMakeLists.txt").exists():
        with tarfile.open(sdists[-1]) as archive:
            archive.extractall(cache, filter="data")
    return source


def build_llama(cache: Path, targets: tuple[str, ...] = BUILD_TARGETS, isa: str = "native") -> Path:
    """Build only `targets` (Release, `nice -n 10`, 2 jobs; -march=native, or AVX2 + FMA for `isa="avx2"`) unless
    all exist; the binary folder."""
    build = cache / ("build" if isa == "native" else f"build-{isa}")
    bin_dir = build / "bin"
    if all((bin_dir / target).exists() for target in targets):
        return bin_dir
    source = llama_source(cache)
    flags = CMAKE_FLAGS if isa == "native" else (*CMAKE_FLAGS, *AVX2_CMAKE_FLAGS)
    if not (build / "CMakeCache.txt").exists():
        subprocess.run(["nice", "-n", "10", "cmake", "-S", str(source), "-B", str(build), *flags], check=True)
    subprocess.run(["nice", "-n", "10", "cmake", "--build", str(build), "--target", *targets, "-j2"], check=True)
    return bin_dir


def staged_checkpoint(checkpoint: Path, out_dir: Path) -> Path:
    """A copy of `checkpoint` (weights linked) whose config.json is spelled as the published Granite 4.0-H configs
    are, which llama.cpp's converter reads: transformers 5 saves layer types as "full_attention" / "linear_attention"
    (the converter wants "attention"); with no experts the published configs set `num_experts_per_tok` 0 (llama.cpp
    aborts on 2) and `intermediate_size` to the shared MLP's (llama.cpp sizes the dense MLP by it)."""
    staged = out_dir / f"{checkpoint.name}-hf"
    staged.mkdir(parents=True, exist_ok=True)
    for path in checkpoint.iterdir():
        if path.name != "config.json" and not (staged / path.name).exists():
            (staged / path.name).symlink_to(path.resolve())
    config = json.loads((checkpoint / "config.json").read_text())
    if config.get("model_type") == "granitemoehybrid":
        config["layer_types"] = ["attention" if kind == "full_attention" else "mamba" for kind in config["layer_types"]]
        if not config.get("num_local_experts"):
            config |= {"num_experts_per_tok": 0, "intermediate_size": config["shared_intermediate_size"]}
    (staged / "config.json").write_text(json.dumps(config, indent=2))
    return staged


def convert(source: Path, bin_dir: Path, checkpoint: Path, out_dir: Path) -> dict[str, Path] | None:
    """f32 and q8_0 GGUFs of `checkpoint` (reused when there), or None when this llama.cpp lacks the architecture."""
    ggufs = {variant: out_dir / f"{checkpoint.name}-{variant}.gguf" for variant in LLAMA_VARIANTS}
    if not ggufs["f32"].exists():
        env = {**os.environ, "PYTHONPATH": f"{source}{os.pathsep}{source / 'gguf-py'}"}
        staged = staged_checkpoint(checkpoint, out_dir)
        done = subprocess.run(
            [
                sys.executable,
                "-c",
                CONVERT_SHIM,
                str(source / "convert_hf_to_gguf.py"),
                str(staged),
                "--outtype",
                "f32",
                "--outfile",
                str(ggufs["f32"]),
            ],
            env=env,
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            if "not supported" in done.stderr:
                return None
            raise RuntimeError(f"convert_hf_to_gguf.py failed:\n{done.stderr[-3000:]}")
    if not ggufs["q8_0"].exists():
        subprocess.run(
            [str(bin_dir / "llama-quantize"), str(ggufs["f32"]), str(ggufs["q8_0"]), "q8_0"],
            check=True,
            capture_output=True,
        )
    return ggufs


def llama_rates(bin_dir: Path, gguf: Path, args: argparse.Namespace, flags: tuple[str, ...] = ()) -> dict[int, float]:
    """One `llama-batched-bench` run over every batch size: output tok/s per batch. Its TG phase times all
    `new_tokens` decode steps after the prefill; hybridgen's prefill already yields the first token, so the
    comparable time is T_PP + T_TG × (new_tokens − 1) / new_tokens."""
    context = max(args.batch_sizes) * (args.prompt_len + args.new_tokens)
    command = [str(bin_dir / "llama-batched-bench"), "-m", str(gguf), "-c", str(context), "-b", "2048", "-ub", "512",
               "-npp", str(args.prompt_len), "-ntg", str(args.new_tokens), "-t", str(args.threads),
               "-npl", ",".join(map(str, args.batch_sizes)), "--output-format", "jsonl", *flags]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        errors = [line for line in done.stderr.splitlines() if " E " in line or "error" in line][-2:]
        raise RuntimeError(f"llama-batched-bench exited with {done.returncode} (< 0: killed by that signal) {errors}")
    rows = [json.loads(line) for line in (done.stdout + done.stderr).splitlines() if line.startswith('{"n_kv_max"')]
    steps = (args.new_tokens - 1) / args.new_tokens
    return {row["pl"]: row["pl"] * args.new_tokens / (row["t_pp"] + row["t_tg"] * steps) for row in rows}


def probe_llama(bin_dir: Path, ggufs: dict[str, Path], args: argparse.Namespace) -> dict[str, tuple[str, ...]] | None:
    """Warm up each GGUF once and find the flags it runs with, or None when llama.cpp cannot run the model. Its AMX
    q8_0 path crashes on some Sapphire Rapids machines (SIGSEGV in `ggml_backend_amx_mul_mat` as in llama.cpp issue
    20824, or SIGILL): such a GGUF is retried with `--no-repack` (no AMX repacking), and the output says so."""
    flags: dict[str, tuple[str, ...]] = {}
    short = argparse.Namespace(**{**vars(args), "batch_sizes": [1], "new_tokens": 4})
    for variant, gguf in ggufs.items():
        for attempt in ((), ("--no-repack",)):
            try:
                llama_rates(bin_dir, gguf, short, attempt)
            except RuntimeError as error:
                print(f"llama.cpp {variant} {attempt or '(default flags)'}: {error}")
                continue
            flags[variant] = attempt
            break
        else:
            return None
    return flags


def load_runners(checkpoint: Path, max_batch: int) -> dict[str, ModelRunner]:
    """hybridgen runners per variant; a variant the runner rejects (bfloat16 on some builds) is left out."""
    runners = {}
    for name, options in HYBRIDGEN_VARIANTS.items():
        try:
            runners[name] = ModelRunner.from_pretrained(str(checkpoint), max_num_seqs=max_batch, **options)
        except (ValueError, TypeError, NotImplementedError, RuntimeError) as error:
            print(f"hybridgen {name}: skipped ({error})")
    return runners


def hybridgen_rate(runner: ModelRunner, prompts: list[list[int]], new_tokens: int) -> float:
    """One timed greedy run of `prompts`: output tok/s."""
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    start = time.perf_counter()
    runner.generate(prompts, params)
    return len(prompts) * new_tokens / (time.perf_counter() - start)


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: the character a BPE token piece uses for each byte."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    moved = [b for b in range(256) if b not in kept]
    return {chr(c): b for b, c in [*zip(kept, kept), *zip(moved, range(256, 256 + len(moved)))]}


def greedy_check(cache: Path, gguf: Path, runner: ModelRunner, new_tokens: int, isa: str = "native") -> str:
    """How many of `new_tokens` greedy tokens `llama-simple` (f32 GGUF) and hybridgen float32 share, as text bytes
    (llama-simple prints text): the prompt's words are single tokens of the GGUF's vocabulary."""
    sys.path.insert(0, str(llama_source(cache) / "gguf-py"))
    import gguf as gguf_py  # llama.cpp's own reader, not a project dependency

    field = gguf_py.GGUFReader(gguf).get_field("tokenizer.ggml.tokens")
    pieces = [bytes(field.parts[i]).decode() for i in field.data]
    ids = {piece: i for i, piece in enumerate(pieces)}
    prompt_ids = [ids.get(word if i == 0 else "Ġ" + word) for i, word in enumerate(GREEDY_PROMPT.split())]
    if None in prompt_ids:
        return "greedy check skipped (prompt words are not single tokens)"
    done = subprocess.run(
        [
            str(build_llama(cache, ("llama-simple",), isa) / "llama-simple"),
            "-m",
            str(gguf),
            "-n",
            str(new_tokens),
            GREEDY_PROMPT,
        ],
        capture_output=True,
    )
    if done.returncode != 0:
        return f"greedy check skipped (llama-simple failed: {done.stderr.decode().strip().splitlines()[-1:]})"
    before, _, llama_text = done.stdout.partition(GREEDY_PROMPT.encode())
    if before:  # llama-simple added a BOS token (it prints the prompt's special tokens too)
        prompt_ids.insert(0, ids[before.decode()])
    llama_text = llama_text.removesuffix(b"\n")
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    token_ids = runner.generate([prompt_ids], params)[0].token_ids
    decoder, text, same = _byte_decoder(), b"", 0
    for token_id in token_ids:
        text += bytes(decoder.get(c, ord("?")) for c in pieces[token_id])
        if not llama_text.startswith(text):
            break
        same += 1
    return f"{same} of {len(token_ids)} greedy tokens equal (llama-simple f32 against hybridgen float32)"


def measure_preset(preset: str, cache: Path, bin_dir: Path, args: argparse.Namespace) -> list[dict] | None:
    """Alternating rounds of every llama.cpp and hybridgen variant on one preset; a row per batch size (medians of
    output tok/s), or None when llama.cpp cannot run the preset's architecture."""
    checkpoint = build_preset(preset, Path(tempfile.gettempdir()) / f"hybridgen-{preset}")
    ggufs = convert(llama_source(cache), bin_dir, checkpoint, cache / "gguf")
    if ggufs is None:
        print(f"{preset}: this llama.cpp's converter does not support the architecture; skipped")
        return None
    flags = probe_llama(bin_dir, ggufs, args)
    if flags is None:
        print(f"{preset}: llama.cpp cannot run it; skipped")
        return None
    runners = load_runners(checkpoint, max(args.batch_sizes))
    vocab = runners["float32"].config.vocab_size
    prompts = {batch: random_prompts(batch, args.prompt_len, vocab) for batch in args.batch_sizes}
    for runner, batch_prompts in itertools.product(runners.values(), prompts.values()):  # warm-up: plans, pools
        hybridgen_rate(runner, batch_prompts, args.new_tokens)
    rates: dict[tuple[str, int], list[float]] = {}
    for _ in range(args.rounds):
        for variant, gguf in ggufs.items():
            for batch, rate in llama_rates(bin_dir, gguf, args, flags[variant]).items():
                rates.setdefault((f"llama.cpp {variant}", batch), []).append(rate)
        for name, runner in runners.items():
            for batch in args.batch_sizes:
                rate = hybridgen_rate(runner, prompts[batch], args.new_tokens)
                rates.setdefault((f"hybridgen {name}", batch), []).append(rate)
    notes = {f"llama.cpp {variant} flags": " ".join(flag) for variant, flag in flags.items()}
    if args.greedy_check:
        notes["greedy check"] = greedy_check(cache, ggufs["f32"], runners["float32"], args.new_tokens, args.isa)
        print(f"{preset}: {notes['greedy check']}")
    rows = []
    for batch in args.batch_sizes:
        medians = {name: statistics.median(r) for (name, b), r in rates.items() if b == batch}
        rows.append({"model": preset, "batch": batch, **medians, **notes})
    return rows


def print_table(rows: list[dict]) -> None:
    """One markdown table: output tok/s per engine and variant, and hybridgen's ratios to llama.cpp."""
    columns = ["llama.cpp f32", "llama.cpp q8_0", *(f"hybridgen {name}" for name in HYBRIDGEN_VARIANTS)]
    ratios = {"float32 / f32": ("hybridgen float32", "llama.cpp f32"),
              "int8 / q8_0": ("hybridgen int8", "llama.cpp q8_0"),
              "bfloat16 / q8_0": ("hybridgen bfloat16", "llama.cpp q8_0")}  # fmt: skip
    print("| model | batch | " + " | ".join(columns + list(ratios)) + " |")
    print("|---" * (2 + len(columns) + len(ratios)) + "|")
    for row in rows:
        cells = [f"{row[c]:.1f}" if c in row else "-" for c in columns]
        cells += [f"{row[a] / row[b]:.2f}×" if a in row and b in row else "-" for a, b in ratios.values()]
        print(f"| {row['model']} | {row['batch']} | " + " | ".join(cells) + " |")


def main() -> int:
    """Build llama.cpp if needed, measure each preset, print the table and write JSON."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--presets", nargs="+", choices=sorted(PRESETS), default=["bench", "gdn-bench"])
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "hybridgen" / "llama.cpp")
    p.add_argument(
        "--greedy-check",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="compare greedy tokens of llama-simple (f32) and hybridgen float32 on one prompt",
    )
    p.add_argument(
        "--isa",
        choices=["native", "avx2"],
        default="native",
        help="native: both built for this CPU; avx2: llama.cpp built for AVX2 + FMA and hybridgen's avx2 "
        "kernels (HYBRIDGEN_CPU_ISA), what an AVX2-only machine runs",
    )
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if args.isa != "native":
        os.environ[native.ISA_ENV] = args.isa
    bin_dir = build_llama(args.cache_dir, isa=args.isa)
    print(
        f"{args.threads} threads, {args.prompt_len}-token prompts, {args.new_tokens} new tokens, output tok/s, "
        f"medians of {args.rounds} alternating rounds; hybridgen kernels: {native.selected_isa()}, llama.cpp: "
        f"{args.isa} build"
    )
    rows = [row for preset in args.presets for row in measure_preset(preset, args.cache_dir, bin_dir, args) or []]
    print_table(rows)
    if args.json:
        source = llama_source(args.cache_dir)
        record = {"llama_cpp": source.parent.parent.name, "threads": args.threads, "rounds": args.rounds}
        args.json.write_text(json.dumps({**record, "isa": native.selected_isa(), "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
