"""Balancing: which endpoint of a model's candidates takes the next request.

Pure: a balancer sees the candidates, a predicate that says which are usable now, an
optional session key, the request's prompt prefix blocks and the time of the choice; it
never reads the clock. Modules: ``base`` (the candidate protocols, :class:`Pick` and its
reasons, the :class:`Balancer` interface), ``simple`` (least outstanding, round robin,
session affinity), ``cache_aware`` (the default), ``index`` (what cache_aware remembers
sending to an endpoint), ``model`` (its capacity and time-to-first-token model), ``placement`` (its shared rule
for prefixes' homes),
``make`` (a balancer by name), ``prefix`` (a prompt as chained block hashes).
"""

from llmgw_router.balancing.base import (
    REASONS,
    Balancer,
    Candidate,
    LoadedCandidate,
    Pick,
)
from llmgw_router.balancing.cache_aware import CacheAware
from llmgw_router.balancing.make import make_balancer
from llmgw_router.balancing.simple import (
    LeastOutstanding,
    RoundRobin,
    SessionAffinity,
    rendezvous_owner,
)

__all__ = [
    "REASONS",
    "Balancer",
    "CacheAware",
    "Candidate",
    "LeastOutstanding",
    "LoadedCandidate",
    "Pick",
    "RoundRobin",
    "SessionAffinity",
    "make_balancer",
    "rendezvous_owner",
]
