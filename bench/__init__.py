"""Benchmark code, kept out of the runtime packages: `generation` (random-weight presets, prompts, timing, the
roofline, tables), `job_throughput` (shards streamed through one worker) and `driver_bookkeeping` (the driver's
shard bookkeeping at scale). `jobs/benchmark.py` and the scripts in `benchmarks/` run them."""
