"""Run one benchmark: ``python -m hpcsplit.bench <name> [args...]``."""

from __future__ import annotations

import importlib
import pkgutil
import sys

import hpcsplit.bench as _pkg


def _available() -> list[str]:
    return sorted(m.name for m in pkgutil.iter_modules(_pkg.__path__) if not m.name.startswith("_"))


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    names = _available()
    if not argv or argv[0] in {"-h", "--help"}:
        print("usage: python -m hpcsplit.bench <name> [args...]\nbenchmarks: " + ", ".join(names))
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in names:
        print(f"unknown benchmark {name!r}; choose one of: {', '.join(names)}", file=sys.stderr)
        return 2
    mod = importlib.import_module(f"hpcsplit.bench.{name}")
    return int(mod.main(rest) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
