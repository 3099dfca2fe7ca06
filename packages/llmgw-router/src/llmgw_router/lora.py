"""LoRA adapters, the router's side (issue 30).

The control plane declares each model's adapters (DeclaredModel.adapters) and relays
which adapters each engine holds with its load figures (EndpointLoad.adapters). A
request whose `model` names an adapter goes to the replicas of its base model that
hold it, balanced as every request is (the bounded-load rule of cache_aware among
them). None holds it: the request is held (hold.py) and the router reports demand,
as for a model scaled to zero; the control plane loads the adapter on the least loaded
replica, and the request goes on as soon as a load report shows a holder. Every
adapter request is counted and reported (``DemandRequest.requests``), so the control
plane gives a hot adapter more holders: that is how traffic above the bound spills, to
a replica that loads it; a replica without the adapter would answer 404.

`/v1/models` lists each adapter with its base model as `parent`, as vLLM does. A
prefix under one adapter is not cached under another: the prefix blocks of an
adapter's request are keyed on the adapter too.

The engines name the adapter differently. vLLM serves an adapter as a model of its own
(`model` is the adapter's name, and an unknown name is a 404). SGLang's OpenAI routes
answer any `model` with the base model: they take the adapter from a `model` of
``base:adapter`` or from the body's ``lora_path``. So a request an SGLang engine gets
carries ``lora_path``: the adapter the request names (the name it was allow-listed
under), and none for the base model, whatever the client wrote there (a client's own
``lora_path`` would choose an adapter past the key's allow-list).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec

__all__ = [
    "LoraBook",
    "adapter_entries",
    "apply_adapters",
    "holders",
    "keyed_prompt",
    "sglang_adapter",
    "sglang_adapter_body",
]


@dataclass
class LoraBook:
    """Per router: adapter requests counted since the last demand report, and the wake."""

    requests: dict[str, int] = field(default_factory=dict)
    # Wakes the demand reporter (set by the control watcher).
    wake: Callable[[], None] | None = None

    def count(self, adapter: str) -> None:
        first = not self.requests
        self.requests[adapter] = self.requests.get(adapter, 0) + 1
        if first and self.wake is not None:
            # Only the first since the last report: a busy adapter is reported once an
            # interval, not once a request.
            self.wake()

    def take(self) -> dict[str, int]:
        taken, self.requests = self.requests, {}
        return taken


def holders(adapter: str, base: Iterable[Any]) -> tuple[Any, ...]:
    """The endpoints among ``base`` (its base model's) whose engine holds ``adapter``."""
    return tuple(ep for ep in base if adapter in ep.adapters)


def adapter_entries(
    adapters: Mapping[str, str], allowed: Callable[[str], bool], created: int
) -> list[dict[str, Any]]:
    """`/v1/models` entries of the adapters a caller may use, each with its `parent`."""
    return [
        {
            "id": name,
            "object": "model",
            "created": created,
            "owned_by": "llmgw",
            "root": name,
            "parent": base,
        }
        for name, base in sorted(adapters.items())
        if allowed(name)
    ]


def keyed_prompt(adapter: str, text: bytes) -> bytes:
    """The prompt text as an adapter's prefix blocks hash it: the adapter first, so no
    block of it matches the base model's or another adapter's."""
    return b"\x00lora:" + adapter.encode() + b"\x00" + text


def apply_adapters(
    by_id: Mapping[str, Any], held: Iterable[tuple[str, Iterable[str]]], full: bool
) -> bool:
    """What each endpoint's engine holds, from a load update (a full one forgets the rest);
    True when any endpoint's set changed (held requests look again)."""
    changed = False
    seen: set[str] = set()
    for endpoint_id, names in held:
        seen.add(endpoint_id)
        ep = by_id.get(endpoint_id)
        if ep is None:
            continue
        now_held = frozenset(names)
        if now_held != ep.adapters:
            ep.adapters = now_held
            changed = True
    if full:
        for endpoint_id, ep in by_id.items():
            if endpoint_id not in seen and ep.adapters:
                ep.adapters = frozenset()
                changed = True
    return changed


def sglang_adapter(body: dict[str, Any], adapter: str) -> dict[str, Any]:
    """An SGLang engine's request body: ``lora_path`` the adapter (``""``: the base model,
    and no ``lora_path`` at all)."""
    out = {k: v for k, v in body.items() if k != "lora_path"}
    if adapter:
        out["lora_path"] = adapter
    return out


def sglang_adapter_body(body: bytes, adapter: str) -> bytes:
    """``sglang_adapter`` on a JSON body. Unchanged when it needs no change (a base-model
    request whose body cannot name ``lora_path``: no such key, and no ``\\u`` escape that
    could spell one) or is not a JSON object (the engine answers that itself)."""
    if not adapter and b"lora_path" not in body and b"\\u" not in body:
        return body
    try:
        decoded = msgspec.json.decode(body)
    except msgspec.DecodeError:
        return body
    if not isinstance(decoded, dict):
        return body
    if not adapter and "lora_path" not in decoded:
        return body
    return msgspec.json.encode(sglang_adapter(decoded, adapter))
