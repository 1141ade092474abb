"""The checkpoint families, one module each: its `config.json` reader, its weight map and, where its MTP heads are
served, their keys. Each registers itself in `registry.py` when this package imports it; the core never imports a
family. A new family is a module here and an import below.
"""

from workers.model.checkpoint import registry

# The order families register in is the order error messages list model types in.
# isort: off
from workers.model.checkpoint.families import granite_bamba  # noqa: F401
from workers.model.checkpoint.families import nemotron_h  # noqa: F401
from workers.model.checkpoint.families import qwen  # noqa: F401
from workers.model.checkpoint.families import olmo_hybrid  # noqa: F401
from workers.model.checkpoint.families import dense  # noqa: F401
from workers.model.checkpoint.families import zamba2  # noqa: F401
from workers.model.checkpoint.families import jamba  # noqa: F401
from workers.model.checkpoint.families import lfm2  # noqa: F401
from workers.model.checkpoint.families import kimi_linear  # noqa: F401
from workers.model.checkpoint.families import falcon_h1  # noqa: F401

# isort: on

SUPPORTED_MODEL_TYPES = registry.model_types()
MTP_MODEL_TYPES = registry.mtp_model_types()  # the model types whose multi-token-prediction heads are served
