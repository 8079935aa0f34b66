"""``distfuse.kernels.launch_cache``: a launch reuses the binary the JIT chose only where Triton would choose it again.

The oracle is Triton's own specialisation (``native_specialize_impl``, which its JIT calls for
every argument, with the base backend's rules: the NVIDIA backend adds none): two arguments
with one fingerprint must get one specialisation.  The dispatch runs against a stand-in JIT
function (there is no binary under the interpreter); on a GPU every fused op's CUDA tests go
through it (``scripts/gpu_lab.sh``).
"""

from __future__ import annotations

import itertools

import pytest
import torch

from distfuse.kernels import launch_cache
from distfuse.kernels.launch_cache import LAUNCH_CACHE_ENV, CachedLaunch, arg_key


def _arguments() -> list:
    ints = [0, 1, 2, 3, 15, 16, 17, 32, -1, -16, -17, 2**31 - 16, 2**31 - 1, 2**31, 2**31 + 16, -2**31, -2**31 - 1,
            -2**31 - 16, 2**63 - 16, 2**63 - 1, 2**63, 2**63 + 16, 2**64 - 16]
    tensors = []
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int32, torch.int64, torch.uint8):
        base = torch.zeros(64, dtype=dtype)
        tensors += [base[offset:] for offset in range(9)]
    from triton.tools.tensor_descriptor import TensorDescriptor

    descriptors = []
    for dtype in (torch.float32, torch.bfloat16):
        base = torch.zeros(64, 64, dtype=dtype)
        for view, shape, strides in ((base, [64, 64], [64, 1]), (base[8:], [56, 64], [64, 1]),
                                     (base[:, 16:], [64, 48], [64, 1])):
            for block in ([16, 32], [32, 16], [16, 16]):
                for padding in ("zero", "nan"):
                    descriptors.append(TensorDescriptor(view, shape, strides, block, padding))
    return ints + [True, False, 0.0, 1.5, -2.0, None] + tensors + descriptors


def test_one_fingerprint_means_one_triton_specialisation():
    pytest.importorskip("triton")
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    args = _arguments()
    spec = [native_specialize_impl(BaseBackend, a, False, True, True) for a in args]  # Triton's finest
    keys = [arg_key(a) for a in args]
    for (i, a), (j, b) in itertools.combinations(enumerate(args), 2):
        if keys[i] == keys[j]:
            assert spec[i] == spec[j], (repr(a)[:40], repr(b)[:40], keys[i], spec[i], spec[j])
    assert len(set(map(str, keys))) >= len(set(map(str, spec))), "the fingerprint is never coarser"
    with pytest.raises(launch_cache._UnkeyableError):
        arg_key(object())
    assert launch_cache.fingerprint(tuple(args)) == tuple(keys), "the inlined fingerprint is arg_key's, arg by arg"
    param = torch.nn.Parameter(torch.zeros(8))  # a tensor subclass takes arg_key's path: the same key
    assert launch_cache.fingerprint((param, 3)) == (arg_key(param), arg_key(3))


class _Binary:
    """A stand-in for Triton's CompiledKernel: ``binary[grid](*args)`` records the launch."""

    def __init__(self):
        self.launches = []

    def __getitem__(self, grid):
        return lambda *args: self.launches.append((grid, args))


class _Jit:
    """A stand-in for a JITFunction with parameters ``x_ptr, n, BLOCK, FLAG``: records each JIT launch."""

    arg_names = ["x_ptr", "n", "BLOCK", "FLAG"]

    def __init__(self):
        self.launches = []
        self.binary = _Binary()

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.launches.append((grid, args, kwargs))
            return self.binary
        return run


@pytest.fixture
def compiled(monkeypatch):
    """As on a GPU: the cache on, device 0."""
    monkeypatch.setattr(launch_cache, "launch_cache_enabled", lambda: True)
    monkeypatch.setattr(launch_cache, "_current_device", lambda: 0)


