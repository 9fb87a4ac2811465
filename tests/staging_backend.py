"""A c10d backend for the test harness that stages collectives through host memory over real gloo.

[Note: why the rank pools' CUDA tensors go through a host-staging backend]
``DTENSOR_FP8_TEST_BACKEND=gloo-cuda`` runs several ranks on one GPU (NCCL refuses two ranks on one
device). Over plain gloo (``"cpu:gloo,cuda:gloo"``) on the H200 (torch 2.11.0+cu130), c10d's own
collectives on CUDA tensors work (FSDP2's), but every *functional* collective on a CUDA tensor
segfaults inside ``torch.ops._c10d_functional.all_gather_into_tensor`` ("Fatal Python error:
Segmentation fault" from ``_functional_collectives.all_gather_tensor``: DTensor ``full_tensor()`` /
``redistribute``, dtensor_fp8/ops/collectives.py; the torch bug family of pytorch/pytorch#152645),
so most of the distributed suite could not run at world 2 and 4 there.

``gloo_staged`` keeps gloo and takes CUDA out of it. Its process groups are ordinary c10d groups
whose one backend, for both devices, is a real ``ProcessGroupGloo`` (one worker thread, as the
suite's CPU groups: tests/gloo_one_worker.py);
what changes is c10d's kernel of each collective op (``torch.ops.c10d.allgather_``,
``_allgather_base_``, ``allgather_into_tensor_coalesced_``, ``reduce_scatter_``, ``allreduce_``,
``alltoall_base_``, ``broadcast_``, ``send``, ``barrier``, ...) for the staged device: it copies
every tensor argument into a contiguous host tensor, runs the same collective on the group's gloo
backend with those host tensors, waits, copies the outputs back into the caller's tensors and
returns a completed Work (a send or receive returns at once, with a Work whose ``wait`` waits for
gloo and copies back: a pipeline posts both before waiting). Nothing is mocked or computed here:
every byte still crosses real gloo, reductions are gloo's. A correctness harness, not a speed one.

Why op kernels, not a Python ``ProcessGroup`` subclass (torch's test_c10d_pypg.py style): such a
group replaces the whole process group and takes c10d's ops out of the dispatcher, so tensor
subclasses (``QuantizedTensor`` refusing a ``src_data_rank=0`` scatter) and dispatch modes
(``dtensor_fp8.comm.CollectiveBytes``) would no longer see the collectives, and torch 2.11's
``PyProcessGroup`` trampoline has no ``_allgather_base`` to override. Every path reaches c10d's
ops' device kernels: the Python API (FSDP2, DCP) and the functional collectives (DTensor;
``Functional.cpp`` calls the same group methods), after subclasses and modes had their turn.

``DTENSOR_FP8_TEST_BACKEND=gloo-staged`` installs the same kernels for the ``cpu`` device: the CPU
suite then runs every collective through exactly the staging that ``gloo-cuda`` runs on the GPU.
"""

from __future__ import annotations

import collections
import warnings

import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as c10d

import gloo_one_worker

#: the backend name for ``init_process_group``
NAME = "gloo_staged"

def _reduce_op(script_op) -> c10d.ReduceOp:
    return c10d.ReduceOp(c10d.ReduceOp.RedOpType(script_op.op()))  # ops pass a TorchBind ReduceOp


def _opts(cls, **fields):
    opts = cls()
    for name, value in fields.items():
        setattr(opts, name, value)
    return opts


def _each(works) -> None:
    for work in works:
        work.wait()


