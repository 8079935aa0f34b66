"""Agreement checks of the linear layers' unfused paths, at no steady-state cost.

What must agree.  The model-parallel workers of a row (``P_gather`` / ``P_scatter``) run
one all-gather or reduce-scatter per call, sized by their inputs: the rows (every
leading extent), the sequence blocks, the dtype.  A worker that disagrees on any of them
used to abort in gloo ("Received data size doesn't match") or, with fp16 against bf16
(same element size), make the others return garbage.  Here the collective carries the
agreement flag of :mod:`~distfuse.primitives._agreement`: while every worker's
signature (shape, dtype, device, autocast, ``seq_len``) repeats nothing but the flag
moves; the first call and any change gather every worker's record once, and a
disagreement raises the same :class:`~distfuse.errors.ShapeError` on every worker of the
row.  Workers of other rows (other data-parallel blocks) hold independent data and may
differ.

Not covered: the fused GEMM paths (they trust their shapes; ``DISTFUSE_DEBUG=1`` checks
them) and local checks that raise on the bad worker alone (a wrong feature extent,
``seq_len`` that does not fit the block): its peers then wait until ``DISTFUSE_TIMEOUT``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from distfuse.errors import DistfuseError, ShapeError, expect, where
from distfuse.geometry.decomposition import block_extent
from distfuse.primitives._agreement import AgreementSite, run_agreed
from distfuse.primitives._axes import balanced_layout
from distfuse.primitives._axes_flagged import scatter_sum_blocks_flagged
from distfuse.primitives._common import dtype_code, dtype_of_code, first_order_only, gather_records
from distfuse.primitives.all_gather import agreed_all_gather
from distfuse.primitives.reduce_scatter import ReduceScatterFunction

__all__ = ["FUSED_FIRST_ORDER", "first_order_only", "agreed_seq_len", "agreed_input_gather",
           "agreed_matmul_reduce_scatter", "agreed_leading", "compute_dtype", "compute_dtype_of"]

_MAX_DIM = 8

#: What the fused linear paths tell a backward with create_graph=True (see ``first_order_only``).
FUSED_FIRST_ORDER = "the fused GEMM + collective (the unfused path, DISTFUSE_PATH=unfused, computes them exactly)"


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


def agreed_leading(layer, x: torch.Tensor) -> tuple[tuple[int, ...], torch.dtype]:
    """``DistributedLinear``'s leading extents and dtype when every worker holds an input block (no metadata).

    Every worker of the layer then holds the same leading extents, so a legitimate change
    changes every worker's input and every worker gathers the records
    (``layer._gathered``) and checks them.  While this worker's input repeats, the agreed
    record is reused and nothing is exchanged.  A worker whose input changed alone (a
    disagreement) gathers while its peers exchange data: no message of the new size is
    ever sent, so nothing aborts and nobody computes with it; every worker ends in a
    :class:`~distfuse.errors.CollectiveTimeoutError` after ``DISTFUSE_TIMEOUT``.  (No
    collective of this layer reaches every worker in forward, so there is nothing for
    the agreement flag to ride on.)
    """
    site = _site(layer)
    signature = (tuple(x.shape), x.dtype, x.device.type, compute_dtype(x))
    site.calls += 1
    if site.repeats(signature):
        return site.state
    site.slow_calls += 1
    try:
        state = layer._gathered(x)
    except DistfuseError:
        site.forget()
        raise
    site.settle(signature, state)
    return state


def _site(layer) -> AgreementSite:
    site = getattr(layer, "agreement", None)
    if site is None:
        site = layer.agreement = AgreementSite(type(layer).__name__)
    return site


def _check_sequence_blocks(layer, seq_len):
    """The sequence-parallel form's rule: blocks along dim -2 are the balanced decomposition of their sum."""
    op, P_m = layer._op, layer.P_m

    def check(shapes, dtype):
        n = sum(s[-2] for s in shapes)
        if seq_len is not None and n != int(seq_len):
            raise expect(op, "gathered sequence length (the sum of the workers' blocks) against seq_len", seq_len, n)
        for j, s in enumerate(shapes):
            if s[-1] != layer.in_features or s[-2] != block_extent(n, P_m, j):
                want = (*s[:-2], block_extent(n, P_m, j), layer.in_features)
                raise expect(op, f"input block of model-parallel worker {j} (world rank {layer.P_gather.ranks[j]}): "
                                 f"the balanced block of the gathered sequence length {n}", want, tuple(s))

    return check


def _check_feature_blocks(layer):
    """The feature form's rule: worker j holds block j of ``in_features``."""
    op, P_m = layer._op, layer.P_m

    def check(shapes, dtype):
        for j, s in enumerate(shapes):
            want = block_extent(layer.in_features, P_m, j)
            if s[-1] != want:
                raise expect(op, f"input feature extent of model-parallel worker {j} (world rank "
                                 f"{layer.P_gather.ranks[j]}; block {j} of in_features={layer.in_features})",
                             want, s[-1])

    return check


def agreed_seq_len(layer, x: torch.Tensor) -> int:
    """The gathered sequence length of the sequence-parallel all-gather linear, without a gather in steady state.

    Agreed on the first call (the slow path runs then: one gather whose result is
    dropped, with the checks of every worker's block) and then read from the agreed
    layout.  Should some worker's block have changed since, :func:`agreed_input_gather`
    learns it from the flag and uses the real blocks' length; the value returned here
    only feeds the path choice, which every worker makes from the same agreed value.
    """
    site = _site(layer)
    if site.fresh:
        agreed_input_gather(layer, x, None)
    return site.state[0].shape[-2]


