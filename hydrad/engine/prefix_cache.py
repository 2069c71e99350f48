"""Digests of a request's KV blocks, for prefix caching (``BlockManager.register``/``lookup``).

Block j of a request holds the KV of its tokens [j * block_size, (j + 1) * block_size).
That KV depends on every token up to the block's end and, where image placeholders lie
among them, on those images' content: the block's digest chains the digest of block
j - 1 with the block's token ids and the digest and offset of every image that overlaps
it (``ImageInput.digest``). Two requests whose blocks have equal digests hold equal KV
in them, whatever else differs. An image whose content is unknown (no digest and no
pixels here) ends the chain: no block from its first placeholder on gets a digest.

BLAKE2b over the bytes, not Python's ``hash``: a block found by a colliding digest would
hand one request another's KV, and a collision must not be something a client can craft.

The image cache (on the image pool of an instance that encodes) is found the same way:
block j of an image's features is registered under a digest of the image's content and j
(``image_block_digests``): the features depend on the image alone, not on where it sits.

The scheduler imports this module: it imports no torch.
"""

from __future__ import annotations

import hashlib
from array import array

from hydrad.engine.request import Request

SEED = b"hydrad-kv-v1"
IMAGE_PERSON = b"hydrad-image-v1"


def chunk_digest(previous: bytes, token_ids: list[int], start: int, images) -> bytes | None:
    """The digest of the tokens at ``start`` (``token_ids``) chained on the digest of all before
    them, with the content and offset of every image they overlap; None where such an image's
    content is unknown. Also what the cache-aware router names prompt chunks by."""
    end = start + len(token_ids)
    h = hashlib.blake2b(previous, digest_size=16)
    h.update(array("q", token_ids).tobytes())
    for image in images:
        if image.offset < end and start < image.offset + image.length:
            content = image.digest()
            if content is None:
                return None
            h.update(content)
            h.update(image.offset.to_bytes(8, "little", signed=True))
    return h.digest()


def block_digests(req: Request, block_size: int, num_blocks: int) -> list[bytes]:
    """The digests of ``req``'s first ``num_blocks`` full blocks (fewer where an image's content
    is unknown), computed once per request and extended as it asks for more."""
    digests = req.block_digests
    while len(digests) < num_blocks and not req.digests_stopped:
        start = len(digests) * block_size
        digest = chunk_digest(digests[-1] if digests else SEED, req.token_ids(start, start + block_size), start,
                              req.images)
        if digest is None:
            req.digests_stopped = True
        else:
            digests.append(digest)
    return digests[:num_blocks]


def image_block_digests(image, num_blocks: int) -> list[bytes] | None:
    """The digests of the ``num_blocks`` image-cache blocks that hold ``image``'s encoded features
    (``ImageInput.digest``: its content and layout); None where its content is unknown."""
    content = image.digest()
    if content is None:
        return None
    return [hashlib.blake2b(content + j.to_bytes(4, "little"), digest_size=16, person=IMAGE_PERSON).digest()
            for j in range(num_blocks)]
