"""A request's prompt prefix as chained block hashes, for the cache-aware balancer.

The prompt is what the engine caches by prefix: the chat `messages` in order, or the
completion `prompt`. The router does not decode it: it takes the raw JSON text of that
field as the client sent it (msgspec hands it over unparsed) and cuts it into blocks of
``block_bytes`` bytes. Block ``i``'s hash covers every byte up to the end of block ``i``
(a running CRC-32, tagged with the block's index), so two prompts share block ``i``'s
hash exactly when they share their first ``i + 1`` blocks. The hashes are the same in
every process and on every machine, which lets several routers agree on a prefix's
endpoint without talking to each other.

A prompt shorter than one block is one (partial) block. JSON spacing differs between
clients, so prompts match only between requests serialised alike; clients of one
application are.
"""

from __future__ import annotations

import zlib

__all__ = ["prefix_blocks"]


def prefix_blocks(raw: bytes, block_bytes: int, max_blocks: int) -> tuple[int, ...]:
    """Chained hashes of the full ``block_bytes`` blocks of ``raw`` (at most ``max_blocks``)."""
    if not raw:
        return ()
    full = min(len(raw) // block_bytes, max_blocks)
    if full == 0:
        return ((zlib.crc32(raw) << 20) | 0,)
    crc32 = zlib.crc32
    crc = 0
    out = [0] * full
    at = 0
    for i in range(full):
        end = at + block_bytes
        crc = crc32(raw[at:end], crc)
        # The index keeps a block from colliding with a shorter prompt of the same CRC.
        out[i] = (crc << 20) | i
        at = end
    return tuple(out)
