"""Streams across engine kills (issue 28's bars): cut streams and the stall a resume adds.

Simulated vLLM engines (greedy: the text is a function of the prompt) behind one
`llmgw-router`; a fixed number of chat streams kept in flight (each ends, the next
starts) while an engine is SIGKILLed every `--kill-every` seconds and started again
(same port) `--down` seconds later. Run twice, side by side: `resume` (the router's
default, `retries.max_resumes: 2`) and the baseline `no resume` (`max_resumes: 0`, the
error event at once, as before). Per run: streams, those hit (their engine, from
`x-sim-name`, killed while they were open), cut (an error event, no `[DONE]`, or the
connection lost), wrong (the text differs from the uninterrupted answer, computed with
the simulator's own generator), and for the hit streams that were not cut the added
stall: the longest gap between two chunks, less the engine's inter-token latency.

    python tools/bench/bench_resume.py [--streams 200] [--seconds 40] [--kill-every 5]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from signal import SIGKILL
from typing import Any

import aiohttp
import msgspec
import yaml
from benchlib import use_uvloop, wait_healthy
from llmgw_sim.model import greedy_tokens
from llmgw_testkit import Proc, free_port

BIN = Path(sys.executable).parent
MODEL = "m1"


@dataclass
class Engine:
    name: str
    port: int
    argv: list[str]
    logs: Path
    proc: Proc | None = None
    kills: list[float] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.proc = Proc(self.argv, log_dir=self.logs, name=self.name)
        wait_healthy(self.proc, self.url + "/health", self.name, timeout=60, interval=0.05)

    def kill(self) -> None:
        assert self.proc is not None
        self.kills.append(time.monotonic())
        self.proc.signal(SIGKILL)
        self.proc.wait(10)
        self.proc.stop()


@contextlib.contextmanager
def engines(logs: Path, count: int, itl: float) -> Iterator[list[Engine]]:
    started: list[Engine] = []
    try:
        for i in range(count):
            port = free_port()
            argv = [str(BIN / "llmgw-sim"), "vllm", "serve", MODEL, "--host", "127.0.0.1"]
            argv += ["--port", str(port), "--sim-load-time", "0", "--sim-name", f"e{i}"]
            argv += ["--sim-itl", str(itl), "--max-num-seqs", "1024"]
            engine = Engine(f"e{i}", port, argv, logs)
            engine.start()
            started.append(engine)
        yield started
    finally:
        for engine in started:
            if engine.proc is not None:
                engine.proc.stop()


@contextlib.contextmanager
def router(logs: Path, ups: list[Engine], max_resumes: int) -> Iterator[str]:
    port, admin = free_port(), free_port()
    config: dict[str, Any] = {
        "listen": f"127.0.0.1:{port}",
        "admin_listen": f"127.0.0.1:{admin}",
        "workers": 1,
        "health_checks": {"interval": "500ms"},
        "retries": {"max_resumes": max_resumes},
        "endpoints": [{"id": e.name, "url": e.url, "models": [MODEL]} for e in ups],
    }
    path = logs / f"router-{port}.yaml"
    path.write_text(yaml.safe_dump(config))
    argv = [str(BIN / "llmgw-router"), "serve", "--config", str(path), "--log-format", "json"]
    proc = Proc(argv, log_dir=logs, name=f"router-{port}")
    try:
        wait_healthy(proc, f"http://127.0.0.1:{admin}/readyz", "router", timeout=60, interval=0.05)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.stop()


@dataclass
class Stream:
    engine: str = ""
    opened: float = 0.0
    closed: float = 0.0
    max_gap: float = 0.0
    cut: bool = False
    wrong: bool = False


class _Delta(msgspec.Struct):
    content: str | None = None


class _Choice(msgspec.Struct):
    delta: _Delta | None = None


class _Chunk(msgspec.Struct):
    choices: list[_Choice] = msgspec.field(default_factory=list)
    error: dict[str, Any] | None = None


_decode = msgspec.json.Decoder(_Chunk).decode


def _expected(content: str, tokens: int) -> str:
    """The uninterrupted answer: the simulator's greedy text for its chat rendering."""
    return "".join(greedy_tokens(f"<|user|>\n{content}\n<|assistant|>\n", tokens))


