"""Token blocks: the one hash an engine's cached prompt blocks and a router's request share.

An engine caches a prompt's KV in blocks of ``block_size`` tokens and names each block by
its own hash: vLLM's is sha256 or xxhash of the pickled or CBOR ``(parent, tokens, extra
keys)``, seeded by a ``NONE_HASH`` drawn from ``os.urandom`` in every engine process, so no
other process can compute it. Its ``BlockStored`` events carry each block's token ids as
well, so the agent names every cached block again with this function, and a router that
tokenizes a request's prompt as the engine does names the prompt's blocks with it too: the
two meet on the token ids alone, without the engine's hash function or seed.

Block ``i`` of a prompt is ``blake2b-64(h(i-1) || tokens of block i)``, the tokens as
little-endian unsigned 32-bit integers, ``h(-1)`` the root: 0, or for a LoRA adapter's
blocks the hash of its name (its KV differs from the base model's). The hash chains, so
block ``i`` matches exactly when the first ``i + 1`` blocks do.
"""

from __future__ import annotations

import hashlib
import struct
import sys
from array import array
from collections.abc import Sequence

__all__ = ["block_hash", "root", "token_block_hashes"]

# An array("I") holds little-endian unsigned 32-bit integers here, the bytes hashed.
_NATIVE_U32 = sys.byteorder == "little" and array("I").itemsize == 4


def root(lora_name: str | None = None) -> int:
    """The chain's start: 0 for the base model, else the adapter name's hash."""
    if not lora_name:
        return 0
    digest = hashlib.blake2b(b"lora\x00" + lora_name.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def block_hash(parent: int, tokens: Sequence[int]) -> int:
    """The hash of one full block of ``tokens`` after the block hashed ``parent``."""
    h = hashlib.blake2b(parent.to_bytes(8, "big"), digest_size=8)
    if isinstance(tokens, array) and tokens.typecode == "I" and _NATIVE_U32:
        # The same bytes without an int object per token (a router's prompt tokens).
        h.update(tokens.tobytes())
    else:
        h.update(struct.pack(f"<{len(tokens)}I", *tokens))
    return int.from_bytes(h.digest(), "big")


def token_block_hashes(
    tokens: Sequence[int], block_size: int, *, parent: int = 0, max_blocks: int | None = None
) -> list[int]:
    """The chained hashes of the full blocks of ``tokens`` (a partial last block has none)."""
    if block_size <= 0:
        return []
    full = len(tokens) // block_size
    if max_blocks is not None:
        full = min(full, max_blocks)
    out = []
    for i in range(full):
        parent = block_hash(parent, tokens[i * block_size : (i + 1) * block_size])
        out.append(parent)
    return out
