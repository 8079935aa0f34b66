"""Tensors over a peer's workspace memory, without a copy, checked: the one place peer views are made.

Producers that write a peer's slot with a torch op (``torch.matmul(..., out=slot)``, the
copy-engine push's ``copy_``, the 4-byte flag copies) need a tensor over the peer's memory.
Built the wrong way, it can be a copy: ``torch.as_tensor`` of a ``__cuda_array_interface__``
pointer that CUDA attributes to another GPU is moved to the local one, silently, and the
owner then sums stale data with no error.  So every peer view comes from the backend's own
mapping (:func:`_raw_buffer`: ``ws._bufs[peer]`` for the loopback and ``/dev/shm``; the
handle's ``get_buffer`` at the peer's own offset on CUDA; a ``__cuda_array_interface__``
wrapper only where torch lacks ``get_buffer``), and every view is checked against the
peer table (:func:`check_peer_view`).  Views are built once per rank view and cached.
"""

from __future__ import annotations

import weakref

import torch

from distfuse.errors import ShapeError, UnsupportedError, where

__all__ = ["PeerViewError", "check_peer_view", "peer_data", "peer_flags", "peer_flag"]


class PeerViewError(UnsupportedError):
    """A tensor meant to alias a peer's workspace memory does not (torch made a copy, or the mapping moved)."""


def check_peer_view(t: torch.Tensor, address: int, *, op: str, peer: int) -> torch.Tensor:
    """``t`` if its first element lies at ``address`` (the peer's address in the peer table), else raise.

    Raises :class:`PeerViewError` naming ``op``, the peer and both addresses.
    """
    if t.data_ptr() != int(address):
        raise PeerViewError(
            f"{where(op)}: the view of peer {peer}'s workspace memory is not that memory: expected data_ptr "
            f"{int(address):#x} (the peer table), got {t.data_ptr():#x} on {t.device}; torch copied the peer's "
            "buffer instead of aliasing it, so writes through it would never reach the peer")
    return t


class _CudaRegion:
    """A raw device address as an object torch can wrap (``__cuda_array_interface__``): the last resort."""

    def __init__(self, ptr: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 3}


def _raw_buffer(ws, peer: int, address: int, nbytes: int) -> torch.Tensor:
    """``peer``'s whole buffer (uint8 ``[nbytes]``) from the backend's own mapping (see the module doc)."""
    bufs = getattr(ws, "_bufs", None) or []
    if len(bufs) == ws.world_size:  # loopback; /dev/shm (every peer's segment is mapped here)
        return bufs[peer]
    handle, locations = getattr(ws, "_handle", None), getattr(ws, "_peer_locations", None)
    if handle is not None and locations is not None and hasattr(handle, "get_buffer"):
        group_rank, offset = locations[peer]
        return handle.get_buffer(group_rank, (nbytes,), torch.uint8, offset)
    return torch.as_tensor(_CudaRegion(address, nbytes), device=ws.device)  # CUDA: CPU workspaces map every peer


#: Per rank view: every peer's whole buffer (header + data) as a checked uint8 tensor.
_BUFFERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _header(view) -> int:
    return view._data.data_ptr() - view.flags.data_ptr()


def _buffers(view) -> list[torch.Tensor]:
    bufs = _BUFFERS.get(view)
    if bufs is None:
        ws = view._owner
        header = _header(view)
        total = header + view.nbytes
        bases = [int(p) for p in view.flag_ptrs.tolist()]  # the flag words open each buffer
        data = [int(p) for p in view.data_ptrs.tolist()]
        bufs = []
        for p in range(view.world_size):
            buf = check_peer_view(_raw_buffer(ws, p, bases[p], total), bases[p], op="peer_buffer", peer=p)
            check_peer_view(buf[header:], data[p], op="peer_buffer (data region)", peer=p)
            bufs.append(buf)
        _BUFFERS[view] = bufs
    return bufs


def peer_data(view, peer: int, dtype: torch.dtype, numel: int, offset: int = 0) -> torch.Tensor:
    """A 1-D ``dtype`` tensor over ``numel`` elements of ``peer``'s data region, ``offset`` bytes in (no copy).

    ``view`` is this rank's :class:`~distfuse.fused.workspace_layout.RankBuffers`; the region must
    fit in the data region (every rank's has the same capacity).
    """
    nbytes = numel * dtype.itemsize
    if offset % dtype.itemsize or offset + nbytes > view.nbytes:
        raise ShapeError(f"{where('peer_data')}: bytes [{offset}, {offset + nbytes}) of a {view.nbytes}-byte data "
                         f"region as {dtype}")
    header = _header(view)
    return _buffers(view)[peer][header + offset: header + offset + nbytes].view(dtype)  # a slice of a checked view


def peer_flags(view, owner: int) -> torch.Tensor:
    """``owner``'s flag words (int32 ``[W * W]``, ``flags[chunk, source]`` chunk-major) as a tensor over them."""
    W = view.world_size
    return _buffers(view)[owner][: 4 * W * W].view(torch.int32)


def peer_flag(view, owner: int, chunk: int, source: int) -> torch.Tensor:
    """Owner ``owner``'s flag word ``flags[chunk, source]`` as a one-element int32 tensor over its address."""
    word = chunk * view.world_size + source
    return peer_flags(view, owner)[word: word + 1]
