"""Benchmark: fused halo staging and halo convolution against F.pad/clone/slice and torch.cat staging (one GPU).

What it measures, for a worker in the middle of a 3x3 (2-D) or 3x3x3 (3-D) grid, so
that it has halos on every side and at every corner (the received halos are simulated
with random buffers; no communication is timed):

* ``mode="stage"``: building the staged conv input ``[B, C, *(n + 2h)]``.
  - ``fused``    ``halo_stage`` (one Triton pass from the block and the receive buffer)
  - ``distdl``   ``F.pad`` + ``clone`` + slice assignment of the halo slabs (DistDL)
  - ``cat``      ``torch.cat`` along each axis in turn (PhysicsNeMo / DTensor style)
  - ``pieces``   distfuse's unfused staging (``halo_exchange.stage_from_pieces``: the staged tensor
                 concatenated from the boxes, a ``torch.cat`` per run of them), which the layers run where
                 dispatch does not fuse (no
                 provider packs the boxes it sends: the fused path's one ``halo_pack`` launch and the unfused
                 path's copy per box are both left out)
  - ``copy``     ``dst.copy_(src)`` of the staged tensor's bytes: the ceiling
  Effective bandwidth = (bytes read + bytes written) / time, and its % of the
  device-to-device copy bandwidth measured in the same run (target >= 80% for fused).
* ``mode="full"``: staging + conv forward + backward (input, weight and bias grads, halo
  gradients to send back and the received ones accumulated) with the same cuDNN
  convolution in every provider.  Its ``pieces`` rows are the step the layers take unfused
  (``unstage_to_pieces`` in the backward): what ``distfuse-tune project`` weighs the fused step
  against for the halo conv's dispatch (``cat`` is the targets' anchor).

Both memory formats (``--formats``): NCHW, and channels last (``channels_last`` /
``channels_last_3d``: every tensor, the baselines' slabs and the fused path's halo boxes in
``[B, *box, C]`` order; rows carry ``format`` in their shape).  In NCHW the staged rows of an
odd halo start at odd offsets, so no staging can store them in 16-byte vectors; in channels
last every staged row starts at a multiple of C, and cuDNN convolves in its native layout.

Timings: ``triton.testing.do_bench`` (median, 20th and 80th percentiles; it also clears
L2 before every run), inputs rotated over enough copies to exceed L2 several times,
random data.  Rows are harness rows (``bench.harness.Row``: op, provider, anchor, mode,
shape ``{nd, C, n, halo, batch}``, dtype, median ms, rate, the kernel that ran), each with
its anchor in the same file (``copy`` for ``stage`` and ``graph``, ``cat`` for ``full``), under ``env``
(device, versions, commit, date, the copy bandwidth); they go to
``bench/results/halo_conv-<device>-<date>.json`` (``--out-dir``, or ``--out`` for a path),
rewritten after every shape, so a run cut off by a time limit keeps what it measured.
Mode ``graph`` (``--modes graph``, CUDA only) replays the staging, ``torch.cat`` and the copy of one
input set from CUDA graphs: the device work without the host's, rows of op ``halo_stage`` so the
eager rows' targets read them apart.  With ``full`` too, the whole step of the fused path and of ``cat`` is
captured and replayed (mode ``full_graph``, rows of the halo conv op, anchored on ``cat``, each saying whether the
replay gave the eager step's results): what a training step captured whole pays, where the eager small steps are
bound by the host.

Without a CUDA device the benchmark is not run (CPU timings of interpreted kernels would
mean nothing).  ``--smoke`` then runs a tiny CPU correctness pass of every provider
instead, under the Triton interpreter, and writes no results.

    python bench/bench_halo_conv.py                      # full sweep on the GPU
    python bench/bench_halo_conv.py --dims 2 --channels 32 64 --extents 256 --modes stage
    python bench/bench_halo_conv.py --smoke              # CPU: do the providers agree?
"""

from __future__ import annotations

import argparse
import functools
import itertools
import math
import os
import sys
from pathlib import Path

import torch

from distfuse.testing.tolerance import rounding_bound

if __package__ in (None, ""):  # run as a script: make `bench.harness` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

RESULTS = Path(__file__).resolve().parent / "results"
L2_BYTES = 60 * 2**20  # H200: 60 MiB of L2; rotation aims well past it (4x)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dims", type=int, nargs="+", default=[2, 3], choices=[2, 3])
    p.add_argument("--channels", type=int, nargs="+", default=[16, 32, 64, 128, 256])
    p.add_argument("--extents", type=int, nargs="+", default=None,
                   help="local extent per axis (default 64 128 256 512 in 2-D, 64 128 in 3-D)")
    p.add_argument("--halos", type=int, nargs="+", default=[1, 2], help="halo width = kernel // 2")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"], choices=sorted(DTYPES))
    p.add_argument("--modes", nargs="+", default=["stage", "full"], choices=["stage", "graph", "full"],
                   help="graph: the staging replayed from a CUDA graph (op halo_stage: the kernels without the host); "
                        "with full, the whole step too (mode full_graph)")
    p.add_argument("--formats", nargs="+", default=["nchw", "channels_last"], choices=["nchw", "channels_last"])
    p.add_argument("--max-gib", type=float, default=24.0, help="skip shapes whose working set exceeds this")
    p.add_argument("--out", type=Path, default=None,
                   help="JSON path (default <out-dir>/halo_conv-<device>-<date>.json)")
    p.add_argument("--out-dir", type=Path, default=None, help="results folder (default bench/results)")
    p.add_argument("--smoke", action="store_true", help="tiny CPU correctness pass of every provider, no timings")
    p.add_argument("--dry-run", action="store_true",
                   help="no GPU: the whole GPU pipeline (rows, anchors, the JSON written after every shape) at tiny "
                        "shapes on CPU; its times mean nothing")
    args = p.parse_args(argv)
    args.device = "cpu" if args.dry_run else "cuda"
    if args.dry_run:
        args.dims, args.channels, args.extents, args.halos, args.dtypes = [2, 3], [2], [4], [1], ["float32"]
    return args


