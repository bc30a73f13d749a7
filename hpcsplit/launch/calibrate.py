"""``stage=calibrate``: measure what the runtime costs on the target, write ``calibration.json``.

    python -m hpcsplit stage=calibrate                                  # 3 local ranks
    python -m hpcsplit stage=calibrate launcher=slurm cluster=dev2      # ranks on both nodes

One short MPI job (``[Note: calibration contract]`` in :mod:`hpcsplit.core.calibration`; the measurements
are :mod:`hpcsplit.launch.calibrate_run`'s).  Rank 0 plays the frontend with the runtime's own
:class:`~hpcsplit.runtime.frontend.Frontend`; other ranks run the runtime's component loop
(:func:`~hpcsplit.runtime.component.serve_component`) on a trivial program, so every figure is the runtime's
own transport, batching, idle policy and doorbell.  This module reads the config and sets each rank's threads
before torch is imported (``[Note: torch after the thread settings]`` in :mod:`hpcsplit.runtime.stage`); only
then does it import the measuring module, by name.
"""

from __future__ import annotations

import importlib
import itertools
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from hpcsplit.core.paths import RunPaths
from hpcsplit.core.settings import Checker, group_defaults
from hpcsplit.runtime.settings import RuntimeSettings
from hpcsplit.runtime.threads import configure_rank

__all__ = ["SETTINGS", "CalibrateSettings", "mpi_main"]

MEASURE_MODULE = "hpcsplit.launch.calibrate_run"  # imports torch: only after the thread settings


@dataclass(frozen=True, slots=True)
class CalibrateSettings:
    """``conf/calibrate/default.yaml`` (meanings there)."""

    ranks: int | None
    gaps_ms: tuple[float, ...]
    chain_gaps_ms: tuple[float, ...]
    samples: int
    max_gap_time_s: float
    settle_s: float
    sizes_bytes: tuple[int, ...]
    saturation_requests: int
    threads: tuple[int, ...] | None
    programs: bool
    program_gaps_ms: tuple[float, ...]
    program_runs: int

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any]) -> CalibrateSettings:
        """Read ``cfg["calibrate"]`` over the defaults; one ConfigError lists every problem.

        Examples
        --------
        >>> CalibrateSettings.from_config({"calibrate": {"samples": 5}}).samples
        5
        >>> CalibrateSettings.from_config({"calibrate": {"gaps_ms": [3, 1]}})
        Traceback (most recent call last):
        ...
        hpcsplit.errors.ConfigError: invalid calibrate settings:
          - calibrate.gaps_ms = [3, 1]: needs a non-empty list of increasing numbers in (0, 3.6e+06]
        """
        node = cfg.get("calibrate")
        values = {**group_defaults("calibrate"), **(node if isinstance(node, Mapping) else {})}
        c = Checker("calibrate", values, [f.name for f in fields(cls)])
        threads = c.get("threads")
        out = cls(
            ranks=c.integer("ranks", lo=2, none=True),
            gaps_ms=_increasing(c, "gaps_ms"),
            chain_gaps_ms=_increasing(c, "chain_gaps_ms"),
            samples=c.integer("samples", lo=3, hi=100_000),
            max_gap_time_s=c.number("max_gap_time_s", lo=0, hi=3600, lo_open=True),
            settle_s=c.number("settle_s", lo=0, hi=60),
            sizes_bytes=tuple(int(x) for x in _increasing(c, "sizes_bytes", whole=True, hi=1 << 30)),
            saturation_requests=c.integer("saturation_requests", lo=10, hi=10**7),
            threads=None if threads is None else tuple(int(x) for x in _increasing(c, "threads", whole=True, hi=1024)),
            programs=c.boolean("programs"),
            program_gaps_ms=_increasing(c, "program_gaps_ms"),
            program_runs=c.integer("program_runs", lo=1, hi=10_000),
        )
        c.done()
        return out


SETTINGS: dict[str, type | dict[str, type]] = {"calibrate": CalibrateSettings}


def _increasing(c: Checker, key: str, whole: bool = False, hi: float = 3.6e6) -> tuple[float, ...]:
    """A non-empty increasing list of numbers in (0, ``hi``] (integers when ``whole``); ms unless said."""
    v = c.get(key)
    ok = (isinstance(v, list | tuple) and v and all(isinstance(x, int | float) and not isinstance(x, bool) and 0 < x <= hi
                                                    and (not whole or x == int(x)) for x in v)
          and all(b > a for a, b in itertools.pairwise(v)))
    if not ok:
        text = repr(v)
        c.problem(f"calibrate.{key} = {text if len(text) < 80 else text[:77] + '...'}: needs a non-empty list of "
                  f"increasing {'integers' if whole else 'numbers'} in (0, {int(hi) if whole else hi:g}]")
        return (1.0,)
    return tuple(float(x) for x in v)


def mpi_main(cfg: dict[str, Any], run_dir: str, comm: Any | None = None) -> dict[str, Any] | None:
    """Every rank of the calibration job; rank 0 writes ``RunPaths.own_calibration`` and returns its summary."""
    from hpcsplit.core import (
        mpi as _mpi,  # starts MPI: only on the ranks (this module serves the login side too)
    )

    settings = CalibrateSettings.from_config(cfg)
    rt = RuntimeSettings.from_config(cfg)
    paths = RunPaths.from_config(cfg, Path(run_dir))
    comm = _mpi.get_comm(comm)
    node_comm = comm.Split_type(_mpi.MPI.COMM_TYPE_SHARED)
    local_ranks = node_comm.Get_size()
    node_comm.Free()
    configure_rank(1, rt.omp_wait_policy, 1, local_ranks)  # one thread per rank, as the plans on CPU
    measure = importlib.import_module(MEASURE_MODULE)  # only now: torch after the thread settings
    out: dict[str, Any] | None = measure.calibrate(comm, cfg, settings, rt, paths)
    return out
