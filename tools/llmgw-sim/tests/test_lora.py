"""LoRA adapters in the simulator (issue 30): SGLang's runtime API and startup check, and
the step scheduler's LoRA slots (vLLM --max-loras, SGLang --max-loras-per-batch)."""

from __future__ import annotations

from pathlib import Path

import httpx
from hypothesis import given, settings
from hypothesis import strategies as st
from llmgw_sim.scheduler import Scheduler, SchedulerConfig, Seq
from llmgw_sim.testing import engine_argv, run_to_exit, start

SG_LORA = ["--enable-lora", "--max-lora-rank", "16", "--lora-target-modules", "all"]


def test_sglang_loads_and_unloads_adapters_at_runtime(tmp_path: Path) -> None:
    args = [*SG_LORA, "--max-loras-per-batch", "2", "--sim-lora-load-time", "0.05"]
    with start(tmp_path, "sglang", args) as sim, httpx.Client(timeout=10) as c:
        # SGLang takes the adapter from lora_path (or a model "base:adapter"), not from
        # the model name, which it does not check: "sql" alone is the base model.
        base = {"model": "sql", "messages": [{"role": "user", "content": "x"}]}
        body = {**base, "lora_path": "sql"}
        r = c.post(sim.url + "/v1/chat/completions", json=body)
        assert r.status_code == 400
        assert r.json()["message"].startswith(
            "The following requested LoRA adapters are not loaded: sql\n"
        )
        plain = c.post(sim.url + "/v1/chat/completions", json=base)
        assert plain.status_code == 200
        r = c.post(sim.url + "/load_lora_adapter", json={"lora_name": "sql", "lora_path": "/l/s"})
        assert r.status_code == 200
        assert r.json() == {
            "success": True,
            "error_message": "",
            "loaded_adapters": {"sql": "/l/s"},
        }
        again = c.post(sim.url + "/load_lora_adapter", json={"lora_name": "sql", "lora_path": "/x"})
        assert again.status_code == 400
        assert again.json()["success"] is False
        assert "already loaded" in again.json()["error_message"]
        served = c.post(sim.url + "/v1/chat/completions", json=body)
        assert served.status_code == 200
        by_model = c.post(sim.url + "/v1/chat/completions", json={**base, "model": "m:sql"})
        text = served.json()["choices"][0]["message"]["content"]
        # The adapter answers differently from the base model, however it is named.
        assert text != plain.json()["choices"][0]["message"]["content"]
        assert by_model.json()["choices"][0]["message"]["content"] == text
        r = c.post(sim.url + "/unload_lora_adapter", json={"lora_name": "sql"})
        assert r.status_code == 200
        assert r.json()["loaded_adapters"] == {}
        r = c.post(sim.url + "/unload_lora_adapter", json={"lora_name": "sql"})
        assert r.status_code == 400
        assert "not loaded" in r.json()["error_message"]
        assert c.post(sim.url + "/v1/chat/completions", json=body).status_code == 400


def test_sglang_lora_without_paths_needs_rank_and_modules(tmp_path: Path) -> None:
    exited = run_to_exit(tmp_path, engine_argv("sglang", 1, ["--enable-lora"]))
    assert exited.returncode != 0
    assert "--max-lora-rank and --lora-target-modules" in exited.output


def test_vllm_runtime_load_serves_the_adapter(tmp_path: Path) -> None:
    args = ["--enable-lora", "--max-loras", "2", "--max-lora-rank", "32"]
    args += ["--sim-scheduler", "step", "--sim-lora-load-time", "0.05"]
    env = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
    with start(tmp_path, "vllm", args, env=env) as sim, httpx.Client(timeout=10) as c:
        body = {"model": "sql", "messages": [{"role": "user", "content": "x"}], "max_tokens": 4}
        r = c.post(sim.url + "/v1/chat/completions", json=body)
        assert r.status_code == 404
        assert r.json()["error"]["message"] == "The model `sql` does not exist."
        r = c.post(sim.url + "/v1/load_lora_adapter", json={"lora_name": "sql", "lora_path": "/p"})
        assert r.status_code == 200
        assert c.post(sim.url + "/v1/chat/completions", json=body).status_code == 200
        models = {m["id"]: m for m in c.get(sim.url + "/v1/models").json()["data"]}
        assert models["sql"]["parent"] == "org/model"


def _seq(rid: int, lora: str | None) -> Seq:
    return Seq(rid, 8, 4, [], lora=lora)


def test_a_batch_holds_at_most_max_loras_adapters_and_skips_the_rest() -> None:
    s = Scheduler(SchedulerConfig(8, 1024, 64, 4, max_loras=2))
    for rid, lora in enumerate(["a", "b", "c", None, "a"]):
        s.add(_seq(rid, lora))
    plan = s.schedule()
    running = [item.seq.lora for item in plan.items]
    # c waits (a third adapter); the base request and a's second request go past it.
    assert running == ["a", "b", None, "a"]
    assert [q.lora for q in s.waiting] == ["c"]


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.sampled_from(["a", "b", "c", "d", None]), min_size=1, max_size=30),
    st.integers(1, 3),
)
def test_lora_slots_are_never_exceeded_and_everything_finishes(
    loras: list[str | None], limit: int
) -> None:
    s = Scheduler(SchedulerConfig(6, 64, 256, 4, max_loras=limit))
    for rid, lora in enumerate(loras):
        s.add(_seq(rid, lora))
    done: set[int] = set()
    for _ in range(10_000):
        if s.idle:
            break
        plan = s.schedule()
        assert len({q.lora for q in s.running if q.lora is not None}) <= limit
        done.update(ev.rid for ev in s.finish_step(plan) if ev.finished)
    assert done == set(range(len(loras)))