# ----------------------------------------------------------------------------------------
# Cases and providers (used by both the GPU run and the CPU smoke pass)
# ----------------------------------------------------------------------------------------


class Case:
    """The middle worker of a 3^nd grid: block ``[B, C, *n]``, halo ``h`` on every side, zero padding."""

    def __init__(self, nd, batch, channels, extent, halo, dtype, device, seed=0, channels_last=False):
        from distfuse.geometry.halo_plan import HaloPlan
        from distfuse.kernels import halo as hk
        from distfuse.kernels.halo_tables import recv_numel, send_numel

        self.nd, self.h, self.dtype, self.device = nd, halo, dtype, device
        self.fmt = hk.CHANNELS_LAST[nd] if channels_last else torch.contiguous_format
        k = 2 * halo + 1
        self.plan = HaloPlan.for_conv((3 * extent,) * nd, (3,) * nd, (k,) * nd, (1,) * nd, (1,) * nd,
                                      ((halo, halo),) * nd, "zeros")
        self.index = (1,) * nd
        self.lead_shape = (batch, channels)
        lead = batch * channels
        gen = torch.Generator(device="cpu").manual_seed(seed)

        def rnd(*shape):
            return torch.randn(shape, generator=gen, dtype=torch.float32).to(device=device, dtype=dtype)

        self.x = rnd(batch, channels, *(extent,) * nd).contiguous(memory_format=self.fmt)
        recv = rnd(recv_numel(self.plan, self.index, lead))  # the halos, boxes in NCHW order
        self.recv_nchw = recv
        self.incoming_nchw = rnd(send_numel(self.plan, self.index, lead))  # halo gradients coming back
        # what the fused path receives: the same boxes in the block's format
        self.recv = self._in_format([pc.src_shape for pc in self.plan.recvs(self.index)], recv)
        self.incoming = self._in_format([pc.src_shape for _, pc in self.plan.sends(self.index)], self.incoming_nchw)
        sends = [pc for _, pc in self.plan.sends(self.index)]  # the same boxes as distfuse's unfused path gets them
        self.incoming_pieces = list(zip(sends, self.boxes(self.incoming_nchw, sends), strict=True))
        self.weight = rnd(channels, channels, *(k,) * nd) * (1.0 / (channels * k**nd) ** 0.5)
        self.weight = self.weight.contiguous(memory_format=self.fmt)
        self.bias = rnd(channels)
        self.staged_shape = (batch, channels) + tuple(extent + 2 * halo for _ in range(nd))
        # The same halos as slabs, for the baselines: the torch reference stage of the plan cuts them out.
        self.staged_ref = hk.halo_stage_reference(self.x, recv, self.plan, self.index).contiguous(
            memory_format=self.fmt)
        self.dy = rnd(batch, channels, *(extent,) * nd).contiguous(memory_format=self.fmt)

    def _in_format(self, shapes, flat_nchw):
        """A flat buffer of NCHW boxes ``[B, C, *box]`` rewritten in the case's format (``[B, *box, C]``)."""
        if self.fmt == torch.contiguous_format:
            return flat_nchw
        from distfuse.kernels.halo_tables import box_offsets

        B, C = self.x.shape[:2]
        offs, _ = box_offsets(shapes, B * C)
        parts = [flat_nchw[o: o + B * C * math.prod(s)].view(B, C, *s).movedim(1, -1).reshape(-1)
                 for o, s in zip(offs, shapes, strict=True)]
        return torch.cat(parts) if parts else flat_nchw

    def boxes(self, flat_nchw, pieces):
        """``flat_nchw`` (boxes end to end, NCHW) as one contiguous ``[B, C, *box]`` tensor per piece of ``pieces``:
        the messages of distfuse's unfused exchange (``distfuse.primitives.halo_exchange``), which travel as
        contiguous NCHW boxes whatever the block's format."""
        from distfuse.kernels.halo_tables import box_offsets

        B, C = self.x.shape[:2]
        offs, _ = box_offsets([pc.src_shape for pc in pieces], B * C)
        return [flat_nchw[o: o + B * C * math.prod(pc.src_shape)].view(B, C, *pc.src_shape)
                for o, pc in zip(offs, pieces, strict=True)]

    def slabs_distdl(self):
        """Slabs written into the padded tensor: per axis a, the low and high slabs of the full extent of axes < a
        (corners included there) and the interior extent of axes > a."""
        h, nd, s = self.h, self.nd, self.staged_ref
        out = []
        for a in range(nd):
            lo = [slice(None)] * 2 + [slice(None) if b < a else slice(h, -h) for b in range(nd)]
            hi = list(lo)
            lo[2 + a] = slice(0, h)
            hi[2 + a] = slice(-h, None)
            out.append((tuple(lo), s[tuple(lo)].contiguous(memory_format=self.fmt), tuple(hi),
                        s[tuple(hi)].contiguous(memory_format=self.fmt)))
        return out

    def slabs_cat(self):
        """Per axis, from the innermost out, the low and high slabs to concatenate (corners in the later ones)."""
        h, nd, s = self.h, self.nd, self.staged_ref
        out = []
        for a in reversed(range(nd)):
            idx = [slice(None)] * 2 + [slice(None) if b > a else slice(h, -h) for b in range(nd)]
            lo, hi = list(idx), list(idx)
            lo[2 + a] = slice(0, h)
            hi[2 + a] = slice(-h, None)
            out.append((a, s[tuple(lo)].contiguous(memory_format=self.fmt),
                        s[tuple(hi)].contiguous(memory_format=self.fmt)))
        return out


