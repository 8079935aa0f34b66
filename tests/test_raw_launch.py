"""``distfuse.kernels.raw_launch``: a hit's call of Triton 3.6's C launcher is the call Triton's own wrappers make.

Two oracles.  Triton 3.6's own ``CudaLauncher.__call__`` and descriptor wrapper, run in a
subprocess with ``triton==3.6.0`` (the GPU machines' version; ``scripts/audit_triton36.sh``
installs it, the test skips without it) around a C-launcher stand-in that records what it is
given: both paths must hand it the same arguments.  And, in CI, stand-ins with 3.6's structure,
for the memo of descriptor expansions and every condition that keeps Triton's own launcher.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest
import torch
from triton.tools.tensor_descriptor import TensorDescriptor

from distfuse.kernels import raw_launch
from distfuse.kernels.raw_launch import TRITON36_BASE_FORMAT, DescriptorLaunch, fast_launcher

_BASE = len(TRITON36_BASE_FORMAT)


class _CLauncher:
    """A stand-in for the compiled C function (no ``__code__``): records each call's arguments."""

    def __init__(self):
        self.calls = []

    def __call__(self, *args):
        self.calls.append(args)


_MADE: list = []  # the stand-in driver's expansions, in order


def make_tensordesc_arg(arg, meta):
    """The stand-in driver's descriptor expansion (3.6's signature): a TMA map standing as what it encodes."""
    _MADE.append((arg.base.data_ptr(), tuple(arg.shape), meta))
    return [("tma map", arg.base.data_ptr(), tuple(arg.shape), tuple(arg.strides), arg.padding, meta), *arg.shape,
            *arg.strides]


def wrap_handle_tensordesc(launcher, tensordesc_indices, tensordesc_meta):
    """3.6's wrapper shape: a closure over exactly these three cells, its expansion a global of its module."""
    def inner(*args):
        final, j = list(args[:_BASE]), 0
        for i, arg in enumerate(args[_BASE:]):
            if i in tensordesc_indices:
                final.extend(make_tensordesc_arg(arg, tensordesc_meta[j]))
                j += 1
            else:
                final.append(arg)
        return launcher(*final)
    return inner


def _driver(monkeypatch, fmt: str = TRITON36_BASE_FORMAT):
    """A driver module of 3.6's shape under a fresh name: ``(module, CudaLauncher class, expansions made)``."""
    mod = types.ModuleType(f"fake_triton_driver_{abs(hash(fmt))}")
    mod._BASE_ARGS_FORMAT = fmt
    _MADE.clear()
    made = _MADE

    class CudaLauncher:
        global_scratch_size = profile_scratch_size = 0
        launch_cooperative_grid, launch_pdl = False, True

        def __init__(self, launch):
            self.launch = launch

        def __call__(self, gx, gy, gz, stream, function, *args):  # 3.6's, without scratch
            self.launch(gx, gy, gz, stream, function, self.launch_cooperative_grid, self.launch_pdl, None, None, *args)

    CudaLauncher.__module__ = mod.__name__
    mod.make_tensordesc_arg, mod.wrap_handle_tensordesc, mod.CudaLauncher = (make_tensordesc_arg,
                                                                             wrap_handle_tensordesc, CudaLauncher)
    assert wrap_handle_tensordesc(None, set(), []).__code__.co_freevars == raw_launch._WRAPPER_CELLS
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    return mod, CudaLauncher, made


def _both_ways(run, packed, args, fast=None) -> tuple:
    """The C stand-in's arguments from ``run(...)`` (Triton's path) and from the fast launcher's call (``fast``, or
    made here), and that launcher."""
    c = run.launch if isinstance(run.launch, _CLauncher) else run.launch.__closure__[0].cell_contents
    run(3, 2, 1, 99, 0xF00D, packed, None, None, None, *args)
    launch, mid = fast or fast_launcher(run, packed)
    launch(3, 2, 1, 99, 0xF00D, *mid, *args)
    return c.calls[-2], c.calls[-1], launch


