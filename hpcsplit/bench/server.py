"""Server benchmark: hpcsplit's Open Inference Protocol endpoint vs a bare echo server of the same libraries.

    python -m hpcsplit.bench server [--concurrency 1,8,64] [--interval-ms 2000] [--samples 2000]

One run, figures side by side: requests/s, p50 and p99 (perf_analyzer's, client side) at each concurrency
over HTTP with JSON tensors, HTTP with the binary extension, gRPC, and gRPC streaming (ModelStreamInfer), for

* ``hpcsplit``: ``stage=serve runtime.mode=server`` of a trivial model (one 8 -> 8 linear layer, one component:
  frontend + 1 rank under mpiexec), token on, as deployed;
* ``echo``: an aiohttp app and a grpc.aio server in one process answering every infer with a canned response
  (no parsing, no pipeline): the ceiling of the protocol stack in Python on this machine;
* ``frontend``: the MPI frontend's own ceiling without a protocol: batch mode over ``--samples`` requests.

Target (issue 18): hpcsplit >= 70% of echo's rate on each protocol, and under 1 ms added to p50 at
concurrency 1.  perf_analyzer comes from ``scripts/setup-perf.sh`` (its own venv, .venv-perf).
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import torch
from aiohttp import web
from tritonclient.grpc import model_config_pb2 as mc
from tritonclient.grpc import service_pb2 as pb

from hpcsplit.core.plan import Plan, RankEntry
from hpcsplit.launch.local import find_mpiexec
from hpcsplit.switchboard.reader import Switchboard
from hpcsplit.switchboard.writer import export

ROOT = Path(__file__).resolve().parents[2]
MODES: tuple[tuple[str, str, str, tuple[str, ...]], ...] = (
    ("http-json", "http", "json", ()), ("http-binary", "http", "binary", ()), ("grpc", "grpc", "binary", ()),
    ("grpc-stream", "grpc", "binary", ("--streaming",)))  # ModelStreamInfer: one stream per client


# ------------------------------------------------------------------------------------------- echo
def _echo_main(port_file: str) -> None:
    """The echo server: canned answers for the calls perf_analyzer makes (a subprocess of the bench)."""
    meta = {"name": "echo", "versions": ["1"], "platform": "echo",
            "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 8]}],
            "outputs": [{"name": "output", "datatype": "FP32", "shape": [-1, 8]}]}
    config = {"name": "echo", "max_batch_size": 64, "input": [{"name": "x", "data_type": "TYPE_FP32", "dims": [8]}],
              "output": [{"name": "output", "data_type": "TYPE_FP32", "dims": [8]}]}
    out = np.zeros((1, 8), np.float32)
    json_body = json.dumps({"model_name": "echo", "model_version": "1", "outputs": [
        {"name": "output", "datatype": "FP32", "shape": [1, 8], "data": out.reshape(-1).tolist()}]}).encode()
    head = json.dumps({"model_name": "echo", "model_version": "1", "outputs": [
        {"name": "output", "datatype": "FP32", "shape": [1, 8],
         "parameters": {"binary_data_size": out.nbytes}}]}).encode()

    async def infer(request: web.Request) -> web.Response:
        await request.read()
        if "Inference-Header-Content-Length" in request.headers:
            return web.Response(body=head + out.tobytes(), content_type="application/octet-stream",
                                headers={"Inference-Header-Content-Length": str(len(head))})
        return web.Response(body=json_body, content_type="application/json")

    async def j(obj: Any) -> web.Response:
        return web.json_response(obj)

    app = web.Application()
    app.add_routes([web.get("/v2", lambda _: j({"name": "echo", "version": "1", "extensions": []})),
                    web.get("/v2/models/echo", lambda _: j(meta)),
                    web.get("/v2/models/echo/config", lambda _: j(config)),
                    web.post("/v2/models/echo/infer", infer)])
    T = pb.ModelMetadataResponse.TensorMetadata
    g_meta = pb.ModelMetadataResponse(name="echo", versions=["1"], platform="echo",
                                      inputs=[T(name="x", datatype="FP32", shape=[-1, 8])],
                                      outputs=[T(name="output", datatype="FP32", shape=[-1, 8])])
    g_cfg = pb.ModelConfigResponse(config=mc.ModelConfig(
        name="echo", max_batch_size=64, input=[mc.ModelInput(name="x", data_type=mc.TYPE_FP32, dims=[8])],
        output=[mc.ModelOutput(name="output", data_type=mc.TYPE_FP32, dims=[8])]))
    g_resp = pb.ModelInferResponse(model_name="echo", model_version="1")
    g_resp.outputs.add(name="output", datatype="FP32", shape=[1, 8])
    g_resp.raw_output_contents.append(out.tobytes())

    async def g_infer(_: Any, __: Any) -> Any:
        return g_resp

    async def g_stream(requests: Any, _: Any) -> Any:  # perf_analyzer matches a stream's answers by id
        async for r in requests:
            resp = pb.ModelStreamInferResponse()
            resp.infer_response.CopyFrom(g_resp)
            resp.infer_response.id = r.id
            yield resp

    def h(fn: Any, req: Any) -> Any:
        return grpc.unary_unary_rpc_method_handler(fn, request_deserializer=req.FromString,
                                                   response_serializer=lambda m: m.SerializeToString())

    async def const(x: Any) -> Any:
        async def f(_: Any, __: Any) -> Any:
            return x
        return f

    async def main() -> None:
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        server = grpc.aio.server()
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("inference.GRPCInferenceService", {
            "ModelMetadata": h(await const(g_meta), pb.ModelMetadataRequest),
            "ModelConfig": h(await const(g_cfg), pb.ModelConfigRequest),
            "ServerMetadata": h(await const(pb.ServerMetadataResponse(name="echo", version="1")),
                                pb.ServerMetadataRequest),
            "ModelInfer": h(g_infer, pb.ModelInferRequest),
            "ModelStreamInfer": grpc.stream_stream_rpc_method_handler(
                g_stream, request_deserializer=pb.ModelInferRequest.FromString,
                response_serializer=lambda m: m.SerializeToString())}),))
        gport = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        Path(port_file).write_text(json.dumps({"http_port": runner.addresses[0][1], "grpc_port": gport}))
        await asyncio.Event().wait()

    asyncio.run(main())


# ------------------------------------------------------------------------------------------ setup
def _toy(tmp: Path) -> tuple[Path, Path, int]:
    """A trivial model (one 8 -> 8 linear layer, one component) exported, and its plan (frontend + 1 rank)."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 8)).eval()
    sb_dir = tmp / "switchboard"
    export(m, (torch.randn(2, 8),), out=sb_dir, name="linear8", cost="flops", stages=1)
    sb = Switchboard.load(sb_dir)
    ranks = [RankEntry(0, "frontend", 0, None, None, 1, None, 1, 0)]
    for c in sb.order:
        ranks.append(RankEntry(len(ranks), "component", 0, None, None, 1, c, 16, 0))
    plan = tmp / "plan.json"
    Plan(sb.model_name, sb.sha256, "cpu", 1, tuple(ranks), dict.fromkeys(sb.order, 0.0), {}).save(plan)
    return sb_dir, plan, len(ranks)


