"""The Request Processor's cache of preprocessed images, by the file they were decoded from.

A conversation resends its image with every turn, and a request's ``n`` completions or
another question about the same picture send it again: decoding it and running the image
processor costs the daemon milliseconds of CPU each time (a 640x480 JPEG for LLaVA-1.5:
about 5 ms, most of a chat turn's processing), on the cores the workers compute on. The
cache keeps the processor's output for each image file it saw last (its pixels, layout and
content digest: an ``ImageInput`` with no placement), up to a byte budget of pixels, and
a request whose image file is found takes that instead of decoding it again.

Images are keyed by a digest of their file's bytes alone: the processor, the model and the
limits it checks images against are fixed for the life of one ``InputProcessor``, which
owns its cache. Images sent as objects (PIL) have no file and are not cached.

The cache holds its own copy of each image's pixels, in the daemon's private memory, and
each request that finds one gets a copy of it (a memory copy: a tenth of a millisecond for
LLaVA-1.5's 1.3 MiB, against milliseconds to decode and process the file). A request's
pixels go to shared memory when it is sent to a worker, each shared tensor holding a file
descriptor open for its life: cached tensors shared that way would hold one each, and a
cache of small images would run the daemon out of descriptors.
"""

from __future__ import annotations

import dataclasses
import hashlib
import threading
from collections import OrderedDict

from hydrad.models.inputs import ImageInput


def file_key(data: bytes) -> bytes:
    """The cache key of an image file (and the source of its content digest)."""
    return hashlib.blake2b(data, digest_size=16, person=b"hydrad-image").digest()


class ProcessedImages:
    """Least recently used preprocessed images, at most ``capacity_bytes`` of pixels in all
    (0: none kept). Safe to use from the processing threads at once."""

    def __init__(self, capacity_bytes: int):
        self.capacity_bytes = capacity_bytes
        self._entries: OrderedDict[bytes, ImageInput] = OrderedDict()
        self._lock = threading.Lock()
        self.num_bytes = 0
        # Images looked up: found (not decoded nor processed again), and not found.
        self.num_found = 0
        self.num_missed = 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: bytes) -> ImageInput | None:
        """A copy of the image kept under ``key`` (its pixels copied, no placement), or None
        (and nothing counted while the cache keeps nothing)."""
        if not self.capacity_bytes:
            return None
        with self._lock:
            image = self._entries.get(key)
            if image is None:
                self.num_missed += 1
                return None
            self._entries.move_to_end(key)
            self.num_found += 1
        return dataclasses.replace(image, pixel_values=image.pixel_values.clone())

    def put(self, key: bytes, image: ImageInput) -> None:
        """Keep a copy of ``image`` (just processed) under ``key``, evicting the least recently
        used past the budget. The copy holds the image's own bytes only (a row of the
        processor's batch tensor would hold the whole batch)."""
        nbytes = _nbytes(image)
        if nbytes > self.capacity_bytes:
            return
        kept = dataclasses.replace(image, offset=-1, pixel_values=image.pixel_values.clone())
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self.num_bytes -= _nbytes(old)
            self._entries[key] = kept
            self.num_bytes += nbytes
            while self.num_bytes > self.capacity_bytes:
                _, evicted = self._entries.popitem(last=False)
                self.num_bytes -= _nbytes(evicted)


def _nbytes(image: ImageInput) -> int:
    return image.pixel_values.numel() * image.pixel_values.element_size()