@functools.lru_cache(maxsize=None)
def _halo():
    """``distfuse.kernels.halo``, imported once (on first use: after ``--dry-run`` set the interpreter), so the
    timed fused calls pay no import statement the baselines do not."""
    from distfuse.kernels import halo

    return halo


def stage_fused(case, x, recv):
    return _halo().halo_stage(x, recv, case.plan, case.index, channels_last=case.fmt != torch.contiguous_format)


def stage_fused_two_pass(case, x, recv, words=None):
    """The fused staging as the layers run it on GPUs (``overlap``): the pieces read from the block first, those
    from the receive buffer once the halos came, into the same output.  With nothing to overlap here, its rows
    show what the two passes cost against the one pass (``stage_fused``).  ``words``: the local pass in the words
    form (``distfuse.kernels.halo_stage_words``) or not; None: the package's default."""
    hk = _halo()
    cl = case.fmt != torch.contiguous_format
    out = hk.halo_stage(x, recv, case.plan, case.index, region="local", channels_last=cl, words=words)
    return hk.halo_stage(x, recv, case.plan, case.index, out=out, region="remote", channels_last=cl)


def stage_fused_words(case, x, recv):
    """The one-pass fused staging in the words form, forced (NCHW: the window's rows as flat 32-bit words, then
    the strips and the slabs; ``distfuse.kernels.halo_stage_words``, off by default until a GPU measures it)."""
    return _halo().halo_stage(x, recv, case.plan, case.index, channels_last=False, words=True)


def takes_words(case) -> bool:
    """Whether the staging of this case takes the words form when forced (``stage_fused_words``; NCHW, 16-bit
    elements in staged rows of an even length of 8 or more, or 32-bit ones, where it has a window to copy).  The
    package's default form of a case: :func:`staging_config`."""
    from distfuse.kernels import halo_programs as hp

    if case.fmt != torch.contiguous_format:
        return False
    lead = case.x.shape[0] * case.x.shape[1]
    launch = hp.stage_launch(case.plan, case.index, lead, case.x.device, "all", None, None, 1, None, True)
    return bool(launch.words) and case.x.element_size() in launch.words[0].sizes


def staging_config(case) -> tuple[dict, str]:
    """The package's one-pass staging of this case as ``stage_fused`` launches it: its config (tile, ``SPLIT``,
    ``WORDS``: ``halo_programs.stage_config``; {} where the staging walks tables only) and where that came from,
    ``"measured"`` (an entry of the tile table, ``distfuse-tune tiles``) or ``"rules"``.  The fused rows carry both."""
    from distfuse.kernels import halo_programs as hp

    trail = case.x.shape[1] if case.fmt != torch.contiguous_format else 1
    lead = case.x.numel() // math.prod(case.x.shape[2:]) // trail
    launch = hp.stage_launch(case.plan, case.index, lead, case.x.device, "all", None, None, trail, None, None,
                             case.x.dtype)
    if launch.kernel is not hp.stage_kernel:
        return {}, "rules"
    key = hp.stage_key(launch, lead, trail)
    measured = hp.measured_stage(case.x.device, case.x.dtype, lead, (1, key["K"], key["N"]))
    return hp.stage_config(launch, case.x.element_size()), "measured" if measured is not None else "rules"


@functools.lru_cache(maxsize=None)
def _halo_packing():
    """``distfuse.primitives._halo_packing``, imported once (as :func:`_halo`)."""
    from distfuse.primitives import _halo_packing

    return _halo_packing


@functools.lru_cache(maxsize=None)
def _halo_exchange():
    """``distfuse.primitives.halo_exchange``, imported once (as :func:`_halo`)."""
    from distfuse.primitives import halo_exchange

    return halo_exchange


