"""The reference servers of ``python -m hpcsplit.bench server`` (:mod:`hpcsplit.bench.server`): the echo
(canned answers, no parsing, no pipeline: the ceiling of the protocol stack in Python on the machine at
hand) and the hop servers (the echo with one round trip to a do-nothing peer process per infer).  Each
runs as ``python -m hpcsplit.bench server --echo-server PORTFILE [--hop wait|spin]``; ``GET /count``
answers how many infers it served (the bench's CPU per request).
"""

from __future__ import annotations

import asyncio
import json
import socket
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import grpc
import numpy as np
from aiohttp import web
from tritonclient.grpc import model_config_pb2 as mc
from tritonclient.grpc import service_pb2 as pb

__all__ = ["echo_main"]


# ------------------------------------------------------------------------------------------- echo
_HOP = struct.Struct("<QI")  # a hop's frame: request number, payload length; then the payload

# The hop's peer: sends back whatever it reads (whole frames or not: the echo side reassembles them).
# "spin": after a message it polls without blocking for 2 ms before it waits in recv again.
_PEER = """
import socket, sys, time
s = socket.socket(fileno=int(sys.argv[1]))
spin = sys.argv[2] == "spin"
last = 0.0
while True:
    if spin and time.perf_counter() - last < 0.002:
        try:
            d = s.recv(1 << 20, socket.MSG_DONTWAIT)
        except BlockingIOError:
            continue
    else:
        d = s.recv(1 << 20)
    if not d:
        break
    s.sendall(d)
    last = time.perf_counter()
"""


