"""Tensor transport between MPI ranks: a small int64 header with the tensors' bytes behind it.

[Note: transport wire format]
A message starts with one MPI message on ``TAG_HEADER``: the header, and behind it, when every tensor is
on the host and their bytes total at most :func:`inline_limit` (8 KiB on one node, 64 KiB between
nodes), every tensor's bytes, each at a 64-byte aligned offset.  A larger message (or one with GPU tensors) sends the header alone, then one
payload per tensor that has bytes on ``TAG_PAYLOAD``, straight from the tensor's memory; MPI's non-overtaking rule (same
source, tag and communicator arrive in order) pairs payloads with their header, so a receiver that posts
the payload receives of each header in the order the headers arrive never mixes two messages.  Which of
the two a message is the receiver reads from its length: it carries inline bytes iff it is longer than
its header.

The header is a flat ``int64`` array (no pickle), zero-padded to a multiple of 8 words (64 bytes)::

    [MAGIC, VERSION, kind, aux, n_req, n_route, n_tensors, n_words,
     request_ids[n_req], routes[n_req * n_route],
     per tensor: slot, rdim, dtype_code, ndim, shape[ndim]]

``request_ids`` number the rows of every tensor of the message (dim 0 is the request dim);
``routes[i]`` is the rank chosen for request ``i`` at every component (see :mod:`routing`), so that
downstream ranks forward without asking the frontend.  ``slot`` is the destination's input index (or
the model output index when the frontend receives); ``rdim`` the tensor dim holding the requests (the
first batch dim of that value; other batch dims, if any, have size 1).

The receiver matches the first message with one ``Improbe``, which gives its source and length, receives
it into one buffer and hands out tensors that view that buffer (inline) or the buffers their separate
payloads land in (pooled, ``buffers.BufferPool``): no copy on either side beyond MPI's own, except the
sender's copy of small tensors behind the header (cheaper than a second MPI message up to the inline
limit; ``docs/runtime.md``, Transport).

GPU tensors: with a CUDA-aware MPI (:func:`cuda_aware_mpi`) the device buffer is handed to MPI after
the producing stream is synchronised; otherwise they are staged through pinned host memory.
"""

from __future__ import annotations

import time
from collections.abc import Container, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import torch

from hpcsplit.core.mpi import MPI
from hpcsplit.errors import RuntimeStageError
from hpcsplit.runtime.buffers import (
    CODE,
    COMPLEX_CODES,
    TensorMeta,
    code_dtype,
    cuda_aware_mpi,
    dtype_code,
    host_bytes,
    host_tensor,
    landing,
    send_buffer,
)
from hpcsplit.runtime.buffers import POOL as _POOL
from hpcsplit.runtime.wire import (
    _ALIGN,
    Header,
    _decode,
    _header_words,
    _new,
    _pack,
    decode_header,
    encode_header,
)

__all__ = [
    "INLINE_MAX",
    "INLINE_MAX_REMOTE",
    "KIND_CONTROL",
    "KIND_DATA",
    "KIND_ERROR",
    "KIND_ROW_ERROR",
    "KIND_STOP",
    "TAG_HEADER",
    "TAG_PAYLOAD",
    "Header",
    "Message",
    "RecvHandle",
    "SendHandle",
    "TensorMeta",
    "code_dtype",
    "cuda_aware_mpi",
    "decode_header",
    "dtype_code",
    "encode_header",
    "in_flight_spin_s",
    "inline_limit",
    "isend_message",
    "poll_message",
    "recv_message",
    "send_message",
    "set_node_peers",
    "take_message",
    "wait_polling",
]

KIND_DATA = 1
KIND_STOP = 2
KIND_ERROR = 3
KIND_CONTROL = 4
KIND_ROW_ERROR = 5  # batch mode: these requests failed in a component (payload: the message); it keeps serving
TAG_HEADER = 7101
TAG_PAYLOAD = 7102
INLINE_MAX = 8 << 10  # tensors' bytes (aligned) up to which they travel behind the header, in one message
INLINE_MAX_REMOTE = 64 << 10  # ... to a rank on another node (see set_node_peers)
_ZEROS = bytes(64)


