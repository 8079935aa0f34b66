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
differ.  What the workers compare (the records, the compute dtype) and the checks every
worker applies alike to the gathered records are in ``_linear_records.py``; this module
holds when they are compared and what each path runs meanwhile.

``DistributedLinear`` has no collective that reaches every worker (its broadcast and
sum-reduce are point to point), so its flag takes a host round over the union of its
partitions before any data moves (:func:`agreed_leading`).

Local checks (a wrong feature extent, a ``seq_len`` that does not fit the block, a
wrong number of dimensions) do not raise on the worker that finds them: they set its
flag (``locally_ok=False``), every worker takes the slow path, and there the failing
workers' messages reach every worker
(:func:`~distfuse.primitives._agreement.agree_on_local_checks`), which all raise the
same error at once instead of leaving the peers in the collective until
``DISTFUSE_TIMEOUT``.

Inside :func:`~distfuse.primitives._agreement.capture_safe` (and while a CUDA stream
captures) a settled site whose signature repeats runs the plain collective with the
agreed sizes: no flag, no host read, no host collective; a different signature raises
:class:`~distfuse.errors.UnsupportedError` on that worker.

On the fused GEMM paths the worker whose local check failed still enters the fused op its
peers enter, under :func:`~distfuse.fused.agreement.refusing`: the op refuses with the
layer's error at its first claim (the ``REFUSED`` word), so the peers raise a
ShapeError naming the refusing rank and the worker its own error, with no host round
(:func:`fused_or_refuse`).  A non-tensor input is a failed local check like the others:
the worker runs the protocol with a stand-in of its last call's shape
(:func:`stand_in`), so that it takes the collective and the path its peers take.

Not covered: layers with one model-parallel worker (``P_m = 1``) and no ZeRO weight
gather: the worker takes part in the parameter broadcast and then raises, so its
data-parallel peers finish the forward, but under grad mode their backward's gradient
sum-reduce waits for it until ``DISTFUSE_TIMEOUT`` (no collective of the layer reaches
the peers from this worker in forward; a flag would need a host round per call).  The
ZeRO layers with several model-parallel workers on their fused path: where the
data-parallel row count is exchanged for the dispatch (CUDA, no forced path) that round
spans the grid and carries the failure (:func:`~distfuse.fused.zero_linear_dispatch.agreed_rows`);
elsewhere (CPU, ``DISTFUSE_PATH`` forced) the worker raises alone, since the plain
model-parallel collective of ``zero_linear`` carries no flag.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from distfuse.errors import DistfuseError, ShapeError, UnsupportedError, expect, where
from distfuse.geometry.decomposition import block_extent
from distfuse.layers._linear_records import _MAX_DIM, _autocast_code, compute_dtype
from distfuse.primitives._agreement import (
    AgreementSite,
    agree_on_local_checks,
    agreed_by_flag_round,
    run_agreed,
    trusting,
)
from distfuse.primitives._axes import balanced_layout
from distfuse.primitives._axes_flagged import scatter_sum_blocks_flagged
from distfuse.primitives._common import dtype_code, dtype_of_code, first_order_only, gather_records
from distfuse.primitives.all_gather import AllGatherFunction, agreed_all_gather
from distfuse.primitives.reduce_scatter import ReduceScatterFunction

__all__ = ["FUSED_FIRST_ORDER", "first_order_only", "agreed_seq_len", "agreed_input_gather",
           "agreed_matmul_reduce_scatter", "agreed_leading", "stand_in", "fused_or_refuse"]


#: What the fused linear paths tell a backward with create_graph=True (see ``first_order_only``).
FUSED_FIRST_ORDER = "the fused GEMM + collective (the unfused path, DISTFUSE_PATH=unfused, computes them exactly)"


