"""Whether a group can use symmetric workspaces, and why not: the collective availability probe.

:func:`symmetric_memory_available` asks every rank of a partition for its local verdict
(``/dev/shm`` and the Triton interpreter on CPU; CUDA and torch's symmetric-memory API on
GPU) and its host and GPU, and returns one answer on every rank, cached per (group ranks,
device) as the workspace cache keys them (:func:`_key`, :func:`_norm_device`).  The verdict
over the gathered facts (:func:`_group_verdict`) is a pure function, testable without GPUs.
Inside :func:`no_probe` (a layer's ``explain``, :func:`distfuse.layers.dispatch.dry_run`) an
uncached verdict raises :class:`NotProbedError` instead of probing, so a dry decision never
communicates.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading

import torch
import torch.distributed as dist

from distfuse.fused.workspace_cuda import ALLOW_OVERLAP_ENV, _allow_overlapping_devices, _device_uuid, _symm_mem_api
from distfuse.fused.workspace_shm import SHM_DIR
from distfuse.groups import WorldTable
from distfuse.partition import Partition

__all__ = ["symmetric_memory_available", "log_fallback_once", "no_probe", "probing_blocked", "NotProbedError"]

logger = logging.getLogger("distfuse.fused")


def _key(P: Partition, device: torch.device) -> tuple:
    return (P.ranks, str(device))


def _norm_device(P: Partition, device) -> torch.device:
    device = torch.device(device) if device is not None else P.device
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


_AVAILABLE: WorldTable = WorldTable()  # (ranks, device) -> (ok, reason), per world
_LOGGED: set[str] = set()
_NO_PROBE = threading.local()


class NotProbedError(RuntimeError):
    """Inside :func:`no_probe`: the group's verdict is not cached, and finding it would communicate."""


@contextlib.contextmanager
def no_probe():
    """Inside (this thread): :func:`symmetric_memory_available` answers from its cache or raises
    :class:`NotProbedError`."""
    depth = getattr(_NO_PROBE, "depth", 0)
    _NO_PROBE.depth = depth + 1
    try:
        yield
    finally:
        _NO_PROBE.depth = depth


def probing_blocked() -> bool:
    """Whether this thread is inside :func:`no_probe`."""
    return getattr(_NO_PROBE, "depth", 0) > 0


def _local_verdict(device: torch.device) -> tuple[bool, str]:
    if device.type == "cpu":
        if not os.path.isdir(SHM_DIR) or not os.access(SHM_DIR, os.W_OK):
            return False, f"{SHM_DIR} is missing or not writable"
        from distfuse.kernels._utils import INTERPRET

        if not INTERPRET:
            return False, "Triton kernels on CPU need TRITON_INTERPRET=1 set before distfuse.kernels is imported"
        return True, "CPU shared memory (/dev/shm) with the Triton interpreter"
    if device.type != "cuda":
        return False, f"no symmetric memory backend for device type {device.type}"
    if not torch.cuda.is_available():
        return False, "CUDA is not available"
    if _symm_mem_api() is None:
        return False, f"torch {torch.__version__} has no torch.distributed._symmetric_memory allocation API"
    return True, "CUDA symmetric memory"

