"""Synthetic profiles and clusters: the allocate benchmark's inputs and the tests'.

Profiles are built in memory (no HDF5 file, no measurement) from per-component arrays
(:func:`make_profile`), or drawn with realistic shapes (:func:`synthetic_profile`: latency grows
sub-linearly with batch, utilization 0.1-0.6 rising with batch, memory = parameters + activations x
batch, out of memory where it does not fit).  ``python -m hpcsplit.bench allocate`` and
``tests/unit/test_allocate.py`` use them.

Examples
--------
>>> p = synthetic_profile(3, seed=0)
>>> sorted(p.components), p.components["c00"].slices
(['c00', 'c01', 'c02'], (5.0, 10.0, 20.0, 40.0, 80.0))
>>> synthetic_cluster(16).nodes
4
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from hpcsplit.core.cluster import GIB, ClusterSpec
from hpcsplit.core.profile_format import ComponentProfile, Profile, ProfileMeta

__all__ = ["make_profile", "synthetic_cluster", "synthetic_profile"]


def make_profile(
    components: dict[str, dict[str, Any]],
    *,
    batch_sizes: tuple[int, ...],
    slices: tuple[float, ...],
    device_kind: str = "cuda",
    model: str = "synthetic",
    cores_per_node: int = 64,
) -> Profile:
    """A :class:`~hpcsplit.core.profile_format.Profile` in memory from per-component 2-D arrays.

    Each component dict has ``latency_ms`` ([n_batch, n_slice], NaN = out of memory),
    ``peak_mem_bytes`` and ``utilization`` (same shape), optional ``param_bytes``.
    """
    comps = {}
    for name, d in components.items():
        lat = np.asarray(d["latency_ms"], float)
        oom = np.isnan(lat)
        comps[name] = ComponentProfile(
            name=name,
            batch_sizes=tuple(batch_sizes),
            slices=tuple(float(s) for s in slices),
            latency_ms=np.repeat(lat[:, :, None], 3, axis=2),
            peak_mem_bytes=np.where(oom, np.nan, np.asarray(d["peak_mem_bytes"], float)),
            utilization=np.where(oom, np.nan, np.asarray(d["utilization"], float)),
            oom=oom,
            measured=np.ones_like(oom, bool),
            param_bytes=int(d.get("param_bytes", 0)),
            input_bytes_per_sample=4,
            output_bytes_per_sample=4,
        )
    gpu = device_kind == "cuda"
    meta = ProfileMeta(
        schema_version=1,
        hpcsplit_version="0",
        switchboard_sha256="0" * 64,
        model=model,
        host="synthetic",
        device_kind=device_kind,
        device_name="synthetic",
        device_mem_bytes=int(80 * GIB) if gpu else 0,
        driver_version="",
        torch_version="",
        cuda_version="",
        created_utc="",
        slice_unit="gb" if gpu else "threads",
        slice_semantics="synthetic",
        latency_timer="synthetic",
        peak_mem_method="synthetic",
        utilization_method="synthetic",
        cores_per_node=cores_per_node,
        warmup=0,
        iters=3,
        mig_device="",
        mps_active_thread_percentage="",
        mps_pinned_device_mem_limit="",
        component_order=tuple(components),
        complete=True,
    )
    return Profile(meta=meta, components=comps)


def synthetic_profile(
    n_components: int,
    *,
    slices: tuple[float, ...] = (5, 10, 20, 40, 80),
    batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32),
    seed: int = 0,
) -> Profile:
    """Realistic-looking GPU profile of ``n_components`` components (deterministic per seed)."""
    rng = np.random.default_rng(seed)
    comps = {}
    b = np.array(batch_sizes, float)[:, None]
    s = np.array(slices, float)[None, :]
    for c in range(n_components):
        l0 = rng.uniform(1.0, 12.0)  # ms at batch 1
        alpha = rng.uniform(0.45, 0.85)  # latency ~ b^alpha
        u0 = rng.uniform(0.1, 0.45)
        params = rng.uniform(0.3, 6.0) * GIB
        act = rng.uniform(0.02, 0.4) * GIB
        lat = l0 * b**alpha * (1 + 0.3 / s) * np.ones_like(s)
        util = np.minimum(0.6, u0 * (1 + 0.12 * np.log2(b))) * np.ones_like(s)
        mem = (params + act * b) * np.ones_like(s)
        lat = np.where(mem > s * GIB, np.nan, lat)
        comps[f"c{c:02d}"] = {
            "latency_ms": lat,
            "peak_mem_bytes": mem,
            "utilization": util,
            "param_bytes": params,
        }
    return make_profile(comps, batch_sizes=batch_sizes, slices=slices, model=f"synthetic{n_components}")


def synthetic_cluster(
    n_gpus: int,
    *,
    gpus_per_node: int = 4,
    gpu_mem_gb: float = 80,
    slices: tuple[float, ...] = (5, 10, 20, 40, 80),
    cores_per_node: int = 64,
) -> ClusterSpec:
    """A GPU cluster of ``n_gpus`` GPUs (``gpus_per_node`` a node, 512 GB of host memory each)."""
    return ClusterSpec.from_config(
        {
            "name": f"synthetic{n_gpus}",
            "nodes": max(1, math.ceil(n_gpus / gpus_per_node)),
            "gpus_per_node": min(gpus_per_node, n_gpus),
            "gpu_mem_gb": gpu_mem_gb,
            "slices_gb": list(slices),
            "cores_per_node": cores_per_node,
            "mem_gb_per_node": 512,
            "cpu_threads": [1, 2, 4],
        }
    )
