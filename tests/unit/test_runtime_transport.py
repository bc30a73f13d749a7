"""Transport header encoding and host buffer handling (no MPI needed)."""

from __future__ import annotations

import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from hpcsplit.errors import RuntimeStageError
from hpcsplit.runtime import buffers as bf
from hpcsplit.runtime import mailbox as mb
from hpcsplit.runtime import transport as tp


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.bool,
                                   torch.uint8, torch.complex64])
def test_header_roundtrip_every_dtype(dtype: torch.dtype) -> None:
    h = tp.Header(tp.KIND_DATA, (5, 9, 11), ((1, 4), (2, 4), (1, 5)),
                  (tp.TensorMeta(1, dtype, (3, 7), 0), tp.TensorMeta(0, torch.float32, (2, 3, 1), 2)), aux=42)
    a = tp.encode_header(h)
    assert a.dtype == np.int64
    assert tp.decode_header(a) == h


def test_header_without_routes_or_tensors() -> None:
    h = tp.Header(tp.KIND_STOP)
    assert tp.decode_header(tp.encode_header(h)) == h
    assert len(tp.encode_header(h)) == 8  # the fixed words (the header's length is the 8th)


def test_header_rejects_foreign_words() -> None:
    with pytest.raises(RuntimeStageError, match="not hpcsplit transport"):
        tp.decode_header(np.arange(10, dtype=np.int64))


def test_header_rejects_ragged_routes() -> None:
    with pytest.raises(RuntimeStageError, match="one route per request"):
        tp.encode_header(tp.Header(tp.KIND_DATA, (1, 2), ((1, 2),)))


def test_unknown_dtype_code_is_reported() -> None:
    a = tp.encode_header(tp.Header(tp.KIND_DATA, (1,), (), (tp.TensorMeta(0, torch.float32, (1,)),)))
    a[11] = 99  # the dtype code of the first tensor (after 8 fixed words, 1 id, slot, rdim)
    with pytest.raises(RuntimeStageError, match="unknown dtype code 99"):
        tp.decode_header(a)


def test_dtype_outside_the_table_is_refused() -> None:
    with pytest.raises(RuntimeStageError, match="cannot send dtype"):
        tp.dtype_code(torch.float8_e4m3fn)


def test_send_buffer_is_a_view_not_a_copy() -> None:
    t = torch.arange(12, dtype=torch.float32).view(3, 4)
    buf, _keep = bf.send_buffer(t, cuda_aware=False)
    assert buf[0].address == t.data_ptr() and buf[0].nbytes == 48
    b16 = t.to(torch.bfloat16)
    buf, _keep = bf.send_buffer(b16, cuda_aware=False)
    assert buf[0].address == b16.data_ptr() and buf[0].nbytes == b16.numel() * 2
    z = torch.complex(t, t).conj()  # a conj view: its bytes are not yet conjugated, so they are copied
    buf, keep = bf.send_buffer(z, cuda_aware=False)
    assert buf[0].address != z.data_ptr() and torch.equal(keep[0], z.resolve_conj())


def test_landing_receives_into_pooled_tensor_and_reuses_it() -> None:
    meta = tp.TensorMeta(0, torch.float32, (256, 256))
    pool = bf.POOL
    t, spec = bf.landing(meta, None, False)
    assert t.shape == (256, 256) and t.dtype == torch.float32
    assert spec[1] == meta.nbytes  # MPI writes the payload's bytes, not the size class's
    ptr = t.data_ptr()
    assert ptr % bf.ALIGN == 0  # a cache line's start: a copy into it runs faster than into malloc's 16-byte offset
    del t, spec
    # only the tensors hold a buffer: MPI's request drops its spec once the payload has landed
    t2 = bf.landing(meta, None, False)[0]
    assert t2.data_ptr() == ptr  # the buffer came back to the pool
    t3 = bf.landing(meta, None, False)[0]
    assert t3.data_ptr() != t2.data_ptr()  # t2 is still alive: never handed out twice
    assert pool.size_class(1 << 20) == 1 << 20


def test_pool_buffer_stays_busy_while_a_view_lives() -> None:
    meta = tp.TensorMeta(0, torch.float32, (128, 512))
    t = bf.landing(meta, None, False)[0]
    row = t[3:4]
    ptr = t.data_ptr()
    del t
    t2 = bf.landing(meta, None, False)[0]
    assert t2.data_ptr() != ptr
    assert sys.getrefcount(row) >= 2
    del row, t2
    assert bf.landing(meta, None, False)[0].data_ptr() == ptr  # free once the view is gone
    t, spec = bf.landing(meta, None, False)
    held = memoryview(spec[0])  # something holding the buffer itself, not a tensor made from it
    del t, spec
    assert bf.landing(meta, None, False)[0].data_ptr() != ptr
    del held
    assert bf.landing(meta, None, False)[0].data_ptr() == ptr


