"""The transport's buffers: dtype codes, CUDA-aware MPI detection, send buffers, the receive-buffer pool.

:mod:`~hpcsplit.runtime.transport` moves tensors as raw bytes; this module says which dtypes it can move
(and their wire codes), how a tensor's memory is handed to MPI (a view of its bytes on the host; the device
pointer with a CUDA-aware MPI; pinned host memory otherwise), and where received payloads land (pooled host
buffers, reused once every tensor viewing them is gone).
"""

from __future__ import annotations

import ctypes
import os
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from hpcsplit.core.mpi import MPI
from hpcsplit.errors import RuntimeStageError

__all__ = ["DTYPES", "BufferPool", "TensorMeta", "code_dtype", "cuda_aware_mpi", "dtype_code"]

DTYPES: tuple[torch.dtype, ...] = (
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
CODE = {dt: i + 1 for i, dt in enumerate(DTYPES)}  # torch dtype -> wire code
ITEMSIZE = {dt: torch.empty((), dtype=dt).element_size() for dt in DTYPES}
NP_DTYPE = {dt: torch.empty((), dtype=dt).numpy().dtype for dt in DTYPES if dt != torch.bfloat16}
COMPLEX_CODES = frozenset({CODE[torch.complex64], CODE[torch.complex128]})  # may carry a conj/neg bit


def dtype_code(dtype: torch.dtype) -> int:
    """Wire code of a torch dtype.

    Examples
    --------
    >>> code_dtype(dtype_code(torch.bfloat16))
    torch.bfloat16
    """
    code = CODE.get(dtype)
    if code is not None:
        return code
    raise RuntimeStageError(
        f"the transport cannot send dtype {dtype}; it sends {[str(d) for d in DTYPES]}. "
        "Cast the component's outputs to one of those."
    )


def code_dtype(code: int) -> torch.dtype:
    """Torch dtype of a wire code (inverse of :func:`dtype_code`)."""
    if not 1 <= code <= len(DTYPES):
        raise RuntimeStageError(f"unknown dtype code {code} in a message header; sender and receiver differ?")
    return DTYPES[code - 1]


@dataclass(frozen=True, slots=True)
class TensorMeta:
    """Destination slot, request dim, dtype and shape of one tensor of a message."""

    slot: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    rdim: int = 0  # the dim along which the message's requests lie

    @property
    def nbytes(self) -> int:
        n = ITEMSIZE[self.dtype]
        for s in self.shape:
            n *= s
        return n


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


# --------------------------------------------------------------------------- send buffers
def host_bytes(t: torch.Tensor) -> torch.Tensor:
    """The tensor whose memory holds ``t``'s values as plain contiguous bytes: ``t`` itself when it is
    contiguous with no conj/neg bit (a complex view whose bytes are not yet conjugated), else a copy on
    ``t``'s device.  Its ``data_ptr`` and ``nbytes`` are what MPI sends."""
    if not t.is_contiguous():
        t = t.contiguous()
    if CODE.get(t.dtype) in COMPLEX_CODES and (t.is_conj() or t.is_neg()):
        t = t.resolve_conj().resolve_neg()
    return t


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor's memory (no copy)."""
    t = t.reshape(-1)
    if t.dtype == torch.bool:
        return t.view(torch.uint8)
    return t.view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8, device=t.device)


def mpi_buffer(t: torch.Tensor) -> list[Any]:
    """``[buffer, MPI.BYTE]`` for a contiguous uint8 tensor (CPU: numpy view; CUDA: the tensor)."""
    if t.is_cuda:
        return [t, t.numel(), MPI.BYTE]
    return [t.numpy(), MPI.BYTE]


def send_buffer(t: torch.Tensor, cuda_aware: bool) -> tuple[list[Any], list[Any]]:
    """MPI buffer spec for ``t`` and the objects that must stay alive until the send completes.

    A host tensor is sent from its own memory (no copy unless it is not contiguous).  A GPU tensor: the
    producing stream is synchronised first; with a CUDA-aware MPI its device memory goes to MPI, else a
    pinned host copy.
    """
    t = host_bytes(t)
    if t.is_cuda:
        # several slices can share one GPU: the producer stream must be done before MPI reads
        torch.cuda.current_stream(t.device).synchronize()
        if not cuda_aware:
            host = torch.empty(t.numel() * t.element_size(), dtype=torch.uint8, pin_memory=True)
            host.copy_(byte_view(t))
            return mpi_buffer(host), [host]
        b = byte_view(t)
        return mpi_buffer(b), [t, b]
    if not t.is_cpu:
        raise RuntimeStageError(f"the transport sends host and CUDA tensors, not {t.device} ones; move the "
                                "component's outputs to the host or a CUDA device")
    return [MPI.buffer.fromaddress(t.data_ptr(), t.nbytes), MPI.BYTE], [t]


# --------------------------------------------------------------------------- receive buffers
ALIGN = 64  # bytes: a cache line, and what torch's own CPU allocator gives


