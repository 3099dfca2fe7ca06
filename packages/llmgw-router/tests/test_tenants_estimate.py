"""The tokens a request reserves at admission (tenants/estimate.py): the completion's
bound as the body gives it, the prompt counted by the model's tokenizer where the router
has one (cache_aware.tokenizers), the body's bytes / 4 otherwise."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st
from llmgw_router.config import ApiKey, CacheAwareConfig, RouterConfig
from llmgw_router.endpoints import EndpointSet
from llmgw_router.metrics import Metrics
from llmgw_router.proxy.parse import parse_head
from llmgw_router.state import RouterState
from llmgw_router.tenants.estimate import BYTES_PER_TOKEN, completion_bound, estimate_tokens
from llmgw_router.tenants.gate import Tenancy
from llmgw_router.tenants.limits import KeyLimits
from llmgw_testkit.tokenizer import write_word_tokenizer

_json = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.floats(allow_nan=False)
    | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3),
    max_leaves=6,
)  # fmt: skip


@given(a=_json, b=_json, default=st.integers(0, 10_000))
def test_the_bound_is_a_count_of_tokens_or_the_default(a: Any, b: Any, default: int) -> None:
    bound = completion_bound(a, b, default)
    assert bound >= 0
    counts = [v for v in (a, b) if type(v) is int and v >= 0]
    assert bound == (counts[0] if counts else default)


@given(
    body=st.fixed_dictionaries(
        {"model": st.just("m")},
        optional={"max_tokens": _json, "max_completion_tokens": _json, "messages": _json},
    )
)
def test_the_parse_stages_head_gives_what_the_body_gives(body: dict[str, Any]) -> None:
    raw = msgspec.json.encode(body)
    head = parse_head(raw, False)
    assert estimate_tokens(raw, 99, head=head) == estimate_tokens(raw, 99)


def test_examples() -> None:
    body = b'{"model": "m", "max_tokens": 7, "max_completion_tokens": 5}'
    assert estimate_tokens(body, 256) == len(body) // BYTES_PER_TOKEN + 5
    assert estimate_tokens(body, 256, prompt_tokens=3) == 3 + 5
    assert estimate_tokens(b'{"max_tokens": "9"}', 16) == 19 // 4 + 16
    assert estimate_tokens(b"[[[[", 16) == 1 + 16


def _tenancy(tmp_path: Path, with_tokenizer: bool) -> Tenancy:
    folder = write_word_tokenizer(tmp_path / "tok", ["hello", "there", "world"])
    tokenizers = {"m": str(folder)} if with_tokenizer else {}
    config = RouterConfig(cache_aware=CacheAwareConfig(tokenizers=tokenizers))
    state = RouterState(config, EndpointSet((), source="static"), Metrics())
    return Tenancy(state, config.tenants)


@pytest.mark.parametrize("with_tokenizer", [True, False])
async def test_the_prompt_is_counted_by_the_models_tokenizer(
    tmp_path: Path, with_tokenizer: bool
) -> None:
    tenancy = _tenancy(tmp_path, with_tokenizer)
    key = ApiKey(b"k", "a", frozenset(), limits=KeyLimits(tpm=1_000_000))
    words = "hello there world " * 50
    body = msgspec.json.encode(
        {"model": "m", "messages": [{"role": "user", "content": words}], "max_tokens": 10}
    )
    ticket = await tenancy.admit(key, "m", (), body, parse_head(body, False))
    assert ticket.reservation is not None
    if with_tokenizer:
        tokenizer = tenancy.state.tokenizer("m")
        assert tokenizer is not None
        rendered = tokenizer.chat([{"role": "user", "content": words}])
        assert rendered is not None
        # 150 words and the template's few tokens, far below bytes / 4.
        assert ticket.reservation.tokens == len(rendered) + 10
        assert len(rendered) < len(body) // BYTES_PER_TOKEN
    else:
        assert ticket.reservation.tokens == len(body) // BYTES_PER_TOKEN + 10
    # A model without a tokenizer, or a prompt that does not render: bytes / 4.
    other = body.replace(b'"m"', b'"x"')
    ticket = await tenancy.admit(key, "x", (), other, parse_head(other, False))
    assert ticket.reservation is not None
    assert ticket.reservation.tokens == len(other) // BYTES_PER_TOKEN + 10
