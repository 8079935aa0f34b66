"""The distributed losses inside ``torch.compile``: custom ops, no metadata gather, no host read.

Eager calls agree on the call's metadata under the agreement protocol (see ``loss``: the
metadata gather over ``P_x`` only on the first call and after a change) and remember the
agreed record (:class:`LossCall`: global shape, dtypes, this worker's block start) with
this worker's signature (input and target shapes, dtypes, device, the weights' shapes and
dtypes).  A compiled call reuses the record while its signature repeats::

    distfuse::flag_check          every worker's agreement flag over P_x (host round, first)
    value check                   entries torch would refuse, counted and replaced (traced tensor ops)
    local loss                    torch's own op on the block (traced)
    distfuse::replicated_total    [sum l, denominator, change flag, failure count per worker] summed
                                  over P_x; raises on every worker where a count is set (CPU)
                                  (adjoint: the identity, the loss is one replicated value)

The flag rides in a round of its own because ``reduction='none'`` has no collective at
all; a changed call joins it with its flag set and returns before anything else, so every
worker raises the same error (then one eager call agrees afresh).  A compiled call before
any eager call is refused on every worker.

Values torch refuses (a class index out of range that is not ``ignore_index``, a BCE
input or target outside [0, 1], NaN included): eager code catches torch's error around the local loss and
carries a failure flag in the reduction.  A compiled graph cannot catch, so with a
reduction it checks first, with tensor ops (``layer._safe_values``): it counts the bad
entries, replaces them with values torch accepts (``ignore_index``, 0.5; a good block is
untouched, so its loss and gradients are eager's bits), and puts the count in this
worker's failure slot of the reduction's message.  The check runs before torch's op, so on
CUDA torch's device-side asserts never fire.  ``distfuse::replicated_total`` reads the
summed slots inside its eager body (a CPU tensor: free) and raises the same
:class:`~distfuse.errors.ShapeError`, naming the bad workers' world ranks, on every worker;
nobody waits.  On a CUDA partition it does not read them (that would synchronise the
device every call): the graph turns the loss into NaN on every worker instead, as the
eager layer's NaN there.  ``reduction='none'`` has no reduction to carry a count: torch's
op runs on the raw block and raises on the bad worker alone (as in eager), with no
collective of this loss left for its peers to wait in.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from distfuse.errors import UnsupportedError, where
from distfuse.layers._norm_common import compute_dtype
from distfuse.ops.collectives import FlaggedSite
from distfuse.ops.flag_check import FlagRound, flag_check
from distfuse.ops.reductions import replicated_total
from distfuse.primitives._agreement import AgreementSite

__all__ = ["LossSites", "LossCall", "call_signature", "keep", "compiled_loss"]


class LossSites:
    """A loss's agreement site and the contexts its custom ops name by handle (made at construction)."""

    def __init__(self, op: str, P_x):
        self.op = op
        self.agreement = AgreementSite(op)
        self.kept = None  # the last (signature, record) settled (see keep)
        self.flag = FlagRound(op, P_x, self.agreement.forget)
        self.total = FlaggedSite(op, P_x, None)


@dataclass(frozen=True)
class LossCall:
    """What an eager call's metadata gather established (``start``: this worker's block start)."""

    global_shape: tuple[int, ...]
    in_dtype: torch.dtype
    t_dtype: torch.dtype
    start: tuple[int, ...]


def call_signature(input: torch.Tensor, target: torch.Tensor, weights: tuple[torch.Tensor, ...] = ()) -> tuple:
    """This worker's signature of a call: what the agreed record and the local loss's slicing depend on."""
    return (tuple(input.shape), input.dtype, tuple(target.shape), target.dtype, input.device.type,
            tuple((tuple(w.shape), w.dtype) for w in weights))


def keep(sites: LossSites, signature: tuple, record: LossCall) -> LossCall:
    """Settle an agreed record (after its checks passed on every worker); an equal record is kept as the same
    objects (the compiler guards on them: new ones would recompile after every slow eager call)."""
    kept = (signature, record)
    if sites.kept != kept:
        sites.kept = kept
    sites.agreement.settle(*sites.kept)
    return sites.kept[1]


def compiled_loss(layer, input: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """``layer.forward`` as traceable code: the flag round, torch's local loss, the replicated total."""
    sites: LossSites = layer._sites
    record: LossCall | None = sites.agreement.state
    if record is None:
        raise UnsupportedError(f"{where(sites.op)}: a compiled call needs the metadata the layer agrees on in eager "
                               "mode: call the layer once eagerly (every worker, same shapes) before the compiled "
                               "region")
    changed = call_signature(input, target, layer._weights()) != sites.agreement.signature
    flag_check(input, sites.flag.handle, changed)
    if changed:  # the flag round raises on every worker when the graph runs; nothing after it is traced
        return input.new_empty((0,))
    G, start = record.global_shape, record.start
    if layer.reduction == "none":
        return layer._local_loss(input, target, G, start)
    input, target, bad = layer._safe_values(input, target)  # before torch's op (see the module docstring)
    local = layer._local_loss(input, target, G, start)
    divisor = None if layer.reduction == "sum" else layer._mean_divisor(G, record.t_dtype)
    summed_divisor = layer.reduction != "sum" and divisor is None
    result_dtype = layer._result_dtype(record.in_dtype, record.t_dtype)
    partial = layer._partial(local, input, target, None, summed_divisor, compute_dtype(result_dtype), bad=bad)
    total = replicated_total(partial, sites.total.handle)  # raises on every worker on a bad CPU block
    loss = total[0] / total[1] if summed_divisor else total[0]
    if bad is not None and total.device.type != "cpu":  # no host read on a device: a NaN on every worker
        loss = torch.where(total[3:].sum() > 0, torch.full_like(loss, float("nan")), loss)
    return (loss if divisor is None else loss / divisor).to(result_dtype)
