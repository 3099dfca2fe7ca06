"""Router CPU per request, precise matching against approximate, on multi-turn conversations.

    python tools/bench/bench_precise_cpu.py                     # this checkout's router
    python tools/bench/bench_precise_cpu.py --router-src DIR    # another llmgw_router (its src/)

One `llmgw-sim vllm serve` with zero delays answers; one llmgw-router (`workers: 1`,
`cache_aware`) is started per mode: `approximate` (no tokenizer) and `precise`
(`cache_aware.tokenizers` naming a byte-level BPE tokenizer trained here on the workload's
words, with a Gemma-style chat template and its turn markers as special tokens). The
workload (bench_routing.py's multi-turn shape: streamed answers of `--out-tokens`):
`--conversations` conversations of `--turns` turns, sent one request at a time on one
keep-alive connection, turn 1 of every conversation, then turn 2, and so on; each prompt
is a shared system prompt (`--system-words`), the earlier turns (a question of
`--question-words` and an answer of `--answer-words` each) and the new question. CPU is
the router process's on-CPU time (all its threads, /proc schedstat, in nanoseconds) over
the requests of a round (after one warm-up conversation that is not counted), per
request; each mode runs `--rounds` times in alternation and keeps its least disturbed
(lowest) round. A fresh router per round and mode: its token cache starts empty.

`--router-src` runs the router from another source tree (e.g. `git archive` of an older
commit), to compare before and after a change on the same machine.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import random
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from benchlib import serving
from llmgw_testkit import free_port

BIN = Path(sys.executable).parent
MODEL = "bench-model"
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['role'] }}\n"
    "{{ m['content'] | trim }}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
SPECIALS = ["<bos>", "<start_of_turn>", "<end_of_turn>"]


def words(n: int, rnd: random.Random) -> str:
    syllables = ["ka", "to", "ri", "men", "sol", "ve", "dan", "pu", "lo", "ith", "or", "ex"]
    return " ".join(
        "".join(rnd.choice(syllables) for _ in range(rnd.randint(1, 3))) for _ in range(n)
    )


def write_tokenizer(folder: Path) -> Path:
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers, trainers

    rnd = random.Random(7)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=4000,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([words(200, rnd) for _ in range(500)], trainer)
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    config = {"bos_token": "<bos>", "eos_token": "<end_of_turn>", "chat_template": TEMPLATE}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def conversations(args: argparse.Namespace, seed: int) -> list[list[bytes]]:
    """Each conversation's request bodies, turn by turn."""
    rnd = random.Random(seed)
    system = words(args.system_words, rnd)
    out = []
    for _ in range(args.conversations):
        messages: list[dict[str, str]] = [{"role": "system", "content": system}]
        bodies = []
        for _ in range(args.turns):
            messages.append({"role": "user", "content": words(args.question_words, rnd)})
            body = {
                "model": MODEL,
                "messages": messages,
                "max_tokens": args.out_tokens,
                "stream": True,
            }
            bodies.append(json.dumps(body).encode())
            messages = [*messages, {"role": "model", "content": words(args.answer_words, rnd)}]
        out.append(bodies)
    return out


@contextlib.contextmanager
def router(
    mode: str, sim: int, logs: Path, tokenizer: Path, src: str | None
) -> Iterator[tuple[int, int]]:
    port, admin = free_port(), free_port()
    cache_aware: dict[str, object] = {}
    if mode == "precise":
        cache_aware["tokenizers"] = {MODEL: str(tokenizer)}
    config = {
        "workers": 1,
        "balancer": "cache_aware",
        "cache_aware": cache_aware,
        "health_checks": {"enabled": False},
        "load_reports": {"enabled": False},
    }
    # JSON is YAML.
    path = logs / f"router-{mode}.yaml"
    path.write_text(json.dumps(config))
    env = dict(os.environ)
    if src:
        env["PYTHONPATH"] = os.pathsep.join([src, env.get("PYTHONPATH", "")])
    argv = [
        sys.executable, "-m", "llmgw_router", "serve", "--config", str(path),
        "--listen", f"127.0.0.1:{port}", "--admin-listen", f"127.0.0.1:{admin}",
        "--endpoint", f"sim=http://127.0.0.1:{sim}={MODEL}", "--log-level", "warning",
    ]  # fmt: skip
    with serving(
        argv,
        health=f"http://127.0.0.1:{admin}/readyz",
        what=f"llmgw-router ({mode})",
        log_dir=logs,
        name=f"router-{mode}",
        env=env,
        timeout=60,
    ) as proc:
        yield port, proc.pid


def cpu_seconds(pid: int) -> float:
    """CPU time of ``pid``'s threads to the nanosecond (schedstat: on-CPU time), where
    /proc/PID/stat counts in 10 ms ticks, too coarse for a round of requests."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            total += int((task / "schedstat").read_text().split()[0])
    return total / 1e9


def send(conn: http.client.HTTPConnection, body: bytes) -> None:
    conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    reply = conn.getresponse()
    data = reply.read()
    if reply.status != 200:
        raise SystemExit(f"HTTP {reply.status}: {data[:300]!r}")


def measure(port: int, pid: int, args: argparse.Namespace, seed: int) -> float:
    """Router CPU seconds per request over one round of the workload."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        # Warm-up (imports, first template render, connection): not counted.
        for body in conversations(argparse.Namespace(**{**vars(args), "conversations": 1}), -1)[0]:
            send(conn, body)
        convs = conversations(args, seed)
        before = cpu_seconds(pid)
        count = 0
        for turn in range(args.turns):
            for conv in convs:
                send(conn, conv[turn])
                count += 1
        return (cpu_seconds(pid) - before) / count
    finally:
        conn.close()


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--system-words", type=int, default=1000)
    parser.add_argument("--question-words", type=int, default=60)
    parser.add_argument("--answer-words", type=int, default=150)
    parser.add_argument("--out-tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--router-src", help="run llmgw_router from this src/ folder")
    args = parser.parse_args()
    logs = Path(tempfile.mkdtemp(prefix="bench-precise-cpu-"))
    tokenizer = write_tokenizer(logs / "tokenizer")
    sim = free_port()
    sim_argv = [
        str(BIN / "llmgw-sim"), "vllm", "serve", MODEL, "--host", "127.0.0.1",
        "--port", str(sim), "--max-num-seqs", "1024", "--sim-load-time", "0",
        "--sim-itl", "0", "--sim-ttft", "0",
    ]  # fmt: skip
    best: dict[str, float] = {}
    with serving(
        sim_argv, health=f"http://127.0.0.1:{sim}/health", what="llmgw-sim", log_dir=logs,
        name="sim", timeout=60,
    ):  # fmt: skip
        for r in range(args.rounds):
            for mode in ("approximate", "precise"):
                # A fresh router per round: its caches start empty, as a new conversation's.
                with router(mode, sim, logs, tokenizer, args.router_src) as (port, pid):
                    cpu = measure(port, pid, args, seed=r)
                print(f"round {r + 1} {mode:<12} {cpu * 1e3:7.2f} ms CPU/request", flush=True)
                best[mode] = min(best.get(mode, cpu), cpu)
    ratio = best["precise"] / best["approximate"]
    print(
        f"best: approximate {best['approximate'] * 1e3:.2f} ms, precise "
        f"{best['precise'] * 1e3:.2f} ms, precise/approximate {ratio:.2f}x"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