class Message(NamedTuple):
    """A received message: its source rank, header and tensors (in header order)."""

    source: int
    header: Header
    tensors: tuple[torch.Tensor, ...]


_allocate: Any = MPI.buffer.allocate  # Any: mpi4py's buffer type is not a typing Buffer
_fromaddress: Any = MPI.buffer.fromaddress
_BYTE = MPI.BYTE
_testall = MPI.Request.Testall
_take = _POOL.take
_POOL_MIN = _POOL.min_bytes
_ndarray = np.ndarray
_from_numpy = torch.from_numpy


# --------------------------------------------------------------------------- sending
_REMOTE: tuple[Any, frozenset[int]] = (None, frozenset())  # (comm, its ranks on other nodes than this one)


def set_node_peers(comm: Any, on_this_node: Sequence[int]) -> None:
    """Tell the transport which ranks of ``comm`` share this rank's node (see :func:`inline_limit`)."""
    global _REMOTE
    local = set(on_this_node)
    _REMOTE = (comm, frozenset(r for r in range(comm.Get_size()) if r not in local))


def inline_limit(comm: Any, dest: int) -> int:
    """How many bytes of tensors travel behind the header to ``dest``: ``INLINE_MAX_REMOTE`` (64 KiB) to a
    rank on another node (:func:`set_node_peers`), else ``INLINE_MAX`` (8 KiB).

    Between nodes every MPI message costs a network round of its own (OFI: a few microseconds of system
    calls on each side), so a second message costs more than copying 64 KiB behind the header; on one
    node it costs less than copying more than 8 KiB behind the header and out of MPI's queue.  Without
    :func:`set_node_peers` every rank counts as on this node.
    """
    remote = _REMOTE
    return INLINE_MAX_REMOTE if remote[0] is comm and dest in remote[1] else INLINE_MAX


@dataclass(slots=True)
class SendHandle:
    """Outstanding nonblocking send of one message; keep it until :meth:`test` is true."""

    requests: list[Any]
    keep: list[Any] = field(default_factory=list)
    nbytes: int = 0  # payload bytes (what a blocking wait may spin for, see in_flight_spin_s)

    def test(self) -> bool:
        reqs = self.requests
        if not reqs:
            return True
        if reqs[0].Test() if len(reqs) == 1 else MPI.Request.Testall(reqs):
            self.requests, self.keep = [], []
            return True
        return False

    def wait(self) -> None:
        if self.requests:
            MPI.Request.Waitall(self.requests)
        self.requests, self.keep = [], []


