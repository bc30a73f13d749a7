"""Tensor transport between MPI ranks: a small int64 header, then raw contiguous buffers.

[Note: transport wire format]
One message = one header on ``TAG_HEADER`` followed by one payload per tensor on ``TAG_PAYLOAD``, all
from the same source to the same destination.  MPI's non-overtaking rule (same source, tag and
communicator arrive in order) pairs payloads with their header, so a receiver that posts the payload
receives of each header in the order the headers arrive never mixes two messages.

The header is a flat ``int64`` array (no pickle)::

    [MAGIC, VERSION, kind, aux, n_req, n_route, n_tensors,
     request_ids[n_req], routes[n_req * n_route],
     per tensor: slot, rdim, dtype_code, ndim, shape[ndim]]

``request_ids`` number the rows of every tensor of the message (dim 0 is the request dim);
``routes[i]`` is the rank chosen for request ``i`` at every component (see :mod:`routing`), so that
downstream ranks forward without asking the frontend.  ``slot`` is the destination's input index (or
the model output index when the frontend receives); ``rdim`` the tensor dim holding the requests (the
first batch dim of that value; other batch dims, if any, have size 1).  Payloads travel as ``MPI.BYTE`` views of the
tensors' memory; receivers allocate the tensor first and receive straight into it (no copy).

GPU tensors: with a CUDA-aware MPI (:func:`cuda_aware_mpi`) the device buffer is handed to MPI after
the producing stream is synchronised; otherwise they are staged through pinned host memory.
"""

from __future__ import annotations

import ctypes
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from hpcsplit.core.mpi import MPI
from hpcsplit.errors import RuntimeStageError

__all__ = [
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
    "isend_message",
    "poll_message",
    "recv_message",
    "send_message",
    "wait_polling",
]

MAGIC = 0x48535054  # "HSPT"
VERSION = 1
KIND_DATA = 1
KIND_STOP = 2
KIND_ERROR = 3
KIND_CONTROL = 4
KIND_ROW_ERROR = 5  # batch mode: these requests failed in a component (payload: the message); it keeps serving
TAG_HEADER = 7101
TAG_PAYLOAD = 7102
_FIXED = 7

_DTYPES: tuple[torch.dtype, ...] = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
    torch.complex128,
)
_CODE = {dt: i + 1 for i, dt in enumerate(_DTYPES)}
_ITEMSIZE = {dt: torch.empty((), dtype=dt).element_size() for dt in _DTYPES}
_NP_DTYPE = {dt: torch.empty((), dtype=dt).numpy().dtype for dt in _DTYPES if dt != torch.bfloat16}
_NP_CODE = {np.dtype(npdt): _CODE[dt] for dt, npdt in _NP_DTYPE.items()}  # numpy dtype -> wire code


def dtype_code(dtype: torch.dtype) -> int:
    """Wire code of a torch dtype.

    Examples
    --------
    >>> code_dtype(dtype_code(torch.bfloat16))
    torch.bfloat16
    """
    code = _CODE.get(dtype)
    if code is not None:
        return code
    try:
        return _CODE[dtype]
    except KeyError:
        raise RuntimeStageError(
            f"the transport cannot send dtype {dtype}; it sends {[str(d) for d in _DTYPES]}. "
            "Cast the component's outputs to one of those."
        ) from None


def code_dtype(code: int) -> torch.dtype:
    """Torch dtype of a wire code (inverse of :func:`dtype_code`)."""
    if not 1 <= code <= len(_DTYPES):
        raise RuntimeStageError(f"unknown dtype code {code} in a message header; sender and receiver differ?")
    return _DTYPES[code - 1]


@dataclass(frozen=True, slots=True)
class TensorMeta:
    """Destination slot, request dim, dtype and shape of one tensor of a message."""

    slot: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    rdim: int = 0  # the dim along which the message's requests lie

    @property
    def nbytes(self) -> int:
        n = _ITEMSIZE[self.dtype]
        for s in self.shape:
            n *= s
        return n


@dataclass(frozen=True, slots=True)
class Header:
    """Decoded message header (see ``[Note: transport wire format]``)."""

    kind: int
    request_ids: tuple[int, ...] = ()
    routes: tuple[tuple[int, ...], ...] = ()
    tensors: tuple[TensorMeta, ...] = ()
    aux: int = 0


