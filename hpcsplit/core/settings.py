"""Where the defaults are, and the checks every stage's settings dataclass is built with.

[Note: settings]
Defaults live in ``conf/`` only: ``conf/<group>/default.yaml`` is the one place a setting's default is
written.  Each stage's ``stage.py`` turns the resolved config dict into a frozen settings dataclass with
``from_config``, built through a :class:`Checker`: unknown keys (with the closest valid one suggested),
wrong types and values out of range are collected, and one :class:`~hpcsplit.errors.ConfigError` lists
them all.  Python callers without Hydra (``hpcsplit.allocate(...)``) get the same defaults through
:func:`group_defaults`.  ``tests/unit/test_settings_keys.py`` checks that every YAML key of a group is a
field of its dataclass and the other way round.
"""

from __future__ import annotations

import copy
import difflib
import math
from collections.abc import Iterable, Mapping, Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

from hpcsplit.errors import ConfigError

__all__ = ["Checker", "conf_dir", "group_defaults"]

_MISSING = object()


def conf_dir() -> Path:
    """The ``conf/`` folder: at the repository root (editable install) or inside the package (a wheel
    carries it as ``hpcsplit/conf``).

    Raises
    ------
    ConfigError
        When neither exists (a broken or partial install).
    """
    here = Path(__file__).resolve().parents[1]  # the hpcsplit package
    for cand in (here.parent / "conf", here / "conf"):
        if (cand / "config.yaml").is_file():
            return cand
    raise ConfigError(
        f"found no conf/config.yaml next to the hpcsplit package ({here.parent / 'conf'}); "
        "the install is incomplete: reinstall hpcsplit (`pip install .` or `pip install -e .` from the source "
        "checkout, see scripts/setup.sh); its wheel carries conf/ as hpcsplit/conf."
    )


@lru_cache(maxsize=32)
def _read_group(group: str, option: str) -> dict[str, Any]:
    import yaml

    path = conf_dir() / group / f"{option}.yaml"
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as e:
        raise ConfigError(f"cannot read the defaults of config group {group!r} ({path}): {e}") from e
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a mapping of settings, found {type(data).__name__}")
    data.pop("defaults", None)
    return data


def group_defaults(group: str, option: str = "default") -> dict[str, Any]:
    """The settings of ``conf/<group>/<option>.yaml`` as a fresh dict (interpolations left as written).

    Examples
    --------
    >>> group_defaults("allocate")["solver"]
    'HIGHS'
    """
    return copy.deepcopy(_read_group(group, option))