def isend_message(
    comm: Any,
    dest: int,
    kind: int,
    request_ids: Sequence[int] = (),
    routes: Sequence[Sequence[int]] = (),
    tensors: Sequence[tuple[int, torch.Tensor]] | Sequence[tuple[int, torch.Tensor, int]] = (),
    aux: int = 0,
) -> SendHandle:
    """Start sending one message: header, then the tensors' bytes (behind it or one payload each).

    Parameters
    ----------
    comm : mpi4py communicator
    dest : int
        Destination rank.
    kind : int
        ``KIND_DATA``, ``KIND_STOP``, ``KIND_ERROR``, ``KIND_ROW_ERROR`` or ``KIND_CONTROL``.
    request_ids, routes
        One id (and one route) per row of every tensor.
    tensors : sequence of (slot, tensor) or (slot, tensor, rdim)
        Tensors with the requests along ``rdim`` (default 0); made contiguous if needed.
    aux : int
        A free integer (error length, phase number...).

    Returns
    -------
    SendHandle
        Test or wait on it before touching the tensors again (tensors sent inline were copied: they
        may be reused at once).
    """
    words = _header_words(kind, request_ids, routes, len(tensors), aux)
    inline = 0  # the inline bytes so far; -1: a tensor is not on the host
    ts = []  # (tensor whose bytes go, its bytes, on the host)
    for x in tensors:
        t = x[1]
        shape = t.shape
        code = CODE.get(t.dtype) or dtype_code(t.dtype)
        words += (x[0], x[2] if len(x) > 2 else 0, code, len(shape))  # type: ignore[misc]
        words += shape
        nb = t.nbytes
        if t.is_cpu:
            if code in COMPLEX_CODES or not t.is_contiguous():
                t = host_bytes(t)
            if inline >= 0:
                inline += (nb + _ALIGN) & ~_ALIGN
            ts.append((t, nb, True))
        else:
            inline = -1
            ts.append((t, nb, False))
    hdr = _pack(words)
    if 0 <= inline <= inline_limit(comm, dest):
        parts = [hdr]
        for t, nb, _ in ts:
            if nb:
                parts.append(_fromaddress(t.data_ptr(), nb))
                if nb & _ALIGN:
                    parts.append(_ZEROS[: -nb & _ALIGN])
        buf = b"".join(parts)  # one copy of the tensors' bytes, behind the header
        r = comm.Isend(buf, dest, TAG_HEADER)
        if r.Test():  # MPI took it at once (an eager message): nothing to keep
            return _SENT
        return SendHandle([r], [buf], inline)
    keep: list[Any] = [hdr]
    reqs = [comm.Isend(hdr, dest, TAG_HEADER)]  # the header first: non-overtaking orders it before the payloads
    aware: bool | None = None
    nbytes = 0
    for t, nb, cpu in ts:
        if not nb:  # an empty tensor has no payload (its receiver makes it from the header)
            continue
        nbytes += nb
        if cpu:
            reqs.append(comm.Isend(_fromaddress(t.data_ptr(), nb), dest, TAG_PAYLOAD))
            keep.append(t)
            continue
        if t.is_cuda and aware is None:
            aware = cuda_aware_mpi()[0]
        spec, k = send_buffer(t, bool(aware))
        keep += k
        reqs.append(comm.Isend(spec, dest, TAG_PAYLOAD))
    if _testall(reqs):  # all taken at once (eager): nothing to keep
        return _SENT
    return SendHandle(reqs, keep, nbytes)


_SENT = SendHandle([], [], 0)  # the handle of every send that completed within isend_message (shared)


def send_message(comm: Any, dest: int, kind: int, *args: Any, **kwargs: Any) -> None:
    """Blocking form of :func:`isend_message` (waits by polling, see :func:`wait_polling`)."""
    h = isend_message(comm, dest, kind, *args, **kwargs)
    wait_polling(h.test, spin_s=in_flight_spin_s(h.nbytes))


# --------------------------------------------------------------------------- receiving
@dataclass(slots=True)
class RecvHandle:
    """A message being received: its first message still arriving (``header`` None), or its header
    decoded and its separate payloads being received.

    On the host the :class:`Message` is built before the payloads land (its tensors are the landing
    buffers): a large copy evicts the caches, and the Python that runs after it runs cold (a tensor
    made right after a 1 MiB copy costs 3-6x what it costs warm), so nothing but the test is left for then.
    """

    source: int
    header: Header | None
    requests: list[Any]
    tensors: list[torch.Tensor]
    device: torch.device | None = None
    t_start: float = 0.0
    message: Message | None = None
    comm: Any = None  # while the first message arrives: where its payloads will be received
    first: Any = None  # ... and the buffer it lands in

    def test(self) -> Message | None:
        """The message once every part of it has arrived, else None."""
        reqs = self.requests
        if reqs:
            if not (reqs[0].Test() if len(reqs) == 1 else MPI.Request.Testall(reqs)):
                return None
            self.requests = []
        if self.header is None:
            return self._first_arrived()
        return self.message or self._finish()

    def wait(self) -> Message:
        while True:
            if self.requests:
                MPI.Request.Waitall(self.requests)
            m = self.test()
            if m is not None:
                return m

    def cancel(self) -> None:
        """Give up on the rest of the message: cancel its posted receives (their buffers are then free)."""
        for r in self.requests:
            r.Cancel()
        if self.requests:
            MPI.Request.Waitall(self.requests)  # a cancelled receive completes locally
        self.requests = []

    def _first_arrived(self) -> Message | None:
        got = _arrive(self.comm, self.source, self.first, len(self.first), self.device)
        self.comm = self.first = None
        if isinstance(got, RecvHandle):
            self.header, self.requests, self.tensors, self.message = got.header, got.requests, got.tensors, got.message
            return self.test()
        self.header, self.message = got.header, got
        return got

    def _finish(self) -> Message:
        ts = self.tensors
        if self.device is not None and self.device.type == "cuda":
            ts = [t if t.is_cuda else t.to(self.device, non_blocking=True) for t in ts]
        assert self.header is not None
        self.message = Message(self.source, self.header, tuple(ts))
        return self.message


