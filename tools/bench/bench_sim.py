"""Requests/s one llmgw-sim process serves with zero simulated delays.

    python tools/bench/bench_sim.py                 # starts its own simulator
    python tools/bench/bench_sim.py --url http://127.0.0.1:8000 --model m   # any endpoint

Two cases at concurrency 64 over loopback, each a few seconds: non-streaming
chat completions, and 100-token streamed chat completions (read to [DONE]).
The simulator must not be what limits a router benchmark, so compare these
numbers with the router's own benchmark on the same machine.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass

import aiohttp


@dataclass
class Result:
    name: str
    requests: int
    errors: int
    seconds: float

    @property
    def rps(self) -> float:
        return self.requests / self.seconds if self.seconds else 0.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def simulator(extra: list[str]) -> Iterator[str]:
    port = _free_port()
    argv = [
        sys.executable, "-m", "llmgw_sim", "vllm", "serve", "bench-model",
        "--host", "127.0.0.1", "--port", str(port), "--max-num-seqs", "1024", *extra,
    ]  # fmt: skip
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "0"}
    proc = subprocess.Popen(
        argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, start_new_session=True
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"simulator exited with {proc.returncode}: {' '.join(argv)}")
            try:
                with urllib.request.urlopen(url + "/health", timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit("simulator did not become healthy within 30 s")
            time.sleep(0.05)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


async def _worker(
    session: aiohttp.ClientSession,
    url: str,
    body: bytes,
    stream: bool,
    stop_at: float,
    counts: list[int],
) -> None:
    headers = {"Content-Type": "application/json"}
    while time.monotonic() < stop_at:
        try:
            async with session.post(url, data=body, headers=headers) as resp:
                if stream:
                    # Read raw chunks as a proxy would; only the tail is checked
                    # so the load generator's own parsing does not set the pace.
                    tail = b""
                    async for chunk in resp.content.iter_any():
                        tail = (tail + chunk)[-32:]
                    ok = resp.status == 200 and tail.endswith(b"data: [DONE]\n\n")
                else:
                    await resp.read()
                    ok = resp.status == 200
        except aiohttp.ClientError:
            ok = False
        counts[0 if ok else 1] += 1


async def run_case(
    name: str, base: str, model: str, *, stream: bool, concurrency: int, seconds: float
) -> Result:
    payload: dict[str, object] = {
        "model": model,
        "messages": [{"role": "user", "content": "Say something."}],
        "max_tokens": 100 if stream else 16,
        "stream": stream,
    }
    if stream:
        payload["stream_options"] = {"include_usage": True}
    body = json.dumps(payload).encode()
    url = base + "/v1/chat/completions"
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:
        # Warm up connections so the measurement is steady-state.
        warm = [0, 0]
        await asyncio.gather(
            *(
                _worker(session, url, body, stream, time.monotonic() + 0.3, warm)
                for _ in range(concurrency)
            )
        )
        counts = [0, 0]
        start = time.monotonic()
        await asyncio.gather(
            *(
                _worker(session, url, body, stream, start + seconds, counts)
                for _ in range(concurrency)
            )
        )
        elapsed = time.monotonic() - start
    return Result(name, counts[0], counts[1], elapsed)


async def main_async(args: argparse.Namespace, url: str) -> list[Result]:
    results = []
    cases = (("non-streaming", False), ("stream 100 tokens", True))
    for name, stream in cases:
        if args.case != "all" and (args.case == "stream") != stream:
            continue
        results.append(
            await run_case(
                name,
                url,
                args.model,
                stream=stream,
                concurrency=args.concurrency,
                seconds=args.seconds,
            )
        )
    return results


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--url", help="benchmark this endpoint instead of starting a simulator")
    parser.add_argument("--model", default="bench-model")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=4.0, help="per case")
    parser.add_argument("--case", choices=("all", "full", "stream"), default="all")
    parser.add_argument("--json", action="store_true", help="print results as JSON")
    args = parser.parse_args()
    if args.concurrency < 1 or args.seconds <= 0:
        parser.error("--concurrency must be >= 1 and --seconds > 0")
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    with contextlib.ExitStack() as stack:
        url = args.url or stack.enter_context(simulator([]))
        results = asyncio.run(main_async(args, url))
    if args.json:
        print(json.dumps([{**r.__dict__, "rps": round(r.rps, 1)} for r in results]))
    else:
        target = args.url or "llmgw-sim vllm (zero delays)"
        print(f"target: {target}, concurrency {args.concurrency}, {args.seconds:g} s per case")
        for r in results:
            print(f"  {r.name:<18} {r.rps:9.1f} req/s  ({r.requests} ok, {r.errors} errors)")
    return 1 if any(r.errors for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
