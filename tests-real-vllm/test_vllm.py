"""The whole system on a real vLLM (or SGLang: see conftest.py): placed by the control plane,
launched by the agent through the engine adapter's command line, served by the router, killed,
restarted and drained.

One system for the module (see conftest.py); the tests run in this order:
loading -> ready -> serving -> load reports -> SIGKILL and restart -> drain (scale to zero).
The model is a 270M base model: the tests check shapes, usage and token counts, not the text.
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import urllib.request
from pathlib import Path
from typing import Any

import httpx
from llmgw_router.proxy.routes import decode_id
from llmgw_testkit import http_get, wait_for
from llmgw_testkit import serving_checks as checks
from llmgw_testkit.checks import stream_chat_with_usage
from llmgw_testkit.cluster import Cluster, metric_sum

SERVED_NAME = "gemma3"


def ready_shard(cluster: Cluster, timeout: float = 600) -> dict[str, Any]:
    """The one ready replica's shard, waiting for it (at once when it is ready already)."""
    (replica,) = cluster.wait_replicas(SERVED_NAME, 1, timeout=timeout)
    (shard,) = replica["shards"]
    result: dict[str, Any] = shard
    return result


def _health(port: int) -> int:
    try:
        status, _ = http_get(f"http://127.0.0.1:{port}/health", timeout=5)
    except OSError:
        return 0  # refused: vLLM binds its port at once but listens only once loaded
    return status


def _shard(cluster: Cluster) -> dict[str, Any] | None:
    for replica in cluster.replicas(SERVED_NAME):
        for shard in replica["shards"]:
            if shard["pid"] > 0:
                result: dict[str, Any] = shard
                return result
    return None


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def _group(pgid: int) -> list[int]:
    """Live processes of a process group (the engine's API server and its EngineCore)."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            pids.append(int(stat.parent.name))
    return pids


def _engine_args(cmdline: list[str], command: list[str]) -> list[str]:
    """What the adapter added after agent.yaml's command (a console script such as bin/vllm
    runs under its python: argv is [python, .../bin/vllm, ...])."""
    for start in (0, 1):
        if cmdline[start : start + len(command)] == command:
            return cmdline[start + len(command) :]
    raise AssertionError(f"{cmdline} does not run {command}")


def _adapter(kind: str) -> Any:
    from llmgw_agent.adapters import ADAPTERS

    return next(a for a in ADAPTERS.values() if a.name == kind)


def _engine_metrics(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        return str(resp.read().decode())


def test_starting_until_health_answers_then_ready(system: Cluster) -> None:
    # Each sample reads the control plane's view first, then the engine's /health. While
    # vLLM loads, its port refuses connections; once /health answers 200 it stays up. So a
    # "starting" read before a failed /health was reported while the engine was loading.
    samples: list[tuple[str, int]] = []

    def starting_seen_while_loading_or_loaded() -> bool:
        shard = _shard(system)
        if shard is None:
            return False
        samples.append((shard["state"], _health(shard["port"])))
        return samples[-1][0] == "starting" or samples[-1][1] == 200

    wait_for(starting_seen_while_loading_or_loaded, timeout=900, interval=0.2, what="loading")
    assert samples[-1][0] == "starting", f"no sample saw the engine load: {samples}"
    assert samples[-1][1] != 200, samples
    assert not [s for s in samples if s[0] == "ready"], samples

    shard = ready_shard(system)
    assert shard["state"] == "ready"
    assert _health(shard["port"]) == 200


def test_placed_on_the_cpu_node_and_launched_through_the_adapter(
    serving: Cluster, engine: Any, hf_model: Path, profile: dict[str, Any]
) -> None:
    shard = checks.placed_on_the_cpu_node(serving, SERVED_NAME, "cpu-a")
    cmdline = checks.cmdline(shard["pid"])
    args = _engine_args(cmdline, engine.command)
    assert args[args.index(engine.model_flag) + 1] == str(hf_model), args
    assert args[args.index("--host") + 1] == "127.0.0.1"
    assert args[args.index("--port") + 1] == str(shard["port"])
    assert args[args.index("--served-model-name") + 1] == SERVED_NAME
    assert args[args.index(engine.tp_flag) + 1] == "1"
    # The profile's engine_args, last (SGLang's secret, on its command line, after them);
    # the KV events go to a Unix socket of the agent's, not tcp://* (issue 24.3).
    engine_args = profile["engine_args"]
    if args[-2:-1] == ["--api-key"]:
        args = args[:-2]
    for given, launched in zip(engine_args, args[-len(engine_args) :], strict=True):
        if given.startswith("{"):
            sent = json.loads(launched)
            assert sent == {**json.loads(given), "endpoint": sent["endpoint"]}
            assert sent["endpoint"].startswith("ipc://")
        else:
            assert launched == given
    environ = checks.environ(shard["pid"])
    for key, value in profile["env"].items():
        assert f"{key}={value}".encode() in environ, key


def help_flags(text: str) -> set[str]:
    """Flags in argparse's help: "  --max-model-len MAX_MODEL_LEN, -asc ..." option lines."""
    flags: set[str] = set()
    for line in text.splitlines():
        if line.startswith("  -"):
            spec = re.split(r"\s{2,}", line.strip())[0]
            flags.update(re.findall(r"(?:^|, )(--?[A-Za-z][\w.-]*)", spec))
    return flags


