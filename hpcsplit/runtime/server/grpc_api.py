"""The v2 gRPC API (``inference.GRPCInferenceService``) on grpc.aio, with the protocol's generated messages
(``tritonclient.grpc.service_pb2``, generated from the published ``grpc_service.proto``).

Every call needs ``authorization: Bearer <token>`` metadata when the server has a token (else
UNAUTHENTICATED, before any work); messages over ``runtime.server_max_body_mb`` are refused by grpc
itself (RESOURCE_EXHAUSTED).  Rejected requests get INVALID_ARGUMENT / NOT_FOUND / UNAVAILABLE with the
same messages as over HTTP.  ``ModelStreamInfer`` (a bidirectional stream of infer requests, Triton's
``--streaming``) admits each request as it arrives, so requests of one stream batch together, and answers
in the stream's order; a rejected request gets a response with ``error_message`` and the stream goes on.
The repository / shared-memory calls are not served (UNIMPLEMENTED).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import numpy as np
from tritonclient.grpc import model_config_pb2 as mc
from tritonclient.grpc import service_pb2 as pb

from hpcsplit.runtime.server.http_api import EXTENSIONS, SERVER_NAME
from hpcsplit.runtime.server.hub import Hub
from hpcsplit.runtime.server.protocol import InferRequest, RequestRejected

__all__ = ["SERVICE", "make_handler"]

SERVICE = "inference.GRPCInferenceService"
_CONTENTS = {"BOOL": "bool_contents", "UINT8": "uint_contents", "UINT16": "uint_contents",
             "UINT32": "uint_contents", "UINT64": "uint64_contents", "INT8": "int_contents",
             "INT16": "int_contents", "INT32": "int_contents", "INT64": "int64_contents",
             "FP32": "fp32_contents", "FP64": "fp64_contents"}


def make_handler(hub: Hub, version: str) -> grpc.GenericRpcHandler:
    """The generic handler serving ``hub``'s model."""
    spec = hub.spec

    async def guard(context: grpc.aio.ServicerContext) -> None:
        if hub.token is None:
            return
        md = dict(context.invocation_metadata() or ())
        if not hub.check_token(md.get("authorization")):
            hub.count(None, "unauthenticated", "grpc")
            await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                                "missing or wrong bearer token (send metadata 'authorization: Bearer <token>')")

    async def reject(context: grpc.aio.ServicerContext, e: RequestRejected) -> None:
        await context.abort(getattr(grpc.StatusCode, e.grpc_code, grpc.StatusCode.INVALID_ARGUMENT), str(e))

    def unary(fn: Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
        async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
            await guard(context)
            try:
                return await fn(request, context)
            except RequestRejected as e:
                if not e.counted:
                    hub.count(None, "rejected", "grpc")
                await reject(context, e)

        return call

    async def server_live(_: Any, __: Any) -> Any:
        return pb.ServerLiveResponse(live=True)

    def degraded(context: grpc.aio.ServicerContext) -> None:
        if hub.degraded:  # still serving, without some replicas ([Note: serving through faults])
            context.set_trailing_metadata((("hpcsplit-state", "degraded"),))

    async def server_ready(_: Any, context: grpc.aio.ServicerContext) -> Any:
        degraded(context)
        return pb.ServerReadyResponse(ready=hub.is_ready())

    async def model_ready(r: Any, context: grpc.aio.ServicerContext) -> Any:
        spec.check_model(r.name, r.version)
        degraded(context)
        return pb.ModelReadyResponse(ready=hub.is_ready())

    async def server_meta(_: Any, __: Any) -> Any:
        return pb.ServerMetadataResponse(name=SERVER_NAME, version=version, extensions=EXTENSIONS)

    async def model_meta(r: Any, _: Any) -> Any:
        spec.check_model(r.name, r.version)
        T = pb.ModelMetadataResponse.TensorMetadata
        return pb.ModelMetadataResponse(
            name=spec.name, versions=[spec.version], platform="hpcsplit",
            inputs=[T(name=t.name, datatype=t.datatype, shape=list(t.shape)) for t in spec.inputs],
            outputs=[T(name=t.name, datatype=t.datatype, shape=list(t.shape)) for t in spec.outputs])

    async def model_config(r: Any, _: Any) -> Any:
        spec.check_model(r.name, r.version)
        c = spec.config()
        cfg = mc.ModelConfig(
            name=c["name"], platform=c["platform"], backend=c["backend"], max_batch_size=c["max_batch_size"],
            input=[mc.ModelInput(name=x["name"], data_type=mc.DataType.Value(x["data_type"]), dims=x["dims"])
                   for x in c["input"]],
            output=[mc.ModelOutput(name=x["name"], data_type=mc.DataType.Value(x["data_type"]), dims=x["dims"])
                    for x in c["output"]],
            dynamic_batching=mc.ModelDynamicBatching())
        return pb.ModelConfigResponse(config=cfg)

    async def model_stats(r: Any, _: Any) -> Any:
        if r.name:
            spec.check_model(r.name, r.version)
        st = (await hub.read_statistics())["model_stats"][0]
        D = pb.StatisticDuration
        inf = pb.InferStatistics(**{k: D(count=v["count"], ns=v["ns"]) for k, v in st["inference_stats"].items()})
        return pb.ModelStatisticsResponse(model_stats=[pb.ModelStatistics(
            name=st["name"], version=st["version"], last_inference=st["last_inference"],
            inference_count=st["inference_count"], execution_count=st["execution_count"], inference_stats=inf)])

    def decode(r: Any) -> InferRequest:
        spec.check_model(r.model_name, r.model_version)
        given: dict[str, tuple[str, list[int]]] = {}
        for x in r.inputs:
            if x.name in given:
                raise RequestRejected(f"input {x.name!r} is given twice")
            given[x.name] = (x.datatype, [int(s) for s in x.shape])
        batch = spec.check_inputs(given)
        raw = list(r.raw_input_contents)
        if raw and len(raw) != len(r.inputs):
            raise RequestRejected(f"{len(raw)} raw_input_contents for {len(r.inputs)} inputs")
        pos = {x.name: i for i, x in enumerate(r.inputs)}
        arrays = []
        for t in spec.inputs:
            x = r.inputs[pos[t.name]]
            shape = given[t.name][1]
            if raw:
                arrays.append(spec.from_bytes(t, shape, raw[pos[t.name]]))
            else:
                field = _CONTENTS.get(t.datatype)
                arrays.append(spec.from_list(t, shape, np.asarray(getattr(x.contents, field)) if field else []))
        outs = spec.check_outputs([o.name for o in r.outputs])
        return InferRequest(r.id, arrays, batch, outs, [True] * len(outs))

    async def infer(r: Any, _: Any) -> Any:
        req = decode(r)
        outputs = await hub.submit(req, "grpc").future  # answered by the frontend loop (http_api's infer)
        resp = pb.ModelInferResponse(model_name=spec.name, model_version=spec.version, id=req.id)
        for j in req.outputs:
            t, a = spec.outputs[j], outputs[j]
            resp.outputs.add(name=t.name, datatype=t.datatype, shape=list(a.shape))
            resp.raw_output_contents.append(np.ascontiguousarray(a).tobytes())
        return resp

    async def stream_one(r: Any) -> Any:
        try:
            return pb.ModelStreamInferResponse(infer_response=await infer(r, None))
        except RequestRejected as e:
            if not e.counted:
                hub.count(None, "rejected", "grpc")
            return pb.ModelStreamInferResponse(error_message=str(e), infer_response=pb.ModelInferResponse(
                model_name=spec.name, model_version=spec.version, id=r.id))

    async def stream_infer(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        """ModelStreamInfer: every request is submitted as it is read; the answers go back in order."""
        await guard(context)
        order: asyncio.Queue[asyncio.Task[Any] | None] = asyncio.Queue()

        async def read() -> None:
            try:
                async for r in requests:
                    order.put_nowait(asyncio.ensure_future(stream_one(r)))
            finally:
                order.put_nowait(None)

        reader = asyncio.ensure_future(read())
        try:
            while (task := await order.get()) is not None:
                yield await task
            await reader  # the client's end of the stream, or its error
        finally:
            reader.cancel()
            while not order.empty():
                left = order.get_nowait()
                if left is not None:
                    left.cancel()

    table = {"ServerLive": (server_live, pb.ServerLiveRequest), "ServerReady": (server_ready, pb.ServerReadyRequest),
             "ModelReady": (model_ready, pb.ModelReadyRequest),
             "ServerMetadata": (server_meta, pb.ServerMetadataRequest),
             "ModelMetadata": (model_meta, pb.ModelMetadataRequest),
             "ModelConfig": (model_config, pb.ModelConfigRequest),
             "ModelStatistics": (model_stats, pb.ModelStatisticsRequest),
             "ModelInfer": (infer, pb.ModelInferRequest)}
    handlers = {name: grpc.unary_unary_rpc_method_handler(unary(fn), request_deserializer=req.FromString,
                                                          response_serializer=lambda m: m.SerializeToString())
                for name, (fn, req) in table.items()}
    handlers["ModelStreamInfer"] = grpc.stream_stream_rpc_method_handler(
        stream_infer, request_deserializer=pb.ModelInferRequest.FromString,
        response_serializer=lambda m: m.SerializeToString())
    return grpc.method_handlers_generic_handler(SERVICE, handlers)
