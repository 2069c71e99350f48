"""Paged block pools: the KV cache (tokens) and the image cache (image-token slots).

Both are a fixed pool of equal blocks handed out by id; a request holds a list of
block ids per cached thing. The pools themselves (tensors) live in the runner; this
module only does the bookkeeping, so it imports no torch and is tested on its own.
"""

from __future__ import annotations

from collections import deque


class BlockManager:
    """A free list over ``num_blocks`` blocks of ``block_size`` slots each."""

    def __init__(self, num_blocks: int, block_size: int, name: str = "blocks"):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"{name}: num_blocks and block_size must be >= 1")
        self.name = name
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._used: set[int] = set()

    # -- sizes -------------------------------------------------------------------
    def num_blocks_for(self, num_slots: int) -> int:
        return -(-num_slots // self.block_size)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return len(self._used)

    @property
    def usage(self) -> float:
        return len(self._used) / self.num_blocks

    # -- allocation ----------------------------------------------------------------
    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free)

    def allocate(self, num_blocks: int) -> list[int]:
        if num_blocks > len(self._free):
            raise RuntimeError(f"{self.name}: asked for {num_blocks} blocks, {len(self._free)} free")
        block_ids = [self._free.popleft() for _ in range(num_blocks)]
        self._used.update(block_ids)
        return block_ids

    def free(self, block_ids: list[int]) -> None:
        for block_id in block_ids:
            if block_id not in self._used:
                raise RuntimeError(f"{self.name}: block {block_id} freed but not allocated")
            self._used.remove(block_id)
            self._free.append(block_id)

    def grow(self, block_ids: list[int], num_slots: int) -> bool:
        """Extend ``block_ids`` in place to hold ``num_slots``; False (and no change) if short."""
        needed = self.num_blocks_for(num_slots) - len(block_ids)
        if needed <= 0:
            return True
        if not self.can_allocate(needed):
            return False
        block_ids.extend(self.allocate(needed))
        return True

    # -- checking ------------------------------------------------------------------
    def check_integrity(self, held: list[list[int]] | None = None) -> None:
        """Raise if the free list and the used set disagree, or if ``held`` (every block
        list owned by a live request) is not exactly the used set, each block once."""
        free = list(self._free)
        if len(free) != len(set(free)):
            raise AssertionError(f"{self.name}: a block is on the free list twice")
        if set(free) & self._used:
            raise AssertionError(f"{self.name}: a block is both free and used")
        if len(free) + len(self._used) != self.num_blocks:
            raise AssertionError(f"{self.name}: {self.num_blocks - len(free) - len(self._used)} blocks lost")
        if held is not None:
            flat = [b for ids in held for b in ids]
            if len(flat) != len(set(flat)):
                raise AssertionError(f"{self.name}: a block is held by two owners")
            if set(flat) != self._used:
                leaked = sorted(self._used - set(flat))
                unknown = sorted(set(flat) - self._used)
                raise AssertionError(f"{self.name}: leaked {leaked[:8]}, held but not allocated {unknown[:8]}")
