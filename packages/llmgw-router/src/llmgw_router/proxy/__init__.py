"""The request path: a chain of stages (see :mod:`llmgw_router.proxy.app`)."""

from llmgw_router.proxy.app import ProxyApp
from llmgw_router.proxy.context import Incoming, Reply, RequestContext

__all__ = ["Incoming", "ProxyApp", "Reply", "RequestContext"]
