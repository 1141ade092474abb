"""Peak resident memory of loading a preset and generating with it, against the size of its float32 weights.

python benchmarks/peak_memory.py --preset granite-4.0-h-1b --batch 8 --new-tokens 8
python benchmarks/peak_memory.py --preset granite-4.0-h-1b --layers 10      # the same shapes, fewer layers

Each measurement runs in a fresh subprocess (ru_maxrss never goes down), which prints one JSON line: peak RSS
after loading and after generating, the weights' bytes as the model holds them, and float32 weights' bytes.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def build(preset: str, layers: int | None) -> Path:
    """The preset's checkpoint (random weights), with `layers` layers when given (attention every 10th)."""
    from workers import benchmark

    name = preset if layers is None else f"{preset}-{layers}l"
    directory = Path(tempfile.gettempdir()) / f"hybridgen-{name}"
    if layers is not None and name not in benchmark.PRESETS:
        shape = dict(benchmark.PRESETS[preset], num_hidden_layers=layers)
        shape["attention_layers"] = [i for i in shape["attention_layers"] if i < layers] or [layers // 2]
        benchmark.PRESETS[name] = shape
    return benchmark.build_preset(name, directory)


def measure(path: str, batch: int, new_tokens: int, quantization: str | None, plan: bool, dtype: str = "auto") -> dict:
    """Load, generate once; peak RSS (MiB) after each (in this process)."""
    from workers import ModelRunner, SamplingParams

    def peak() -> float:  # VmHWM, not ru_maxrss: that one keeps the forking parent's peak across exec
        status = Path("/proc/self/status").read_text()
        return int(status.split("VmHWM:")[1].split()[0]) / 1024

    start = peak()
    options = ({"quantization": quantization} if quantization else {}) | {"dtype": dtype}
    runner = ModelRunner.from_pretrained(path, max_num_seqs=batch, decode_plan=plan, **options)
    loaded = peak()
    prompts = [[10 + i + j for j in range(32)] for i in range(batch)]
    runner.generate(prompts, SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True))
    generated = peak()
    model = runner.model
    tensors = {id(t): t for t in model.parameters()}  # tied weights once
    for module in model.modules():  # native linears hold their panels outside the parameters
        tensors.update(
            {id(t): t for t in (getattr(module, "panels", None), getattr(module, "scale", None)) if t is not None}
        )
    held = sum(t.numel() * t.element_size() for t in tensors.values())
    float32 = 4 * sum(p.numel() for p in model.parameters())
    float32 += 4 * sum(m.in_features * m.out_features for m in model.modules() if hasattr(m, "panels"))
    return {
        "start_mib": start,
        "loaded_mib": loaded,
        "generated_mib": generated,
        "held_mib": held / 2**20,
        "float32_weights_mib": float32 / 2**20,
    }


def main() -> int:
    """Build the checkpoint, then measure in a child process."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="granite-4.0-h-1b")
    p.add_argument("--layers", type=int, default=None, help="fewer layers than the preset (same widths)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--quantization", default=None)
    p.add_argument("--no-decode-plan", action="store_true")
    p.add_argument("--dtype", default="auto", help="as the jobs' --dtype (bfloat16 on CPU: bf16 linear weights)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        plan = not args.no_decode_plan
        print(json.dumps(measure(args.child, args.batch, args.new_tokens, args.quantization, plan, args.dtype)))
        return 0
    path = build(args.preset, args.layers)
    command = [
        sys.executable,
        __file__,
        "--child",
        str(path),
        "--batch",
        str(args.batch),
        "--new-tokens",
        str(args.new_tokens),
    ] + (["--quantization", args.quantization] if args.quantization else [])
    command += ["--no-decode-plan"] if args.no_decode_plan else []
    command += ["--dtype", args.dtype]
    out = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    if out.returncode != 0:
        print(out.stderr, file=sys.stderr)
        return out.returncode
    result = json.loads(out.stdout.strip().splitlines()[-1])
    result["peak_over_float32_weights"] = result["generated_mib"] / result["float32_weights_mib"]
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