def closest(name: str, valid: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` for the closest valid name, or ``""``.

    >>> closest("max_infligth", ["max_inflight", "max_wait_ms"])
    " (did you mean 'max_inflight'?)"
    """
    hit = difflib.get_close_matches(name, list(valid), n=1, cutoff=0.6)
    return f" (did you mean {hit[0]!r}?)" if hit else ""


class Checker:
    """Reads one config group, collecting every problem; :meth:`done` raises them together.

    Parameters
    ----------
    group : str
        The group's name in messages (``runtime``, ``allocate``, ...).
    values : mapping
        The group's node of the resolved config.
    fields : iterable of str
        The valid keys; any other key is a problem (with the closest valid key suggested).

    Examples
    --------
    >>> c = Checker("demo", {"n": 3, "rate": "fast"}, ["n", "rate"])
    >>> c.integer("n", lo=1), c.number("rate", lo=0)
    (3, 0.0)
    >>> c.done()
    Traceback (most recent call last):
    ...
    hpcsplit.errors.ConfigError: invalid demo settings:
      - demo.rate = 'fast': needs a number >= 0
    """

    def __init__(self, group: str, values: Mapping[str, Any] | None, fields: Iterable[str]) -> None:
        self.group = group
        self.problems: list[str] = []
        fields = tuple(fields)
        if values is None:
            values = {}
        if not isinstance(values, Mapping):
            self.problems.append(f"{group} must be a mapping of settings, found {type(values).__name__}")
            values = {}
        self.values = values
        for key in sorted(set(values) - set(fields), key=str):
            self.problems.append(
                f"{group}.{key} is not a setting{closest(str(key), fields)}; valid: {', '.join(sorted(fields))}"
            )

    # ------------------------------------------------------------------------------------------ reading
    def get(self, key: str, default: Any = None) -> Any:
        return self.values.get(key, default)

    def problem(self, msg: str) -> None:
        self.problems.append(msg)

    def _bad(self, key: str, v: Any, need: str) -> None:
        self.problems.append(f"{self.group}.{key} = {v!r}: needs {need}")

    def number(self, key: str, *, lo: float | None = None, hi: float | None = None, lo_open: bool = False,
               none: bool = False, default: Any = _MISSING) -> Any:
        """A finite real number in ``[lo, hi]`` (``(lo, hi]`` with ``lo_open``); None allowed with ``none``."""
        v = self.values.get(key, None if default is _MISSING else default)
        if v is None and none:
            return None
        need = _range_text("a number", lo, hi, lo_open) + (" or null" if none else "")
        if isinstance(v, bool) or not isinstance(v, int | float) or not _finite(v):
            self._bad(key, v, need)
            return float(lo if lo is not None else 0.0)
        if (lo is not None and (v < lo or (lo_open and v == lo))) or (hi is not None and v > hi):
            self._bad(key, v, need)
        return float(v)

    def integer(self, key: str, *, lo: int | None = None, hi: int | None = None, none: bool = False,
                default: Any = _MISSING) -> Any:
        """A whole number in ``[lo, hi]`` (a float such as ``2.0`` counts; ``True`` does not)."""
        v = self.values.get(key, None if default is _MISSING else default)
        if v is None and none:
            return None
        need = _range_text("an integer", lo, hi, False) + (" or null" if none else "")
        if isinstance(v, bool) or not isinstance(v, int | float) or not _finite(v) or int(v) != v:
            self._bad(key, v, need)
            return int(lo if lo is not None else 0)
        if (lo is not None and v < lo) or (hi is not None and v > hi):
            self._bad(key, v, need)
        return int(v)

    def boolean(self, key: str, *, default: Any = _MISSING) -> bool:
        v = self.values.get(key, None if default is _MISSING else default)
        if type(v) is not bool:
            self._bad(key, v, "true or false")
            return False
        return v

    def choice(self, key: str, options: Sequence[Any], *, default: Any = _MISSING) -> Any:
        v = self.values.get(key, None if default is _MISSING else default)
        if v not in options or isinstance(v, bool) != any(isinstance(o, bool) and o == v for o in options):
            self._bad(key, v, "one of " + ", ".join("null" if o is None else str(o) for o in options))
            return options[0]
        return v

    def string(self, key: str, *, none: bool = False, default: Any = _MISSING) -> Any:
        v = self.values.get(key, None if default is _MISSING else default)
        if v is None and none:
            return None
        if not isinstance(v, str) or not v:
            self._bad(key, v, "a non-empty string" + (" or null" if none else ""))
            return ""
        return v

    def mapping(self, key: str, *, default: Any = _MISSING) -> dict[str, Any]:
        v = self.values.get(key, None if default is _MISSING else default)
        if v is None:
            return {}
        if not isinstance(v, Mapping):
            self._bad(key, v, "a mapping")
            return {}
        return dict(v)

    def done(self) -> None:
        """Raise one :class:`ConfigError` listing every problem found, if any."""
        if self.problems:
            raise ConfigError(f"invalid {self.group} settings:\n  - " + "\n  - ".join(self.problems))


def _finite(v: float) -> bool:
    """A finite number that a float can hold (``math.isfinite`` raises OverflowError on a larger integer)."""
    return abs(v) <= 1.7e308 if isinstance(v, int) else math.isfinite(v)


def _range_text(what: str, lo: float | None, hi: float | None, lo_open: bool) -> str:
    if lo is not None and hi is not None:
        return f"{what} in {'(' if lo_open else '['}{lo:g}, {hi:g}]"
    if lo is not None:
        return f"{what} {'>' if lo_open else '>='} {lo:g}"
    if hi is not None:
        return f"{what} <= {hi:g}"
    return what
