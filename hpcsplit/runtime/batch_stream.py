"""Batch mode over datasets larger than memory: streamed inputs, a resumable outputs file, progress.

[Note: streaming batch mode]
``runtime.input_path`` is an HDF5 file (chunked or contiguous datasets, one per model input), an
``.npy`` (a one-input model) or ``.npz`` file, or a directory of shards (``*.h5`` / ``*.hdf5`` /
``*.npy`` / ``*.npz``, in name order; each shard holds every input, the same way).  :func:`open_inputs`
opens and checks every shard before any request is sent (names, dtypes, per-sample shapes against the
switchboard's layout, equal sample counts per shard; no object arrays, ``.npy`` / ``.npz`` read with
``allow_pickle=False``, HDF5 only when self-contained, ``[Note: self-contained HDF5]``); each error
names the file, the array and what was expected.  Nothing is read whole: :class:`ChunkFeed` reads
``runtime.chunk_rows`` rows at a time (``.npy`` memory-mapped, ``.npz`` members streamed from the
zip, HDF5 by slices) and reads the next chunk on a thread while the current one is served.

The outputs go to one HDF5 file (:class:`StreamWriter`): per model output a chunked dataset
preallocated to the sample count (space allocated when the dataset is made, so later writes change
no HDF5 metadata), plus ``done`` (bool), ``done_count`` (how often each row was committed: 1 in a
finished file), ``latency_ms`` (admission to output) and ``failed`` (0, :data:`FAIL_TIMEOUT` or
:data:`FAIL_COMPONENT`).
Finished rows are buffered and written in groups (at most ``chunk_rows`` rows or
:data:`FLUSH_EVERY_S`): the group's data is written and flushed first, then its ``done`` flags, then
flushed again, so a ``done`` row on disk is whole whenever the job dies (``kill -9`` loses only the
rows in flight and the unflushed group).  Memory is bounded by ``runtime.max_inflight``, two input
chunks and one output group, whatever the dataset's size: the frontend serves the rows in sessions of
``frontend_rank.SEGMENT_ROWS`` (65,536) rows, and keeps 17 bytes per row of the whole dataset (the
``done`` mask and the rows to serve, twice while a pass reads ahead).

Resume: the file's attributes record the input's fingerprint (:func:`InputSource.fingerprint`:
file names, sizes, array names/shapes/dtypes and a few rows' bytes) and the switchboard's sha256.  The
same command run again opens the file, checks both, and serves only the rows whose ``done`` flag is
not set; another input or switchboard is refused (never mixed) unless ``runtime.overwrite=true``,
which starts over.  An ``.npz`` output cannot grow: it is streamed to ``<output>.partial.h5`` (the
resumable file) and written from it when the job ends (the stream removed once every row is done).
"""

from __future__ import annotations

import hashlib
import os
import time
import zipfile
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from hpcsplit.core.hdf5 import WriterLock, open_self_contained
from hpcsplit.errors import RuntimeStageError
from hpcsplit.runtime.batch_files import MARKER, check_array_meta, write_outputs
from hpcsplit.switchboard.layout import TensorSpec

__all__ = ["FAIL_COMPONENT", "FAIL_REASONS", "FAIL_TIMEOUT", "FLUSH_EVERY_S", "ChunkFeed", "InputSource", "Progress", "StreamWriter",
           "chunk_rows_for", "memory_source", "open_inputs", "peak_rss_mb"]

FLUSH_EVERY_S = 0.5
FAIL_TIMEOUT = 1  # the ``failed`` dataset's reason codes
FAIL_COMPONENT = 2  # a component raised on the row alone ([Note: failed rows] in hpcsplit.runtime.component)
FAIL_REASONS = {FAIL_TIMEOUT: "timeout (runtime.request_timeout_s, counted from admission)",
                FAIL_COMPONENT: "component error (the component raised on this row alone)"}
