"""The normalisation layers' agreement on a call, eager (:func:`agree_call`) and inside ``torch.compile``.

Eager calls follow the agreement protocol (:mod:`distfuse.primitives._agreement`).  Every
worker keeps its signature of the last call (shape, dtype, device, grad mode and flags, the
parameters' dtypes and grad flags, training) and the record every worker agreed on then
(:class:`NormCall`).  While every worker's signature repeats, a call costs one flag round
(a one-element host all-reduce over ``P_x``, before any data moves) and no metadata
gather.  When some worker's signature changed, every worker sees the flag and all gather
the call's metadata over ``P_x`` and check it together (``_norm_common.gather_call``), so
a disagreement raises the same error everywhere and a legitimate change agrees afresh.
The first call gathers directly; inside :func:`~distfuse.primitives._agreement.capture_safe`
a settled record is trusted (no round).  A compiled call reuses the record while its
signature repeats; the compiler guards on the signature, so a changed call retraces with
``changed`` set.  Communication inside a compiled graph (see :mod:`distfuse.ops`)::

    distfuse::flag_check          every worker's agreement flag, over P_x (host round, first)
    distfuse::moments             the (count, mean, M2) all-gather over P_stats, Chan combine
    distfuse::normalize           xhat [* w + b]; adjoint distfuse::normalize_backward (all-reduce over P_stats)
    distfuse::replicate           a replicated weight or bias; adjoint distfuse::all_sum over P_rep
    distfuse::all_sum             instance norm's running statistics over the batch workers

Why a flag round of its own rather than a flag in the statistics gather (eager and
compiled alike): the norms' data collectives run over sub-grids (``P_stats``, ``P_rep``),
which reach every worker of ``P_x`` only in special layouts (a batch norm whose channels
are not split), and an eval-mode batch norm or instance norm with running statistics has
none at all; a flag must reach every worker or those outside the changed worker's
sub-grid would run on and wait in the next layer.  The round replaces the metadata
all-gather (a one-element host all-reduce against ``11 x`` int64 per tensor and worker,
no device read, so no CUDA sync).  A compiled call that changed joins the round with its
flag set and returns before anything else, so every worker raises the same error; one
eager call then agrees afresh.  A compiled call before any eager call is refused on every worker.

A worker whose input (or parameter) does not require grad while a peer's does would skip
the adjoint collective its peers wait in; eager code promotes it to a leaf that requires
grad, which a graph cannot create, so a compiled call flags such a call instead.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from distfuse.errors import UnsupportedError, where
from distfuse.layers._norm_common import (
    CallRecord,
    Moments,
    compute_dtype,
    gather_moments,
    sum_replica_grads,
)
from distfuse.layers._norm_common import normalize as eager_normalize
from distfuse.ops import norm_collectives as norm_ops
from distfuse.ops.collectives import FlaggedSite
from distfuse.ops.flag_check import FlagRound, flag_check
from distfuse.ops.reductions import all_sum as all_sum_op
from distfuse.ops.reductions import replicate
from distfuse.primitives._agreement import AgreementSite, agreed_by_flag_round
from distfuse.primitives._axes import all_reduce_sum

__all__ = ["NormSites", "NormCall", "call_signature", "agree_call", "compiled_call", "moments", "normalize", "replica",
           "all_sum"]


class NormSites:
    """A norm layer's agreement site and the contexts its custom ops name by handle (made at construction,
    in the same order on every rank, so every rank's graph names the same handles)."""

    def __init__(self, op: str, P_x, P_stats, P_rep=None, P_batch=None):
        self.op = op
        self.agreement = AgreementSite(op)
        self.kept = None  # the last (signature, record) settled (see _keep)
        self.flag = FlagRound(op, P_x, self.agreement.forget)
        self.stats = FlaggedSite(op, P_stats, None)
        self.rep = FlaggedSite(op, P_rep, None) if P_rep is not None else None
        self.batch = FlaggedSite(op, P_batch, None) if P_batch is not None else None


@dataclass(frozen=True)
class NormCall:
    """What an eager call's metadata gather established, the same on every worker."""

    global_shape: tuple[int, ...]
    dtype: torch.dtype
    call: CallRecord


def call_signature(x: torch.Tensor, params: Sequence[torch.Tensor], training: bool) -> tuple:
    """This worker's signature of a call: what decides the agreed record and which adjoints run."""
    grad_on = torch.is_grad_enabled()
    return (tuple(x.shape), x.dtype, x.device.type, grad_on, x.requires_grad,
            tuple((p.dtype, p.requires_grad) for p in params), bool(training))