def stage_pieces(case, x, flat):
    """distfuse's unfused staging (the layers' path where dispatch does not fuse) of the received boxes end to end
    (``flat``, NCHW boxes): as the layers' ``halo_exchange`` op pair stages once its boxes came
    (``halo_exchange.receive_buffers``, ``stage_received``): one gather from them where the block is small, else the
    block's views and the boxes concatenated (``stage_from_pieces``)."""
    hx = _halo_exchange()
    gathered, _ = hx.receive_buffers(x, case.plan, case.index)  # the layers' choice (and allocation) of buffers
    if gathered is not None:
        return hx.stage_received(x, case.plan, case.index, flat, ())
    return hx.stage_from_pieces(x, case.plan, case.index, case.boxes(flat, case.plan.recvs(case.index)))


class _PiecesStage(torch.autograd.Function):
    """distfuse's unfused staging and its adjoint without the exchange (single GPU), as the layers' ``halo_exchange``
    op pair runs them: forward one gather from the received boxes end to end where the block is small
    (``halo_exchange.receive_buffers``, ``stage_received``), else ``stage_from_pieces`` of the received boxes (views
    of one flat buffer here, a buffer a box there); backward ``unstage_for_exchange`` (the block's own boxes summed
    into a gradient of the block, in fp32 for 16-bit data, and the messages to send back: the flat buffer's
    gradient), then the
    neighbours' boxes (``case.incoming_nchw``, simulated) added into it as the layers add them, and the sum rounded
    to the dtype once."""

    @staticmethod
    def forward(ctx, x, case, flat):
        ctx.case, ctx.x_shape, ctx.fmt = case, tuple(x.shape), case.fmt
        return stage_pieces(case, x, flat)

    @staticmethod
    def backward(ctx, g):
        case = ctx.case
        grad_x, outgoing = _halo_exchange().unstage_for_exchange(g, ctx.x_shape, case.plan, case.index, ctx.fmt)
        # the boxes that come back, added as the layers' adjoint adds them (halo_exchange._exchange_adjoint): small
        # ones at once, in box order (distfuse.primitives._halo_packing), others per box
        packing = _halo_packing()
        if packing.packs(case.incoming_nchw.numel(), g):
            packing.add_incoming(grad_x, case.plan, case.index, case.incoming_nchw)
        else:
            for pc, buf in case.incoming_pieces:
                grad_x[pc.src_index].add_(buf)
        return grad_x.to(g.dtype), None, torch.cat([m.reshape(-1) for m in outgoing])


def stage_distdl(case, x, slabs):
    """DistDL: pad with zeros, clone (the padded tensor is then written in place), overwrite the halo slabs."""
    import torch.nn.functional as F

    h = case.h
    xp = F.pad(x, [h] * (2 * case.nd)).clone()
    for lo_idx, lo, hi_idx, hi in slabs:
        xp[lo_idx] = lo
        xp[hi_idx] = hi
    return xp


def stage_cat(case, x, slabs):
    out = x
    for a, lo, hi in slabs:
        out = torch.cat([lo, out, hi], dim=2 + a)
    return out


class _FusedStage(torch.autograd.Function):
    """The fused op's staging and its adjoint without the exchange (single GPU): the send-back buffer is the
    receive buffer's gradient, and the received halo gradients are a fixed buffer."""

    @staticmethod
    def forward(ctx, x, recv, case):
        ctx.case = case
        return stage_fused(case, x, recv)

    @staticmethod
    def backward(ctx, g):
        hk = _halo()
        case = ctx.case
        cl = case.fmt != torch.contiguous_format
        u = hk.halo_unstage(g.contiguous(memory_format=case.fmt), case.plan, case.index, channels_last=cl)
        gx = hk.halo_accumulate(u.grad_x, u.self_boxes, case.incoming, case.plan, case.index, channels_last=cl)
        return gx, u.send, None


def _conv(case):
    import torch.nn.functional as F

    return {2: F.conv2d, 3: F.conv3d}[case.nd]


def _leaf(t):
    """``t`` as a leaf that requires grad: itself when it already is one (:func:`step_leaves`), else a detached one."""
    return t if t.is_leaf and t.requires_grad else t.detach().requires_grad_(True)


def _halo_leaves(provider, halos):
    """``halos`` (a provider's, as :func:`_halo_inputs` gives them) with every tensor a leaf (:func:`_leaf`), and
    those leaves in order."""
    if provider in ("fused", "pieces"):  # one flat buffer (the received boxes end to end, _halo_inputs)
        halos = _leaf(halos)
        return halos, [halos]
    if provider == "distdl":
        halos = [(li, _leaf(lo), hi_i, _leaf(hi)) for li, lo, hi_i, hi in halos]
        return halos, [t for _, lo, _, hi in halos for t in (lo, hi)]
    halos = [(a, _leaf(lo), _leaf(hi)) for a, lo, hi in halos]
    return halos, [t for _, lo, hi in halos for t in (lo, hi)]


def step_leaves(case, provider):
    """``(x, halos, weight, bias)`` of ``case`` for :func:`full_step`, made leaves once: the timed steps then pay no
    ``detach`` per tensor and per step (a provider's halos are 1 to 26 tensors)."""
    return _leaf(case.x), _halo_leaves(provider, _step_halos(case, provider))[0], _leaf(case.weight), \
        _leaf(case.bias)


def _step_halos(case, provider):
    """A provider's halos for :func:`full_step`: as :func:`_halo_inputs` gives them."""
    return _halo_inputs(case, provider)


