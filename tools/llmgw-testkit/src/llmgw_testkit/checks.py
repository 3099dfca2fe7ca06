"""Checks several test suites make the same way: stream a chat with usage through an
OpenAI-compatible endpoint (the simulator, a router, a real engine), read one series from a
Prometheus page.

They need the ``openai`` client (in tools/test-requirements.txt); it is imported on use.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Callable

    from openai.types.chat import ChatCompletionChunk
    from openai.types.completion_usage import CompletionUsage

__all__ = ["StreamedChat", "metric", "stream_chat_with_usage"]


@dataclass(frozen=True)
class StreamedChat:
    """One streamed chat completion, as the OpenAI client read it."""

    chunks: list[ChatCompletionChunk]
    usage: CompletionUsage
    """The usage the last chunk carried."""
    deltas: list[str | None] = field(default_factory=list)
    """``delta.content`` of every chunk with a choice, in order (the role chunk's too)."""
    finishes: list[str] = field(default_factory=list)
    """Every ``finish_reason`` set, in order."""

    @property
    def pieces(self) -> list[str]:
        """The non-empty content deltas: one per token where the engine streams per token."""
        return [d for d in self.deltas if d]

    @property
    def text(self) -> str:
        return "".join(self.pieces)


def stream_chat_with_usage(
    url: str,
    model: str,
    *,
    max_tokens: int,
    content: str = "hello",
    api_key: str = "x",
    timeout: float = 60.0,
    expect_tokens: int | None = None,
    on_chunk: Callable[[ChatCompletionChunk], object] | None = None,
    **create: Any,
) -> StreamedChat:
    """Stream ``/v1/chat/completions`` at ``url`` (the server's root) with
    ``stream_options={"include_usage": True}`` and check what every such stream shows:
    every chunk is a ``chat.completion.chunk``, the last one carries the usage, the prompt
    counted at least one token, and ``expect_tokens`` (``max_tokens`` unless given; pass 0
    to skip) completion tokens were counted. ``on_chunk`` sees each chunk as it arrives
    (for a test that acts while the stream runs). ``create`` goes to ``create()`` as it is
    (``temperature``, ``extra_body``...). Returns what was read for the caller's own checks.
    """
    import openai

    with openai.OpenAI(
        base_url=url.rstrip("/") + "/v1", api_key=api_key, max_retries=0, timeout=timeout
    ) as client:
        stream = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": content}],
            max_tokens=max_tokens,
            stream=True,
            stream_options={"include_usage": True},
            **create,
        )
        chunks = []
        for chunk in stream:
            chunks.append(chunk)
            if on_chunk is not None:
                on_chunk(chunk)
    assert chunks, f"{url}: the stream of {model!r} ended without a chunk"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    usage = chunks[-1].usage
    assert usage is not None, f"{url}: the last chunk of {model!r} carries no usage"
    assert usage.prompt_tokens > 0
    expected = max_tokens if expect_tokens is None else expect_tokens
    if expected:
        assert usage.completion_tokens == expected
    deltas = [c.choices[0].delta.content for c in chunks if c.choices]
    finishes = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    return StreamedChat(chunks=chunks, usage=usage, deltas=deltas, finishes=finishes)


def metric(text: str, series: str) -> float:
    """The value of one series in Prometheus text, named with its labels exactly as the page
    writes them (``'name{model="m1"}'``), or 0.0 when the page does not show it."""
    for line in text.splitlines():
        if line.startswith(series + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0