SHARD_SUFFIXES = (".h5", ".hdf5", ".npy", ".npz")
CHUNK_BYTES = 32 << 20  # chunk_rows=null: about this many bytes of inputs per chunk
FORMAT = 2  # the outputs file's layout version (attribute ``hpcsplit_stream``)


# ------------------------------------------------------------------------------------------- inputs
class _Array:
    """One array of one shard: ``read(lo, hi)`` returns rows ``lo:hi`` as a numpy array."""

    def __init__(self, path: Path | None, name: str, shape: tuple[int, ...], dtype: np.dtype,
                 read: Callable[[int, int], np.ndarray]) -> None:
        self.path, self.name, self.shape, self.dtype, self.read = path, name, shape, dtype, read


def _bad(path: Path, msg: str) -> RuntimeStageError:
    return RuntimeStageError(f"runtime.input_path: {path}: {msg}")


def _npy_arrays(path: Path) -> dict[str, _Array]:
    try:
        mm = np.load(path, mmap_mode="r", allow_pickle=False)
    except ValueError as e:  # object arrays need pickle: refused
        raise _bad(path, f"{e}; save plain numeric arrays (np.save of a numeric array)") from e
    except (OSError, EOFError) as e:
        raise _bad(path, f"cannot be read as .npy ({e})") from e
    if not isinstance(mm, np.ndarray):
        raise _bad(path, "is not a single .npy array")
    return {"arr_0": _Array(path, "arr_0", tuple(mm.shape), mm.dtype, lambda lo, hi: np.array(mm[lo:hi]))}


def _npz_arrays(path: Path) -> dict[str, _Array]:
    """Each member streamed from the zip (compressed or not): header parsed, rows read by offset."""
    try:
        zf = zipfile.ZipFile(path)
    except (OSError, zipfile.BadZipFile) as e:
        raise _bad(path, f"cannot be read as .npz ({e})") from e
    out: dict[str, _Array] = {}
    for member in zf.namelist():
        if not member.endswith(".npy"):
            continue
        name = member[:-4]
        fh = zf.open(member)
        try:
            version = np.lib.format.read_magic(fh)
            header = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
            shape, fortran, dtype = header(fh)
        except ValueError as e:
            raise _bad(path, f"array {name!r}: not a readable .npy member ({e})") from e
        if dtype.hasobject:
            raise _bad(path, f"array {name!r} holds Python objects (dtype {dtype}), which need pickle to load: "
                             "refused; save plain numeric arrays")
        if fortran and len(shape) > 1:
            raise _bad(path, f"array {name!r} is in Fortran order; save it C-ordered (np.ascontiguousarray)")
        offset = fh.tell()
        row = int(dtype.itemsize * int(np.prod(shape[1:], dtype=np.int64))) if shape else 0

        def read(lo: int, hi: int, fh: Any = fh, offset: int = offset, row: int = row, dtype: np.dtype = dtype,
                 shape: tuple[int, ...] = tuple(shape), name: str = name) -> np.ndarray:
            fh.seek(offset + lo * row)
            buf = fh.read((hi - lo) * row)
            if len(buf) != (hi - lo) * row:
                raise _bad(path, f"array {name!r} is truncated (rows {lo}:{hi} missing)")
            return np.frombuffer(buf, dtype=dtype).reshape((hi - lo, *shape[1:])).copy()

        out[name] = _Array(path, name, tuple(shape), dtype, read)
    return out


def _slicer(a: Any) -> Callable[[int, int], np.ndarray]:
    """``(lo, hi) -> a[lo:hi]`` as a numpy array (an h5py dataset or an array in memory)."""

    def read(lo: int, hi: int) -> np.ndarray:
        return np.asarray(a[lo:hi])

    return read


def _h5_arrays(path: Path, keep: list[Any]) -> dict[str, _Array]:
    f = open_self_contained(path, RuntimeStageError, "batch input file")
    keep.append(f)
    out: dict[str, _Array] = {}
    for k in f:
        ds = f[k]
        if not hasattr(ds, "shape"):
            continue
        if ds.dtype.kind in "OSUV":
            raise _bad(path, f"array {k!r} has dtype {ds.dtype}; the model takes numeric arrays")
        out[k] = _Array(path, k, tuple(ds.shape), ds.dtype, _slicer(ds))
    return out


