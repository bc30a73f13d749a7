"""Protocol workers (``runtime.server_workers``) and TLS (``runtime.tls_cert`` / ``tls_key``) under real
``mpiexec``, called with the real clients.

- ``server_workers=2``: tritonclient over HTTP (JSON and binary) and gRPC gets the whole model's outputs; the
  token is still required on both protocols; requests on many connections (spread over both workers by the
  kernel) are all counted in ``/metrics`` and ``/stats``, whichever worker answers those; perf_analyzer runs
  through them; SIGTERM with requests in flight: every one is answered with its outputs, exit 0, the workers
  gone.
- TLS with tritonclient HTTP (``ssl=True`` and the test's CA) and gRPC (``ssl=True``, root certificates), on
  the frontend's own servers and through workers (perf_analyzer too); plain HTTP to a TLS port fails, a CA
  that did not sign the certificate is refused, the token is still needed; the login side's pinned poll.
- A worker killed with SIGKILL is named in the log and the other goes on serving; the frontend rank killed
  with SIGKILL takes its workers with it (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import datetime
import ipaddress
import json
import os
import re
import signal
import ssl
import subprocess
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.integration.test_bench_server_hop import _children
from tests.mpi.test_serve import _last, _whole_per_request
from tests.mpi.test_server import (  # noqa: F401 - perf_analyzer: the fixture
    Server,
    _check_equal,
    _infer,
    _inputs_for,
    _metric,
    perf_analyzer,
    start_server,
)

pytestmark = pytest.mark.mpi

th = pytest.importorskip("tritonclient.http")
tg = pytest.importorskip("tritonclient.grpc")
from tritonclient.utils import InferenceServerException


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _wait_gone(pids: list[int], timeout_s: float) -> list[int]:
    t_end = time.monotonic() + timeout_s
    while time.monotonic() < t_end and any(_alive(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if _alive(p)]


def make_ca(tmp: Path) -> tuple[Path, Path, Path]:
    """A CA of the test's own, and a server certificate it signed for 127.0.0.1 / localhost: (ca, cert, key)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "hpcsplit test CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
          .not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")]))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                                                        x509.DNSName("localhost")]), critical=False)
            .sign(ca_key, hashes.SHA256()))
    paths = tmp / "ca.pem", tmp / "server.pem", tmp / "server.key"
    paths[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    paths[2].chmod(0o600)
    return paths


# --------------------------------------------------------------------------------------- workers=2
@pytest.fixture(scope="module")
def toy_sb(switchboards: Callable[..., Path]) -> Path:
    return switchboards("toy_mlp", stages=2, max_branches=2)


@pytest.fixture(scope="module")
def workers(tmp_path_factory: pytest.TempPathFactory, toy_sb: Path) -> Iterator[Server]:
    # every batch of the last component takes 0.2 s more: the drain test's requests are in flight at SIGTERM
    srv = start_server(tmp_path_factory.mktemp("workers"), toy_sb, {"server_workers": 2, "verify": False,
                                                                     "fault": {"component": _last(toy_sb),
                                                                               "kind": "sleep", "sleep_s": 0.2,
                                                                               "after_batches": 0, "times": 10**6}})
    yield srv
    srv.stop()


def test_workers_serve_the_whole_models_outputs(workers: Server, toy_sb: Path) -> None:
    assert workers.ep["workers"] == 2 and len(workers.ep["worker_pids"]) == 2
    assert sorted(workers.ep["worker_pids"]) == sorted(_children(workers.ep["pid"]))  # the frontend rank's children
    _check_equal(workers, toy_sb, [(th, False), (th, True), (tg, True)])


def test_workers_refuse_a_missing_token(workers: Server, toy_sb: Path) -> None:
    x = _inputs_for(toy_sb, 1, seed=3)[0]
    code, body = workers.post(f"/v2/models/{workers.model}/infer", json.dumps(
        {"inputs": [{"name": "x", "datatype": "FP32", "shape": list(x.shape), "data": x.ravel().tolist()}]}).encode(),
        headers={})
    assert code == 401 and "bearer token" in body["error"]
    i = tg.InferInput("x", list(x.shape), "FP32")
    i.set_data_from_numpy(x)
    with pytest.raises(InferenceServerException, match="UNAUTHENTICATED"):
        workers.grpc().infer(workers.model, [i])
    with pytest.raises(InferenceServerException, match="UNAUTHENTICATED"):
        workers.grpc().infer(workers.model, [i], headers={"authorization": "Bearer wrong"})
    assert _metric(workers, 'hpcsplit_requests_total{outcome="unauthenticated"') >= 3


def test_workers_metrics_count_every_worker(workers: Server, toy_sb: Path) -> None:
    """Each request on a connection of its own (the kernel spreads them over both workers): /metrics and
    /stats, from whichever worker answers, count all of them."""
    m0 = _metric(workers, 'hpcsplit_requests_total{outcome="ok"')
    s0 = workers.http().get_inference_statistics(workers.model, headers=workers.headers())["model_stats"][0]
    xs = _inputs_for(toy_sb, 1, seed=5)
    for _ in range(12):
        _infer(workers, th, toy_sb, xs)  # a new client, so a new connection, each time
    for _ in range(12):
        _metric(workers, "hpcsplit_queue_depth")  # ask different workers too
    assert _metric(workers, 'hpcsplit_requests_total{outcome="ok"') == m0 + 12
    s1 = workers.http().get_inference_statistics(workers.model, headers=workers.headers())["model_stats"][0]
    assert s1["inference_count"] == s0["inference_count"] + 12
    assert _metric(workers, "hpcsplit_server_workers") == 2


def test_workers_perf_analyzer(workers: Server, perf_analyzer: Path) -> None:  # noqa: F811 - test_server's fixture
    pa = perf_analyzer
    for proto, port, key in (("http", workers.ep["http_port"], "Authorization"),
                             ("grpc", workers.ep["grpc_port"], "authorization")):
        r = subprocess.run([str(pa), "-m", workers.model, "-u", f"127.0.0.1:{port}", "-i", proto, "-H",
                            f"{key}:Bearer {workers.token}", "--concurrency-range", "2", "--measurement-interval",
                            "1000", "--stability-percentage", "1000", "--max-trials", "10"],
                           capture_output=True, text=True, timeout=150, check=False)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]


