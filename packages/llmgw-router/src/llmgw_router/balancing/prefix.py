"""A request's prompt prefix as chained block hashes, for the cache-aware balancer.

The prompt is what the engine caches by prefix: the chat `messages` in order, or the
completion `prompt`. :func:`prompt_text` makes it the same bytes however a client
serialised the JSON (key order, spacing, escapes): each message's role and text in
order, or the prompt string; anything else (tool calls, images) as its JSON re-encoded
compactly. That text is cut into blocks of ``block_bytes`` bytes. Block ``i``'s hash covers every byte up to the end of block ``i``
(a running CRC-32, tagged with the block's index), so two prompts share block ``i``'s
hash exactly when they share their first ``i + 1`` blocks. The hashes are the same in
every process and on every machine, which lets several routers agree on a prefix's
endpoint without talking to each other.

A prompt shorter than one block is one (partial) block.
"""

from __future__ import annotations

import zlib

import msgspec

__all__ = ["prefix_blocks", "prompt_text"]

_decode = msgspec.json.decode
_encode = msgspec.json.encode


def _part(value: object) -> bytes:
    if isinstance(value, str):
        return value.encode()
    # Text parts by their text; anything else (an image, a tool call) as compact JSON
    # with sorted keys, which every client's serialisation of it decodes to.
    if isinstance(value, list):
        return b"\x1e".join(_part(v) for v in value)
    if isinstance(value, dict):
        if value.get("type") == "text" and isinstance(value.get("text"), str):
            return str(value["text"]).encode()
        return _encode(dict(sorted(value.items())))
    return _encode(value)


def prompt_text(raw: bytes, chat: bool) -> bytes:
    """The prompt as bytes that do not depend on how the client serialised its JSON:
    chat messages as role and content in order, a completion prompt as its text. The
    raw bytes as given when they do not decode (the engine will refuse them anyway)."""
    try:
        value = _decode(raw)
    except (msgspec.DecodeError, RecursionError):
        return raw
    if chat and isinstance(value, list):
        out = []
        for message in value:
            if isinstance(message, dict):
                rest = {k: v for k, v in message.items() if k not in ("role", "content")}
                role = message.get("role")
                out.append(_part(role if isinstance(role, str) else ""))
                out.append(_part(message.get("content")))
                if rest:
                    out.append(_part(rest))
            else:
                out.append(_part(message))
        return b"".join(part + b"\x1f" for part in out)
    return _part(value)


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
