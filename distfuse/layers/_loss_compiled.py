"""The distributed losses inside ``torch.compile``: custom ops, no metadata gather, no host read.

Eager calls agree on the call's metadata under the agreement protocol (see ``loss``: the
metadata gather over ``P_x`` only on the first call and after a change) and remember the
agreed record (:class:`LossCall`: global shape, dtypes, this worker's block start) with
this worker's signature (input and target shapes, dtypes, device, the weights' shapes and
dtypes).  A compiled call reuses the record while its signature repeats::

    distfuse::flag_check          every worker's agreement flag over P_x (host round, first)
    local loss                    torch's own op on the block (traced)
    distfuse::replicated_total    [sum l, denominator, change flag, failure flags] summed over P_x
                                  (adjoint: the identity, the loss is one replicated value)

The flag rides in a round of its own because ``reduction='none'`` has no collective at
all; a changed call joins it with its flag set and returns before anything else, so every
worker raises the same error (then one eager call agrees afresh).  A compiled call before
any eager call is refused on every worker.

Not carried into a compiled graph: the eager layer's conversion of torch's own value
errors (a class index out of range, a probability outside [0, 1]) into an error on every
worker.  Eager code catches them around the local loss; a compiled graph raises them on
the worker whose block is bad, and its peers wait in the reduction until
``DISTFUSE_TIMEOUT`` (``CollectiveTimeoutError``).  Validate targets eagerly if they may be bad.
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
    local = layer._local_loss(input, target, G, start)
    if layer.reduction == "none":
        return local
    divisor = None if layer.reduction == "sum" else layer._mean_divisor(G, record.t_dtype)
    summed_divisor = layer.reduction != "sum" and divisor is None
    result_dtype = layer._result_dtype(record.in_dtype, record.t_dtype)
    partial = layer._partial(local, input, target, None, summed_divisor, compute_dtype(result_dtype))
    total = replicated_total(partial, sites.total.handle)
    loss = total[0] / total[1] if summed_divisor else total[0]
    return (loss if divisor is None else loss / divisor).to(result_dtype)
