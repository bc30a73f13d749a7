"""Join and batch requests on a component replica: pure bookkeeping, no MPI.

A replica receives messages whose rows are requests.  :class:`JoinBuffer` collects, per request, one
row for every input slot (a join component gets its slots from different senders) and hands out the
request once complete.  :class:`Batcher` queues complete requests and says when to run: when
``batch_size`` are waiting, or when the oldest has waited ``max_wait_s``.  :func:`stack_rows` builds the
batch tensors, slicing instead of copying when the rows are consecutive rows of one received tensor.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["Batcher", "JoinBuffer", "ReadyRequest", "Row", "row_runs", "stack_rows"]


@dataclass(frozen=True, slots=True)
class Row:
    """Request ``index`` of a received tensor, whose requests lie along dim ``dim``."""

    tensor: Any
    index: int
    dim: int = 0


@dataclass(frozen=True, slots=True)
class ReadyRequest:
    """A request whose every input slot has arrived."""

    request_id: int
    route: tuple[int, ...]
    rows: tuple[Row, ...]  # one per input slot
    t_ready: float
    path_us: int = 0  # longest chain of compute upstream of this request (see worker)


class JoinBuffer:
    """Per-request collection of input rows until every slot is filled.

    Examples
    --------
    >>> j = JoinBuffer(n_slots=2)
    >>> j.add(7, (1, 2), 0, Row("a", 0), now=0.0) is None
    True
    >>> r = j.add(7, (1, 2), 1, Row("b", 3), now=0.5)
    >>> r.request_id, [x.tensor for x in r.rows], r.t_ready, len(j)
    (7, ['a', 'b'], 0.5, 0)
    """

    def __init__(self, n_slots: int) -> None:
        self.n_slots = n_slots
        self._pending: dict[int, list[Any]] = {}  # id -> [route, rows, t_first, path_us]

    def __len__(self) -> int:
        return len(self._pending)

    def add(self, request_id: int, route: tuple[int, ...], slot: int, row: Row, now: float,
            path_us: int = 0) -> ReadyRequest | None:
        """Store one slot of a request; return the request when it is complete.

        ``path_us`` is the sender's upstream compute chain; the request keeps the longest of its slots.
        """
        if self.n_slots == 1:
            return ReadyRequest(request_id, route, (row,), now, path_us)
        entry = self._pending.get(request_id)
        if entry is None:
            entry = [route, [None] * self.n_slots, now, 0]
            self._pending[request_id] = entry
        rows = entry[1]
        if rows[slot] is not None:
            raise ValueError(f"request {request_id}: input slot {slot} arrived twice")
        rows[slot] = row
        entry[3] = max(entry[3], path_us)
        if any(r is None for r in rows):
            return None
        del self._pending[request_id]
        return ReadyRequest(request_id, entry[0], tuple(rows), now, entry[3])

    def expire(self, now: float, max_age_s: float) -> list[int]:
        """Drop requests that have waited longer than ``max_age_s`` for their other inputs."""
        old = [rid for rid, e in self._pending.items() if now - e[2] > max_age_s]
        for rid in old:
            del self._pending[rid]
        return old


class Batcher:
    """FIFO of ready requests; a batch is due at ``batch_size`` or when the oldest waited ``max_wait_s``.

    Examples
    --------
    >>> b = Batcher(batch_size=2, max_wait_s=0.01)
    >>> b.push("r1", now=0.0); b.due(0.005), b.due(0.011)
    (False, True)
    >>> b.push("r2", now=0.006); b.due(0.006), b.take(), len(b)
    (True, ['r1', 'r2'], 0)
    """

    def __init__(self, batch_size: int, max_wait_s: float) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size {batch_size}, needs >= 1")
        self.batch_size = batch_size
        self.max_wait_s = max(0.0, max_wait_s)
        self._q: deque[tuple[float, Any]] = deque()

    def __len__(self) -> int:
        return len(self._q)

    def push(self, item: Any, now: float) -> None:
        self._q.append((now, item))

    def due(self, now: float) -> bool:
        if not self._q:
            return False
        return len(self._q) >= self.batch_size or now - self._q[0][0] >= self.max_wait_s

    def deadline(self) -> float | None:
        """When the oldest waiting request's wait runs out (None when empty)."""
        return self._q[0][0] + self.max_wait_s if self._q else None

    def take(self) -> list[Any]:
        n = min(self.batch_size, len(self._q))
        return [self._q.popleft()[1] for _ in range(n)]


def row_runs(rows: Sequence[Row]) -> list[tuple[Any, int, int]]:
    """Group rows into runs ``(tensor, start, stop)`` of consecutive rows of one tensor.

    Examples
    --------
    >>> row_runs([Row("a", 0), Row("a", 1), Row("b", 0), Row("a", 2)])
    [('a', 0, 2), ('b', 0, 1), ('a', 2, 3)]
    """
    runs: list[tuple[Any, int, int]] = []
    for r in rows:
        if runs and runs[-1][0] is r.tensor and runs[-1][2] == r.index:
            t, a, b = runs[-1]
            runs[-1] = (t, a, b + 1)
        else:
            runs.append((r.tensor, r.index, r.index + 1))
    return runs


def stack_rows(rows: Sequence[Row]) -> Any:
    """One tensor with the given rows in order, along their request dim (a view when they are one run)."""
    runs = row_runs(rows)
    d = rows[0].dim
    if len(runs) == 1:
        t, a, b = runs[0]
        return t if (a == 0 and b == t.shape[d]) else t.narrow(d, a, b - a)
    import torch

    return torch.cat([t.narrow(d, a, b - a) for t, a, b in runs], dim=d)


def take_requests(t: Any, bdims: Sequence[int], pos: Sequence[int]) -> Any:
    """The part of batch tensor ``t`` that belongs to the requests at positions ``pos``.

    With one batch dim this selects along it.  With several (e.g. a ``[batch, batch]`` similarity),
    request ``p`` owns the entry at ``p`` in every batch dim, exactly what the model returns for that
    request alone at batch 1; the parts are stacked along the first batch dim, the others keep size 1.

    Examples
    --------
    >>> import torch
    >>> take_requests(torch.arange(9).view(3, 3), (0, 1), [0, 2]).tolist()
    [[0], [8]]
    >>> take_requests(torch.arange(6).view(2, 3), (1,), [1, 2]).tolist()
    [[1, 2], [4, 5]]
    """
    import torch

    d0 = bdims[0]
    n = t.shape[d0]
    if len(bdims) == 1:
        if len(pos) == n and list(pos) == list(range(n)):
            return t
        if list(pos) == list(range(pos[0], pos[0] + len(pos))):
            return t.narrow(d0, pos[0], len(pos))
        return t.index_select(d0, torch.as_tensor(list(pos), dtype=torch.long, device=t.device))
    parts = []
    for p in pos:
        x = t
        for d in bdims:
            x = x.narrow(d, p, 1)
        parts.append(x)
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=d0)