#: c10d op -> (index of the argument it writes and returns beside its Work, or None; how it runs
#: on gloo, given the gloo backend and the op's arguments with every tensor on the host: it waits,
#: or returns the gloo Work it left running).
#: The tensor-list coalesced ops run as one gloo collective per tensor (gloo's Python backend
#: binds no coalesced all-gather / reduce-scatter into tensors); the bytes are the same.
RUNNERS = {
    "allgather_": (0, lambda be, a: be.allgather(a[0], a[1], c10d.AllgatherOptions()).wait()),
    "_allgather_base_": (0, lambda be, a: be._allgather_base(a[0], a[1], c10d.AllgatherOptions()).wait()),
    "allgather_coalesced_": (0, lambda be, a: be.allgather_coalesced(a[0], a[1], c10d.AllgatherOptions()).wait()),
    "allgather_into_tensor_coalesced_": (
        0, lambda be, a: _each([be._allgather_base(o, i, c10d.AllgatherOptions()) for o, i in zip(a[0], a[1])])),
    "gather_": (0, lambda be, a: be.gather(a[0], a[1], _opts(c10d.GatherOptions, rootRank=a[3])).wait()),
    "allreduce_": (0, lambda be, a: be.allreduce(a[0], _opts(c10d.AllreduceOptions, reduceOp=_reduce_op(a[2]))).wait()),
    "allreduce_coalesced_": (
        0, lambda be, a: be.allreduce_coalesced(a[0], _opts(c10d.AllreduceCoalescedOptions,
                                                           reduceOp=_reduce_op(a[2]))).wait()),
    "reduce_": (0, lambda be, a: be.reduce(a[0], _opts(c10d.ReduceOptions, reduceOp=_reduce_op(a[2]), rootRank=a[3],
                                                       rootTensor=a[4])).wait()),
    "reduce_scatter_": (
        0, lambda be, a: be.reduce_scatter(a[0], a[1], _opts(c10d.ReduceScatterOptions,
                                                            reduceOp=_reduce_op(a[3]))).wait()),
    "_reduce_scatter_base_": (
        0, lambda be, a: be._reduce_scatter_base(a[0], a[1], _opts(c10d.ReduceScatterOptions,
                                                                  reduceOp=_reduce_op(a[3]))).wait()),
    "reduce_scatter_tensor_coalesced_": (
        0, lambda be, a: _each([be._reduce_scatter_base(o, i, _opts(c10d.ReduceScatterOptions, reduceOp=_reduce_op(a[3])))
                                for o, i in zip(a[0], a[1])])),
    "broadcast_": (0, lambda be, a: be.broadcast(a[0], _opts(c10d.BroadcastOptions, rootRank=a[2],
                                                            rootTensor=a[3])).wait()),
    "scatter_": (0, lambda be, a: be.scatter(a[0], a[1], _opts(c10d.ScatterOptions, rootRank=a[3])).wait()),
    "alltoall_": (0, lambda be, a: be.alltoall(a[0], a[1], c10d.AllToAllOptions()).wait()),
    "alltoall_base_": (0, lambda be, a: be.alltoall_base(a[0], a[1], list(a[3]), list(a[4]),
                                                        c10d.AllToAllOptions()).wait()),
    # Point-to-point ops return gloo's Work still running: a pipeline schedule posts a send and a
    # receive together and waits for both (1F1B: both stages send at once), so waiting inside the
    # kernel would block each rank in its send with the peer's receive never posted.
    "send": (None, lambda be, a: be.send(a[0], a[2], a[3])),
    "recv_": (0, lambda be, a: be.recv(a[0], a[2], a[3])),
    "barrier": (None, lambda be, a: be.barrier(c10d.BarrierOptions()).wait()),
}

#: (op name, device type) -> how many collectives the kernels staged (tests check it grows)
STAGED: collections.Counter = collections.Counter()
_LIBRARIES: dict[str, torch.library.Library] = {}


def register(device: str) -> None:
    """Make ``dist.init_process_group("gloo_staged", ...)`` build gloo groups whose collectives on
    ``device`` tensors are staged through host memory (see the note above).

    Idempotent; call it in each rank before ``init_process_group``. ``device`` is ``"cuda"`` (the
    one-GPU multi-rank suite) or ``"cpu"`` (the same staging, checked without a GPU).

    Example:
        >>> register("cuda")
        >>> dist.init_process_group(NAME, rank=rank, world_size=world, store=store)
    """
    if device not in ("cpu", "cuda"):
        raise ValueError(f"gloo_staged stages cpu or cuda tensors, not {device!r}")
    if NAME.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(NAME, _create_gloo, devices=["cpu", "cuda"])
    if device in _LIBRARIES:
        return
    lib = torch.library.Library("c10d", "IMPL")
    with warnings.catch_warnings():  # "Overriding a previously registered kernel": that is the point
        warnings.simplefilter("ignore", UserWarning)
        for name, (out, run) in RUNNERS.items():
            packet = getattr(torch.ops.c10d, name, None)
            if packet is not None:
                lib.impl(name, _staging_kernel(packet.default, out, run, device), device.upper())
    _LIBRARIES[device] = lib


