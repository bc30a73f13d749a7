"""The switchboard's ``layout.json``: typed records, JSON (de)serialisation, validation, hashing.

See [Note: switchboard layout] in docs/architecture.md and docs/export.md for the fields.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpcsplit.errors import SwitchboardError

__all__ = [
    "SCHEMA_VERSION",
    "ComponentSpec",
    "Edge",
    "FileRef",
    "Layout",
    "TensorSpec",
    "read_layout",
    "sha256_file",
]

SCHEMA_VERSION = 1
BATCH = "batch"
LAYOUT_FILE = "layout.json"
GOLDEN_FILE = "golden.safetensors"
DEFAULT_ATOL = 1e-5  # verification tolerance for fp32
DEFAULT_RTOL = 1e-4


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, read in chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """A named tensor: dtype (``"float32"``), shape with ``"batch"`` for the batch dims."""

    name: str
    dtype: str
    shape: tuple[int | str, ...]
    bytes_per_sample: int

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "bytes_per_sample": self.bytes_per_sample,
        }

    @staticmethod
    def from_json(d: Mapping[str, Any]) -> TensorSpec:
        return TensorSpec(str(d["name"]), str(d["dtype"]), tuple(d["shape"]), int(d["bytes_per_sample"]))

    @property
    def batch_dims(self) -> tuple[int, ...]:
        return tuple(i for i, s in enumerate(self.shape) if s == BATCH)


@dataclass(frozen=True, slots=True)
class ComponentSpec:
    """One component: its tensors in call order, parameter bytes and program file."""

    name: str
    kind: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    param_bytes: int
    work_ms: float
    program: str
    sha256: str
    file_bytes: int

    @property
    def input_bytes_per_sample(self) -> int:
        return sum(t.bytes_per_sample for t in self.inputs)

    @property
    def output_bytes_per_sample(self) -> int:
        return sum(t.bytes_per_sample for t in self.outputs)

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "kind": self.kind,
            "inputs": [t.to_json() for t in self.inputs],
            "outputs": [t.to_json() for t in self.outputs],
            "param_bytes": self.param_bytes,
            "work_ms": self.work_ms,
            "program": self.program,
            "sha256": self.sha256,
            "file_bytes": self.file_bytes,
        }

    @staticmethod
    def from_json(d: Mapping[str, Any]) -> ComponentSpec:
        return ComponentSpec(
            name=str(d["name"]),
            kind=str(d.get("kind", "sequential")),
            inputs=tuple(TensorSpec.from_json(t) for t in d["inputs"]),
            outputs=tuple(TensorSpec.from_json(t) for t in d["outputs"]),
            param_bytes=int(d["param_bytes"]),
            work_ms=float(d.get("work_ms", 0.0)),
            program=str(d["program"]),
            sha256=str(d["sha256"]),
            file_bytes=int(d["file_bytes"]),
        )


@dataclass(frozen=True, slots=True)
class Edge:
    """Dataflow between components: ``src`` is a component or ``"input"``, ``dst`` one or ``"output"``."""

    src: str
    src_name: str
    dst: str
    dst_name: str

    def to_json(self) -> dict[str, str]:
        return {"src": self.src, "src_name": self.src_name, "dst": self.dst, "dst_name": self.dst_name}


@dataclass(frozen=True, slots=True)
class FileRef:
    """A file of the switchboard with its hash and size."""

    file: str
    sha256: str
    file_bytes: int

    def to_json(self) -> dict[str, Any]:
        return {"file": self.file, "sha256": self.sha256, "file_bytes": self.file_bytes}

    @staticmethod
    def from_json(d: Mapping[str, Any]) -> FileRef:
        return FileRef(str(d["file"]), str(d["sha256"]), int(d["file_bytes"]))


@dataclass(frozen=True, slots=True)
class Layout:
    """Everything ``layout.json`` holds."""

    schema_version: int
    model: str
    arch_hash: str
    inputs: tuple[TensorSpec, ...]
    input_spec: str
    outputs: tuple[TensorSpec, ...]
    output_values: tuple[str, ...]
    output_spec: str
    components: tuple[ComponentSpec, ...]
    edges: tuple[Edge, ...]
    order: tuple[str, ...]
    whole: FileRef
    whole_param_bytes: int
    golden: FileRef
    golden_batch_size: int
    dynamic_batch: bool
    verification: dict[str, Any]
    partition: dict[str, Any]
    torch_version: str

    def to_json(self) -> dict[str, Any]:
        return {
            "schema_version": self.schema_version,
            "model": self.model,
            "arch_hash": self.arch_hash,
            "torch_version": self.torch_version,
            "dynamic_batch": self.dynamic_batch,
            "inputs": [t.to_json() for t in self.inputs],
            "input_spec": self.input_spec,
            "outputs": [
                {**t.to_json(), "value": v} for t, v in zip(self.outputs, self.output_values, strict=True)
            ],
            "output_spec": self.output_spec,
            "components": [c.to_json() for c in self.components],
            "edges": [e.to_json() for e in self.edges],
            "order": list(self.order),
            "whole": {**self.whole.to_json(), "param_bytes": self.whole_param_bytes},
            "golden": {**self.golden.to_json(), "batch_size": self.golden_batch_size},
            "verification": self.verification,
            "partition": self.partition,
        }

    def write(self, path: Path) -> None:
        path.write_text(json.dumps(self.to_json(), indent=2) + "\n")


def _req(
    d: Mapping[str, Any], key: str, kind: type | tuple[type, ...], where: str, problems: list[str]
) -> Any:
    if key not in d:
        problems.append(f"{where}: missing key {key!r}")
        return None
    if not isinstance(d[key], kind):
        problems.append(f"{where}.{key}: found {type(d[key]).__name__}")
        return None
    return d[key]


def read_layout(path: Path) -> Layout:
    """Parse and validate ``layout.json`` (every problem is listed in one error).

    Raises
    ------
    SwitchboardError
        Missing file, invalid JSON, unknown schema version, missing or mistyped fields,
        or an ``order`` that does not match the components.
    """
    if not path.is_file():
        raise SwitchboardError(f"found no {path}; needed a switchboard directory written by hpcsplit.export")
    try:
        d = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SwitchboardError(f"{path} is not valid JSON ({e}); re-run the export") from e
    if not isinstance(d, dict):
        raise SwitchboardError(
            f"{path}: found a JSON {type(d).__name__}; needed an object; re-run the export"
        )
    version = d.get("schema_version")
    if version != SCHEMA_VERSION:
        raise SwitchboardError(
            f"{path}: found schema_version={version!r}; needed {SCHEMA_VERSION}; re-export with this hpcsplit"
        )
    problems: list[str] = []
    for key, kind in (
        ("model", str),
        ("arch_hash", str),
        ("inputs", list),
        ("input_spec", str),
        ("outputs", list),
        ("output_spec", str),
        ("components", list),
        ("edges", list),
        ("order", list),
        ("whole", dict),
        ("golden", dict),
    ):
        _req(d, key, kind, "layout", problems)
    if problems:
        raise SwitchboardError(f"{path} is malformed: " + "; ".join(problems) + "; re-run the export")
    try:
        comps = tuple(ComponentSpec.from_json(c) for c in d["components"])
        layout = Layout(
            schema_version=version,
            model=d["model"],
            arch_hash=d["arch_hash"],
            inputs=tuple(TensorSpec.from_json(t) for t in d["inputs"]),
            input_spec=d["input_spec"],
            outputs=tuple(TensorSpec.from_json(t) for t in d["outputs"]),
            output_values=tuple(str(t["value"]) for t in d["outputs"]),
            output_spec=d["output_spec"],
            components=comps,
            edges=tuple(
                Edge(str(e["src"]), str(e["src_name"]), str(e["dst"]), str(e["dst_name"])) for e in d["edges"]
            ),
            order=tuple(str(x) for x in d["order"]),
            whole=FileRef.from_json(d["whole"]),
            whole_param_bytes=int(d["whole"].get("param_bytes", 0)),
            golden=FileRef.from_json(d["golden"]),
            golden_batch_size=int(d["golden"]["batch_size"]),
            dynamic_batch=bool(d.get("dynamic_batch", True)),
            verification=dict(d.get("verification") or {}),
            partition=dict(d.get("partition") or {}),
            torch_version=str(d.get("torch_version", "")),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise SwitchboardError(f"{path} is malformed: bad or missing field {e}; re-run the export") from e
    names = [c.name for c in comps]
    if list(layout.order) != names:
        raise SwitchboardError(
            f"{path} is malformed: order {list(layout.order)} does not match components {names}"
        )
    _check_wiring(path, layout)
    return layout


def _check_wiring(path: Path, layout: Layout) -> None:
    available = {t.name for t in layout.inputs}
    for c in layout.components:
        missing = [t.name for t in c.inputs if t.name not in available]
        if missing:
            raise SwitchboardError(
                f"{path} is malformed: component {c.name!r} reads {missing} before anything produces them"
            )
        available.update(t.name for t in c.outputs)
    missing = [v for v in layout.output_values if v not in available]
    if missing:
        raise SwitchboardError(f"{path} is malformed: outputs {missing} are produced by no component")


def check_file(root: Path, ref: FileRef | ComponentSpec, what: str, *, full: bool) -> Path:
    """Check that a file exists with the recorded size (and hash when ``full``)."""
    rel = ref.program if isinstance(ref, ComponentSpec) else ref.file
    path = root / rel
    if not path.is_file():
        raise SwitchboardError(f"{what} file {path} is missing; needed by layout.json; re-run the export")
    size = path.stat().st_size
    if size != ref.file_bytes:
        raise SwitchboardError(
            f"{what} file {path} has {size} bytes; layout.json records {ref.file_bytes}; "
            "the file was changed or truncated; re-run the export"
        )
    if full:
        digest = sha256_file(path)
        if digest != ref.sha256:
            raise SwitchboardError(
                f"{what} file {path} has sha256 {digest[:16]}...; layout.json records {ref.sha256[:16]}...; "
                "the file was tampered with or belongs to another export; re-run the export"
            )
    return path


def spec_of(name: str, dtype: str, shape: Sequence[int | str]) -> TensorSpec:
    """A :class:`TensorSpec` with bytes per sample computed from the non-batch dims."""
    import torch

    itemsize = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    n = 1
    for s in shape:
        if isinstance(s, int):
            n *= s
    return TensorSpec(name, dtype, tuple(shape), n * itemsize)
