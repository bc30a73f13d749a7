"""Join, batch and per-request slicing on a component replica (pure)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from hpcsplit.runtime.batching import Batcher, JoinBuffer, Row, row_runs, stack_rows, take_requests


def test_join_waits_for_every_slot_in_any_order() -> None:
    j = JoinBuffer(3)
    assert j.add(1, (1,), 2, Row("c", 0), 0.0) is None
    assert j.add(2, (2,), 0, Row("x", 0), 0.1) is None
    assert j.add(1, (1,), 0, Row("a", 0), 0.2) is None
    done = j.add(1, (1,), 1, Row("b", 0), 0.3)
    assert done is not None and [r.tensor for r in done.rows] == ["a", "b", "c"]
    assert len(j) == 1
    with pytest.raises(ValueError, match="arrived twice"):
        j.add(2, (2,), 0, Row("x", 0), 0.4)


def test_join_expires_old_partial_requests() -> None:
    j = JoinBuffer(2)
    j.add(1, (), 0, Row("a", 0), 0.0)
    j.add(2, (), 0, Row("a", 1), 5.0)
    assert j.expire(now=6.0, max_age_s=2.0) == [1]
    assert len(j) == 1


def test_batcher_size_and_wait() -> None:
    b = Batcher(batch_size=3, max_wait_s=0.010)
    assert not b.due(0.0) and b.deadline() is None
    b.push("r0", 0.000)
    b.push("r1", 0.001)
    assert not b.due(0.005)
    assert b.deadline() == pytest.approx(0.010)
    assert b.due(0.0101)
    b.push("r2", 0.002)
    b.push("r3", 0.003)
    assert b.due(0.003)
    assert b.take() == ["r0", "r1", "r2"]
    assert b.take() == ["r3"]
    zero = Batcher(batch_size=8, max_wait_s=0.0)
    zero.push("x", 1.0)
    assert zero.due(1.0)


def test_stack_rows_slices_consecutive_rows_and_concatenates_others() -> None:
    a = torch.arange(12.0).view(4, 3)
    b = torch.arange(100.0, 106.0).view(2, 3)
    one = stack_rows([Row(a, 1), Row(a, 2)])
    assert one.data_ptr() == a[1].data_ptr()  # a view, no copy
    mixed = stack_rows([Row(a, 3), Row(b, 0), Row(a, 0)])
    assert mixed.tolist() == [a[3].tolist(), b[0].tolist(), a[0].tolist()]
    assert row_runs([Row(a, 0), Row(a, 1), Row(b, 1)]) == [(a, 0, 2), (b, 1, 2)]
    col = torch.arange(12.0).view(3, 4)  # requests along dim 1
    assert stack_rows([Row(col, 1, 1), Row(col, 3, 1)]).tolist() == col[:, [1, 3]].tolist()


def test_take_requests_matches_running_each_request_alone() -> None:
    img = torch.randn(5, 4)
    txt = torch.randn(5, 4)
    sim = txt @ img.T  # [batch, batch], like CLIP's logits
    got = take_requests(sim, (0, 1), [1, 3])
    alone = torch.stack([(txt[i:i + 1] @ img[i:i + 1].T)[0] for i in (1, 3)])
    torch.testing.assert_close(got, alone)
    assert take_requests(img, (0,), [0, 1, 2, 3, 4]) is img
    assert take_requests(img, (0,), [2, 3]).data_ptr() == img[2].data_ptr()
    assert take_requests(img, (0,), [4, 0]).tolist() == img[[4, 0]].tolist()
    assert take_requests(img.T, (1,), [2]).shape == (4, 1)


def test_join_keeps_the_longest_upstream_compute_chain() -> None:
    j = JoinBuffer(2)
    j.add(4, (), 0, Row("v", 0), 0.0, path_us=150_000)
    r = j.add(4, (), 1, Row("t", 0), 0.1, path_us=40_000)
    assert r is not None and r.path_us == 150_000
    single = JoinBuffer(1).add(5, (), 0, Row("x", 0), 0.0, path_us=7)
    assert single is not None and single.path_us == 7
