"""The test ranks' CPU backend: real gloo, with one worker thread per process group.

[Note: why the test ranks' gloo groups run one worker thread]
``ProcessGroupGloo`` runs each group's collectives on two worker threads by default. After each
collective, ``ProcessGroupGloo::runLoop`` records the collective's name in the group's status
(``pgStatus_->lastCompletedWorkName``, a ``std::string`` shared by both workers) before it takes
its lock; the same code is in the shipped torch 2.13 and 2.15 binaries. Two workers finishing at
about the same time then race on that string. A name longer than 15 characters lives on the heap,
and every functional all-gather on gloo is ``ALLGATHER_COALESCED`` (19): DTensor's
``full_tensor()`` and redistributes, and ``dtensor_fp8/ops/collectives.py``. Each assignment frees
the string's previous buffer, so two racing threads can free the same 32-byte chunk twice. glibc
notices only at some later allocation, in whatever code allocates next: "malloc(): unaligned
tcache chunk detected" or a SIGSEGV with no Python exception. The full CPU suite lost a rank like
that now and then, at 4 ranks on a loaded 2-core machine (likely a worker preempted inside the
assignment). A core dump of one such crash matches: the chunk freed twice sat two chunks from the
name's own buffer, which held "ALLGATHER_COALESCED", in the same thread arena. The worker count
alone decides it in a stress loop: 4-rank 1F1B MXFP8 pp x FSDP2 training with each plane's gather
left in flight until all were issued (300 steps a run, torch 2.13). Two workers gave 1 abort and
2 hangs in 6 runs; one worker gave 13 clean runs of 13. A pure-torch loop of functional all-gathers
alone ran clean for minutes.

With one worker thread a group's collectives run one after another on that thread, in the order
they were issued. Every rank must issue them in the same order anyway, so this cannot deadlock.
Point-to-point sends and receives run on the calling thread, as before. Nothing else changes: the
groups are ordinary ``ProcessGroupGloo`` objects, the bytes still cross real gloo, and every
sub-group (DeviceMesh's, ``new_group``'s) is built by the same creator. The library does not need
this. On a GPU, NCCL has no such thread. docs/README.md's Limitations give CPU users the same
registration.
"""

from __future__ import annotations

import torch.distributed as dist

#: the backend name for ``init_process_group``
NAME = "gloo_one_worker"


def create(store, rank: int, world_size: int, timeout) -> dist.ProcessGroupGloo:
    """A ``ProcessGroupGloo`` with one worker thread, otherwise what ``"gloo"`` builds (its default
    device, the group's timeout)."""
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    options._devices = [dist.ProcessGroupGloo.create_default_device()]
    options._threads = 1
    return dist.ProcessGroupGloo(store, rank, world_size, options)


def register() -> None:
    """Make ``dist.init_process_group("gloo_one_worker", ...)`` build such groups (idempotent; call it
    in each rank first).

    Example:
        >>> register()
        >>> dist.init_process_group(NAME, rank=rank, world_size=world, store=store)
    """
    if NAME.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(NAME, create, devices=["cpu"])