class InputSource:
    """The checked shards of ``runtime.input_path`` (``[Note: streaming batch mode]``); ``n`` rows in all."""

    def __init__(self, path: Path, shards: list[list[_Array]], handles: list[Any]) -> None:
        self.path = path
        self.shards = shards  # per shard: one _Array per model input
        self._handles = handles
        self.counts = [s[0].shape[0] for s in shards]
        self.starts = np.cumsum([0, *self.counts])
        self.n = int(self.starts[-1])

    def read(self, lo: int, hi: int) -> list[np.ndarray]:
        """Rows ``lo:hi`` of every input (across shards)."""
        parts: list[list[np.ndarray]] = [[] for _ in self.shards[0]]
        s = int(np.searchsorted(self.starts, lo, side="right")) - 1
        while lo < hi:
            a, b = int(self.starts[s]), int(self.starts[s + 1])
            top = min(hi, b)
            for i, arr in enumerate(self.shards[s]):
                parts[i].append(arr.read(lo - a, top - a))
            lo, s = top, s + 1
        return [p[0] if len(p) == 1 else np.concatenate(p) for p in parts]

    def fingerprint(self) -> str:
        """sha256 of the shards' names and sizes, the arrays' names, shapes and dtypes, and a few rows."""
        h = hashlib.sha256()
        for arrays in self.shards:
            p = arrays[0].path
            h.update((f"{p.name}:{p.stat().st_size}" if p is not None else "in memory").encode())
            cnt = arrays[0].shape[0]
            rows = sorted({int(r) for r in np.linspace(0, cnt - 1, 33)})
            for a in arrays:
                h.update(f"|{a.name}:{a.shape}:{a.dtype.str}".encode())
                for r in rows:
                    h.update(np.ascontiguousarray(a.read(r, r + 1)).tobytes())
        return h.hexdigest()

    def close(self) -> None:
        for f in self._handles:
            try:
                f.close()
            except Exception:  # noqa: BLE001, S110 - closing a read-only file at the end
                pass
        self._handles = []


def memory_source(arrays: Sequence[np.ndarray], names: Sequence[str]) -> InputSource:
    """An :class:`InputSource` over arrays in memory (batch mode without ``runtime.input_path``)."""
    shard = [_Array(None, n, tuple(a.shape), a.dtype, _slicer(a)) for n, a in zip(names, arrays, strict=True)]
    return InputSource(Path("<example inputs>"), [shard], [])


def _shard_files(path: Path) -> list[Path]:
    if not path.exists():
        raise RuntimeStageError(f"runtime.input_path={path} does not exist; give an .h5/.npz/.npy file or a "
                                "directory of such shards (samples first)")
    if not path.is_dir():
        if path.suffix not in SHARD_SUFFIXES:
            raise _bad(path, f"give a file ending in {', '.join(SHARD_SUFFIXES)} (or a directory of them)")
        return [path]
    files = sorted(p for p in path.iterdir() if p.suffix in SHARD_SUFFIXES and p.is_file())
    root = path.resolve()
    for p in files:  # a directory's shards are the directory's: a link out of it is not read
        if p.is_symlink() and root not in p.resolve().parents:
            raise _bad(p, f"is a symbolic link to {p.resolve()}, outside {path}; copy the shard into the "
                          "directory (or give that file as runtime.input_path)")
    if not files:
        raise _bad(path, f"the directory holds no shards ({', '.join('*' + s for s in SHARD_SUFFIXES)})")
    if len({p.suffix in (".h5", ".hdf5") for p in files}) > 1 or len({p.suffix for p in files} - {".h5", ".hdf5"}) > 1:
        raise _bad(path, f"the shards mix formats ({sorted({p.suffix for p in files})}); use one kind")
    return files


