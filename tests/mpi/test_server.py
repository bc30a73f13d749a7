"""Server mode (``runtime.mode=server``) under real ``mpiexec``, called with real clients.

One toy server (3 ranks) takes most checks: tritonclient HTTP (JSON and binary) and gRPC outputs equal the
whole model's at batch 1 and 4, concurrent clients, every refusal answered with its code while the server
keeps serving, statistics and metrics that move, perf_analyzer over HTTP and gRPC with the token, and last
SIGTERM: drained, exit 0.  Tiny CLIP over both protocols; a slow component (queue full -> 503, the request
timeout -> 504) and a raising one (errors to the clients, the job exits non-zero within seconds).
"""

from __future__ import annotations

import contextlib
import csv
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.mpi.test_serve import MPIEXEC, _last, _plan, _whole_per_request

pytestmark = pytest.mark.mpi

torch = pytest.importorskip("torch")
th = pytest.importorskip("tritonclient.http")
tg = pytest.importorskip("tritonclient.grpc")
from tritonclient.utils import InferenceServerException

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Server:
    proc: subprocess.Popen[str]
    run: Path
    log: Path
    ep: dict[str, Any]
    token: str
    model: str

    @property
    def url(self) -> str:
        return f"{self.ep['host']}:{self.ep['http_port']}"

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}  # a fresh dict per call (tritonclient writes into it)

    def gmeta(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.token}"}

    def http(self) -> Any:
        return th.InferenceServerClient(self.url, concurrency=8)

    def grpc(self) -> Any:
        return tg.InferenceServerClient(self.ep["grpc_target"])

    def post(self, path: str, body: bytes, headers: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
        req = urllib.request.Request(f"http://{self.url}{path}", data=body, method="POST",
                                     headers=self.headers() if headers is None else headers)
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def stop(self, timeout_s: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            return -9


def start_server(tmp: Path, sb_dir: Path, runtime: dict[str, Any], n_ranks: int | None = None,
                 timeout_s: float = 150.0) -> Server:
    """mpiexec the serve stage in server mode on 127.0.0.1; wait for its endpoint.json."""
    n = n_ranks or _plan(sb_dir, tmp / "plan.json")
    run = tmp / "run"
    cfg = {"stage": "serve", "plan": str(tmp / "plan.json"), "switchboard": str(sb_dir),
           "runtime": {"mode": "server", "server_host": "127.0.0.1", **runtime}}
    (tmp / "cfg.json").write_text(json.dumps(cfg))
    log = tmp / "server.log"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    with open(log, "w") as f:
        proc = subprocess.Popen([MPIEXEC, "-n", str(n), sys.executable, "-m", "mpi4py", "-m", "hpcsplit.launch.rank",
                                 "hpcsplit.runtime.stage:mpi_main", str(tmp / "cfg.json"), str(run)],
                                stdout=f, stderr=subprocess.STDOUT, text=True, env=env, cwd=tmp)
    t_end = time.monotonic() + timeout_s
    ep_path = run / "endpoint.json"
    while not ep_path.exists():
        if proc.poll() is not None or time.monotonic() > t_end:
            proc.kill()
            raise AssertionError(f"server did not start (rc {proc.poll()}):\n{log.read_text()[-3000:]}")
        time.sleep(0.2)
    time.sleep(0.1)
    ep = json.loads(ep_path.read_text())
    token = Path(ep["token_file"]).read_text().strip() if ep["token_file"] else ""
    return Server(proc, run, log, ep, token, ep["model"])


def _inputs_for(sb_dir: Path, batch: int, seed: int) -> list[np.ndarray]:
    from hpcsplit.switchboard.reader import Switchboard

    sb = Switchboard.load(sb_dir)
    gen = torch.Generator().manual_seed(seed)
    out = []
    for ex in sb.example_inputs(batch):
        if ex.is_floating_point():
            out.append(torch.randn(ex.shape, generator=gen).numpy())
        else:
            out.append(ex.numpy().copy())
    return out


def _names(sb_dir: Path) -> tuple[list[str], list[str]]:
    from hpcsplit.switchboard.reader import Switchboard

    lay = Switchboard.load(sb_dir).layout
    return [t.name for t in lay.inputs], [t.name for t in lay.outputs]


_DT = {"float32": "FP32", "int64": "INT64"}


def _infer(srv: Server, mod: Any, sb_dir: Path, xs: list[np.ndarray], binary: bool = True) -> list[np.ndarray]:
    ins_n, outs_n = _names(sb_dir)
    ins = []
    for name, x in zip(ins_n, xs, strict=True):
        i = mod.InferInput(name, list(x.shape), _DT[str(x.dtype)])
        if mod is th:
            i.set_data_from_numpy(x, binary_data=binary)
        else:
            i.set_data_from_numpy(x)
        ins.append(i)
    if mod is th:
        outs = [th.InferRequestedOutput(n, binary_data=binary) for n in outs_n]
        r = srv.http().infer(srv.model, ins, outputs=outs, headers=srv.headers())
    else:
        r = srv.grpc().infer(srv.model, ins, headers=srv.gmeta())
    return [r.as_numpy(n) for n in outs_n]


def _check_equal(srv: Server, sb_dir: Path, kinds: list[tuple[Any, bool]]) -> None:
    for batch in (1, 4):
        xs = _inputs_for(sb_dir, batch, seed=batch)
        ref = _whole_per_request(sb_dir, xs)
        for mod, binary in kinds:
            got = _infer(srv, mod, sb_dir, xs, binary)
            for g, r in zip(got, ref, strict=True):
                assert g.shape[0] == batch
                np.testing.assert_allclose(g.reshape(r.shape), r, atol=1e-5, rtol=1e-4)


# ---------------------------------------------------------------------------------------------- toy
@pytest.fixture(scope="module")
def toy_sb(switchboards: Callable[..., Path]) -> Path:
    return switchboards("toy_mlp", stages=2, max_branches=2)


@pytest.fixture(scope="module")
def toy(tmp_path_factory: pytest.TempPathFactory, toy_sb: Path) -> Iterator[Server]:
    srv = start_server(tmp_path_factory.mktemp("toy_server"), toy_sb, {"server_max_body_mb": 0.05})
    yield srv
    srv.stop()


def test_protocol_routes(toy: Server) -> None:
    c = toy.http()
    assert c.is_server_live() and c.is_server_ready()
    meta = c.get_server_metadata(headers=toy.headers())
    assert {"binary_tensor_data", "statistics"} <= set(meta["extensions"])
    m = c.get_model_metadata(toy.model, headers=toy.headers())
    assert m["inputs"] == [{"name": "x", "datatype": "FP32", "shape": [-1, 64]}]
    assert m["versions"] == ["1"]
    cfg = c.get_model_config(toy.model, headers=toy.headers())
    assert cfg["max_batch_size"] == 64 and cfg["input"][0]["dims"] == [64]
    assert c.is_model_ready(toy.model, headers=toy.headers())
    g = toy.grpc()
    assert g.is_server_ready(headers=toy.gmeta()) and g.is_model_ready(toy.model, headers=toy.gmeta())
    assert g.get_model_config(toy.model, headers=toy.gmeta()).config.max_batch_size == 64
    assert Path(toy.ep["token_file"]).stat().st_mode & 0o777 == 0o600


def test_outputs_equal_whole_model(toy: Server, toy_sb: Path) -> None:
    _check_equal(toy, toy_sb, [(th, False), (th, True), (tg, True)])


def test_concurrent_clients(toy: Server, toy_sb: Path) -> None:
    sizes = [1 + k % 3 for k in range(24)]
    pool = _inputs_for(toy_sb, sum(sizes), seed=100)
    ref = _whole_per_request(toy_sb, pool)[0]  # the whole model once, per sample
    cut = np.cumsum([0, *sizes])
    xs = [[pool[0][cut[k]:cut[k + 1]]] for k in range(24)]
    refs = [ref[cut[k]:cut[k + 1]] for k in range(24)]
    got: dict[int, np.ndarray] = {}
    errors: list[BaseException] = []

    def client(k0: int) -> None:
        try:
            for k in range(k0, len(xs), 8):
                got[k] = _infer(toy, tg if k % 2 else th, toy_sb, xs[k])[0]
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=client, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    for k, r in enumerate(refs):
        np.testing.assert_allclose(got[k], r, atol=1e-5, rtol=1e-4)


def test_grpc_stream_answers_in_order_and_refusals_keep_the_stream(toy: Server, toy_sb: Path) -> None:
    """ModelStreamInfer (tritonclient's start_stream, perf_analyzer --streaming): batch 1 and 4 requests
    equal the whole model, in the stream's order; a wrong dtype is answered with an error and the stream
    goes on; a stream without the token is refused."""
    import queue

    got: queue.Queue[tuple[Any, Any]] = queue.Queue()
    c = toy.grpc()
    c.start_stream(callback=lambda result, error: got.put((result, error)), headers=toy.gmeta())
    ins_n, outs_n = _names(toy_sb)
    expect: list[tuple[str, Any]] = []
    for k, batch in enumerate((1, 4, 2, 4)):
        xs = _inputs_for(toy_sb, batch, seed=20 + k)
        ins = []
        for name, x in zip(ins_n, xs, strict=True):
            i = tg.InferInput(name, list(x.shape), _DT[str(x.dtype)])
            i.set_data_from_numpy(x)
            ins.append(i)
        c.async_stream_infer(toy.model, ins, request_id=f"r{k}")
        expect.append((f"r{k}", _whole_per_request(toy_sb, xs)))
        if k == 1:
            bad = tg.InferInput(ins_n[0], list(xs[0].shape), "FP64")
            bad.set_data_from_numpy(xs[0].astype(np.float64))
            c.async_stream_infer(toy.model, [bad], request_id="bad")
            expect.append(("bad", None))
    for rid, ref in expect:
        result, error = got.get(timeout=30)
        if ref is None:
            assert result is None and "expected datatype FP32" in str(error), (result, error)
            continue
        assert error is None, error
        assert result.get_response().id == rid
        for name, r in zip(outs_n, ref, strict=True):
            np.testing.assert_allclose(result.as_numpy(name).reshape(r.shape), r, atol=1e-5, rtol=1e-4)
    c.stop_stream()
    c2 = toy.grpc()
    c2.start_stream(callback=lambda result, error: got.put((result, error)))
    xs = _inputs_for(toy_sb, 1, seed=1)
    i = tg.InferInput(ins_n[0], list(xs[0].shape), _DT[str(xs[0].dtype)])
    i.set_data_from_numpy(xs[0])
    with contextlib.suppress(InferenceServerException):  # refused at the stream's start, maybe before this
        c2.async_stream_infer(toy.model, [i])
    result, error = got.get(timeout=30)
    assert result is None and "UNAUTHENTICATED" in str(error.status()), error
    c2.stop_stream()


def _body(name: str = "x", dt: str = "FP32", shape: list[int] | None = None, data: Any = None) -> bytes:
    shape = shape or [1, 64]
    n = int(np.prod(shape))
    return json.dumps({"inputs": [{"name": name, "datatype": dt, "shape": shape,
                                   "data": data if data is not None else [0.5] * n}]}).encode()


def test_refusals_keep_serving(toy: Server, toy_sb: Path) -> None:
    path = f"/v2/models/{toy.model}/infer"
    code, body = toy.post(path, _body(), headers={})
    assert code == 401 and "bearer token" in body["error"]
    code, body = toy.post(path, _body(), headers={"Authorization": "Bearer wrong"})
    assert code == 401
    code, body = toy.post(path, _body(dt="INT32", data=[1] * 64))
    assert code == 400 and "'x'" in body["error"] and "FP32" in body["error"] and "INT32" in body["error"]
    code, body = toy.post(path, _body(shape=[1, 63]))
    assert code == 400 and "[-1, 64]" in body["error"] and "[1, 63]" in body["error"]
    code, body = toy.post(path, _body(name="y"))
    assert code == 400 and "unknown input 'y'" in body["error"]
    code, body = toy.post(path, b"{not json")
    assert code == 400 and "not valid JSON" in body["error"]
    code, body = toy.post(path, _body(shape=[200, 64]))  # 200 * 64 values: over the 0.05 MB bound
    assert code == 413 and "limit" in body["error"]
    code, body = toy.post(path, _body(data=["a"] * 64))
    assert code == 400 and "'x'" in body["error"]
    code, body = toy.post("/v2/models/nope/infer", _body())
    assert code == 404 and "unknown model" in body["error"]
    g = toy.grpc()
    x = tg.InferInput("x", [1, 64], "FP32")
    x.set_data_from_numpy(np.zeros((1, 64), np.float32))
    with pytest.raises(InferenceServerException, match="UNAUTHENTICATED"):
        g.infer(toy.model, [x])
    bad = tg.InferInput("x", [1, 32], "FP32")
    bad.set_data_from_numpy(np.zeros((1, 32), np.float32))
    with pytest.raises(InferenceServerException, match="INVALID_ARGUMENT.*expected shape"):
        g.infer(toy.model, [bad], headers=toy.gmeta())
    # still serving, and nothing of the above reached a rank
    xs = _inputs_for(toy_sb, 2, seed=7)
    np.testing.assert_allclose(_infer(toy, th, toy_sb, xs)[0], _whole_per_request(toy_sb, xs)[0], atol=1e-5)


def _metric(srv: Server, name: str) -> float:
    req = urllib.request.Request(f"http://{srv.url}/metrics", headers=srv.headers())
    text = urllib.request.urlopen(req, timeout=10).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


def test_statistics_and_metrics_move(toy: Server, toy_sb: Path) -> None:
    c = toy.http()
    before = c.get_inference_statistics(toy.model, headers=toy.headers())["model_stats"][0]
    m0 = _metric(toy, 'hpcsplit_requests_total{outcome="ok"')
    _infer(toy, th, toy_sb, _inputs_for(toy_sb, 3, seed=9))
    after = c.get_inference_statistics(toy.model, headers=toy.headers())["model_stats"][0]
    assert after["inference_count"] == before["inference_count"] + 3
    assert after["execution_count"] == before["execution_count"] + 1
    assert after["inference_stats"]["success"]["ns"] > before["inference_stats"]["success"]["ns"]
    assert _metric(toy, 'hpcsplit_requests_total{outcome="ok"') == m0 + 1
    assert _metric(toy, "hpcsplit_queue_depth") == 0
    # every component replica's own counters, which its rank sends once a second while they change
    from hpcsplit.switchboard.reader import Switchboard

    comps = Switchboard.load(toy_sb).order
    s0 = {c: _metric(toy, f'hpcsplit_component_samples_total{{component="{c}"') for c in comps}
    _infer(toy, th, toy_sb, _inputs_for(toy_sb, 4, seed=10))
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(
            _metric(toy, f'hpcsplit_component_samples_total{{component="{c}"') < s0[c] + 4 for c in comps):
        time.sleep(0.3)
    for c in comps:
        assert _metric(toy, f'hpcsplit_component_samples_total{{component="{c}"') >= s0[c] + 4, c
        assert _metric(toy, f'hpcsplit_component_batches_total{{component="{c}"') >= 1
        assert _metric(toy, f'hpcsplit_component_compute_seconds_total{{component="{c}"') > 0
    code = urllib.request.Request(f"http://{toy.url}/metrics")
    with pytest.raises(urllib.error.HTTPError, match="401"):
        urllib.request.urlopen(code, timeout=10)


@pytest.fixture(scope="session")
def perf_analyzer() -> Path:
    p = subprocess.run([str(ROOT / "scripts" / "setup-perf.sh")], capture_output=True, text=True, timeout=600,
                       check=False)
    if p.returncode != 0:
        pytest.skip(f"perf_analyzer could not be installed here (scripts/setup-perf.sh): {p.stderr[-500:]}")
    return ROOT / p.stdout.strip().splitlines()[-1]


@pytest.mark.parametrize("protocol", ["http", "grpc", "grpc-stream"])
def test_perf_analyzer_sweep(toy: Server, perf_analyzer: Path, protocol: str, tmp_path: Path) -> None:
    streaming = protocol == "grpc-stream"
    protocol = "grpc" if streaming else protocol
    port = toy.ep["http_port"] if protocol == "http" else toy.ep["grpc_port"]
    key = "Authorization" if protocol == "http" else "authorization"
    cmd = [str(perf_analyzer), "-m", toy.model, "-u", f"127.0.0.1:{port}", "-i", protocol,
           "-H", f"{key}:Bearer {toy.token}", "--concurrency-range", "1:2", "-b", "2",
           # the sweep is asked to complete, not to time anything: on a loaded 2-core CI machine one-second
           # windows at concurrency 1 varied by more than 1.9x four times running (CI of stop 24), so any three
           # windows within 11x of each other count as stable
           "--measurement-interval", "1000", "--stability-percentage", "1000", "--max-trials", "10",
           "-f", str(tmp_path / "pa.csv"), *(["--streaming"] if streaming else [])]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=150, check=False)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert "Concurrency: 1" in p.stdout and "Concurrency: 2" in p.stdout, p.stdout[-2000:]
    rows = list(csv.DictReader((tmp_path / "pa.csv").open()))
    assert [int(r["Concurrency"]) for r in rows] == [1, 2], rows
    assert all(float(r["Inferences/Second"]) > 0 for r in rows), rows


def test_sigterm_drains_and_exits_0(toy: Server, toy_sb: Path) -> None:
    """Last of the toy server's tests: a request in flight when SIGTERM comes is answered; exit 0."""
    xs = _inputs_for(toy_sb, 4, seed=11)
    toy.proc.send_signal(signal.SIGTERM)
    try:
        _infer(toy, th, toy_sb, xs)  # answered, or refused with 503 once draining
    except InferenceServerException as e:
        assert "503" in str(e) or "not ready" in str(e) or "Connect" in str(e)
    assert toy.stop() == 0, toy.log.read_text()[-3000:]
    text = toy.log.read_text()
    assert "not ready, refusing new requests" in text and "server: stopped after" in text
    assert "Traceback" not in text and "Exception in callback" not in text, text[-3000:]  # the whole life of the server
    assert not (toy.run / "endpoint.json").exists()


# --------------------------------------------------------------------------------------------- CLIP
@pytest.mark.slow
def test_clip_outputs_equal_whole_model(tmp_path: Path, switchboards: Callable[..., Path]) -> None:
    pytest.importorskip("transformers")
    sb = switchboards("clip_tiny")
    srv = start_server(tmp_path, sb, {})
    try:
        _check_equal(srv, sb, [(th, True), (tg, True), (th, False)])
    finally:
        assert srv.stop() == 0


# -------------------------------------------------------------------------------------------- faults
def test_queue_full_and_request_timeout(tmp_path: Path, toy_sb: Path) -> None:
    srv = start_server(tmp_path, toy_sb, {"verify": False, "server_queue": 1, "max_inflight": 1,
                                          "request_timeout_s": 1.5,
                                          "fault": {"component": _last(toy_sb), "kind": "sleep",
                                                    "after_batches": 0, "sleep_s": 3.0, "times": 1}})
    try:
        results: dict[int, tuple[int, dict[str, Any]]] = {}

        def send(k: int) -> None:
            results[k] = srv.post(f"/v2/models/{srv.model}/infer", _body())

        first = threading.Thread(target=send, args=(0,))
        first.start()
        time.sleep(0.5)  # admitted: the slow component holds it
        second = threading.Thread(target=send, args=(1,))
        second.start()
        time.sleep(0.3)  # queued (the window of 1 is taken)
        code, body = srv.post(f"/v2/models/{srv.model}/infer", _body())
        assert code == 503 and "queue is full" in body["error"]
        first.join(30)
        second.join(30)
        assert results[0][0] == 504 and "request_timeout_s" in results[0][1]["error"]
        # the queued one is answered at its own deadline, whether it got into the pipeline or not
        assert results[1][0] == 504 and "request_timeout_s" in results[1][1]["error"]
        assert _metric(srv, 'hpcsplit_requests_total{outcome="busy"') == 1
    finally:
        assert srv.stop() == 0, srv.log.read_text()[-3000:]


def test_raising_component_fails_requests_and_job(tmp_path: Path, toy_sb: Path) -> None:
    srv = start_server(tmp_path, toy_sb, {"verify": False, "abort_grace_s": 1.0,
                                          "fault": {"component": _last(toy_sb), "kind": "raise",
                                                    "after_batches": 0}})
    code, body = srv.post(f"/v2/models/{srv.model}/infer", _body())
    assert code == 500 and "injected fault" in body["error"] and "rank 2" in body["error"]
    t0 = time.monotonic()
    rc = srv.proc.wait(30)
    assert rc != 0 and time.monotonic() - t0 < 20
    assert "injected fault" in srv.log.read_text()
