"""Launch a ``@triton.jit`` kernel through the binary the JIT chose for it, without the JIT's per-call work.

``kernel[grid](*args)`` runs :meth:`triton.JITFunction.run` on every call: it binds the
arguments, specialises each one, builds the cache key, looks the binary up, checks the
kernel's globals, then launches.  On the GPU lab's hosts that Python is most of a launch's
host time (a ``chunk_reduce`` launch took 24 us of host on the H200's host, 2026-11-27;
``scripts/gpu_diagnose.py --sections attrib`` times the same binary launched directly), and
a fused op's eager call is host-bound where its kernel is short.

:class:`CachedLaunch` keys each call by a fingerprint from which Triton's specialisation
follows (finer, never coarser; :func:`arg_key`):

* a tensor: its dtype, and whether its address is a multiple of 16 bytes;
* an int: its range (int32, int64, uint64), whether it is 1, whether it is a multiple of 16;
* a host tensor descriptor: its base's dtype, block shape and padding (the launcher encodes
  its address, shape and strides at every launch);
* a bool by value, a float as a float, None;
* every constexpr and launch option by type and value (:func:`constexpr_key`: the JIT tells ``True`` from
  ``1``), the options the JIT reads from Triton's knobs at each launch (:func:`knob_state`: debug, Proton's
  instrumentation mode), and the current CUDA device.

Calls with one fingerprint get one specialisation, so the binary the JIT handed back for the
first serves every later one.  Two checks of the JIT's are not repeated at a hit: its pre-run hooks
(``JITFunction.pre_run_hooks``; distfuse installs none) and its check that the globals a kernel read when it
was compiled still hold (distfuse changes none at run time).  Code that installs such a hook or rebinds
such a global turns the cache off (``DISTFUSE_LAUNCH_CACHE=0``).

A hit calls the binary's launcher itself (Triton 3.6's C function
where :func:`~distfuse.kernels.raw_launch.fast_launcher` finds it, with the tensor descriptors
expanded from a memo; else ``CompiledKernel.run``), with the current stream read in one C call,
where ``binary[grid](*args)`` would first build a closure, ask ``torch.cuda.current_device`` for
the device, build the launch metadata for the launch hooks and call both hook chains: while no
launch hook is installed (``triton.knobs.runtime``'s ``launch_enter_hook`` /
``launch_exit_hook``, the profilers' entry point) that work has no effect, so a hit skips it,
and with a hook installed it goes through ``binary[grid]`` as before. A binary without that
launcher (another Triton) is launched through ``binary[grid]`` too. A new fingerprint goes
through the JIT, which compiles or finds its binary and launches it.
``tests/test_launch_cache.py`` checks the fingerprint against Triton's own specialisation.

A hit passes every CUDA tensor to the launcher as its address (an int), which the fingerprint
has read anyway.  Given a tensor, Triton's C launcher calls its ``data_ptr`` method and then
``cuPointerGetAttribute`` to translate and validate the address: one Python call and one driver
call per pointer argument per launch, and a launch passes 5 to 20 pointers (its static tables
included).  For device memory under unified addressing the translation is the identity, and a
tensor of another kind (a CPU tensor, pinned host words) is passed as the tensor, so the launcher
still validates it: a CPU tensor passed by mistake raises there, as it would without the cache.
A bound launch resolves its static tensors' addresses once, when its first hit is recorded.

``DISTFUSE_FAST_LAUNCH=0`` keeps both of those off (hits then call ``CompiledKernel.run`` with the tensors
themselves, as before they existed): the GPU lab's launch canary (``scripts/launch_canary.py``) sets it for the rest
of a lab run where the fast hits do not match the JIT bit for bit on that GPU.

Off under the interpreter (there is no binary) and with ``DISTFUSE_LAUNCH_CACHE=0``.
"""

from __future__ import annotations

import os

import torch
from triton.tools.tensor_descriptor import TensorDescriptor

from distfuse.kernels._utils import INTERPRET, env_choice
from distfuse.kernels.raw_launch import fast_launcher, run_launcher

