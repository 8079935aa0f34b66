"""The consumer launches' status words: one set per launch, in host memory the GPU writes, read without a copy.

A consumer kernel (``chunk_reduce``, the gathered GEMMs, the all-reduce's column gather, the
signature check) writes a status word only when something failed: the epoch of a flag wait
that gave up (:func:`~distfuse.kernels.jit_helpers.wait_flag`), or a peer's disagreeing
signature word (:mod:`distfuse.kernels.signature`).  Its launcher then reads the words: at
once (sync mode), or once the launch has finished (deferred mode, the CUDA default; see
:meth:`~distfuse.fused.workspace_layout.RankBuffers.check_status`).

Each launch gets ``W`` words of its own, zero when handed out (:meth:`StatusSlots.take`), so
a check reads its launch's words and nothing else, whenever it reads them.  Where they live:

* **CUDA**: page-locked host memory.  Under unified addressing CUDA maps it into every
  device's address space at the same address, so a kernel's store crosses the bus and the
  host reads the words in place once the launch's event has completed.  A deferred check
  costs one event record per consumer; copying device-resident words into pinned memory
  (the ``copy_``, its host-allocator bookkeeping and the event) cost about 28 us of host
  per consumer on an H200 host (``scripts/gpu_diagnose.py --sections attrib``, 2026-11-27),
  as much as the Triton launch itself.  :func:`mapped_host_words` checks once per device
  that a kernel's store lands there; where it does not (or ``DISTFUSE_STATUS_WORDS=device``),
  the slots live on the device and each check copies its words to pinned memory.
* **CPU**: ordinary memory of this process: the interpreted kernels run here, and no
  ``/dev/shm`` peer ever writes another rank's status words.

Slots are :func:`slot_stride` words apart, a multiple of 4 (16 bytes), so every slot has the
same Triton pointer specialisation: one compiled kernel serves them all.  A slot returns to
the pool only after a check found it clear; a slot that reported a failure is kept (its
workspace is broken).  A slot handed to a launch captured in a CUDA graph is never reused: a
replay may write it at any time, so every later claim of the workspace reads it
(:meth:`StatusSlots.captured_failure`).
"""

from __future__ import annotations

import functools
import os

import torch

from distfuse.errors import UnsupportedError, where

__all__ = ["StatusSlots", "mapped_host_words", "slot_stride", "words_clear", "STATUS_WORDS_ENV"]

STATUS_WORDS_ENV = "DISTFUSE_STATUS_WORDS"
_SLOTS_PER_BLOCK = 64


