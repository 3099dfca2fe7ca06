"""Issue 24.3: engines reachable only through the router.

Each launch carries a secret the engine's port requires (in its environment where the
engine reads one there, so no other local user sees it in ps), and KV events are
published on loopback only.
"""

from __future__ import annotations

import json
import string
import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from llmgw_agent.adapters import (
    LLAMACPP,
    SGLANG,
    VLLM,
    build_launch,
    new_api_key,
    redacted_argv,
    with_api_key,
    with_kv_endpoint,
)
from llmgw_agent.engine_flags import captured
from llmgw_agent.kv_events import loopback_endpoint, loopback_kv_config
from llmgw_agent.output import OutputFollower, file_tail
from llmgw_proto import v1

SPECS = {
    "vllm": captured("vllm", "0.32.0"),
    "sglang": captured("sglang", "0.5.23"),
    "llamacpp": captured("llamacpp", "b11434"),
}
KEY = "s3cr3t-key"


def launch(adapter: Any, start: v1.StartShard) -> Any:
    parsed = SPECS[adapter.name].parse(start.engine_args)
    return build_launch(
        adapter, start, parsed, ["engine"], bind_host="10.0.0.5", endpoint_host="10.0.0.5"
    )


def test_vllm_reads_the_secret_from_its_environment(kit: Any) -> None:
    base = launch(VLLM, kit.make_start())
    keyed = with_api_key(VLLM, base, KEY)
    assert keyed.api_key == KEY
    assert keyed.env["VLLM_API_KEY"] == KEY
    assert keyed.argv == base.argv  # nothing in the command line ps shows
    assert KEY not in " ".join(keyed.argv)
    assert keyed.argv[keyed.argv.index("--host") + 1] == "10.0.0.5"


def test_llamacpp_reads_the_secret_from_its_environment(kit: Any) -> None:
    start = kit.make_start(engine=v1.EngineKind.LLAMACPP, model_ref="/models/m.gguf")
    keyed = with_api_key(LLAMACPP, launch(LLAMACPP, start), KEY)
    assert keyed.env["LLAMA_API_KEY"] == KEY
    assert KEY not in keyed.argv


def test_sglang_takes_the_secret_on_its_command_line(kit: Any) -> None:
    start = kit.make_start(engine=v1.EngineKind.SGLANG)
    base = launch(SGLANG, start)
    keyed = with_api_key(SGLANG, base, KEY)
    assert keyed.argv == [*base.argv, "--api-key", KEY]
    # What the agent logs masks it.
    assert redacted_argv(keyed) == [*base.argv, "--api-key", "***"]


def test_headless_rank_and_no_key_are_left_alone(kit: Any) -> None:
    multi = v1.MultiNode(rank=1, size=2, leader_address="10.0.0.5:29500")
    headless = launch(VLLM, kit.make_start(gpu_indices=[0], multi_node=multi))
    assert with_api_key(VLLM, headless, KEY) == headless
    plain = launch(VLLM, kit.make_start())
    assert with_api_key(VLLM, plain, "") == plain


@pytest.mark.parametrize("adapter", [VLLM, SGLANG, LLAMACPP], ids=lambda a: a.name)
def test_a_profile_may_not_set_the_api_key(adapter: Any) -> None:
    # The agent gives the key; a profile's own would not be the one routers send.
    assert "--api-key" in adapter.reserved


@pytest.mark.parametrize(
    ("given_endpoint", "subscribed"),
    [
        (None, "tcp://127.0.0.1:5557"),  # vLLM's default publishes on tcp://*:5557
        ("tcp://*:5557", "tcp://127.0.0.1:5557"),
        ("tcp://0.0.0.0:6000", "tcp://127.0.0.1:6000"),
        ("tcp://127.0.0.1:5557", "tcp://127.0.0.1:5557"),
    ],
)
def test_kv_events_are_published_on_a_unix_socket(
    kit: Any, given_endpoint: str | None, subscribed: str
) -> None:
    config: dict[str, object] = {"enable_kv_cache_events": True, "publisher": "zmq"}
    if given_endpoint is not None:
        config["endpoint"] = given_endpoint
    start = kit.make_start(engine_args=["--kv-events-config", json.dumps(config)])
    planned = launch(VLLM, start)
    assert planned.kv_events_endpoint == subscribed
    # At launch the agent gives the engine a socket of its own: vLLM binds an ipc://
    # endpoint (a tcp:// one it binds only as a wildcard, on every address of the node).
    launched = with_kv_endpoint(planned, "ipc:///state/kv/s-0.kv")
    sent = json.loads(launched.argv[launched.argv.index("--kv-events-config") + 1])
    assert sent == {**config, "endpoint": "ipc:///state/kv/s-0.kv"}
    assert launched.kv_events_endpoint == "ipc:///state/kv/s-0.kv"