def test_the_c_launcher_gets_what_the_wrappers_would_give_it(monkeypatch):
    mod, cls, made = _driver(monkeypatch)
    run = cls(_CLauncher())
    ours_and_theirs = _both_ways(run, ("packed",), (7, 1.5, None, True))
    assert ours_and_theirs[0] == ours_and_theirs[1] and ours_and_theirs[2] is run.launch, "no wrapper: the C function"

    base = torch.zeros(64, 64, dtype=torch.bfloat16)
    meta_a, meta_b = {"block": [16, 32]}, {"block": [32, 16]}
    run = cls(mod.wrap_handle_tensordesc(_CLauncher(), {1, 3}, [meta_a, meta_b]))
    fast = fast_launcher(run, ("packed",))  # once per binary, as the launch cache makes it
    for a, b in ((base, base[8:]), (base[16:], base), (base, base[8:])):
        da = TensorDescriptor(a, list(a.shape), list(a.stride()), [16, 32])
        db = TensorDescriptor(b, list(b.shape), list(b.stride()), [32, 16])
        theirs, ours, launch = _both_ways(run, ("packed",), (5, da, 6, db, 64), fast)
        assert ours == theirs and isinstance(launch, DescriptorLaunch)
    # Triton's wrapper expanded every descriptor at each of its three calls; the memo only new (base, geometry) pairs
    assert len(made) == 6 + 4, made
    assert len(launch.maps) == 4


def test_the_memo_keys_every_field_the_expansion_reads(monkeypatch):
    mod, cls, made = _driver(monkeypatch)
    run = cls(mod.wrap_handle_tensordesc(_CLauncher(), {0}, [{"block": [16, 16]}]))
    launch, mid = fast_launcher(run, ())
    base = torch.zeros(32, 32)
    variants = [TensorDescriptor(base, [32, 32], [32, 1], [16, 16]),
                TensorDescriptor(base, [16, 32], [32, 1], [16, 16]),  # shape
                TensorDescriptor(base, [16, 16], [16, 1], [16, 16]),  # strides
                TensorDescriptor(base, [32, 32], [32, 1], [16, 16], padding="nan"),  # padding
                TensorDescriptor(base[1:], [31, 32], [32, 1], [16, 16])]  # base address
    for v in variants + variants:
        launch(1, 1, 1, 0, 0, *mid, v)
    assert len(made) == len(variants) and len(launch.maps) == len(variants)
    small = DescriptorLaunch(_CLauncher(), (0,), ({},), mod.make_tensordesc_arg, limit=2)
    for v in variants[:3]:
        small(1, 1, 1, 0, 0, *mid, v)
    assert len(small.maps) == 1, "a full memo starts again rather than grow"


def test_anything_else_keeps_tritons_own_launcher(monkeypatch):
    mod, cls, _ = _driver(monkeypatch)
    packed = ("packed",)
    fallback = (None, (packed, None, None, None))

    def check(run):
        launch, mid = fast_launcher(run, packed)
        assert (launch is run and mid == fallback[1]), run

    scratch = cls(_CLauncher())
    scratch.global_scratch_size = 128  # device-side descriptors or other scratch: Triton allocates it per launch
    check(scratch)
    profiled = cls(_CLauncher())
    profiled.profile_scratch_size = 64
    check(profiled)
    check(cls(mod.wrap_handle_tensordesc(_CLauncher(), {0}, [None])))  # no TMA metadata: the base tensor is passed
    check(cls(lambda *args: None))  # a Python launcher of unknown shape
    other, other_cls, _ = _driver(monkeypatch, fmt="iiiKKOOOO")  # another Triton's argument format
    check(other_cls(_CLauncher()))

    class _Run:  # not a CudaLauncher at all (the stand-ins of tests/test_launch_cache.py)
        def __call__(self, *args):
            pass
    check(_Run())
    check(print)


def _triton36() -> str | None:
    """Where ``triton==3.6.0`` is: ``""`` where it is this interpreter's own (the GPU machines), else the folder
    ``scripts/audit_triton36.sh`` installs it into, else None."""
    import triton

    if triton.__version__ == "3.6.0":
        return ""
    site = os.environ.get("DISTFUSE_TRITON36_DIR") or str(Path.home() / ".cache/distfuse/triton-3.6.0")
    return site if (Path(site) / "triton" / "backends" / "nvidia" / "driver.py").is_file() else None


