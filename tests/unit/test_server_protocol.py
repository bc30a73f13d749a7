"""Server mode's request checks and tensor coding (hpcsplit.runtime.server.protocol), without ranks: every
malformed body is refused with a message naming what was wrong, and well-formed ones decode exactly."""

from __future__ import annotations

import json
from types import SimpleNamespace as T

import numpy as np
import pytest

from hpcsplit.runtime.server.protocol import (
    InferRequest,
    ModelSpec,
    RequestRejected,
    decode_http,
    encode_http,
)

SPEC = ModelSpec.from_layout(
    "m", [T(name="x", dtype="float32", shape=("batch", 3)), T(name="ids", dtype="int64", shape=("batch", 2))],
    [T(name="y", dtype="float32", shape=("batch", "batch"))], max_batch_size=4)


def _req(inputs: list[dict], **extra: object) -> bytes:
    return json.dumps({"inputs": inputs, **extra}).encode()


def _x(**kw: object) -> dict:
    return {"name": "x", "datatype": "FP32", "shape": [2, 3], "data": list(range(6)), **kw}


def _ids(**kw: object) -> dict:
    return {"name": "ids", "datatype": "INT64", "shape": [2, 2], "data": [1, 2, 3, 4], **kw}


def test_json_and_binary_decode() -> None:
    r = decode_http(SPEC, _req([_ids(), _x()]), None)  # any input order
    assert r.batch == 2 and r.arrays[0].dtype == np.float32 and r.arrays[1].tolist() == [[1, 2], [3, 4]]
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    head = _req([_x(data=None, parameters={"binary_data_size": 24}), _ids()]).replace(b', "data": null', b"")
    r = decode_http(SPEC, head + x.tobytes(), len(head))
    np.testing.assert_array_equal(r.arrays[0], x)


@pytest.mark.parametrize(("body", "header_len", "says"), [
    (b"[1, 2]", None, "JSON object"),
    (b"{oops", None, "not valid JSON"),
    (_req([_x()]), None, "input 'ids' is missing"),
    (_req([_x(), _ids(), {"name": "z", "datatype": "FP32", "shape": [1]}]), None, "unknown input 'z'"),
    (_req([_x(datatype="FP64"), _ids()]), None, "expected datatype FP32, got 'FP64'"),
    (_req([_x(shape=[2, 4]), _ids()]), None, "expected shape [-1, 3]"),
    (_req([_x(shape=[5, 3], data=[0] * 15), _ids()]), None, "batch 1..4"),
    (_req([_x(data=[1, 2]), _ids()]), None, "expected 6 values"),
    (_req([_x(), _ids(data=[0.5, 1, 2, 3])]), None, "INT64"),
    (_req([_x(), _ids(shape=[1, 2], data=[1, 2])]), None, "differs from the other inputs"),
    (_req([_x(), _ids()]), 10_000, "outside the body"),
    (_req([_x(), _ids()], outputs=[{"name": "nope"}]), None, "unknown output 'nope'"),
])
def test_malformed_is_refused(body: bytes, header_len: int | None, says: str) -> None:
    with pytest.raises(RequestRejected) as e:
        decode_http(SPEC, body, header_len)
    assert says in str(e.value) and e.value.http_status == 400


def test_binary_sizes_are_checked() -> None:
    head = _req([_x(data=None, parameters={"binary_data_size": 20}), _ids()]).replace(b', "data": null', b"")
    with pytest.raises(RequestRejected, match="expected 24 bytes"):
        decode_http(SPEC, head + bytes(20), len(head))
    with pytest.raises(RequestRejected, match="not claimed"):
        decode_http(SPEC, head + bytes(24), len(head))


def test_encode_binary_and_json() -> None:
    r = decode_http(SPEC, _req([_x(), _ids()], parameters={"binary_data_output": True}), None)
    y = np.ones((2, 1), np.float32)
    body, n = encode_http(SPEC, r, [y])
    assert n is not None and body[n:] == y.tobytes()
    head = json.loads(body[:n])
    assert head["outputs"][0]["shape"] == [2, 1] and head["outputs"][0]["parameters"]["binary_data_size"] == 8
    r = decode_http(SPEC, _req([_x(), _ids()]), None)
    body, n = encode_http(SPEC, r, [y])
    assert n is None and json.loads(body)["outputs"][0]["data"] == [1.0, 1.0]


