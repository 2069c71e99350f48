"""The garbage collector in a serving process.

A process that imported torch and transformers and loaded a model holds some 400,000
objects that live as long as it does. Python's full collections scan them all (160-310 ms
in the daemon here) whenever enough new objects have survived into the oldest generation: in the daemon, that
stalls every stream's tokens at once; in a worker, a step. ``freeze_startup_heap`` collects
once when start-up is over and moves what is alive then into the collector's permanent
generation (``gc.freeze``), so that later collections scan only what serving allocates.
"""

from __future__ import annotations

import gc
import logging
import time


def freeze_startup_heap(logger: logging.Logger) -> int:
    """Collect, then freeze what is alive; returns how many objects were frozen. Call once
    the process is ready to serve (objects allocated before are never collected after)."""
    start = time.perf_counter()
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    logger.info("froze the start-up heap (%d objects, %.0f ms): full collections skip it", frozen,
                (time.perf_counter() - start) * 1e3)
    return frozen
