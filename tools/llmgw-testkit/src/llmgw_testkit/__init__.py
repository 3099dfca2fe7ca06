"""Helpers for tests that run llmgw's programs as real processes.

Every test that starts a process does it through :class:`Proc`, so the process
lives in its own process group, its output lands in a file the failure report
can show, and it is stopped by pid even when the test fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import socket
import subprocess
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from pathlib import Path
from signal import SIGKILL, SIGTERM
from typing import TypeVar

__all__ = [
    "ENGINE_PORTS",
    "PROGRAM_PORTS",
    "Proc",
    "engine_port_range",
    "free_port",
    "http_get",
    "port_open",
    "wait_for",
    "wait_for_async",
    "worker_slice",
]

T = TypeVar("T")


# The programs' ports (free_port) and the engines' (engine_port_range) come from ranges
# of their own, below Linux's ephemeral ports (32768+ by default). A port that bind(0)
# returns is one the kernel may give an outgoing connection as its source port a moment
# later: a CI run saw a control plane refuse its admin port, taken by a test worker's own
# client connection.
PROGRAM_PORTS = (10000, 20000)
ENGINE_PORTS = (20000, 32000)
# This process's next program port (its slice of PROGRAM_PORTS, taken in turn).
_next_port: list[int] = []


def worker_slice(
    low: int, high: int, worker: str | None = None, workers: int | None = None
) -> tuple[int, int]:
    """Under pytest-xdist (PYTEST_XDIST_WORKER=gwN of PYTEST_XDIST_WORKER_COUNT, unless
    given) worker N's share of [low, high), so two workers never hand out the same port;
    otherwise all of it."""
    if worker is None:
        worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if workers is None:
        workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if worker.startswith("gw") and worker[2:].isdigit():
        count = max(workers, int(worker[2:]) + 1)
        width = (high - low) // count
        low += int(worker[2:]) * width
        high = low + width
    return low, high


@functools.cache
def _ephemeral_low() -> int:
    """The lowest of the kernel's ephemeral ports (read once: it does not change under a
    test run)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago: the next free one of this
    process's slice of :data:`PROGRAM_PORTS` (no port twice until the slice wraps round),
    or the kernel's choice where its ephemeral ports reach down into that range."""
    low, high = worker_slice(*PROGRAM_PORTS)
    if _ephemeral_low() < PROGRAM_PORTS[1] or high - low < 1:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((host, 0))
            return int(sock.getsockname()[1])
    if not _next_port:
        _next_port.append(low + (os.getpid() * 7919) % (high - low))
    for _ in range(high - low):
        port = _next_port[0]
        _next_port[0] = low + (port + 1 - low) % (high - low)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return port
    raise OSError(f"no free port in {low}-{high - 1} on {host}")


def engine_port_range(size: int = 500, salt: int = 97) -> tuple[int, int]:
    """A block of ``size`` engine ports (first, last) for one control plane in a test.

    Under pytest-xdist each worker (PYTEST_XDIST_WORKER=gwN) draws from its own slice of
    :data:`ENGINE_PORTS`, so two tests running at once never hand out the same port; the
    process id moves the block between runs."""
    low, high = worker_slice(*ENGINE_PORTS)
    if high - low < size:
        raise ValueError(f"the workers leave {high - low} engine ports each, under {size}")
    first = low + (os.getpid() * salt) % (high - low - size + 1)
    return first, first + size - 1


def port_open(port: int, host: str = "127.0.0.1") -> bool:
    with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=0.5):
        return True
    return False


def wait_for(
    condition: Callable[[], T | None],
    *,
    timeout: float = 30.0,
    interval: float = 0.05,
    what: str = "condition",
) -> T:
    """Poll ``condition`` until it returns something truthy, or fail at the deadline."""
    deadline = time.monotonic() + timeout
    last_error: BaseException | None = None
    while True:
        try:
            value = condition()
        except Exception as exc:
            last_error = exc
            value = None
        if value:
            return value
        if time.monotonic() >= deadline:
            detail = f" (last error: {last_error!r})" if last_error else ""
            raise TimeoutError(f"timed out after {timeout:.1f}s waiting for {what}{detail}")
        time.sleep(interval)