def open_inputs(path: str | Path, names: tuple[str, ...], specs: Sequence[TensorSpec] | None = None) -> InputSource:
    """Open and check every shard of ``path`` against the model's inputs ``names`` (and ``specs``).

    Raises
    ------
    RuntimeStageError
        Naming the file, the array and what was expected, before any request is sent.
    """
    path = Path(path)
    handles: list[Any] = []
    shards: list[list[_Array]] = []
    try:
        for f in _shard_files(path):
            if f.suffix == ".npy":
                if len(names) != 1:
                    raise _bad(f, f"a .npy file holds one array; the model needs {list(names)}: use .npz or .h5 "
                                  "(one array per input)")
                arrays = _npy_arrays(f)
            elif f.suffix == ".npz":
                arrays = _npz_arrays(f)
            else:
                arrays = _h5_arrays(f, handles)
            chosen = []
            for i, n in enumerate(names):
                key = n if n in arrays else f"arr_{i}"
                a = arrays.get(key)
                if a is None:
                    raise _bad(f, f"has arrays {sorted(arrays)}; the model needs {list(names)}")
                check_array_meta(f, key, a.shape, a.dtype, specs[i] if specs is not None else None)
                chosen.append(a)
            lens = {a.shape[0] for a in chosen}
            if len(lens) != 1:
                raise _bad(f, f"the inputs have different sample counts "
                              f"{ {a.name: a.shape[0] for a in chosen} }; every input needs one row per sample")
            if shards:
                for a, b in zip(shards[0], chosen, strict=True):
                    if a.shape[1:] != b.shape[1:] or a.dtype != b.dtype:
                        first = a.path.name if a.path is not None else "the first shard"
                        raise _bad(f, f"array {b.name!r} is {b.dtype}{list(b.shape[1:])} per sample but "
                                      f"{first} has {a.dtype}{list(a.shape[1:])}; shards must agree")
            shards.append(chosen)
        src = InputSource(path, shards, handles)
    except BaseException:
        for h in handles:
            h.close()
        raise
    if src.n == 0:
        src.close()
        raise _bad(path, "the inputs hold no samples")
    return src


