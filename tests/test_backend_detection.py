"""NCCL detection by the group's CUDA backend, not by its backend string.

After ``init_process_group()`` with no backend (torchrun's usual form) the backend string
reads "undefined", and after ``init_process_group("cpu:gloo,cuda:nccl")`` it is stored as
written; both are NCCL worlds for CUDA tensors.  Taking them for CPU worlds put partitions
on the CPU and skipped the NCCL warm-up, after which a partial ``batch_isend_irecv`` can
hang.  These tests stub what torch reports (no GPU is needed) and check the helper, the
default device and the warm-up decision.
"""

from unittest import mock

import pytest
import torch
import torch.distributed as dist

from distfuse import groups
from distfuse.groups import cuda_backend_of
from distfuse.partition import Partition
from distfuse.testing import run_ranks

MISSING = object()


class _FakeBackend:
    def __init__(self, name):
        self._name = name

    def name(self):
        return self._name


class _FakeGroup:
    """A process group that holds ``cuda`` as its CUDA backend (None: none, as torch raises then)."""

    def __init__(self, cuda=None):
        self.cuda = cuda

    def _get_backend(self, device):
        if device.type != "cuda" or self.cuda is None:
            raise RuntimeError(f"No backend type associated with device type {device.type}")
        return _FakeBackend(self.cuda)


def _stub(monkeypatch, backend, config):
    """Make torch report ``backend`` as the backend string and ``config`` as the config (MISSING: torch lacks it)."""
    monkeypatch.setattr(dist, "get_backend", lambda group=None: backend)
    if config is MISSING:
        monkeypatch.delattr(dist, "get_backend_config", raising=False)
    else:
        monkeypatch.setattr(dist, "get_backend_config", lambda group=None: config)


# (backend string, backend config, the group's CUDA backend object, expected)
CASES = {
    "torchrun-no-backend-gpu": ("undefined", "cpu:gloo,cuda:nccl", "nccl", "nccl"),
    "torchrun-no-backend-cpu-only": ("undefined", "cpu:gloo", None, None),
    "pairs-as-written": ("cpu:gloo,cuda:nccl", "cpu:gloo,cuda:nccl", "nccl", "nccl"),
    "nccl": ("nccl", "cuda:nccl", "nccl", "nccl"),
    "gloo": ("gloo", "cpu:gloo,cuda:gloo", "gloo", "gloo"),
    "cpu-gloo-only": ("cpu:gloo", "cpu:gloo", None, None),
    # Older torch without get_backend_config: the group's CUDA backend, then the string.
    "no-config-undefined-asks-the-group": ("undefined", MISSING, "NCCL", "nccl"),
    "no-config-pairs-string": ("cpu:gloo,cuda:nccl", MISSING, MISSING, "nccl"),
    "no-config-gloo-string": ("gloo", MISSING, MISSING, "gloo"),
    "no-config-undefined-nothing-known": ("undefined", MISSING, MISSING, None),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_cuda_backend_of(monkeypatch, case):
    backend, config, cuda, expected = CASES[case]
    _stub(monkeypatch, backend, config)
    group = object() if cuda is MISSING else _FakeGroup(cuda)
    assert cuda_backend_of(group) == expected


def test_cuda_backend_of_falls_through_a_failing_config(monkeypatch):
    def config_fails(group=None):
        raise ValueError("Invalid process group specified")

    monkeypatch.setattr(dist, "get_backend", lambda group=None: "undefined")
    monkeypatch.setattr(dist, "get_backend_config", config_fails)
    assert cuda_backend_of(_FakeGroup("nccl")) == "nccl"
    assert cuda_backend_of(_FakeGroup(None)) is None


def test_the_config_decides_over_the_string(monkeypatch):
    # A gloo-only string with an NCCL config cannot happen in torch, but the order matters:
    # the config is the per-device truth and is asked first.
    _stub(monkeypatch, "gloo", "cpu:gloo,cuda:nccl")
    assert cuda_backend_of(_FakeGroup("gloo")) == "nccl"


# ---------------------------------------------------------------- Partition.world on ranks


def _world_under(backend, config):
    """Partition.world() on a fresh cache while torch reports ``backend`` / ``config``; (device, warm-ups)."""
    warmups = []
    with mock.patch.object(dist, "get_backend", lambda group=None: backend), \
            mock.patch.object(dist, "get_backend_config", lambda group=None: config), \
            mock.patch.object(groups, "_GROUPS", {}), \
            mock.patch.object(groups, "_WORLD", {}), \
            mock.patch.object(groups, "_warm_up_nccl", warmups.append), \
            mock.patch.object(torch.cuda, "current_device", lambda: 0):
        P = Partition.world()
        again = Partition.world()  # cached: no second warm-up
        # The warm-up runs on distfuse's own world data group (created with DISTFUSE_TIMEOUT), never the default group.
        return str(P.device), str(again.device), [g is groups.world_group() and g is not dist.group.WORLD
                                                  for g in warmups]


@pytest.mark.parametrize("backend,config,device,warm", [
    ("undefined", "cpu:gloo,cuda:nccl", "cuda:0", [True]),
    ("cpu:gloo,cuda:nccl", "cpu:gloo,cuda:nccl", "cuda:0", [True]),
    ("nccl", "cuda:nccl", "cuda:0", [True]),
    ("gloo", "cpu:gloo,cuda:gloo", "cpu", []),
    ("undefined", "cpu:gloo", "cpu", []),
])
def test_partition_device_and_warm_up_follow_the_cuda_backend(backend, config, device, warm):
    for got in run_ranks(2, _world_under, backend, config):
        assert got == (device, device, warm)
