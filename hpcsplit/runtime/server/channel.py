"""The channel between a protocol worker and the MPI frontend (``runtime.server_workers``): one ``AF_UNIX``
stream socketpair per worker, frames of ``[length u32][kind u8][body]``.

[Note: protocol worker channel]
A worker checks a request (token, body size, names, datatypes, shapes: the same code as the frontend's
own servers), then sends it as one ``REQ`` frame: its number, arrival time (``time.perf_counter``, the
node's monotonic clock, which the frontend shares, so deadlines and latency count from the worker's
arrival), batch, protocol, outputs wanted and the input arrays' bytes.  The frontend answers with ``ANS``
(the requested outputs: dtype, shape, bytes) or ``ERR`` (HTTP status, gRPC code, message).  Both sides
gather the frames of one event-loop turn and send them with one write (:class:`Link`), so a batch of
requests or answers costs one ``sendto`` and, on the other side, one ``recv`` and one parse pass; an
input array arrives as a view of the received bytes (no copy until the frontend joins the rows of a
pipeline batch).  Rare frames (counts, state, metrics queries, start and stop) carry JSON.

The frontend trusts no frame: a body whose length, batch or outputs do not fit the served model is a
:class:`ChannelError`, and the frontend drops that worker (its clients' connections end with it).
"""

from __future__ import annotations

import asyncio
import json
import struct
from collections.abc import Sequence
from typing import Any

import numpy as np

from hpcsplit.errors import RuntimeStageError
from hpcsplit.runtime.server.protocol import InferRequest, ModelSpec, RequestRejected, TensorInfo

__all__ = ["PROTOCOLS", "ChannelError", "Link", "decode_answer", "decode_request", "encode_answer",
           "encode_request", "frame", "json_frame", "spec_from_dict", "spec_to_dict"]

_HEAD = struct.Struct("<IB")  # body length, kind
_REQ = struct.Struct("<IdIBHH")  # seq, arrival, batch, protocol, outputs, id bytes
_ANS = struct.Struct("<IH")  # seq, arrays
_ARR = struct.Struct("<B4s")  # ndim, dtype (numpy's str, '<f4')
MAX_FRAME = 1 << 31  # 2 GiB: above any body a server accepts (runtime.server_max_body_mb)
PROTOCOLS = ("http", "grpc")

# worker -> frontend
REQ, COUNT, QUERY, READY = 1, 2, 3, 4
# frontend -> worker
ANS, ERR, STATE, REPLY, STOP, CONFIG = 11, 12, 13, 14, 15, 16


class ChannelError(RuntimeStageError):
    """A frame that does not fit the channel's format or the served model."""


def frame(kind: int, *parts: bytes | memoryview) -> list[bytes | memoryview]:
    """A frame as the parts to write (header first)."""
    return [_HEAD.pack(sum(len(p) for p in parts), kind), *parts]


def json_frame(kind: int, obj: Any) -> list[bytes | memoryview]:
    return frame(kind, json.dumps(obj, separators=(",", ":")).encode())


# ------------------------------------------------------------------------------------- the model
def spec_to_dict(spec: ModelSpec) -> dict[str, Any]:
    def t(x: TensorInfo) -> list[Any]:
        return [x.name, x.datatype, list(x.shape), x.bdim]

    return {"name": spec.name, "version": spec.version, "max_batch_size": spec.max_batch_size,
            "inputs": [t(x) for x in spec.inputs], "outputs": [t(x) for x in spec.outputs]}


def spec_from_dict(d: dict[str, Any]) -> ModelSpec:
    def t(x: list[Any]) -> TensorInfo:
        return TensorInfo(str(x[0]), str(x[1]), tuple(int(s) for s in x[2]), int(x[3]))

    return ModelSpec(d["name"], tuple(t(x) for x in d["inputs"]), tuple(t(x) for x in d["outputs"]),
                     int(d["max_batch_size"]), d["version"])


# ----------------------------------------------------------------------------------- requests
def encode_request(seq: int, t_arrival: float, protocol: int, req: InferRequest) -> list[bytes | memoryview]:
    """A checked request as a ``REQ`` frame's parts (its arrays as they are: views of the client's body)."""
    rid = req.id.encode()[:65535]
    meta = (_REQ.pack(seq, t_arrival, req.batch, protocol, len(req.outputs), len(rid))
            + struct.pack(f"<{len(req.outputs)}H{len(req.outputs)}B", *req.outputs, *req.binary) + rid)
    arrays = [np.ascontiguousarray(a).data.cast("B") for a in req.arrays]
    return frame(REQ, meta, *arrays)