def full_step(case, provider, x, halos, weight, bias):
    """Staging + conv forward + backward; returns (y, grads of x, weight, bias, halos).

    The gradients are taken with ``torch.autograd.grad``, not accumulated into ``.grad``: each provider hands its
    halos to the staging as its own tensors (one flat buffer fused and ``pieces``, 4 or 6 slabs for ``cat`` and
    ``distdl``), and an accumulation per leaf cost about 5 us of host time each (CPU), host time that is the
    bench's, not the staging's.  Captured, a leaf costs under 1 us."""
    x, w, b = _leaf(x), _leaf(weight), _leaf(bias)
    halos, leaves = _halo_leaves(provider, halos)
    if provider == "fused":
        staged = _FusedStage.apply(x, halos, case)
    elif provider == "pieces":
        staged = _PiecesStage.apply(x, case, halos)
    elif provider == "distdl":
        staged = stage_distdl(case, x, halos)
    else:
        staged = stage_cat(case, x, halos)
    y = _conv(case)(staged, w, b)
    grads = torch.autograd.grad(y, [x, w, b, *leaves], case.dy)
    return y, grads[0], grads[1], grads[2], list(grads[3:])


def _same_step(got, want) -> bool:
    """Whether two results of :func:`full_step` (output, gradients of x, weight, bias and the halos) agree, each
    tensor within a few roundings of its largest element: cuDNN may pick another algorithm under capture, which
    sums in another order (in fp32, then rounds once to the dtype), so elements near zero differ by the rounding of
    the largest partial sums, not of themselves."""
    pairs = list(zip(got[:4] + tuple(got[4]), want[:4] + tuple(want[4]), strict=True))
    for a, b in pairs:
        if a is None or b is None or a.shape != b.shape:
            return False
        scale = b.float().abs().max().item() if b.numel() else 0.0
        tol = (2**-6 if b.element_size() <= 2 else 1e-3) * scale  # 4 bf16 ulps, or fp32 sums of 10^5 terms
        if b.numel() and (a.float() - b.float()).abs().max().item() > tol:
            return False
    return True


def _halo_inputs(case, provider):
    """A provider's received halos: the fused staging's receive buffer (boxes in the block's format), the layers'
    unfused staging's (``pieces``: NCHW boxes end to end, one flat buffer), the baselines' slabs."""
    if provider == "pieces":
        return case.recv_nchw
    return {"fused": case.recv, "distdl": case.slabs_distdl(), "cat": case.slabs_cat()}[provider]


# ----------------------------------------------------------------------------------------
# CPU smoke pass
# ----------------------------------------------------------------------------------------


def _close64(got, want, terms) -> bool:
    """``got`` within float64's rounding bound of ``want`` (``distfuse.testing.tolerance``), both sides rounded: sums
    of ``terms`` terms, each element on the scale of the tensor's typical magnitude (at least 1, the data's)."""
    bound = 2 * rounding_bound(torch.float64, terms)
    got, want = got.detach(), want.detach()
    scale = max(1.0, float(want.pow(2).mean().sqrt())) if want.numel() else 1.0
    return bool(((got - want).abs() <= bound * (want.abs() + scale)).all())


