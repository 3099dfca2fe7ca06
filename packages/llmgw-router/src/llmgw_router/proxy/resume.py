"""Resuming a broken generation, apart from I/O (issue 28): what may be resumed, the
request that continues it, and the stream spliced so the client sees one.

When an engine fails after the first byte of a streamed chat or text completion, the
router sends the request again, to another replica, with the text the client already
has: a completion's prompt followed by it; a chat's messages followed by an assistant
message holding it, continued rather than started (``continue_final_message: true,
add_generation_prompt: false``: vLLM and SGLang; llama-server continues a final
assistant message by itself and ignores the two fields). ``max_tokens`` (and
``max_completion_tokens``, ``min_tokens``) shrink by the tokens already produced;
every other field is kept.

:func:`refusal` says from the request alone why it could not be resumed faithfully;
:class:`Splice` follows the stream (the text and tokens so far, the id and created
time, what makes it unresumable on the way) and rewrites a continuation's events
into the client's one stream; :func:`continuation` builds the continuing request;
:func:`decide` says whether to resume.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import msgspec

__all__ = [
    "CHAT_PATH",
    "COMPLETIONS_PATH",
    "Decision",
    "Splice",
    "continuation",
    "decide",
    "refusal",
    "split_events",
]

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"

# Request fields whose output a continuation cannot reproduce: constrained decoding
# restarts its grammar at the continuation's first token; logprobs of the text so far
# would be of its re-tokenization, not of the tokens the client got.
_STRUCTURED = (
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "structured_outputs",
    "json_schema",
    "grammar",
)


class _ResponseFormat(msgspec.Struct):
    type: str = "text"


class _Message(msgspec.Struct):
    role: str = ""
    content: msgspec.Raw = msgspec.Raw(b"null")


class _Facts(msgspec.Struct):
    """The fields :func:`refusal` reads; the rest of the body is skipped unparsed."""

    stream: bool = False
    n: int | None = None
    best_of: int | None = None
    logprobs: msgspec.Raw = msgspec.Raw(b"null")
    top_logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    response_format: _ResponseFormat | None = None
    prompt: msgspec.Raw = msgspec.Raw(b"null")
    messages: msgspec.Raw = msgspec.Raw(b"null")
    continue_final_message: bool = False
    guided_json: msgspec.Raw = msgspec.Raw(b"null")
    guided_regex: msgspec.Raw = msgspec.Raw(b"null")
    guided_choice: msgspec.Raw = msgspec.Raw(b"null")
    guided_grammar: msgspec.Raw = msgspec.Raw(b"null")
    structured_outputs: msgspec.Raw = msgspec.Raw(b"null")
    json_schema: msgspec.Raw = msgspec.Raw(b"null")
    grammar: msgspec.Raw = msgspec.Raw(b"null")


_decode_facts = msgspec.json.Decoder(_Facts).decode
_decode_messages = msgspec.json.Decoder(list[_Message] | None).decode
_NULLS = (b"null", b"false", b"0", b"")


def _set(raw: msgspec.Raw) -> bool:
    return bytes(raw).strip() not in _NULLS


def refusal(path: str, body: bytes) -> str | None:
    """Why a broken answer to this request could not be resumed faithfully; None when
    it can. Read from the request alone (each reason is a metric label and a line of
    the router README)."""
    if path not in (CHAT_PATH, COMPLETIONS_PATH):
        return "route"
    try:
        facts = _decode_facts(body)
    except (msgspec.DecodeError, RecursionError):
        return "body"
    if not facts.stream:
        return "not_streamed"
    if (facts.n or 1) != 1 or (facts.best_of or 1) != 1:
        return "n"
    if _set(facts.logprobs) or facts.top_logprobs:
        return "logprobs"
    if facts.echo:
        return "echo"
    if facts.suffix:
        return "suffix"
    if facts.response_format is not None and facts.response_format.type != "text":
        return "structured_output"
    if any(_set(getattr(facts, name)) for name in _STRUCTURED):
        return "structured_output"
    if path == COMPLETIONS_PATH:
        raw = bytes(facts.prompt).strip()
        # One prompt, as text: a list of token ids cannot have text appended.
        if not (raw.startswith(b'"') or (raw.startswith(b'["') and _one_string(raw))):
            return "prompt_not_text"
    else:
        try:
            messages = _decode_messages(facts.messages)
        except msgspec.DecodeError:
            return "body"
        last = messages[-1] if messages else None
        if facts.continue_final_message:
            # The client's own prefill: its text must be a string to append to.
            if last is None or not bytes(last.content).strip().startswith(b'"'):
                return "content_parts"
        elif last is not None and last.role == "assistant":
            # A final assistant message the client did not mark: vLLM and SGLang take it
            # as a finished turn, llama-server as the start of the answer (a prefill).
            # Which one the answer continues depends on the engine: not resumed.
            return "final_assistant"
    return None


def _one_string(raw: bytes) -> bool:
    try:
        value = msgspec.json.decode(raw)
    except msgspec.DecodeError:
        return False
    return isinstance(value, list) and len(value) == 1 and isinstance(value[0], str)


class Decision(enum.Enum):
    RESUME = "resume"
    DONE = "done"  # the answer was already whole: end the stream
    RESUMES_SPENT = "resumes_spent"
    DEADLINE = "deadline"
    UNRESUMABLE = "unresumable"


def decide(
    *, max_resumes: int, resumes: int, now: float, deadline: float, finished: bool, why_not: str
) -> Decision:
    """After a stream broke: end it (it was whole), resume it, or give up (and why)."""
    if finished:
        return Decision.DONE
    if why_not:
        return Decision.UNRESUMABLE
    if resumes >= max_resumes:
        return Decision.RESUMES_SPENT
    if now >= deadline:
        return Decision.DEADLINE
    return Decision.RESUME


def continuation(path: str, body: bytes, text: str, tokens: int) -> bytes:
    """The request that continues ``body``'s answer after ``text`` (``tokens`` tokens)."""
    request: dict[str, Any] = msgspec.json.decode(body)
    if text:
        if path == COMPLETIONS_PATH:
            prompt = request["prompt"]
            request["prompt"] = (prompt[0] if isinstance(prompt, list) else prompt) + text
        else:
            messages = list(request["messages"])
            if request.get("continue_final_message"):
                # The client's own prefill, continued: the text follows it.
                last = dict(messages[-1])
                last["content"] = (last.get("content") or "") + text
                messages[-1] = last
            else:
                messages.append({"role": "assistant", "content": text})
            request["messages"] = messages
            request["continue_final_message"] = True
            request["add_generation_prompt"] = False
    if tokens:
        for name in ("max_tokens", "max_completion_tokens"):
            value = request.get(name)
            if isinstance(value, int) and not isinstance(value, bool):
                request[name] = max(1, value - tokens)
        if path == COMPLETIONS_PATH and request.get("max_tokens") is None:
            # The completions API's default, 16, shrinks too.
            request["max_tokens"] = max(1, 16 - tokens)
        min_tokens = request.get("min_tokens")
        if isinstance(min_tokens, int) and not isinstance(min_tokens, bool) and min_tokens:
            request["min_tokens"] = max(0, min_tokens - tokens)
    return msgspec.json.encode(request)