def test_a_repeated_fingerprint_launches_the_binary(compiled):
    jit = _Jit()
    launch = CachedLaunch(jit)
    x = torch.zeros(64)
    launch[(4,)](x, 32, BLOCK=64, FLAG=True, num_warps=4)
    assert len(jit.launches) == 1 and not jit.binary.launches
    other = torch.zeros(32)  # another tensor, also 16-byte aligned; another multiple of 16
    launch[(5,)](other, 48, BLOCK=64, FLAG=True, num_warps=4)
    assert len(jit.launches) == 1
    assert jit.binary.launches == [((5, 1, 1), (other, 48, 64, True))], "signature order, no launch options"
    for changed in ((x, 33, 64, True, 4), (x[1:], 32, 64, True, 4), (x, 32, 128, True, 4), (x, 32, 64, False, 4),
                    (x, 32, 64, True, 8), (x, 1, 64, True, 4)):
        x_, n, block, flag, warps = changed
        launch[(4,)](x_, n, BLOCK=block, FLAG=flag, num_warps=warps)
    assert len(jit.launches) == 7, "every change of specialisation, constexpr or option goes through the JIT"
    assert len(jit.binary.launches) == 1


def test_calls_the_fingerprint_cannot_model_always_take_the_jit(compiled, monkeypatch):
    jit = _Jit()
    launch = CachedLaunch(jit)
    x = torch.zeros(64)
    for _ in range(2):
        launch[(1,)](x, 16, BLOCK=64)  # FLAG left to a default: never cached
        launch[(1,)](object(), 16, BLOCK=64, FLAG=True)  # an argument of an unknown kind
    assert len(jit.launches) == 4 and not jit.binary.launches
    monkeypatch.setenv(LAUNCH_CACHE_ENV, "0")
    monkeypatch.setattr(launch_cache, "launch_cache_enabled", lambda: False)
    for _ in range(2):
        launch[(1,)](x, 16, BLOCK=64, FLAG=True)
    assert len(jit.launches) == 6 and not jit.binary.launches


