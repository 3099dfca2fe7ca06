"""KV-cache events over ZMQ in vLLM 0.32's format, read by the agent's own decoder."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import httpx
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st
from llmgw_agent.kv_events import CacheView, decode_events
from llmgw_sim.kvevents import binds
from llmgw_sim.testing import Sim, engine_argv, run_to_exit, start
from llmgw_testkit import free_port, wait_for

SYSTEM = " ".join(f"w{i}" for i in range(100))  # a 100-token prompt head: 6 full blocks+


def _config(port: int) -> str:
    return json.dumps(
        {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{port}",
            "topic": "kv",
        }
    )


def _chat(sim: Sim, system: str, user: str) -> int:
    body = {
        "model": "org/model",
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
        "max_tokens": 2,
    }
    r = httpx.post(sim.url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text
    return int(r.json()["usage"]["prompt_tokens"])


def test_stored_and_evicted_blocks_reach_a_subscriber(tmp_path: Path) -> None:
    port = free_port()
    # 24 blocks: two different 100-token prompts cannot both stay cached.
    args = ["--sim-scheduler", "step", "--num-gpu-blocks-override", "12",
            "--max-model-len", "190", "--kv-events-config", _config(port)]  # fmt: skip
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    sub.setsockopt(zmq.LINGER, 0)
    try:
        with start(tmp_path, "vllm", args) as sim:
            sub.connect(f"tcp://127.0.0.1:{port}")
            stored: list[int] = []
            removed: list[int] = []
            seqs: list[int] = []
            view = CacheView()  # the agent's view of the engine, across batches

            def receive() -> bool:
                while sub.poll(0):
                    topic, seq, payload = sub.recv_multipart()
                    assert topic == b"kv"
                    seqs.append(int.from_bytes(seq, "big"))
                    delta = view.apply(decode_events(payload))
                    assert delta.block_size in (0, 16)
                    stored.extend(delta.stored)
                    removed.extend(delta.removed)
                return bool(removed)

            # A subscriber joins a PUB socket asynchronously: send until events flow.
            def first_events() -> bool:
                _chat(sim, SYSTEM, f"hello {len(seqs)}")
                receive()
                return bool(stored)

            wait_for(first_events, timeout=20, what="the first BlockStored event")
            prompt = _chat(sim, SYSTEM, "again")
            _chat(sim, " ".join(f"x{i}" for i in range(100)), "other")
            wait_for(receive, timeout=20, what="a BlockRemoved")
            assert len(set(stored)) >= (prompt - 1) // 16
            # Evicted blocks are blocks that were stored, and numbering has no gaps.
            assert set(removed) <= set(stored)
            assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
    finally:
        sub.close(0)
        context.term()


def test_taken_event_port_fails_start_up_like_zmq(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("0.0.0.0", 0))
        busy.listen()
        port = busy.getsockname()[1]
        args = ["--sim-scheduler", "step", "--kv-events-config", _config(port)]
        proc = run_to_exit(
            tmp_path, engine_argv("vllm", free_port(), args), env={"CUDA_VISIBLE_DEVICES": "0"}
        )
    assert proc.returncode == 1
    assert f"zmq.error.ZMQError: Address already in use (addr='tcp://*:{port}')" in proc.output


def test_a_specific_address_is_connected_to_not_bound(tmp_path: Path) -> None:
    """vLLM binds only a wildcard or ipc:// endpoint and connects to any other address: a
    subscriber bound at tcp://127.0.0.1:PORT gets the events (binding there too would fail
    start-up with 'Address already in use')."""
    port = free_port()
    config = json.loads(_config(port))
    config["endpoint"] = f"tcp://127.0.0.1:{port}"
    args = ["--sim-scheduler", "step", "--kv-events-config", json.dumps(config)]
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    sub.setsockopt(zmq.LINGER, 0)
    sub.bind(f"tcp://127.0.0.1:{port}")
    try:
        with start(tmp_path, "vllm", args) as sim:
            stored: list[int] = []
            view = CacheView()
            sent = [0]

            def first_events() -> bool:
                sent[0] += 1
                _chat(sim, f"{sent[0]} {SYSTEM}", "hello")
                while sub.poll(100):
                    topic, _seq, payload = sub.recv_multipart()
                    assert topic == b"kv"
                    stored.extend(view.apply(decode_events(payload)).stored)
                return bool(stored)

            wait_for(first_events, timeout=30, what="a BlockStored event at the bound subscriber")
    finally:
        sub.close(0)
        context.term()


@settings(max_examples=200)
@given(
    scheme=st.sampled_from(["tcp://", "ipc://", "inproc://"]),
    host=st.sampled_from(["*", "[::]", "127.0.0.1", "localhost", "10.1.2.3", "/tmp/kv"]),
    port=st.integers(0, 65535),
)
def test_binds_a_wildcard_or_local_endpoint_and_connects_to_the_rest(
    scheme: str, host: str, port: int
) -> None:
    endpoint = f"{scheme}{host}:{port}"
    wildcard = host in ("*", "[::]")
    assert binds(endpoint) == (wildcard or scheme != "tcp://")


def test_binds_examples() -> None:
    assert binds("tcp://*:5557")
    assert binds("tcp://[::]:5557")
    assert binds("ipc:///run/llmgw/kv.sock")
    assert binds("inproc://kv")
    assert not binds("tcp://127.0.0.1:5557")
    assert not binds("tcp://engine-host:5557")
