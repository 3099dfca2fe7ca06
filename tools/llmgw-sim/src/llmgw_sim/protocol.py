"""Validation of OpenAI-style request bodies into small plain records.

Every rejection is a :class:`BadRequest` whose message names the offending
field, so clients get a 400 that says what to fix.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec


class BadRequest(Exception):
    """A request the engine answers with 400; the message names the field."""


@dataclass(frozen=True)
class Generation:
    endpoint: str  # "chat" or "completion"
    model: str | None
    prompt_text: str
    prompt_ids: list[int] | None
    max_tokens: int | None
    stream: bool
    include_usage: bool
    continuous_usage: bool
    ignore_eos: bool = False
    # The request's `seed` (sampling is greedy here; the seed still picks the text).
    seed: int | None = None
    # The LoRA adapter that serves it (None: the base model), as the engine reads it
    # (Engine.adapter_for).
    adapter: str | None = None


@dataclass(frozen=True)
class EmbeddingReq:
    model: str | None
    inputs: list[str | list[int]]
    encoding_format: str
    dimensions: int | None


def decode_body(raw: bytes) -> dict[str, Any]:
    if not raw:
        raise BadRequest("Request body is empty; expected a JSON object")
    try:
        body = msgspec.json.decode(raw)
    except msgspec.DecodeError as err:
        raise BadRequest(f"Request body is not valid JSON: {err}") from None
    if not isinstance(body, dict):
        raise BadRequest("Request body must be a JSON object")
    return body


def _opt_str(body: dict[str, Any], key: str) -> str | None:
    value = body.get(key)
    if value is None or isinstance(value, str):
        return value
    raise BadRequest(f"'{key}' must be a string")


def _opt_bool(body: dict[str, Any], key: str, default: bool = False) -> bool:
    value = body.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise BadRequest(f"'{key}' must be a boolean")
    return value


def _opt_int(body: dict[str, Any], key: str, minimum: int) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest(f"'{key}' must be an integer")
    if value < minimum:
        raise BadRequest(f"'{key}' must be at least {minimum}, got {value}")
    return value


def _opt_number(body: dict[str, Any], key: str, lo: float, hi: float) -> None:
    value = body.get(key)
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise BadRequest(f"'{key}' must be a number")
    if not lo <= value <= hi:
        raise BadRequest(f"'{key}' must be between {lo} and {hi}, got {value}")


def _common(body: dict[str, Any]) -> tuple[bool, bool, bool]:
    stream = _opt_bool(body, "stream")
    opts = body.get("stream_options")
    include_usage = continuous = False
    if opts is not None:
        if not isinstance(opts, dict):
            raise BadRequest("'stream_options' must be an object")
        if not stream:
            raise BadRequest("Stream options can only be defined when `stream=True`.")
        include_usage = _opt_bool(opts, "include_usage")
        continuous = _opt_bool(opts, "continuous_usage_stats")
    n = _opt_int(body, "n", 1)
    if n is not None and n != 1:
        raise BadRequest("'n' > 1 is not supported by the simulator")
    _opt_number(body, "temperature", 0.0, 2.0)
    _opt_number(body, "top_p", 0.0, 1.0)
    _opt_number(body, "presence_penalty", -2.0, 2.0)
    _opt_number(body, "frequency_penalty", -2.0, 2.0)
    return stream, include_usage, continuous


def _content_text(content: object, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts: list[str] = []
        for i, part in enumerate(content):
            if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                raise BadRequest(f"{where}.content[{i}] must be an object with a 'type'")
            if part["type"] == "text":
                text = part.get("text")
                if not isinstance(text, str):
                    raise BadRequest(f"{where}.content[{i}].text must be a string")
                parts.append(text)
            # Images and other parts cost no text tokens in the simulation.
        return "\n".join(parts)
    raise BadRequest(f"{where}.content must be a string or a list of content parts")


def parse_chat(body: dict[str, Any], *, prefill_assistant: bool = False) -> Generation:
    """A chat request, rendered by the simulator's own template (``<|role|>\\ncontent\\n``
    per message, then ``<|assistant|>\\n`` to start the answer).

    ``continue_final_message: true`` (vLLM, SGLang) leaves the final message open: its
    text ends the prompt, with no end of turn and no new assistant turn, so the answer
    continues it; vLLM refuses it together with ``add_generation_prompt: true``, and a
    final message without content. ``prefill_assistant`` (llama-server, whose default
    this is) continues a final assistant message the same way, unasked.
    """
    model = _opt_str(body, "model")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list")
    continue_final = _opt_bool(body, "continue_final_message")
    add_generation = _opt_bool(body, "add_generation_prompt", True)
    if continue_final and body.get("add_generation_prompt") is True:
        raise BadRequest(
            "Cannot set both `continue_final_message` and `add_generation_prompt` to True."
        )
    pieces: list[str] = []
    last = len(messages) - 1
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise BadRequest(f"messages[{i}] must be an object")
        role = msg.get("role")
        if not isinstance(role, str) or not role:
            raise BadRequest(f"messages[{i}].role must be a non-empty string")
        text = _content_text(msg.get("content"), f"messages[{i}]")
        if i == last and prefill_assistant and role == "assistant" and not continue_final:
            # llama-server: a final assistant message is the start of the answer.
            continue_final, add_generation = True, False
        if i == last and continue_final:
            if msg.get("content") is None:
                raise BadRequest(
                    f'messages[{i}]: continue_final_message is set but the final message has no "content" to continue!'
                )
            pieces.append(f"<|{role}|>\n{text}")
        else:
            pieces.append(f"<|{role}|>\n{text}\n")
    if add_generation and not continue_final:
        pieces.append("<|assistant|>\n")
    max_tokens = _opt_int(body, "max_completion_tokens", 1)
    if max_tokens is None:
        max_tokens = _opt_int(body, "max_tokens", 1)
    stream, include_usage, continuous = _common(body)
    return Generation(
        "chat",
        model,
        "".join(pieces),
        None,
        max_tokens,
        stream,
        include_usage,
        continuous,
        _opt_bool(body, "ignore_eos"),
        _opt_int(body, "seed", -(1 << 63)),
    )


def parse_completion(body: dict[str, Any]) -> Generation:
    model = _opt_str(body, "model")
    prompt = body.get("prompt")
    text = ""
    ids: list[int] | None = None
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        text = prompt
    elif isinstance(prompt, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in prompt
    ):
        ids = list(prompt)
    elif isinstance(prompt, list) and prompt:
        raise BadRequest("batched prompts (a list of several prompts) are not supported")
    else:
        raise BadRequest("'prompt' must be a string or a list of token ids")
    if ids is not None and not ids:
        raise BadRequest("'prompt' must not be empty")
    # The OpenAI completions API (and vLLM) default max_tokens to 16.
    max_tokens = _opt_int(body, "max_tokens", 1)
    if "max_tokens" not in body:
        max_tokens = 16
    stream, include_usage, continuous = _common(body)
    return Generation(
        "completion",
        model,
        text,
        ids,
        max_tokens,
        stream,
        include_usage,
        continuous,
        _opt_bool(body, "ignore_eos"),
        _opt_int(body, "seed", -(1 << 63)),
    )


def parse_tokenize(body: dict[str, Any]) -> tuple[str | None, str | list[int]]:
    """vLLM's /tokenize: a completion-style prompt or chat messages."""
    if "messages" in body:
        gen = parse_chat({**body, "stream": False, "stream_options": None})
        return gen.model, gen.prompt_text
    gen = parse_completion({**body, "stream": False, "stream_options": None})
    return gen.model, gen.prompt_ids if gen.prompt_ids is not None else gen.prompt_text


def parse_embedding(body: dict[str, Any]) -> EmbeddingReq:
    model = _opt_str(body, "model")
    raw = body.get("input")
    inputs: list[str | list[int]]
    if isinstance(raw, str):
        inputs = [raw]
    elif isinstance(raw, list) and raw and all(isinstance(x, str) for x in raw):
        inputs = list(raw)
    elif (
        isinstance(raw, list)
        and raw
        and all(isinstance(x, int) and not isinstance(x, bool) for x in raw)
    ):
        inputs = [list(raw)]
    elif isinstance(raw, list) and raw and all(isinstance(x, list) for x in raw):
        inputs = [list(x) for x in raw]
    else:
        raise BadRequest("'input' must be a string, a list of strings, or token ids")
    fmt = _opt_str(body, "encoding_format") or "float"
    if fmt not in ("float", "base64"):
        raise BadRequest("'encoding_format' must be 'float' or 'base64'")
    dims = _opt_int(body, "dimensions", 1)
    return EmbeddingReq(model, inputs, fmt, dims)
