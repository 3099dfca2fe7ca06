"""A non-streamed answer that may be resumed (issue 28), apart from I/O.

A non-streamed chat or text completion comes whole at the end: an engine that dies
mid-generation used to cost the whole generation. When the request is one
:func:`~llmgw_router.proxy.resume.refusal` would resume as a stream, the router asks
the engine for a stream instead (:func:`streamed_request`: ``stream: true``,
``stream_options: {include_usage: true}``), relays it through the resumable relay
(whose continuation events are already rewritten into one stream: one id and created
time, usage over the whole answer), and :class:`Answer` gathers those events into the
one JSON answer the client asked for: ``id``, ``object``, ``created``, ``model``,
``choices[0]`` (``message`` with ``role`` and ``content``, or ``text``;
``finish_reason`` and the finish chunk's other fields such as ``logprobs`` and vLLM's
``stop_reason``),
the chunks' other top-level fields (``system_fingerprint``: null when no chunk had
one) and ``usage``. A stream that ends with an error event becomes an error answer in
OpenAI's shape (502).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec

from llmgw_router.errors import error_body
from llmgw_router.proxy.resume import CHAT_PATH, COMPLETIONS_PATH, refusal

__all__ = ["Answer", "streamed_request"]

# Fields a non-streamed request keeps as it is (not gathered): `stream_options` is an
# error without `stream` (vLLM answers 400; the client should get that answer), and a
# tool call would have to be assembled from its deltas (it is never resumed anyway).
_KEPT_AS_IS = ("stream_options", "tools", "functions")
# Per-chunk fields that say nothing about the answer as a whole.
_CHUNK_ONLY = frozenset({"id", "object", "created", "model", "choices", "usage", "error"})
_CHOICE_OWN = frozenset({"index", "delta", "text", "finish_reason"})
# Reasoning deltas, gathered into the message under the engine's own name.
_REASONING = ("reasoning_content", "reasoning")


def streamed_request(path: str, body: bytes) -> bytes | None:
    """The streamed request that stands in for a non-streamed ``body`` so that a break
    after the first byte can be resumed; None when the request goes as it is (streamed
    already, another route, unreadable, or one a break could not resume)."""
    if path not in (CHAT_PATH, COMPLETIONS_PATH):
        return None
    try:
        request = msgspec.json.decode(body)
    except (msgspec.DecodeError, RecursionError):
        return None
    if not isinstance(request, dict) or request.get("stream") not in (None, False):
        return None
    if any(request.get(name) is not None for name in _KEPT_AS_IS):
        return None
    request["stream"] = True
    request["stream_options"] = {"include_usage": True}
    streamed = msgspec.json.encode(request)
    return streamed if refusal(path, streamed) is None else None


class _PieceDelta(msgspec.Struct):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None


class _PieceChoice(msgspec.Struct):
    index: int = 0
    delta: _PieceDelta | None = None
    text: str | None = None
    finish_reason: str | None = None


class _Piece(msgspec.Struct):
    """The fields of an event in the middle of a stream; others are skipped."""

    choices: list[_PieceChoice] = msgspec.field(default_factory=list)
    usage: Any = None
    error: Any = None


_decode_piece = msgspec.json.Decoder(_Piece).decode


def _plain(piece: _Piece) -> bool:
    """A piece of text only: no usage, no error, no end, no new role."""
    if piece.usage is not None or piece.error is not None:
        return False
    for choice in piece.choices:
        if choice.finish_reason is not None:
            return False
        if choice.delta is not None and choice.delta.role:
            return False
    return True


def _data(event: bytes) -> bytes | None:
    for line in event.split(b"\n"):
        if line.startswith(b"data:"):
            payload = line[5:].strip()
            return payload if payload.startswith(b"{") else None
    return None


@dataclass(slots=True)
class Answer:
    """The events of one (spliced) stream, gathered into a non-streamed answer."""

    chat: bool
    top: dict[str, Any] = field(default_factory=dict)
    role: str = "assistant"
    text: list[str] = field(default_factory=list)
    reasoning: dict[str, list[str]] = field(default_factory=dict)
    finish_reason: str | None = None
    choice: dict[str, Any] = field(default_factory=dict)
    usage: Any = None
    # The error answer, once an error event came.
    error: bytes | None = None

    def feed(self, event: bytes) -> None:
        """One whole SSE event (comments and ``[DONE]`` are passed over)."""
        payload = _data(event)
        if payload is None:
            return
        if self.top:
            # Most events are one piece of text: read as such, without a dict per event.
            try:
                piece = _decode_piece(payload)
            except msgspec.DecodeError:
                piece = None
            if piece is not None and _plain(piece):
                for choice in piece.choices:
                    delta = choice.delta
                    if choice.index != 0:
                        continue
                    if delta is None:
                        if choice.text:
                            self.text.append(choice.text)
                        continue
                    if delta.content:
                        self.text.append(delta.content)
                    if delta.reasoning_content:
                        self.reasoning.setdefault("reasoning_content", []).append(
                            delta.reasoning_content
                        )
                    if delta.reasoning:
                        self.reasoning.setdefault("reasoning", []).append(delta.reasoning)
                return
        self._feed_whole(payload)

    def _feed_whole(self, payload: bytes) -> None:
        """An event read whole: the first, the answer's end, usage, an error."""
        try:
            chunk = msgspec.json.decode(payload)
        except msgspec.DecodeError:
            self.error = self.error or _error("the engine sent an event the router cannot read")
            return
        if not isinstance(chunk, dict):
            return
        if chunk.get("error") is not None:
            self.error = self.error or msgspec.json.encode({"error": chunk["error"]})
            return
        for name, value in chunk.items():
            if name == "usage":
                if value is not None:
                    self.usage = value
            elif name in ("id", "created"):
                # The client's stream's: the first attempt's (a continuation's events
                # carry them rewritten).
                self.top.setdefault(name, value)
            elif name not in ("choices", "object") and (value is not None or name not in self.top):
                self.top[name] = value
        for choice in chunk.get("choices") or ():
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta")
            if isinstance(delta, dict):
                if isinstance(delta.get("role"), str) and delta["role"]:
                    self.role = delta["role"]
                if isinstance(delta.get("content"), str):
                    self.text.append(delta["content"])
                for name in _REASONING:
                    if isinstance(delta.get(name), str):
                        self.reasoning.setdefault(name, []).append(delta[name])
            elif isinstance(choice.get("text"), str):
                self.text.append(choice["text"])
            if choice.get("finish_reason") is not None:
                self.finish_reason = choice["finish_reason"]
                for name, value in choice.items():
                    if name not in _CHOICE_OWN:
                        self.choice[name] = value

    def result(self) -> tuple[int, bytes]:
        """The answer: (200, the JSON answer), or (502, an OpenAI-shaped error)."""
        if self.error is not None:
            return 502, self.error
        if "id" not in self.top:
            return 502, _error("the engine's stream ended before its first event")
        text = "".join(self.text)
        first: dict[str, Any] = {"index": 0}
        if self.chat:
            message: dict[str, Any] = {"role": self.role, "content": text}
            for name, parts in self.reasoning.items():
                message[name] = "".join(parts)
            first["message"] = message
        else:
            first["text"] = text
        # `logprobs` (null: a request with logprobs is not gathered) and the end chunk's
        # other fields, where the engine's chunks carry them (llama-server's chat
        # chunks, like its own answer, have none).
        first.update({k: v for k, v in self.choice.items() if k == "logprobs"})
        first["finish_reason"] = self.finish_reason
        first.update(self.choice)
        top = dict(self.top)
        answer: dict[str, Any] = {
            "id": top.pop("id"),
            "object": "chat.completion" if self.chat else "text_completion",
            "created": top.pop("created", 0),
            "model": top.pop("model", None),
            "choices": [first],
            "system_fingerprint": top.pop("system_fingerprint", None),
            **top,
        }
        if self.usage is not None:
            answer["usage"] = self.usage
        return 200, msgspec.json.encode(answer)


def _error(message: str) -> bytes:
    return error_body(message, "upstream_error", None, "upstream_error")
