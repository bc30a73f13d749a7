"""The probe's pure parts: which GPU a rank owns, and the table of rows (no MPI, no torch).

The login side prints a SLURM probe's table from rank 0's rows with :func:`format_table`; importing
:mod:`hpcsplit.launch.probe` there would import mpi4py (and start MPI).
"""

from __future__ import annotations

from typing import Any

__all__ = ["format_table", "owned_gpu"]

_COLUMNS = (
    ("host", "host"),
    ("address", "address"),
    ("rank", "rank"),
    ("world_size", "world"),
    ("local_rank", "local"),
    ("gpu", "gpu"),
    ("cuda_visible_devices", "CUDA_VISIBLE_DEVICES"),
    ("gpu_name", "GPU name"),
    ("gpu_mem_gb", "mem GB"),
    ("mig_mode", "MIG"),
    ("cpus_per_task", "cpus/task"),
    ("cpus_usable", "cpus usable"),
    ("omp_num_threads", "OMP_NUM_THREADS"),
    ("omp_wait_policy", "OMP_WAIT_POLICY"),
    ("torch_threads", "torch threads"),
    ("mpi_library", "MPI library"),
)


def owned_gpu(local_rank: int, visible: str | None, cuda_count: int = 0) -> str | None:
    """The GPU a rank would own (``[Note: GPU a rank owns]`` in :mod:`hpcsplit.launch.probe`).

    Parameters
    ----------
    local_rank : int
        Rank within the node.
    visible : str or None
        ``CUDA_VISIBLE_DEVICES`` (comma-separated indices or UUIDs), None when unset.
    cuda_count : int
        Devices CUDA reports when visibility is unrestricted.

    Returns
    -------
    str or None
        The device index or UUID as the driver names it, None when the rank has no GPU.

    Examples
    --------
    >>> owned_gpu(2, "0,1,2,3"), owned_gpu(1, "3"), owned_gpu(3, None, 2), owned_gpu(0, None)
    ('2', '3', '1', None)
    >>> owned_gpu(0, "") is None
    True
    """
    if visible is not None:
        devices = [d.strip() for d in visible.split(",") if d.strip()]
        if not devices or devices[0] in ("-1", "NoDevFiles"):
            return None
        return devices[local_rank % len(devices)]
    if cuda_count > 0:
        return str(local_rank % cuda_count)
    return None


def format_table(rows: list[dict[str, Any]]) -> str:
    """The probe rows as an aligned text table (one line per rank).

    Examples
    --------
    >>> print(format_table([{"host": "n1", "rank": 0, "world_size": 1, "gpu": None}]).splitlines()[0][:17])
    host  rank  world
    """
    cols = [(key, title) for key, title in _COLUMNS if any(key in r for r in rows)]
    cells = [[title for _, title in cols]]
    for r in sorted(rows, key=lambda r: r.get("rank", 0)):
        cells.append(["-" if r.get(key) is None else str(r.get(key)) for key, _ in cols])
    widths = [max(len(row[i]) for row in cells) for i in range(len(cols))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells]
    notes = sorted({str(r["nvml_error"]) for r in rows if r.get("nvml_error")})
    if notes:
        lines.append("NVML: " + "; ".join(notes) + " (no GPU names or memory)")
    hosts = sorted({str(r.get("host")) for r in rows})
    lines.append(f"{len(rows)} rank(s) on {len(hosts)} host(s): {', '.join(hosts)}")
    return "\n".join(lines)
