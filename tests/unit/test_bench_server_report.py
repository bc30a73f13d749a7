"""``python -m hpcsplit.bench server``'s report: the targets of issue 31 judged from the measured rows, and the
better hop's own figures beside them (what any split server reaches at best on the machine at hand)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hpcsplit.bench.server import Result, Target, _code_env
from hpcsplit.bench.server_report import report


def _t(name: str, kind: str) -> Target:
    return Target(name, kind, "m", {}, None, 1)


def test_the_report_sets_the_better_hops_cpu_and_rate_beside_the_targets(tmp_path: Path,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    names = ["echo", "hop-wait", "hop-spin", "hpcsplit", "base"]
    targets = [_t("echo", "echo"), _t("hop-wait", "hop"), _t("hop-spin", "hop"), _t("hpcsplit", "hpcsplit"),
               _t("base", "base")]
    # gRPC at 8 clients as measured on the 2-core VM (req/s, p50, p99, CPU us per request)
    row = {"echo": Result(4352, 1.74, 3.0, 260.0, None), "hop-wait": Result(3758, 2.06, 4.0, 330.0, None),
           "hop-spin": Result(2578, 3.0, 5.0, 500.0, None), "hpcsplit": Result(1774, 4.64, 9.0, 539.0, None),
           "base": Result(1815, 4.62, 9.0, 504.0, None)}
    args = argparse.Namespace(interval_ms=2000, rounds=3, server_cpus=None, client_cpus=None, samples=2000,
                              base=Path("/tmp/base"), out=tmp_path)
    report(args, [("grpc", 8, row)], names, [8], 41311.0, targets)
    out = capsys.readouterr().out
    # the CPU table: echo 260, the better hop (hop-wait, by rate) 330 = 1.27x, hpcsplit 539 = 2.07x, base 504
    line = next(ln for ln in out.splitlines() if ln.startswith("grpc") and "260" in ln and "330" in ln)
    assert line.split() == ["grpc", "8", "|", "260", "330", "1.27", "539", "2.07", "504", "1.94", "|", "0.98"]
    assert "CPU per request <= 1.5x the echo's (HTTP binary, gRPC): no (grpc 8: 2.07)" in out
    assert "unary gRPC at 8 clients >= 2.0x the base code's rate: no (hpcsplit 0.98x)" in out
    # the hop reaches 1.27x the echo's CPU (the target is within reach here) and 2.07x the base's rate
    assert ("the better hop on this machine: CPU per request grpc 8: 1.27 x the echo's; unary gRPC at 8 clients "
            "2.07x the base code's rate") in out
    assert (tmp_path / "server_bench.csv").read_text().count("grpc,8,") == len(names)


def test_a_base_checkout_is_the_code_its_server_imports_even_run_from_this_repository(tmp_path: Path) -> None:
    """``--base``: started from this repository's root (where ``python -m`` finds this hpcsplit first), the
    base server's ranks import the checkout's hpcsplit."""
    fake = tmp_path / "checkout"
    (fake / "hpcsplit").mkdir(parents=True)
    (fake / "hpcsplit" / "__init__.py").write_text("")
    repo = Path(__file__).resolve().parents[2]
    env, cwd = _code_env(fake)
    out = subprocess.run([sys.executable, "-m", "mpi4py", "-c", "import hpcsplit; print(hpcsplit.__file__)"],
                         env=env, cwd=cwd or repo, capture_output=True, text=True, timeout=60, check=True)
    assert Path(out.stdout.strip()).resolve() == (fake / "hpcsplit" / "__init__.py").resolve()
    env, cwd = _code_env(None)  # this checkout's own server runs from wherever the bench does
    assert cwd is None and env.get("PYTHONPATH") == os.environ.get("PYTHONPATH")
