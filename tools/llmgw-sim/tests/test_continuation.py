"""Exact continuation (issue 28 point 2): the text is a function of the prompt, so a
request that carries the first part of an answer gets exactly the rest of it, for chat
(vLLM's `continue_final_message`, llama-server's prefilled final assistant message) and
for completions; and what vLLM refuses is refused."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from llmgw_sim.protocol import parse_chat
from llmgw_sim.testing import Sim, start

MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Tell me about the sea."},
]


@pytest.fixture(scope="module")
def vllm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sim]:
    with start(tmp_path_factory.mktemp("vllm"), "vllm", ["--served-model-name", "m"]) as sim:
        yield sim


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sim]:
    with start(
        tmp_path_factory.mktemp("llama"), "llama-server", ["-m", "/models/m.gguf", "--alias", "m"]
    ) as sim:
        yield sim


def _chat(client: httpx.Client, sim: Sim, **body: Any) -> str:
    r = client.post(sim.url + "/v1/chat/completions", json={"model": "m", **body})
    assert r.status_code == 200, r.text
    content = r.json()["choices"][0]["message"]["content"]
    assert isinstance(content, str)
    return content


def _streamed_chat(client: httpx.Client, sim: Sim, **body: Any) -> str:
    text = []
    with client.stream(
        "POST", sim.url + "/v1/chat/completions", json={"model": "m", "stream": True, **body}
    ) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    text.append(choice["delta"].get("content") or "")
    return "".join(text)


def _words(text: str, k: int) -> str:
    """The first k generated tokens (each a word with its leading space)."""
    return "".join(" " + w for w in text.split(" ")[1 : k + 1])


def test_chat_continued_final_message_gives_the_rest(vllm: Sim, client: httpx.Client) -> None:
    whole = _chat(client, vllm, messages=MESSAGES, max_tokens=20)
    assert whole == _streamed_chat(client, vllm, messages=MESSAGES, max_tokens=20)
    for k in (1, 7, 19):
        head = _words(whole, k)
        rest = _chat(
            client,
            vllm,
            messages=[*MESSAGES, {"role": "assistant", "content": head}],
            continue_final_message=True,
            add_generation_prompt=False,
            max_tokens=20 - k,
        )
        assert head + rest == whole
        streamed = _streamed_chat(
            client,
            vllm,
            messages=[*MESSAGES, {"role": "assistant", "content": head}],
            continue_final_message=True,
            add_generation_prompt=False,
            max_tokens=20 - k,
        )
        assert head + streamed == whole
    # Without continue_final_message the assistant message is a finished turn: a new answer.
    new_turn = _chat(
        client,
        vllm,
        messages=[*MESSAGES, {"role": "assistant", "content": _words(whole, 7)}],
        max_tokens=13,
    )
    assert _words(whole, 7) + new_turn != whole


def test_completion_prompt_plus_text_gives_the_rest(vllm: Sim, client: httpx.Client) -> None:
    def complete(prompt: str, n: int) -> str:
        r = client.post(
            vllm.url + "/v1/completions", json={"model": "m", "prompt": prompt, "max_tokens": n}
        )
        assert r.status_code == 200, r.text
        text = r.json()["choices"][0]["text"]
        assert isinstance(text, str)
        return text

    whole = complete("Once upon a time", 30)
    head = _words(whole, 11)
    assert head + complete("Once upon a time" + head, 19) == whole


def test_seed_changes_the_text(vllm: Sim, client: httpx.Client) -> None:
    a = _chat(client, vllm, messages=MESSAGES, max_tokens=12, seed=1)
    assert a == _chat(client, vllm, messages=MESSAGES, max_tokens=12, seed=1)
    assert a != _chat(client, vllm, messages=MESSAGES, max_tokens=12, seed=2)


def test_refused_as_vllm_refuses(vllm: Sim, client: httpx.Client) -> None:
    both = {
        "model": "m",
        "messages": [*MESSAGES, {"role": "assistant", "content": " the"}],
        "continue_final_message": True,
        "add_generation_prompt": True,
    }
    r = client.post(vllm.url + "/v1/chat/completions", json=both)
    assert r.status_code == 400
    assert "Cannot set both `continue_final_message` and `add_generation_prompt`" in r.text
    no_content = {
        "model": "m",
        "messages": [*MESSAGES, {"role": "assistant", "content": None}],
        "continue_final_message": True,
        "add_generation_prompt": False,
    }
    r = client.post(vllm.url + "/v1/chat/completions", json=no_content)
    assert r.status_code == 400
    message = r.json()["error"]["message"]
    assert message.startswith("messages[2]: continue_final_message is set")
    assert 'no "content" to continue' in message


def test_llama_server_continues_a_final_assistant_message(llama: Sim, client: httpx.Client) -> None:
    whole = _chat(client, llama, messages=MESSAGES, max_tokens=16)
    head = _words(whole, 5)
    rest = _chat(
        client, llama, messages=[*MESSAGES, {"role": "assistant", "content": head}], max_tokens=11
    )
    assert head + rest == whole


@settings(max_examples=200, deadline=None)
@given(
    turns=st.lists(
        st.tuples(st.sampled_from(["system", "user", "assistant"]), st.text(max_size=30)),
        min_size=1,
        max_size=4,
    ),
    text=st.text(max_size=30),
    llama=st.booleans(),
)
def test_a_continued_final_message_renders_the_prompt_followed_by_its_text(
    turns: list[tuple[str, str]], text: str, llama: bool
) -> None:
    """The prompt of a continuation is the original prompt and the text so far, so the
    greedy text goes on exactly: vLLM's continue_final_message, llama-server's prefill."""
    # llama-server takes a final assistant message as a prefill already (the router does
    # not resume such a chat: resume.py's `final_assistant`).
    assume(not (llama and turns[-1][0] == "assistant"))
    messages = [{"role": role, "content": content} for role, content in turns]
    whole = parse_chat({"messages": messages}, prefill_assistant=llama).prompt_text
    final = {"role": "assistant", "content": text}
    flags = {} if llama else {"continue_final_message": True, "add_generation_prompt": False}
    continued = parse_chat(
        {"messages": [*messages, final], **flags}, prefill_assistant=llama
    ).prompt_text
    assert continued == whole + text