def agreed_leading(layer, x: torch.Tensor, locally_ok: bool) -> tuple[tuple[int, ...], torch.dtype]:
    """``DistributedLinear``'s leading extents and dtype under the agreement protocol, the flag in a host round.

    No collective of the layer reaches every worker (the broadcast and the sum-reduce are
    point to point), so the flag takes a one-integer all-reduce over ``layer.P_all``
    before any data moves (:func:`~distfuse.primitives._agreement.agreed_by_flag_round`).
    A worker whose signature (shape, dtype, device, autocast, grad mode) changed, or whose
    input failed its local checks (``locally_ok`` False), sets its flag; then every
    worker gathers the records and checks them (``layer._gathered``), which returns the
    new agreed state or raises the same error on every worker.  A worker that holds no
    input passes a zero-volume tensor: its signature repeats, and the others' flags tell
    it about a change.
    """
    if not isinstance(x, torch.Tensor):  # a failed local check: it flags, and its record makes every worker raise
        signature, locally_ok = ("not a tensor", type(x).__name__), False
    else:
        signature = (tuple(x.shape), x.dtype, x.device.type, _autocast_code(x.device.type), torch.is_grad_enabled())
    return agreed_by_flag_round(_site(layer), layer.P_all, layer._op, signature, locally_ok,
                                lambda: layer._gathered(x))


def stand_in(layer, x, default_shape) -> torch.Tensor:
    """``x`` if it is a tensor of two dimensions or more; otherwise zeros shaped as this layer's last eager input
    (``default_shape`` before the first).

    The worker's input failed its local checks, and it must still take part in what its
    peers run (the row's collective, or the fused op whose claim carries its refusal),
    with sizes as close to theirs as it can know: those of its own previous call, the
    peers' too in steady state.  A tensor of two dimensions or more is used as it is (the
    dispatch reads its rows, and the slow path's checks name its shape).  On a first call
    the path the peers take is only guessed from ``default_shape`` (see the module doc).
    """
    if isinstance(x, torch.Tensor) and x.dim() >= 2:
        return x
    from distfuse.layers._linear_compiled import _RECORD

    rec = layer.__dict__.get(_RECORD)
    shape, dtype = (rec[0][0], rec[0][1]) if rec is not None else (tuple(default_shape), layer._param_dtype())
    return torch.zeros(shape, dtype=dtype, device=layer._param_device())


def fused_or_refuse(error: DistfuseError | None, run):
    """``run()``, a fused op, with this worker's local check failure (None: none) refused through the op's claim.

    The op's peers raise a ShapeError naming this worker, this worker raises ``error``
    (:func:`~distfuse.fused.agreement.refusing`); with no error ``run()`` is called as is.
    """
    if error is None:
        return run()
    from distfuse.fused.agreement import refusing

    with refusing(error):
        return run()


def _site(layer) -> AgreementSite:
    site = getattr(layer, "agreement", None)
    if site is None:
        site = layer.agreement = AgreementSite(type(layer).__name__)
    return site


def _check_seq_len(op: str, seq_len, shapes) -> None:
    """This worker's ``seq_len`` against the gathered blocks' length (each worker passes its own ``seq_len``)."""
    n = sum(s[-2] for s in shapes)
    if seq_len is not None and n != int(seq_len):
        raise expect(op, "gathered sequence length (the sum of the workers' blocks) against seq_len", seq_len, n)


def _check_sequence_blocks(layer):
    """The sequence-parallel form's rule: blocks along dim -2 are the balanced decomposition of their sum."""
    op, P_m = layer._op, layer.P_m

    def check(shapes, dtype):
        n = sum(s[-2] for s in shapes)
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


def _everywhere(P, op: str, error: DistfuseError | None, own=None, common=None):
    """The slow path's checks: this worker's own ones agreed on over ``P``, then the ones every worker shares.

    ``error`` (this worker's local check failure) and ``own(*args)`` (checks that depend on
    this worker's own arguments, such as its ``seq_len``) run under
    :func:`~distfuse.primitives._agreement.agree_on_local_checks`: a failure on any worker
    raises on every worker, naming each failing worker and its message.  ``common(*args)``
    evaluates gathered records alike everywhere, so it raises (or not) on every worker.
    """

    def checks(*args):
        def run():
            if error is not None:
                raise error
            if own is not None:
                own(*args)
        agree_on_local_checks(P, op, run)
        if common is not None:
            common(*args)

    return checks


def agreed_seq_len(layer, x: torch.Tensor, error: DistfuseError | None = None) -> int:
    """The gathered sequence length of the sequence-parallel all-gather linear, without a gather in steady state.

    Agreed on the first call (the slow path runs then: one gather whose result is
    dropped, with the checks of every worker's block) and then read from the agreed
    layout.  Should some worker's block have changed since, :func:`agreed_input_gather`
    learns it from the flag and uses the real blocks' length; the value returned here
    only feeds the path choice, which every worker makes from the same agreed value.
    ``error``: this worker's local check failure (see :func:`agreed_input_gather`).
    """
    site = _site(layer)
    if site.fresh:
        agreed_input_gather(layer, x, None, error)
    return site.state[0].shape[-2]


