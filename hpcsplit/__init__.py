"""hpcsplit: split PyTorch models, profile the parts, allocate GPU slices, serve on MPI ranks.

The public API is small; heavy modules are imported lazily so that
``import hpcsplit`` stays cheap on login nodes.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

from hpcsplit.errors import HpcsplitError as HpcsplitError

__version__ = "0.1.0"

# name -> module that defines it.  (`capture` and `partition` are modules of the same name:
# use hpcsplit.capture.capture / hpcsplit.partition.partition.)
_LAZY = {
    "export": "hpcsplit.switchboard",
    "Switchboard": "hpcsplit.switchboard",
    "profile_components": "hpcsplit.profiling",
    "read_profile": "hpcsplit.profile_io",
    "Profile": "hpcsplit.profile_io",
    "allocate": "hpcsplit.allocate",
    "Allocation": "hpcsplit.allocate",
    "Plan": "hpcsplit.runtime.plan",
}

__all__ = [
    "Allocation",
    "HpcsplitError",
    "Plan",
    "Profile",
    "Switchboard",
    "__version__",
    "allocate",
    "export",
    "profile_components",
    "read_profile",
]

if TYPE_CHECKING:  # pragma: no cover
    from hpcsplit.allocate import Allocation, allocate
    from hpcsplit.profile_io import Profile, read_profile
    from hpcsplit.profiling import profile_components
    from hpcsplit.runtime.plan import Plan
    from hpcsplit.switchboard import Switchboard, export


def __getattr__(name: str) -> Any:
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'hpcsplit' has no attribute {name!r}")
    return getattr(import_module(mod), name)
