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