class _Hop(asyncio.Protocol):
    """The echo side of a hop: :meth:`call` sends a frame (the frames of one loop turn leave in one write)
    and resolves when the peer has sent it back; if the peer goes, every call waiting fails."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.out: list[bytes] = []
        self.waiting: dict[int, asyncio.Future[bytes]] = {}
        self.n = 0
        self.buf = bytearray()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def call(self, payload: bytes) -> asyncio.Future[bytes]:
        if self.transport is None or self.transport.is_closing():
            raise ConnectionError("the hop's peer is gone")
        self.n += 1
        fut = self.waiting[self.n] = self.loop.create_future()
        if not self.out:
            self.loop.call_soon(self._flush)
        self.out += (_HOP.pack(self.n, len(payload)), payload)
        return fut

    def _flush(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(b"".join(self.out))
        self.out.clear()

    def data_received(self, data: bytes) -> None:
        b = self.buf
        b += data
        at = 0
        while len(b) - at >= _HOP.size:
            n, size = _HOP.unpack_from(b, at)
            if len(b) - at - _HOP.size < size:
                break
            fut = self.waiting.pop(n, None)
            if fut is not None and not fut.done():
                fut.set_result(bytes(b[at + _HOP.size:at + _HOP.size + size]))
            at += _HOP.size + size
        del b[:at]

    def connection_lost(self, exc: Exception | None) -> None:
        for fut in self.waiting.values():
            if not fut.done():
                fut.set_exception(ConnectionError("the hop's peer is gone"))
        self.waiting.clear()


def echo_main(port_file: str, hop: str | None = None) -> None:
    """The echo server: canned answers for the calls perf_analyzer makes (a subprocess of the bench); with
    ``hop`` ("wait" or "spin"), each infer goes to a peer process and back first."""
    meta = {"name": "echo", "versions": ["1"], "platform": "echo",
            "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 8]}],
            "outputs": [{"name": "output", "datatype": "FP32", "shape": [-1, 8]}]}
    config = {"name": "echo", "max_batch_size": 64, "input": [{"name": "x", "data_type": "TYPE_FP32", "dims": [8]}],
              "output": [{"name": "output", "data_type": "TYPE_FP32", "dims": [8]}]}
    out = np.zeros((1, 8), np.float32)
    json_body = json.dumps({"model_name": "echo", "model_version": "1", "outputs": [
        {"name": "output", "datatype": "FP32", "shape": [1, 8], "data": out.reshape(-1).tolist()}]}).encode()
    head = json.dumps({"model_name": "echo", "model_version": "1", "outputs": [
        {"name": "output", "datatype": "FP32", "shape": [1, 8],
         "parameters": {"binary_data_size": out.nbytes}}]}).encode()

    hops: list[_Hop] = []  # the hop, once the loop runs
    mine = peer = None
    if hop is not None:  # the peer ends when this process's end of the socketpair closes
        mine, theirs = socket.socketpair()
        peer = subprocess.Popen([sys.executable, "-c", _PEER, str(theirs.fileno()), hop], pass_fds=(theirs.fileno(),))
        theirs.close()

    served = [0]  # infers answered (GET /count)

    async def infer(request: web.Request) -> web.Response:
        await request.read()
        served[0] += 1
        if hops:
            await hops[0].call(out.tobytes())
        if "Inference-Header-Content-Length" in request.headers:
            return web.Response(body=head + out.tobytes(), content_type="application/octet-stream",
                                headers={"Inference-Header-Content-Length": str(len(head))})
        return web.Response(body=json_body, content_type="application/json")

    async def j(obj: Any) -> web.Response:
        return web.json_response(obj)

    app = web.Application()
    app.add_routes([web.get("/v2", lambda _: j({"name": "echo", "version": "1", "extensions": []})),
                    web.get("/v2/models/echo", lambda _: j(meta)),
                    web.get("/v2/models/echo/config", lambda _: j(config)),
                    web.post("/v2/models/echo/infer", infer),
                    web.get("/count", lambda _: j({"served": served[0]}))])
    T = pb.ModelMetadataResponse.TensorMetadata
    g_meta = pb.ModelMetadataResponse(name="echo", versions=["1"], platform="echo",
                                      inputs=[T(name="x", datatype="FP32", shape=[-1, 8])],
                                      outputs=[T(name="output", datatype="FP32", shape=[-1, 8])])
    g_cfg = pb.ModelConfigResponse(config=mc.ModelConfig(
        name="echo", max_batch_size=64, input=[mc.ModelInput(name="x", data_type=mc.TYPE_FP32, dims=[8])],
        output=[mc.ModelOutput(name="output", data_type=mc.TYPE_FP32, dims=[8])]))
    g_resp = pb.ModelInferResponse(model_name="echo", model_version="1")
    g_resp.outputs.add(name="output", datatype="FP32", shape=[1, 8])
    g_resp.raw_output_contents.append(out.tobytes())

    async def g_infer(_: Any, __: Any) -> Any:
        served[0] += 1
        if hops:
            await hops[0].call(out.tobytes())
        return g_resp

    async def g_stream(requests: Any, _: Any) -> Any:  # perf_analyzer matches a stream's answers by id
        async for r in requests:
            served[0] += 1
            if hops:
                await hops[0].call(out.tobytes())
            resp = pb.ModelStreamInferResponse()
            resp.infer_response.CopyFrom(g_resp)
            resp.infer_response.id = r.id
            yield resp

    def h(fn: Any, req: Any) -> Any:
        return grpc.unary_unary_rpc_method_handler(fn, request_deserializer=req.FromString,
                                                   response_serializer=lambda m: m.SerializeToString())

    async def const(x: Any) -> Any:
        async def f(_: Any, __: Any) -> Any:
            return x
        return f

    async def main() -> None:
        if mine is not None:
            loop = asyncio.get_running_loop()
            _, proto = await loop.create_connection(lambda: _Hop(loop), sock=mine)
            hops.append(proto)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        server = grpc.aio.server()
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("inference.GRPCInferenceService", {
            "ModelMetadata": h(await const(g_meta), pb.ModelMetadataRequest),
            "ModelConfig": h(await const(g_cfg), pb.ModelConfigRequest),
            "ServerMetadata": h(await const(pb.ServerMetadataResponse(name="echo", version="1")),
                                pb.ServerMetadataRequest),
            "ModelInfer": h(g_infer, pb.ModelInferRequest),
            "ModelStreamInfer": grpc.stream_stream_rpc_method_handler(
                g_stream, request_deserializer=pb.ModelInferRequest.FromString,
                response_serializer=lambda m: m.SerializeToString())}),))
        gport = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        tmp = Path(port_file + ".tmp")  # whole or not there: the bench reads it once it exists
        tmp.write_text(json.dumps({"http_port": runner.addresses[0][1], "grpc_port": gport}))
        tmp.replace(port_file)
        await asyncio.Event().wait()

    try:
        asyncio.run(main())
    finally:
        if peer is not None:
            peer.kill()
            peer.wait()
