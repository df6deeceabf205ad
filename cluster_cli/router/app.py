"""The router behind ``clusterctl serve-router``: ``Router``, built from a ``RouterConfig``.

Its parts, by job: ``lifecycle`` (start and stop, live reload, the sweeper and the other
background tasks), ``routes`` (which path a request takes, API keys, model lookup, the
routes the router answers itself) and ``forward`` (the forwarding loop: pick an endpoint,
send, relay the answer, retry elsewhere).
"""

from __future__ import annotations

from cluster_cli.router.routes import Router

__all__ = ["Router"]
