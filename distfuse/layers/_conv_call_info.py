"""Per-call metadata of the distributed convolutions: what every worker learns of every other's input.

* :func:`gather_call_info` is the host-side collective that tells every worker of the
  layer's partitions every other's ``(shape, dtype, requires_grad flags, autocast)``, so
  that workers holding no input learn the global shape and the dtype, and so that every
  worker agrees on whether the adjoints run.  Every convolution runs it only on its
  first call and when some worker's inputs changed (the layer's
  :class:`~distfuse.primitives.agreement_session.AgreementSession`; the general and
  channel convolutions' flag is a one-element host all-reduce, the feature and
  transposed convolutions' rides in their parameter broadcast).  That
  agreement matters: a worker
  whose received block does not require grad never runs its Broadcast adjoint, and
  its source then waits for that gradient until the process-group timeout.  With
  ``DISTFUSE_DEBUG=1`` it first checks that every worker is calling the same layer
  (its options and partitions), so that ranks that call layers in different orders
  fail with :class:`~distfuse.errors.CollectiveMismatchError` instead of exchanging
  blocks of different layers.
* **Autocast.**  Under ``torch.autocast`` a convolution runs in the autocast dtype, as
  ``torch.nn.ConvNd`` does: :func:`autocast_dtype` gives it, the layers cast the input
  (before its halo exchange, which then moves the smaller dtype) and the replicated
  parameters to it, and :func:`~distfuse.layers._conv_common.conv_block` runs with
  autocast off (so that its fp32 computation of 16-bit CPU convolutions is not cast
  back).  The output has the autocast dtype and the parameters' gradients their own
  dtype, as torch's.
* **Memory format.**  A ``channels_last`` input gives a ``channels_last`` output wherever
  ``torch.nn.ConvNd`` does (CPU Conv2d and CUDA convolutions do; torch 2.13's CPU Conv3d
  returns NCDHW): the halo exchange stages in the input's format,
  :func:`~distfuse.layers._conv_common.conv_block` then computes in it, and
  :func:`~distfuse.layers._conv_common.conv_output_format` asks torch which format its
  convolution returns.  :func:`gather_call_info` exchanges the input's format, because
  workers that hold only weights or outputs never see the input, and the channel and
  general convolutions move their blocks in the agreed format.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from distfuse import debug
from distfuse._compat import all_gather_flat
from distfuse.errors import CollectiveMismatchError, ShapeError, expect, where
from distfuse.geometry.decomposition import local_shape
from distfuse.partition import CartesianPartition, Partition
from distfuse.primitives._common import collective_guard

__all__ = ["CallInfo", "gather_call_info", "autocast_dtype", "cast_for_compute", "local_call_checks",
           "call_signature", "passes_local_checks"]


_DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16]
_MAX_DIM = 5  # [B, C, D, H, W]
# ndim, x dtype, x requires grad, params require grad, param dtype, problem, autocast dtype, layer hash, layout bits
_HEAD = 9
_DENSE, _DENSE_CL = 1, 2  # layout bits: the block is dense in NCHW order / in channels_last(_3d) order
_OK, _BAD_DEVICE, _BAD_DTYPE, _TOO_MANY_DIMS, _NOT_EMPTY = range(5)


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The dtype ``torch.autocast`` computes convolutions in on ``device_type`` now, or None when it is off."""
    if not torch.is_autocast_enabled(device_type):
        return None
    return torch.get_autocast_dtype(device_type)


