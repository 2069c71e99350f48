"""Paged block pools: the KV cache (tokens) and the image cache (image-token slots).

Both are a fixed pool of equal blocks handed out by id; a request holds a list of
block ids per cached thing. The pools themselves (tensors) live in the runner; this
module only does the bookkeeping, so it imports no torch and is tested on its own.

A pool can also keep what its blocks hold for later requests (prefix caching, on the KV
pool of an instance that prefills): a full block whose content is known is ``register``ed
under a digest of that content (``hydrad.engine.prefix_cache``); ``lookup`` finds the
longest run of registered blocks for a list of digests, and ``acquire`` takes them for a
request, so several requests may hold one block (each holder is counted). A registered
block that no request holds any more stays registered, and counts as free: ``allocate``
takes never-registered blocks first, then the least recently released registered ones,
forgetting their content.
"""

from __future__ import annotations

from collections import OrderedDict, deque


class BlockManager:
    """A free list over ``num_blocks`` blocks of ``block_size`` slots each."""

    def __init__(self, num_blocks: int, block_size: int, name: str = "blocks"):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"{name}: num_blocks and block_size must be >= 1")
        self.name = name
        self.num_blocks = num_blocks
        self.block_size = block_size
        # Blocks that hold nothing anyone can find.
        self._free: deque[int] = deque(range(num_blocks))
        # Held blocks and how many holders each has.
        self._refs: dict[int, int] = {}
        # Registered blocks: digest -> block and back.
        self._by_digest: dict[bytes, int] = {}
        self._digest: dict[int, bytes] = {}
        # Registered blocks nobody holds, least recently released first (taken by ``allocate``
        # once ``_free`` is empty).
        self._evictable: OrderedDict[int, None] = OrderedDict()

    # -- sizes -------------------------------------------------------------------
    def num_blocks_for(self, num_slots: int) -> int:
        return -(-num_slots // self.block_size)

    @property
    def num_free_blocks(self) -> int:
        """Blocks ``allocate`` can hand out: free ones and registered ones nobody holds."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        return len(self._refs)

    @property
    def num_cached_blocks(self) -> int:
        """Registered blocks, held or not."""
        return len(self._digest)

    @property
    def usage(self) -> float:
        return len(self._refs) / self.num_blocks

    # -- allocation ----------------------------------------------------------------
    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free) + len(self._evictable)

    def allocate(self, num_blocks: int) -> list[int]:
        free, evictable = self._free, self._evictable
        if num_blocks > len(free) + len(evictable):
            raise RuntimeError(f"{self.name}: asked for {num_blocks} blocks, {self.num_free_blocks} free")
        refs = self._refs
        block_ids = []
        for _ in range(num_blocks):
            if free:
                block_id = free.popleft()
            else:
                block_id, _ = evictable.popitem(last=False)
                del self._by_digest[self._digest.pop(block_id)]
            refs[block_id] = 1
            block_ids.append(block_id)
        return block_ids

    def free(self, block_ids: list[int]) -> None:
        """Release one hold on each block. A registered block nobody holds any more stays
        findable until ``allocate`` needs it; the blocks of a list are kept in reverse, so that
        the end of a prefix goes before its start."""
        refs, digest = self._refs, self._digest
        released = []
        for block_id in block_ids:
            count = refs.get(block_id)
            if count is None:
                raise RuntimeError(f"{self.name}: block {block_id} freed but not allocated")
            if count > 1:
                refs[block_id] = count - 1
                continue
            del refs[block_id]
            if block_id in digest:
                released.append(block_id)
            else:
                self._free.append(block_id)
        for block_id in reversed(released):
            self._evictable[block_id] = None

    def grow(self, block_ids: list[int], num_slots: int) -> bool:
        """Extend ``block_ids`` in place to hold ``num_slots``; False (and no change) if short."""
        needed = self.num_blocks_for(num_slots) - len(block_ids)
        if needed <= 0:
            return True
        if not self.can_allocate(needed):
            return False
        block_ids.extend(self.allocate(needed))
        return True

    # -- prefix caching --------------------------------------------------------------
    def register(self, block_id: int, digest: bytes) -> bool:
        """Make the held block ``block_id`` findable under ``digest`` (its content is complete
        and will not change). False when the digest already names a block (the same content
        computed twice: the first stays) or the block is registered already."""
        if block_id not in self._refs:
            raise RuntimeError(f"{self.name}: block {block_id} registered but not allocated")
        if digest in self._by_digest or block_id in self._digest:
            return False
        self._by_digest[digest] = block_id
        self._digest[block_id] = digest
        return True

    def lookup(self, digests: list[bytes]) -> list[int]:
        """The registered blocks of the longest prefix of ``digests`` (not taken)."""
        found = []
        by_digest = self._by_digest
        for digest in digests:
            block_id = by_digest.get(digest)
            if block_id is None:
                break
            found.append(block_id)
        return found

    def num_unheld(self, block_ids: list[int]) -> int:
        """How many of these registered blocks nobody holds (``acquire`` takes them off the free count)."""
        refs = self._refs
        return sum(1 for block_id in block_ids if block_id not in refs)

    def acquire(self, block_ids: list[int]) -> None:
        """Take a hold on registered blocks ``lookup`` found (another holder may have them)."""
        refs, evictable = self._refs, self._evictable
        for block_id in block_ids:
            if block_id not in self._digest:
                raise RuntimeError(f"{self.name}: block {block_id} acquired but not registered")
            count = refs.get(block_id)
            if count is None:
                del evictable[block_id]
                refs[block_id] = 1
            else:
                refs[block_id] = count + 1

    # -- checking ------------------------------------------------------------------
    def check_integrity(self, held: list[list[int]] | None = None) -> None:
        """Raise if the free list, the registered blocks and the held ones disagree, or if
        ``held`` (every block list owned by a live request) does not account for exactly
        the holds on each held block."""
        free, evictable, refs = list(self._free), list(self._evictable), self._refs
        if len(free) != len(set(free)):
            raise AssertionError(f"{self.name}: a block is on the free list twice")
        if set(free) & refs.keys() or set(evictable) & refs.keys() or set(free) & set(evictable):
            raise AssertionError(f"{self.name}: a block is both free and used")
        if len(free) + len(evictable) + len(refs) != self.num_blocks:
            raise AssertionError(f"{self.name}: {self.num_blocks - len(free) - len(evictable) - len(refs)} "
                                 "blocks lost")
        if any(count < 1 for count in refs.values()):
            raise AssertionError(f"{self.name}: a held block has no holder")
        if {b: d for d, b in self._by_digest.items()} != self._digest:
            raise AssertionError(f"{self.name}: the registered blocks' two maps disagree")
        if set(free) & self._digest.keys() or not set(evictable) <= self._digest.keys():
            raise AssertionError(f"{self.name}: a free block is registered, or a released one is not")
        if held is not None:
            counts: dict[int, int] = {}
            for ids in held:
                if len(ids) != len(set(ids)):
                    raise AssertionError(f"{self.name}: an owner holds a block twice")
                for b in ids:
                    counts[b] = counts.get(b, 0) + 1
            shared = sorted(b for b, count in counts.items() if count > 1 and b not in self._digest)
            if shared:
                raise AssertionError(f"{self.name}: block {shared[0]} is held by two owners but not registered")
            if counts != refs:
                leaked = sorted(refs.keys() - counts.keys())
                unknown = sorted(counts.keys() - refs.keys())
                miscounted = sorted(b for b in counts.keys() & refs.keys() if counts[b] != refs[b])
                raise AssertionError(f"{self.name}: leaked {leaked[:8]}, held but not allocated {unknown[:8]}, "
                                     f"holders miscounted {miscounted[:8]}")