__all__ = ["CachedLaunch", "BoundLaunch", "cached_launch", "arg_key", "fingerprint", "fingerprint_and_addresses",
           "by_address", "constexpr_key", "knob_state", "direct_launcher", "hit_launcher", "launch_cache_enabled",
           "fast_launch_enabled", "LAUNCH_CACHE_ENV", "FAST_LAUNCH_ENV"]

LAUNCH_CACHE_ENV = "DISTFUSE_LAUNCH_CACHE"
FAST_LAUNCH_ENV = "DISTFUSE_FAST_LAUNCH"
_I32, _I64 = 1 << 31, 1 << 63
_MAX_BINARIES = 64  # fingerprints kept per kernel: shapes that keep changing fall back to the JIT


def fast_launch_enabled() -> bool:
    """``DISTFUSE_FAST_LAUNCH`` (``1``, the default, or ``0``): whether a hit calls Triton 3.6's C launcher itself
    (:func:`~distfuse.kernels.raw_launch.fast_launcher`) and passes device tensors by address (see the module doc).
    Any other value raises, naming the variable."""
    return env_choice(FAST_LAUNCH_ENV, ("1", "0")) == "1"


#: :func:`fast_launch_enabled`, read once at import (a hit reads it).
FAST_LAUNCH: bool = fast_launch_enabled()
#: The tensor attribute that says a tensor is passed to the launcher as its address (CUDA device memory, whose
#: address the launcher's ``cuPointerGetAttribute`` would hand back unchanged); tests point it elsewhere.  Without
#: the fast launch, ``is_meta``: no tensor that reaches a launch is a meta tensor, so every tensor goes as itself.
_BY_ADDRESS = "is_cuda" if FAST_LAUNCH else "is_meta"


def launch_cache_enabled() -> bool:
    """Compiled kernels, unless ``DISTFUSE_LAUNCH_CACHE=0``."""
    return not INTERPRET and os.environ.get(LAUNCH_CACHE_ENV, "1").strip() != "0"


class _UnkeyableError(Exception):
    """An argument whose specialisation the fingerprint does not model: the call goes through the JIT."""


def arg_key(arg):
    """The fingerprint of one runtime argument (see the module doc); raises :class:`_UnkeyableError` for other kinds."""
    if arg is None:
        return None
    kind = type(arg)
    if kind is bool:
        return ("u1", arg)
    if kind is int:
        span = 0 if -_I32 <= arg < _I32 else 1 if -_I64 <= arg < _I64 else 2
        return (span, arg == 1, arg % 16 == 0)
    if kind is float:
        return "fp"
    if isinstance(arg, torch.Tensor):
        return (arg.dtype, arg.data_ptr() % 16 == 0)
    if kind is TensorDescriptor:
        return ("desc", arg.base.dtype, tuple(arg.block_shape), arg.padding, getattr(arg, "round_f32_to_tf32", False))
    raise _UnkeyableError(kind.__name__)


def fingerprint_and_addresses(args: tuple) -> tuple[tuple, tuple]:
    """``(fingerprint(args), args as a hit passes them)``: the fingerprint with the common kinds (ints, plain tensors,
    host tensor descriptors) inlined, the per-call half of a hit's host time (a launch passes 10 to 20 arguments);
    each CUDA tensor passed as its address (:func:`by_address`), read once for both."""
    out, passed = [], []
    add, put = out.append, passed.append
    attr = _BY_ADDRESS
    for arg in args:
        kind = type(arg)
        if kind is int:
            add((0 if -_I32 <= arg < _I32 else 1 if -_I64 <= arg < _I64 else 2, arg == 1, arg % 16 == 0))
        elif kind is torch.Tensor:
            ptr = arg.data_ptr()
            add((arg.dtype, ptr % 16 == 0))
            if getattr(arg, attr):
                put(ptr)
                continue
        elif kind is TensorDescriptor:
            add(("desc", arg.base.dtype, tuple(arg.block_shape), arg.padding, getattr(arg, "round_f32_to_tf32", False)))
        else:
            add(arg_key(arg))
        put(arg)
    return tuple(out), tuple(passed)


