"""One tolerance table for the whole suite.  Every entry departing from fp64 says why."""

import torch

TOL = {
    # Reference is float64; fp64 results differ only by summation order.
    torch.float64: dict(rtol=1e-10, atol=1e-12),
    # fp32: reductions over <= a few thousand terms accumulate ~1e-6 relative error.
    torch.float32: dict(rtol=1e-5, atol=1e-5),
    # fp16: 11-bit mantissa; one rounding of the output plus fp32 accumulation inside.
    torch.float16: dict(rtol=2e-3, atol=2e-3),
    # bf16: 8-bit mantissa (ulp 2^-7 at 1.0); the Triton interpreter truncates instead of
    # rounding, so allow a little over one ulp relative.
    torch.bfloat16: dict(rtol=1.6e-2, atol=1.6e-2),
}

# Adjoint (dot-product) test in float64: |<Fx,y> - <x,F*y>| / max(|.|) below this.
ADJOINT_RTOL = 1e-11


def tol(dtype):
    return TOL[dtype]


#: Relative error in norm, ||got - ref|| / ||ref||, for checks at realistic sizes: element-wise
#: tolerances sized for tiny shapes fail there on cancellation (an element near zero whose
#: terms are large) and on the extra roundings of 16-bit outputs summed over thousands of
#: rows, without telling a wrong result from a rounded one.
REL_NORM = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2, torch.float64: 1e-12}


def assert_rel_close(got: torch.Tensor, ref: torch.Tensor, dtype, what: str = "") -> float:
    """NaN-free, same shape, and ``||got - ref|| / ||ref|| <= REL_NORM[dtype]``; returns the error."""
    assert got.shape == ref.shape, (what, tuple(got.shape), tuple(ref.shape))
    assert not torch.isnan(got).any(), f"{what}: NaN (an element was never written, or a wait gave up)"
    got, ref = got.detach().double().cpu(), ref.detach().double().cpu()
    err = float((got - ref).norm() / ref.norm().clamp_min(1e-300))
    assert err <= REL_NORM[dtype], f"{what}: relative error {err:.2e} over {REL_NORM[dtype]:.0e} ({dtype})"
    return err
