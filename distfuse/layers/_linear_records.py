"""What a linear layer's call is, as its workers compare it: compute dtypes, records and their checks.

Each linear's agreement session decides when the workers exchange metadata (the row
linears': ``_linear_agreement.py``); this module holds what they exchange and how every
worker judges it alike.  ``DistributedLinear``'s call becomes a fixed-size int64 record
(:func:`general_record`: number of dimensions, dtype, device type, autocast dtype, grad
mode, shape), so one gather carries it, and :func:`check_general_records` /
:func:`check_input_dtype` raise the same :class:`~distfuse.errors.ShapeError` on every
worker from the gathered records; the reduce-scatter linear's likewise
(:func:`row_record`, :func:`check_row_records`).  :func:`compute_dtype` names the dtype ``F.linear``
computes in (the autocast dtype under ``torch.autocast``), which the partial sums travel
in, so the workers must share it.  :func:`local_error` turns a local check into a value
to be agreed on instead of an error raised on one worker alone.
"""

from __future__ import annotations

import torch

from distfuse.errors import DistfuseError, ShapeError, expect, where
from distfuse.geometry.decomposition import block_extent
from distfuse.primitives._common import dtype_code, dtype_of_code

__all__ = ["compute_dtype", "compute_dtype_of", "local_error", "general_record", "record_shape",
           "check_general_records", "check_input_dtype", "row_record", "check_row_records"]

#: The most dimensions a record holds (and so the most a linear layer's input may have).
_MAX_DIM = 8


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype ``F.linear`` computes ``x`` in: the autocast dtype under ``torch.autocast`` (not for float64)."""
    if x.is_floating_point() and x.dtype != torch.float64 and torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


def compute_dtype_of(dtype: torch.dtype, device) -> torch.dtype:
    """:func:`compute_dtype` for an input of ``dtype`` on ``device`` (workers that hold no input ask this)."""
    device_type = torch.device(device).type
    if dtype.is_floating_point and dtype != torch.float64 and torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return dtype


def _autocast_code(device_type: str) -> int:
    """The autocast dtype's code on ``device_type`` (-1: autocast off); part of what the workers must share."""
    if torch.is_autocast_enabled(device_type):
        return dtype_code(torch.get_autocast_dtype(device_type))
    return -1


def local_error(check) -> DistfuseError | None:
    """The distfuse error ``check()`` raises, or None: a local check's outcome, to be agreed on, not raised here."""
    try:
        check()
    except DistfuseError as exc:
        return exc
    return None


# DistributedLinear's record: [ndim, dtype, device, autocast dtype, grad mode, shape (8 slots)].
_TOO_MANY, _NOT_A_TENSOR = -2, -3


def general_record(x: torch.Tensor) -> list[int]:
    """This worker's record of a ``DistributedLinear`` call (13 int64; see :func:`check_general_records`).

    Something other than a tensor gets the record ``[-3, ...]``: every worker raises on it.
    """
    if not isinstance(x, torch.Tensor):
        return [_NOT_A_TENSOR, -1, -1, -1, int(torch.is_grad_enabled())] + [-1] * _MAX_DIM
    too_many = x.dim() > _MAX_DIM
    rec = [_TOO_MANY if too_many else x.dim(), dtype_code(x.dtype), -1, _autocast_code(x.device.type),
           int(torch.is_grad_enabled())] + [-1] * _MAX_DIM
    if x.numel() > 0:
        rec[2] = _DEVICE_TYPES.index(x.device.type) if x.device.type in _DEVICE_TYPES else len(_DEVICE_TYPES)
    if not too_many:
        rec[5:5 + x.dim()] = list(x.shape)
    return rec


_DEVICE_TYPES = ("cpu", "cuda", "meta", "xpu", "mps", "hpu")


def record_shape(rec: list[int]) -> tuple[int, ...]:
    return tuple(rec[5:5 + rec[0]])


def check_general_records(op: str, by_rank: dict, device_type: str) -> None:
    """What every worker of ``DistributedLinear`` must share, checked alike on every worker from the records.

    Too many dimensions, data on another device type, and disagreement on autocast or
    grad mode (autocast sets the dtype the partial sums travel in; grad mode whether every
    worker runs its part of the adjoint) raise :class:`~distfuse.errors.ShapeError`.
    """
    odd = sorted(w for w, r in by_rank.items() if r[0] == _NOT_A_TENSOR)
    if odd:
        raise ShapeError(f"{where(op)}: input type: expected torch.Tensor on every worker (a zero-volume tensor where "
                         f"a worker holds no input); world rank(s) {odd} passed something else")
    over = sorted(w for w, r in by_rank.items() if r[0] == _TOO_MANY)
    if over:
        raise ShapeError(f"{where(op)}: tensors of more than {_MAX_DIM} dimensions are not supported; world rank(s) "
                         f"{over} passed one")
    names = list(_DEVICE_TYPES) + ["another device"]
    bad = {w: names[r[2]] for w, r in by_rank.items() if r[2] >= 0 and names[r[2]] != device_type}
    if bad:
        raise ShapeError(f"{where(op)}: input device type: expected {device_type} on every worker, got "
                         f"{', '.join(f'world rank {w}: {d}' for w, d in sorted(bad.items()))}")
    for slot, what in ((3, "the autocast dtype (torch.autocast, -1: off)"), (4, "grad mode (torch.is_grad_enabled)")):
        seen = {w: r[slot] for w, r in by_rank.items()}
        if len(set(seen.values())) > 1:
            got = ", ".join(f"world rank {w}: {dtype_of_code(v) if slot == 3 and v >= 0 else v}"
                            for w, v in sorted(seen.items()))
            raise ShapeError(f"{where(op)}: every worker must call the layer with the same {what}; got {got}")