def split_events(buffer: bytes) -> tuple[list[bytes], bytes]:
    """Whole SSE events (each with its blank line) and the unfinished rest."""
    end = buffer.rfind(b"\n\n")
    if end < 0:
        return [], buffer
    whole, rest = buffer[: end + 2], buffer[end + 2 :]
    return [event + b"\n\n" for event in whole[:-2].split(b"\n\n")], rest


class _Delta(msgspec.Struct):
    role: str | None = None
    content: str | None = None
    tool_calls: msgspec.Raw = msgspec.Raw(b"null")
    function_call: msgspec.Raw = msgspec.Raw(b"null")
    reasoning_content: str | None = None
    reasoning: str | None = None


class _Choice(msgspec.Struct):
    index: int = 0
    delta: _Delta | None = None
    text: str | None = None
    finish_reason: str | None = None


class _Usage(msgspec.Struct):
    prompt_tokens: int = 0
    completion_tokens: int = 0


class _Chunk(msgspec.Struct):
    id: str = ""
    created: int = 0
    choices: list[_Choice] = msgspec.field(default_factory=list)
    usage: _Usage | None = None
    error: msgspec.Raw = msgspec.Raw(b"null")


_decode_chunk = msgspec.json.Decoder(_Chunk).decode
# A stream's events are kept unread up to this many bytes (about 250 tokens of chat).
FOLD_AT = 64 * 1024


def _data(event: bytes) -> bytes | None:
    """The JSON of an event's `data:` line; None for `[DONE]`, comments and the like."""
    for line in event.split(b"\n"):
        if line.startswith(b"data:"):
            payload = line[5:].strip()
            return payload if payload.startswith(b"{") else None
    return None


