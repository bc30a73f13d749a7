"""The public API: every name in ``hpcsplit.__all__`` resolves, and ``import hpcsplit`` stays cheap."""

from __future__ import annotations

import subprocess
import sys

import hpcsplit


def test_every_public_name_resolves() -> None:
    for name in hpcsplit.__all__:
        assert getattr(hpcsplit, name) is not None, name
    assert callable(hpcsplit.allocate) and not isinstance(hpcsplit.allocate, type(hpcsplit))
    assert callable(hpcsplit.capture) and callable(hpcsplit.partition) and callable(hpcsplit.export)
    assert issubclass(hpcsplit.ConfigError, hpcsplit.HpcsplitError)
    assert hpcsplit.__version__ and hpcsplit.__version__[0].isdigit()


def test_unknown_names_raise_attribute_error() -> None:
    try:
        hpcsplit.no_such_name  # noqa: B018
    except AttributeError as e:
        assert "no_such_name" in str(e)
    else:  # pragma: no cover
        raise AssertionError("hpcsplit.no_such_name resolved")


def test_import_is_cheap() -> None:
    code = ("import sys, hpcsplit; heavy = [m for m in ('torch', 'cvxpy', 'h5py', 'mpi4py', 'hydra', 'submitit') "
            "if m in sys.modules]; print(heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "[]", out.stdout