def test_every_flag_the_adapter_emitted_is_in_the_real_help(serving: Cluster, engine: Any) -> None:
    shard = ready_shard(serving)
    args = _engine_args(checks.cmdline(shard["pid"]), engine.command)
    flags = {a.split("=", 1)[0] for a in args if a.startswith("-")}
    known = help_flags(engine.captured_help.read_text())
    checks.every_flag_in_help(flags, known, at_least=300)
    # The capture in the repo is what this engine accepts: the agent read the installed
    # engine's help itself (cached under its state dir) and it has exactly the same flags.
    # (Not line for line: SGLang's usage lines wrap choice lists that vary between runs.)
    pattern = f"{engine.kind}-{engine.version}-*.txt"
    cached = sorted((serving.state_dir("cpu-a") / "engine-help").glob(pattern))
    assert cached, "the agent did not read the engine's own help"
    assert help_flags(cached[0].read_text()) == known


def test_the_engine_refuses_a_direct_request_and_serves_the_routed_one(
    serving: Cluster, engine: Any
) -> None:
    """Issue 24.3: the real engine requires the secret the agent gave it; the router sends
    it, a client going around the router has none."""
    shard = ready_shard(serving)
    if engine.kind == "vllm":  # VLLM_API_KEY: out of the command line ps shows
        checks.engine_secret(shard["pid"], "VLLM_API_KEY")
    else:
        cmdline = checks.cmdline(shard["pid"])
        assert len(cmdline[cmdline.index("--api-key") + 1]) >= 32
    direct = checks.direct_request_refused(serving, SERVED_NAME)
    if engine.kind == "vllm":
        assert direct.json() == {"error": "Unauthorized"}
    checks.routed_request_served(serving, SERVED_NAME)


def test_chat_completion_through_the_router(serving: Cluster) -> None:
    reply = checks.chat_through_the_router(serving, SERVED_NAME)
    assert reply.model == SERVED_NAME
    assert reply.choices[0].message.content
    usage = reply.usage
    assert usage is not None
    # The chat template wrapped the message: more tokens than the five words alone.
    assert usage.prompt_tokens > 8


def test_streaming_chat_completion_with_usage_through_the_router(serving: Cluster) -> None:
    got = checks.streaming_chat_through_the_router(serving, SERVED_NAME)
    assert got.chunks[-1].choices == []  # the usage chunk comes last, on its own


def test_completion_through_the_router(serving: Cluster) -> None:
    client = checks.client(serving)
    reply = client.completions.create(
        model=SERVED_NAME, prompt="The capital of France is", max_tokens=12, temperature=0
    )
    assert reply.object == "text_completion"
    (choice,) = reply.choices
    assert isinstance(choice.text, str)
    assert choice.text
    assert reply.usage is not None
    assert reply.usage.prompt_tokens == 6  # <bos> and five tokens: add_bos_token kept
    assert 0 < reply.usage.completion_tokens <= 12
    # Greedy decoding of the same prompt gives the same text through the router again.
    again = client.completions.create(
        model=SERVED_NAME, prompt="The capital of France is", max_tokens=12, temperature=0
    )
    assert again.choices[0].text == choice.text


