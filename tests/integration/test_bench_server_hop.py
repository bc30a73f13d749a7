"""The server benchmark's reference servers (``python -m hpcsplit.bench server``): the echo answers the
real clients, and a hop server's answers really go through its peer process (killed, the hop server
answers errors at once instead of hanging), so the hop column measures a round trip, not the echo."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException


def _children(pid: int) -> list[int]:
    kids: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            kids += [int(k) for k in (task / "children").read_text().split()]
        except OSError:  # the thread ended meanwhile
            pass
    return kids


@pytest.fixture(params=[None, "wait", "spin"])
def echo(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], dict, str | None]]:
    pf = tmp_path / "ports.json"
    hop = request.param
    proc = subprocess.Popen([sys.executable, "-m", "hpcsplit.bench", "server", "--echo-server", str(pf),
                             *(("--hop", hop) if hop else ())])
    try:
        t_end = time.monotonic() + 60
        while not pf.exists():
            assert proc.poll() is None and time.monotonic() < t_end, "the echo server did not start"
            time.sleep(0.1)
        yield proc, json.loads(pf.read_text()), hop
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _infer_http(port: int) -> np.ndarray:
    c = httpclient.InferenceServerClient(f"127.0.0.1:{port}", network_timeout=10.0)
    x = httpclient.InferInput("x", [1, 8], "FP32")
    x.set_data_from_numpy(np.ones((1, 8), np.float32), binary_data=True)
    return c.infer("echo", [x]).as_numpy("output")


def _infer_grpc(port: int) -> np.ndarray:
    c = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
    x = grpcclient.InferInput("x", [1, 8], "FP32")
    x.set_data_from_numpy(np.ones((1, 8), np.float32))
    return c.infer("echo", [x], client_timeout=10.0).as_numpy("output")


def test_echo_and_hop_servers(echo: tuple[subprocess.Popen[bytes], dict, str | None]) -> None:
    proc, ports, hop = echo
    for out in (_infer_http(ports["http_port"]), _infer_grpc(ports["grpc_port"])):
        assert out.shape == (1, 8) and out.dtype == np.float32 and not out.any()
    kids = _children(proc.pid)
    if hop is None:
        assert kids == []
        return
    assert len(kids) == 1  # the peer
    subprocess.run(["kill", "-9", str(kids[0])], check=True)
    t0 = time.monotonic()
    with pytest.raises(InferenceServerException):
        _infer_http(ports["http_port"])
    with pytest.raises(InferenceServerException):
        _infer_grpc(ports["grpc_port"])
    assert time.monotonic() - t0 < 8  # answered, not left to the clients' 10 s timeouts
    assert proc.poll() is None  # the server itself goes on