def fingerprint(args: tuple) -> tuple:
    """``tuple(map(arg_key, args))``, with the common kinds (ints, plain tensors, host tensor descriptors) inlined:
    the per-call half of a hit's host time (a launch passes 10 to 20 arguments)."""
    return fingerprint_and_addresses(args)[0]


def constexpr_key(kwargs: dict) -> tuple:
    """The constexprs and launch options of a call as the JIT tells them apart: by name, type and value, a float by
    its ``repr``.  The JIT keys its binaries on their ``str`` (``("constexpr", value)`` pairs), so ``True`` and ``1``,
    ``1`` and ``1.0``, ``0.0`` and ``-0.0`` are different binaries, which Python's equality (and so a dict key of the
    plain values) would take for one."""
    items = tuple(kwargs.items())
    types = tuple(map(type, kwargs.values()))
    if float in types:
        return tuple([(k, repr(v) if v.__class__ is float else v) for k, v in items]), types
    return items, types


def knob_state() -> tuple:
    """The options Triton's JIT reads from its knobs at every launch and keys its binaries on: ``runtime.debug``,
    ``compilation.instrumentation_mode`` (set by Proton's instrumentation when a profile starts) and, where the
    Triton has it, ``compilation.fpsan_homomorphic_casts``.  Part of every key of the cache and of a bound launch's
    hits, so a profiler switched on after the first launches gets the instrumented binaries from the JIT, and the
    plain ones again once it is off, as without the cache."""
    compilation = _COMPILATION
    if compilation is None:
        return ()
    return _RUNTIME.debug, compilation.instrumentation_mode, getattr(compilation, "fpsan_homomorphic_casts", None)


def by_address(arg):
    """``arg`` as a hit passes it to the launcher: a CUDA tensor (exactly ``torch.Tensor``) as its address, anything
    else as it is (see the module doc)."""
    return arg.data_ptr() if type(arg) is torch.Tensor and getattr(arg, _BY_ADDRESS) else arg


class CachedLaunch:
    """``CachedLaunch(kernel)[grid](*args, **constexprs_and_options)``: ``kernel[grid](...)``, cached as above.

    Positional arguments are the kernel's leading parameters; the rest of its parameters
    (its constexprs) come by name, and names that are no parameter are launch options
    (``num_warps``...).  ``grid`` may be a tuple or, as for the JIT, a function of the
    parameters by name.  A call that leaves a parameter to its default (an autotuned kernel,
    whose tuner supplies the block sizes), or passes an argument the fingerprint does not
    model, always goes through the JIT.
    """

    def __init__(self, kernel):
        self.kernel = kernel
        self._names = tuple(kernel.arg_names)
        self._binaries: dict = {}

    def __getitem__(self, grid):
        if not launch_cache_enabled():
            return self.kernel[grid]  # the JIT's own launch, no wrapper in the way
        return lambda *args, **kwargs: self.launch(grid, args, kwargs)

    def launch(self, grid, args: tuple, kwargs: dict):
        try:
            device = _current_device()
            shape, passed = fingerprint_and_addresses(args)
            key = self._key(device, shape, kwargs)
            hit = self._binaries.get(key)
        except (_UnkeyableError, TypeError, AttributeError):  # TypeError: an unhashable constexpr
            return self.kernel[grid](*args, **kwargs)
        if hit is not None:
            binary, tail, direct = hit
            if callable(grid):  # grid(META), as the JIT calls it: every parameter by name
                grid = grid({**dict(zip(self._names, args, strict=False)), **kwargs})  # args: the leading ones
            g = _grid3(grid)
            if direct is not None and not _hooked():
                launch, function, mid = direct
                launch(g[0], g[1], g[2], _current_stream(device), function, *mid, *passed,
                       *map(kwargs.__getitem__, tail))
            else:
                binary[g](*args, *map(kwargs.__getitem__, tail))
            return binary
        binary = self.kernel[grid](*args, **kwargs)  # the JIT: specialise, compile or find, launch
        if hasattr(binary, "result"):
            binary = binary.result()
        tail = self._names[len(args):]
        if hasattr(type(binary), "__getitem__") and all(name in kwargs for name in tail):
            if len(self._binaries) >= _MAX_BINARIES:
                self._binaries.clear()
            self._binaries[key] = (binary, tail, hit_launcher(binary))
        return binary

    @staticmethod
    def _key(device: int, shape: tuple, kwargs: dict) -> tuple:
        """A call's cache key: the device, the arguments' fingerprint (``shape``), the constexprs and options by
        name and type (:func:`constexpr_key`), and the options the JIT reads from Triton's knobs at each launch
        (:func:`knob_state`)."""
        return device, shape, constexpr_key(kwargs), knob_state()

    def bind(self, grid, static: tuple, kwargs: dict, split: int | None = None) -> BoundLaunch:
        """A :class:`BoundLaunch` of this kernel: ``grid``, the positional arguments ``static`` and the constexprs
        and options ``kwargs`` fixed, for a call site that launches them again and again.  ``static`` follows the
        call's arguments, or its first ``split`` of them."""
        return BoundLaunch(self, grid, static, kwargs, split)


