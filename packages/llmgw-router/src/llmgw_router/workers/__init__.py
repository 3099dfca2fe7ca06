"""`workers: N`: N router processes on one listening port, under a supervisor.

Modules: worker.py (what a worker runs besides the router: its context, its
SO_REUSEPORT socket, ejection sharing with its peers), supervisor.py (forking,
watching and restarting the workers; `run_router`), fleet_admin.py (the supervisor's
admin listener), merge.py (summing the workers' Prometheus expositions). The
supervisor imports the router (server.py) only in a forked worker; the router imports
only worker.py: no cycle.

With ``workers: 1`` none of this runs: the router is one process, as it always was.
With more, the process started as `llmgw-router serve` becomes the supervisor:

- Each worker is forked from the supervisor, which imports everything first (so a
  worker starts in milliseconds), and runs the whole router of :mod:`llmgw_router.server`
  (event loop, balancer, upstream pool, health checks, its own Watch subscription),
  with its own socket on the listen address (``SO_REUSEPORT``: the kernel spreads
  new connections over the workers' sockets, and nobody shares an accept queue).
  The supervisor binds the address too, without listening, so a port in use is
  reported once and clearly, and the port stays ours while workers restart.
- Why every worker subscribes on its own rather than the supervisor feeding them: a
  worker is then exactly the router that `workers: 1` runs (snapshots, load figures
  and whatever router-side state comes with them need no second transport), a hung
  or restarting supervisor cannot stall the endpoint set, and the control plane is
  built for many routers (N workers cost it N streams, the same as N routers).
- What must agree is shared: the endpoint snapshot comes from the same control plane
  to every worker; an ejection one worker makes is sent at once to the others (a
  datagram per peer over Unix sockets in the supervisor's private runtime
  directory), so an endpoint that one worker saw fail is not hammered by the rest;
  API keys come from the same config and keys file (SIGHUP re-reads it in every
  worker). Affinity hashing is deterministic (blake2b, never the per-process
  ``hash()``), so every worker sends a key to the same endpoint.
- The supervisor owns the admin listener. It answers `/metrics` by scraping every
  worker's own admin app (a Unix socket each) and summing counters and histograms
  (gauges: `in_flight` summed, views of the fleet such as endpoint states taken
  once), so the hot path keeps prometheus-client's plain in-memory values instead of
  its multiprocess mode's mmap writes per observation. A worker that dies keeps its
  last scraped counts in the sum, so totals never go backwards. `/v1/endpoints` sums
  each endpoint's outstanding requests over the workers; `/v1/workers` lists them.
- A worker that dies is started again, after 0 s, then 0.5 s, 1 s, ... up to 30 s
  while it keeps dying young. One that cannot start at all when the router starts
  (no worker ever came up) ends the router with its error.
- SIGTERM/SIGINT: `/readyz` fails at once, every worker gets SIGTERM and drains
  (in-flight streams finish within `shutdown_grace`), then the supervisor exits.
  SIGHUP is passed to every worker.
"""