def encode_header(h: Header) -> np.ndarray:
    """Pack a :class:`Header` into a flat int64 array.

    Examples
    --------
    >>> h = Header(KIND_DATA, (7, 8), ((1, 2), (1, 3)), (TensorMeta(0, torch.float32, (4, 2), 1),))
    >>> decode_header(encode_header(h)) == h
    True
    """
    n_req = len(h.request_ids)
    n_route = len(h.routes[0]) if h.routes else 0
    if h.routes and (len(h.routes) != n_req or any(len(r) != n_route for r in h.routes)):
        raise RuntimeStageError(f"header routes {h.routes} do not give one route per request {h.request_ids}")
    parts: list[int] = [MAGIC, VERSION, h.kind, h.aux, n_req, n_route, len(h.tensors)]
    parts.extend(h.request_ids)
    for r in h.routes:
        parts.extend(r)
    for t in h.tensors:
        parts.extend((t.slot, t.rdim, dtype_code(t.dtype), len(t.shape)))
        parts.extend(t.shape)
    return np.asarray(parts, dtype=np.int64)


_META_CACHE: dict[tuple[int, ...], TensorMeta] = {}  # header words -> TensorMeta (messages repeat shapes)


def decode_header(a: np.ndarray) -> Header:
    """Unpack an int64 header array (inverse of :func:`encode_header`)."""
    v = a.tolist()
    if len(v) < _FIXED or v[0] != MAGIC or v[1] != VERSION:
        raise RuntimeStageError(
            f"received a message header that is not hpcsplit transport v{VERSION} (first words {v[:4]}); "
            "are two different hpcsplit versions running in one job?"
        )
    kind, aux, n_req, n_route, n_t = v[2], v[3], v[4], v[5], v[6]
    i = _FIXED + n_req
    ids = tuple(v[_FIXED:i])
    if n_route:
        routes = tuple(tuple(v[j : j + n_route]) for j in range(i, i + n_req * n_route, n_route))
        i += n_req * n_route
    else:
        routes = ()
    tensors = []
    for _ in range(n_t):
        end = i + 4 + v[i + 3]
        key = tuple(v[i:end])
        meta = _META_CACHE.get(key)
        if meta is None:
            code = v[i + 2]
            if not 1 <= code <= len(_DTYPES):
                code_dtype(code)  # raises with the message
            meta = TensorMeta(v[i], _DTYPES[code - 1], tuple(v[i + 4 : end]), v[i + 1])
            if len(_META_CACHE) < 4096:
                _META_CACHE[key] = meta
        tensors.append(meta)
        i = end
    return Header(kind, ids, routes, tuple(tensors), aux)


# --------------------------------------------------------------------------- CUDA-aware detection
_CUDA_AWARE: bool | None = None
_YES, _NO = frozenset({"1", "true", "yes", "on"}), frozenset({"0", "false", "no", "off", ""})
_CUDA_AWARE_WHY = ""


def cuda_aware_mpi() -> tuple[bool, str]:
    """Whether MPI can take CUDA device buffers, and how that was decided.

    ``HPCSPLIT_CUDA_AWARE_MPI=0|1`` overrides; otherwise ``MPIX_GPU_query_support`` /
    ``MPIX_Query_cuda_support`` from the MPI library, then ``MPICH_GPU_SUPPORT_ENABLED`` (Cray MPICH).
    """
    global _CUDA_AWARE, _CUDA_AWARE_WHY
    if _CUDA_AWARE is not None:
        return _CUDA_AWARE, _CUDA_AWARE_WHY
    env = os.environ.get("HPCSPLIT_CUDA_AWARE_MPI")
    if env is not None:
        word = env.strip().lower()
        if word not in _YES | _NO:
            raise RuntimeStageError(
                f"HPCSPLIT_CUDA_AWARE_MPI={env!r} is neither on ({'/'.join(sorted(_YES))}) nor off "
                f"({'/'.join(sorted(_NO))}); set it to 1 only if this MPI takes CUDA device buffers, or unset it "
                "to ask the MPI library"
            )
        _CUDA_AWARE, _CUDA_AWARE_WHY = word in _YES, "HPCSPLIT_CUDA_AWARE_MPI"
        return _CUDA_AWARE, _CUDA_AWARE_WHY
    found: bool | None = None
    why = "no MPIX query in the MPI library"
    try:
        lib = ctypes.CDLL(MPI.__file__)
        if hasattr(lib, "MPIX_GPU_query_support"):
            out = ctypes.c_int(0)
            # MPIX_GPU_SUPPORT_CUDA == 0 in MPICH's mpi_proto.h
            if lib.MPIX_GPU_query_support(ctypes.c_int(0), ctypes.byref(out)) == 0:
                found, why = bool(out.value), "MPIX_GPU_query_support"
        if found is None and hasattr(lib, "MPIX_Query_cuda_support"):
            found, why = bool(lib.MPIX_Query_cuda_support()), "MPIX_Query_cuda_support"
    except OSError as e:  # pragma: no cover - exotic MPI builds
        why = f"could not query the MPI library ({e})"
    if found is None and os.environ.get("MPICH_GPU_SUPPORT_ENABLED") == "1":
        found, why = True, "MPICH_GPU_SUPPORT_ENABLED=1"
    _CUDA_AWARE, _CUDA_AWARE_WHY = bool(found), why
    return _CUDA_AWARE, _CUDA_AWARE_WHY