class BoundLaunch:
    """``bound(*lead)`` is ``kernel[grid](*lead, *static, **kwargs)``, with ``grid``, ``static`` and ``kwargs`` fixed
    when it is made (:meth:`CachedLaunch.bind`); with ``split``, ``bound(*args)`` is ``kernel[grid](*args[:split],
    *static, *args[split:], **kwargs)``.

    For the launchers whose geometry is cached per plan or shape (the halo kernels' ``*Launch`` tuples, the
    reductions' plans): their grid, scalar arguments, lookup tables and constexprs are the same at every call, and
    only the leading buffers change.  A hit therefore fingerprints the leading arguments alone and calls the binary's
    launcher with the constexprs' values already in order, where :meth:`CachedLaunch.launch` would fingerprint all
    of them (tables included: a halo launch passes 15 to 22 arguments) and key the constexprs by name at every call:
    that was most of a fused halo step's host time with the kernels stubbed (``scripts/host_cost.py --kernels``).
    ``static`` tensors must stay alive and in place while the bound launch is used (cached tables are): a hit passes
    the CUDA ones by the address they had when the first hit was recorded.

    A first call, a new fingerprint of the leading arguments, an installed launch hook or a grid function go
    through :meth:`CachedLaunch.launch` (the JIT on its misses); off the cache (the interpreter,
    ``DISTFUSE_LAUNCH_CACHE=0``) a call is the JIT's own launch.
    """

    __slots__ = ("cached", "grid", "static", "kwargs", "split", "_grid3", "_hits")

    def __init__(self, cached: CachedLaunch, grid, static: tuple, kwargs: dict, split: int | None = None):
        self.cached, self.grid, self.static, self.kwargs, self.split = cached, grid, tuple(static), dict(kwargs), split
        self._grid3 = None if callable(grid) else _grid3(grid)
        # (device, fingerprint of the call's arguments, knob_state()) -> (launch, function, mid, static by address,
        # tail values)
        self._hits: dict = {}

    def _args(self, given: tuple) -> tuple:
        k = self.split
        return given + self.static if k is None else given[:k] + self.static + given[k:]

    def __call__(self, *given):
        if not launch_cache_enabled():
            return self.cached.kernel[self.grid](*self._args(given), **self.kwargs)
        try:
            device = _current_device()
            shape, passed = fingerprint_and_addresses(given)
            key = (device, shape, knob_state())
            hit = self._hits.get(key)
        except (_UnkeyableError, TypeError, AttributeError):
            hit = key = None
        if hit is not None and not _hooked():
            launch, function, mid, static, tail = hit
            g, k = self._grid3, self.split
            if k is None:
                launch(g[0], g[1], g[2], _current_stream(device), function, *mid, *passed, *static, *tail)
            else:
                launch(g[0], g[1], g[2], _current_stream(device), function, *mid, *passed[:k], *static,
                       *passed[k:], *tail)
            return None
        args = self._args(given)
        binary = self.cached.launch(self.grid, args, self.kwargs)
        if key is not None and self._grid3 is not None:
            try:
                entry = self.cached._binaries.get(self.cached._key(device, fingerprint(args), self.kwargs))
            except (_UnkeyableError, TypeError, AttributeError):
                entry = None
            if entry is not None and entry[2] is not None:  # cached, with a launcher a hit can call
                _, names, (launch, function, mid) = entry
                self._hits[key] = (launch, function, mid, tuple(map(by_address, self.static)),
                                   tuple(self.kwargs[name] for name in names))
        return binary


