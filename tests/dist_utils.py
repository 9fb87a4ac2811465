"""Multi-process test harness: one pool of real ranks per world size, kept for the session.

Why not torch's ``MultiProcContinuousTest``: we want pytest parametrization over recipes and world
sizes sharing one pool per world size across modules, fail-fast (a failing rank tears the pool down
after a short grace period instead of leaving the others waiting for the group timeout), and the
same runner on a GPU. Ranks are real processes with a real process group; ``DTENSOR_FP8_TEST_BACKEND``
picks it (see :data:`BACKENDS`):

* ``gloo`` (default): CPU tensors;
* ``nccl``: one GPU per rank (``cuda:<rank>``; NCCL refuses two ranks on one device);
* ``gloo-cuda``: CUDA tensors, every rank on ``cuda:0`` -- real shards at world sizes 2 and 4 on a
  single GPU -- over ``gloo_staged`` (tests/staging_backend.py): each collective copies its tensors
  to the host and runs on a real CPU gloo group (CUDA tensors straight into gloo make functional
  collectives segfault on torch 2.11; see the note there). A correctness harness, not a speed one;
* ``gloo-staged``: CPU tensors over that same staging backend, to check it without a GPU.

Environment (all optional):

* ``DTENSOR_FP8_TEST_WORLD_SIZES`` (default ``2,4``): the world sizes the suite runs;
* ``DTENSOR_FP8_TEST_TASK_TIMEOUT`` (s, default 240): how long ``RankPool.run`` waits for the ranks;
* ``DTENSOR_FP8_TEST_STARTUP_TIMEOUT`` (s, default 180): how long a new pool may take to start
  (import torch, create the CUDA context, ``init_process_group``);
* ``DTENSOR_FP8_TEST_GROUP_TIMEOUT`` (s, default 45): the process groups' collective timeout;
* ``DTENSOR_FP8_TEST_LOG_DIR``: keep every rank's log there (else a temporary folder, removed at
  the end of the session).

[Note: what a failed or hung task reports]
Each rank writes its stdout and stderr (Python and C++) to its own log file, with a line per task
started and finished, and ``faulthandler`` armed: a fatal signal (SIGSEGV, SIGBUS, SIGABRT, ...)
writes every thread's Python stack there, and so does SIGUSR1. ``run`` waits in one-second steps
and checks that every rank that has not answered is still alive, so a rank that dies is reported
at once (exit code or signal), not after the timeout. When the ranks' errors are in, or a rank
died, or the task timed out, the ranks that have not answered get SIGUSR1, and the error names, per
rank, what it did (answered / raised / died / no answer) with the tail of its log (traceback or
stacks); then the pool is killed and the next ``Pools[w]`` starts a fresh one. Anything that
interrupts ``run`` in the test process (pytest-timeout, SIGTERM, Ctrl-C) kills the pool too, so no
rank is left running a task whose result the next test would read (results carry a task id).
"""

from __future__ import annotations

import faulthandler
import io
import itertools
import multiprocessing as mp
import os
import queue
import signal
import sys
import tempfile
import time
import traceback
import warnings
import weakref
from datetime import timedelta
from typing import NamedTuple

import torch
import torch.distributed as dist

import gloo_one_worker
import rank_logs
import staging_backend


class RankBackend(NamedTuple):
    """How the ranks of a pool talk and where their tensors live."""

    process_group: str  # the ``backend`` argument of ``init_process_group``
    device: str  # device type of the ranks' tensors and meshes
    gpu_per_rank: bool  # rank r on cuda:r (else every rank on cuda:0)


BACKENDS = {
    # Real gloo with one worker thread per group (tests/gloo_one_worker.py says why).
    "gloo": RankBackend(gloo_one_worker.NAME, "cpu", False),
    "nccl": RankBackend("nccl", "cuda", True),
    # Several ranks share cuda:0; every tensor, CUDA or CPU, is staged through host memory over
    # a real CPU gloo group (tests/staging_backend.py).
    "gloo-cuda": RankBackend(staging_backend.NAME, "cuda", False),
    "gloo-staged": RankBackend(staging_backend.NAME, "cpu", False),
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
GROUP_TIMEOUT_S = float(os.environ.get("DTENSOR_FP8_TEST_GROUP_TIMEOUT", "45"))
TASK_TIMEOUT_S = float(os.environ.get("DTENSOR_FP8_TEST_TASK_TIMEOUT", "240"))
STARTUP_TIMEOUT_S = float(os.environ.get("DTENSOR_FP8_TEST_STARTUP_TIMEOUT", "180"))
GRACE_S = 3  # how long the other ranks may still answer once one has failed


def _to_host(obj):
    """``obj`` with every plain tensor (or tensor subclass other than DTensor) moved to the CPU:
    results cross the process boundary as bytes, never as CUDA IPC handles (which would create a
    CUDA context in the test process and tie the ranks' memory to it)."""
    if isinstance(obj, torch.Tensor):
        from torch.distributed.tensor import DTensor

        return obj.cpu() if obj.device.type != "cpu" and not isinstance(obj, DTensor) else obj
    if type(obj) is dict:
        return {k: _to_host(v) for k, v in obj.items()}
    if type(obj) in (list, tuple):
        return type(obj)(_to_host(v) for v in obj)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(_to_host(v) for v in obj))
    return obj


