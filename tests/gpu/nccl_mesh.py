"""The one-rank NCCL mesh fixture of the GPU suite's TE module tests (a module, not a conftest.py:
tests/conftest.py is imported by name by the CPU suite, and a second conftest would shadow it)."""

import os
import tempfile

import pytest
import torch
import torch.distributed as dist


@pytest.fixture(scope="module")
def mesh():
    """A one-rank NCCL group on ``cuda:0`` (created unless this process has one; kept for the
    process's later modules) and its 1-D device mesh, for FSDP2 tests of TE modules."""
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_initialized():
        # A file store, not a TCP port: other suites may run beside this one on the machine.
        fd, path = tempfile.mkstemp(prefix="dtensor_fp8_gpu_store_")
        os.close(fd)
        os.unlink(path)
        dist.init_process_group("nccl", store=dist.FileStore(path, 1), rank=0, world_size=1,
                                device_id=torch.device("cuda", 0))
    yield init_device_mesh("cuda", (1,))