def smoke() -> int:
    """Tiny shapes on the CPU: the stagings (fused in one pass and in two, each in the words form too where it
    applies, distdl, cat, and distfuse's unfused pieces) agree exactly; fwd+bwd agree in float64."""
    from distfuse.kernels import halo as hk
    from distfuse.kernels.halo_tables import self_numel

    for nd, cl in itertools.product((2, 3), (False, True)):
        name_of = f"{nd}-D {'channels last' if cl else 'NCHW'}"
        for dtype in (torch.float32, torch.bfloat16, torch.float64):
            case = Case(nd, 1, 3, 5, 1 if nd == 3 else 2, dtype, "cpu", channels_last=cl)
            ref = case.staged_ref
            got = {"fused": stage_fused(case, case.x, case.recv),
                   "fused_two_pass": stage_fused_two_pass(case, case.x, case.recv),
                   "distdl": stage_distdl(case, case.x, case.slabs_distdl()),
                   "cat": stage_cat(case, case.x, case.slabs_cat()),
                   "pieces": stage_pieces(case, case.x, _halo_inputs(case, "pieces"))}
            if takes_words(case):  # the words form (fp32 here: the smoke's staged rows are odd)
                got["fused_words"] = stage_fused_words(case, case.x, case.recv)
                got["fused_two_pass_words"] = stage_fused_two_pass(case, case.x, case.recv, words=True)
            for name, s in got.items():
                if not torch.equal(s, ref):
                    print(f"smoke: {name_of} {dtype} staging by {name} differs from the reference", file=sys.stderr)
                    return 1
            if cl and not got["fused"].is_contiguous(memory_format=case.fmt):
                print(f"smoke: {name_of}: the fused staging dropped the format", file=sys.stderr)
                return 1
        case = Case(nd, 2, 3, 5, 1, torch.float64, "cpu", channels_last=cl)
        outs = {p: full_step(case, p, case.x, _step_halos(case, p), case.weight, case.bias)
                for p in ("fused", "distdl", "cat", "pieces")}
        # the fused path also adds the halo gradients that neighbours send back (simulated); the baselines
        # stop at this worker's own staging, so add the same boxes to theirs
        back = hk.halo_accumulate_reference(torch.zeros_like(case.x), torch.zeros(
            self_numel(case.plan, case.index, case.x.shape[0] * case.x.shape[1]), dtype=torch.float64),
            case.incoming_nchw, case.plan, case.index)
        for p in ("distdl", "cat"):
            outs[p] = (outs[p][0], outs[p][1] + back, *outs[p][2:])
        # float64 sums in two orders: an output sums C * taps products, a weight gradient B * n^nd
        terms = max(case.x.shape[1] * 3**nd, case.x.shape[0] * case.x.shape[2] ** nd)
        for p in ("distdl", "cat", "pieces"):
            for i, what in enumerate(("y", "grad x", "grad weight", "grad bias")):
                if not _close64(outs["fused"][i], outs[p][i], terms):
                    print(f"smoke: {name_of} fused and {p} differ in {what}", file=sys.stderr)
                    return 1
        # the halos' gradients (what goes back to the neighbours): distfuse's two paths send the same boxes (the
        # fused one in the block's format, end to end); the baselines' slabs carry the same total
        recvs = [pc.src_shape for pc in case.plan.recvs(case.index)]
        sent = case._in_format(recvs, torch.cat([g.reshape(-1) for g in outs["pieces"][4]]))
        if not _close64(outs["fused"][4][0], sent, terms):
            print(f"smoke: {name_of} fused and pieces send different halo gradients", file=sys.stderr)
            return 1
        tot = {p: sum(float(g.sum()) for g in outs[p][4]) for p in outs}
        mags = sum(float(g.abs().sum()) for g in outs["distdl"][4])  # a sum of sums: bounded by its terms' magnitudes
        elements = sum(g.numel() for g in outs["distdl"][4])
        if abs(tot["fused"] - tot["distdl"]) > 2 * rounding_bound(torch.float64, terms + elements) * max(1.0, mags):
            print(f"smoke: {name_of} halo gradients differ: {tot}", file=sys.stderr)
            return 1
        print(f"smoke: {name_of} fused (one pass and two; in the words form too where it applies), distdl, cat and "
              "pieces stagings agree (fp32, bf16, fp64); fwd+bwd agree (fp64)")
    print("smoke: ok (correctness only; no timings on CPU)")
    return 0


# ----------------------------------------------------------------------------------------
# GPU run
# ----------------------------------------------------------------------------------------


def _device_name() -> str:
    if not torch.cuda.is_available():
        return "cpu"
    try:
        import pynvml

        pynvml.nvmlInit()
        name = pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device()))
        return name.decode() if isinstance(name, bytes) else str(name)
    except Exception:  # noqa: BLE001 - pynvml missing or NVML unavailable: fall back to torch's name
        return torch.cuda.get_device_name()


def _bench(fn, rotations: int, device: str = "cuda"):
    """Median, 20th and 80th percentile in ms; ``fn(i)`` uses input set ``i % rotations``.

    CPU (``--dry-run``): two runs through the harness timer; the numbers mean nothing.
    """
    state = [0]

    def call():
        fn(state[0] % rotations)
        state[0] += 1

    if device != "cuda":
        from bench.harness import time_fn

        return time_fn(call, warmup=1, reps=2, device=torch.device(device))
    import triton.testing

    return triton.testing.do_bench(call, warmup=25, rep=100, quantiles=[0.5, 0.2, 0.8])


def _copy_bandwidth(device: str = "cuda") -> float:
    """Device-to-device copy bandwidth (bytes read + written per second) of a 2 GiB buffer (4 MiB on CPU)."""
    n = 2**29 if device == "cuda" else 2**20  # fp32 elements: 2 GiB, far past L2
    src = torch.randn(n, device=device)
    dst = torch.empty_like(src)
    ms = _bench(lambda i: dst.copy_(src), 1, device)[0]
    return 2 * src.numel() * src.element_size() / (ms * 1e-3)


#: The anchor of each mode, measured in the same run: the device copy for staging, torch.cat staging + the same
#: cuDNN convolution for the whole step.
ANCHORS = {"stage": "copy", "graph": "copy", "full": "cat", "full_graph": "cat"}
#: What each provider runs (rows name it: ``kernel``).
KERNELS = {"stage": {"fused": "halo_stage", "fused_words": "halo_stage (words form)", "distdl": "F.pad+clone+slices",
                     "cat": "torch.cat", "pieces": "stage_received", "copy": "Tensor.copy_"},
           "graph": {"fused": "halo_stage", "fused_two_pass": "halo_stage local+remote",
                     "fused_words": "halo_stage (words form)", "fused_two_pass_words": "halo_stage local+remote "
                     "(words form)", "cat": "torch.cat", "copy": "Tensor.copy_"},
           "full": {"fused": "halo_stage+cudnn+halo_unstage/accumulate", "distdl": "F.pad+clone+slices+cudnn",
                    "cat": "torch.cat+cudnn", "pieces": "stage_received+cudnn+unstage_for_exchange"},
           "full_graph": {"fused": "halo_stage+cudnn+halo_unstage/accumulate", "cat": "torch.cat+cudnn"}}