def test_kv_events_on_another_address_are_refused() -> None:
    raw = json.dumps({"enable_kv_cache_events": True, "endpoint": "tcp://10.0.0.5:5557"})
    kept, problem = loopback_kv_config(raw)
    assert kept == raw
    assert "--kv-events-config" in problem
    assert "tcp://10.0.0.5:5557" in problem


_HOSTS = st.sampled_from(["*", "0.0.0.0", "127.0.0.1", "localhost", "[::1]", "[::]", "::"])
_OTHERS = st.ip_addresses(v=4).filter(lambda a: not a.is_loopback and str(a) != "0.0.0.0")


@given(_HOSTS, st.integers(min_value=0, max_value=65535))
def test_wildcard_and_loopback_stay_on_the_node(host: str, port: int) -> None:
    local = loopback_endpoint(f"tcp://{host}:{port}")
    assert local is not None
    assert local.startswith(("tcp://127.0.0.1:", "tcp://localhost:", "tcp://[::1]:"))
    assert local.endswith(f":{port}")


@given(_OTHERS, st.integers(min_value=0, max_value=65535))
def test_other_addresses_are_never_published_on(address: Any, port: int) -> None:
    assert loopback_endpoint(f"tcp://{address}:{port}") is None
    raw = json.dumps({"enable_kv_cache_events": True, "endpoint": f"tcp://{address}:{port}"})
    assert loopback_kv_config(raw)[1]


@given(st.text(max_size=50))
def test_loopback_kv_config_never_raises(raw: str) -> None:
    launched, problem = loopback_kv_config(raw)
    assert isinstance(launched, str)
    assert isinstance(problem, str)


def test_engine_output_never_carries_the_secret(tmp_path: Path) -> None:
    # SGLang prints its server_args, api_key included, at start.
    out = tmp_path / "engine.log"
    out.write_text(f"server_args=ServerArgs(port=30000, api_key='{KEY}')\nready\n")
    follower = OutputFollower(out, "s-0", lines=10, max_bytes=1 << 20, secret=KEY)
    follower.read_more(final=True)
    assert follower.tail(10) == "server_args=ServerArgs(port=30000, api_key='***')\nready"
    adopted = OutputFollower(out, "s-0", lines=10, max_bytes=1 << 20, secret=KEY)
    adopted.refill()
    assert KEY not in adopted.tail(10)
    assert KEY not in file_tail(out, 10, secret=KEY)


_SECRETS = st.text(alphabet=string.ascii_letters + string.digits + "-_", min_size=1, max_size=8)


@given(_SECRETS, st.lists(st.text(alphabet=st.characters(blacklist_characters="\r\n"))))
def test_a_masked_tail_never_holds_the_secret(secret: str, lines: list[str]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "engine.log"
        out.write_text("".join(f"{line}\n" for line in lines), errors="replace")
        assert secret not in file_tail(out, len(lines) + 1, secret=secret)


def test_engine_keys_never_look_like_an_option() -> None:
    # argparse takes a value that begins with "-" for an option: "--api-key -x..." (vLLM,
    # and SGLang's --config file, which it turns into argv) exits with status 2. A
    # base64url key began with "-" once in 64 launches; 10,000 draws catch that.
    keys = {new_api_key() for _ in range(10_000)}
    assert len(keys) == 10_000
    assert all(len(k) >= 32 and k[0].isalnum() and k.isascii() for k in keys)