def aligned_empty(nbytes: int) -> np.ndarray:
    """A uint8 array of ``nbytes`` whose first byte is at a multiple of :data:`ALIGN` (64) bytes.

    numpy's (and malloc's) large blocks start 16 bytes past a page, and a copy into them runs 4-9 %
    slower than into an aligned one (MPICH's shared-memory receive on the 2-core VM, one way: 1 MiB
    63.7 -> 58.2 us, 4 MiB 395 -> 381 us; ``docs/runtime.md``, Transport).

    Examples
    --------
    >>> b = aligned_empty(1000)
    >>> b.nbytes, b.ctypes.data % ALIGN
    (1000, 0)
    """
    raw = np.empty(nbytes + ALIGN, dtype=np.uint8)
    off = -raw.ctypes.data % ALIGN
    return raw[off : off + nbytes]


class BufferPool:
    """Reusable host receive buffers, so large payloads do not page-fault fresh memory every time.

    A buffer is a 64-byte aligned numpy uint8 array of its size class (:func:`aligned_empty`; receive into its
    first ``nbytes``); tensors handed out are ``torch.from_numpy`` views of it.  A buffer is free again when
    every tensor made from it (and every view of those) is gone ([Note: pool buffers in use]).
    Sizes are rounded up to quarter-octave classes; at most ``max_bytes`` are kept.

    [Note: pool buffers in use]
    An aligned buffer is a slice of a larger array, its *owner* (``buffer.base``).  numpy gives an array made
    over a slice (``np.ndarray(shape, dtype, buffer)``) the owner as its base, not the slice, so it is the
    owner's reference count (``sys.getrefcount``) that rises while a tensor made from the buffer lives; the
    slice's own count does not move (counting the slice alone handed one buffer to every message of a window in
    flight at once).  Whatever holds the slice itself (a receive's buffer spec, a memoryview) raises the slice's
    count instead, so a buffer is free when both counts are a free buffer's, measured once on a probe buffer
    when the pool is made.
    """

    def __init__(self, min_bytes: int = 64 << 10, max_bytes: int = 2 << 30, per_class: int = 64) -> None:
        self.min_bytes, self.max_bytes, self.per_class = min_bytes, max_bytes, per_class
        self.free: dict[int, list[np.ndarray]] = {}
        self._classes: dict[int, int] = {}  # nbytes -> size class (payload sizes repeat)
        self.held_bytes = 0
        self.hits = 0
        self.misses = 0
        probe = [aligned_empty(64)]
        self._free_refs = self._refs(probe)  # a free buffer's reference counts (its own, its owner's), as take sees them

    @staticmethod
    def _refs(bufs: list[np.ndarray]) -> tuple[int, int]:
        for b in bufs:
            return sys.getrefcount(b), sys.getrefcount(b.base)
        return 0, 0

    @staticmethod
    def size_class(nbytes: int) -> int:
        """Round up to the next of 4 steps per power of two (at most 25% waste).

        Examples
        --------
        >>> [BufferPool.size_class(n) for n in (1000, 1024, 1025, 1 << 20, (1 << 20) + 1)]
        [1024, 1024, 1280, 1048576, 1310720]
        """
        if nbytes <= 1:
            return 1
        top = 1 << (nbytes - 1).bit_length()
        step = max(top // 8, 1)
        return -(-nbytes // step) * step

    def take(self, nbytes: int) -> Any:
        """A buffer of at least ``nbytes`` (pooled from ``min_bytes`` up: a free one of its size class)."""
        if nbytes < self.min_bytes:
            return _allocate(nbytes)
        cls = self._classes.get(nbytes)
        if cls is None:
            cls = self.size_class(nbytes)
            if len(self._classes) < 4096:
                self._classes[nbytes] = cls
        bufs = self.free.get(cls)
        if bufs is None:
            bufs = self.free[cls] = []
        own, owner = self._free_refs
        for b in bufs:
            # nothing made from b lives, and nothing holds b itself ([Note: pool buffers in use])
            if sys.getrefcount(b.base) == owner and sys.getrefcount(b) == own:
                self.hits += 1
                return b
        self.misses += 1
        b = aligned_empty(cls)
        if len(bufs) < self.per_class and self.held_bytes + cls <= self.max_bytes:
            bufs.append(b)
            self.held_bytes += cls
        return b


POOL = BufferPool()
_allocate: Any = MPI.buffer.allocate


def host_tensor(buf: Any, offset: int, meta: TensorMeta) -> torch.Tensor:
    """The tensor ``meta`` describes, viewing ``buf``'s bytes from ``offset`` (no copy)."""
    npdt = NP_DTYPE.get(meta.dtype)
    if not meta.nbytes:
        return torch.empty(meta.shape, dtype=meta.dtype)
    if npdt is not None:
        return torch.from_numpy(np.ndarray(meta.shape, npdt, buf, offset))
    # bfloat16 (numpy has none): the bytes as int16, then viewed as bfloat16 (same item size)
    return torch.from_numpy(np.ndarray(meta.shape, np.int16, buf, offset)).view(meta.dtype)


def landing(meta: TensorMeta, device: torch.device | None, aware: bool) -> tuple[torch.Tensor, Any]:
    """The tensor a separate payload lands in, and the buffer spec MPI writes to."""
    if device is not None and device.type == "cuda":
        if aware:
            t = torch.empty(meta.shape, dtype=meta.dtype, device=device)
        else:
            t = torch.empty(meta.shape, dtype=meta.dtype, pin_memory=True)
        return t, mpi_buffer(byte_view(t))
    buf = POOL.take(meta.nbytes)
    return host_tensor(buf, 0, meta), [buf, meta.nbytes, MPI.BYTE]
