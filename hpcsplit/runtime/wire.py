"""The transport's header: flat int64 words packed and unpacked with ``struct``, tensor layouts decoded once.

The format is ``[Note: transport wire format]`` in :mod:`~hpcsplit.runtime.transport`, which sends and
receives with these; :class:`Header`, :func:`encode_header` and :func:`decode_header` are re-exported there.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from hpcsplit.errors import RuntimeStageError
from hpcsplit.runtime.buffers import NP_DTYPE, TensorMeta, code_dtype, dtype_code

__all__ = ["MAGIC", "VERSION", "Header", "decode_header", "encode_header"]

MAGIC = 0x48535054  # "HSPT"
VERSION = 2
_FIXED = 8
_ALIGN = 63  # offsets of inline tensors are multiples of 64 bytes (mask)
_PAD = [0] * 8
_FIX = struct.Struct(f"={_FIXED}q")
_NW = struct.Struct("=q")  # n_words, the header's 8th word
_W16 = struct.Struct("=16q")
_STRUCTS: dict[int, struct.Struct] = {}  # n words -> its struct (headers repeat their lengths)


class Header(NamedTuple):
    """Decoded message header (see ``[Note: transport wire format]``)."""

    kind: int
    request_ids: tuple[int, ...] = ()
    routes: tuple[tuple[int, ...], ...] = ()
    tensors: tuple[TensorMeta, ...] = ()
    aux: int = 0


_new = tuple.__new__  # _new(Header, (...)): a named tuple made without its Python-level __new__ (hot path)


def _words(n: int) -> struct.Struct:
    s = _STRUCTS.get(n)
    if s is None:
        s = struct.Struct(f"={n}q")
        if len(_STRUCTS) < 1024:
            _STRUCTS[n] = s
    return s


def _header_words(kind: int, request_ids: Sequence[int], routes: Sequence[Sequence[int]], n_t: int,
                  aux: int) -> list[int]:
    """The header's words up to the tensors' part (``n_words`` still 0)."""
    n_req = len(request_ids)
    if routes:
        n_route = len(routes[0])
        if len(routes) != n_req or any(len(r) != n_route for r in routes):
            raise RuntimeStageError(f"header routes {routes} do not give one route per request {request_ids}")
    else:
        n_route = 0
    words = [MAGIC, VERSION, kind, aux, n_req, n_route, n_t, 0]
    words += request_ids
    for r in routes:
        words += r
    return words


def _pack(words: list[int]) -> bytes:
    """The header's bytes: ``words`` padded to a multiple of 8 with zeros, their count the 8th word."""
    n = len(words)
    nw = (n + 7) & ~7
    words[7] = nw
    if nw > n:
        words += _PAD[: nw - n]
    try:
        return (_STRUCTS.get(nw) or _words(nw)).pack(*words)
    except struct.error as e:
        raise RuntimeStageError(f"a message header takes 64-bit integers (kind, aux, request ids, routes, "
                                f"shapes); found {words[:24]}{'...' if len(words) > 24 else ''} ({e})") from None


def encode_header(h: Header) -> np.ndarray:
    """Pack a :class:`Header` into a flat int64 array (a header sent alone, its payloads separate).

    Examples
    --------
    >>> import torch
    >>> h = Header(1, (7, 8), ((1, 2), (1, 3)), (TensorMeta(0, torch.float32, (4, 2), 1),))
    >>> decode_header(encode_header(h)) == h
    True
    """
    words = _header_words(h.kind, h.request_ids, h.routes, len(h.tensors), h.aux)
    for t in h.tensors:
        words += (t.slot, t.rdim, dtype_code(t.dtype), len(t.shape))
        words += t.shape
    return np.frombuffer(_pack(words), dtype=np.int64).copy()


class _Layout(NamedTuple):
    """The tensors' part of a header, decoded once per distinct part (messages repeat shapes)."""

    n_tensors: int
    metas: tuple[TensorMeta, ...]
    parts: tuple[tuple[int, Any, tuple[int, ...], TensorMeta, int], ...]  # offset, numpy dtype, shape, meta, bytes
    inline_bytes: int  # the inline tensors' aligned total


_LAYOUTS: dict[tuple[int, ...], _Layout] = {}


def _layout(part: tuple[int, ...], n_t: int) -> _Layout:
    metas, inline = [], []
    i = off = 0
    for _ in range(n_t):
        if i + 4 > len(part) or part[i + 3] < 0 or i + 4 + part[i + 3] > len(part):
            raise RuntimeStageError(f"a message header announces {n_t} tensors but holds the shapes of fewer "
                                    f"({part}); sender and receiver differ?")
        end = i + 4 + part[i + 3]
        shape = part[i + 4 : end]
        if any(s < 0 for s in shape):
            raise RuntimeStageError(f"a message header gives a tensor the shape {shape}; sender and receiver differ?")
        meta = TensorMeta(part[i], code_dtype(part[i + 2]), shape, part[i + 1])
        metas.append(meta)
        # numpy dtype None: made by buffers.host_tensor (bfloat16, no bytes)
        nb = meta.nbytes
        inline.append((off, NP_DTYPE.get(meta.dtype) if nb else None, shape, meta, nb))
        off += (nb + _ALIGN) & ~_ALIGN
        i = end
    lay = _Layout(n_t, tuple(metas), tuple(inline), off)
    if len(_LAYOUTS) < 4096:
        _LAYOUTS[part] = lay
    return lay


def _decode(buf: Any, n: int) -> tuple[Header, _Layout, int]:
    """Header, tensor layout and header bytes of a first message of ``n`` bytes."""
    if n >= 128:  # most headers are 16 words or fewer: one unpack reads them
        v = _W16.unpack_from(buf, 0)
        nw = v[7]
        if nw != 16:
            v = _words(nw).unpack_from(buf, 0) if 8 <= nw and not nw % 8 and nw * 8 <= n else ()
    else:
        nw = _NW.unpack_from(buf, 56)[0] if n >= 64 else 0
        v = _FIX.unpack_from(buf, 0) if nw == 8 else ()
    if not v or v[0] != MAGIC or v[1] != VERSION:
        first = _FIX.unpack_from(buf, 0)[:4] if n >= 64 else ()
        raise RuntimeStageError(
            f"received a message header that is not hpcsplit transport v{VERSION} (first words {first}, "
            f"{n} bytes); are two different hpcsplit versions running in one job?"
        )
    n_req, n_route, n_t = v[4], v[5], v[6]
    i = _FIXED + n_req
    if n_req < 0 or n_route < 0 or nw < i + n_req * n_route + 4 * n_t:
        raise RuntimeStageError(f"a message header of {nw} words announces {n_req} requests, {n_route}-hop "
                                f"routes and {n_t} tensors; sender and receiver differ?")
    if n_route:
        routes = tuple([v[j : j + n_route] for j in range(i, i + n_req * n_route, n_route)])
        part = v[i + n_req * n_route :]
    else:
        routes = ()
        part = v[i:]
    lay = _LAYOUTS.get(part)
    if lay is None or lay.n_tensors != n_t:
        lay = _layout(part, n_t)
    return _new(Header, (v[2], v[_FIXED:i], routes, lay.metas, v[3])), lay, nw * 8


def decode_header(a: Any) -> Header:
    """Unpack an int64 header array (inverse of :func:`encode_header`)."""
    return _decode(a, a.nbytes)[0]