def _mpi_cmd(n: int, cfg: Path, run: Path) -> list[str]:
    return [find_mpiexec(None), "-n", str(n), sys.executable, "-m", "mpi4py", "-m", "hpcsplit.launch.rank",
            "hpcsplit.runtime.stage:mpi_main", str(cfg), str(run)]


def _env() -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")


def _start_hpcsplit(tmp: Path, sb: Path, plan: Path, n: int, runtime: dict[str, Any] | None = None,
                    name: str = "server") -> tuple[subprocess.Popen[bytes], dict[str, Any], str]:
    """``stage=serve runtime.mode=server`` under mpiexec on this node; returns it once its endpoint is up."""
    cfg = tmp / f"{name}.cfg.json"
    cfg.write_text(json.dumps({"stage": "serve", "plan": str(plan), "switchboard": str(sb),
                               "runtime": {"mode": "server", "server_host": "127.0.0.1", "max_inflight": 256,
                                           "server_queue": 1024, **(runtime or {})}}))
    run = tmp / f"{name}-run"
    with open(tmp / f"{name}.log", "wb") as log:
        proc = subprocess.Popen(_mpi_cmd(n, cfg, run), env=_env(), stdout=log, stderr=subprocess.STDOUT)
    ep = run / "endpoint.json"
    t_end = time.monotonic() + 180
    while not ep.exists():
        if proc.poll() is not None or time.monotonic() > t_end:
            raise SystemExit(f"the hpcsplit server did not start; log: {tmp / f'{name}.log'}")
        time.sleep(0.2)
    time.sleep(0.2)
    info = json.loads(ep.read_text())
    return proc, info, Path(info["token_file"]).read_text().strip()