@dataclass(slots=True)
class Splice:
    """One client stream over its attempts: what it holds so far, and the rewriting of
    a continuation's events into it."""

    # The client's stream: its id and created time (the first attempt's).
    id: str = ""
    created: int = 0
    text: str = ""
    # Completion tokens the client got: running usage where the stream carries it, else
    # one per chunk with text (what vLLM, SGLang and llama-server send by default).
    tokens: int = 0
    # The client's prompt tokens, once an engine's usage told (the first attempt's
    # running usage; else a continuation's prompt less the tokens it was given).
    prompt_tokens: int | None = None
    finished: bool = False
    # The client's response has begun (the first attempt's head went out).
    started: bool = False
    # Why the stream can no longer be resumed (a tool call begun, reasoning, an error).
    why_not: str = ""
    # Attempts resumed so far; the tokens the current attempt was given.
    resumes: int = 0
    offset: int = 0
    done_sent: bool = False
    usage: tuple[int, int] | None = field(default=None)
    # The first attempt's events passed on but not followed yet (:meth:`feed`).
    pending: bytearray = field(default_factory=bytearray)

    def feed(self, events: bytes) -> None:
        """The first attempt's whole events, as passed on: followed only when a break
        needs them (:meth:`fold`) or past ``FOLD_AT`` bytes, so a stream that ends well
        costs a copy, not a decode per event."""
        self.pending += events
        if len(self.pending) > FOLD_AT:
            self.fold()

    def fold(self) -> None:
        """Follow the events fed so far."""
        if self.pending:
            data = bytes(self.pending)
            self.pending.clear()
            for event in data.split(b"\n\n"):
                if event.strip():
                    self.observe(event)

    def observe(self, event: bytes) -> None:
        """Follow one of the first attempt's events (passed on as it is)."""
        payload = _data(event)
        if payload is None:
            if b"[DONE]" in event:
                self.done_sent = True
            return
        try:
            chunk = _decode_chunk(payload)
        except msgspec.DecodeError:
            self.why_not = self.why_not or "unreadable_event"
            return
        if not self.id:
            self.id, self.created = chunk.id, chunk.created
        self._follow(chunk)

    def _follow(self, chunk: _Chunk) -> None:
        if _set(chunk.error):
            self.why_not = self.why_not or "engine_error"
        counted = False
        for choice in chunk.choices:
            if choice.index != 0:
                self.why_not = self.why_not or "n"
                continue
            piece = choice.text
            delta = choice.delta
            if delta is not None:
                piece = delta.content
                if _set(delta.tool_calls) or _set(delta.function_call):
                    self.why_not = self.why_not or "tool_call"
                if delta.reasoning_content or delta.reasoning:
                    self.why_not = self.why_not or "reasoning"
            if piece:
                self.text += piece
                counted = True
            if choice.finish_reason is not None:
                self.finished = True
        usage = chunk.usage
        if usage is not None:
            self.tokens = self.offset + usage.completion_tokens
            if self.prompt_tokens is None:
                self.prompt_tokens = max(0, usage.prompt_tokens - self.offset)
            self.usage = (self.prompt_tokens, self.tokens)
        elif counted:
            self.tokens += 1

    def resumed(self) -> None:
        """A continuation is about to be sent: its tokens count after those so far."""
        self.resumes += 1
        self.offset = self.tokens

    def rewrite(self, event: bytes) -> bytes:
        """One of a continuation's events as the client's stream goes on: its id and
        created time, no second role, usage counted over the whole answer. Empty when
        nothing of it is for the client (the continuation's role chunk)."""
        payload = _data(event)
        if payload is None:
            if b"[DONE]" in event:
                self.done_sent = True
            return event
        try:
            chunk = _decode_chunk(payload)
            raw: dict[str, Any] = msgspec.json.decode(payload)
        except msgspec.DecodeError:
            self.why_not = self.why_not or "unreadable_event"
            return event
        self._follow(chunk)
        if "id" in raw:
            raw["id"] = self.id
        if "created" in raw:
            raw["created"] = self.created
        keep = False
        for choice in raw.get("choices") or ():
            delta = choice.get("delta")
            if isinstance(delta, dict):
                delta.pop("role", None)
                if any(v not in (None, "") for v in delta.values()):
                    keep = True
            elif choice.get("text") not in (None, ""):
                keep = True
            if choice.get("finish_reason") is not None:
                keep = True
        usage = raw.get("usage")
        if isinstance(usage, dict) and self.usage is not None:
            prompt, completion = self.usage
            usage["prompt_tokens"], usage["completion_tokens"] = prompt, completion
            usage["total_tokens"] = prompt + completion
            keep = True
        if not keep and raw.get("choices"):
            return b""
        return b"data: " + msgspec.json.encode(raw) + b"\n\n"