def agreed_input_gather(layer, x: torch.Tensor, seq_len: int | None,
                        error: DistfuseError | None = None) -> torch.Tensor:
    """The all-gather linear's gathered input, its blocks checked under the agreement protocol.

    Without ``P_x`` the features are gathered (last dim), with ``P_x`` the sequence (dim -2).
    ``error`` is this worker's local check failure (None: its input passed): it flags, and
    the slow path raises it on every worker of the row.  Inside ``capture_safe()`` a
    settled site whose signature repeats gathers with the agreed layout, unflagged.
    """
    op, P_sub, site = layer._op, layer.P_gather, _site(layer)
    extra = (compute_dtype(x), seq_len)
    if site.state is not None and trusting():  # capture-safe: no flag, no host read
        _trusted(site, op, (tuple(x.shape), x.dtype, x.device.type, *extra))
        layout, _ = site.state
        return AllGatherFunction.apply(x, P_sub, layout, None, op)
    if layer.P_x is not None:
        own, common = (lambda shapes, dtype: _check_seq_len(op, seq_len, shapes)), _check_sequence_blocks(layer)
    else:
        own, common = None, _check_feature_blocks(layer)
    return agreed_all_gather(x, P_sub, site, extra=extra, locally_ok=error is None,
                             check=_everywhere(P_sub, op, error, own, common), op=op)


def _trusted(site: AgreementSite, op: str, signature) -> None:
    """A call inside ``capture_safe()``: it must repeat the agreed signature (no flag can tell the peers otherwise)."""
    if signature != site.signature:
        raise UnsupportedError(f"{where(op)}: inside capture_safe() (or a CUDA-graph capture) a call must repeat the "
                               "inputs of the last eager call (shape, dtype, autocast); warm up with the captured "
                               "shapes on every worker")
    site.calls += 1


# Record of the reduce-scatter linear's slow path: [ndim, input dtype, compute dtype, problem, shape...].
_OK, _BAD_DEVICE, _BAD_DTYPE, _TOO_MANY_DIMS = range(4)


def agreed_matmul_reduce_scatter(layer, x: torch.Tensor, W: torch.Tensor,
                                 error: DistfuseError | None = None) -> torch.Tensor:
    """``reduce_scatter(x @ W.T)`` over ``layer.P_scatter`` with the inputs checked under the agreement protocol.

    What must agree is the input (rows, dtype): the partial sums' size follows from it.
    A worker whose input changed, or cannot be multiplied (a dtype other than the
    weight's outside autocast, an integer dtype), skips its GEMM and sends zeros of the
    agreed size with the flag; then every worker gathers the inputs' records and raises
    the same error, or agrees on the new size.  Under ``torch.autocast`` the partial sums
    (and so the output) are in the autocast dtype, as ``torch.nn.Linear``'s output.
    ``error`` is this worker's local check failure: it flags, and the slow path raises it
    on every worker.  Inside ``capture_safe()`` a settled site whose signature repeats
    reduce-scatters with the agreed layout, unflagged.
    """
    op, P_sub, site = layer._op, layer.P_scatter, _site(layer)
    cdt = compute_dtype(x)
    signature = (tuple(x.shape), x.dtype, cdt, x.device.type)
    if site.state is not None and trusting():  # capture-safe: no flag, no host read
        _trusted(site, op, signature)
        return ReduceScatterFunction.apply(F.linear(x, W), P_sub, balanced_layout(P_sub, site.state[0]), None, op)
    problem = _OK
    if x.device.type != P_sub.device.type:
        problem = _BAD_DEVICE
    elif not x.is_floating_point() or (cdt == x.dtype and x.dtype != W.dtype):
        problem = _BAD_DTYPE
    elif x.dim() > _MAX_DIM:
        problem = _TOO_MANY_DIMS
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
        _everywhere(P_sub, op, error)()  # a local check that failed anywhere raises here, on every worker
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

    return run_agreed(site, signature, problem == _OK and error is None, attempt, slow)


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
