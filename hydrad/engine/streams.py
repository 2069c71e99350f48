"""Dual streams: vision work and language work of one step, at the same time.

On CPU the two run on two executor threads (torch kernels release the GIL); on
CUDA each thread issues its kernels on its own CUDA stream. This is the only
place that knows the difference. Off (the default on a CPU), a step runs its vision
work, then its language work, on the step thread.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, TypeVar

import torch

T = TypeVar("T")
U = TypeVar("U")


def _timed(fn: Callable[[], T]) -> tuple[T, float]:
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


class StageStreams:
    def __init__(self, device: torch.device, enabled: bool):
        self.device = device
        self.enabled = enabled
        self._vision_pool = ThreadPoolExecutor(1, thread_name_prefix="hydrad-vision") if enabled else None
        if enabled and device.type == "cuda":
            self._vision_stream = torch.cuda.Stream(device)
            self._language_stream = torch.cuda.Stream(device)
        else:
            self._vision_stream = self._language_stream = None

    def _on_stream(self, fn: Callable[[], T], stream) -> Callable[[], T]:
        if stream is None:
            return fn

        def run() -> T:
            with torch.cuda.stream(stream):
                result = fn()
            stream.synchronize()
            return result

        return run

    def run(self, vision: Callable[[], T] | None, language: Callable[[], U] | None):
        """Run both (either may be None); return ((vision_result, secs), (language_result, secs)).
        Not enabled, vision runs first, then language, on this thread: the language work may
        read what the vision work wrote (``Scheduler.prefill_after_encode``)."""
        idle = (None, 0.0)
        if vision is None or language is None or not self.enabled:
            return (_timed(vision) if vision else idle), (_timed(language) if language else idle)
        future = self._vision_pool.submit(_timed, self._on_stream(vision, self._vision_stream))
        language_out = _timed(self._on_stream(language, self._language_stream))
        return future.result(), language_out

    def shutdown(self) -> None:
        if self._vision_pool is not None:
            self._vision_pool.shutdown(wait=True)