def agreed_input_gather(layer, x: torch.Tensor, seq_len: int | None) -> torch.Tensor:
    """The all-gather linear's gathered input, its blocks checked under the agreement protocol.

    Without ``P_x`` the features are gathered (last dim), with ``P_x`` the sequence (dim -2).
    """
    check = _check_sequence_blocks(layer, seq_len) if layer.P_x is not None else _check_feature_blocks(layer)
    return agreed_all_gather(x, layer.P_gather, _site(layer), extra=(compute_dtype(x), seq_len), check=check,
                             op=layer._op)


# Record of the reduce-scatter linear's slow path: [ndim, input dtype, compute dtype, problem, shape...].
_OK, _BAD_DEVICE, _BAD_DTYPE, _TOO_MANY_DIMS = range(4)


def agreed_matmul_reduce_scatter(layer, x: torch.Tensor, W: torch.Tensor) -> torch.Tensor:
    """``reduce_scatter(x @ W.T)`` over ``layer.P_scatter`` with the inputs checked under the agreement protocol.

    What must agree is the input (rows, dtype): the partial sums' size follows from it.
    A worker whose input changed, or cannot be multiplied (a dtype other than the
    weight's outside autocast, an integer dtype), skips its GEMM and sends zeros of the
    agreed size with the flag; then every worker gathers the inputs' records and raises
    the same error, or agrees on the new size.  Under ``torch.autocast`` the partial sums
    (and so the output) are in the autocast dtype, as ``torch.nn.Linear``'s output.
    """
    op, P_sub, site = layer._op, layer.P_scatter, _site(layer)
    cdt = compute_dtype(x)
    problem = _OK
    if x.device.type != P_sub.device.type:
        problem = _BAD_DEVICE
    elif not x.is_floating_point() or (cdt == x.dtype and x.dtype != W.dtype):
        problem = _BAD_DTYPE
    elif x.dim() > _MAX_DIM:
        problem = _TOO_MANY_DIMS
    signature = (tuple(x.shape), x.dtype, cdt, x.device.type)
    partial: list = []

    def full() -> torch.Tensor:
        if not partial:
            partial.append(F.linear(x, W))
        return partial[0]

    def attempt(changed: bool):
        shape, dtype = site.state
        layout = balanced_layout(P_sub, shape)
        mine = full().detach() if not changed else torch.zeros(shape, dtype=dtype, device=P_sub.device)
        block, flagged = scatter_sum_blocks_flagged(op, P_sub, layout, mine, changed)
        if flagged:
            return None, True
        return ReduceScatterFunction.apply(full(), P_sub, layout, None, op, block), False

    def slow():
        rec = [min(x.dim(), _MAX_DIM), dtype_code(x.dtype), dtype_code(cdt), problem] + [-1] * _MAX_DIM
        if problem == _OK:
            rec[4:4 + x.dim()] = list(x.shape)
        rows = gather_records(op, P_sub, rec)
        _check_rows(layer, rows, W.dtype)
        shape = (*rows[0][4:4 + rows[0][0] - 1], layer.out_features)
        dtype = dtype_of_code(rows[0][2])
        y = full()
        layout = balanced_layout(P_sub, shape)
        return ReduceScatterFunction.apply(y, P_sub, layout, None, op), (tuple(shape), dtype)

    return run_agreed(site, signature, problem == _OK, attempt, slow)


def _check_rows(layer, rows, weight_dtype) -> None:
    """Every model-parallel worker's input record, checked alike on every worker (raises on all of them)."""
    op, P_sub = layer._op, layer.P_scatter
    for j, (r, w) in enumerate(zip(rows, P_sub.ranks, strict=True)):  # j: the worker's model-parallel index
        if r[3] == _BAD_DEVICE:
            raise expect(op, f"device type of the input on world rank {w}", P_sub.device.type, "another device")
        if r[3] == _BAD_DTYPE:
            raise ShapeError(f"{where(op)}: world rank {w} passed an input of dtype {dtype_of_code(r[1])}; the "
                             f"layer multiplies floating inputs of its weight's dtype {weight_dtype} (any floating "
                             "dtype under torch.autocast)")
        if r[3] == _TOO_MANY_DIMS:
            raise ShapeError(f"{where(op)}: world rank {w} passed an input of more than {_MAX_DIM} dimensions")
        want = block_extent(layer.in_features, layer.P_m, j)
        if r[4 + r[0] - 1] != want:
            raise expect(op, f"input feature extent on world rank {w} (block {j} of in_features="
                             f"{layer.in_features})", want, r[4 + r[0] - 1])
    first = rows[0]
    for r in rows:
        if r[0] != first[0] or r[4:4 + r[0] - 1] != first[4:4 + first[0] - 1] or r[1:3] != first[1:3]:
            got = ", ".join(f"world rank {v}: shape {tuple(q[4:4 + q[0]])} dtype {dtype_of_code(q[1])} computing in "
                            f"{dtype_of_code(q[2])}" for q, v in zip(rows, P_sub.ranks, strict=True))
            raise ShapeError(f"{where(op)}: the model-parallel workers must pass inputs with the same leading "
                             f"extents (rows) and dtype, computed in the same dtype (torch.autocast); got {got}")