async def _stream(
    session: aiohttp.ClientSession, url: str, content: str, tokens: int, out: list[Stream]
) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": tokens,
        "stream": True,
    }
    s = Stream(opened=time.monotonic())
    out.append(s)
    text: list[str] = []
    done = False
    last = s.opened
    try:
        async with session.post(url + "/v1/chat/completions", json=body) as resp:
            s.engine = resp.headers.get("x-sim-name", "")
            if resp.status != 200:
                s.cut = True
                return
            async for line in resp.content:
                if not line.startswith(b"data: "):
                    continue
                now = time.monotonic()
                if text:
                    s.max_gap = max(s.max_gap, now - last)
                last = now
                if line.startswith(b"data: [DONE]"):
                    done = True
                    continue
                chunk = _decode(line[6:])
                if chunk.error is not None:
                    s.cut = True
                for choice in chunk.choices:
                    if choice.delta is not None and choice.delta.content:
                        text.append(choice.delta.content)
    except (TimeoutError, aiohttp.ClientError):
        s.cut = True
    finally:
        s.closed = time.monotonic()
    s.cut = s.cut or not done
    s.wrong = not s.cut and "".join(text) != _expected(content, tokens)


async def _load(
    url: str, ups: list[Engine], streams: int, seconds: float, tokens: int, kill_every: float,
    down: float,
) -> list[Stream]:  # fmt: skip
    out: list[Stream] = []
    stop_at = time.monotonic() + seconds
    rng = random.Random(7)
    timeout = aiohttp.ClientTimeout(total=120)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:

        async def client(i: int) -> None:
            n = 0
            while time.monotonic() < stop_at:
                n += 1
                await _stream(
                    session, url, f"Client {i}, story {n}: tell me of the sea.", tokens, out
                )

        async def killer() -> None:
            k = 0
            await asyncio.sleep(kill_every)
            while time.monotonic() < stop_at - kill_every / 2:
                victim = ups[k % len(ups)]
                k += 1
                await asyncio.to_thread(victim.kill)
                await asyncio.sleep(down)
                await asyncio.to_thread(victim.start)
                await asyncio.sleep(max(0.0, kill_every - down + rng.uniform(-0.5, 0.5)))

        tasks = [asyncio.create_task(client(i)) for i in range(streams)]
        await killer()
        await asyncio.gather(*tasks)
    return out


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _row(name: str, streams: list[Stream], ups: list[Engine], itl: float) -> str:
    kills = {e.name: e.kills for e in ups}
    hit = [s for s in streams if any(s.opened < t < s.closed for t in kills.get(s.engine, ()))]
    cut = [s for s in streams if s.cut]
    wrong = [s for s in streams if s.wrong]
    stalls = [max(0.0, s.max_gap - itl) for s in hit if not s.cut]
    return (
        f"| {name} | {len(streams)} | {len(hit)} | {len(cut)} | {len(wrong)} | "
        f"{_pct(stalls, 0.5):.3f} | {_pct(stalls, 0.9):.3f} | "
        f"{max(stalls, default=float('nan')):.3f} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=200, help="streams kept in flight")
    parser.add_argument("--seconds", type=float, default=30.0, help="length of each run")
    parser.add_argument("--engines", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=60, help="max_tokens of each stream")
    parser.add_argument("--itl", type=float, default=0.05, help="engine inter-token latency")
    parser.add_argument("--kill-every", type=float, default=5.0)
    parser.add_argument(
        "--down", type=float, default=1.0, help="seconds a killed engine stays down"
    )
    parser.add_argument("--only", choices=["resume", "baseline"], default=None)
    args = parser.parse_args()
    use_uvloop()
    rows = []
    runs = [("resume", 2), ("no resume (baseline)", 0)]
    if args.only:
        runs = [runs[0] if args.only == "resume" else runs[1]]
    for name, max_resumes in runs:
        with tempfile.TemporaryDirectory(prefix="bench-resume-") as tmp:
            logs = Path(tmp)
            with (
                engines(logs, args.engines, args.itl) as ups,
                router(logs, ups, max_resumes) as url,
            ):
                streams = asyncio.run(
                    _load(url, ups, args.streams, args.seconds, args.tokens, args.kill_every,
                          args.down)
                )  # fmt: skip
                rows.append(_row(name, streams, ups, args.itl))
    print(
        f"{args.streams} streams in flight, {args.engines} engines (itl {args.itl:g} s, "
        f"{args.tokens} tokens), one SIGKILLed every {args.kill_every:g} s for "
        f"{args.down:g} s, {args.seconds:g} s per run"
    )
    print("| run | streams | hit | cut | wrong text | added stall p50 s | p90 s | max s |")
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        print(row)


if __name__ == "__main__":
    main()