def slot_stride(world_size: int) -> int:
    """Words between two slots: ``world_size`` rounded up to 4 (16-byte aligned slots)."""
    return -(-int(world_size) // 4) * 4


def words_clear(words: torch.Tensor) -> bool:
    """Whether every word of host status ``words`` is zero: the check of every consumer launch's steady state.

    A slot of a mapped pool carries its numpy view (``host_words``, made once when the pool grows), and the test
    compares the words' bytes with zeros: 0.05 us on a fast host, where ``words.numpy().any()`` (a new numpy view,
    then a ufunc reduction) took 1.3 us, and a launch's host time is what bounds a short fused op's eager call."""
    host = getattr(words, "host_words", None)
    if host is None:
        host = words.numpy()
    return not host.tobytes().strip(b"\0")


def _status_words_choice() -> str:
    choice = os.environ.get(STATUS_WORDS_ENV, "auto").strip().lower() or "auto"
    if choice not in ("auto", "host", "device"):
        raise ValueError(f"{STATUS_WORDS_ENV}={choice!r}: expected auto, host or device")
    return choice


@functools.lru_cache(maxsize=None)
def _probe_mapped(index: int) -> tuple[bool, str]:
    """Launch one store into a pinned host word on device ``index``; ``(it landed, why not)``."""
    from distfuse.kernels.jit_helpers import store_word_kernel

    try:
        word = torch.zeros(4, dtype=torch.int32, pin_memory=True)
        with torch.cuda.device(index):
            store_word_kernel[(1,)](word, 7)
            torch.cuda.synchronize(index)
        got = int(word[0])
    except Exception as exc:  # noqa: BLE001 - whatever refused the store, the words stay on the device
        return False, f"{type(exc).__name__}: {exc}"
    return got == 7, "" if got == 7 else f"the probe's store did not land (read {got})"


def mapped_host_words(device: torch.device) -> bool:
    """Whether consumer kernels on CUDA ``device`` write their status words into pinned host memory.

    ``DISTFUSE_STATUS_WORDS``: ``auto`` (default) probes once per device; ``device`` keeps them
    on the device; ``host`` requires the mapping and raises :class:`~distfuse.errors.UnsupportedError`
    where the probe fails.
    """
    choice = _status_words_choice()
    if choice == "device":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    ok, why = _probe_mapped(index)
    if not ok and choice == "host":
        raise UnsupportedError(f"{where('StatusSlots')}: {STATUS_WORDS_ENV}=host, but a kernel on cuda:{index} "
                               f"cannot write pinned host memory ({why})")
    return ok


class StatusSlots:
    """A workspace's pool of per-launch status slots (int32 ``[W]`` each; the module doc says where they live).

    Attributes:
        mapped: the slots are host memory the host reads in place (CPU, or CUDA with mapped
            pinned memory); otherwise CUDA device memory, copied for each check.
        captured: ``(slot, rank, op, what)`` of launches captured in CUDA graphs, never reused.
    """

    def __init__(self, world_size: int, device: torch.device):
        self.world_size = int(world_size)
        self.device = torch.device(device)
        cuda = self.device.type == "cuda"
        self.mapped = not cuda or mapped_host_words(self.device)
        self._pinned = cuda and self.mapped
        self._free: list[torch.Tensor] = []
        self._blocks: list[torch.Tensor] = []
        self.captured: list[tuple[torch.Tensor, int, str, str]] = []
        self._grow()  # before any capture: no allocation while a stream captures, in the steady state

    def _grow(self) -> None:
        stride, W = slot_stride(self.world_size), self.world_size
        if self.mapped:
            block = torch.zeros(_SLOTS_PER_BLOCK * stride, dtype=torch.int32, pin_memory=self._pinned)
        else:
            block = torch.zeros(_SLOTS_PER_BLOCK * stride, dtype=torch.int32, device=self.device)
        self._blocks.append(block)
        slots = [block[i * stride: i * stride + W] for i in reversed(range(_SLOTS_PER_BLOCK))]
        if self.mapped:
            for slot in slots:  # the words in place, as numpy: what words_clear reads (no torch op, no new view)
                slot.host_words = slot.numpy()
        self._free.extend(slots)

    def take(self) -> torch.Tensor:
        """A clear slot for one launch."""
        if not self._free:
            self._grow()
        return self._free.pop()

    def give_back(self, slot: torch.Tensor) -> None:
        """Return a slot a check found clear (all zero: no need to clear it again)."""
        self._free.append(slot)

    def read(self, slot: torch.Tensor) -> torch.Tensor:
        """The slot's words on the host: the slot itself where mapped, else a copy (a sync: call it once the
        launch has finished)."""
        return slot if self.mapped else slot.cpu()

    def snapshot(self, slot: torch.Tensor) -> torch.Tensor:
        """What a deferred check reads later: the slot itself where mapped; else a copy into pinned memory
        issued on the current stream now (the caller records the event after it)."""
        if self.mapped:
            return slot
        host = torch.empty(slot.shape, dtype=slot.dtype, pin_memory=True)
        host.copy_(slot, non_blocking=True)
        return host

    def keep_captured(self, slot: torch.Tensor, rank: int, op: str, what: str) -> None:
        """A CUDA graph holds ``slot``: never reuse it, and read it at every later check."""
        self.captured.append((slot, rank, op, what))

    def captured_failure(self, wait: bool) -> tuple[torch.Tensor, int, str, str] | None:
        """The first captured slot holding a failure, or None.  Device slots (not mapped) are read only when
        ``wait`` (a sync point): reading them is a device sync."""
        if not self.mapped and not wait:
            return None
        for entry in self.captured:
            words = self.read(entry[0])
            if not words_clear(words):
                return (words, *entry[1:])
        return None