_BY_KERNEL: dict = {}


def cached_launch(kernel) -> CachedLaunch:
    """The :class:`CachedLaunch` of ``kernel`` (one per kernel object, so call sites that pick a kernel at run time
    share its binaries): ``cached_launch(kernel)[grid](...)`` in place of ``kernel[grid](...)``."""
    launch = _BY_KERNEL.get(id(kernel))  # by identity: a JITFunction hashes its source key (a lock per call)
    if launch is None:
        launch = _BY_KERNEL[id(kernel)] = CachedLaunch(kernel)  # holds the kernel: its id is never reused
    return launch


def direct_launcher(binary):
    """``(run, function, packed_metadata)`` of a compiled kernel whose handles are loaded (it has launched once), or
    None where ``binary`` has no such launcher: what a cache hit calls as
    ``run(gx, gy, gz, stream, function, packed_metadata, None, None, None, *args)`` (no launch metadata, no hooks:
    the call :meth:`CompiledKernel.__getitem__`'s runner makes, less the work only a launch hook reads)."""
    try:
        run, function, packed = binary.run, binary.function, binary.packed_metadata
    except Exception:  # noqa: BLE001 - not a CompiledKernel of a Triton with these attributes
        return None
    return (run, function, packed) if callable(run) and function is not None else None


def hit_launcher(binary):
    """``(launch, function, mid)`` of a compiled kernel whose handles are loaded, or None (as :func:`direct_launcher`):
    what a hit calls as ``launch(gx, gy, gz, stream, function, *mid, *args)``, Triton's C launcher itself where
    :func:`~distfuse.kernels.raw_launch.fast_launcher` finds it (and ``DISTFUSE_FAST_LAUNCH`` is not ``0``), else the
    binary's ``run``."""
    direct = direct_launcher(binary)
    if direct is None:
        return None
    run, function, packed = direct
    launch, mid = (fast_launcher if FAST_LAUNCH else run_launcher)(run, packed)
    return launch, function, mid


def _hooked() -> bool:
    """Whether a launch hook is installed (then a hit goes through ``binary[grid]``, which builds what hooks read)."""
    runtime = _RUNTIME
    if runtime is None:
        return True
    enter, leave = runtime.launch_enter_hook, runtime.launch_exit_hook
    return _live(enter) or _live(leave)


def _live(hook) -> bool:
    """A hook that would run: any callable but an empty hook chain (Triton 3.6 and later keep chains, never None)."""
    if hook is None:
        return False
    calls = getattr(hook, "calls", None)
    return True if calls is None else bool(calls)


def _knobs() -> tuple:
    """``(knobs.runtime, knobs.compilation)``: the runtime None in a Triton without knobs (every hit then goes
    through ``binary[grid]``), the compilation None where the JIT's per-launch options are not there to read (none
    in the keys)."""
    try:
        from triton import knobs
    except ImportError:
        return None, None
    runtime, compilation = getattr(knobs, "runtime", None), getattr(knobs, "compilation", None)
    known = all(hasattr(k, name) for k, name in ((runtime, "debug"), (compilation, "instrumentation_mode")))
    return runtime, compilation if known else None


_RUNTIME, _COMPILATION = _knobs()


def _current_stream(device: int) -> int:
    """The current CUDA stream's raw handle on ``device`` (one C call, what Triton's runner passes)."""
    return torch._C._cuda_getCurrentRawStream(device)


def _current_device() -> int:
    """The current CUDA device, as Triton's launch reads it (one C call, not ``torch.cuda.current_device``'s Python)."""
    return torch._C._cuda_getDevice()


def _grid3(grid) -> tuple:
    """The compiled launcher's grid: three extents (the JIT pads a shorter grid with ones)."""
    grid = tuple(grid)
    return grid + (1,) * (3 - len(grid))
