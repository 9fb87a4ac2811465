"""DCP writing with a checksum per stored item, and failures named: which rank, file and errno.

``ChecksumSavePlanner`` records each item's checksum as DCP writes it; ``ChecksumFileSystemWriter``
writes them to ``checksums.json`` before DCP's ``.metadata`` (which keeps only DCP's own classes)
and reports a failed write with its errno and file (``torch.save`` turns ENOSPC into "unexpected
pos 704 vs 598"); ``describe_dcp_failure`` turns DCP's ``CheckpointException`` (a traceback per
rank) into one line per failing rank. The reading side is ``dcp_io.py``.
"""

from __future__ import annotations

import dataclasses
import os
from concurrent.futures import Future as ConcurrentFuture
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.futures import Future

from .checksum import CHECKSUMS_FILE, bytes_checksum, entry_key, tensor_checksum, write_checksums
from ..agreement import CheckpointError, UnsafeCheckpointError
from .errors import os_error_text


# ---- writing: a checksum per stored item ----------------------------------------------------------------
class ChecksumSavePlanner(dcp.DefaultSavePlanner):
    """DCP's default save planner that records the checksum of every item as DCP writes it (the
    bytes DCP gets from ``resolve_data``: a tensor chunk, or a value's ``torch.save`` bytes).

    A CPU tensor's checksum runs on a worker thread (numpy releases the GIL) while DCP serializes
    and writes the same tensor, so it hides behind DCP's own work where a core is free;
    :meth:`collect` waits for them.
    """

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self._pending: dict = {}
        self._pool = None

    def resolve_data(self, write_item):
        data = super().resolve_data(write_item)
        if isinstance(data, torch.Tensor):
            nbytes = data.numel() * data.element_size()
            if data.device.type == "cpu":
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(1, thread_name_prefix="dtensor_fp8-checksum")
                self._pending[write_item.index] = (self._pool.submit(tensor_checksum, data), nbytes)
            else:  # torch's reduction on the device; only the block sums come back
                self._pending[write_item.index] = (done(tensor_checksum(data)), nbytes)
        else:
            with data.getbuffer() as view:
                self._pending[write_item.index] = (done(bytes_checksum(view)), view.nbytes)
        return data

    def collect(self) -> dict:
        """``{index: (checksum, nbytes)}`` of every item resolved so far (waits for the worker)."""
        try:
            return {index: (future.result(), nbytes) for index, (future, nbytes) in self._pending.items()}
        finally:
            if self._pool is not None:
                self._pool.shutdown()
                self._pool = None


def done(value):
    """A finished future holding ``value``."""
    future: ConcurrentFuture = ConcurrentFuture()
    future.set_result(value)
    return future


@dataclasses.dataclass(frozen=True)
class _Checksummed:
    """A write result's storage info with its item's checksum, on the way to the coordinator (DCP
    gathers write results); unwrapped before ``.metadata`` is written."""

    info: object
    checksum: str
    nbytes: int


class _RecordingStream:
    """A write stream that remembers the ``OSError`` of a failed write, flush or close."""

    def __init__(self, stream, path, failures: list):
        self._stream, self._path, self._failures = stream, path, failures

    def _call(self, name, *args):
        try:
            return getattr(self._stream, name)(*args)
        except OSError as err:
            self._failures.append((self._path, err))
            raise

    def write(self, data):
        return self._call("write", data)

    def flush(self):
        return self._call("flush")

    def close(self):
        return self._call("close")

    def __getattr__(self, name):
        return getattr(self._stream, name)


class _RecordingFileSystem(FileSystem):
    """DCP's local file system whose write streams remember why a write failed: ``torch.save``
    reports a write that failed (ENOSPC, EIO) as "unexpected pos 704 vs 598", without the errno."""

    def __init__(self):
        super().__init__()
        self.failures: list = []  # (path, OSError), first first

    @contextmanager
    def create_stream(self, path, mode):
        if "r" in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        try:
            with super().create_stream(path, mode) as stream:
                yield _RecordingStream(stream, path, self.failures)
        except OSError as err:  # opening, or the close that flushes the last buffer
            self.failures.append((path, err))
            raise