# --------------------------------------------------------------------------- buffers
def _byte_view(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor's memory (no copy)."""
    t = t.reshape(-1)
    if t.dtype == torch.bool:
        return t.view(torch.uint8)
    return t.view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8, device=t.device)


def _mpi_buffer(t: torch.Tensor) -> list[Any]:
    """``[buffer, MPI.BYTE]`` for a contiguous uint8 tensor (CPU: numpy view; CUDA: the tensor)."""
    if t.is_cuda:
        return [t, t.numel(), MPI.BYTE]
    return [t.numpy(), MPI.BYTE]


def _send_buffer(t: torch.Tensor, cuda_aware: bool) -> tuple[list[Any], list[Any]]:
    """MPI buffer spec for ``t`` and the objects that must stay alive until the send completes."""
    if not t.is_contiguous():
        t = t.contiguous()
    if t.is_cuda:
        # several slices can share one GPU: the producer stream must be done before MPI reads
        torch.cuda.current_stream(t.device).synchronize()
        if not cuda_aware:
            host = torch.empty(t.numel() * t.element_size(), dtype=torch.uint8, pin_memory=True)
            host.copy_(_byte_view(t))
            return _mpi_buffer(host), [host]
    elif t.dtype in _NP_DTYPE and not t.requires_grad:
        a = t.numpy()  # fast path: numpy exposes the bytes, MPI.BYTE counts them
        return [a, MPI.BYTE], [t, a]
    b = _byte_view(t)
    return _mpi_buffer(b), [t, b]


@dataclass(slots=True)
class SendHandle:
    """Outstanding nonblocking send of one message; keep it until :meth:`test` is true."""

    requests: list[Any]
    keep: list[Any] = field(default_factory=list)
    nbytes: int = 0  # payload bytes (what a blocking wait may spin for, see in_flight_spin_s)

    def test(self) -> bool:
        if not self.requests:
            return True
        if MPI.Request.Testall(self.requests):
            self.requests, self.keep = [], []
            return True
        return False

    def wait(self) -> None:
        if self.requests:
            MPI.Request.Waitall(self.requests)
        self.requests, self.keep = [], []


@dataclass(frozen=True, slots=True)
class Message:
    """A received message: its source rank, header and tensors (in header order)."""

    source: int
    header: Header
    tensors: tuple[torch.Tensor, ...]


@dataclass(slots=True)
class RecvHandle:
    """A message whose header has arrived and whose payloads are being received.

    On the host the :class:`Message` is built before the payloads land (its tensors are the landing
    buffers): a large copy evicts the caches, and the Python that runs after it runs cold (a tensor
    made right after a 1 MiB copy costs 3-6x what it costs warm), so nothing but the test is left for then.
    """

    source: int
    header: Header
    requests: list[Any]
    tensors: list[torch.Tensor]
    device: torch.device | None = None
    t_start: float = 0.0
    message: Message | None = None

    def test(self) -> Message | None:
        """The message once every payload has arrived, else None."""
        if self.requests:
            if not MPI.Request.Testall(self.requests):
                return None
            self.requests = []
        return self.message or self._finish()

    def wait(self) -> Message:
        if self.requests:
            MPI.Request.Waitall(self.requests)
        self.requests = []
        return self.message or self._finish()

    def _finish(self) -> Message:
        ts = self.tensors
        if self.device is not None and self.device.type == "cuda":
            ts = [t if t.is_cuda else t.to(self.device, non_blocking=True) for t in ts]
        self.message = Message(self.source, self.header, tuple(ts))
        return self.message


