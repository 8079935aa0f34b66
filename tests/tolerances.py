"""One tolerance table for the whole suite, derived from the arithmetic, never from one machine.

Every entry is :func:`distfuse.testing.tolerance.rounding_bound`: the dtype's unit roundoff
``u``, the length ``n`` of the longest sum behind the checked values, and the number of
steps, ``safety * ((1 + r u + lam sqrt(n) u_acc)**steps - 1)`` (the derivation is in that
module's docstring).  The bound is relative to the magnitude of the partial sums, which is
the size of a typical element of the result when the terms have random signs (the suite's
data) and at most the sum of the terms' magnitudes.  So an element-wise check is

    |got - ref| <= rtol * |ref| + rtol * scale,    rtol = rounding_bound(dtype, terms)

where ``scale`` is the magnitude of the terms: 1 for the suite's unit-variance data, or a
tensor's typical magnitude where that is larger.  Never a tensor's own largest value alone:
a tensor that cancels to almost nothing (a bias gradient behind a normalisation, a
parameter that hardly moved) keeps the rounding error of the terms it was summed from.

A check whose sums are longer than :data:`TERMS` passes ``terms=``; one over several
steps passes ``steps=``.  Where data only moves, tests compare bit for bit instead.
"""

import math

import torch

from distfuse.testing.tolerance import rounding_bound, unit_roundoff

__all__ = ["TERMS", "TOL", "REL_NORM", "REL_NORM_TERMS", "NORM_LAMBDA", "ADJOINT_TERMS", "ADJOINT_RTOL", "tol",
           "rel_norm", "assert_rel_close", "unit_roundoff", "rounding_bound", "TF32_UNIT_ROUNDOFF",
           "TF32_OPERAND_ROUNDINGS", "rel_norm_tf32"]

DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)

#: The suite's shapes are small: its sums (3 x 3 kernels over a few channels, linear layers of a few
#: dozen features, gradients over a few dozen rows) have at most this many terms.
TERMS = 64


def tol(dtype: torch.dtype, terms: int = TERMS, scale: float = 1.0, steps: int = 1,
        cond: float = 1.0) -> dict[str, float]:
    """``dict(rtol=, atol=)`` for ``torch.testing.assert_close``: ``rtol = rounding_bound(dtype, terms, steps)``
    and ``atol = rtol * scale``, ``scale`` being the magnitude of the terms summed (1: unit-variance data).

    ``cond`` is the condition number of the computation where it exceeds 1: how much a rounding of
    relative size ``u`` in its inputs or intermediates grows in its result (a normalisation
    ``(x - mean) / sigma`` turns ``u |x|`` into ``u |x| / sigma``).  It multiplies the part of
    ``atol`` that comes from the sums (in the accumulation precision), not the final rounding to
    the storage dtype.
    """
    r = rounding_bound(dtype, terms, steps)
    sums = rounding_bound(dtype, terms, steps, roundings=0)
    return dict(rtol=r, atol=(r + (max(cond, 1.0) - 1.0) * sums) * scale)


#: At the default sum length: float64 1.1e-14, float32 6.0e-6, float16 2.0e-3, bfloat16 1.6e-2.
TOL = {dtype: tol(dtype) for dtype in DTYPES}

#: The longest sums of the norm-wise checks at realistic sizes: GEMMs with K = 4096, weight
#: gradients over 4096 rows.
REL_NORM_TERMS = 4096
#: A norm over many outputs averages their errors: with rounding errors of mean zero and
#: variance at most ``u**2``, ``||error||**2`` has mean at most ``u**2 * n * ||partial sums||**2`` and
#: concentrates as the outputs grow, so the per-sum tail parameter (6) becomes a margin of 2.
NORM_LAMBDA = 2.0


def rel_norm(dtype: torch.dtype, terms: int = REL_NORM_TERMS) -> float:
    """The bound on ``||got - ref|| / ||ref||`` for outputs of sums of ``terms`` terms."""
    return rounding_bound(dtype, terms, lam=NORM_LAMBDA)


