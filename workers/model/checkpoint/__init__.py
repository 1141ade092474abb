"""From a hub checkpoint to a loaded model. `config.py` holds `HybridConfig`, the one architecture description the
layers read, and `weights.py` the `Source` each parameter is read from; what differs between families (Granite
4.0-H and Bamba, Nemotron-H, the Qwen Gated DeltaNet hybrids, attention-only models) lives in `families/`, one
module each with its config reader and weight map, which register themselves in `registry.py` (the core looks them
up there and never imports a family). `loader.py` resolves the directory, builds the model and fills it.
"""
