"""The rank-pool harness itself (tests/dist_utils.py): failures are reported at once and name what
every rank was doing; a pool that failed or was interrupted is never reused."""

import os
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

import dtensor_fp8 as d
import dist_utils
from dist_utils import DEVICE, WORLD_SIZES, RankPool

WORLD = WORLD_SIZES[0]
#: the tests that make rank 1 fail or hang need a second rank (the one-GPU NCCL suite has one)
needs_two = pytest.mark.skipif(WORLD < 2, reason=f"needs a second rank; DTENSOR_FP8_TEST_WORLD_SIZES starts at {WORLD}")


def _exit_on_rank_1():
    if dist.get_rank() == 1:
        os._exit(7)
    dist.barrier()  # rank 0 waits for rank 1, which is gone


def _sleep_on_rank_0(seconds):
    if dist.get_rank() == 0:
        time.sleep(seconds)
    return dist.get_rank()


def _rank_and_tensors():
    # Values inside E4M3's range: an overflow's NaN byte differs between CPU and CUDA casts.
    x = torch.arange(256 * 64, dtype=torch.float32, device=DEVICE).reshape(256, 64) / 64
    return dist.get_rank(), x.to(torch.float8_e4m3fn), d.quantize(x.bfloat16(), d.MXFP8())


def _fresh_pool_is_correct(pools):
    """The next ``pools[w]`` is a new pool whose results are this task's, in rank order."""
    assert [r[0] for r in pools[WORLD].run(_rank_and_tensors)] == list(range(WORLD))
    assert pools[WORLD].run(_sleep_on_rank_0, 0) == list(range(WORLD))


def test_results_are_host_tensors_bit_exact(pools):
    results = pools[WORLD].run(_rank_and_tensors)
    x = torch.arange(256 * 64, dtype=torch.float32).reshape(256, 64) / 64
    ref = d.quantize(x.bfloat16(), d.MXFP8())
    for rank, (r, fp8, q) in enumerate(results):
        assert r == rank and fp8.device.type == "cpu" and fp8.dtype == torch.float8_e4m3fn
        assert torch.equal(fp8.view(torch.uint8), x.to(torch.float8_e4m3fn).view(torch.uint8))
        assert isinstance(q, d.QuantizedTensor) and q.device.type == "cpu"
        for usage in ref.usages:
            assert torch.equal(q.plane(usage).data.view(torch.uint8), ref.plane(usage).data.view(torch.uint8))


