"""A compiled kernel's C launcher called without its Python wrappers: what a launch-cache hit calls.

A Triton 3.6 binary launches through ``CudaLauncher.__call__`` (a closure and two scratch
allocators built per call, for kernels that may need scratch memory), then, where the kernel
takes tensor descriptors, through a wrapper that walks every argument and builds each
descriptor's TMA map (``make_tensordesc_arg``: Python, then ``cuTensorMapEncodeTiled``) at every
launch.  With a persistent GEMM's three descriptors, that wrapper's Python alone (its encoder
stubbed) took 2.3 us a launch on one core of an AMD EPYC, and ``CudaLauncher.__call__`` 0.4 us;
the GPU hosts ran such Python several times slower.  :func:`fast_launcher` returns the C launcher
itself with the arguments those wrappers would add, and for descriptor kernels a
:class:`DescriptorLaunch` that expands only the descriptors, each from a memo keyed by what the
expansion reads (base address, shape, strides, padding; the element type, block and swizzle are
the binary's), so a descriptor over the same memory in the same geometry reuses its TMA map.  A
TMA map is a pure function of that key, and the launcher copies it into the kernel's parameters
at each launch, so reusing one is exact.

Only where the binary's launcher is Triton 3.6's form: its driver module's base argument format
is :data:`TRITON36_BASE_FORMAT`, the kernel needs no global or profile scratch, and the
descriptor wrapper is the one this module knows (its closure's names).  Anything else (another
Triton, a kernel with scratch, descriptors without TMA metadata) gets the binary's own launcher,
called as :meth:`CompiledKernel.run`.  The GPU lab's CUDA tests launch every bound kernel both
ways and compare the bits (``tests/test_launch_cache.py::test_bound_launches_match_the_jit_cuda``).
"""

from __future__ import annotations

import sys

from distfuse.kernels._utils import BoundedMemo

__all__ = ["fast_launcher", "run_launcher", "DescriptorLaunch", "TRITON36_BASE_FORMAT"]

#: Triton 3.6's C launcher's leading arguments: grid x, y, z, stream, function, cooperative, PDL, global scratch,
#: profile scratch, packed metadata, launch metadata, enter hook, exit hook.
TRITON36_BASE_FORMAT = "iiiKKppOOOOOO"
_WRAPPER_CELLS = ("launcher", "tensordesc_indices", "tensordesc_meta")


def fast_launcher(run, packed) -> tuple:
    """``(launch, mid)`` for a compiled kernel's launcher ``run`` (``CompiledKernel.run``) and its packed metadata:
    ``launch(gx, gy, gz, stream, function, *mid, *kernel_args)`` launches as
    ``run(gx, gy, gz, stream, function, packed, None, None, None, *kernel_args)`` does (no launch metadata, no
    hooks), through the C launcher where :func:`raw_launch` finds it, else through ``run`` itself."""
    raw = raw_launch(run)
    if raw is None:
        return run_launcher(run, packed)
    launch, coop, pdl = raw
    return launch, (coop, pdl, None, None, packed, None, None, None)


def run_launcher(run, packed) -> tuple:
    """``(run, mid)``: the binary's own launcher ``CompiledKernel.run``, called as ``run(gx, gy, gz, stream, function,
    packed, None, None, None, *kernel_args)`` (no launch metadata, no hooks)."""
    return run, (packed, None, None, None)


def raw_launch(run) -> tuple | None:
    """``(C launcher or DescriptorLaunch, cooperative, pdl)`` behind Triton 3.6's ``CudaLauncher`` ``run``, or None
    (the module doc's conditions)."""
    module = sys.modules.get(type(run).__module__)
    if getattr(module, "_BASE_ARGS_FORMAT", None) != TRITON36_BASE_FORMAT:
        return None
    try:
        if run.global_scratch_size or run.profile_scratch_size:
            return None
        launch, coop, pdl = run.launch, run.launch_cooperative_grid, run.launch_pdl
    except AttributeError:
        return None
    code = getattr(launch, "__code__", None)
    if code is None:  # the C function itself: no descriptor arguments to expand
        return (launch, coop, pdl) if callable(launch) else None
    if code.co_freevars != _WRAPPER_CELLS or not launch.__closure__:
        return None
    cells = dict(zip(code.co_freevars, (c.cell_contents for c in launch.__closure__), strict=True))
    metas, make_arg = cells["tensordesc_meta"], getattr(module, "make_tensordesc_arg", None)
    positions = sorted(cells["tensordesc_indices"])
    if make_arg is None or not metas or len(metas) != len(positions) or any(m is None for m in metas):
        return None  # descriptors without TMA metadata expand into their base tensor: left to Triton's wrapper
    return DescriptorLaunch(cells["launcher"], tuple(positions), tuple(metas), make_arg), coop, pdl


class DescriptorLaunch:
    """The C launcher of a kernel with tensor-descriptor arguments, each descriptor expanded (TMA map, shape,
    strides) as Triton's wrapper would, from a memo per binary (see the module doc).

    ``positions``: the descriptors' places among the kernel's arguments, ascending; ``metas``: their TMA metadata in
    that order; ``make_arg(descriptor, meta)``: Triton's expansion, called on a memo miss.
    """

    __slots__ = ("launch", "positions", "metas", "make_arg", "maps")

    def __init__(self, launch, positions: tuple, metas: tuple, make_arg, limit: int = 256):
        self.launch, self.positions, self.metas, self.make_arg = launch, positions, metas, make_arg
        self.maps = BoundedMemo(limit)

    def expand(self, args: tuple) -> list:
        """``args`` with each descriptor replaced by its expansion."""
        out, prev, maps = [], 0, self.maps
        for j, pos in enumerate(self.positions):
            desc = args[pos]
            key = (j, desc.base.data_ptr(), tuple(desc.shape), tuple(desc.strides), desc.padding)
            expanded = maps.get(key)
            if expanded is None:
                expanded = maps.keep(key, tuple(self.make_arg(desc, self.metas[j])))
            out += args[prev:pos]
            out += expanded
            prev = pos + 1
        out += args[prev:]
        return out

    def __call__(self, gx, gy, gz, stream, function, coop, pdl, global_scratch, profile_scratch, packed,
                 launch_metadata, enter_hook, exit_hook, *args):
        return self.launch(gx, gy, gz, stream, function, coop, pdl, global_scratch, profile_scratch, packed,
                           launch_metadata, enter_hook, exit_hook, *self.expand(args))