def test_repeated_binary_headers_decode_from_the_plan_and_still_check_sizes() -> None:
    """A client's repeated header is parsed once (decode_http's plans): the same request comes out, the body's
    binary part is still read per request, and a body of another length is checked afresh."""
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    ids = np.array([[1, 2], [3, 4]], np.int64)
    head = _req([{"name": "x", "datatype": "FP32", "shape": [2, 3], "parameters": {"binary_data_size": 24}},
                 {"name": "ids", "datatype": "INT64", "shape": [2, 2], "parameters": {"binary_data_size": 32}}],
                outputs=[{"name": "y", "parameters": {"binary_data": True}}], id="r7")
    plans: dict = {}
    for k in range(3):
        body = head + (x + k).tobytes() + (ids + k).tobytes()
        r = decode_http(SPEC, body, len(head), plans)
        plain = decode_http(SPEC, body, len(head))
        assert len(plans) == 1 and (r.id, r.batch, r.outputs, r.binary) == (plain.id, 2, [0], [True])
        assert all(np.array_equal(a, b) and a.dtype == b.dtype for a, b in zip(r.arrays, plain.arrays, strict=True))
        np.testing.assert_array_equal(r.arrays[0], x + k)
    with pytest.raises(RequestRejected, match="not claimed"):
        decode_http(SPEC, head + x.tobytes() + ids.tobytes() + b"extra", len(head), plans)
    with pytest.raises(RequestRejected, match="does not fit"):
        decode_http(SPEC, head + x.tobytes(), len(head), plans)
    other = head.replace(b'"r7"', b'"r8"')  # same length, other bytes: its own plan
    r8 = decode_http(SPEC, other + x.tobytes() + ids.tobytes(), len(other), plans)
    assert r8.id == "r8" and len(plans) == 2
    json_body = _req([_x(), _ids()])  # JSON data: its values are in the header, nothing is kept
    decode_http(SPEC, json_body, len(json_body), plans)
    assert len(plans) == 2


def test_repeated_binary_answers_reuse_their_json_part() -> None:
    r = decode_http(SPEC, _req([_x(), _ids()], parameters={"binary_data_output": True}), None)
    heads: dict = {}
    for k in range(3):
        y = np.full((2, 1), k, np.float32)
        assert encode_http(SPEC, r, [y], heads) == encode_http(SPEC, r, [y])
    assert len(heads) == 1
    y = np.ones((1, 1), np.float32)  # another shape: another JSON part
    body, n = encode_http(SPEC, r, [y], heads)
    assert n is not None and json.loads(body[:n])["outputs"][0]["shape"] == [1, 1] and len(heads) == 2


def test_the_hub_answers_every_open_request_when_abandoned() -> None:
    """Handlers wait on their ticket without a timer: when the frontend loop ends, Hub.abandon answers every
    request still open, queued or taken, and none that was answered already."""
    import asyncio

    from hpcsplit.runtime.server.hub import Hub

    async def main() -> None:
        hub = Hub(SPEC, capacity=8, token=None)
        hub.ready.set()
        req = decode_http(SPEC, _req([_x(), _ids()]), None)
        tickets = [hub.submit(req, "http") for _ in range(4)]
        taken = hub.take(2)  # in the pipeline: no longer in the queue
        hub.finish(taken[0], [np.zeros((2, 1), np.float32)])
        err = RequestRejected("the server stopped", 503, "UNAVAILABLE")
        assert hub.abandon(err) == 3 and not hub.open and not hub.queue
        await asyncio.sleep(0)
        assert tickets[0].future.result()[0].shape == (2, 1)
        for t in tickets[1:]:
            with pytest.raises(RequestRejected, match="stopped"):
                t.future.result()
        assert hub.abandon(err) == 0

    asyncio.run(main())


