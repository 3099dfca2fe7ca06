"""A balancer candidate with fixed figures, for the router's cache_aware tests."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Cand", "usable"]


@dataclass
class Cand:
    id: str
    weight: int = 1
    outstanding: int = 0
    load: float = 0.0
    generation: int = 0
    up: bool = True
    awaiting_first: int = 0
    cache_blocks: int = 0
    pending: float = 0.0
    block_time: float = 0.0
    slot: str = ""

    def load_at(self, now: float) -> float:
        return self.load

    def pending_at(self, now: float) -> float:
        return self.pending


def usable(c: Cand) -> bool:
    return c.up