def check_input_dtype(op: str, dtype: torch.dtype | None, weight_dtype: torch.dtype, autocast_code: int) -> None:
    """The agreed input dtype must be one the layer multiplies: floating, and its weight's outside autocast."""
    if dtype is None or not dtype.is_floating_point:
        raise ShapeError(f"{where(op)}: the input dtype {dtype} is not a floating dtype; the layer multiplies floating "
                         f"inputs of its weight's dtype {weight_dtype} (any floating dtype under torch.autocast)")
    computes_in = dtype_of_code(autocast_code) if autocast_code >= 0 and dtype != torch.float64 else dtype
    if computes_in == dtype and dtype != weight_dtype:
        raise ShapeError(f"{where(op)}: the input dtype {dtype} is not the weight's dtype {weight_dtype}; the layer "
                         "multiplies inputs of its weight's dtype (any floating dtype under torch.autocast)")


# The reduce-scatter linear's record: [ndim, input dtype, compute dtype, problem, shape (8 slots)].
_OK, _BAD_DEVICE, _BAD_DTYPE, _TOO_MANY_DIMS = range(4)


def row_record(x: torch.Tensor, weight_dtype: torch.dtype, device_type: str) -> list[int]:
    """This worker's record of a reduce-scatter linear call (12 int64; ``rec[3]`` is 0 when the layer can
    multiply the input: the device type, a floating dtype, its weight's outside autocast, at most 8 dimensions)."""
    cdt = compute_dtype(x)
    problem = _OK
    if x.device.type != device_type:
        problem = _BAD_DEVICE
    elif not x.is_floating_point() or (cdt == x.dtype and x.dtype != weight_dtype):
        problem = _BAD_DTYPE
    elif x.dim() > _MAX_DIM:
        problem = _TOO_MANY_DIMS
    rec = [min(x.dim(), _MAX_DIM), dtype_code(x.dtype), dtype_code(cdt), problem] + [-1] * _MAX_DIM
    if problem == _OK:
        rec[4:4 + x.dim()] = list(x.shape)
    return rec


def check_row_records(op: str, P_row, rows: list[list[int]], in_features: int, P_m: int,
                      weight_dtype: torch.dtype) -> tuple[tuple[int, ...], torch.dtype]:
    """Every model-parallel worker's :func:`row_record`, checked alike on every worker (raises on all of them);
    returns the agreed leading extents and compute dtype."""
    for j, (r, w) in enumerate(zip(rows, P_row.ranks, strict=True)):  # j: the worker's model-parallel index
        if r[3] == _BAD_DEVICE:
            raise expect(op, f"device type of the input on world rank {w}", P_row.device.type, "another device")
        if r[3] == _BAD_DTYPE:
            raise ShapeError(f"{where(op)}: world rank {w} passed an input of dtype {dtype_of_code(r[1])}; the "
                             f"layer multiplies floating inputs of its weight's dtype {weight_dtype} (any floating "
                             "dtype under torch.autocast)")
        if r[3] == _TOO_MANY_DIMS:
            raise ShapeError(f"{where(op)}: world rank {w} passed an input of more than {_MAX_DIM} dimensions")
        want = block_extent(in_features, P_m, j)
        if r[4 + r[0] - 1] != want:
            raise expect(op, f"input feature extent on world rank {w} (block {j} of in_features={in_features})",
                         want, r[4 + r[0] - 1])
    first = rows[0]
    for r in rows:
        if r[0] != first[0] or r[4:4 + r[0] - 1] != first[4:4 + first[0] - 1] or r[1:3] != first[1:3]:
            got = ", ".join(f"world rank {v}: shape {tuple(q[4:4 + q[0]])} dtype {dtype_of_code(q[1])} computing in "
                            f"{dtype_of_code(q[2])}" for q, v in zip(rows, P_row.ranks, strict=True))
            raise ShapeError(f"{where(op)}: the model-parallel workers must pass inputs with the same leading "
                             f"extents (rows) and dtype, computed in the same dtype (torch.autocast); got {got}")
    return tuple(first[4:4 + first[0] - 1]), dtype_of_code(first[2])