def test_a_window_of_pooled_payloads_in_flight_keeps_every_message_apart() -> None:
    """Payloads that land while the messages before them are still held each get a buffer of their own (a
    pooled buffer handed out twice would show here as every message holding the last one's values).

    As the receiver does (``transport._arrive``): the landing tensor is made, MPI writes the bytes through
    the spec, and the spec is dropped once the payload has landed; only the tensor is kept."""
    meta = tp.TensorMeta(0, torch.float32, (256, 256))  # 256 KiB: a pooled payload
    got = []
    for k in range(6):
        t, spec = bf.landing(meta, None, False)
        np.frombuffer(spec[0], dtype=np.float32, count=256 * 256)[:] = k  # what MPI's receive does
        del spec
        got.append(t)
    assert len({t.data_ptr() for t in got}) == 6
    for k, t in enumerate(got):
        assert torch.equal(t, torch.full((256, 256), float(k))), f"message {k} holds another message's values"
        assert t.data_ptr() % bf.ALIGN == 0



@pytest.mark.parametrize("dtype", bf.DTYPES)
@pytest.mark.parametrize("shape", [(), (0,), (3, 0, 2), (5,), (2, 3, 7)])
def test_host_tensor_views_the_bytes_of_every_dtype_and_shape(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    """The inline receive path: a tensor at an offset of a received buffer, no copy (a 0-byte one is empty)."""
    src = (torch.arange(int(np.prod(shape)), dtype=torch.float64) % 7).to(dtype).reshape(shape)
    raw = np.zeros(64 + src.nbytes, dtype=np.uint8)
    raw[64:] = src.reshape(-1).view(torch.uint8).numpy()
    t = bf.host_tensor(raw, 64, tp.TensorMeta(0, dtype, shape))
    assert t.dtype == dtype and tuple(t.shape) == shape and torch.equal(t, src)
    if src.nbytes:
        assert t.data_ptr() == raw.ctypes.data + 64


def test_backoff_sleeps_only_after_spinning() -> None:
    b = mb.Backoff(spin_s=1.0, max_sleep_s=1e-3)
    import time

    t0 = time.perf_counter()
    for _ in range(100):
        b.idle(time.perf_counter())
    assert time.perf_counter() - t0 < 0.5  # still spinning: no sleeps
    b2 = mb.Backoff(spin_s=0.0, max_sleep_s=1e-3)
    for _ in range(10):
        b2.idle(time.perf_counter())
    assert b2._sleep == pytest.approx(1e-3)
    b2.reset()
    assert b2._sleep == pytest.approx(20e-6)


def test_a_long_spin_yields_the_core_past_the_short_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """[Note: spin after work]: the first SPIN_S is a plain spin; the rest of a longer spin yields between
    polls; past spin_s the backoff sleeps as before."""
    yields = []
    monkeypatch.setattr(mb.os, "sched_yield", lambda: yields.append(1))
    b = mb.Backoff(spin_s=2e-3, max_sleep_s=1e-3)
    assert b.plan(10.0) == (0.0, False) and not b.yielding  # the spin starts
    b.idle(10.0 + mb.SPIN_S / 2)
    assert not yields
    assert b.plan(10.0 + 1e-3) == (0.0, False) and b.yielding
    b.idle(10.0 + 1.5e-3)
    assert yields == [1]
    s, _ = b.plan(10.0 + 3e-3)
    assert s > 0 and not b.yielding
    b.reset()
    assert b.plan(20.0) == (0.0, False) and not b.yielding


def test_settle_heap_collects_the_garbage_and_freezes_the_rest() -> None:
    """[Note: frozen heap]: a cycle dropped before the call is collected (not frozen for good), what is alive is
    frozen (a full pass no longer scans it), and what is made afterwards is collected as usual; a frozen cycle
    dropped later (a variant's program) is freed by the next call, or by a pass after thaw_heap."""
    import gc
    import weakref

    from hpcsplit.runtime.heap import settle_heap, thaw_heap

    class Node:
        def __init__(self) -> None:
            self.me = self

    dropped, kept = Node(), Node()
    gone = weakref.ref(dropped)
    del dropped
    before = gc.get_freeze_count()
    try:
        settle_heap()
        assert gone() is None  # collected before the freeze
        assert gc.get_freeze_count() > before and gc.is_tracked(kept)
        # frozen: in none of the generations a pass scans
        assert not any(o is kept for g in range(3) for o in gc.get_objects(generation=g))
        later = Node()
        ref = weakref.ref(later)
        del later
        gc.collect()
        assert ref() is None
        for free in ("settle", "thaw"):  # a frozen cycle, dropped: freed at the next variant's start, or its end
            kept = Node()
            ref = weakref.ref(kept)
            settle_heap()
            del kept
            gc.collect()
            assert ref() is not None  # frozen: the collector skips it
            if free == "settle":
                settle_heap()
            else:
                thaw_heap()
                gc.collect()
            assert ref() is None
    finally:
        gc.unfreeze()


def test_the_simulators_backoff_wakes_are_the_runtimes(monkeypatch: pytest.MonkeyPatch) -> None:
    """[Note: idle CPU]: the wake-ups the simulator charges a crowded node (core.policy.backoff_wakes_ms) are those
    of the runtime's Backoff of a quiet rank with a doorbell, replayed from the end of its work until it takes its
    quiet sleep on the doorbell: its spin, then sleeps of 20 us doubling (none after a spin of 1 ms or more)."""
    import types

    from hpcsplit.core.policy import backoff_wakes_ms

    bell = types.SimpleNamespace(quiet_sleep_s=mb.DOORBELL_QUIET_SLEEP_S, all_local=True)
    monkeypatch.setattr(mb, "_DOORBELL", bell)
    for spin_s in (mb.SPIN_S, 0.0, 0.3e-3, 0.99e-3, mb.SERVER_SPIN_S):
        b = mb.Backoff(spin_s=spin_s)
        now, wakes = 5.0, []
        while now < 6.0:  # (a second of backoff without its quiet sleep fails below, not hangs)
            s, _ = b.plan(now, quiet=True)
            if s == bell.quiet_sleep_s:  # asleep until rung
                break
            now += s if s > 0 else 1e-7  # a spin polls until spin_s has passed
            if s > 0:
                wakes.append((now - 5.0) * 1e3)
        assert backoff_wakes_ms(spin_s * 1e6) == pytest.approx(wakes, abs=1e-3), spin_s
    assert backoff_wakes_ms(mb.SPIN_S * 1e6) == pytest.approx([0.07, 0.11, 0.19, 0.35, 0.67, 1.31])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_tensors_stage_through_pinned_host_memory() -> None:
    t = torch.arange(1000, dtype=torch.float32, device="cuda") * 2
    _buf, keep = bf.send_buffer(t, cuda_aware=False)
    host = keep[0]
    assert host.is_pinned() and not host.is_cuda
    assert torch.equal(host.view(torch.float32), t.cpu())
    meta = tp.TensorMeta(0, torch.float32, (10, 100))
    landing, _view = bf.landing(meta, torch.device("cuda"), aware=False)
    assert landing.is_pinned()
    landing.copy_(t.cpu().view(10, 100))
    msg = tp.RecvHandle(3, tp.Header(tp.KIND_DATA), [], [landing], torch.device("cuda")).test()
    assert msg is not None and msg.tensors[0].is_cuda
    assert torch.equal(msg.tensors[0].view(-1), t)
    aware_buf, _ = bf.send_buffer(t, cuda_aware=True)
    assert aware_buf[0] is not None


@pytest.mark.parametrize(("value", "aware"), [("1", True), ("True", True), ("YES", True), ("on", True),
                                             ("0", False), ("False", False), ("No", False), ("", False)])
def test_cuda_aware_override_reads_any_case(monkeypatch: pytest.MonkeyPatch, value: str, aware: bool) -> None:
    monkeypatch.setattr(bf, "_CUDA_AWARE", None)
    monkeypatch.setattr(bf, "_CUDA_AWARE_WHY", "")
    monkeypatch.setenv("HPCSPLIT_CUDA_AWARE_MPI", value)
    assert tp.cuda_aware_mpi() == (aware, "HPCSPLIT_CUDA_AWARE_MPI")


def test_cuda_aware_override_refuses_other_words(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bf, "_CUDA_AWARE", None)
    monkeypatch.setattr(bf, "_CUDA_AWARE_WHY", "")
    monkeypatch.setenv("HPCSPLIT_CUDA_AWARE_MPI", "maybe")
    with pytest.raises(RuntimeStageError, match="HPCSPLIT_CUDA_AWARE_MPI='maybe' is neither on"):
        tp.cuda_aware_mpi()
    assert bf._CUDA_AWARE is None  # nothing decided: the next call asks again
