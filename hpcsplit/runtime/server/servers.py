"""The HTTP (aiohttp) and gRPC (grpc.aio) servers of one process: the frontend rank's own
(``runtime.server_workers=0``) or a protocol worker's (:mod:`~hpcsplit.runtime.server.worker`).

Imports neither torch nor MPI, so a protocol worker starts in a second.
"""

from __future__ import annotations

import asyncio
import sys

import grpc
from aiohttp import web

from hpcsplit.errors import RuntimeStageError
from hpcsplit.runtime.server.grpc_api import make_handler
from hpcsplit.runtime.server.http_api import make_app
from hpcsplit.runtime.server.hub import Hub
from hpcsplit.runtime.server.tls import TlsFiles

__all__ = ["VERSION", "Servers"]

VERSION = "0.1.0"


class Servers:
    """The HTTP and gRPC servers serving ``hub`` on one event loop (``[Note: server mode]``).

    ``reuse_port``: listen with ``SO_REUSEPORT`` beside the other protocol workers (the kernel spreads the
    connections); otherwise a port another process holds is an error, as it should be for one server.
    ``tls``: serve HTTPS and gRPC over TLS with these files.
    """

    def __init__(self, hub: Hub, host: str, http_port: int, grpc_port: int, max_body: int,
                 tls: TlsFiles | None = None, reuse_port: bool = False) -> None:
        self.hub, self.host = hub, host
        self._want = (http_port, grpc_port)
        self.max_body = max_body
        self.tls, self.reuse_port = tls, reuse_port
        self.http_port = self.grpc_port = 0
        self._runner: web.AppRunner | None = None
        self._grpc: grpc.aio.Server | None = None

    async def start(self, timeout_s: float = 30.0) -> None:
        try:
            async with asyncio.timeout(timeout_s):
                await self._start()
        except TimeoutError:
            await self.stop()
            raise RuntimeStageError(f"the HTTP/gRPC servers did not start within {timeout_s:g} s") from None
        except Exception as e:  # noqa: BLE001 - a port taken, an address not this node's: said, with the fix
            await self.stop()
            raise RuntimeStageError(f"could not start the servers on {self.host} (ports {self._want}): "
                                    f"{type(e).__name__}: {e}. Choose other ports (runtime.server_http_port / "
                                    "server_grpc_port; 0 picks free ones) or another runtime.server_host") from None

    async def _start(self) -> None:
        app = make_app(self.hub, self.max_body, VERSION)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self._want[0], backlog=1024,
                           ssl_context=self.tls.http_context() if self.tls else None,
                           reuse_port=self.reuse_port or None)
        await site.start()
        self.http_port = int(self._runner.addresses[0][1])
        opts = [("grpc.max_receive_message_length", self.max_body), ("grpc.max_send_message_length", 1 << 30),
                ("grpc.so_reuseport", int(self.reuse_port))]
        self._grpc = grpc.aio.server(options=opts)
        self._grpc.add_generic_rpc_handlers((make_handler(self.hub, VERSION),))
        addr = f"{self.host}:{self._want[1]}"
        if self.tls is not None:
            self.grpc_port = self._grpc.add_secure_port(addr, self.tls.grpc_credentials())
        else:
            self.grpc_port = self._grpc.add_insecure_port(addr)
        if not self.grpc_port:
            raise OSError(f"gRPC could not bind {addr}")
        await self._grpc.start()

    async def stop(self, timeout_s: float = 10.0) -> None:
        try:
            async with asyncio.timeout(timeout_s):
                if self._grpc is not None:
                    await self._grpc.stop(grace=1.0)
                if self._runner is not None:
                    await self._runner.cleanup()
        except Exception as e:  # noqa: BLE001 - closing anyway
            print(f"server: closing the servers: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        self._grpc = self._runner = None