#: Relative error in norm, ||got - ref|| / ||ref||, for checks at realistic sizes: element-wise
#: tolerances sized for tiny shapes fail there on cancellation (an element near zero whose
#: terms are large), without telling a wrong result from a rounded one.  At 4096 terms:
#: float64 2.9e-14, float32 1.6e-5, float16 2.0e-3, bfloat16 1.6e-2.
REL_NORM = {dtype: rel_norm(dtype) for dtype in DTYPES}

#: The dot-product test sums ``<F x, y>`` and ``<x, F* y>`` over whole tensors of at most this many elements.
ADJOINT_TERMS = 4096
#: Adjoint (dot-product) test in float64: ``|<Fx,y> - <x,F*y>| / max(|.|)`` below this.  Each side is a
#: sum of ADJOINT_TERMS products (of values that are themselves short sums), bounded relative to the
#: sum of their magnitudes; ``y`` is random, so that sum of magnitudes is about sqrt(ADJOINT_TERMS)
#: times the inner product itself: 5.5e-12.
ADJOINT_RTOL = rounding_bound(torch.float64, ADJOINT_TERMS) * math.sqrt(ADJOINT_TERMS)


def assert_rel_close(got: torch.Tensor, ref: torch.Tensor, dtype, what: str = "",
                     terms: int = REL_NORM_TERMS) -> float:
    """NaN-free, same shape, and ``||got - ref|| / ||ref|| <= rel_norm(dtype, terms)``; returns the error."""
    assert got.shape == ref.shape, (what, tuple(got.shape), tuple(ref.shape))
    assert not torch.isnan(got).any(), f"{what}: NaN (an element was never written, or a wait gave up)"
    got, ref = got.detach().double().cpu(), ref.detach().double().cpu()
    err = float((got - ref).norm() / ref.norm().clamp_min(1e-300))
    bound = rel_norm(dtype, terms)
    assert err <= bound, f"{what}: relative error {err:.2e} over {bound:.1e} ({dtype}, sums of {terms} terms)"
    return err


#: TF32, the tensor cores' input format for float32 GEMMs: 10 explicit mantissa bits, unit roundoff 2**-11.
TF32_UNIT_ROUNDOFF = 2.0 ** -11
#: A TF32 product converts both float32 operands, each to within 2 u_tf32: cuBLAS rounds (u), but Triton's
#: ``tl.dot(input_precision="tf32")`` hands float32 registers to the tensor cores, which drop the 13 low mantissa
#: bits (a truncation, up to 2u, the module's "one truncation").  The product of two 11-bit significands is exact
#: in float32, and the sums and the stored result are float32.
TF32_OPERAND_ROUNDINGS = 4


def rel_norm_tf32(terms: int = REL_NORM_TERMS) -> float:
    """:func:`rel_norm` of a float32 GEMM on TF32 tensor cores: ``||got - ref|| / ||ref||`` for outputs of sums of
    ``terms`` products.  The storage roundings ``r u`` of :func:`rounding_bound` become the operands' conversions,
    ``TF32_OPERAND_ROUNDINGS * TF32_UNIT_ROUNDOFF`` (as a number of float32 roundings), and the sums keep float32's
    ``u``.  The conversions dominate: at 1024 terms 3.9e-3.  A truncation errs one way (each operand loses about
    0.7 u_tf32 of its size on average), so the result shrinks by about 1.4 u_tf32 = 7e-4 and its error in norm
    with it: the margin is the safety factor and the worst case of the conversions, not the averaging of a norm."""
    roundings = TF32_OPERAND_ROUNDINGS * TF32_UNIT_ROUNDOFF / unit_roundoff(torch.float32)
    return rounding_bound(torch.float32, terms, roundings=roundings, lam=NORM_LAMBDA)

