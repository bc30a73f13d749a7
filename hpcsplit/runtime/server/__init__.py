"""``runtime.mode=server``: the Open Inference Protocol (KServe v2) endpoint on the frontend rank.

- :mod:`~hpcsplit.runtime.server.protocol`: the model as the protocol describes it (metadata, Triton-style
  config), request checks and tensor (de)coding (JSON, binary extension, gRPC); imports no torch.
- :mod:`~hpcsplit.runtime.server.hub`: the bounded hand-over between the servers' handlers and the
  frontend loop (one event loop); counters, statistics and Prometheus metrics.
- :mod:`~hpcsplit.runtime.server.http_api`, :mod:`~hpcsplit.runtime.server.grpc_api`: aiohttp routes and
  grpc.aio handlers.
- :mod:`~hpcsplit.runtime.server.servers`, :mod:`~hpcsplit.runtime.server.tls`: the two servers of one
  process (TLS or not).
- :mod:`~hpcsplit.runtime.server.worker`, :mod:`~hpcsplit.runtime.server.workers`,
  :mod:`~hpcsplit.runtime.server.channel`: protocol worker processes (``runtime.server_workers``), the
  frontend's side of them, and the framing between the two.
- :mod:`~hpcsplit.runtime.server.serve`: the frontend rank's server mode (the servers and the continuous
  frontend loop on one event loop in the rank's main thread, ``endpoint.json``, drain on SIGTERM).
- :mod:`~hpcsplit.runtime.server.failover`: serving through a lost replica (heartbeats, routing around it,
  its requests sent again, the degraded state) and the token kept across the login side's restarts.

See docs/serving.md.
"""