def isend_message(
    comm: Any,
    dest: int,
    kind: int,
    request_ids: Sequence[int] = (),
    routes: Sequence[Sequence[int]] = (),
    tensors: Sequence[tuple[int, torch.Tensor]] | Sequence[tuple[int, torch.Tensor, int]] = (),
    aux: int = 0,
) -> SendHandle:
    """Start sending one message: header, then one raw payload per ``(slot, tensor)``.

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
        Test or wait on it before touching the tensors again.
    """
    n_route = len(routes[0]) if routes else 0
    if routes and (len(routes) != len(request_ids) or any(len(r) != n_route for r in routes)):
        raise RuntimeStageError(f"header routes {routes} do not give one route per request {request_ids}")
    parts: list[int] = [MAGIC, VERSION, kind, int(aux), len(request_ids), n_route, len(tensors)]
    parts += request_ids
    for r in routes:
        parts += r
    keep: list[Any] = []
    bufs: list[Any] = []
    aware: bool | None = None
    nbytes = 0
    for x in tensors:
        t = x[1]
        rdim = x[2] if len(x) > 2 else 0  # type: ignore[misc]
        try:
            # fast path (the common case, a CPU tensor without grad of a numpy dtype): one torch call,
            # numpy gives shape, dtype and bytes; raises for CUDA, grad, bfloat16, conj/neg views
            a = t.numpy()
            code = _NP_CODE[a.dtype]
        except (TypeError, RuntimeError, KeyError):
            a = None
        if a is not None and a.flags.c_contiguous:
            parts += (x[0], rdim, code, a.ndim)
            parts += a.shape
            nbytes += a.nbytes
            bufs.append([a, MPI.BYTE])
            keep += (t, a)
            continue
        nbytes += t.nbytes
        code = _CODE.get(t.dtype) or dtype_code(t.dtype)
        parts += (x[0], rdim, code, t.ndim)
        parts += t.shape
        if t.is_cuda and aware is None:
            aware = cuda_aware_mpi()[0]
        buf, k = _send_buffer(t, bool(aware))
        bufs.append(buf)
        keep.extend(k)
    hdr = np.array(parts, dtype=np.int64)
    keep.append(hdr)
    reqs = [comm.Isend([hdr, MPI.INT64_T], dest=dest, tag=TAG_HEADER)]
    for buf in bufs:
        reqs.append(comm.Isend(buf, dest=dest, tag=TAG_PAYLOAD))
    return SendHandle(reqs, keep, nbytes)


def send_message(comm: Any, dest: int, kind: int, *args: Any, **kwargs: Any) -> None:
    """Blocking form of :func:`isend_message` (waits by polling, see :func:`wait_polling`)."""
    h = isend_message(comm, dest, kind, *args, **kwargs)
    wait_polling(h.test, spin_s=in_flight_spin_s(h.nbytes))


