"""The router's LoRA bookkeeping (issue 30): what each engine holds, the model list's
adapters and their allow-lists, demand counting, and prefix keys per adapter."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st
from llmgw_router.balancing.prefix import prefix_blocks
from llmgw_router.config import ApiKey
from llmgw_router.endpoints import Endpoint, EndpointSpec
from llmgw_router.lora import (
    LoraBook,
    adapter_entries,
    apply_adapters,
    holders,
    keyed_prompt,
    sglang_adapter_body,
)


def _eps(n: int) -> dict[str, Endpoint]:
    return {
        f"e{i}": Endpoint(EndpointSpec(f"e{i}", f"http://127.0.0.1:{9000 + i}", ("base",)))
        for i in range(n)
    }


def test_load_updates_set_and_a_full_one_forgets_what_it_omits() -> None:
    by_id = _eps(3)
    assert apply_adapters(by_id, [("e0", ["a"]), ("e1", ["a", "b"]), ("gone", ["x"])], False)
    assert holders("a", by_id.values()) == (by_id["e0"], by_id["e1"])
    assert not apply_adapters(by_id, [("e0", ["a"])], False)  # nothing changed
    assert apply_adapters(by_id, [("e1", ["b"])], True)
    assert [ep.adapters for ep in by_id.values()] == [frozenset(), {"b"}, frozenset()]


@given(
    st.lists(st.tuples(st.sampled_from(["e0", "e1", "e2"]), st.frozensets(st.sampled_from("abc"))))
)
def test_the_last_word_on_each_endpoint_wins(updates: list[tuple[str, frozenset[str]]]) -> None:
    by_id = _eps(3)
    for update in updates:
        apply_adapters(by_id, [update], False)
    last = dict(updates)
    for ident, ep in by_id.items():
        assert ep.adapters == last.get(ident, frozenset())


def test_model_list_entries_have_their_parent_and_follow_the_allow_list() -> None:
    key = ApiKey(secret=b"k", name="team", models=frozenset({"sql"}))
    entries = adapter_entries({"sql": "base", "chat": "base"}, key.allows, 7)
    assert entries == [
        {
            "id": "sql",
            "object": "model",
            "created": 7,
            "owned_by": "llmgw",
            "root": "sql",
            "parent": "base",
        }
    ]


def test_demand_is_counted_and_wakes_the_reporter_once_per_report() -> None:
    woken: list[int] = []
    book = LoraBook(wake=lambda: woken.append(1))
    for name in ["a", "a", "b"]:
        book.count(name)
    assert woken == [1]
    assert book.take() == {"a": 2, "b": 1}
    book.count("a")
    assert woken == [1, 1]


def test_prefix_blocks_of_an_adapter_differ_from_the_base_models() -> None:
    text = b"the same long prompt " * 40
    base = prefix_blocks(text, 64, 64)
    sql = prefix_blocks(keyed_prompt("sql", text), 64, 64)
    chat = prefix_blocks(keyed_prompt("chat", text), 64, 64)
    assert not set(base) & set(sql)
    assert not set(sql) & set(chat)


# --- SGLang names the adapter in lora_path -------------------------------------------

_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**53), 2**53) | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=8,
)


def test_sglang_body_carries_the_requests_adapter_and_no_other() -> None:
    body = b'{"model":"sql","prompt":"hi"}'
    assert json.loads(sglang_adapter_body(body, "sql")) == {
        "model": "sql",
        "prompt": "hi",
        "lora_path": "sql",
    }
    # A base model's request goes unchanged when nothing in it can name an adapter ...
    assert sglang_adapter_body(body, "") is body
    # ... and loses a lora_path the client wrote, however it is spelt.
    for sneaky in (
        b'{"model":"base","lora_path":"secret"}',
        b'{"model":"base","lora\\u005fpath":"secret"}',
        b'{"lora_path":"a","model":"base","lora_path":"b"}',
    ):
        assert json.loads(sglang_adapter_body(sneaky, "")) == {"model": "base"}
    # The client's lora_path never replaces the adapter the request was allowed.
    assert json.loads(sglang_adapter_body(b'{"lora_path":"x"}', "sql")) == {"lora_path": "sql"}
    # Not a JSON object: the engine answers it.
    assert sglang_adapter_body(b"[1]", "sql") == b"[1]"
    assert sglang_adapter_body(b"not json", "sql") == b"not json"


@given(
    st.dictionaries(st.text(max_size=10), _JSON, max_size=6), st.sampled_from(["", "sql", "a/b"])
)
def test_sglang_body_is_the_request_with_only_lora_path_changed(
    request: dict[str, object], adapter: str
) -> None:
    out = json.loads(sglang_adapter_body(json.dumps(request).encode(), adapter))
    expected = {k: v for k, v in request.items() if k != "lora_path"}
    if adapter:
        expected["lora_path"] = adapter
    assert out == expected