class ChecksumFileSystemWriter(dcp.FileSystemWriter):
    """``FileSystemWriter`` that writes ``checksums.json`` (the checksum of every item, from a
    :class:`ChecksumSavePlanner`) before DCP's ``.metadata``, which stays DCP's own classes only.
    A failed write is reported with its errno and file (ENOSPC with the free space), not as the
    "unexpected pos" ``torch.save`` turns it into.

    Example:
        >>> dcp.save(state, storage_writer=ChecksumFileSystemWriter(path), planner=ChecksumSavePlanner())
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.fs = _RecordingFileSystem()

    def _named(self, err: BaseException) -> BaseException:
        """``err`` as a :class:`CheckpointError` naming the errno and file that caused it, where known."""
        failures = getattr(self.fs, "failures", [])
        if failures:
            path, first = failures[0]
            shown = "" if first is err else f" (torch reported: {type(err).__name__}: {(str(err).splitlines() or [''])[0][:150]})"
            return CheckpointError(f"writing the checkpoint failed: {os_error_text(first, path)}{shown}")
        if isinstance(err, OSError) and err.errno:
            return CheckpointError(f"writing the checkpoint failed: {os_error_text(err)}")
        return err

    def write_data(self, plan, planner):
        if not isinstance(planner, ChecksumSavePlanner):
            raise TypeError("ChecksumFileSystemWriter needs a ChecksumSavePlanner (it records the checksums)")
        try:
            results = super().write_data(plan, planner).wait()
        except Exception as err:  # noqa: BLE001  (named, or re-raised as it was)
            named = self._named(err)
            if named is err:
                raise
            raise named from err
        finally:
            checksums = planner.collect()
        wrapped = [dataclasses.replace(r, storage_data=_Checksummed(r.storage_data, *checksums[r.index]))
                   for r in results]
        fut: Future = Future()
        fut.set_result(wrapped)
        return fut

    def finish(self, metadata, results) -> None:
        plain, entries = [], {}
        for rank_results in results:
            row = []
            for r in rank_results:
                if isinstance(r.storage_data, _Checksummed):
                    entries[entry_key(r.index.fqn, r.index.offset)] = {
                        "checksum": r.storage_data.checksum, "nbytes": r.storage_data.nbytes,
                        "file": r.storage_data.info.relative_path}
                    r = dataclasses.replace(r, storage_data=r.storage_data.info)
                row.append(r)
            plain.append(row)
        try:
            write_checksums(os.fspath(self.path), entries, sync=self.sync_files)
        except OSError as err:
            raise CheckpointError("writing the checkpoint failed: "
                                  + os_error_text(err, err.filename or os.path.join(self.path, CHECKSUMS_FILE))) from None
        try:
            super().finish(metadata, plain)
        except Exception as err:  # noqa: BLE001
            named = self._named(err)
            if named is err:
                raise
            raise named from err


def describe_dcp_failure(err: CheckpointException) -> str:
    """The message of each rank's exception inside DCP's ``CheckpointException`` (no tracebacks)."""
    parts = []
    for rank, failure in sorted(err.failures.items()):
        exc = failure[0] if isinstance(failure, tuple) else failure
        text = str(exc).strip() if isinstance(exc, CheckpointError) else f"{type(exc).__name__}: {str(exc).strip()[:500]}"
        parts.append(f"rank {rank}: {text}")
    return "; ".join(parts) or "DCP reported a failure without details"


def dcp_failure_class(err: CheckpointException) -> type[CheckpointError]:
    """:class:`UnsafeCheckpointError` when that is what every failing rank raised, else :class:`CheckpointError`."""
    kinds = {type(f[0] if isinstance(f, tuple) else f) for f in err.failures.values()}
    return UnsafeCheckpointError if kinds == {UnsafeCheckpointError} else CheckpointError


def checkpoint_error_of(err: CheckpointException) -> CheckpointError:
    """The :class:`CheckpointError` to raise for DCP's ``CheckpointException`` ``err`` (the same on
    every rank): each rank's message, and the unsafe kind where every failing rank refused unsafe
    input. It names the ranks itself, so ``agree()`` adds no rank list of its own.

    Example:
        >>> try:
        ...     dcp.load(state, storage_reader=reader)
        ... except CheckpointException as err:
        ...     raise checkpoint_error_of(err) from None
    """
    error = dcp_failure_class(err)(describe_dcp_failure(err))
    error.names_ranks = True  # "rank 1: ...": agree() adds no rank list of its own
    return error
