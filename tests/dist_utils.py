"""Multi-process test harness: one pool of real ranks per world size, kept for the session.

Why not torch's ``MultiProcContinuousTest``: we want pytest parametrization over recipes and world
sizes sharing one pool per world size across modules, fail-fast (a failing rank tears the pool down
after a short grace period instead of leaving the others waiting for the group timeout), and the
same runner on a GPU. Ranks are real processes with a real process group; ``DTENSOR_FP8_TEST_BACKEND``
picks it (see :data:`BACKENDS`):

* ``gloo`` (default): CPU tensors;
* ``nccl``: one GPU per rank (``cuda:<rank>``; NCCL refuses two ranks on one device);
* ``gloo-cuda``: CUDA tensors, every rank on ``cuda:0``, over gloo (``"cpu:gloo,cuda:gloo"``) -- real
  shards at world sizes 2 and 4 on a single GPU. A correctness harness, not a speed one: gloo stages
  CUDA tensors through the host.

``DTENSOR_FP8_TEST_WORLD_SIZES`` (default ``2,4``) lists the world sizes the suite runs.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import tempfile
import time
import traceback
import warnings
from datetime import timedelta
from multiprocessing.reduction import ForkingPickler
from typing import NamedTuple

import torch
import torch.distributed as dist


class RankBackend(NamedTuple):
    """How the ranks of a pool talk and where their tensors live."""

    process_group: str  # the ``backend`` argument of ``init_process_group``
    device: str  # device type of the ranks' tensors and meshes
    gpu_per_rank: bool  # rank r on cuda:r (else every rank on cuda:0)


BACKENDS = {
    "gloo": RankBackend("gloo", "cpu", False),
    "nccl": RankBackend("nccl", "cuda", True),
    # Several ranks share cuda:0: gloo moves CUDA tensors (through the host); a "cpu:gloo" half
    # serves CPU tensors (DCP's object collectives, barriers).
    "gloo-cuda": RankBackend("cpu:gloo,cuda:gloo", "cuda", False),
}


def backend_spec(name: str) -> RankBackend:
    """The :class:`RankBackend` named by ``DTENSOR_FP8_TEST_BACKEND``, with a clear error otherwise."""
    try:
        return BACKENDS[name]
    except KeyError:
        raise ValueError(f"DTENSOR_FP8_TEST_BACKEND={name!r} is not a test backend; use one of "
                         f"{sorted(BACKENDS)} (default gloo)") from None


BACKEND = os.environ.get("DTENSOR_FP8_TEST_BACKEND", "gloo")
#: device type of the distributed suite's tensors: build test inputs with ``device=DEVICE``
DEVICE = backend_spec(BACKEND).device
WORLD_SIZES = [int(w) for w in os.environ.get("DTENSOR_FP8_TEST_WORLD_SIZES", "2,4").split(",")]
GROUP_TIMEOUT_S = 45
GRACE_S = 3


def _worker(rank: int, world_size: int, store_path: str, tasks, results, backend: str) -> None:
    # Warnings that mean silent corruption in FSDP2 fail the test that triggers them.
    warnings.filterwarnings("error", message=".*was resized.*")
    spec = backend_spec(backend)
    if spec.device == "cuda":
        torch.cuda.set_device(rank if spec.gpu_per_rank else 0)
    store = dist.FileStore(store_path, world_size)
    dist.init_process_group(spec.process_group, rank=rank, world_size=world_size, store=store,
                            timeout=timedelta(seconds=GROUP_TIMEOUT_S))
    clean = True
    parent = os.getppid()
    while True:
        try:
            item = tasks.get(timeout=5)
        except queue.Empty:
            if os.getppid() != parent:  # the test process is gone (killed): do not linger
                os._exit(1)
            continue
        if item is None:
            break
        fn, args = item
        try:
            torch.manual_seed(1234)
            # Pickled here, as the queue's feeder thread would: a result that cannot cross the process
            # boundary (e.g. a tensor that requires grad) fails this task now instead of never arriving.
            results.put((rank, "ok", bytes(ForkingPickler.dumps(fn(*args)))))
        except BaseException:  # noqa: BLE001  (sent back to the test)
            clean = False
            results.put((rank, "err", traceback.format_exc()))
    if clean:
        dist.barrier()  # barrier-then-destroy avoids an occasional SIGABRT at exit
        dist.destroy_process_group()


class RankPool:
    """``world_size`` processes in one process group; ``run(fn, *args)`` runs ``fn`` on every rank.

    Args:
        world_size: number of ranks.
        backend: a key of :data:`BACKENDS` (default: ``DTENSOR_FP8_TEST_BACKEND``).
    """

    def __init__(self, world_size: int, backend: str = BACKEND):
        spec = backend_spec(backend)
        if spec.device == "cuda" and not torch.cuda.is_available():
            raise RuntimeError(f"test backend {backend!r} runs ranks on CUDA, and no CUDA device is visible")
        if spec.gpu_per_rank and world_size > torch.cuda.device_count():
            raise RuntimeError(f"test backend {backend!r} needs one GPU per rank: {world_size} ranks, "
                               f"{torch.cuda.device_count()} GPU(s); use DTENSOR_FP8_TEST_BACKEND=gloo-cuda "
                               "(several ranks on one GPU) or DTENSOR_FP8_TEST_WORLD_SIZES=1")
        self.world_size = world_size
        self.backend = backend
        ctx = mp.get_context("spawn")
        fd, self._store = tempfile.mkstemp(prefix="dtensor_fp8_store_")
        os.close(fd)
        os.unlink(self._store)
        self._tasks = [ctx.Queue() for _ in range(world_size)]
        self._results = ctx.Queue()
        self._procs = [
            ctx.Process(target=_worker, args=(r, world_size, self._store, self._tasks[r], self._results, backend),
                       daemon=True)
            for r in range(world_size)
        ]
        for p in self._procs:
            p.start()
        self.alive = True
        self.runs = 0

    def run(self, fn, *args, timeout: float = 240.0) -> list:
        """Run ``fn(*args)`` on every rank; return the per-rank results or raise the ranks' errors."""
        assert self.alive, "pool was torn down after an earlier failure"
        self.runs += 1
        for q in self._tasks:
            q.put((fn, args))
        results, errors = {}, {}
        deadline = time.monotonic() + timeout
        while len(results) + len(errors) < self.world_size:
            wait = deadline - time.monotonic()
            if errors:
                wait = min(wait, GRACE_S)
            try:
                rank, status, value = self._results.get(timeout=max(wait, 0.01))
            except queue.Empty:
                break
            if status == "ok":
                results[rank] = ForkingPickler.loads(value)
            else:
                errors[rank] = value
        if errors or len(results) < self.world_size:
            self.close(kill=True)
            missing = sorted(set(range(self.world_size)) - set(results) - set(errors))
            msg = "".join(f"\n--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
            raise AssertionError(f"{fn.__name__} failed on ranks {sorted(errors)}; no answer from {missing}{msg}")
        return [results[r] for r in range(self.world_size)]

    def close(self, kill: bool = False) -> None:
        if not self.alive:
            return
        self.alive = False
        if not kill:
            for q in self._tasks:
                q.put(None)
            for p in self._procs:
                p.join(timeout=30)
        for p in self._procs:
            if p.is_alive():
                p.kill()
        if os.path.exists(self._store):
            os.unlink(self._store)


class Pools:
    """One :class:`RankPool` per world size, replaced after a failure and every ``MAX_RUNS`` runs:
    each test builds its own meshes, and on a multi-dim mesh every ``init_device_mesh`` creates new
    gloo subgroups (sockets and threads) that live as long as the process, so a long-lived rank
    accumulates hundreds of them; fresh processes keep that bounded."""

    MAX_RUNS = 25

    def __init__(self, backend: str = BACKEND):
        self.backend = backend
        self._pools: dict[int, RankPool] = {}

    def __getitem__(self, world_size: int) -> RankPool:
        pool = self._pools.get(world_size)
        if pool is not None and pool.alive and pool.runs >= self.MAX_RUNS:
            pool.close()
        if pool is None or not pool.alive:
            pool = self._pools[world_size] = RankPool(world_size, self.backend)
        return pool

    def close(self):
        for pool in self._pools.values():
            pool.close()


# The byte counter lives in the package (the example and benchmarks use it too).
from dtensor_fp8.comm import CollectiveBytes  # noqa: E402,F401
