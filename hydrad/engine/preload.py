"""What a worker imports before it can build its engine, imported once in the fork server.

Workers are forked from a server process that has imported this module
(``hydrad.cluster.launch``), so a new worker starts with torch, the engine, every model
family and transformers' configuration classes already loaded: building its engine then
takes a fraction of a second instead of seconds of imports per worker. Importing it must
not initialise CUDA or run a parallel torch operation (a forked child could not use
either); it only imports, then freezes what it imported (below).
"""

from __future__ import annotations

import gc

import safetensors  # noqa: F401
import torch  # noqa: F401
from transformers import AutoConfig  # noqa: F401
from transformers.models.llava import configuration_llava  # noqa: F401
from transformers.models.llava_next import configuration_llava_next  # noqa: F401
from transformers.models.qwen2_5_vl import configuration_qwen2_5_vl  # noqa: F401
from transformers.models.qwen2_vl import configuration_qwen2_vl  # noqa: F401

import hydrad.engine.core  # noqa: F401
import hydrad.engine.profiler  # noqa: F401
import hydrad.engine.worker  # noqa: F401
from hydrad.models import registry

for _module, _cls in registry.MODELS.values():
    __import__(_module)

# What the server imported lives as long as every worker forked from it. Collected once and
# frozen here, before any fork, it is in each worker's permanent generation: the worker's
# collections never scan it, so they neither take the time nor write to the pages it shares
# with the server (copy on write). The worker freezes its own start-up heap when ready.
gc.collect()
gc.freeze()
