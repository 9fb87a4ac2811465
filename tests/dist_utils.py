"""Multi-process test harness: one pool of real ranks per world size, kept for the session.

Why not torch's ``MultiProcContinuousTest``: we want pytest parametrization over recipes and world
sizes sharing one pool per world size across modules, fail-fast (a failing rank tears the pool down
after a short grace period instead of leaving the others waiting for the group timeout), and the
same runner over NCCL on a GPU (``DTENSOR_FP8_TEST_BACKEND=nccl``). Ranks are real processes with a
real process group (gloo on CPU, NCCL on CUDA).
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

import torch
import torch.distributed as dist

BACKEND = os.environ.get("DTENSOR_FP8_TEST_BACKEND", "gloo")
DEVICE = "cuda" if BACKEND == "nccl" else "cpu"
WORLD_SIZES = [int(w) for w in os.environ.get("DTENSOR_FP8_TEST_WORLD_SIZES", "2,4").split(",")]
GROUP_TIMEOUT_S = 45
GRACE_S = 3


def _worker(rank: int, world_size: int, store_path: str, tasks, results) -> None:
    # Warnings that mean silent corruption in FSDP2 fail the test that triggers them.
    warnings.filterwarnings("error", message=".*was resized.*")
    if DEVICE == "cuda":
        torch.cuda.set_device(rank)
    store = dist.FileStore(store_path, world_size)
    dist.init_process_group(BACKEND, rank=rank, world_size=world_size, store=store,
                            timeout=timedelta(seconds=GROUP_TIMEOUT_S))
    clean = True
    while True:
        item = tasks.get()
        if item is None:
            break
        fn, args = item
        try:
            torch.manual_seed(1234)
            results.put((rank, "ok", fn(*args)))
        except BaseException:  # noqa: BLE001  (sent back to the test)
            clean = False
            results.put((rank, "err", traceback.format_exc()))
    if clean:
        dist.barrier()  # barrier-then-destroy avoids an occasional SIGABRT at exit
        dist.destroy_process_group()


class RankPool:
    """``world_size`` processes in one process group; ``run(fn, *args)`` runs ``fn`` on every rank."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        ctx = mp.get_context("spawn")
        fd, self._store = tempfile.mkstemp(prefix="dtensor_fp8_store_")
        os.close(fd)
        os.unlink(self._store)
        self._tasks = [ctx.Queue() for _ in range(world_size)]
        self._results = ctx.Queue()
        self._procs = [
            ctx.Process(target=_worker, args=(r, world_size, self._store, self._tasks[r], self._results), daemon=True)
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
            (results if status == "ok" else errors)[rank] = value
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

    def __init__(self):
        self._pools: dict[int, RankPool] = {}

    def __getitem__(self, world_size: int) -> RankPool:
        pool = self._pools.get(world_size)
        if pool is not None and pool.alive and pool.runs >= self.MAX_RUNS:
            pool.close()
        if pool is None or not pool.alive:
            pool = self._pools[world_size] = RankPool(world_size)
        return pool

    def close(self):
        for pool in self._pools.values():
            pool.close()


# The byte counter lives in the package (the example and benchmarks use it too).
from dtensor_fp8.comm import CollectiveBytes  # noqa: E402,F401
