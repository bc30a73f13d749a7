"""The protocol workers' channel (``[Note: protocol worker channel]``): frames round-trip, arrive cut
anywhere, and a frame that does not fit the model is refused."""

from __future__ import annotations

import asyncio
import struct

import numpy as np
import pytest

from hpcsplit.runtime.server import channel as ch
from hpcsplit.runtime.server.protocol import InferRequest, ModelSpec, RequestRejected, TensorInfo
from hpcsplit.runtime.server.workers import auto_workers

SPEC = ModelSpec("m", (TensorInfo("x", "FP32", (-1, 3), 0), TensorInfo("k", "INT64", (-1, 2), 0)),
                 (TensorInfo("y", "FP32", (-1, 3), 0), TensorInfo("s", "FP16", (-1, 1), 1)), 8)


def _req(batch: int = 2) -> InferRequest:
    return InferRequest("id-ü", [np.arange(3 * batch, dtype=np.float32).reshape(batch, 3),
                                 np.arange(2 * batch, dtype=np.int64).reshape(batch, 2)], batch, [1, 0], [True, False])


class _Collect(ch.Link):
    def __init__(self) -> None:
        super().__init__(asyncio.new_event_loop())
        self.got: list[tuple[int, bytes]] = []
        self.errors: list[ch.ChannelError] = []

    def on_frames(self, frames: list[tuple[int, memoryview]]) -> None:
        self.got += [(k, bytes(b)) for k, b in frames]

    def broken(self, err: ch.ChannelError) -> None:
        self.errors.append(err)


def _wire(parts: list[bytes | memoryview]) -> bytes:
    return b"".join(parts)


def test_request_and_answer_round_trip() -> None:
    req = _req()
    body = _wire(ch.encode_request(7, 12.5, 1, req))[5:]
    seq, t, proto, back = ch.decode_request(SPEC, memoryview(body))
    assert (seq, t, proto, back.id, back.batch, back.outputs, back.binary) == (7, 12.5, 1, "id-ü", 2, [1, 0],
                                                                               [True, False])
    for a, b in zip(req.arrays, back.arrays, strict=True):
        np.testing.assert_array_equal(a, b)
        assert a.dtype == b.dtype
    outs = [np.ones((2, 1), np.float16), np.zeros((2, 3), np.float32)[:, ::2]]  # a non-contiguous one
    seq, arrays = ch.decode_answer(memoryview(_wire(ch.encode_answer(9, outs))[5:]))
    assert seq == 9 and [a.dtype for a in arrays] == [np.float16, np.float32]
    np.testing.assert_array_equal(arrays[1], outs[1])
    seq, err = ch.decode_error(memoryview(_wire(ch.error_frame(3, RequestRejected("full", 503, "UNAVAILABLE")))[5:]))
    assert (seq, err.http_status, err.grpc_code, str(err), err.counted) == (3, 503, "UNAVAILABLE", "full", True)
    assert ch.spec_from_dict(ch.spec_to_dict(SPEC)) == SPEC


@pytest.mark.parametrize("cut", [1, 3, 5, 17, 1000])
def test_frames_cut_anywhere_arrive_whole(cut: int) -> None:
    wire = _wire(ch.encode_request(1, 0.0, 0, _req(1)) + ch.json_frame(ch.COUNT, ["http", "rejected"])
                 + ch.encode_request(2, 0.0, 0, _req(8)))
    link = _Collect()
    for at in range(0, len(wire), cut):
        link.data_received(wire[at:at + cut])
    assert [k for k, _ in link.got] == [ch.REQ, ch.COUNT, ch.REQ] and not link.errors
    assert ch.decode_request(SPEC, memoryview(link.got[2][1]))[3].batch == 8


def test_frames_that_do_not_fit_are_refused() -> None:
    body = bytearray(_wire(ch.encode_request(1, 0.0, 0, _req()))[5:])
    with pytest.raises(ch.ChannelError, match="header says"):
        ch.decode_request(SPEC, memoryview(bytes(body[:-1])))
    bad = bytearray(body)
    struct.pack_into("<I", bad, 12, 9)  # batch 9 > max_batch_size 8
    with pytest.raises(ch.ChannelError, match="batch 9"):
        ch.decode_request(SPEC, memoryview(bytes(bad)))
    bad = bytearray(body)
    struct.pack_into("<H", bad, ch._REQ.size, 5)  # output 5 of 2
    with pytest.raises(ch.ChannelError, match="outputs"):
        ch.decode_request(SPEC, memoryview(bytes(bad)))
    link = _Collect()
    link.data_received(struct.pack("<IB", ch.MAX_FRAME + 1, ch.REQ))
    assert link.errors and not link.got


def test_auto_workers() -> None:
    assert [auto_workers(c, u) for c, u in ((2, 2), (3, 2), (16, 3), (4, 8))] == [0, 1, 4, 0]
