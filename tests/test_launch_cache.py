"""``distfuse.kernels.launch_cache``: a launch reuses the binary the JIT chose only where Triton would choose it again.

The oracle is Triton's own specialisation (``native_specialize_impl``, which its JIT calls for
every argument, with the base backend's rules: the NVIDIA backend adds none): two arguments
with one fingerprint must get one specialisation.  The dispatch runs against a stand-in JIT
function (there is no binary under the interpreter); on a GPU every fused op's CUDA tests go
through it (``scripts/gpu_lab.sh``).
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

from distfuse.kernels import launch_cache
from distfuse.kernels.launch_cache import LAUNCH_CACHE_ENV, CachedLaunch, arg_key

ROOT = Path(__file__).resolve().parent.parent


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
    debug = False  # knobs.runtime's, read into every key

    def __init__(self, enter, leave):
        self.launch_enter_hook, self.launch_exit_hook = enter, leave


def _jit_with_launcher(monkeypatch, arg_names: list, stream: int) -> _Jit:
    """A stand-in JIT with these parameters whose binary has a direct launcher; no launch hook; ``stream`` current."""
    jit = _Jit()
    jit.arg_names = list(arg_names)
    jit.binary = _Compiled()
    monkeypatch.setattr(launch_cache, "_current_stream", lambda device: stream)
    monkeypatch.setattr(launch_cache, "_RUNTIME", _Runtime(None, None))
    return jit


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


def test_a_bound_launch_fingerprints_its_own_arguments_and_hits_the_launcher(compiled, monkeypatch):
    """``bind(grid, static, kwargs)``: the first call and every new fingerprint of the call's own arguments go through
    the cache (the JIT on its misses); a hit calls the binary's launcher with the static arguments and the constexprs
    in signature order; a hook sends it through the runner; off the cache it is the JIT's own launch."""
    jit = _Jit()
    jit.binary = _Compiled()
    monkeypatch.setattr(launch_cache, "_current_stream", lambda device: 77)
    monkeypatch.setattr(launch_cache, "_RUNTIME", _Runtime(_HookChain(), _HookChain()))
    bound = CachedLaunch(jit).bind((4, 2), (32,), dict(BLOCK=64, FLAG=True, num_warps=4))
    x, y = torch.zeros(64), torch.zeros(32)
    bound(x)
    assert len(jit.launches) == 1 and jit.launches[0] == ((4, 2), (x, 32), dict(BLOCK=64, FLAG=True, num_warps=4))
    bound(y)  # another tensor of the same fingerprint: the launcher
    assert len(jit.launches) == 1
    assert jit.binary.direct == [(4, 2, 1, 77, 0xF00D, ("packed",), None, None, None, y, 32, 64, True)]
    bound(torch.zeros(64, dtype=torch.float64))  # a new fingerprint: through the cache, the JIT, then bound too
    bound(x[1:])  # a misaligned base: another specialisation
    assert len(jit.launches) == 3 and len(jit.binary.direct) == 1
    bound(x[1:])
    assert len(jit.launches) == 3 and jit.binary.direct[-1][9] is not x and len(jit.binary.direct) == 2
    monkeypatch.setattr(launch_cache, "_RUNTIME", _Runtime(_HookChain([print]), _HookChain()))
    bound(y)
    assert len(jit.binary.direct) == 2 and jit.binary.runner == [((4, 2, 1), (y, 32, 64, True))]
    monkeypatch.setattr(launch_cache, "launch_cache_enabled", lambda: False)
    bound(y)
    assert jit.launches[-1] == ((4, 2), (y, 32), dict(BLOCK=64, FLAG=True, num_warps=4)) and len(jit.launches) == 4


def test_a_split_bound_launch_puts_the_static_arguments_between(compiled, monkeypatch):
    """``split=k``: ``bound(*args)`` launches ``args[:k] + static + args[k:]``, on the JIT's path and on a hit alike."""

    jit = _jit_with_launcher(monkeypatch, ["x_ptr", "n", "m", "y_ptr", "BLOCK"], stream=5)
    bound = CachedLaunch(jit).bind((1,), (16, 48), dict(BLOCK=32), split=1)
    x, y = torch.zeros(8), torch.zeros(8)
    bound(x, y)
    bound(y, x)
    assert jit.launches == [((1,), (x, 16, 48, y), dict(BLOCK=32))]
    assert jit.binary.direct == [(1, 1, 1, 5, 0xF00D, ("packed",), None, None, None, y, 16, 48, x, 32)]


