"""Exceptions raised by hpcsplit.

Every stage has one subclass of :class:`HpcsplitError`.  Messages follow one
pattern: what was found, what was needed, and what to do about it.
"""

from __future__ import annotations

__all__ = [
    "AllocationError",
    "AllocationInfeasibleError",
    "CalibrationError",
    "CaptureError",
    "ConfigError",
    "HpcsplitError",
    "JobTimedOut",
    "LaunchError",
    "PartitionError",
    "PlanError",
    "ProfileError",
    "ProfileFormatError",
    "RankLeftJob",
    "RequestTimeoutError",
    "RuntimeStageError",
    "SwitchboardError",
    "VerificationError",
    "WorldSizeError",
]


class HpcsplitError(Exception):
    """Base class of every error hpcsplit raises on purpose."""


class ConfigError(HpcsplitError, ValueError):
    """Invalid configuration values (all problems are listed in one message)."""


class CaptureError(HpcsplitError):
    """torch.export could not trace the model."""


class PartitionError(HpcsplitError):
    """The captured graph could not be split as asked."""


class SwitchboardError(HpcsplitError):
    """A switchboard directory is missing, malformed, tampered with or mismatched."""


class VerificationError(SwitchboardError):
    """The split components do not reproduce the whole model within tolerance."""


class ProfileError(HpcsplitError):
    """Profiling failed."""


class ProfileFormatError(ProfileError):
    """An HDF5 profile file is malformed, truncated or of an unknown schema version."""


class AllocationError(HpcsplitError):
    """The allocator was given inputs it cannot use."""


class AllocationInfeasibleError(AllocationError):
    """No placement satisfies the budget; the message names the budget and the way out."""


class CalibrationError(HpcsplitError):
    """A calibration file is malformed, of another kind or schema, or the calibration job failed."""


class PlanError(HpcsplitError):
    """A plan file is malformed or does not match the switchboard / world size."""


class RuntimeStageError(HpcsplitError):
    """Serving failed (a rank raised, a component failed)."""


class RequestTimeoutError(RuntimeStageError):
    """A request exceeded ``runtime.request_timeout_s``."""


class RankLeftJob(RuntimeStageError):
    """This rank leaves a job that goes on without it (server mode: the frontend declared it lost, or the
    frontend fell silent): the rank exits without aborting the others (``hpcsplit.launch.rank``)."""


class LaunchError(HpcsplitError):
    """A job could not be launched, or failed on the cluster."""


class JobTimedOut(LaunchError):
    """A job ran past the launcher's time limit and was stopped (a server is not started again then)."""


class WorldSizeError(LaunchError):
    """The MPI world size does not match what SLURM or the plan expects."""