def cast_for_compute(t: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """``t`` in the compute dtype, as autocast casts a convolution's arguments (float64 is never cast)."""
    if t is None or t.dtype == dtype or not t.is_floating_point() or t.dtype == torch.float64:
        return t
    return t.to(dtype)


@dataclass(frozen=True)
class CallInfo:
    """What every worker of a layer learns from one call's metadata gather.

    ``input_grad`` / ``param_grad``: some worker's input / parameter requires grad
    (with grad mode on), so every worker must take part in that adjoint.
    ``param_dtype``: the parameters' dtype (``dtype`` for layers without parameters);
    ``compute_dtype``: what the convolution computes in, the autocast dtype when every
    worker is under ``torch.autocast`` (and the input is not float64), else ``dtype``.
    ``memory_format``: ``channels_last`` (``_3d``) when every P_x block is dense in it and
    some is not plainly contiguous (blocks dense in both, such as one channel, agree with
    either), else contiguous.
    """

    global_shape: tuple[int, ...]
    dtype: torch.dtype
    input_grad: bool
    param_grad: bool
    param_dtype: torch.dtype | None = None
    compute_dtype: torch.dtype | None = None
    memory_format: torch.memory_format = torch.contiguous_format  # the input's, agreed (see gather_call_info)


def local_call_checks(P_x: CartesianPartition, x: torch.Tensor) -> int:
    """This worker's problem code for :func:`gather_call_info` (``_OK`` when its input passes the local checks)."""
    if P_x.active:
        if x.device.type != P_x.device.type:
            return _BAD_DEVICE
        if x.dtype not in _DTYPES:
            return _BAD_DTYPE
        if x.dim() > _MAX_DIM:
            return _TOO_MANY_DIMS
        return _OK
    return _NOT_EMPTY if x.numel() != 0 else _OK


def passes_local_checks(P_x: CartesianPartition, x: torch.Tensor) -> bool:
    """Whether this worker's input passes :func:`local_call_checks` and has one dimension per dimension of P_x."""
    return local_call_checks(P_x, x) == _OK and (not P_x.active or x.dim() == P_x.dim)


def gather_call_info(op: str, P_union: Partition, P_x: CartesianPartition, x: torch.Tensor,
                     params: Sequence[torch.Tensor], signature=None) -> CallInfo:
    """All-gather ``(shape, dtype, grad flags, autocast)`` over ``P_union`` (host gloo, 12 int64 per worker).

    Every worker validates every record, so a bad block raises the same error on every
    worker instead of a hang: the input must be the balanced decomposition of one
    global shape over ``P_x``, in one floating dtype, equal to the parameters' dtype
    unless the workers run under ``torch.autocast`` (then every worker must, with one
    autocast dtype: the halo and broadcast messages travel in it); workers outside
    ``P_x`` pass zero-volume tensors.  ``signature`` (the layer's options and partitions)
    is compared across workers, as a digest (:class:`~distfuse.errors.CollectiveMismatchError`
    when workers call different layers here), and in full in debug mode.
    """
    if signature is not None and debug.enabled():
        debug.check_agreement(op, P_union.ranks, P_union.meta_group, same={"layer": signature},
                              info={"local shape": tuple(x.shape)})
    grad_on = torch.is_grad_enabled()
    rec = torch.full((_HEAD + _MAX_DIM,), -1, dtype=torch.int64)
    problem = local_call_checks(P_x, x)
    ac = autocast_dtype(P_x.device.type)
    rec[0] = x.dim()
    rec[1] = _DTYPES.index(x.dtype) if x.dtype in _DTYPES else -1
    rec[2] = int(grad_on and x.requires_grad)
    rec[3] = int(grad_on and any(p.requires_grad for p in params))
    rec[4] = _DTYPES.index(params[0].dtype) if params and params[0].dtype in _DTYPES else -1
    rec[5] = problem
    rec[6] = _DTYPES.index(ac) if ac in _DTYPES else (-1 if ac is None else -2)
    # A stable digest of the layer (options, partitions): ranks that call different layers here (a program-order
    # bug) raise instead of moving one layer's parameters into another's buffers.
    rec[7] = zlib.crc32(repr(signature).encode()) if signature is not None else -1
    cl = {4: torch.channels_last, 5: torch.channels_last_3d}.get(x.dim())
    rec[8] = (_DENSE if x.is_contiguous() else 0) | (_DENSE_CL if cl is not None and x.is_contiguous(
        memory_format=cl) else 0)
    if problem == _OK and P_x.active:
        rec[_HEAD:_HEAD + x.dim()] = torch.tensor(x.shape, dtype=torch.int64)
    out = torch.empty(P_union.size * rec.numel(), dtype=torch.int64)
    with collective_guard(op, "metadata all-gather", P_union.ranks):
        all_gather_flat(out, rec, group=P_union.meta_group)
    # Slot g of the gather belongs to the g-th smallest world rank (new_group sorts its ranks), which is not
    # partition rank g when P_union lists its ranks out of order (a feature conv's P_x may).
    rows = dict(zip(sorted(P_union.ranks), out.view(P_union.size, -1).tolist(), strict=True))
    for w, r in rows.items():
        if r[5] == _BAD_DEVICE:
            raise expect(op, f"device type of the input on world rank {w}", P_x.device.type, "another device")
        if r[5] == _BAD_DTYPE:
            raise ShapeError(f"{where(op)}: world rank {w} passed a non-floating input; expected one of "
                             f"{[str(d) for d in _DTYPES]}")
        if r[5] == _TOO_MANY_DIMS or (w in P_x.ranks and r[0] != P_x.dim):
            raise expect(op, f"number of input dimensions on world rank {w} ([batch, channel, spatial...], one per "
                         "dimension of P_x)", P_x.dim, r[0])
        if r[5] == _NOT_EMPTY:
            raise ShapeError(f"{where(op)}: world rank {w} is not in P_x, so it must pass a zero-volume tensor")
    if len({r[7] for r in rows.values()}) != 1:
        digests = dict(sorted((w, r[7]) for w, r in rows.items()))
        raise CollectiveMismatchError(f"{where(op)}: the workers are not calling the same layer (their options or "
                                      "partitions differ; call the layers in the same order on every worker): layer "
                                      f"digests {digests} (world rank: digest)")
    x_rows = [rows[w] for w in P_x.ranks]
    dtypes = {r[1] for r in x_rows}
    if len(dtypes) != 1:
        got = {w: str(_DTYPES[rows[w][1]]) for w in P_x.ranks}
        raise ShapeError(f"{where(op)}: the workers of P_x must pass one dtype; got {got} (world rank: dtype)")
    dtype = _DTYPES[dtypes.pop()]
    autocasts = {r[6] for r in rows.values()}
    if len(autocasts) != 1 or -2 in autocasts:
        got = {w: ("off" if r[6] == -1 else str(_DTYPES[r[6]]) if r[6] >= 0 else "unsupported") for w, r in
               rows.items()}
        raise ShapeError(f"{where(op)}: every worker must run this layer under the same torch.autocast state (its "
                         f"dtype is what the exchanges carry); got {got} (world rank: autocast dtype)")
    ac_code = autocasts.pop()
    param_dtypes = {r[4] for r in rows.values() if r[4] >= 0}
    if len(param_dtypes) > 1:
        raise ShapeError(f"{where(op)}: the workers' parameters must share one dtype; got "
                         f"{ {w: str(_DTYPES[r[4]]) for w, r in rows.items() if r[4] >= 0} } (world rank: dtype)")
    if ac_code < 0 and param_dtypes and param_dtypes != {_DTYPES.index(dtype)}:
        raise expect(op, "input dtype (the parameters' dtype, as torch's ConvNd requires outside torch.autocast)",
                     [str(_DTYPES[c]) for c in sorted(param_dtypes)], str(dtype))
    param_dtype = _DTYPES[param_dtypes.pop()] if param_dtypes else dtype
    compute = _DTYPES[ac_code] if ac_code >= 0 and dtype != torch.float64 else dtype
    layouts = [r[8] for r in x_rows]
    channels_last = all(b & _DENSE_CL for b in layouts) and not all(b & _DENSE for b in layouts)
    fmt = {4: torch.channels_last, 5: torch.channels_last_3d}.get(P_x.dim) if channels_last else None
    shapes = [tuple(r[_HEAD:_HEAD + P_x.dim]) for r in x_rows]
    G = tuple(sum(shapes[P_x.rank_of([k if e == d else 0 for e in range(P_x.dim)])][d] for k in range(P_x.shape[d]))
              for d in range(P_x.dim))
    for r, shape in enumerate(shapes):
        want = local_shape(G, P_x.shape, P_x.index_of(r))
        if shape != want:
            raise expect(op, f"local input shape on world rank {P_x.ranks[r]} (P_x index {P_x.index_of(r)}; the blocks "
                         f"must be the balanced decomposition of the global shape {G} inferred from them)", want, shape)
    return CallInfo(G, dtype, any(r[2] for r in rows.values()), any(r[3] for r in rows.values()), param_dtype,
                    compute, fmt or torch.contiguous_format)


def call_signature(x: torch.Tensor, params: Sequence[torch.Tensor]) -> tuple:
    """This worker's signature of a call: everything of its own that :func:`gather_call_info` records.

    Local shape, dtype, device type, grad mode, the input's and the parameters'
    ``requires_grad`` and dtype, autocast, and the layout bits (dense in NCHW, dense in
    ``channels_last``): while it repeats on every worker the agreed :class:`CallInfo` holds.
    """
    cl = {4: torch.channels_last, 5: torch.channels_last_3d}.get(x.dim())
    layout = (x.is_contiguous(), cl is not None and x.is_contiguous(memory_format=cl))
    return (tuple(x.shape), x.dtype, x.device.type, torch.is_grad_enabled(), x.requires_grad,
            tuple((p.requires_grad, p.dtype) for p in params), autocast_dtype(x.device.type), layout)