def _dumps(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _loads(data: bytes):
    return torch.load(io.BytesIO(data), weights_only=False)  # our own ranks' results


def _die_with_parent() -> None:
    """Linux: the kernel kills this rank when the test process dies (SIGKILL included), even if the
    rank is stuck in a collective or a CUDA call; elsewhere the task loop's check below does it."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _worker(rank: int, world_size: int, store_path: str, tasks, results, backend: str, log_path: str) -> None:
    # Everything this rank prints, Python or C++ (gloo, CUDA, TE), goes to its own log; fatal signals
    # and SIGUSR1 write every thread's stack there (see [Note: what a failed or hung task reports]).
    log = open(log_path, "a", buffering=1)  # noqa: SIM115  (open for the process's life)
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    sys.stdout = sys.stderr = log
    faulthandler.enable(file=log, all_threads=True)
    faulthandler.register(signal.SIGUSR1, file=log, all_threads=True)
    # `timeout` signals its whole process group, ranks included: each writes its stacks, then dies.
    faulthandler.register(signal.SIGTERM, file=log, all_threads=True, chain=True)
    parent = os.getppid()
    _die_with_parent()
    t0 = time.monotonic()

    def note(msg: str) -> None:
        log.write(f"[{time.strftime('%H:%M:%S')} rank {rank}/{world_size} pid {os.getpid()} +{time.monotonic() - t0:.1f}s] {msg}\n")

    note(f"start: backend {backend}")
    # Warnings that mean silent corruption in FSDP2 fail the test that triggers them.
    warnings.filterwarnings("error", message=".*was resized.*")
    try:
        spec = backend_spec(backend)
        if spec.device == "cuda":
            torch.cuda.set_device(rank if spec.gpu_per_rank else 0)
            torch.empty(1, device="cuda")  # the CUDA context now: start-up, not the first task, pays it
        if spec.process_group == staging_backend.NAME:
            staging_backend.register(spec.device)
        if spec.process_group == gloo_one_worker.NAME:
            gloo_one_worker.register()
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group(spec.process_group, rank=rank, world_size=world_size, store=store,
                                timeout=timedelta(seconds=GROUP_TIMEOUT_S))
        import dtensor_fp8  # noqa: F401  (every task imports it)

        if spec.device == "cuda":
            # TE (dtensor_fp8's CUDA fast path) imports on the first CUDA requantization, seconds per
            # rank: here it is part of a start-up that overlaps other pools' work (see Pools).
            from dtensor_fp8.formats import te_kernels

            te_kernels._te()
    except BaseException:  # noqa: BLE001  (sent back to the test)
        tb = traceback.format_exc()
        note(f"start-up failed:\n{tb}")
        results.put((rank, "startup-err", None, tb))
        return
    note("ready")
    results.put((rank, "ready", None, None))
    clean = True
    while True:
        try:
            item = tasks.get(timeout=5)
        except queue.Empty:
            if os.getppid() != parent:  # the test process is gone (killed): do not linger
                note("test process gone: exiting")
                os._exit(1)
            continue
        if item is None:
            break
        if item[0] == "import":  # warm-up of a spare pool: the modules of the tasks run so far
            for name in item[1]:
                try:
                    __import__(name)
                except Exception:  # noqa: BLE001  (the task that needs it will report it)
                    note(f"preload of {name} failed:\n{traceback.format_exc()}")
            continue
        task_id, fn, args = item
        note(f"task {task_id} {fn.__module__}.{fn.__name__}: start")
        started = time.monotonic()
        try:
            torch.manual_seed(1234)
            # Serialized here, not by the queue's feeder thread: a result that cannot cross the process
            # boundary fails this task now instead of never arriving. torch.save, not the queue's
            # ForkingPickler: tensors travel as bytes in the message (ForkingPickler moves them to
            # /dev/shm segments whose file descriptors the test process must fetch from this process
            # through a socket, with no timeout, and sends CUDA tensors as IPC handles).
            payload = _dumps(_to_host(fn(*args)))
            results.put((rank, "ok", task_id, payload))
            note(f"task {task_id}: ok in {time.monotonic() - started:.1f}s")
        except BaseException:  # noqa: BLE001  (sent back to the test)
            clean = False
            tb = traceback.format_exc()
            note(f"task {task_id}: raised after {time.monotonic() - started:.1f}s\n{tb}")
            results.put((rank, "err", task_id, tb))
    note("closing")
    if clean:
        dist.barrier()  # barrier-then-destroy avoids an occasional SIGABRT at exit
        dist.destroy_process_group()
    note("closed")


def _exit_reason(code: int | None) -> str:
    if code is None:
        return "alive"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


_POOL_SERIAL = itertools.count()
_TASK_IDS = itertools.count(1)
#: every pool whose ranks may be running (for the SIGTERM handler)
LIVE_POOLS: weakref.WeakSet = weakref.WeakSet()


class RankPool:
    """``world_size`` processes in one process group; ``run(fn, *args)`` runs ``fn`` on every rank.

    Start-up (spawn, CUDA context, ``init_process_group``) runs in the background: the first
    ``run`` waits for it. See [Note: what a failed or hung task reports].

    Args:
        world_size: number of ranks.
        backend: a key of :data:`BACKENDS` (default: ``DTENSOR_FP8_TEST_BACKEND``).
        modules: a dict in which ``run`` records each task's module (see :class:`Pools`).

    Example:
        >>> pool = RankPool(2)
        >>> pool.run(torch.distributed.get_rank)
        [0, 1]
    """

    def __init__(self, world_size: int, backend: str = BACKEND, modules: dict | None = None):
        spec = backend_spec(backend)
        if spec.device == "cuda" and not torch.cuda.is_available():
            raise RuntimeError(f"test backend {backend!r} runs ranks on CUDA, and no CUDA device is visible")
        if spec.gpu_per_rank and world_size > torch.cuda.device_count():
            raise RuntimeError(f"test backend {backend!r} needs one GPU per rank: {world_size} ranks, "
                               f"{torch.cuda.device_count()} GPU(s); use DTENSOR_FP8_TEST_BACKEND=gloo-cuda "
                               "(several ranks on one GPU) or DTENSOR_FP8_TEST_WORLD_SIZES=1")
        self.world_size = world_size
        self.backend = backend
        self._modules = modules
        self.name = f"{backend}-w{world_size}-pid{os.getpid()}-p{next(_POOL_SERIAL)}"
        ctx = mp.get_context("spawn")
        fd, self._store = tempfile.mkstemp(prefix="dtensor_fp8_store_")
        os.close(fd)
        os.unlink(self._store)
        self.logs = [os.path.join(rank_logs.log_dir(), f"{self.name}-rank{r}.log") for r in range(world_size)]
        self._tasks = [ctx.Queue() for _ in range(world_size)]
        self._results = ctx.Queue()
        self._procs = [
            ctx.Process(target=_worker, name=f"{self.name}-rank{r}",
                        args=(r, world_size, self._store, self._tasks[r], self._results, backend, self.logs[r]),
                        daemon=True)
            for r in range(world_size)
        ]
        self._started_at = time.monotonic()
        for p in self._procs:
            p.start()
        self._ready: set[int] = set()
        self.alive = True
        self.runs = 0
        LIVE_POOLS.add(self)

    @property
    def pids(self) -> list[int | None]:
        return [p.pid for p in self._procs]

    # -- waiting -------------------------------------------------------------------------------------
    def _dead(self, ranks) -> dict[int, str]:
        return {r: _exit_reason(self._procs[r].exitcode) for r in ranks if self._procs[r].exitcode is not None}

    def _fail(self, what: str, status: dict[int, str], dump: list[int], tracebacks: dict[int, str] | None = None):
        """Stacks of the ranks in ``dump``, an error naming every rank's state, with its traceback
        (a rank that raised) or the tail of its log (stacks of a rank that hung or died), the
        pool killed."""
        tracebacks = tracebacks or {}
        self.dump_stacks(dump)
        lines = [f"{what} (pool {self.name}, pids {self.pids}):"]
        for r in range(self.world_size):
            state = status.get(r, "answered")
            if r in tracebacks:
                state += ": " + (tracebacks[r].strip().splitlines() or ["?"])[-1]
            lines.append(f"  rank {r}: {state}")
        for r in sorted(status):
            if r in tracebacks:
                lines.append(f"--- rank {r} ({status[r]}), traceback (log: {self.logs[r]}) ---\n{tracebacks[r]}")
            else:
                lines.append(f"--- rank {r} ({status[r]}), log {self.logs[r]} (tail) ---\n{rank_logs.tail(self.logs[r])}")
        self.close(kill=True)
        raise AssertionError("\n".join(lines))

    def dump_stacks(self, ranks=None, wait: bool = True) -> list[int]:
        """SIGUSR1 to the live ranks in ``ranks`` (default all): each writes every thread's stack to
        its log; waits up to ``rank_logs.DUMP_WAIT_S`` for them (``wait``). Returns the ranks
        signalled."""
        ranks = range(self.world_size) if ranks is None else ranks
        sizes = {}
        for r in ranks:
            p = self._procs[r]
            if p.exitcode is None and p.pid is not None:
                try:
                    sizes[r] = rank_logs.size(self.logs[r])
                    os.kill(p.pid, signal.SIGUSR1)
                except ProcessLookupError:
                    sizes.pop(r, None)
        if sizes and wait:
            rank_logs.await_growth({self.logs[r]: n for r, n in sizes.items()})
        return sorted(sizes)

    def _await_ready(self) -> None:
        deadline = self._started_at + STARTUP_TIMEOUT_S
        errors: dict[int, str] = {}  # rank -> traceback
        while len(self._ready) + len(errors) < self.world_size:
            try:
                rank, status, _, value = self._results.get(timeout=1.0)
            except queue.Empty:
                waiting = set(range(self.world_size)) - self._ready - set(errors)
                dead = self._dead(waiting)
                if dead or time.monotonic() > deadline:
                    status = {r: f"did not start: {why}" for r, why in dead.items()}
                    status.update({r: f"still starting after {STARTUP_TIMEOUT_S:.0f}s (stack in its log)"
                                   for r in waiting - set(dead)})
                    status.update({r: "start-up raised" for r in errors})
                    self._fail("rank pool failed to start", status, sorted(waiting - set(dead)), errors)
                continue
            if status == "ready":
                self._ready.add(rank)
            else:
                errors[rank] = value
        if errors:
            self._fail("rank pool failed to start", {r: "start-up raised" for r in errors}, [], errors)

    def run(self, fn, *args, timeout: float | None = None) -> list:
        """Run ``fn(*args)`` on every rank; return the per-rank results or raise the ranks' errors.

        Args:
            fn: a module-level function (pickled by reference).
            timeout: seconds to wait for all ranks (default ``DTENSOR_FP8_TEST_TASK_TIMEOUT``).
        """
        assert self.alive, "pool was torn down after an earlier failure"
        timeout = TASK_TIMEOUT_S if timeout is None else timeout
        if self._modules is not None:
            self._modules.setdefault(fn.__module__, None)
        completed = False
        try:
            if len(self._ready) < self.world_size:
                self._await_ready()
            self.runs += 1
            task_id = next(_TASK_IDS)
            for q in self._tasks:
                q.put((task_id, fn, args))
            out = self._collect(fn, task_id, timeout)
            completed = True
            return out
        finally:
            if not completed and self.alive:  # interrupted (pytest-timeout, SIGTERM, Ctrl-C)
                self.dump_stacks()
                sys.stderr.write(f"\n[dist_utils] {fn.__name__} interrupted: pool {self.name} killed; rank logs:\n"
                                 + "".join(f"--- rank {r}: {self.logs[r]} (tail) ---\n{rank_logs.tail(self.logs[r])}\n"
                                           for r in range(self.world_size)))
                self.close(kill=True)

    def _collect(self, fn, task_id: int, timeout: float) -> list:
        results, errors, tracebacks = {}, {}, {}
        deadline = time.monotonic() + timeout
        grace_end = None
        while len(results) + len(errors) < self.world_size:
            now = time.monotonic()
            if now > deadline or (grace_end is not None and now > grace_end):
                break
            try:
                rank, status, tid, value = self._results.get(timeout=1.0)
            except queue.Empty:
                dead = self._dead(set(range(self.world_size)) - set(results) - set(errors))
                for r, why in dead.items():
                    errors[r] = f"died during the task ({why}); a fatal signal's stacks are in its log"
                if dead and grace_end is None:
                    grace_end = time.monotonic() + GRACE_S
                continue
            if tid != task_id:  # cannot happen while every interrupted run kills its pool; be sure
                continue
            if status == "ok":
                results[rank] = _loads(value)
            else:
                errors[rank], tracebacks[rank] = "raised", value
                if grace_end is None:
                    grace_end = time.monotonic() + GRACE_S
        if errors or len(results) < self.world_size:
            silent = sorted(set(range(self.world_size)) - set(results) - set(errors))
            waited = "after the others failed" if errors else f"within {timeout:.0f}s"
            status = dict(errors)
            status.update({r: f"no answer {waited} (stacks at the end of its log)" for r in silent})
            self._fail(f"{fn.__name__} failed: raised or died on ranks {sorted(errors)}, no answer from {silent}",
                       status, silent, tracebacks)
        return [results[r] for r in range(self.world_size)]

    # -- shutting down ---------------------------------------------------------------------------------
    def preload(self, modules) -> None:
        """Import ``modules`` on every rank now (a spare pool warms up while another one works)."""
        for q in self._tasks:
            q.put(("import", tuple(modules)))

    def close(self, kill: bool = False) -> None:
        if not self.alive:
            return
        self.alive = False
        LIVE_POOLS.discard(self)
        if not kill:
            for q in self._tasks:
                q.put(None)
            deadline = time.monotonic() + 30
            for p in self._procs:
                p.join(timeout=max(0.1, deadline - time.monotonic()))
        for p in self._procs:
            if p.is_alive():
                p.kill()
        for p in self._procs:
            p.join(timeout=5)  # reap; a killed rank's CUDA context is gone once it has exited
        for q in [*self._tasks, self._results]:
            q.cancel_join_thread()  # never block the test process on a pipe that a dead rank no longer reads
            q.close()
        if os.path.exists(self._store):
            os.unlink(self._store)


class Pools:
    """One :class:`RankPool` per world size, replaced after a failure and every ``MAX_RUNS`` runs:
    each test builds its own meshes, and on a multi-dim mesh every ``init_device_mesh`` creates new
    gloo subgroups (sockets and threads) that live as long as the process, so a long-lived rank
    accumulates hundreds of them; fresh processes keep that bounded.

    Start-up costs seconds per pool (4 ranks each creating a CUDA context under ``gloo-cuda``), so
    it overlaps other work: the first pool requested starts the pools of the other
    :data:`WORLD_SIZES` too, and a replacement starts ``SPARE_AHEAD`` runs before its
    predecessor retires, importing the test modules run so far.
    """

    MAX_RUNS = 25
    SPARE_AHEAD = 3

    def __init__(self, backend: str = BACKEND, world_sizes=WORLD_SIZES):
        self.backend = backend
        self.world_sizes = list(world_sizes)
        self._pools: dict[int, RankPool] = {}
        self._spares: dict[int, RankPool] = {}
        self._modules: dict[str, None] = {}

    def _start(self, world_size: int) -> RankPool:
        spare = self._spares.pop(world_size, None)
        if spare is not None and spare.alive:
            return spare
        pool = RankPool(world_size, self.backend, self._modules)
        if self._modules:
            pool.preload(self._modules)
        return pool

    def __getitem__(self, world_size: int) -> RankPool:
        first = not self._pools
        pool = self._pools.get(world_size)
        if pool is not None and pool.alive and pool.runs >= self.MAX_RUNS:
            pool.close()
        if pool is None or not pool.alive:
            pool = self._pools[world_size] = self._start(world_size)
        if first:
            for w in self.world_sizes:
                if w != world_size and w > 1 and w not in self._pools:
                    try:
                        self._pools[w] = self._start(w)
                    except RuntimeError:  # e.g. too few GPUs for nccl: the test that asks for it says so
                        pass
        if pool.runs >= self.MAX_RUNS - self.SPARE_AHEAD and world_size not in self._spares:
            self._spares[world_size] = self._start(world_size)
        return pool

    def close(self):
        for pool in [*self._pools.values(), *self._spares.values()]:
            pool.close()
        rank_logs.cleanup()


# The byte counter lives in the package (the example and benchmarks use it too).
from dtensor_fp8.comm import CollectiveBytes  # noqa: E402,F401
