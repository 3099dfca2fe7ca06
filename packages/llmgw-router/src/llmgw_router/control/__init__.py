"""The link to the control plane: watch.py (the `Watch`, `WatchLoad` and `ReportDemand`
streams, several addresses, leader following), translating the wire's messages into
the router's endpoint specs, engine loads and cache changes."""