def test_workers_drain_on_sigterm_with_nothing_lost(workers: Server, toy_sb: Path) -> None:
    """Last of the fixture's tests: 8 clients (HTTP and gRPC) send requests back to back, and SIGTERM comes
    while some are in flight (every batch takes 0.2 s).  Every request the server accepted is answered with
    its outputs: the clients' successes are exactly the requests the server counts as answered, none
    failed, and the only refusals are the drain's 503 (or a connection the stopped workers no longer
    take, or a gRPC call cancelled by gRPC as a worker's port closes); the job exits 0 and the workers are
    gone."""
    pids = list(workers.ep["worker_pids"])
    ok0 = _metric(workers, 'hpcsplit_requests_total{outcome="ok"')
    ok: list[int] = []
    refused: list[str] = []
    wrong: list[str] = []
    xs = [_inputs_for(toy_sb, 1 + k % 3, seed=40 + k) for k in range(8)]
    refs = [_whole_per_request(toy_sb, x) for x in xs]

    def client(k: int) -> None:
        for _ in range(100):
            try:
                got = _infer(workers, tg if k % 2 else th, toy_sb, xs[k])
            except InferenceServerException as e:
                msg = str(e)
                # CANCELLED: a call that reached a worker's gRPC server as it closed (gRPC cancels the calls it
                # has not handed to a handler yet): never admitted, so not in the server's count below
                refusal = ("503", "UNAVAILABLE", "not ready", "onnect") + (("StatusCode.CANCELLED",) if k % 2 else ())
                (refused if any(s in msg for s in refusal) else wrong).append(msg)
                return
            except Exception as e:  # noqa: BLE001 - a keep-alive connection the stopping worker closed
                refused.append(f"{type(e).__name__}: {e}")
                return
            for g, r in zip(got, refs[k], strict=True):
                if g.shape[0] != r.shape[0] or not np.allclose(g.reshape(r.shape), r, atol=1e-5, rtol=1e-4):
                    wrong.append(f"client {k}: wrong outputs")
            ok.append(k)

    threads = [threading.Thread(target=client, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 20
    while _metric(workers, "hpcsplit_inflight_samples") < 4:
        assert time.monotonic() < deadline, "no requests in flight"
        time.sleep(0.02)
    workers.proc.send_signal(signal.SIGTERM)
    for t in threads:
        t.join(60)
    assert not wrong, wrong
    assert workers.stop() == 0, workers.log.read_text()[-3000:]
    text = workers.log.read_text()
    assert "draining" in text and "Traceback" not in text, text[-3000:]
    line = next(x for x in text.splitlines() if "server: stopped after" in x)
    answered, failed = (int(w) for w in re.findall(r"(\d+) answered, (\d+) failed", line)[0])
    assert failed == 0 and answered == ok0 + len(ok), (line, ok0, len(ok), refused)
    # 4 samples were in flight at the signal (2 requests at least): answered, as every request accepted
    assert len(ok) >= 2 and len(refused) == 8, (len(ok), refused)
    assert _wait_gone(pids, 5) == []


# ---------------------------------------------------------------------------------------------- TLS
def _tls_clients(srv: Server, ca: Path) -> tuple[Any, Any]:
    return (th.InferenceServerClient(srv.url, ssl=True, ssl_options={"ca_certs": str(ca)}),
            tg.InferenceServerClient(srv.ep["grpc_target"], ssl=True, root_certificates=str(ca)))


def _check_tls(srv: Server, sb: Path, ca: Path) -> None:
    assert srv.ep["tls"] is True and srv.ep["http_url"].startswith("https://")
    h, g = _tls_clients(srv, ca)
    xs = _inputs_for(sb, 3, seed=8)
    ref = _whole_per_request(sb, xs)[0]
    x = th.InferInput("x", list(xs[0].shape), "FP32")
    x.set_data_from_numpy(xs[0], binary_data=True)
    out = h.infer(srv.model, [x], headers=srv.headers()).as_numpy(_out_name(sb))
    np.testing.assert_allclose(out.reshape(ref.shape), ref, atol=1e-5, rtol=1e-4)
    gx = tg.InferInput("x", list(xs[0].shape), "FP32")
    gx.set_data_from_numpy(xs[0])
    out = g.infer(srv.model, [gx], headers=srv.gmeta()).as_numpy(_out_name(sb))
    np.testing.assert_allclose(out.reshape(ref.shape), ref, atol=1e-5, rtol=1e-4)
    with pytest.raises(InferenceServerException, match="401"):  # the token is still needed over TLS
        h.infer(srv.model, [x])
    with pytest.raises(InferenceServerException, match="UNAUTHENTICATED"):
        g.infer(srv.model, [gx])
    with pytest.raises(OSError):  # plain HTTP to the TLS port gets no answer
        urllib.request.urlopen(f"http://{srv.url}/v2/health/live", timeout=5)
    (srv.run.parent / "other").mkdir(exist_ok=True)
    other = make_ca(srv.run.parent / "other")[0]
    with pytest.raises(Exception):  # noqa: B017 - a CA that did not sign the certificate: refused
        th.InferenceServerClient(srv.url, ssl=True, ssl_options={"ca_certs": str(other)}).is_server_live()


def _out_name(sb: Path) -> str:
    from hpcsplit.switchboard.reader import Switchboard

    return Switchboard.load(sb).layout.outputs[0].name


def test_tls_on_the_frontends_own_servers(tmp_path: Path, toy_sb: Path) -> None:
    ca, cert, key = make_ca(tmp_path)
    srv = start_server(tmp_path, toy_sb, {"server_workers": 0, "tls_cert": str(cert), "tls_key": str(key)})
    try:
        _check_tls(srv, toy_sb, ca)
        # the login side's status line: the token goes only to the server with that very certificate
        from hpcsplit.launch.serve_watch import fetch_pinned, parse_metrics

        text = fetch_pinned("127.0.0.1", srv.ep["http_port"], "/metrics", srv.token, str(cert)).decode()
        assert parse_metrics(text)["ok"] >= 2
        with pytest.raises(ssl.SSLError, match="another certificate"):
            fetch_pinned("127.0.0.1", srv.ep["http_port"], "/metrics", srv.token, str(ca))
    finally:
        assert srv.stop() == 0, srv.log.read_text()[-3000:]


def test_tls_through_workers_and_a_worker_that_dies(tmp_path: Path, toy_sb: Path,
                                                    perf_analyzer: Path) -> None:  # noqa: F811 - the fixture
    """TLS through two workers; one killed (SIGKILL) is named and the other serves on; then the frontend
    rank killed (SIGKILL) takes the last worker with it."""
    ca, cert, key = make_ca(tmp_path)
    srv = start_server(tmp_path, toy_sb, {"server_workers": 2, "tls_cert": str(cert), "tls_key": str(key)})
    try:
        _check_tls(srv, toy_sb, ca)
        pa = perf_analyzer
        for proto, url, ssl_args, key in (
                ("http", f"https://{srv.url}", ["--ssl-https-ca-certificates-file", str(ca)], "Authorization"),
                ("grpc", srv.ep["grpc_target"], ["--ssl-grpc-use-ssl", "true", "--ssl-grpc-root-certifications-file",
                                                 str(ca)], "authorization")):
            r = subprocess.run([str(pa), "-m", srv.model, "-u", url, "-i", proto, *ssl_args, "-H",
                                f"{key}:Bearer {srv.token}", "--concurrency-range", "2", "--measurement-interval",
                                "1000", "--stability-percentage", "1000", "--max-trials", "10"],
                               capture_output=True, text=True, timeout=150, check=False)
            assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
        first, second = srv.ep["worker_pids"]
        os.kill(first, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while f"protocol worker 0 (pid {first}) died (killed by SIGKILL)" not in srv.log.read_text():
            assert time.monotonic() < deadline, srv.log.read_text()[-2000:]
            time.sleep(0.1)
        h, _ = _tls_clients(srv, ca)
        for _ in range(4):  # new connections go to the worker left
            assert h.is_server_ready()
        os.kill(srv.ep["pid"], signal.SIGKILL)
        assert _wait_gone([second], 10) == [], "a worker outlived the frontend rank"
    finally:
        srv.stop()
