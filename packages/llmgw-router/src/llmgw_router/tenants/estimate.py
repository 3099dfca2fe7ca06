"""The tokens a request reserves at admission: its prompt's, plus the completion's bound.

The prompt's tokens are counted by the model's tokenizer where the router has one
(``cache_aware.tokenizers``; the precise balancer has counted them already, otherwise
they are counted here), and estimated from the body's size (:data:`BYTES_PER_TOKEN`)
where it has none or the prompt does not render. The completion's bound is the body's
``max_completion_tokens``, else ``max_tokens``, else the configured default. The parse
stage has read both bounds from the body already (:class:`RequestHead`); the body is
decoded again only for a route whose head does not carry them.
"""

from __future__ import annotations

from typing import Any, Protocol

import msgspec

__all__ = ["BYTES_PER_TOKEN", "completion_bound", "count_prompt", "estimate_tokens"]

# Bytes of a request body per prompt token, for the estimate reserved at admission
# (an over-estimate for English text: a reservation errs on the safe side).
BYTES_PER_TOKEN = 4


class _Bounds(msgspec.Struct):
    max_tokens: Any = None
    max_completion_tokens: Any = None


class _Prompt(msgspec.Struct):
    messages: Any = None
    prompt: Any = None


_decode_bounds = msgspec.json.Decoder(_Bounds).decode
_decode_prompt = msgspec.json.Decoder(_Prompt).decode


class _Tokenizer(Protocol):
    async def chat_async(self, messages: object) -> Any: ...

    async def completion_async(self, prompt: object) -> Any: ...


def _count(value: object) -> int | None:
    # A JSON integer >= 0 (bool is not one); anything else is not a bound.
    if type(value) is int and value >= 0:
        return value
    return None


def completion_bound(max_completion_tokens: object, max_tokens: object, default: int) -> int:
    """The completion's bound: max_completion_tokens, else max_tokens, else ``default``
    (a value that is not a count of tokens is as if absent: the engine refuses it)."""
    bound = _count(max_completion_tokens)
    if bound is None:
        bound = _count(max_tokens)
    return default if bound is None else bound


def estimate_tokens(
    body: bytes, default_max_tokens: int, *, head: Any = None, prompt_tokens: int | None = None
) -> int:
    """Prompt tokens (``prompt_tokens`` when counted, else from the body's size) plus the
    completion's bound (from ``head``'s max_tokens fields when given, else the body's)."""
    if head is None:
        try:
            head = _decode_bounds(body)
        except (msgspec.DecodeError, RecursionError):
            head = _Bounds()
    # completion_bound, inline (every admitted request of a limited key passes here).
    completion = head.max_completion_tokens
    if type(completion) is not int or completion < 0:
        completion = head.max_tokens
        if type(completion) is not int or completion < 0:
            completion = default_max_tokens
    prompt = len(body) // BYTES_PER_TOKEN if prompt_tokens is None else prompt_tokens
    return prompt + completion


async def count_prompt(tokenizer: _Tokenizer, body: bytes) -> int | None:
    """The prompt's tokens as the model's tokenizer counts them; None when the body has
    no prompt it renders (the estimate from the body's size stands)."""
    try:
        found = _decode_prompt(body)
    except (msgspec.DecodeError, RecursionError):
        return None
    if found.messages is not None:
        tokens = await tokenizer.chat_async(found.messages)
    elif found.prompt is not None:
        tokens = await tokenizer.completion_async(found.prompt)
    else:
        return None
    return None if tokens is None else len(tokens)
