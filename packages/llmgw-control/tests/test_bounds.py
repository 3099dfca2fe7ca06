"""What one node may report (bounds.py), and the max_message_bytes setting."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from llmgw_control.bounds import (
    Bounds,
    admit_shard,
    clip,
    clip_status,
    register_problem,
    status_problem,
)
from llmgw_control.config import load_control_config
from llmgw_proto import v1
from llmgw_proto.config import ConfigError

B = Bounds()


def register(**kw: object) -> v1.Register:
    return v1.Register(node_id="gpu-a", **kw)  # type: ignore[arg-type]


def test_an_ordinary_register_is_fine() -> None:
    shards = [v1.RunningShard(shard_id=f"s{i}", replica_id=f"r{i}") for i in range(8)]
    assert register_problem(register(labels={"fabric.ib-subnet": "a"}, shards=shards), B) is None


@pytest.mark.parametrize(
    ("msg", "why"),
    [
        (register(labels={f"k{i}": "" for i in range(65)}), "labels: 65 labels, at most 64"),
        (register(labels={"k" * 318: "v"}), "is 318 characters, at most 317"),
        (register(labels={"note": "v" * 1025}), "labels['note']: value of 1025 characters"),
        (
            register(shards=[v1.RunningShard(shard_id=str(i)) for i in range(257)]),
            "shards: 257 shards reported, at most 256",
        ),
        (
            register(inventory=v1.Inventory(hostname="h" * (2 * 1024 * 1024))),
            "the Register is 2097",
        ),
    ],
)
def test_too_much_is_named(msg: v1.Register, why: str) -> None:
    problem = register_problem(msg, B)
    assert problem is not None
    assert why in problem


@given(st.integers(0, 200), st.integers(0, 200))
def test_labels_bounded_by_count(count: int, limit: int) -> None:
    msg = register(labels={f"k{i}": "v" for i in range(count)})
    problem = register_problem(msg, Bounds(labels=limit))
    assert (problem is not None) == (count > limit)


@given(st.integers(0, 600), st.booleans(), st.booleans(), st.integers(1, 300))
def test_a_shard_is_kept_if_known_asked_or_under_the_bound(
    held: int, known: bool, asked: bool, limit: int
) -> None:
    kept = admit_shard(held=held, known=known, asked=asked, bounds=Bounds(shards=limit))
    assert kept == (known or asked or held < limit)


@given(st.text(max_size=300), st.integers(1, 200), st.booleans())
def test_clip_fits_and_keeps_what_fits(text: str, limit: int, keep_end: bool) -> None:
    out = clip(text, limit, keep_end=keep_end)
    assert len(out) <= limit
    if len(text) <= limit:
        assert out == text
    elif len(out) > 40:
        # Room for the mark: it says so, and keeps the start (or the end of a tail).
        assert f"cut from {len(text)} characters" in out
        kept = out.split("]", 1)[1] if keep_end else out.rsplit("[", 1)[0]
        assert text.endswith(kept) if keep_end else text.startswith(kept)


def test_a_status_keeps_its_reason_and_tail_short() -> None:
    msg = v1.ShardStatus(shard_id="s", reason="r" * 10_000, output_tail="t" * 100_000 + "END")
    clip_status(msg, B)
    assert len(msg.reason) == B.reason
    assert msg.reason.startswith("rrr")
    assert len(msg.output_tail) == B.output_tail
    assert msg.output_tail.endswith("END")


def write(tmp_path: Path, extra: str) -> Path:
    path = tmp_path / "control.yaml"
    path.write_text(f"tls: {{insecure: true}}\n{extra}models: []\n")
    return path


def test_max_message_bytes_defaults_to_four_mebibytes(tmp_path: Path) -> None:
    assert load_control_config(write(tmp_path, "")).config.max_message_bytes == 4 * 1024 * 1024
    loaded = load_control_config(write(tmp_path, "max_message_bytes: 16777216\n"))
    assert loaded.config.max_message_bytes == 16 * 1024 * 1024


def test_a_tiny_max_message_bytes_is_a_located_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"max_message_bytes"):
        load_control_config(write(tmp_path, "max_message_bytes: 100\n"))


def test_a_status_no_node_could_mean_is_named() -> None:
    assert status_problem(v1.ShardStatus(shard_id="m.p.abc-0", gpu_indices=[0, 1]), B) is None
    long_id = status_problem(v1.ShardStatus(shard_id="s" * 1025), B)
    assert long_id == "shard_id: 1025 characters, at most 1024"
    url = status_problem(v1.ShardStatus(shard_id="s", endpoint_url="u" * 5000), B)
    assert url is not None
    assert url.startswith("endpoint_url: 5000")
    many = status_problem(v1.ShardStatus(shard_id="s", gpu_indices=list(range(257))), B)
    assert many == "gpu_indices: 257 indices, at most 256"


@given(st.integers(0, 2000), st.integers(0, 400))
def test_status_bounds_hold_exactly(id_length: int, gpus: int) -> None:
    msg = v1.ShardStatus(shard_id="s" * id_length, gpu_indices=list(range(gpus)))
    problem = status_problem(msg, B)
    assert (problem is None) == (id_length <= B.status_id and gpus <= B.gpu_indices)