def agree_call(sites: NormSites, P_x, x: torch.Tensor, params: Sequence[torch.Tensor], training: bool,
               slow: Callable[[], NormCall]) -> NormCall:
    """An eager call's agreed record: one flag round while every worker's call repeats, else ``slow()``.

    ``slow()`` gathers the metadata and checks it (raising the same error on every worker);
    its record is remembered with this call's signature (see :func:`_keep`).  No local
    check is needed before the round: the signature holds everything the checks read, and
    a signature that repeats passed them when it was agreed.
    """
    site = sites.agreement
    before = site.slow_calls
    signature = call_signature(x, params, training)
    record = agreed_by_flag_round(site, P_x, sites.op, signature, True, slow)
    if site.slow_calls != before:
        record = _keep(sites, signature, record)
    return record


def _keep(sites: NormSites, signature: tuple, record: NormCall) -> NormCall:
    """Settle ``record``; one equal to the last is kept as the same objects: the compiler guards on them, and new
    objects after every slow call would recompile the graph."""
    kept = (signature, record)
    if sites.kept != kept:
        sites.kept = kept
    sites.agreement.settle(*sites.kept)
    return sites.kept[1]


def compiled_call(layer, x: torch.Tensor, params: Sequence[torch.Tensor], training: bool,
                  x_needed: Callable[[CallRecord], bool],
                  params_needed: Callable[[CallRecord], bool]) -> tuple[NormCall | None, bool]:
    """Inside a compiled region: the agreed record and whether this call flagged, after the flag round.

    ``x_needed(call)`` / ``params_needed(call)``: whether the eager call would promote the
    input / the parameters (some worker's adjoint needs this worker's); a call that would
    is flagged (see the module docstring).  Returns ``(record, changed)``; with ``changed``
    the caller returns at once (the round raises on every worker when the graph runs).
    """
    sites: NormSites = layer._sites
    record: NormCall | None = sites.agreement.state
    if record is None:
        raise UnsupportedError(f"{where(sites.op)}: a compiled call needs the metadata the layer agrees on in eager "
                               "mode: call the layer once eagerly (every worker, same shapes and grad settings) "
                               "before the compiled region")
    grad_on = torch.is_grad_enabled()
    changed = call_signature(x, params, training) != sites.agreement.signature
    if not changed:
        lacks_x = x_needed(record.call) and not (grad_on and x.requires_grad)
        lacks_p = params_needed(record.call) and not all(grad_on and p.requires_grad for p in params)
        changed = lacks_x or lacks_p
    flag_check(x, sites.flag.handle, changed)
    return record, changed


# ---------------------------------------------------------------- eager or custom op, by context


def moments(site: FlaggedSite, x3: torch.Tensor, count: int) -> Moments:
    """:func:`~distfuse.layers._norm_common.gather_moments` over ``site.P_sub`` (``distfuse::moments`` compiled)."""
    if torch.compiler.is_compiling():
        mean, var = norm_ops.moments(x3.detach(), site.handle, count)
        return Moments(mean, var, count)
    return gather_moments(site.op, site.P_sub, x3, count)


def normalize(site: FlaggedSite, x3: torch.Tensor, stats: Moments, eps: float, weight: torch.Tensor | None = None,
              bias: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`~distfuse.layers._norm_common.normalize` (``distfuse::normalize`` compiled); compute dtype out."""
    if torch.compiler.is_compiling():
        cdt = compute_dtype(x3.dtype)
        return norm_ops.normalize(x3, weight, bias, stats.mean.to(cdt), stats.invstd(eps, cdt), site.handle,
                                  stats.count)
    return eager_normalize(x3, stats, eps, site.P_sub, site.op, weight, bias)


def replica(site: FlaggedSite, w: torch.Tensor | None, any_grad: bool) -> torch.Tensor | None:
    """:func:`~distfuse.layers._norm_common.sum_replica_grads` over ``site.P_sub`` (``distfuse::replicate``)."""
    if not torch.compiler.is_compiling():
        return sum_replica_grads(w, site.P_sub, site.op, any_grad)
    if w is None or site.P_sub.size == 1 or not any_grad:
        return w
    return replicate(w, site.handle)


def all_sum(site: FlaggedSite, t: torch.Tensor) -> torch.Tensor:
    """The sum of ``t`` over ``site.P_sub``, no autograd (``distfuse::all_sum`` compiled)."""
    if torch.compiler.is_compiling():
        return all_sum_op(t, site.handle)
    return all_reduce_sum(site.op, site.P_sub, t)
