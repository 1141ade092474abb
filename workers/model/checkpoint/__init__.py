"""From a hub checkpoint to a loaded model: `config.py` reads every family's `config.json` into `HybridConfig`,
the one architecture description the layers read; `weights.py` maps each of the model's parameters to the
checkpoint tensors it is read from; `loader.py` resolves the directory, builds the model and fills it.
"""