def _gloo_worker_threads():
    """How many worker threads the gloo backend of each group a task may use has: the world, a
    DeviceMesh's sub-groups (what FSDP2, TP and pipelining run on), a new group."""
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    mesh = init_device_mesh(DEVICE, (world // 2, 2), mesh_dim_names=("pp", "dp")) if world % 2 == 0 else None
    groups = [dist.group.WORLD, dist.new_group(list(range(world)))]
    groups += [mesh.get_group(name) for name in ("pp", "dp")] if mesh is not None else []
    return [g._get_backend(torch.device("cpu")).options._threads for g in groups]


@pytest.mark.skipif(dist_utils.BACKEND == "nccl", reason="NCCL groups have no gloo worker threads")
def test_every_gloo_group_of_the_ranks_runs_one_worker_thread(pools):
    """tests/gloo_one_worker.py: gloo's two worker threads race on a heap string after each
    collective (the note there); every group the ranks build, sub-groups included, has one."""
    for threads in pools[WORLD].run(_gloo_worker_threads):
        assert threads and set(threads) == {1}, threads


@needs_two
def test_a_rank_that_dies_is_reported_at_once(pools):
    started = time.monotonic()
    with pytest.raises(AssertionError) as err:
        pools[WORLD].run(_exit_on_rank_1)
    msg = str(err.value)
    # Not the task timeout, nor the group timeout: the parent sees the exit within about a second.
    assert time.monotonic() - started < dist_utils.GROUP_TIMEOUT_S, msg
    assert "rank 1: died during the task (exited with code 7)" in msg, msg
    # Rank 0 either sees the connection close (gloo raises) or still waits: then its stack
    # (faulthandler, SIGUSR1) shows where.
    assert "rank 0: raised" in msg or ("rank 0: no answer after the others failed" in msg
                                       and "in _exit_on_rank_1" in msg), msg
    _fresh_pool_is_correct(pools)


@needs_two
def test_a_hung_task_times_out_with_the_ranks_stacks(pools):
    with pytest.raises(AssertionError) as err:
        pools[WORLD].run(_sleep_on_rank_0, 120, timeout=3)
    msg = str(err.value)
    assert "no answer from [0]" in msg and "rank 1: answered" in msg, msg
    assert "rank 0: no answer within 3s" in msg and "in _sleep_on_rank_0" in msg, msg
    _fresh_pool_is_correct(pools)


def test_an_interrupted_run_kills_its_pool(pools):
    """pytest-timeout's signal method (or SIGTERM) raises inside ``run``: the pool, whose rank 0
    is still busy with the task, must not serve the next test."""

    class Interrupted(Exception):
        pass

    def interrupt(signum, frame):
        raise Interrupted

    pool = pools[WORLD]
    pool.run(_sleep_on_rank_0, 0)  # started, so that the alarm hits the task, not the start-up
    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 1.0)
        with pytest.raises(Interrupted):
            pool.run(_sleep_on_rank_0, 120)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert not pool.alive
    _fresh_pool_is_correct(pools)


def test_a_pool_that_cannot_start_says_why(monkeypatch):
    # A backend the test process knows and the ranks do not: every rank's start-up raises.
    monkeypatch.setitem(dist_utils.BACKENDS, "unknown-to-ranks", dist_utils.RankBackend("gloo", "cpu", False))
    pool = RankPool(2, "unknown-to-ranks")
    with pytest.raises(AssertionError) as err:
        pool.run(_sleep_on_rank_0, 0)
    msg = str(err.value)
    assert "rank pool failed to start" in msg and "is not a test backend" in msg, msg
    assert not pool.alive


_HANGING_SESSION = '''
import time
def _sleep(seconds):
    print("_sleep: sleeping", flush=True)
    time.sleep(seconds)
def test_passes():
    pass
def test_hangs(pools):
    pools[2].run(_sleep, 600)
'''
_SESSION_CONFTEST = '''
import sys
sys.path.insert(0, {tests!r})
import pytest
import dist_utils, rank_logs
def pytest_configure(config):
    rank_logs.install_sigterm_report(dist_utils.LIVE_POOLS, config)
@pytest.fixture
def pools():
    p = dist_utils.Pools(world_sizes=[2])
    yield p
    p.close()
'''


@needs_two
def test_a_session_killed_by_sigterm_reports_stacks_and_its_summary(tmp_path):
    """What `timeout` does to a hung session (SIGTERM to its process group): every rank's stacks and
    the test process's in sigterm-<pid>.txt and on stderr, then pytest's own summary."""
    tests = os.path.dirname(os.path.abspath(__file__))
    (tmp_path / "test_hang.py").write_text(_HANGING_SESSION)
    (tmp_path / "conftest.py").write_text(_SESSION_CONFTEST.format(tests=tests))
    logs = tmp_path / "logs"
    env = {**os.environ, "DTENSOR_FP8_TEST_LOG_DIR": str(logs), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", str(tmp_path)],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        # Both ranks inside _sleep (its own line: the task's "start" line comes before the rank's
        # per-task seeding, so a loaded machine could take the stacks before the sleep began).
        while sum("_sleep: sleeping" in p.read_text() for p in logs.glob("*-rank*.log")) < 2:
            assert proc.poll() is None and time.monotonic() < deadline, "the session did not reach its task"
            time.sleep(0.5)
        os.killpg(proc.pid, signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 2, out  # pytest's code for an interrupted session
    assert "KeyboardInterrupt: SIGTERM" in out and "1 passed" in out, out
    report = next(logs.glob("sigterm-*.txt")).read_text()
    assert "in test_hangs" in report, report  # the test process's stack
    # Both ranks' stacks, each in its own log's tail. A rank may have written its stack twice: the
    # process-group SIGTERM reaches it as well as the report's SIGUSR1, in either order.
    rank_tails = [section for section in report.split("--- ")[1:] if "-rank" in section.split("\n", 1)[0]]
    assert len(rank_tails) == 2, report
    assert all("in _sleep" in section for section in rank_tails), report
    assert "in test_hangs" in out and "in _sleep" in out, out  # on stderr too


def _every_collective(device):
    """Each collective kind the suite issues (c10d and functional), on seeded per-rank inputs;
    returns the results (as host tensors) and what the staging kernels counted in this rank."""
    import torch.distributed._functional_collectives as funcol

    import staging_backend

    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    gen = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(4 * world, 3, generator=gen).to(device=device, dtype=torch.bfloat16)
    u8 = torch.randint(0, 256, (2 * world, 5), generator=gen, dtype=torch.uint8).to(device)
    out = {}
    gathered = [torch.empty_like(u8) for _ in range(world)]
    dist.all_gather(gathered, u8)
    out["all_gather"] = torch.cat(gathered)
    flat = torch.empty(world * u8.shape[0], 5, dtype=torch.uint8, device=device)
    dist.all_gather_into_tensor(flat, u8)
    out["all_gather_into_tensor"] = flat
    out["funcol_all_gather"] = funcol.all_gather_tensor(x, 0, group).wait()
    out["funcol_all_gather_coalesced"] = torch.cat([t.wait() for t in funcol.all_gather_into_tensor_coalesced([x, x + 1], group)])
    for op in (dist.ReduceOp.SUM, dist.ReduceOp.MAX):
        y = x.clone()
        dist.all_reduce(y, op=op)
        out[f"all_reduce_{op}"] = y
    out["funcol_all_reduce"] = funcol.all_reduce(x, "sum", group).wait()
    rs = torch.empty(4, 3, dtype=x.dtype, device=device)
    dist.reduce_scatter_tensor(rs, x)
    out["reduce_scatter_tensor"] = rs
    out["funcol_reduce_scatter"] = funcol.reduce_scatter_tensor(x, "sum", 0, group).wait()
    out["funcol_reduce_scatter_coalesced"] = torch.cat(
        [t.wait() for t in funcol.reduce_scatter_tensor_coalesced([x, 2 * x], "sum", [0, 0], group)])
    b = x.clone()
    dist.broadcast(b, src=world - 1)
    out["broadcast"] = b
    a2a = torch.empty_like(u8)
    dist.all_to_all_single(a2a, u8)
    out["all_to_all_single"] = a2a
    out["funcol_all_to_all_single"] = funcol.all_to_all_single(x, None, None, group).wait()
    if rank == 0:
        dist.send(u8, 1)
    elif rank == 1:
        recv = torch.empty_like(u8)
        dist.recv(recv, 0)
        out["recv"] = recv
    if rank == 0:
        dist.send(x, 1)
    elif rank == 1:
        # torch.distributed.pipelining receives activations into leaves that require grad; a
        # native backend writes them outside autograd, so must the staging kernels.
        leaf = torch.empty_like(x, requires_grad=True)
        dist.recv(leaf, 0)
        out["recv_into_leaf_requiring_grad"] = leaf.detach()
    if rank < 2:
        # What a 1F1B pipeline does between two stages: each posts a send and a receive to the other
        # before waiting for either (a kernel that waits inside send or receive deadlocks here).
        peer = 1 - rank
        for send_first in (True, False):
            got = torch.empty_like(x, requires_grad=True)
            ops = [dist.P2POp(dist.isend, x + rank, peer), dist.P2POp(dist.irecv, got, peer)]
            for work in dist.batch_isend_irecv(ops if send_first else ops[::-1]):
                work.wait()
            out[f"exchange_send_first_{send_first}"] = got.detach()
    objs = [None] * world
    dist.all_gather_object(objs, {"rank": rank})
    out["all_gather_object"] = objs
    dist.barrier()
    return _to_cpu(out), dict(staging_backend.STAGED)


def _to_cpu(obj):
    if isinstance(obj, torch.Tensor):
        return obj.cpu()
    return {k: _to_cpu(v) for k, v in obj.items()} if isinstance(obj, dict) else obj


def _staged_backends():
    return ["gloo-staged"] + (["gloo-cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("backend", _staged_backends())
def test_staged_backend_gives_the_bytes_plain_gloo_gives(backend):
    """tests/staging_backend.py: every collective kind, through the staging kernels (on CPU
    tensors, and on CUDA tensors where a GPU is visible), returns byte for byte what plain gloo
    returns on the CPU, and really went through the kernels (each op counted)."""
    device = dist_utils.BACKENDS[backend].device
    plain, staged = RankPool(2, "gloo"), RankPool(2, backend)
    try:
        want = plain.run(_every_collective, "cpu")
        got = staged.run(_every_collective, device)
    finally:
        plain.close()
        staged.close()
    for rank, ((ref, ref_counts), (res, counts)) in enumerate(zip(want, got)):
        assert ref_counts == {}, ref_counts  # plain gloo: no staging kernel installed
        assert res.keys() == ref.keys()
        for name, value in ref.items():
            if isinstance(value, torch.Tensor):
                assert res[name].dtype == value.dtype and res[name].device.type == "cpu", name
                assert torch.equal(res[name].view(torch.uint8), value.view(torch.uint8)), (rank, name)
            else:
                assert res[name] == value, (rank, name)
        ops = {op for op, dev in counts if dev == device}
        # A barrier moves no tensor data; torch 2.11 issues it on the group's CPU backend (unstaged
        # under gloo-cuda), so only gloo-staged (CPU) counts it at the staging kernels.
        barrier = ("barrier",) if device == "cpu" else ()
        for op in ("allgather_", "_allgather_base_", "allgather_into_tensor_coalesced_", "allreduce_",
                   "_reduce_scatter_base_", "reduce_scatter_tensor_coalesced_", "broadcast_", "alltoall_base_",
                   *barrier, "send" if rank == 0 else "recv_"):
            assert f"c10d::{op}" in ops, (rank, op, counts)