def test_responses_through_the_router(serving: Cluster, engine: Any) -> None:
    """The Responses API through the router (issue 31): the engine answers, and the id the
    client gets names the replica that answered (the router's rewrite)."""
    if engine.kind != "vllm":
        return  # SGLang's Responses API is not what this suite's build serves
    reply = checks.client(serving).responses.create(
        model=SERVED_NAME, input="The capital of France is", max_output_tokens=12, temperature=0
    )
    assert reply.output_text
    decoded = decode_id(reply.id)
    assert decoded is not None
    assert decoded[0].startswith("resp")
    (replica,) = serving.wait_replicas(SERVED_NAME, 1)
    assert decoded[1] == replica["replica_id"]
    assert reply.usage is not None
    assert reply.usage.input_tokens > 0


def test_anthropic_messages_through_the_router(serving: Cluster, engine: Any) -> None:
    """Anthropic's Messages API through the router (issue 31), whole and streamed."""
    if engine.kind != "vllm":
        return
    import anthropic

    client = anthropic.Anthropic(
        base_url=serving.router_url, api_key="unused", max_retries=0, timeout=300
    )
    ask: list[Any] = [{"role": "user", "content": "Say hello."}]
    message = client.messages.create(model=SERVED_NAME, max_tokens=8, messages=ask)
    assert message.type == "message"
    assert message.content[0].type == "text"
    assert message.content[0].text
    with client.messages.stream(model=SERVED_NAME, max_tokens=8, messages=ask) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text
    assert 0 < final.usage.output_tokens <= 8