class _BufferPool:
    """Reusable host receive buffers, so large payloads do not page-fault fresh memory every time.

    A buffer is a numpy uint8 array; tensors handed out are ``torch.from_numpy`` views of it, which
    hold a reference to it.  A buffer is free again when nothing but the pool refers to it
    (``sys.getrefcount``), i.e. when every tensor made from it (and every view of those) is gone.
    Sizes are rounded up to quarter-octave classes; at most ``max_bytes`` are kept.
    """

    def __init__(self, min_bytes: int = 64 << 10, max_bytes: int = 2 << 30, per_class: int = 64) -> None:
        self.min_bytes, self.max_bytes, self.per_class = min_bytes, max_bytes, per_class
        self.free: dict[int, list[np.ndarray]] = {}
        self._classes: dict[int, int] = {}  # nbytes -> size class (payload sizes repeat)
        self.held_bytes = 0
        self.hits = 0
        self.misses = 0

    @staticmethod
    def size_class(nbytes: int) -> int:
        """Round up to the next of 4 steps per power of two (at most 25% waste).

        Examples
        --------
        >>> [_BufferPool.size_class(n) for n in (1000, 1024, 1025, 1 << 20, (1 << 20) + 1)]
        [1024, 1024, 1280, 1048576, 1310720]
        """
        if nbytes <= 1:
            return 1
        top = 1 << (nbytes - 1).bit_length()
        step = max(top // 8, 1)
        return -(-nbytes // step) * step

    def take(self, nbytes: int) -> np.ndarray:
        if nbytes < self.min_bytes:
            return np.empty(nbytes, dtype=np.uint8)
        cls = self._classes.get(nbytes)
        if cls is None:
            cls = self.size_class(nbytes)
            if len(self._classes) < 4096:
                self._classes[nbytes] = cls
        bufs = self.free.get(cls)
        if bufs is None:
            bufs = self.free[cls] = []
        for b in bufs:
            if sys.getrefcount(b) == 3:  # the list, the loop variable, getrefcount's argument
                self.hits += 1
                return b[:nbytes]
        self.misses += 1
        b = np.empty(cls, dtype=np.uint8)
        if len(bufs) < self.per_class and self.held_bytes + cls <= self.max_bytes:
            bufs.append(b)
            self.held_bytes += cls
        return b[:nbytes]


_POOL = _BufferPool()


def _alloc(meta: TensorMeta, device: torch.device | None, aware: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The tensor a payload lands in, and the uint8 view MPI writes to."""
    if device is not None and device.type == "cuda":
        if aware:
            t = torch.empty(meta.shape, dtype=meta.dtype, device=device)
        else:
            t = torch.empty(meta.shape, dtype=meta.dtype, pin_memory=True)
        return t, _byte_view(t)
    nbytes = meta.nbytes
    buf = _POOL.take(nbytes)
    npdt = _NP_DTYPE.get(meta.dtype)
    if npdt is not None and nbytes:
        return torch.from_numpy(np.ndarray(meta.shape, npdt, buf)), buf  # type: ignore[return-value]
    raw = torch.from_numpy(buf)
    t = raw.view(meta.dtype).view(meta.shape) if nbytes else torch.empty(meta.shape, dtype=meta.dtype)
    return t, raw


_HDR_BUF = np.empty(512, dtype=np.int64)  # headers land here (decode copies them out)


def poll_message(comm: Any, device: torch.device | None = None, source: int | None = None) -> RecvHandle | None:
    """If a header is waiting, receive it and post the payload receives; else return None.

    Never blocks: uses a matched probe (``Improbe``), so it is safe with several pollers.  The payload
    receives are posted at once, before returning: a sender's payload is matched as soon as MPI sees it.
    """
    st = MPI.Status()
    m = comm.Improbe(source=MPI.ANY_SOURCE if source is None else source, tag=TAG_HEADER, status=st)
    if m is None:
        return None
    n = st.Get_count(MPI.INT64_T)
    hdr_arr = _HDR_BUF[:n] if n <= len(_HDR_BUF) else np.empty(n, dtype=np.int64)
    m.Recv([hdr_arr, MPI.INT64_T])
    hdr = decode_header(hdr_arr)
    source = st.Get_source()
    aware = cuda_aware_mpi()[0] if device is not None and device.type == "cuda" else False
    if aware and hdr.tensors:
        # MPI writes device memory outside stream order: the blocks torch.empty hands out must not
        # still be in use by kernels queued on the stream
        torch.cuda.current_stream(device).synchronize()
    reqs, tensors = [], []
    for meta in hdr.tensors:
        t, view = _alloc(meta, device, aware)
        tensors.append(t)
        buf = [view, MPI.BYTE] if isinstance(view, np.ndarray) else _mpi_buffer(view)
        reqs.append(comm.Irecv(buf, source=source, tag=TAG_PAYLOAD))
    on_host = device is None or device.type != "cuda"
    msg = Message(source, hdr, tuple(tensors)) if on_host else None
    return RecvHandle(source, hdr, reqs, tensors, device, time.perf_counter(), msg)


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
    """Receive one whole message, waiting without spinning (see :func:`wait_polling`)."""
    box: list[RecvHandle] = []

    def _hdr() -> bool:
        h = poll_message(comm, device, source)
        if h is not None:
            box.append(h)
        return bool(box)

    if not wait_polling(_hdr, timeout_s, spin_s=spin_s):
        raise RuntimeStageError(f"no message from {source if source is not None else 'any rank'} "
                                f"within {timeout_s} s")
    h = box[0]
    m = h.test()
    if m is not None:
        return m
    # the payload is known to be in flight: poll it back to back for its expected transfer time
    # (a plain loop: the copy runs inside these calls), then fall back to the sleeping wait
    t_end = time.perf_counter() + max(spin_s, in_flight_spin_s(sum(t.nbytes for t in h.header.tensors)))
    test = h.test
    while time.perf_counter() < t_end:
        m = test()
        if m is not None:
            return m
    done: list[Message] = []

    def _pay() -> bool:
        got = test()
        if got is not None:
            done.append(got)
        return bool(done)

    wait_polling(_pay, spin_s=0.0)
    return done[0]
