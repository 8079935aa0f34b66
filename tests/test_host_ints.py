"""The host-side grid helpers agree with Triton's own on every int the launchers give them."""

import triton

from distfuse.kernels.host_ints import cdiv, next_power_of_2


def test_cdiv_matches_triton():
    for a in [*range(0, 300), 2**31 - 1, 2**31, 2**40 + 3]:
        for b in (1, 2, 3, 7, 16, 64, 128, 256, 1000):
            assert cdiv(a, b) == triton.cdiv(a, b), (a, b)


def test_next_power_of_2_matches_triton():
    for n in [*range(0, 5000), 2**31 - 1, 2**31, 2**31 + 1]:
        assert next_power_of_2(n) == triton.next_power_of_2(n), n