def _arrive(comm: Any, src: int, buf: Any, n: int, device: torch.device | None) -> Message | RecvHandle:
    """A first message received whole: the message (inline), or its payloads posted (separate)."""
    header, lay, hb = _decode(buf, n)
    ts: list[torch.Tensor] = []
    if n > hb:
        if n != hb + lay.inline_bytes:
            raise RuntimeStageError(f"a message from rank {src} of {n} bytes carries {n - hb} bytes behind its "
                                    f"header, which announces {lay.inline_bytes}; sender and receiver differ?")
        for off, npdt, shape, meta, _nb in lay.parts:
            ts.append(host_tensor(buf, hb + off, meta) if npdt is None else
                      _from_numpy(_ndarray(shape, npdt, buf, hb + off)))
        if device is not None and device.type == "cuda":
            ts = [t.to(device, non_blocking=True) for t in ts]
        return _new(Message, (src, header, tuple(ts)))
    if not lay.parts:
        return _new(Message, (src, header, ()))
    reqs = []
    if device is None or device.type != "cuda":
        for _off, npdt, shape, meta, nb in lay.parts:
            if not nb:
                ts.append(torch.empty(shape, dtype=meta.dtype))
                continue
            if nb < _POOL_MIN:  # an exact buffer of its own
                land = _allocate(nb)
                reqs.append(comm.Irecv(land, src, TAG_PAYLOAD))
            else:  # a pooled one of its size class: receive into its first nb bytes
                land = _take(nb)
                reqs.append(comm.Irecv([land, nb, _BYTE], src, TAG_PAYLOAD))
            ts.append(host_tensor(land, 0, meta) if npdt is None else _from_numpy(_ndarray(shape, npdt, land, 0)))
        msg = _new(Message, (src, header, tuple(ts)))
        # the payloads may be here already (and from 256 KiB up on one node this call copies them)
        if reqs[0].Test() if len(reqs) == 1 else _testall(reqs):
            return msg
        return RecvHandle(src, header, reqs, ts, device, time.perf_counter(), msg)
    aware = cuda_aware_mpi()[0]
    if aware:
        # MPI writes device memory outside stream order: the blocks torch.empty hands out must not
        # still be in use by kernels queued on the stream
        torch.cuda.current_stream(device).synchronize()
    for meta in lay.metas:
        t, spec = landing(meta, device, aware)
        ts.append(t)
        if meta.nbytes:
            reqs.append(comm.Irecv(spec, src, TAG_PAYLOAD))
    return RecvHandle(src, header, reqs, ts, device, time.perf_counter(), None)


def take_message(comm: Any, device: torch.device | None, source: int, status: Any,
                 hold: Container[int] = ()) -> Message | RecvHandle | None:
    """If a message is waiting (from ``source``, or ``MPI.ANY_SOURCE``), take it; else None.

    Returns the :class:`Message` when it arrived whole (inline tensors, or none), else a
    :class:`RecvHandle` to test.  Never blocks: one matched probe (``Improbe``, safe with several
    pollers) gives the first message's source and length; it is received into a buffer of that length
    and its separate payloads, if any, are posted at once.  ``status`` is an ``MPI.Status`` to reuse.

    ``hold``: sources whose previous first message is still arriving.  A message from one of them is
    returned as a handle and not decoded until the handles before it are (by testing the handles in
    the order they were taken): its payload receives must be posted after those of the message before,
    or MPI would pair that message's payloads with this one's receives.
    """
    m = comm.Improbe(source, TAG_HEADER, status)
    if m is None:
        return None
    n = status.Get_count(_BYTE)
    buf = _allocate(n)
    r = m.Irecv(buf)
    src = status.Get_source()
    if r.Test():
        if src not in hold:
            return _arrive(comm, src, buf, n, device)
        r = None
    # a large first message still arriving, or one that must wait for the one before it
    return RecvHandle(src, None, [] if r is None else [r], [], device, time.perf_counter(), None, comm, buf)


