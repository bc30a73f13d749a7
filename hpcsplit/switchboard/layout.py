"""The switchboard's ``layout.json``: typed records, JSON (de)serialisation, validation, hashing.

See [Note: switchboard layout] in docs/architecture.md and docs/export.md for the fields.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
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
    "check_file",
    "load_layout",
    "parse_layout",
    "read_bytes",
    "read_layout",
    "read_ref",
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
    return load_layout(path.parent)[0]


def load_layout(root: Path) -> tuple[Layout, str]:
    """``root/layout.json`` read once (no symlink): the validated layout and the sha256 of its bytes."""
    path = root / LAYOUT_FILE
    if not path.is_file():
        raise SwitchboardError(f"found no {path}; needed a switchboard directory written by hpcsplit.export")
    data = read_bytes(root, LAYOUT_FILE, "layout")
    return parse_layout(data, path), hashlib.sha256(data).hexdigest()


def parse_layout(data: bytes, path: Path) -> Layout:
    """Validate the bytes of a ``layout.json`` (``path`` names it in errors)."""
    try:
        d = json.loads(data)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise SwitchboardError(f"{path} is not valid JSON ({type(e).__name__}: {str(e)[:200]}); re-run the export") from e
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
    except (KeyError, TypeError, ValueError, AttributeError, OverflowError, RecursionError) as e:
        raise SwitchboardError(
            f"{path} is malformed: bad or missing field ({type(e).__name__}: {str(e)[:200]}); re-run the export"
        ) from e
    names = [c.name for c in comps]
    if list(layout.order) != names:
        raise SwitchboardError(
            f"{path} is malformed: order {list(layout.order)} does not match components {names}"
        )
    _check_wiring(path, layout)
    return layout


def _mismatch(t: TensorSpec, made: TensorSpec) -> bool:
    return (t.dtype, tuple(t.shape)) != (made.dtype, tuple(made.shape))


def _check_wiring(path: Path, layout: Layout) -> None:
    available = {t.name: t for t in layout.inputs}
    for c in layout.components:
        missing = [t.name for t in c.inputs if t.name not in available]
        if missing:
            raise SwitchboardError(
                f"{path} is malformed: component {c.name!r} reads {missing} before anything produces them"
            )
        for t in c.inputs:
            made = available[t.name]
            if _mismatch(t, made):
                raise SwitchboardError(
                    f"{path} is malformed: component {c.name!r} reads {t.name!r} as {t.dtype} {list(t.shape)}, "
                    f"but it is made as {made.dtype} {list(made.shape)}; re-run the export"
                )
        available.update((t.name, t) for t in c.outputs)
    missing = [v for v in layout.output_values if v not in available]
    if missing:
        raise SwitchboardError(f"{path} is malformed: outputs {missing} are produced by no component")
    for t, v in zip(layout.outputs, layout.output_values, strict=False):
        made = available[v]
        if _mismatch(t, made):
            raise SwitchboardError(
                f"{path} is malformed: output {t.name!r} is {t.dtype} {list(t.shape)}, but {v!r} is made as "
                f"{made.dtype} {list(made.shape)}; re-run the export"
            )


# [Note: switchboard paths] Every file layout.json names (programs, whole, golden) is a relative
# path inside the switchboard directory: no absolute path, no ``..``, no symlink at any component
# (each is opened with O_NOFOLLOW from the directory's file descriptor, so a component swapped for a
# symlink after the check is refused too), a regular file.  Its bytes are read once: the hash is
# computed on the bytes that are then parsed, never on a second read.  Errors name the file as
# layout.json writes it and say nothing about anything outside the directory.


def _rel_parts(rel: object, what: str) -> list[str]:
    text = str(rel)
    parts = text.split("/")
    if (not isinstance(rel, str) or not rel or rel.startswith("/") or "\\" in rel or "\x00" in rel
            or any(p in ("", ".", "..") for p in parts) or ":" in parts[0]):
        raise SwitchboardError(
            f"{what} file {text[:200]!r} in layout.json is refused: needed a relative path inside the "
            "switchboard directory (no absolute path, '..', '.', empty part or backslash); re-run the export"
        )
    return parts


def _open_inside(root: Path, rel: object, what: str) -> int:
    """A read-only fd of ``root/rel``, refusing escapes and symlinks at every component."""
    parts = _rel_parts(rel, what)
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0)
    try:
        dfd = os.open(root, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise SwitchboardError(f"found no switchboard directory {root} ({e.strerror})") from e
    try:
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            try:
                st = os.stat(part, dir_fd=dfd, follow_symlinks=False)
            except FileNotFoundError:
                raise SwitchboardError(
                    f"{what} file {rel!r} is missing; needed by layout.json; re-run the export"
                ) from None
            except OSError as e:
                raise SwitchboardError(f"{what} file {rel!r} cannot be read ({e.strerror}); re-run the export") from e
            if stat.S_ISLNK(st.st_mode):
                raise SwitchboardError(
                    f"{what} file {rel!r} is refused: {'/'.join(parts[: i + 1])!r} is a symlink; a switchboard's "
                    "files must lie inside its directory; re-run the export (or copy the files in)"
                )
            kind_ok = stat.S_ISREG(st.st_mode) if last else stat.S_ISDIR(st.st_mode)
            if not kind_ok:
                raise SwitchboardError(
                    f"{what} file {rel!r} is refused: {'/'.join(parts[: i + 1])!r} is not a "
                    f"{'regular file' if last else 'folder'}; re-run the export"
                )
            try:
                fd = os.open(part, (flags if last else flags | getattr(os, "O_DIRECTORY", 0)), dir_fd=dfd)
            except OSError as e:  # swapped for a symlink (ELOOP) or removed since the stat
                raise SwitchboardError(
                    f"{what} file {rel!r} changed while it was opened ({e.strerror}); re-run the export"
                ) from e
            os.close(dfd)
            dfd = fd
            if not (stat.S_ISREG if last else stat.S_ISDIR)(os.fstat(fd).st_mode):  # swapped since the stat
                raise SwitchboardError(f"{what} file {rel!r} changed while it was opened; re-run the export")
        return dfd
    except BaseException:
        os.close(dfd)
        raise


def read_bytes(root: Path, rel: object, what: str, *, file_bytes: int | None = None,
               sha256: str | None = None) -> bytes:
    """The bytes of ``root/rel`` (see [Note: switchboard paths]), read once, size and hash checked.

    Raises
    ------
    SwitchboardError
        Escaping path, symlink, missing file, size or hash unlike what layout.json records.
    """
    fd = _open_inside(root, rel, what)
    try:
        size = os.fstat(fd).st_size
        if file_bytes is not None and size != file_bytes:
            raise SwitchboardError(
                f"{what} file {rel!r} has {size} bytes; layout.json records {file_bytes}; "
                "the file was changed or truncated; re-run the export"
            )
        chunks = []
        left = size
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 24))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        data = b"".join(chunks)
    finally:
        os.close(fd)
    if len(data) != size or (file_bytes is not None and len(data) != file_bytes):
        raise SwitchboardError(f"{what} file {rel!r} changed while it was read; re-run the export")
    if sha256 is not None and hashlib.sha256(data).hexdigest() != sha256:
        raise SwitchboardError(
            f"{what} file {rel!r} has a sha256 unlike layout.json's {str(sha256)[:16]}...; "
            "the file was tampered with or belongs to another export; re-run the export"
        )
    return data


def read_ref(root: Path, ref: FileRef | ComponentSpec, what: str) -> bytes:
    """The checked bytes of the file a layout entry names."""
    rel = ref.program if isinstance(ref, ComponentSpec) else ref.file
    return read_bytes(root, rel, what, file_bytes=ref.file_bytes, sha256=ref.sha256)


def check_file(root: Path, ref: FileRef | ComponentSpec, what: str, *, full: bool) -> Path:
    """Check that a file lies inside ``root`` with the recorded size (and hash when ``full``)."""
    rel = ref.program if isinstance(ref, ComponentSpec) else ref.file
    if full:
        read_ref(root, ref, what)
    else:
        fd = _open_inside(root, rel, what)
        try:
            size = os.fstat(fd).st_size
        finally:
            os.close(fd)
        if size != ref.file_bytes:
            raise SwitchboardError(
                f"{what} file {rel!r} has {size} bytes; layout.json records {ref.file_bytes}; "
                "the file was changed or truncated; re-run the export"
            )
    return root / rel


def spec_of(name: str, dtype: str, shape: Sequence[int | str]) -> TensorSpec:
    """A :class:`TensorSpec` with bytes per sample computed from the non-batch dims."""
    import torch

    itemsize = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    n = 1
    for s in shape:
        if isinstance(s, int):
            n *= s
    return TensorSpec(name, dtype, tuple(shape), n * itemsize)
