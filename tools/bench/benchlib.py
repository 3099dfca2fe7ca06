"""What the HTTP benchmarks in tools/bench share: processes and chat-completion load.

The scripts start real programs (simulator, routers) and wait for them to be
healthy, put a fixed number of concurrent aiohttp clients on an OpenAI-style
endpoint for a few seconds, and read how much CPU each watched process used
meanwhile (from /proc: on a shared machine requests/s also measure the
neighbours, CPU per request does not). Each script keeps its own table.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
from llmgw_testkit import Proc, http_get, wait_for

# Load before each measured run, so connections are open and the measurement is steady-state.
WARMUP_SECONDS = 0.3
_DONE = b"data: [DONE]\n\n"


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time of ``pid`` and its threads (children not included)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    # utime and stime are fields 14 and 15 of the whole line.
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def use_uvloop() -> None:
    """Run the load generator on uvloop where it is installed: less client overhead."""
    with contextlib.suppress(ImportError):
        import uvloop

        uvloop.install()


def wait_healthy(proc: Proc, url: str, what: str, *, timeout: float, interval: float) -> None:
    """Wait until ``url`` answers 200; exit the benchmark if ``proc`` dies or the time runs out."""

    def healthy() -> bool:
        if not proc.alive():
            # SystemExit is no Exception, so wait_for lets it through at once.
            raise SystemExit(f"{what} exited with {proc.popen.returncode}:\n{proc.tail()}")
        return http_get(url, timeout=1)[0] == 200

    try:
        wait_for(healthy, timeout=timeout, interval=interval, what=f"{what} at {url}")
    except TimeoutError:
        raise SystemExit(
            f"{what} did not become healthy within {timeout:g} s:\n{proc.tail()}"
        ) from None


@contextlib.contextmanager
def serving(
    argv: Sequence[str],
    *,
    health: str,
    what: str,
    log_dir: Path,
    name: str,
    env: Mapping[str, str] | None = None,
    timeout: float = 30.0,
    interval: float = 0.05,
    grace: float = 10.0,
) -> Iterator[Proc]:
    """A process, in its own process group, once ``health`` answers 200; stopped on exit."""
    with Proc(argv, log_dir=log_dir, name=name, env=env, grace=grace) as proc:
        wait_healthy(proc, health, what, timeout=timeout, interval=interval)
        yield proc


def chat_body(model: str, stream: bool) -> bytes:
    """The request every benchmark sends: 16 tokens, or a 100-token stream with usage."""
    payload: dict[str, object] = {
        "model": model,
        "messages": [{"role": "user", "content": "Say something."}],
        "max_tokens": 100 if stream else 16,
        "stream": stream,
    }
    if stream:
        payload["stream_options"] = {"include_usage": True}
    return json.dumps(payload).encode()


@dataclass
class Run:
    """One measured run: answers, failures, per-request latencies, CPU by process."""

    ok: int = 0
    errors: int = 0
    seconds: float = 0.0
    # Seconds from sending the request to reading its last byte, for answers that were ok.
    latencies: list[float] = field(default_factory=list)
    # CPU seconds each watched process (by label) used during the run.
    cpu: dict[str, float] = field(default_factory=dict)

    @property
    def rps(self) -> float:
        return self.ok / self.seconds if self.seconds else 0.0

    def pct(self, q: float) -> float:
        if not self.latencies:
            return float("nan")
        ordered = sorted(self.latencies)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def _client(
    session: aiohttp.ClientSession, url: str, body: bytes, stream: bool, stop_at: float, run: Run
) -> None:
    """Send one request after another until ``stop_at``, counting each into ``run``."""
    headers = {"Content-Type": "application/json"}
    clock = time.perf_counter
    while time.monotonic() < stop_at:
        start = clock()
        try:
            async with session.post(url, data=body, headers=headers) as resp:
                if stream:
                    # Read raw chunks as a proxy would; only the tail is checked
                    # so the load generator's own parsing does not set the pace.
                    tail = b""
                    async for chunk in resp.content.iter_any():
                        tail = (tail + chunk)[-32:]
                    ok = resp.status == 200 and tail.endswith(_DONE)
                else:
                    await resp.read()
                    ok = resp.status == 200
        except aiohttp.ClientError:
            ok = False
        if ok:
            run.ok += 1
            run.latencies.append(clock() - start)
        else:
            run.errors += 1


async def _clients(
    session: aiohttp.ClientSession,
    url: str,
    body: bytes,
    stream: bool,
    concurrency: int,
    stop_at: float,
    run: Run,
) -> None:
    await asyncio.gather(
        *(_client(session, url, body, stream, stop_at, run) for _ in range(concurrency))
    )


async def chat_load(
    base: str,
    model: str,
    *,
    stream: bool,
    concurrency: int,
    seconds: float,
    pids: Mapping[str, int],
) -> Run:
    """``concurrency`` clients on ``base``'s chat completions for ``seconds`` after a warm-up,
    with the CPU time each process in ``pids`` used meanwhile."""
    body = chat_body(model, stream)
    url = base + "/v1/chat/completions"
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:
        warm_until = time.monotonic() + WARMUP_SECONDS
        await _clients(session, url, body, stream, concurrency, warm_until, Run())
        run = Run()
        cpu_before = {label: cpu_seconds(pid) for label, pid in pids.items()}
        start = time.monotonic()
        await _clients(session, url, body, stream, concurrency, start + seconds, run)
        run.seconds = time.monotonic() - start
        run.cpu = {label: cpu_seconds(pid) - cpu_before[label] for label, pid in pids.items()}
    return run
