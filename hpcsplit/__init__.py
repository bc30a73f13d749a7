"""hpcsplit: split PyTorch models, profile the parts, allocate GPU slices, serve on MPI ranks.

The public API is small; every name but the errors is imported on first use, so that
``import hpcsplit`` stays cheap on login nodes (no torch, cvxpy, h5py or mpi4py).

>>> import hpcsplit
>>> sorted(n for n in hpcsplit.__all__ if n[0].islower())  # the functions
['allocate', 'capture', 'export', 'partition', 'profile_components', 'read_profile']
"""

from __future__ import annotations

from importlib import import_module
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

from hpcsplit.errors import (
    AllocationError,
    AllocationInfeasibleError,
    CaptureError,
    ConfigError,
    HpcsplitError,
    LaunchError,
    PartitionError,
    PlanError,
    ProfileError,
    ProfileFormatError,
    RequestTimeoutError,
    RuntimeStageError,
    SwitchboardError,
    VerificationError,
    WorldSizeError,
)

try:
    __version__ = version("hpcsplit")
except PackageNotFoundError:  # pragma: no cover - a source tree that was never installed
    __version__ = "0+unknown"

# name -> the module that defines it (imported on first use)
_LAZY = {
    "capture": "hpcsplit.switchboard.graph",
    "partition": "hpcsplit.switchboard.regions",
    "export": "hpcsplit.switchboard.writer",
    "Switchboard": "hpcsplit.switchboard.reader",
    "profile_components": "hpcsplit.profiling.runner",
    "read_profile": "hpcsplit.core.profile_format",
    "Profile": "hpcsplit.core.profile_format",
    "ClusterSpec": "hpcsplit.core.cluster",
    "allocate": "hpcsplit.allocation.solve",
    "Allocation": "hpcsplit.allocation.results",
    "Plan": "hpcsplit.core.plan",
}

__all__ = [
    "Allocation",
    "AllocationError",
    "AllocationInfeasibleError",
    "CaptureError",
    "ClusterSpec",
    "ConfigError",
    "HpcsplitError",
    "LaunchError",
    "PartitionError",
    "Plan",
    "PlanError",
    "Profile",
    "ProfileError",
    "ProfileFormatError",
    "RequestTimeoutError",
    "RuntimeStageError",
    "Switchboard",
    "SwitchboardError",
    "VerificationError",
    "WorldSizeError",
    "__version__",
    "allocate",
    "capture",
    "export",
    "partition",
    "profile_components",
    "read_profile",
]

if TYPE_CHECKING:  # pragma: no cover
    from hpcsplit.allocation.results import Allocation
    from hpcsplit.allocation.solve import allocate
    from hpcsplit.core.cluster import ClusterSpec
    from hpcsplit.core.plan import Plan
    from hpcsplit.core.profile_format import Profile, read_profile
    from hpcsplit.profiling.runner import profile_components
    from hpcsplit.switchboard.graph import capture
    from hpcsplit.switchboard.reader import Switchboard
    from hpcsplit.switchboard.regions import partition
    from hpcsplit.switchboard.writer import export


def __getattr__(name: str) -> Any:
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'hpcsplit' has no attribute {name!r}")
    value = getattr(import_module(mod), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