def _admin_post(cluster: Cluster, path: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(
        f"http://127.0.0.1:{cluster.router_admin_port}{path}",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=30) as resp:  # noqa: S310 (http:// above)
        answer: dict[str, Any] = json.loads(resp.read())
    return answer


def _engine_tokens(port: int, body: dict[str, Any]) -> list[int]:
    """The engine's own tokenization of a request (vLLM's /tokenize)."""
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/tokenize",
        data=json.dumps({"model": SERVED_NAME, **body}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=30) as resp:  # noqa: S310 (http:// above)
        tokens: list[int] = json.loads(resp.read())["tokens"]
    return tokens


# ~250 tokens: seven full 32-token blocks.
SYSTEM = " ".join(
    f"Rule {i}: answer in plain words, cite the manual, and keep it short." for i in range(16)
)


def test_the_router_matches_prompts_on_the_blocks_the_engine_reports_cached(
    serving: Cluster, engine: Any
) -> None:
    if engine.kind != "vllm":
        return  # SGLang's events carry no token ids here
    shard = ready_shard(serving)
    chat = {
        "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": "What is rule 3?"},
        ]
    }
    completion = {"prompt": SYSTEM + " Rule 99:"}
    # The router tokenizes both as the engine does, token for token.
    engine_chat = _engine_tokens(shard["port"], {**chat, "add_generation_prompt": True})
    engine_completion = _engine_tokens(shard["port"], completion)
    before = _admin_post(serving, "/v1/match", {"model": SERVED_NAME, **chat})
    assert before["prompt_tokens"] == len(engine_chat)
    assert len(engine_chat) >= 7 * 32
    assert _admin_post(serving, "/v1/match", {"model": SERVED_NAME, **completion})[
        "prompt_tokens"
    ] == len(engine_completion)

    reply = httpx.post(
        f"{serving.router_url}/v1/chat/completions",
        json={"model": SERVED_NAME, "max_tokens": 2, **chat},
        timeout=120,
    )
    assert reply.status_code == 200, reply.text

    # The engine's BlockStored events, named by their token ids by the agent, reach the
    # router through the control plane: every full block of the prompt is matched.
    full = len(engine_chat) // 32

    def matched() -> dict[str, Any] | None:
        answer = _admin_post(serving, "/v1/match", {"model": SERVED_NAME, **chat})
        (ep,) = answer["endpoints"]
        return ep if ep["cached_blocks"] == full else None

    ep = wait_for(matched, timeout=60, what=f"the router matching all {full} blocks")
    assert ep["token_block_size"] == 32
    assert ep["prompt_blocks"] == full
    # A prompt that shares only the first half of that system prompt matches exactly the
    # blocks the two share token for token (by the engine's own tokenization).
    half = SYSTEM[: len(SYSTEM) // 2]
    other = {
        "messages": [
            {"role": "system", "content": half + " Then forget every rule above."},
            {"role": "user", "content": "What is rule 3?"},
        ]
    }
    engine_other = _engine_tokens(shard["port"], {**other, "add_generation_prompt": True})
    common = next(
        (i for i, (a, b) in enumerate(zip(engine_chat, engine_other, strict=False)) if a != b),
        min(len(engine_chat), len(engine_other)),
    )
    (partial,) = _admin_post(serving, "/v1/match", {"model": SERVED_NAME, **other})["endpoints"]
    assert partial["cached_blocks"] == common // 32
    assert 0 < partial["cached_blocks"] < full
    # The router's endpoint view counts the token-named blocks it holds.
    status, raw = http_get(f"http://127.0.0.1:{serving.router_admin_port}/v1/endpoints")
    assert status == 200
    (view,) = json.loads(raw)["endpoints"]
    assert view["token_blocks"] >= full
    assert view["token_block_size"] == 32


def test_load_reports_carry_the_engines_real_metrics(serving: Cluster, engine: Any) -> None:
    shard = ready_shard(serving)
    # What the engine itself says: the names the agent's adapter reads are in its /metrics.
    adapter = _adapter(engine.kind)
    text = _engine_metrics(shard["port"])
    names = {line.split("{", 1)[0].split(" ", 1)[0] for line in text.splitlines()}
    load = adapter.load
    wanted = [adapter.running_metric, load.running, load.waiting, load.kv_cache_usage]
    wanted += [load.prefix_queries, load.prefix_hits]
    missing = [n for n in wanted if n not in names and f"{n}_total" not in names]
    assert not missing, f"{engine.kind} {engine.version} has no {missing}"
    queries = metric_sum(text, load.prefix_queries) + metric_sum(
        text, f"{load.prefix_queries}_total"
    )
    assert queries > 0  # the requests above were looked up in the prefix cache

    # ...and the agent's load reports carry it to the control plane, per replica.
    def reported() -> dict[str, Any] | None:
        (replica,) = serving.replicas(SERVED_NAME)
        load: dict[str, Any] | None = replica.get("load")
        if not (load and load["known"] and load["prefix_cache_queries"] > 0):
            return None
        # Idle once the earlier tests' requests are done (a clean-clone run's first report
        # here came while one was still running: running 1).
        return load if load["running"] == 0 else None

    figures = wait_for(reported, timeout=60, what="an idle load report with prefix-cache counts")
    assert figures["prefix_cache_queries"] <= queries

    # A request running shows as running in the reported load.
    done = threading.Event()

    def long_request() -> None:
        try:
            checks.client(serving).completions.create(
                model=SERVED_NAME,
                prompt="Once upon a time",
                max_tokens=200,
                extra_body={"ignore_eos": True},
            )
        finally:
            done.set()

    worker = threading.Thread(target=long_request)
    worker.start()
    try:
        wait_for(
            lambda: done.is_set() or serving.replicas(SERVED_NAME)[0]["load"]["running"] >= 1,
            timeout=120,
            what="the running request in the reported load",
        )
        assert not done.is_set(), "the request ended before any load report saw it"
    finally:
        worker.join(timeout=300)
    wait_for(
        lambda: serving.replicas(SERVED_NAME)[0]["load"]["running"] == 0,
        timeout=60,
        what="the reported load back to 0 running",
    )


def test_sigkill_is_reported_failed_with_the_engines_last_lines_then_restarted(
    serving: Cluster, engine: Any
) -> None:
    shard = ready_shard(serving)
    pid = shard["pid"]
    assert len(_group(pid)) >= 2  # the API server and the engine process(es) it started
    os.kill(pid, signal.SIGKILL)  # the API server only: no chance to say goodbye

    def reported_failed() -> dict[str, Any] | None:
        (replica,) = serving.replicas(SERVED_NAME)
        return replica if replica["failures"] >= 1 else None

    failed = wait_for(reported_failed, timeout=120, what="the killed engine reported")
    assert "SIGKILL" in str(failed["last_error"]), failed
    tail = str(failed["output_tail"])
    # The engine's own lines, as it writes them (vLLM: its API server's prefix with the
    # killed pid; uvicorn's access line for a completion above), not the agent's polls.
    for line in engine.own_lines:
        assert line.format(pid=pid) in tail, tail
    assert '"GET /metrics HTTP/1.1" 200' not in tail, tail
    serving.agents["cpu-a"].wait_output('"state": "FAILED"', timeout=30)
    # The engine's children (vLLM's EngineCore holds the model) went with it.
    wait_for(lambda: not _group(pid), timeout=60, what="the killed engine's group gone")

    # Restarted after backoff: a new vLLM, loaded and ready again.
    def restarted() -> dict[str, Any] | None:
        shard = _shard(serving)
        ok = shard and shard["pid"] != pid and shard["state"] == "ready"
        return shard if ok else None

    again = wait_for(restarted, timeout=900, interval=0.5, what="a new engine ready after the kill")
    assert _health(again["port"]) == 200


# Long enough (10-30 s here) for the scale-down to reach the agent while vLLM runs it.
DRAIN_TOKENS = 300


def test_scale_to_zero_drains_on_the_engines_running_metric(serving: Cluster, engine: Any) -> None:
    shard = ready_shard(serving)
    pid, port = shard["pid"], shard["port"]
    running = _adapter(engine.kind).running_metric
    serving.wait_router_models(SERVED_NAME, timeout=60)
    outcome: list[tuple[str, int]] = []
    # The client's first streamed token: the request runs in the engine. (Gating on the
    # engine's own running metric instead lost the race once in CI: the stream of 300
    # tokens ended before a scrape saw it, see the metric's check below.)
    first_token = threading.Event()

    def seen(chunk: Any) -> None:
        if chunk.choices:
            first_token.set()

    def stream() -> None:
        try:
            # The token count is checked below, with what the stream ended on.
            got = stream_chat_with_usage(
                serving.router_url,
                SERVED_NAME,
                max_tokens=DRAIN_TOKENS,
                content="Once upon a time",
                api_key="unused",
                timeout=300,
                expect_tokens=0,
                on_chunk=seen,
                extra_body={"ignore_eos": True},
            )
            finish = [c.choices[0].finish_reason for c in got.chunks if c.choices]
            outcome.append((str(finish[-1]), got.usage.completion_tokens))
        except Exception as err:
            outcome.append((f"error: {err!r}", 0))
        finally:
            first_token.set()

    worker = threading.Thread(target=stream)
    worker.start()
    try:
        assert first_token.wait(timeout=120), "no token streamed within 120 s"
        assert not outcome, f"the stream ended before the scale-down: {outcome}"

        config_path = serving.workdir / "control.yaml"
        config = json.loads(config_path.read_text())
        config["models"][0]["profiles"]["cpu"]["replicas"] = 0
        config_path.write_text(json.dumps(config, indent=2))
        assert serving.control is not None
        serving.control.signal(signal.SIGHUP)

        # Draining while the engine still runs the request: it is not stopped under it.
        wait_for(
            lambda: outcome or serving.replicas(SERVED_NAME)[0]["state"] == "draining",
            timeout=60,
            what="the replica draining",
        )
        assert not outcome, f"the stream ended before the drain began: {outcome}"
        assert _alive(pid)
        # ...and the engine says so on the metric the agent drains on. Every scrape is kept
        # for the message, should the stream end before one shows the request.
        scrapes: list[str] = []

        def scraped_running() -> bool:
            if outcome:
                return True
            try:
                value = metric_sum(_engine_metrics(port), running)
            except OSError as err:
                scrapes.append(repr(err))
                return False
            scrapes.append(str(value))
            return value >= 1

        wait_for(scraped_running, timeout=120, what=f"{running} >= 1 on port {port}")
        assert not outcome, f"the stream ended before {running} showed it: {scrapes[-10:]}"
    finally:
        worker.join(timeout=300)
    assert outcome == [("length", DRAIN_TOKENS)], outcome

    wait_for(lambda: not serving.replicas(SERVED_NAME), timeout=120, what="no replica left")
    wait_for(lambda: not _group(pid), timeout=60, what="the drained engine stopped")
    agent_log = serving.agents["cpu-a"].output()
    assert '"state": "DRAINING"' in agent_log
    assert '"state": "STOPPED"' in agent_log