def poll_message(comm: Any, device: torch.device | None = None, source: int | None = None) -> RecvHandle | None:
    """If a message is waiting, take it (see :func:`take_message`) as a handle to test; else None."""
    got = take_message(comm, device, MPI.ANY_SOURCE if source is None else source, MPI.Status())
    if got is None or isinstance(got, RecvHandle):
        return got
    return RecvHandle(got.source, got.header, [], list(got.tensors), device, time.perf_counter(), got)


def in_flight_spin_s(nbytes: int) -> float:
    """How long a wait may poll back to back while ``nbytes`` of payload are known to be in flight.

    MPICH moves large shared-memory messages only while *both* ranks call into MPI, and a
    ``time.sleep`` of 20 us really sleeps 60-100 us (timer slack), so sleeping while a payload is
    being copied stalls the copy.  The budget is the transfer time at a pessimistic 0.5 GB/s plus
    200 us, at most 50 ms; an idle wait (no payload known) never gets it.

    Examples
    --------
    >>> round(in_flight_spin_s(1 << 20) * 1e6)
    2297
    """
    return min(200e-6 + nbytes / 0.5e9, 0.05)


def wait_polling(ready: Any, timeout_s: float | None = None, max_sleep_s: float = 1e-3,
                 spin_s: float = 50e-6) -> bool:
    """Call ``ready()`` until it is true without busy-waiting for long.

    Polls back to back for ``spin_s`` (a message that is about to arrive costs no sleep), then sleeps
    with exponential backoff from 20 us to ``max_sleep_s``.  An MPI ``Recv``/``Wait`` in MPICH
    busy-polls a whole core instead; this wait costs well under 1% of a core when idle and adds at most
    ``max_sleep_s`` of latency.  Returns False on timeout.
    """
    t0 = time.perf_counter()
    t_end = None if timeout_s is None else t0 + timeout_s
    sleep = 20e-6
    while not ready():
        now = time.perf_counter()
        if t_end is not None and now > t_end:
            return False
        if now - t0 < spin_s:
            continue
        time.sleep(sleep)
        sleep = min(sleep * 2, max_sleep_s)
    return True


def recv_message(comm: Any, source: int | None = None, device: torch.device | None = None,
                 timeout_s: float | None = None, spin_s: float = 50e-6) -> Message:
    """Receive one whole message, waiting without spinning (see :func:`wait_polling`).

    ``timeout_s`` bounds the wait for the message to start, and again for the rest of it once it has
    started (a sender stopped or dead half-way is named); None waits as long as it takes.
    """
    st = MPI.Status()
    src = MPI.ANY_SOURCE if source is None else source
    box: list[Message | RecvHandle] = []

    def _first() -> bool:
        got = take_message(comm, device, src, st)
        if got is not None:
            box.append(got)
            return True
        return False

    if not wait_polling(_first, timeout_s, spin_s=spin_s):
        raise RuntimeStageError(f"no message from {source if source is not None else 'any rank'} "
                                f"within {timeout_s} s")
    h = box[0]
    if not isinstance(h, RecvHandle):
        return h
    # the rest is known to be in flight: poll it back to back for its expected transfer time (a plain
    # loop: the copy runs inside these calls), then fall back to the sleeping wait
    known = sum(t.nbytes for t in h.header.tensors) if h.header is not None else len(h.first)
    t_end = time.perf_counter() + max(spin_s, in_flight_spin_s(known))
    test = h.test
    while time.perf_counter() < t_end:
        m = test()
        if m is not None:
            return m
    done: list[Message] = []

    def _rest() -> bool:
        got = test()
        if got is not None:
            done.append(got)
        return bool(done)

    if not wait_polling(_rest, timeout_s, spin_s=0.0):
        h.cancel()
        what = (f"{len(h.header.tensors)} tensor(s), {known} bytes" if h.header is not None
                else f"its first {known} bytes")
        raise RuntimeStageError(f"rank {h.source} started a message ({what}) that did not arrive whole within "
                                f"{timeout_s} s of its start; is rank {h.source} stopped or dead? (Its later "
                                "messages cannot be paired with their payloads: end the job.)")
    return done[0]
