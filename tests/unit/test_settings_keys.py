"""Every YAML key of a config group is a field of its settings dataclass, and the other way round.

``[Note: settings]`` in :mod:`hpcsplit.core.settings`: defaults live in ``conf/`` only, and each stage's
``stage.py`` names the dataclass of each group it reads in ``SETTINGS`` (group -> class, or
group -> {option -> class} where a group's options have different keys: models, launchers).
"""

from __future__ import annotations

import dataclasses
import importlib
from pathlib import Path

import pytest
import yaml

from hpcsplit.core.settings import conf_dir

STAGE_MODULES = (
    "hpcsplit.switchboard.stage",
    "hpcsplit.profiling.stage",
    "hpcsplit.allocation.stage",
    "hpcsplit.runtime.stage",
    "hpcsplit.launch.stages",
    "hpcsplit.launch.calibrate",
    "hpcsplit.launch.simulate",
)
NOT_SETTINGS = {"experiment", "hydra"}  # overrides of other groups, and Hydra's own config


def _all_settings() -> dict[str, object]:
    out: dict[str, object] = {}
    for name in STAGE_MODULES:
        mod = importlib.import_module(name)
        for group, cls in mod.SETTINGS.items():
            assert group not in out, f"group {group!r} claimed by two stages"
            out[group] = cls
    return out


def config_keys(cls: type) -> set[str]:
    keys = getattr(cls, "CONFIG_KEYS", None)
    if keys is not None:
        return set(keys)
    return {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]


def _options() -> list[tuple[str, Path]]:
    conf = conf_dir()
    return [(d.name, f) for d in sorted(conf.iterdir()) if d.is_dir() and d.name not in NOT_SETTINGS
            for f in sorted(d.glob("*.yaml"))]


def test_every_group_has_settings() -> None:
    groups = {g for g, _ in _options()}
    assert groups <= set(_all_settings()), f"groups without a settings dataclass: {groups - set(_all_settings())}"


@pytest.mark.parametrize(("group", "path"), _options(), ids=lambda v: getattr(v, "stem", v))
def test_yaml_keys_match_the_dataclass(group: str, path: Path) -> None:
    cls = _all_settings()[group]
    if isinstance(cls, dict):
        assert path.stem in cls, f"{path}: no settings class for option {path.stem!r} of group {group!r}"
        cls = cls[path.stem]
    data = yaml.safe_load(path.read_text()) or {}
    data.pop("defaults", None)
    keys, fields = set(data), config_keys(cls)  # type: ignore[arg-type]
    assert keys == fields, (
        f"{path.relative_to(conf_dir().parent)}: keys only in the YAML {sorted(keys - fields)}, "
        f"only in {cls.__name__} {sorted(fields - keys)}"  # type: ignore[union-attr]
    )


def test_settings_are_frozen() -> None:
    for group, cls in _all_settings().items():
        for c in cls.values() if isinstance(cls, dict) else [cls]:
            assert dataclasses.is_dataclass(c), f"{group}: {c} is not a dataclass"
            assert c.__dataclass_params__.frozen, f"{group}: {c.__name__} is not frozen"  # type: ignore[union-attr]