async def wait_for_async(
    condition: Callable[[], Awaitable[T | None]],
    *,
    timeout: float = 30.0,
    interval: float = 0.05,
    what: str = "condition",
) -> T:
    """Async twin of :func:`wait_for`."""
    deadline = time.monotonic() + timeout
    last_error: BaseException | None = None
    while True:
        try:
            value = await condition()
        except Exception as exc:
            last_error = exc
            value = None
        if value:
            return value
        if time.monotonic() >= deadline:
            detail = f" (last error: {last_error!r})" if last_error else ""
            raise TimeoutError(f"timed out after {timeout:.1f}s waiting for {what}{detail}")
        await asyncio.sleep(interval)


def http_get(url: str, timeout: float = 2.0) -> tuple[int, bytes]:
    """A tiny blocking GET for readiness checks; returns (status, body)."""
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:  # noqa: S310 - loopback only
            return int(resp.status), resp.read()
    except urllib.error.HTTPError as err:
        return int(err.code), err.read()


class Proc:
    """A child process in its own process group, with its output in a log file.

    Use it as a context manager (or call :meth:`stop`): leaving the block
    terminates the whole group by pid, then kills it after ``grace`` seconds.
    """

    def __init__(
        self,
        argv: Sequence[str],
        *,
        log_dir: Path,
        name: str | None = None,
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
        grace: float = 10.0,
    ) -> None:
        self.argv = list(argv)
        self.name = name or Path(self.argv[0]).name
        self.grace = grace
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = log_dir / f"{self.name}-{os.getpid()}-{time.monotonic_ns()}.log"
        full_env = dict(os.environ)
        full_env.setdefault("PYTHONUNBUFFERED", "1")
        if env:
            full_env.update(env)
        self._log = self.log_path.open("wb")
        self.popen = subprocess.Popen(
            self.argv,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=full_env,
            cwd=str(cwd) if cwd else None,
            start_new_session=True,
        )

    @property
    def pid(self) -> int:
        return self.popen.pid

    def output(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def alive(self) -> bool:
        return self.popen.poll() is None

    def wait_output(self, text: str, timeout: float = 30.0) -> None:
        """Wait until ``text`` appears in the output; fail early if the process dies."""

        def seen() -> bool:
            if text in self.output():
                return True
            if not self.alive():
                raise AssertionError(
                    f"{self.name} exited with {self.popen.returncode} before printing {text!r}:\n"
                    f"{self.tail()}"
                )
            return False

        deadline = time.monotonic() + timeout
        while not seen():
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"{self.name} did not print {text!r} within {timeout}s:\n{self.tail()}"
                )
            time.sleep(0.05)

    def tail(self, lines: int = 40) -> str:
        return "\n".join(self.output().splitlines()[-lines:])

    def signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.popen.pid, sig)

    def wait(self, timeout: float = 30.0) -> int:
        return self.popen.wait(timeout=timeout)

    def stop(self, sig: int = SIGTERM) -> int | None:
        """Stop the whole process group: ``sig``, then SIGKILL after the grace period."""
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.popen.pid, sig)
            try:
                self.popen.wait(timeout=self.grace)
            except subprocess.TimeoutExpired:
                pass
        # Children left in the group (engines an agent started, say) go too.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.popen.pid, SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout=5)
        self._log.close()
        return self.popen.returncode

    def __enter__(self) -> Proc:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


@contextlib.contextmanager
def running(argv: Sequence[str], *, log_dir: Path, **kwargs: object) -> Iterator[Proc]:
    proc = Proc(argv, log_dir=log_dir, **kwargs)  # type: ignore[arg-type]
    try:
        yield proc
    finally:
        proc.stop()