def test_a_grid_function_sees_every_parameter_by_name(compiled):
    """As the JIT calls it: ``grid(META)`` with the positional arguments and the constexprs by name."""
    jit = _Jit()
    launch = CachedLaunch(jit)
    x = torch.zeros(64)
    seen = []

    def grid(meta):
        seen.append(dict(meta))
        return (meta["n"] // meta["BLOCK"], 2)

    launch[grid](x, 128, BLOCK=32, FLAG=True, num_warps=4)  # the JIT computes the grid itself
    launch[grid](x, 256, BLOCK=32, FLAG=True, num_warps=4)
    assert len(jit.launches) == 1 and jit.binary.launches == [((8, 2, 1), (x, 256, 32, True))]
    assert seen == [dict(x_ptr=x, n=256, BLOCK=32, FLAG=True, num_warps=4)]


def test_off_under_the_interpreter(monkeypatch):
    monkeypatch.delenv(LAUNCH_CACHE_ENV, raising=False)
    assert launch_cache.launch_cache_enabled() == (not launch_cache.INTERPRET)
    monkeypatch.setenv(LAUNCH_CACHE_ENV, "0")
    assert not launch_cache.launch_cache_enabled()


@pytest.mark.cuda
def test_cached_launches_match_the_jit_cuda(monkeypatch):
    """Compiled: a GEMM + reduce-scatter through the cache (the second call launches the binaries) is bitwise the
    same op through the JIT alone, and the cache holds the consumer's binary."""
    from distfuse.fused.workspace import LoopbackWorkspace
    from distfuse.kernels import chunk_reduce as chunk_reduce_kernels
    from distfuse.kernels.matmul_reduce_scatter import chunk_reduce, matmul_scatter, matmul_scatter_workspace_bytes

    W, n, K, N = 4, 256, 128, 256
    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(11)
    a = [torch.randn(1, n, K, generator=g).to(dev, torch.bfloat16) for _ in range(W)]
    w = [(torch.randn(N, K, generator=g) / 16).to(dev, torch.bfloat16) for _ in range(W)]
    ws = LoopbackWorkspace(W, matmul_scatter_workspace_bytes(1, n, N, W, torch.bfloat16), dev)

    def op():
        with ws.in_flight("launch cache"):
            for r in range(W):
                matmul_scatter(a[r], w[r], ws, r, W)
            outs = [chunk_reduce(ws, r, W, 1, n, N, partial_dtype=torch.bfloat16) for r in range(W)]
        torch.cuda.synchronize()
        return outs

    monkeypatch.setenv(LAUNCH_CACHE_ENV, "0")
    jit = op()
    monkeypatch.delenv(LAUNCH_CACHE_ENV)
    assert launch_cache.launch_cache_enabled()
    first, second = op(), op()
    assert chunk_reduce_kernels._CHUNK_REDUCE._binaries, "the consumer's binary is cached after its first launch"
    assert all(entry[2] is not None for entry in chunk_reduce_kernels._CHUNK_REDUCE._binaries.values()), \
        "this Triton's binaries have the launcher a hit calls directly"
    assert not launch_cache._hooked(), "no launch hook installed: the second call's hits went through the launcher"
    for r in range(W):
        assert torch.equal(first[r], jit[r]) and torch.equal(second[r], jit[r]), r
        assert not torch.isnan(second[r]).any()


class _Compiled:
    """A stand-in for a loaded CompiledKernel: ``run`` (its launcher) records the direct launches, ``binary[grid]``
    the runner's."""

    function = 0xF00D
    packed_metadata = ("packed",)

    def __init__(self):
        self.direct, self.runner = [], []

    def run(self, *args):
        self.direct.append(args)

    def __getitem__(self, grid):
        return lambda *args: self.runner.append((grid, args))


class _HookChain:
    def __init__(self, calls=()):
        self.calls = list(calls)


class _Runtime:
    def __init__(self, enter, leave):
        self.launch_enter_hook, self.launch_exit_hook = enter, leave


def test_a_hit_calls_the_launcher_itself_unless_a_launch_hook_is_installed(compiled, monkeypatch):
    """No hook: ``run(grid, stream, function, packed metadata, no launch metadata, no hooks, *args)``, the runner's
    call less what only a hook reads.  A hook (a profiler's) installed: the runner, which builds what it reads."""
    jit = _Jit()
    jit.binary = _Compiled()
    monkeypatch.setattr(launch_cache, "_current_stream", lambda device: 1234 + device)
    monkeypatch.setattr(launch_cache, "_RUNTIME", _Runtime(_HookChain(), _HookChain()))
    launch = CachedLaunch(jit)
    x = torch.zeros(64)
    launch[(4,)](x, 32, BLOCK=64, FLAG=True, num_warps=4)  # the JIT
    launch[(5, 2)](x, 48, BLOCK=64, FLAG=True, num_warps=4)  # a hit
    assert len(jit.launches) == 1 and not jit.binary.runner
    assert jit.binary.direct == [(5, 2, 1, 1234, 0xF00D, ("packed",), None, None, None, x, 48, 64, True)]
    for enter, leave in ((_HookChain([print]), _HookChain()), (_HookChain(), _HookChain([print])), (print, None)):
        monkeypatch.setattr(launch_cache, "_RUNTIME", _Runtime(enter, leave))
        launch[(3,)](x, 16, BLOCK=64, FLAG=True, num_warps=4)
    assert len(jit.binary.direct) == 1 and len(jit.binary.runner) == 3
    assert jit.binary.runner[0] == ((3, 1, 1), (x, 16, 64, True))
    monkeypatch.setattr(launch_cache, "_RUNTIME", _Runtime(None, None))  # older Tritons: no hook is None
    launch[(3,)](x, 16, BLOCK=64, FLAG=True, num_warps=4)
    assert len(jit.binary.direct) == 2


def test_a_binary_without_the_launcher_goes_through_its_runner():
    class _NoFunction(_Compiled):
        function = None

    assert launch_cache.direct_launcher(_Binary()) is None
    assert launch_cache.direct_launcher(_NoFunction()) is None
    ok = _Compiled()
    run, function, packed = launch_cache.direct_launcher(ok)
    assert (function, packed) == (0xF00D, ("packed",)) and run.__self__ is ok