def test_the_hubs_request_metrics_read_as_prometheus_clients_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """[Note: metrics per batch]: the hub's counters and histograms, folded per batch of values (also past the
    fold threshold, and with values on the bucket bounds), expose exactly what prometheus_client's Counter
    and Histogram give for the same requests, answered through Hub.finish and Hub.count."""
    import asyncio
    import time

    from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

    from hpcsplit.runtime.server import hub as hubmod

    now = [0.0]  # the hub's perf_counter reads the latency the request at hand should have
    monkeypatch.setattr(hubmod, "time", T(perf_counter=lambda: now[0], time=time.time))
    rng = np.random.default_rng(0)
    lat = np.concatenate([rng.exponential(0.01, 5000), np.asarray(hubmod._LATENCY_BUCKETS)])  # bounds: le
    ref = CollectorRegistry()
    r_req = Counter("hpcsplit_requests", "x", ["protocol", "outcome"], registry=ref)
    r_lat = Histogram("hpcsplit_request_latency_seconds", "x", ["protocol"], buckets=hubmod._LATENCY_BUCKETS,
                      registry=ref)
    r_batch = Histogram("hpcsplit_request_batch_size", "x", buckets=hubmod._BATCH_BUCKETS, registry=ref)
    r_queue = Histogram("hpcsplit_request_queue_seconds", "x", buckets=hubmod._LATENCY_BUCKETS, registry=ref)
    r_compute = Histogram("hpcsplit_request_compute_seconds", "x", buckets=hubmod._LATENCY_BUCKETS, registry=ref)

    async def main() -> str:
        hub = hubmod.Hub(SPEC, capacity=8, token=None)
        hub.ready.set()
        loop = asyncio.get_running_loop()
        for i, seconds in enumerate(lat.tolist()):
            proto = ("http", "grpc")[i % 2]
            batch = 1 + i % 300
            t = hubmod.Ticket(InferRequest(str(i), [], batch, [0], [True]), proto, loop, loop.create_future(),
                              t_arrival=0.0)  # now - t_arrival is the latency exactly
            now[0] = seconds
            r_req.labels(proto, "timeout" if i % 7 == 0 else "ok").inc()
            r_lat.labels(proto).observe(seconds)
            if i % 7 == 0:
                hub.count(t, "timeout")
                continue
            t.t_admit, t.compute_us = seconds / 2, i
            hub.finish(t, [])
            r_batch.observe(batch)
            r_queue.observe(seconds / 2)
            r_compute.observe(i / 1e6)
        hub.count(None, "rejected", "http")
        r_req.labels("http", "rejected").inc()
        return (await hub.metrics_text()).decode()

    def series(text: str, names: tuple[str, ...]) -> dict[str, float]:
        return {k: float(v) for k, v in (line.rsplit(" ", 1) for line in text.splitlines() if not
                                          line.startswith("#") and line.startswith(names) and "_created" not in line)}

    names = ("hpcsplit_requests_total", "hpcsplit_request_latency_seconds", "hpcsplit_request_batch_size",
             "hpcsplit_request_queue_seconds", "hpcsplit_request_compute_seconds")
    got, want = series(asyncio.run(main()), names), series(generate_latest(ref).decode(), names)
    assert set(got) == set(want) and len(want) > 80
    for k, v in want.items():
        assert got[k] == pytest.approx(v, rel=1e-9), k


@pytest.mark.parametrize("name", ["m", "odd name"])
def test_the_served_models_infer_paths_and_the_others(name: str) -> None:
    """The served model's own infer paths are plain routes (aiohttp finds them by one dict lookup) and
    answer; another model or version still gets 404 naming what is served; a name that is not a plain
    path part (a space) is served through the pattern routes alone, with the same answers."""
    import asyncio

    from aiohttp.test_utils import TestClient, TestServer

    from hpcsplit.runtime.server.http_api import make_app
    from hpcsplit.runtime.server.hub import Hub

    spec = ModelSpec(name, SPEC.inputs, SPEC.outputs, SPEC.max_batch_size)
    hub = Hub(spec, 8, None)
    hub.ready.set()

    def answer() -> None:  # the frontend loop's part: every request gets y = its batch, shape [N, 1]
        for t in hub.take(8):
            hub.finish(t, [np.full((t.req.batch, 1), t.req.batch, np.float32)])

    async def main() -> None:
        loop = asyncio.get_running_loop()
        hub.on_submit = lambda: loop.call_soon(answer)
        app = make_app(hub, 1 << 20, "0")
        async with TestClient(TestServer(app)) as client:
            own = f"/v2/models/{name}/infer"
            for path in (own, f"/v2/models/{name}/versions/1/infer"):
                r = await client.post(path.replace(" ", "%20"), data=_req([_x(), _ids()]))
                assert r.status == 200, await r.text()
                out = (await r.json())["outputs"][0]
                assert out["name"] == "y" and out["shape"] == [2, 1] and out["data"] == [2.0, 2.0]
            for path, says in (("/v2/models/other/infer", "unknown model 'other'"),
                               (f"/v2/models/{name}/versions/2/infer", "has no version '2'")):
                r = await client.post(path.replace(" ", "%20"), data=_req([_x(), _ids()]))
                assert r.status == 404 and says in (await r.json())["error"]
        plain = {r.resource.canonical for r in app.router.routes() if "{" not in r.resource.canonical}
        assert (f"/v2/models/{name}/infer" in plain) == (" " not in name)

    asyncio.run(main())
