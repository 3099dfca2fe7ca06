"""Tenants at the router: per-key admission (requests and tokens per minute, requests
at once, budgets), this router's share of fleet-wide limits, and priority and fair
share when the engines are full.

- limits.py: the pure state of one key's limits (token buckets, reservations);
- fair.py: the pure fair-share queue (bands, virtual time by weight);
- estimate.py: the tokens a request reserves (its prompt's, by the model's tokenizer or
  bytes / 4, plus the completion's bound);
- config.py: the `tenants:` section of the router config;
- gate.py: :class:`~llmgw_router.tenants.gate.Tenancy`, which holds them per key and
  per model and reads the clock;
- reply.py: the x-ratelimit-* headers added to a response;
- metrics.py: per-key series and the queue's.

Keys and shares from the control plane come through llmgw_router.control.keys.
"""
