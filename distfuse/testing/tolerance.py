"""Tolerances derived from the arithmetic: the dtype's unit roundoff, the length of the sums, the number of steps.

A distributed result and its sequential reference are the same sums added in a different
order (split over workers, blocked differently by another CPU kernel), so they differ by
rounding error, whose bound is a property of the arithmetic, not of the machine the numbers
were first seen on.  One relative bound covers every check:

    eps(n)        = r * u  +  lam * sqrt(n) * u_acc            one step
    bound(n, k)   = safety * ((1 + eps(n))**k - 1)             k steps (~ safety * k * eps(n))

* ``u`` is the unit roundoff of the dtype (half its machine epsilon: 2**-24 for float32)
  and ``u_acc`` that of the accumulation (float32 for 16-bit dtypes, else the dtype).
* ``lam * sqrt(n) * u_acc`` bounds the error of a sum of ``n`` terms relative to the sum of
  their magnitudes.  Summing in any order commits at most ``n`` roundings ``delta_i``
  (``|delta_i| <= u``), each multiplying a partial sum ``p_i`` with ``|p_i| <= sum |x|``; to
  first order the error is ``sum delta_i p_i``.  With the roundings independent and of mean
  zero (Higham and Mary, SIAM J. Sci. Comput. 41(5), 2019), Azuma-Hoeffding bounds it by
  ``lam * u * sqrt(sum p_i**2) <= lam * sqrt(n) * u * sum |x|`` except with probability
  ``2 exp(-lam**2 / 2)``: ``lam = 6`` gives 3e-8 per sum.  The deterministic
  ``gamma_n = n u / (1 - n u)`` grows with ``n`` where measured errors grow with ``sqrt(n)``
  (10 times wider at ``n = 3456``).
* ``r * u`` (``r = 2``): roundings to the storage dtype on the way (the output and an
  intermediate such as a send buffer, or one truncation, which errs by up to 2u).
  Negligible in float32 and float64; dominant in float16/bfloat16.
* ``safety = 2``: a second set of ``n`` roundings on the path (an inner product rounds its
  products as well as its partial sums; a gradient is a sum of products of a backward signal
  that is itself a sum), whose errors add.  The majorant ``sqrt(sum p_i**2) <= sqrt(n) sum |x|``
  is itself loose, so the factor is not stretched by a third set.
* Steps compound as relative errors do, ``(1 + eps)**k - 1`` (``k * eps`` to first order):
  each training step adds its own rounding, and a stable step (a learning rate below
  2 / the curvature) does not amplify the error already there.

The bound is relative to the magnitude of the terms summed, not to the result: a sum that
cancels keeps the error of its terms.  So every check needs an absolute floor on the scale
of those terms, and for a trained state that is its layer's scale, not the tensor's own
(:func:`compare_state`): a batch norm's bias that moved from 0 to 1e-4 was updated from the
same activations and gradients as its weight, of order 1.

A trained state obeys such a bound only if training is a continuous function of the
rounding.  A ReLU is not (a pre-activation within rounding of zero switches a whole term of
the next gradient on or off), so the demos use SiLU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["LAMBDA", "SAFETY", "STORE_ROUNDINGS", "unit_roundoff", "accumulation_dtype", "rounding_bound",
           "StateComparison", "compare_state"]

#: Tail parameter of the probabilistic bound: a sum exceeds ``LAMBDA * sqrt(n) * u * sum|x|`` with
#: probability at most ``2 exp(-LAMBDA**2 / 2)`` = 3e-8.
LAMBDA = 6.0
#: A second set of ``n`` roundings on the path (an inner product's products; a gradient of a sum), whose errors add.
SAFETY = 2.0
#: Roundings to the storage dtype on the way (output and one intermediate, or one truncation).
STORE_ROUNDINGS = 2


def unit_roundoff(dtype: torch.dtype) -> float:
    """``u``: the largest relative error of one rounding to nearest in ``dtype`` (half its machine epsilon)."""
    return torch.finfo(dtype).eps / 2


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """The precision sums of ``dtype`` values are carried in: float32 for 16-bit dtypes (torch's CPU and CUDA
    kernels and distfuse's Triton kernels accumulate them in float32), else the dtype itself."""
    return dtype if torch.finfo(dtype).bits >= 32 else torch.float32


def rounding_bound(dtype: torch.dtype, terms: int = 1, steps: int = 1, *, roundings: int = STORE_ROUNDINGS,
                   lam: float = LAMBDA, safety: float = SAFETY) -> float:
    """The relative error bound ``safety * ((1 + r u + lam sqrt(terms) u_acc)**steps - 1)`` (see the module).

    Args:
        dtype: the dtype the result is computed and stored in.
        terms: the length of the longest sum behind the result (the reduction of a GEMM or a
            convolution, ``in_channels * kernel volume``; the rows a weight gradient or a
            batch norm's statistics sum over; the elements a mean divides by).
        steps: how many times the result was fed back into itself (training steps).
        roundings, lam, safety: the constants of the derivation, for a check that states why it departs.

    The result is relative to the magnitude of the terms: apply it as ``rtol`` and, times the
    terms' scale, as ``atol``.
    """
    if terms < 1 or steps < 1:
        raise ValueError(f"terms and steps must be positive, got terms={terms}, steps={steps}")
    eps = roundings * unit_roundoff(dtype) + lam * math.sqrt(terms) * unit_roundoff(accumulation_dtype(dtype))
    return safety * math.expm1(steps * math.log1p(eps))


@dataclass(frozen=True)
class StateComparison:
    """The worst tensor of a state comparison: its error, the error allowed it, and their ratio (<= 1 passes)."""

    key: str
    error: float
    allowed: float
    bound: float

    @property
    def ratio(self) -> float:
        return self.error / self.allowed if self.allowed > 0 else (math.inf if self.error > 0 else 0.0)

    @property
    def ok(self) -> bool:
        return self.error <= self.allowed


def _layer_max(tensors: dict[str, torch.Tensor]) -> dict[str, float]:
    """The largest magnitude per module (the key up to its last dot) over its floating tensors."""
    out: dict[str, float] = {}
    for key, t in tensors.items():
        if t.is_floating_point() and t.numel():
            layer = key.rpartition(".")[0]
            out[layer] = max(out.get(layer, 0.0), float(t.detach().double().abs().max()))
    return out


def compare_state(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], dtype: torch.dtype, terms: int,
                  steps: int, start: dict[str, torch.Tensor] | None = None) -> StateComparison:
    """Compare two ``state_dict`` s of one model in float64; returns the tensor nearest its allowance.

    ``want`` is the reference, ideally the same model trained in float64 from the same
    ``start``.  The floating tensors of one module (``enc1.1.weight``, ``.bias``,
    ``.running_var``) share one allowance, on the module's scales, never on a tensor's own
    largest value (which for a tensor near zero turns rounding into a failure):

        rounding_bound(dtype, terms, steps) * moved  +  safety * ((1 + u)**steps - 1) * size

    ``size`` is the module's largest value: each step stores every value once more, one
    rounding of at most ``u |w|`` (no sum behind it, so no ``sqrt(n)``).
    ``moved`` is the module's largest change from ``start``: the updates, sums of
    ``terms`` terms, are rounded relative to their own size (``steps`` times the bound
    leaves room for updates that partly cancel).  Without ``start``, ``moved`` is ``size``:
    a looser check.  Integer tensors (``num_batches_tracked``) must be equal.
    """
    if set(got) != set(want) or (start is not None and set(start) != set(want)):
        raise ValueError(f"the states hold different tensors: {sorted(set(got) ^ set(want))}")
    bound = rounding_bound(dtype, terms, steps)
    stored = rounding_bound(dtype, 1, steps, roundings=1, lam=0.0)
    sizes = _layer_max(want)
    moved = sizes if start is None else _layer_max(
        {k: v.detach().cpu().double() - start[k].detach().cpu().double() for k, v in want.items()
         if v.is_floating_point()})
    worst = StateComparison("", 0.0, math.inf, bound)
    for key, ref in want.items():
        a, b = got[key].detach().cpu(), ref.detach().cpu()
        if a.shape != b.shape:
            raise ValueError(f"{key}: shape {tuple(a.shape)} != {tuple(b.shape)}")
        if not b.is_floating_point():
            if not torch.equal(a, b):
                return StateComparison(key, math.inf, 0.0, bound)
            continue
        err = float((a.double() - b.double()).abs().max()) if b.numel() else 0.0
        if math.isnan(err):
            return StateComparison(key, math.inf, 0.0, bound)
        layer = key.rpartition(".")[0]
        cur = StateComparison(key, err, bound * moved.get(layer, 0.0) + stored * sizes.get(layer, 0.0), bound)
        if not worst.key or cur.ratio > worst.ratio:
            worst = cur
    return worst


def check_trained_state(final: dict[str, torch.Tensor], twins: dict, terms: int, steps: int, start: dict,
                        what: str = "weights") -> tuple[StateComparison, StateComparison]:
    """A demo's final check: the float32 distributed state against the float64 twin's, within :func:`compare_state`.

    ``twins`` maps a dtype to ``(model, optimizer)``: the float64 model is the oracle and the
    float32 ``torch.nn`` model the yardstick (how close plain torch gets).  Raises
    RuntimeError naming the worst tensor when the distributed state is over its allowance;
    returns ``(distributed, torch_nn)`` comparisons.
    """
    exact = twins[torch.float64][0].state_dict()
    worst = compare_state(final, exact, torch.float32, terms, steps, start=start)
    torch_nn = compare_state(twins[torch.float32][0].state_dict(), exact, torch.float32, terms, steps, start=start)
    if not worst.ok:
        raise RuntimeError(f"after {steps} steps, the distributed {what} against the float64 model's: "
                           f"{worst.key} is off by {worst.error:.2e}, over the {worst.allowed:.2e} allowed (the "
                           f"float32 rounding bound {worst.bound:.1e} on its layer's scales)")
    return worst, torch_nn