def chunk_rows_for(src: InputSource, chunk_rows: int | None, max_inflight: int) -> int:
    """``runtime.chunk_rows``, or about :data:`CHUNK_BYTES` of inputs (at least ``max_inflight`` rows)."""
    if chunk_rows:
        return int(chunk_rows)
    row = sum(a.dtype.itemsize * int(np.prod(a.shape[1:], dtype=np.int64)) for a in src.shards[0])
    return int(max(max_inflight, 256, min(1 << 20, CHUNK_BYTES // max(row, 1))))


class ChunkFeed:
    """Rows ``rows`` (sorted) of ``src``, served by position: ``get(pos)`` for increasing positions.

    Chunks of ``chunk`` rows are read on one thread: the chunk after the one being served is read
    ahead; chunks behind the lowest position asked for are dropped.
    """

    def __init__(self, src: InputSource, rows: np.ndarray, chunk: int) -> None:
        self.src, self.rows, self.chunk = src, np.asarray(rows, dtype=np.int64), int(chunk)
        self._ks = np.unique(self.rows // self.chunk)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="hpcsplit-read")
        self._futs: dict[int, Future[list[np.ndarray]]] = {}
        self.read_s = 0.0  # time get() waited for a chunk (0 when read-ahead keeps up)
        if len(self._ks):
            self._ensure(0)

    def _ensure(self, pos: int) -> Future[list[np.ndarray]] | None:
        if pos >= len(self._ks):
            return None
        if pos not in self._futs:
            lo = int(self._ks[pos]) * self.chunk
            self._futs[pos] = self._pool.submit(self.src.read, lo, min(self.src.n, lo + self.chunk))
        return self._futs[pos]

    def get(self, pos: np.ndarray) -> list[np.ndarray]:
        """Inputs (samples first) of rows ``rows[pos]``, one array per model input."""
        r = self.rows[np.asarray(pos, dtype=np.int64)]
        k = r // self.chunk
        first = int(np.searchsorted(self._ks, k[0]))
        for p in [p for p in self._futs if p < first]:
            del self._futs[p]
        out: list[np.ndarray] | None = None
        for kk in np.unique(k):
            p = int(np.searchsorted(self._ks, kk))
            fut = self._ensure(p)
            assert fut is not None
            self._ensure(p + 1)  # read ahead
            t = time.perf_counter()
            data = fut.result()
            self.read_s += time.perf_counter() - t
            sel = k == kk
            local = r[sel] - int(kk) * self.chunk
            if out is None:
                out = [np.empty((len(r), *d.shape[1:]), dtype=d.dtype) for d in data]
            for o, d in zip(out, data, strict=True):
                o[sel] = d[local]
        assert out is not None
        return out

    def close(self) -> None:
        self._futs.clear()
        self._pool.shutdown(wait=True, cancel_futures=True)


# ------------------------------------------------------------------------------------------ outputs
def _ds_name(name: str) -> str:
    return name.replace("/", "_")


def _runs(idx: np.ndarray) -> list[tuple[int, int, int]]:
    """Sorted row indices as contiguous runs ``(position in idx, first row, row after the last)``."""
    cut = np.flatnonzero(np.diff(idx) != 1) + 1
    starts = np.concatenate([[0], cut])
    ends = np.concatenate([cut, [len(idx)]])
    return [(int(s), int(idx[s]), int(idx[e - 1]) + 1) for s, e in zip(starts, ends, strict=True)]


def _stream_format(path: Path) -> int:
    """The ``hpcsplit_stream`` attribute of an outputs file; 0 when absent or unreadable."""
    import h5py

    try:
        with h5py.File(path, "r", locking=False) as f:
            return int(f.attrs.get("hpcsplit_stream", 0))
    except Exception:  # noqa: BLE001 - anything unreadable is not a resumable file
        return 0


class StreamWriter:
    """The resumable outputs file of ``[Note: streaming batch mode]``.

    Parameters
    ----------
    path
        ``runtime.output_path`` (``.h5``; ``.npz`` streams to ``<path>.partial.h5``).
    names
        The model's outputs.
    n
        Rows in the dataset.
    input_fp, switchboard_fp
        Fingerprints recorded in (and checked against) the file's attributes.
    overwrite
        Start over even when the file holds another input's or switchboard's rows.
    group_rows
        Most rows buffered before a write.
    """

    def __init__(self, path: str | Path, names: tuple[str, ...], n: int, input_fp: str, switchboard_fp: str,
                 overwrite: bool = False, group_rows: int = 4096) -> None:
        import h5py

        self.path = Path(path)
        self.names, self.n, self.group_rows = names, int(n), int(group_rows)
        self.stream = self.path if self.path.suffix != ".npz" else self.path.with_name(self.path.name + ".partial.h5")
        self._lock = WriterLock(self.stream, RuntimeStageError, "batch outputs file").acquire()
        self._buf: dict[int, tuple[list[np.ndarray], float]] = {}
        self._last_flush = time.perf_counter()
        self.written = 0  # rows committed by this run
        attrs = {"n": self.n, "input_sha256": input_fp, "switchboard_sha256": switchboard_fp,
                 "outputs": list(names)}
        self.resumed = 0
        if self.stream.exists() and not overwrite and _stream_format(self.stream) == FORMAT:
            self._f = self._reopen(h5py, attrs)  # an earlier hpcsplit outputs file of another kind is replaced
        else:
            self._f = self._create(h5py, attrs)
        self.done = self._f["done"][()]  # in memory: 1 byte per row
        self.resumed = int(self.done.sum())

    def _reopen(self, h5py: Any, attrs: dict[str, Any]) -> Any:
        try:
            f = h5py.File(self.stream, "r+", locking=False)
        except OSError as e:
            raise RuntimeStageError(f"runtime.output_path={self.path}: {self.stream} exists but cannot be opened "
                                    f"to continue ({e}); remove it, or set runtime.overwrite=true to start over") from e
        try:
            for key, what in (("input_sha256", "input (runtime.input_path)"), ("switchboard_sha256", "switchboard"),
                              ("n", "sample count"), ("outputs", "model outputs")):
                have = f.attrs.get(key)
                have = [str(x) for x in have] if key == "outputs" else (int(have) if key == "n" else str(have))
                if have != attrs[key]:
                    raise RuntimeStageError(
                        f"runtime.output_path={self.path}: refusing to continue it: its rows were made from another "
                        f"{what} ({str(have)[:16]} there, {str(attrs[key])[:16]} now). Re-run with the same "
                        "input and switchboard, give another runtime.output_path, or set runtime.overwrite=true "
                        "to start over")
        except BaseException:
            f.close()
            self._lock.release()
            raise
        return f

    def _create(self, h5py: Any, attrs: dict[str, Any]) -> Any:
        tmp = self.stream.with_name(self.stream.name + ".new")
        try:
            with h5py.File(tmp, "w", locking=False) as f:
                for k, v in attrs.items():
                    f.attrs[k] = v
                f.attrs[MARKER] = True
                f.attrs["hpcsplit_stream"] = FORMAT
                c = (min(self.n, 1 << 16),)
                f.create_dataset("done", shape=(self.n,), dtype=bool, chunks=c, dcpl=self._dcpl(h5py, (self.n,), c, bool))
                f.create_dataset("done_count", shape=(self.n,), dtype=np.uint16, chunks=c,
                                 dcpl=self._dcpl(h5py, (self.n,), c, np.uint16))
                f.create_dataset("failed", shape=(self.n,), dtype=np.int8, chunks=c,
                                 dcpl=self._dcpl(h5py, (self.n,), c, np.int8))
                f.create_dataset("latency_ms", shape=(self.n,), dtype=np.float32, chunks=c,
                                 dcpl=self._dcpl(h5py, (self.n,), c, np.float32, np.nan))
            os.replace(tmp, self.stream)
            return h5py.File(self.stream, "r+", locking=False)
        except OSError as e:
            self._lock.release()
            raise RuntimeStageError(f"runtime.output_path={self.path}: cannot create {self.stream} ({e})") from e

    @staticmethod
    def _dcpl(h5py: Any, shape: tuple[int, ...], chunks: tuple[int, ...], dtype: Any, fill: Any = 0) -> Any:
        """Chunked, space allocated at creation (later writes touch raw data only), filled with ``fill``."""
        p = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
        p.set_chunk(chunks)
        p.set_alloc_time(h5py.h5d.ALLOC_TIME_EARLY)
        p.set_fill_time(h5py.h5d.FILL_TIME_ALLOC)
        p.set_fill_value(np.array(fill, dtype=dtype))
        return p

    def _output(self, j: int, row: np.ndarray) -> Any:
        name = _ds_name(self.names[j])
        if name not in self._f:
            import h5py

            shape = (self.n, *row.shape)
            per = max(1, min(self.n, (1 << 20) // max(row.nbytes, 1)))
            c = (per, *row.shape)
            self._f.create_dataset(name, shape=shape, dtype=row.dtype, chunks=c,
                                   dcpl=self._dcpl(h5py, shape, c, row.dtype))
            self._f.flush()
        return self._f[name]

    @property
    def todo(self) -> np.ndarray:
        """Rows not done yet (sorted)."""
        return np.flatnonzero(~self.done)

    def row(self, i: int, rows: list[np.ndarray], latency_ms: float) -> None:
        """Row ``i`` finished with one array per output (written with its group)."""
        buf = self._buf
        buf[i] = (rows, latency_ms)
        k = len(buf)
        if k >= self.group_rows or (not k & 31 and time.perf_counter() - self._last_flush > FLUSH_EVERY_S):
            self.flush()

    def fail(self, rows: np.ndarray, reason: int) -> None:
        """Mark ``rows`` failed (kept not done: a re-run serves them again)."""
        for _, lo, hi in _runs(np.sort(np.asarray(rows, dtype=np.int64))):
            self._f["failed"][lo:hi] = reason
        self._f.flush()

    def flush(self) -> None:
        """The group's data, flushed; then its ``done`` flags (and counters), flushed."""
        self._last_flush = time.perf_counter()
        if not self._buf:
            return
        idx = np.array(sorted(self._buf), dtype=np.int64)
        buf, self._buf = self._buf, {}
        runs = _runs(idx)
        first = buf[int(idx[0])][0]
        for j in range(len(first)):
            ds = self._output(j, first[j])
            data = np.stack([buf[int(i)][0][j] for i in idx])
            for s, lo, hi in runs:
                ds[lo:hi] = data[s:s + hi - lo]
        lat = np.array([buf[int(i)][1] for i in idx], dtype=np.float32)
        self._f.flush()
        cnt = self._f["done_count"]
        for s, lo, hi in runs:
            self._f["latency_ms"][lo:hi] = lat[s:s + hi - lo]
            self._f["failed"][lo:hi] = 0
            cnt[lo:hi] = cnt[lo:hi] + 1
            self._f["done"][lo:hi] = True
        self._f.flush()
        self.done[idx] = True
        self.written += len(idx)

    def close(self) -> Path:
        """Flush and close; an ``.npz`` output is written from the stream (which is removed once every row is
        done). Returns the outputs path."""
        if self._f is None:
            return self.path
        try:
            self.flush()
        finally:
            self._f.close()
            self._f = None
            self._lock.release()
        if self.stream != self.path:  # the .npz: the rows done so far; the stream stays until every row is done
            import h5py

            with h5py.File(self.stream, "r", locking=False) as f:
                arrays = [f[_ds_name(n)][()] if _ds_name(n) in f else None for n in self.names]
                write_outputs(self.path, self.names, arrays, f["done"][()], f["latency_ms"][()].astype(np.float64))
            if self.done.all():
                self.stream.unlink()
        return self.path


# ----------------------------------------------------------------------------------------- progress
def peak_rss_mb() -> float | None:
    """This process's peak resident memory (``VmHWM`` of /proc/self/status), MiB; None off Linux."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


class Progress:
    """A status line every ``every_s``: rows done/total, rows/s, ETA, failures (to ``say`` and ``path``)."""

    def __init__(self, total: int, already: int, every_s: float, say: Callable[[str], None],
                 path: Path | None = None) -> None:
        self.total, self.already, self.every_s, self._say, self.path = total, already, every_s, say, path
        self.t0 = self._last = time.perf_counter()
        self._calls = 0

    def line(self, done_now: int, failed: int) -> str:
        el = time.perf_counter() - self.t0
        rate = done_now / el if el > 0 else 0.0
        done = self.already + done_now
        left = self.total - done
        eta = f"{left / rate:.0f} s" if rate > 0 else "?"
        return (f"batch progress: {done}/{self.total} rows done ({100 * done / max(self.total, 1):.1f}%), "
                f"{rate:.0f} rows/s, ETA {eta}, {failed} failed")

    def tick(self, done_now: int, failed: int, force: bool = False) -> None:
        self._calls += 1
        if not force and self._calls & 63:
            return  # look at the clock every 64 rows only
        now = time.perf_counter()
        if not force and now - self._last < self.every_s:
            return
        self._last = now
        text = self.line(done_now, failed)
        self._say(text)
        if self.path is not None:
            try:
                tmp = self.path.with_name(self.path.name + ".tmp")
                tmp.write_text(text + "\n")
                os.replace(tmp, self.path)
            except OSError:
                pass  # the log line is the record; the file is for the login side