def _create_gloo(store, rank: int, world_size: int, timeout):
    """The backend of every ``gloo_staged`` group, for both devices: gloo with one worker thread
    (tests/gloo_one_worker.py says why); CUDA tensors never reach it, the staging kernels hand it
    host copies."""
    return gloo_one_worker.create(store, rank, world_size, timeout)


def _to_host(value):
    """``value`` (a tensor or a list / list of lists of them, as in c10d's schemas) as new
    contiguous host tensors holding the same values."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", memory_format=torch.contiguous_format, copy=True)
    if isinstance(value, (list, tuple)):
        return [_to_host(v) for v in value]
    return value  # process group, reduce op, ranks, flags


def _copy_back(target, host) -> None:
    if isinstance(target, torch.Tensor):
        # Outside autograd, as a native backend writes: pipelining's receive buffers are leaves
        # that require grad, and autograd refuses an in-place copy_ into them.
        with torch.no_grad():
            target.copy_(host)  # strided targets too (views into a bigger buffer)
    else:
        for t, h in zip(target, host):
            _copy_back(t, h)


def _completed(result):
    future = torch.futures.Future()
    future.set_result(result)
    return c10d._create_work_from_future(future).boxed()  # ops return TorchBind Works


#: the running point-to-point Works handed out and not yet waited. A boxed Python Work keeps only
#: its C++ half alive; without this reference its ``wait`` (the copy back) would be lost to GC.
_RUNNING: set = set()


class _CopyBackOnWait(c10d.Work):
    """A gloo Work left running, and what its host buffer is copied back into once it completes
    (gloo's send / recv Works have no future to chain a copy onto)."""

    def __init__(self, gloo_work, target, host):
        super().__init__()
        self._gloo_work, self._target, self._host = gloo_work, target, host
        _RUNNING.add(self)

    def wait(self, timeout=None):
        self._gloo_work.wait()
        if self._target is not None:
            _copy_back(self._target, self._host)
            self._target = self._host = None
        _RUNNING.discard(self)
        return True

    def is_completed(self):
        return self not in _RUNNING


def _staging_kernel(op, out: int | None, run, device: str):
    group_index = [a.name for a in op._schema.arguments].index("process_group")
    returns_tensors = len(op._schema.returns) == 2  # (outputs, Work); else Work alone

    def kernel(*args):
        group = dist.ProcessGroup.unbox(args[group_index])
        gloo = group._get_backend(torch.device("cpu"))
        if not isinstance(gloo, dist.ProcessGroupGloo):
            raise RuntimeError(f"gloo_staged: {op._schema.name} on {device} tensors in group {group.group_name}, whose "
                               f"cpu backend is {type(gloo).__name__}, not gloo; this process stages every {device} "
                               "collective (tests/staging_backend.py), so build every group with the "
                               f"{NAME!r} backend")
        # Every tensor is copied first (outputs too: in-place ops read them, and an input may alias
        # an output, as in FSDP2's in-place all-gather), then gloo runs on the copies.
        host = [_to_host(a) for a in args]
        running = run(gloo, host)  # gloo's errors (timeout, closed connection, float8 dtype) raise here
        STAGED[op._schema.name, device] += 1
        target, source = (None, None) if out is None else (args[out], host[out])
        if isinstance(running, c10d.Work):  # point-to-point: copied back when the caller waits
            return _CopyBackOnWait(running, target, source).boxed()
        if out is not None:
            _copy_back(target, source)
        if returns_tensors:
            return args[out], _completed(args[out])
        return _completed(None)

    kernel.__name__ = "staged_" + op._schema.name.split("::")[-1]
    return kernel
