"""llmgw's wire protocol and the few helpers every llmgw program shares.

- :mod:`llmgw_proto.v1`: the generated messages and grpclib stubs of ``llmgw.v1``.
- :mod:`llmgw_proto.backoff`: jittered exponential backoff, the one used everywhere.
- :mod:`llmgw_proto.tls`: TLS contexts for both streams.
- :mod:`llmgw_proto.config`: loading YAML/TOML config files into msgspec Structs.
- :mod:`llmgw_proto.logs`: structlog set up once per program.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("llmgw-proto")
except PackageNotFoundError:  # pragma: no cover - running from a source tree
    __version__ = "0.0.0"

__all__ = ["__version__"]