def _frontend_ceiling(tmp: Path, sb: Path, plan: Path, n: int, samples: int) -> float | None:
    cfg = tmp / "batch.cfg.json"
    cfg.write_text(json.dumps({"stage": "serve", "plan": str(plan), "switchboard": str(sb),
                               "runtime": {"mode": "batch", "num_samples": samples, "max_inflight": 256,
                                           "verify": False}}))
    run = tmp / "batch-run"
    subprocess.run(_mpi_cmd(n, cfg, run), env=_env(), capture_output=True, timeout=300, check=False)
    try:
        res = json.loads((run / "runtime.mpi_main.result.json").read_text())
        return float(res["variants"]["split"]["throughput_rps"])
    except (OSError, KeyError, ValueError, TypeError):
        return None


def _perf(pa: Path, model: str, port: int, protocol: str, fmt: str, conc: int, interval_ms: int, token: str | None,
          out: Path, extra: tuple[str, ...] = (), timeout_s: float = 120.0) -> tuple[float, float, float] | None:
    """One perf_analyzer level: (infer/s, p50 ms, p99 ms), or None (said on stderr) when it measured nothing."""
    cmd = [str(pa), "-m", model, "-u", f"127.0.0.1:{port}", "-i", protocol, "--concurrency-range", str(conc),
           "--measurement-interval", str(interval_ms), "--stability-percentage", "50", "--max-trials", "6",
           "-f", str(out), *extra]
    if protocol == "http":
        cmd += ["--input-tensor-format", fmt, "--output-tensor-format", fmt]
    if token:
        cmd += ["-H", f"{'Authorization' if protocol == 'http' else 'authorization'}:Bearer {token}"]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        print(f"  perf_analyzer did not finish within {timeout_s:g} s (concurrency {conc})", file=sys.stderr)
        return None
    if p.returncode not in (0, 2) or not out.exists():
        print(f"  perf_analyzer failed (rc {p.returncode}): {(p.stderr or p.stdout)[-300:]}", file=sys.stderr)
        return None
    rows = list(csv.DictReader(out.open()))
    if not rows:
        return None
    r = rows[-1]
    return float(r["Inferences/Second"]), float(r["p50 latency"]) / 1e3, float(r["p99 latency"]) / 1e3