def _group_verdict(ok: bool, reason: str, infos: list, group_ranks: list[int], device_index: int | None, *,
                   visible: dict[str, int], can_access, allow_overlapping: bool) -> tuple[bool, str]:
    """This rank's verdict on symmetric memory over a group, from every rank's gathered facts (pure).

    Args:
        ok, reason: this rank's local verdict (:func:`_local_verdict`).
        infos: ``(hostname, gpu uuid or "", device name, ok, reason)`` of every rank, in
            the gather's order (group-rank order: sorted world ranks).
        group_ranks: the world rank of each entry of ``infos``, to name ranks in reasons.
        device_index: this rank's CUDA device index (None on CPU).
        visible: uuid -> local index of the GPUs this process sees.
        can_access: ``can_access(i, j)``, whether local GPU ``i`` reaches local GPU ``j`` (P2P).
        allow_overlapping: ``TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1`` on this rank.

    Unavailable when the ranks span several hosts; when two ranks of one host hold the
    same GPU (torch's rendezvous rejects that unless ``allow_overlapping``: the mode in
    which a one-GPU machine runs the real CUDA path with two processes); when a peer's
    GPU is visible here but not reachable by P2P.
    """
    if not ok:
        return ok, reason
    hosts = sorted({info[0] for info in infos})
    if len(hosts) > 1:
        return False, (f"ranks {list(group_ranks)} span {len(hosts)} hosts ({', '.join(hosts[:4])}); symmetric "
                       "memory needs one host")
    if device_index is None:
        return ok, reason
    holders: dict[str, list[int]] = {}
    for g, info in enumerate(infos):
        if info[1]:
            holders.setdefault(info[1], []).append(g)
    shared = {uuid: gs for uuid, gs in holders.items() if len(gs) > 1}
    if shared and not allow_overlapping:
        uuid, gs = next(iter(shared.items()))
        who = ", ".join(f"{group_ranks[g]} ({infos[g][2]})" for g in gs)
        return False, (f"world ranks {who} share one GPU (uuid {uuid}) on host {hosts[0]}; torch's "
                       "symmetric-memory rendezvous rejects ranks on the same device: give each rank its own GPU "
                       f"(torch.cuda.set_device(local_rank)), or set {ALLOW_OVERLAP_ENV}=1 on every rank to allow it "
                       "(for testing the CUDA path with several processes on one GPU)")
    for g, info in enumerate(infos):
        j = visible.get(info[1]) if info[1] else None
        # A peer GPU hidden by CUDA_VISIBLE_DEVICES cannot be checked here; allocation will tell.
        if j is not None and j != device_index and not can_access(device_index, j):
            return False, f"no P2P access from cuda:{device_index} to cuda:{j} (world rank {group_ranks[g]})"
    if shared:
        return ok, f"{reason} (ranks share GPUs; {ALLOW_OVERLAP_ENV}=1)"
    return ok, reason


def symmetric_memory_available(P: Partition, device=None) -> tuple[bool, str]:
    """Whether ``P`` can use symmetric workspaces on ``device``, and why (see the module doc).

    Collective over ``P`` the first time (two small gathers on ``P.meta_group``), so every rank gets the same answer.
    """
    if not P.active:
        return False, "this rank is not in the partition"
    device = _norm_device(P, device)
    key, available = _key(P, device), _AVAILABLE.current()
    if key in available:
        return available[key]
    ok, reason = _local_verdict(device)
    if P.size == 1:
        available[key] = (ok, reason)
        return ok, reason
    if probing_blocked():
        raise NotProbedError(f"whether world ranks {sorted(P.ranks)} share symmetric memory is found by a collective "
                        "probe on their first fused call; not probed here")
    import socket

    cuda = ok and device.type == "cuda"
    uuid = _device_uuid(device.index) if cuda else ""
    infos: list = [None] * P.size
    dist.all_gather_object(infos, (socket.gethostname(), uuid, str(device), ok, reason), group=P.meta_group)
    # The gathers are in group-rank order: torch's new_group sorts the ranks.
    group_ranks = sorted(P.ranks)
    visible = {}
    if cuda:
        visible = {u: i for i in range(torch.cuda.device_count()) if (u := _device_uuid(i))}
    ok, reason = _group_verdict(ok, reason, infos, group_ranks, device.index if cuda else None, visible=visible,
                                can_access=torch.cuda.can_device_access_peer,
                                allow_overlapping=_allow_overlapping_devices())
    verdicts: list = [None] * P.size
    dist.all_gather_object(verdicts, (ok, reason), group=P.meta_group)
    for g, (v_ok, v_reason) in enumerate(verdicts):
        if not v_ok:
            ok, reason = False, f"world rank {group_ranks[g]}: {v_reason}"
            break
    available[key] = (ok, reason)
    return ok, reason


def log_fallback_once(reason: str) -> bool:
    """Log (warning, logger ``distfuse.fused``) that the unfused path is used because of ``reason``, once per reason.

    Returns True if this call logged."""
    if reason in _LOGGED:
        return False
    _LOGGED.add(reason)
    logger.warning("distfuse: fused kernels unavailable, using the unfused path: %s", reason)
    return True