def gpu_run(args) -> int:
    from bench.harness import environment, results_path, write_json

    env = environment()
    device_name = _device_name()
    copy_bw = _copy_bandwidth(args.device)
    env.update(nvml_name=device_name, copy_GBps=round(copy_bw / 1e9, 1), world_size=1,
               note="single GPU; received halos simulated with buffers; no communication timed")
    print(f"{device_name}: device-to-device copy {copy_bw / 1e9:.0f} GB/s")
    out = args.out or results_path("halo_conv", env, args.out_dir)
    rows = []
    for nd in args.dims:
        extents = args.extents or ([64, 128, 256, 512] if nd == 2 else [64, 128])
        for dtype_name in args.dtypes:
            dtype = DTYPES[dtype_name]
            for c in args.channels:
                for n in extents:
                    for h in args.halos:
                        for fmt in args.formats:
                            rows += _run_shape(args, nd, c, n, h, dtype, dtype_name, copy_bw, fmt)
                            write_json(out, env, rows, partial=True)  # after every shape: a cut-off run keeps them
    write_json(out, env, rows, partial=False)
    print(f"wrote {len(rows)} rows to {out}")
    return 0


def _run_shape(args, nd, c, n, h, dtype, dtype_name, copy_bw, fmt="nchw"):
    from bench.harness import Row, add_ratios
    from distfuse.fused import registry

    esize = torch.empty(0, dtype=dtype).element_size()
    staged_elems = args.batch * c * (n + 2 * h) ** nd
    block_elems = args.batch * c * n**nd
    # one input set: block, halos, staged output, dy and the gradients (x2 for the autograd baselines)
    set_bytes = esize * (4 * staged_elems + 2 * block_elems)
    if set_bytes > args.max_gib * 2**30:
        print(f"skip {nd}-D C={c} n={n} h={h} {dtype_name}: {set_bytes / 2**30:.1f} GiB > --max-gib")
        return []
    rotations = max(1, min(8, int(4 * L2_BYTES // max(1, esize * staged_elems)) + 1,
                           int(args.max_gib * 2**30 // set_bytes)))
    dev = args.device
    cases = [Case(nd, args.batch, c, n, h, dtype, dev, seed=i, channels_last=fmt == "channels_last")
             for i in range(rotations)]
    halos = {p: [_halo_inputs(cs, p) for cs in cases] for p in ("fused", "distdl", "cat", "pieces")}
    # The shape keys gpu_ratios reads (C, n, nd: the volume C * n^nd) and the rest of the case; format keeps the
    # channels-last rows and their anchors apart from the NCHW ones.
    shape = dict(nd=nd, C=c, n=n, halo=h, batch=args.batch, format=fmt)
    op = registry.HALO_CONV.name
    rows = []

    # the package's default staging of this case (a row names the kernel that ran): the words form where
    # DISTFUSE_STAGE_WORDS=1 or a measured config makes it the default; the fused rows carry the config and its source
    config, source = staging_config(cases[0])
    default_words = bool(config.get("WORDS"))
    # the layers' unfused staging of this case: one gather (a small block) or the views (its rows name which)
    pieces_form = " (one gather)" if _halo_exchange().receive_buffers(
        cases[0].x, cases[0].plan, cases[0].index)[0] is not None else " (views)"

    def row(mode, provider, q, extra=None, **kw):
        # The graph rows are the staging op's own (halo_stage): kept apart from the eager rows of the halo conv op
        kernel = KERNELS[mode][provider] + (" (words form)" if provider == "fused" and default_words else "") + \
            (pieces_form if provider == "pieces" else "")
        if provider in ("fused", "fused_two_pass"):
            extra = dict(extra or {}, stage_config=config, stage_config_source=source)
        rows.append(Row(op="halo_stage" if mode == "graph" else op, provider=provider, mode=mode, shape=dict(shape),
                        dtype=dtype_name, world_size=1, ms=q[0], ms_q20=q[1], ms_q80=q[2], kernel=kernel,
                        **({} if extra is None else dict(extra=extra)), **kw))

    if "stage" in args.modes:
        # bytes moved: the block and the halos read once, the staged tensor written once
        moved = esize * (block_elems + (staged_elems - block_elems) + staged_elems)
        fns = {
            "fused": lambda i: stage_fused(cases[i], cases[i].x, halos["fused"][i]),
            "distdl": lambda i: stage_distdl(cases[i], cases[i].x, halos["distdl"][i]),
            "cat": lambda i: stage_cat(cases[i], cases[i].x, halos["cat"][i]),
            "pieces": lambda i: stage_pieces(cases[i], cases[i].x, halos["pieces"][i]),
        }
        if takes_words(cases[0]):  # the words form, forced (off by default: a row of its own, not "fused")
            fns["fused_words"] = lambda i: stage_fused_words(cases[i], cases[i].x, halos["fused"][i])
        dst = [torch.empty(cs.staged_shape, device=dev, dtype=dtype, memory_format=cs.fmt) for cs in cases]
        fns["copy"] = lambda i: dst[i].copy_(cases[i].staged_ref)
        for provider, fn in fns.items():
            q = _bench(fn, rotations, dev)
            moved_p = 2 * esize * staged_elems if provider == "copy" else moved
            bw = moved_p / (q[0] * 1e-3)
            row("stage", provider, q, rate=bw / 1e9, rate_unit="GB/s", extra=dict(pct_of_copy=100.0 * bw / copy_bw))
    if "graph" in args.modes and dev == "cuda":
        from bench.harness import graphed

        # One input set captured per provider and replayed (after the timer's L2 flush): the device work of the
        # staging alone, as a step captured in a CUDA graph runs it; the eager rows above keep the host's share.
        dst = [torch.empty(cs.staged_shape, device=dev, dtype=dtype, memory_format=cs.fmt) for cs in cases]
        # fused_two_pass: the layers' staging on GPUs (local, then remote), against the one pass
        graph_fns = {"fused": lambda: stage_fused(cases[0], cases[0].x, halos["fused"][0]),
                     "fused_two_pass": lambda: stage_fused_two_pass(cases[0], cases[0].x, halos["fused"][0]),
                     "cat": lambda: stage_cat(cases[0], cases[0].x, halos["cat"][0]),
                     "copy": lambda: dst[0].copy_(cases[0].staged_ref)}
        if takes_words(cases[0]):  # the words form beside the default, in both (off by default: not "fused")
            graph_fns["fused_words"] = lambda: stage_fused_words(cases[0], cases[0].x, halos["fused"][0])
            graph_fns["fused_two_pass_words"] = lambda: stage_fused_two_pass(cases[0], cases[0].x,
                                                                             halos["fused"][0], words=True)
        for provider, fn in graph_fns.items():
            try:
                replay = graphed(fn)
            except Exception as exc:  # noqa: BLE001 - reported, the case goes on
                print(f"graph halo_stage {provider} {shape}: not captured: {type(exc).__name__}: {str(exc)[:200]}")
                continue
            q = _bench(lambda i, replay=replay: replay(), 1, dev)
            how = "graph"
            if provider == "copy":
                # A copy captured in a graph is a memcpy node, which ran up to 1.4x slower than the copy kernel an
                # eager copy_ launches (H200, 2026-11-28: 103 against 72 us for 135 MB): the anchor is the faster
                # of the two, so a graph row's ratio never gains from the anchor's capture.
                eager = _bench(lambda i: dst[0].copy_(cases[0].staged_ref), 1, dev)
                if eager[0] < q[0]:
                    q, how = eager, "eager"
            row("graph", provider, q, extra=dict(graph=True, timed=how))
    if "full" in args.modes:
        # pieces: distfuse's own unfused step, the alternative the layers' dispatch weighs the fused step against
        leaves = {p: [step_leaves(cs, p) for cs in cases] for p in ("fused", "distdl", "cat", "pieces")}
        for provider in ("fused", "distdl", "cat", "pieces"):
            q = _bench(lambda i, p=provider: full_step(cases[i], p, *leaves[p][i]), rotations, dev)
            row("full", provider, q)
    if "full" in args.modes and "graph" in args.modes and dev == "cuda":
        # The whole step of one input set (forward and backward) captured in a CUDA graph and replayed: the device
        # work of both steps without the host's, as a training step captured whole runs it.  Rows of the halo conv
        # op (its target reads them with the eager ones); each says whether the replay gave the eager step's results.
        from bench.harness import graph_capture

        for provider in ("fused", "cat"):
            inputs = step_leaves(cases[0], provider)

            def step(p=provider, inputs=inputs):
                return full_step(cases[0], p, *inputs)
            try:
                replay, captured = graph_capture(step)
            except Exception as exc:  # noqa: BLE001 - reported, the case goes on
                print(f"graph halo_conv full {provider} {shape}: not captured: {type(exc).__name__}: {str(exc)[:200]}")
                continue
            q = _bench(lambda i, replay=replay: replay(), 1, dev)
            row("full_graph", provider, q, extra=dict(graph=True, matches_eager=_same_step(captured, step())))
    for mode, anchor in ANCHORS.items():
        add_ratios([r for r in rows if r.mode == mode], anchor)
    for r in rows:
        extra = f"  {r.extra['pct_of_copy']:5.1f}% of copy" if "pct_of_copy" in r.extra else ""
        ratio = f"  x{r.ratio:.2f} of {r.anchor}" if r.ratio is not None else ""
        print(f"{nd}-D C={c:3d} n={n:3d} h={h} {fmt:13s} {dtype_name:8s} {r.mode:5s} {r.provider:6s} "
              f"{r.ms * 1e3:9.1f} us{extra}{ratio}")
    if dev == "cuda":
        torch.cuda.empty_cache()  # this shape's buffers are freed on return; hand their blocks back for the next
    return rows


def main(argv=None) -> int:
    args = _parse(argv)
    has_cuda = torch.cuda.is_available()
    if args.smoke:
        if not has_cuda:
            os.environ.setdefault("TRITON_INTERPRET", "1")  # before distfuse.kernels is imported
        return smoke()
    if args.dry_run:
        if not has_cuda:
            os.environ.setdefault("TRITON_INTERPRET", "1")
        return gpu_run(args)
    if not has_cuda:
        print("no CUDA device; benchmark not run (use --smoke for a CPU correctness pass)")
        return 0
    return gpu_run(args)


if __name__ == "__main__":
    sys.exit(main())