def perf_analyzer() -> Path | None:
    """perf_analyzer from ``scripts/setup-perf.sh`` (installed on first use), or None (said on stderr)."""
    setup = subprocess.run([str(ROOT / "scripts" / "setup-perf.sh")], capture_output=True, text=True, check=False)
    if setup.returncode != 0 or not setup.stdout.strip():
        print(f"perf_analyzer is not available (scripts/setup-perf.sh): {setup.stderr[-500:]}", file=sys.stderr)
        return None
    return ROOT / setup.stdout.strip().splitlines()[-1]


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m hpcsplit.bench server", description=__doc__.splitlines()[0])
    p.add_argument("--concurrency", default="1,8,64")
    p.add_argument("--interval-ms", type=int, default=2000, help="perf_analyzer's measurement interval")
    p.add_argument("--samples", type=int, default=2000, help="requests of the frontend-ceiling batch run")
    p.add_argument("--echo-server", default=None, help=argparse.SUPPRESS)  # internal: run the echo server
    args = p.parse_args(argv)
    if args.echo_server:
        _echo_main(args.echo_server)
        return 0
    pa = perf_analyzer()
    if pa is None:
        return 2
    levels = [int(c) for c in args.concurrency.split(",")]
    with tempfile.TemporaryDirectory(prefix="hpcsplit-bench-server-") as d:
        tmp = Path(d)
        sb, plan, n = _toy(tmp)
        ceiling = _frontend_ceiling(tmp, sb, plan, n, args.samples)
        port_file = tmp / "echo.json"
        echo = subprocess.Popen([sys.executable, "-m", "hpcsplit.bench", "server", "--echo-server", str(port_file)],
                                env=_env())
        srv, info, token = _start_hpcsplit(tmp, sb, plan, n)
        try:
            t_end = time.monotonic() + 60
            while not port_file.exists() and time.monotonic() < t_end:
                time.sleep(0.1)
            eports = json.loads(port_file.read_text())
            table: list[tuple[str, int, Any, Any]] = []
            for label, proto, fmt, extra in MODES:
                for c in levels:
                    k = f"{label}-{c}"
                    e = _perf(pa, "echo", eports[f"{proto}_port"], proto, fmt, c, args.interval_ms, None,
                              tmp / f"e-{k}.csv", extra)
                    h = _perf(pa, info["model"], info[f"{proto}_port"], proto, fmt, c, args.interval_ms, token,
                              tmp / f"h-{k}.csv", extra)
                    table.append((label, c, e, h))
        finally:
            srv.send_signal(signal.SIGTERM)
            echo.terminate()
            try:
                srv.wait(60)
            except subprocess.TimeoutExpired:
                srv.kill()
            echo.wait(10)
    print(f"python -m hpcsplit.bench server: trivial model (one 8 -> 8 linear layer, frontend + 1 component rank), perf_analyzer "
          f"{args.interval_ms} ms windows, {os.cpu_count()} cores")
    print(f"MPI frontend's own ceiling (batch mode, {args.samples} requests, no protocol): "
          + (f"{ceiling:.0f} req/s" if ceiling else "n/a"))
    print(f"{'protocol':<12} {'conc':>4} | {'echo req/s':>10} {'p50 ms':>7} {'p99 ms':>7} | "
          f"{'hpcsplit req/s':>14} {'p50 ms':>7} {'p99 ms':>7} | {'rate/echo':>9} {'+p50 ms':>8}")
    verdict = []
    for label, c, e, h in table:
        def f(x: Any) -> str:
            return f"{x[0]:>10.0f} {x[1]:>7.2f} {x[2]:>7.2f}" if x else f"{'n/a':>10} {'':>7} {'':>7}"

        ratio = f"{h[0] / e[0]:>9.2f}" if e and h else f"{'n/a':>9}"
        dp50 = f"{h[1] - e[1]:>8.2f}" if e and h else f"{'n/a':>8}"
        print(f"{label:<12} {c:>4} | {f(e)} | {f(h).replace(f'{h[0]:>10.0f}', f'{h[0]:>14.0f}') if h else f(h)} | "
              f"{ratio} {dp50}")
        if e and h:
            verdict.append((label, c, h[0] / e[0], h[1] - e[1]))
    ok_rate = all(r >= 0.7 for _, _, r, _ in verdict)
    low = [d for _, c, _, d in verdict if c == min(levels)]
    print(f"verdict: rate >= 70% of echo on every row: {'yes' if ok_rate else 'no'}; added p50 at concurrency "
          f"{min(levels)}: {', '.join(f'{d:.2f}' for d in low)} ms (target < 1 ms)")
    return 0