def test_a_bound_launch_with_a_grid_function_or_an_unkeyable_argument_takes_the_cache_path(compiled, monkeypatch):
    jit = _Jit()
    jit.binary = _Compiled()
    monkeypatch.setattr(launch_cache, "_current_stream", lambda device: 9)
    monkeypatch.setattr(launch_cache, "_RUNTIME", _Runtime(None, None))
    bound = CachedLaunch(jit).bind(lambda meta: (meta["n"] // meta["BLOCK"],), (64,), dict(BLOCK=32, FLAG=False))
    x = torch.zeros(64)
    for _ in range(3):
        bound(x)
    assert len(jit.launches) == 1 and not bound._hits, "a grid function: no bound hit"
    assert jit.binary.direct == [(2, 1, 1, 9, 0xF00D, ("packed",), None, None, None, x, 64, 32, False)] * 2, \
        "the cache's own hit path computes the grid from the parameters"
    other = CachedLaunch(_Jit()).bind((1,), (3,), dict(BLOCK=1, FLAG=True))
    other(object())
    other(object())
    assert len(other.cached.kernel.launches) == 2, "an argument the fingerprint cannot model: the JIT every time"


def test_hits_pass_device_tensors_by_address(compiled, monkeypatch):
    """A hit passes each device tensor as its address (the int Triton's launcher would get from ``data_ptr`` and
    ``cuPointerGetAttribute``), the bound launch's static ones resolved when its first hit was recorded; any other
    tensor (a CPU tensor, pinned host words), a tensor subclass and a descriptor go as they are, so the launcher
    still validates them.  The fingerprint is unchanged.  On CPU the tensors that require grad stand in for device
    memory (the predicate pointed at ``requires_grad``, a property as ``is_cuda`` is)."""
    args = _arguments()
    shape, passed = launch_cache.fingerprint_and_addresses(tuple(args))
    assert shape == launch_cache.fingerprint(tuple(args)) and passed == tuple(args), "CPU tensors go as they are"
    monkeypatch.setattr(launch_cache, "_BY_ADDRESS", "requires_grad")
    args += [torch.zeros(64, requires_grad=True)[offset:] for offset in range(5)]
    shape, passed = launch_cache.fingerprint_and_addresses(tuple(args))
    assert shape == launch_cache.fingerprint(tuple(args))
    for a, p in zip(args, passed, strict=True):
        device = type(a) is torch.Tensor and a.requires_grad
        assert (type(p) is int and p == a.data_ptr()) if device else p is a, repr(a)[:40]
    assert launch_cache.by_address(args[-1]) == args[-1].data_ptr() and launch_cache.by_address(args[0]) is args[0]
    param = torch.nn.Parameter(torch.zeros(8))
    assert launch_cache.fingerprint_and_addresses((param,))[1][0] is param, "a subclass: the launcher's own path"

    jit = _jit_with_launcher(monkeypatch, ["x_ptr", "table_ptr", "words_ptr", "z_ptr", "BLOCK"], stream=3)
    table = torch.ones(16, requires_grad=True)  # a static device table
    words = torch.zeros(16, dtype=torch.int32)  # static host words
    bound = CachedLaunch(jit).bind((2,), (table, words), dict(BLOCK=8), split=1)
    x, y = torch.zeros(32, requires_grad=True), torch.zeros(32, requires_grad=True)
    z = torch.zeros(32, dtype=torch.int32)
    bound(x, z)  # the JIT: tensors, as it takes them
    bound(y, z)
    assert jit.launches == [((2,), (x, table, words, z), dict(BLOCK=8))]
    assert jit.binary.direct == [(2, 1, 1, 3, 0xF00D, ("packed",), None, None, None, y.data_ptr(), table.data_ptr(),
                                  words, z, 8)]
    plain = CachedLaunch(jit)
    plain[(1,)](x, table, words, z, BLOCK=8)
    plain[(1,)](y, table, words, z, BLOCK=8)
    assert jit.binary.direct[-1] == (1, 1, 1, 3, 0xF00D, ("packed",), None, None, None, y.data_ptr(), table.data_ptr(),
                                     words, z, 8)


@pytest.mark.cuda
def test_bound_launches_match_the_jit_cuda():
    """Compiled: the halo staging, unstage and accumulate, the persistent producer, ``chunk_reduce``, the push and the
    persistent consumer, through their bound launches (the second call hits), are bitwise the same ops through the
    JIT alone, and every family hit (the GPU lab's launch canary, ``scripts/launch_canary.py``)."""
    import importlib.util

    import triton

    spec = importlib.util.spec_from_file_location("launch_canary", ROOT / "scripts" / "launch_canary.py")
    canary = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(canary)
    res = canary.compare("cuda")
    assert res["ok"] and not res["warnings"], (res["problems"], res["warnings"])
    if triton.__version__ == "3.6.0" and launch_cache.FAST_LAUNCH:  # the hits called its C launcher, not its wrappers
        assert "CudaLauncher" not in res["launcher"], res["launcher"]
        assert "DescriptorLaunch" in res["launcher"] and res["descriptor_maps"], \
            "the persistent GEMMs' descriptors came from the memo"


def test_constexprs_python_calls_equal_are_different_binaries(compiled):
    """The JIT keys a binary on its constexprs' ``str``: ``True`` and ``1``, ``1`` and ``1.0``, ``0.0`` and ``-0.0``
    compile apart, so none of them may hit the binary of another."""
    jit = _Jit()
    launch = CachedLaunch(jit)
    x = torch.zeros(64)
    values = (True, 1, 1.0, 0.0, -0.0, False, 0)
    for flag in values + values:  # each once through the JIT, then each a hit of its own binary
        launch[(1,)](x, 32, BLOCK=64, FLAG=flag)
    assert [kw["FLAG"] for _, _, kw in jit.launches] == list(values)
    assert [type(a[-1]) for _, a in jit.binary.launches] == [type(v) for v in values]
    assert len({launch_cache.constexpr_key({"FLAG": v}) for v in values}) == len(values)


class _Knobs:
    """Triton's ``knobs.runtime`` and ``knobs.compilation`` in one stand-in: no launch hooks, the JIT's per-launch
    options as given."""

    def __init__(self, debug=False, instrumentation_mode=""):
        self.launch_enter_hook = self.launch_exit_hook = None
        self.debug, self.instrumentation_mode = debug, instrumentation_mode


def test_the_jits_knob_options_are_part_of_every_key(compiled, monkeypatch):
    """``knobs.runtime.debug`` and ``knobs.compilation.instrumentation_mode`` (Proton's instrumentation sets it when a
    profile starts) choose the JIT's binary at every launch: a change sends the next call, plain or bound, through
    the JIT, which compiles the instrumented binary; back to the first state, the first binary hits again."""
    knobs = _Knobs()
    monkeypatch.setattr(launch_cache, "_RUNTIME", knobs)
    monkeypatch.setattr(launch_cache, "_COMPILATION", knobs)
    jit = _jit_with_launcher(monkeypatch, ["x_ptr", "n", "BLOCK", "FLAG"], stream=3)
    monkeypatch.setattr(launch_cache, "_RUNTIME", knobs)  # _jit_with_launcher installs its own runtime
    launch = CachedLaunch(jit)
    bound = launch.bind((1,), (32,), dict(BLOCK=64, FLAG=True))  # one kernel's call sites share its binaries
    x = torch.zeros(64)
    states = [(False, ""), (True, ""), (False, "default"), (True, "default"), (False, "")]
    for debug, mode in states:
        knobs.debug, knobs.instrumentation_mode = debug, mode
        for _ in range(2):
            launch[(1,)](x, 32, BLOCK=64, FLAG=True)
            bound(x)
    assert [kw for _, _, kw in jit.launches] == [dict(BLOCK=64, FLAG=True)] * 4, "one JIT launch per new state"
    assert len(jit.binary.direct) == len(states) * 2 * 2 - 4, "every other call a hit, the last state's included"
    assert launch_cache.knob_state()[:2] == (False, "")
    monkeypatch.setattr(launch_cache, "_COMPILATION", None)
    assert launch_cache.knob_state() == (), "a Triton without these knobs keys none"