def decode_request(spec: ModelSpec, body: memoryview) -> tuple[int, float, int, InferRequest]:
    """``(seq, arrival, protocol, request)`` of a ``REQ`` body; its arrays are views of ``body``."""
    if len(body) < _REQ.size:
        raise ChannelError(f"a request frame of {len(body)} bytes is shorter than its header")
    seq, t_arr, batch, proto, n_out, n_id = _REQ.unpack_from(body)
    at = _REQ.size
    if not 1 <= batch <= spec.max_batch_size or proto >= len(PROTOCOLS) or n_out > len(spec.outputs):
        raise ChannelError(f"a request frame with batch {batch}, protocol {proto}, {n_out} outputs does not fit "
                           f"the model (batch 1..{spec.max_batch_size}, {len(spec.outputs)} outputs)")
    sizes = [batch * int(np.prod(t.shape[1:], dtype=np.int64)) * t.dtype.itemsize for t in spec.inputs]
    want = at + 3 * n_out + n_id + sum(sizes)
    if len(body) != want:
        raise ChannelError(f"a request frame of {len(body)} bytes; its header says {want}")
    fields = struct.unpack_from(f"<{n_out}H{n_out}B", body, at)
    outs, binary = list(fields[:n_out]), [bool(b) for b in fields[n_out:]]
    if any(j >= len(spec.outputs) for j in outs):
        raise ChannelError(f"a request frame asks for outputs {outs} of {len(spec.outputs)}")
    at += 3 * n_out
    rid = bytes(body[at:at + n_id]).decode("utf-8", "replace")
    at += n_id
    arrays = []
    for t, size in zip(spec.inputs, sizes, strict=True):
        arrays.append(np.frombuffer(body, dtype=t.dtype, count=size // t.dtype.itemsize, offset=at)
                      .reshape((batch, *t.shape[1:])))
        at += size
    return seq, t_arr, proto, InferRequest(rid, arrays, batch, outs, binary)


# ------------------------------------------------------------------------------------ answers
def encode_answer(seq: int, outputs: Sequence[np.ndarray]) -> list[bytes | memoryview]:
    """An ``ANS`` frame's parts: the arrays (the requested outputs, in the request's order)."""
    parts: list[bytes | memoryview] = [_ANS.pack(seq, len(outputs))]
    for a in outputs:
        a = np.ascontiguousarray(a)
        parts.append(_ARR.pack(a.ndim, a.dtype.str.encode()) + struct.pack(f"<{a.ndim}q", *a.shape))
        parts.append(a.data.cast("B") if a.size else b"")
    return frame(ANS, *parts)


def decode_answer(body: memoryview) -> tuple[int, list[np.ndarray]]:
    """``(seq, arrays)`` of an ``ANS`` body; the arrays are views of ``body``."""
    seq, n = _ANS.unpack_from(body)
    at = _ANS.size
    out = []
    for _ in range(n):
        ndim, dt = _ARR.unpack_from(body, at)
        at += _ARR.size
        shape = struct.unpack_from(f"<{ndim}q", body, at)
        at += 8 * ndim
        dtype = np.dtype(dt.rstrip(b"\0").decode())
        count = int(np.prod(shape, dtype=np.int64))
        out.append(np.frombuffer(body, dtype=dtype, count=count, offset=at).reshape(shape))
        at += count * dtype.itemsize
    return seq, out


def error_frame(seq: int, err: RequestRejected) -> list[bytes | memoryview]:
    return json_frame(ERR, [seq, err.http_status, err.grpc_code, str(err)])


def decode_error(body: memoryview) -> tuple[int, RequestRejected]:
    seq, status, code, msg = json.loads(bytes(body))
    err = RequestRejected(str(msg), int(status), str(code))
    err.counted = True  # the frontend counted it
    return int(seq), err


# --------------------------------------------------------------------------------------- links
class Link(asyncio.Protocol):
    """One end of a channel: :meth:`send` gathers the frames of one loop turn into one write; received
    bytes are cut into frames for :meth:`on_frames` (a whole batch at a time)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self._out: list[bytes | memoryview] = []
        self._buf = bytearray()
        self._need = 0  # bytes the partial frame in _buf needs before it is whole
        self.closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def send(self, parts: list[bytes | memoryview]) -> None:
        if self.closed:
            return
        if not self._out:
            self.loop.call_soon(self.flush)
        self._out += parts

    def flush(self) -> None:
        if self._out and self.transport is not None and not self.transport.is_closing():
            self.transport.write(b"".join(self._out))
        self._out.clear()

    def data_received(self, data: bytes) -> None:
        buf = self._buf
        if buf:
            buf += data
            if len(buf) < self._need:
                return
            src = bytes(buf)
            buf.clear()
        else:
            src = data
        mv = memoryview(src)
        at, end = 0, len(src)
        frames: list[tuple[int, memoryview]] = []
        while end - at >= _HEAD.size:
            n, kind = _HEAD.unpack_from(src, at)
            if n > MAX_FRAME:
                self.broken(ChannelError(f"a frame of {n} bytes (at most {MAX_FRAME})"))
                return
            if end - at - _HEAD.size < n:
                self._need = _HEAD.size + n
                break
            frames.append((kind, mv[at + _HEAD.size:at + _HEAD.size + n]))
            at += _HEAD.size + n
        else:
            self._need = _HEAD.size
        if at < end:
            buf += mv[at:]
        if frames:
            try:
                self.on_frames(frames)
            except ChannelError as e:
                self.broken(e)

    def on_frames(self, frames: list[tuple[int, memoryview]]) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def broken(self, err: ChannelError) -> None:
        """A frame that does not fit: the channel closes (``connection_lost`` follows)."""
        self.closed = True
        if self.transport is not None:
            self.transport.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
