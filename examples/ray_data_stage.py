"""A hybridgen stage in a Ray Data pipeline: questions in, the model's answers added as columns.

    python examples/ray_data_stage.py [MODEL_DIR_OR_REPO_ID]

Without an argument it uses quickstart's tiny random checkpoint (saved to output/tiny-granite-4.0-h on first use),
so it runs offline on CPU; the text is random. Docs: docs/ray-data.md.
"""

from __future__ import annotations

import sys
from pathlib import Path

import ray

from pipeline import HybridgenProcessorConfig, build_processor


def main() -> None:
    """Build the processor, apply it to a small dataset and print a few output rows."""
    if len(sys.argv) > 1:
        model = sys.argv[1]
    else:
        from quickstart import build_tiny_checkpoint  # examples/, the script's own directory

        directory = Path("output/tiny-granite-4.0-h")
        model = str(directory if (directory / "config.json").exists() else build_tiny_checkpoint(directory))
    ray.init()
    config = HybridgenProcessorConfig(
        model_source=model,
        engine_kwargs={"device": "auto", "max_num_seqs": 16, "max_model_len": 256},
        sampling_params={"temperature": 0.8, "top_p": 0.95, "max_tokens": 16, "seed": 0},
        index_column="id",  # a seeded row samples with seed + its id, as row `id` of the generate job does
        concurrency=(1, 2),  # an autoscaling pool of 1 to 2 actors, each holding one model
        batch_size=8,
    )
    processor = build_processor(
        config,
        preprocess=lambda row: {**row, "prompt": f"the {row['animal']} sat on the"},
        postprocess=lambda row: {"id": row["id"], "answer": row["generated_text"], "error": row["error"]},
    )
    animals = ["cat", "dog"] * 16
    dataset = ray.data.from_items([{"id": i, "animal": animal} for i, animal in enumerate(animals)])
    for row in processor(dataset).sort("id").take(4):
        print(row)


if __name__ == "__main__":
    main()
