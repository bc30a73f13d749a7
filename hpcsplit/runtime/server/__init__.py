"""``runtime.mode=server``: the Open Inference Protocol (KServe v2) endpoint on the frontend rank.

- :mod:`~hpcsplit.runtime.server.protocol`: the model as the protocol describes it (metadata, Triton-style
  config), request checks and tensor (de)coding (JSON, binary extension, gRPC); imports no torch.
- :mod:`~hpcsplit.runtime.server.hub`: the bounded, thread-safe hand-over between the servers' asyncio
  thread and the frontend loop; counters, statistics and Prometheus metrics.
- :mod:`~hpcsplit.runtime.server.http_api`, :mod:`~hpcsplit.runtime.server.grpc_api`: aiohttp routes and
  grpc.aio handlers.
- :mod:`~hpcsplit.runtime.server.serve`: the frontend rank's server mode (start the servers in a thread,
  write ``endpoint.json``, run the continuous frontend loop, drain on SIGTERM).

See docs/serving.md.
"""
