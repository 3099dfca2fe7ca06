"""llmgw-sim: vLLM, SGLang and llama.cpp stand-ins at their real interfaces.

Python API for other llmgw parts:

- :func:`llmgw_sim.flags.known_flags` - the option strings accepted per engine kind.
- :func:`llmgw_sim.metrics.parse_prometheus` / :func:`llmgw_sim.metrics.sample` - read a
  ``/metrics`` page.
- :data:`llmgw_sim.server.ERROR_HEADER` and friends - per-request failure injection headers.
"""

from llmgw_sim.flags import ENGINE_KINDS, EngineKind, known_flags

__all__ = ["ENGINE_KINDS", "EngineKind", "known_flags"]
__version__ = "0.1.0"