_ORACLE = textwrap.dedent("""
    import torch, triton
    import triton.backends.nvidia.driver as drv
    from triton.tools.tensor_descriptor import TensorDescriptor
    from distfuse.kernels.raw_launch import DescriptorLaunch, fast_launcher
    assert triton.__version__ == "3.6.0", triton.__version__

    class Utils:
        @staticmethod
        def fill_tma_descriptor(*args):  # the TMA map stands as the arguments it is encoded from
            return ("tma",) + tuple(tuple(a) if isinstance(a, list) else a for a in args)

    triton.runtime.driver.set_active(type("Driver", (), {"utils": Utils})())
    calls = []
    c_launch = type("C", (), {"__call__": lambda self, *a: calls.append(a)})()
    base = torch.zeros(64, 64, dtype=torch.bfloat16)
    sig = {0: "*bf16", 1: "tensordesc<bf16[16, 32]>", 2: "i32", 3: "tensordesc<bf16[32, 16]>", 4: "constexpr"}
    meta = [dict(swizzle=3, elem_size=2, elem_type=9, block_size=[16, 32], fp4_padded=False),
            dict(swizzle=2, elem_size=2, elem_type=9, block_size=[32, 16], fp4_padded=False)]
    for wrapped in (True, False):
        run = object.__new__(drv.CudaLauncher)
        run.launch = drv.wrap_handle_tensordesc(c_launch, sig if wrapped else {0: "*bf16", 2: "i32"},
                                                meta if wrapped else None)
        run.num_ctas, run.launch_cooperative_grid, run.launch_pdl = 1, False, True
        run.global_scratch_size = run.profile_scratch_size = 0
        run.global_scratch_align = run.profile_scratch_align = 1
        da = TensorDescriptor(base[8:], [56, 64], [64, 1], [16, 32])
        db = TensorDescriptor(base, [64, 64], [64, 1], [32, 16])
        args = (12345, da, 7, db, 64) if wrapped else (12345, 7)
        for _ in range(2):
            run(4, 1, 1, 99, 0xF00D, ("packed",), None, None, None, *args)
            launch, mid = fast_launcher(run, ("packed",))
            assert isinstance(launch, DescriptorLaunch) if wrapped else launch is c_launch, type(launch)
            launch(4, 1, 1, 99, 0xF00D, *mid, *args)
            assert calls[-1] == calls[-2], (calls[-1], calls[-2])
    print("ok")
""")


def test_tritons_own_wrappers_agree_under_triton_36():
    """Triton 3.6's ``CudaLauncher.__call__`` and ``wrap_handle_tensordesc`` (with its ``make_tensordesc_arg``, the TMA
    encoder stubbed) hand the C launcher exactly what :func:`fast_launcher`'s call does, with and without
    descriptors."""
    site = _triton36()
    if site is None:
        pytest.skip("triton==3.6.0 not installed (scripts/audit_triton36.sh installs it)")
    root = str(Path(__file__).resolve().parent.parent)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (site, root) if p))
    env.pop("TRITON_INTERPRET", None)
    out = subprocess.run([sys.executable, "-c", _ORACLE], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


def test_a_cache_hit_calls_the_c_launcher(monkeypatch):
    """The launch cache keeps, per binary, the launcher its hits call: the C function where the binary's ``run`` is
    3.6's, with the arguments ``run`` would add."""
    from distfuse.kernels import launch_cache

    _, cls, _ = _driver(monkeypatch)
    c = _CLauncher()
    binary = types.SimpleNamespace(run=cls(c), function=0xBEEF, packed_metadata=("packed",))
    assert launch_cache.hit_launcher(binary) == (c, 0xBEEF, (False, True, None, None, ("packed",), None, None, None))
    plain = types.SimpleNamespace(run=print, function=0xBEEF, packed_metadata=("packed",))
    assert launch_cache.hit_launcher(plain) == (print, 0xBEEF, (("packed",), None, None, None))
