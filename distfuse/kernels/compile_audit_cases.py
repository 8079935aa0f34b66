"""The compile audit's catalogue: every ``@triton.jit`` kernel of distfuse in every config a launcher can pick.

A :class:`KernelCase` names one compilation: the kernel, its constexprs and launch
options, the Triton signature its arguments take, and the PTX checks it must pass.
:func:`audit_cases` lists them all (the GEMM fusions with their flags and signatures,
the halo exchange, the implicit-GEMM convolution) in fp32, fp16 and bf16.  The compiling
and the checks themselves live in :mod:`distfuse.kernels.compile_audit`, which re-exports
both names; adding a kernel or a config to the audit only touches this catalogue.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

__all__ = ["KernelCase", "audit_cases", "DTYPES"]

_TT = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_LUTS = {f"{k}{a}_ptr": "i32" for a in range(3) for k in ("seg", "crd")}  # the halo lookup tables


@dataclass
class KernelCase:
    """One compilation: a kernel, its constexprs and launch options, and the checks its PTX must pass.

    ``pointer_dtypes`` maps pointer arguments to Triton element types (default: the
    case's dtype for ``*_ptr`` arguments); ``ints`` maps integer arguments to ``i32`` or
    ``i64`` (default ``i32``).  ``aligned`` lists the integer arguments that are
    multiples of 16 in the case (Triton specialises those at run time; pointers are
    always taken as 16-byte aligned, as torch allocates them).  ``descriptors`` maps
    host-side tensor-descriptor arguments to their block shape (elements of the case's
    dtype): ``tensordesc<bf16[128, 64]>`` in the signature.
    """

    name: str
    fn: object
    dtype: torch.dtype
    constexprs: dict
    num_warps: int = 4
    num_stages: int = 3
    pointer_dtypes: dict = field(default_factory=dict)
    ints: dict = field(default_factory=dict)
    aligned: tuple = ()
    checks: tuple = ()
    descriptors: dict = field(default_factory=dict)

    def __post_init__(self):
        # a constexpr the case leaves to its default is compiled at that default, as a launch that names it (the
        # launchers name every one): not as a run-time argument, which would compile branches no launch takes
        defaults = {p.name: p.default for p in self.fn.params if p.is_constexpr and p.has_default}
        self.constexprs = {**{k: v for k, v in defaults.items() if k not in self.constexprs}, **self.constexprs}

    def signature(self) -> tuple[dict, dict]:
        tt = _TT[self.dtype]
        sig, attrs = {}, {}
        dont = set(getattr(self.fn, "do_not_specialize", ()) or ())
        for i, name in enumerate(self.fn.arg_names):
            if name in self.constexprs:
                sig[name] = "constexpr"
            elif name in self.descriptors:
                sig[name] = f"tensordesc<{tt}[{', '.join(str(b) for b in self.descriptors[name])}]>"
                continue
            elif name in self.pointer_dtypes:
                sig[name] = "*" + self.pointer_dtypes[name]
            elif name.endswith("_ptr"):
                sig[name] = "*" + tt
            else:
                sig[name] = self.ints.get(name, "i32")
            if sig[name].startswith("*") or (name in self.aligned and name not in dont):
                attrs[(i,)] = [["tt.divisibility", 16]]
        return sig, attrs

    def label(self) -> str:
        shown = ("INPUT_PRECISION", "REGION", "LOG2_NBOX", "LOG2_NCELL", "W_UNROLL", "B_KMAJOR", "FLAT", "WIDE",
                 "FLATTEN", "SPAN", "TRAIL", "STRIP_ALIGN", "POLL_LOADS")
        meta = ",".join(f"{k}={v}" for k, v in self.constexprs.items() if k.startswith("BLOCK") or k in shown)
        return f"{self.name}[{_TT[self.dtype]};{meta};w{self.num_warps}s{self.num_stages}]"



def _gemm_cases(dtypes) -> list[KernelCase]:
    import triton

    import distfuse.kernels.all_gather_features_matmul as ag_features_kernels
    import distfuse.kernels.all_gather_matmul as all_gather_kernels
    import distfuse.kernels.chunk_flag as chunk_flag
    import distfuse.kernels.chunk_reduce as chunk_reduce_kernels
    import distfuse.kernels.gathered_matmul_persistent as gathered_persistent_kernels
    import distfuse.kernels.matmul_all_reduce as all_reduce_kernels
    import distfuse.kernels.matmul_reduce_scatter as reduce_scatter_kernels
    import distfuse.kernels.matmul_reduce_scatter_features as rs_features_kernels
    import distfuse.kernels.matmul_scatter_persistent as persistent_kernels
    import distfuse.kernels.scatter_partial as scatter_partial_kernels
    import distfuse.kernels.signature as signature_kernels
    from distfuse.kernels._utils import (
        REDUCE_AUDIT_W,
        config_of,
        get_chunk_reduce_configs,
        get_gemm_configs,
        get_push_configs,
        pinned_gemm_config,
    )
    from distfuse.kernels.jit_helpers import store_word_kernel

    tables = {"data_ptrs": "i64", "flag_ptrs": "i64", "counter_ptr": "i32", "flags_ptr": "i32", "status_ptr": "i32",
              "epoch_ptr": "i32", "sigs_ptr": "i32", "word_ptr": "i32"}
    case = functools.partial(KernelCase, pointer_dtypes=tables, ints={"timeout": "i64"})

    def family_configs(dt, family, prec="tf32"):
        """``(num_warps, num_stages, blocks)`` of the family's autotuning list for products in ``prec`` plus every
        bucket's pinned config."""
        configs = [config_of(c) for c in get_gemm_configs(dt, family, prec)]
        for rows, cols in ((4096, 4096), (4096, 128), (64, 4096), (16, 16)):  # every bucket of the pinned rule
            pinned = pinned_gemm_config(dt, rows, cols, family, prec)
            if pinned not in configs:
                configs.append(pinned)
        return [(c.pop("num_warps"), c.pop("num_stages"), c) for c in configs]

    def b_block(cfg, kmajor):  # the weight descriptor's block: [BLOCK_K, BLOCK_N] for a [K, N] read
        return (cfg["BLOCK_K"], cfg["BLOCK_N"]) if kmajor else (cfg["BLOCK_N"], cfg["BLOCK_K"])

    # The one-program-per-tile GEMMs: name, kernel, constexprs besides the tile's, aligned integer arguments, checks.
    pointer = (
        ("matmul_scatter", reduce_scatter_kernels._matmul_scatter_kernel, {},
         ("N", "K", "ld", "stride_ab", "stride_an", "stride_bn"), ("release_sys", "vector_store")),
        ("gathered_matmul", all_gather_kernels._gathered_matmul_kernel, dict(HAS_BIAS=True, TIMED=True),
         ("N", "K", "stride_xb", "stride_xn", "stride_bn"), ("acquire_sys",)),
        # The feature-direction scatter (column chunks).
        ("matmul_scatter_columns", rs_features_kernels._matmul_scatter_columns_kernel, dict(HAS_BIAS=True),
         ("N", "K", "ld", "stride_am", "stride_bn"), ("release_sys", "vector_store")),
        # GEMM + one-shot all-reduce: each tile stored into every rank's slot.
        ("matmul_push", all_reduce_kernels._matmul_push_kernel, dict(HAS_BIAS=True),
         ("N", "K", "ld", "stride_am", "stride_bn"), ("release_sys", "vector_store")),
    )
    cases = []
    for dt in dtypes:
        precisions = ("ieee", "tf32") if dt == torch.float32 else ("tf32",)
        for prec in precisions:
            base = dict(UPCAST=False, INPUT_PRECISION=prec, ROUND_BF16=False)
            for warps, stages, cfg in family_configs(dt, "gathered_k", prec):
                # The feature-direction all-gather GEMM: its own list (it spills where the others do not).
                cases.append(case("gathered_k_matmul", ag_features_kernels._gathered_k_matmul_kernel, dt,
                                  dict(base, HAS_BIAS=True, TIMED=True, **cfg), warps, stages,
                                  aligned=("N", "K", "stride_xm", "stride_bn"), checks=("acquire_sys",)))
            # The persistent form: host tensor descriptors (TMA); both weight layouts; the flattened loop (the
            # default) and the nested one with each tile's arrival deferred; row tiles per chunk and spanning
            # chunks (per-row slot addresses), at W = 8.  Never with IEEE fp32 products: the selector refuses them
            # compiled (kernels/persistent.compiled_refusal; its dot spills 0.3-5.9 KB a thread there).
            for warps, stages, cfg in family_configs(dt, "persistent") if prec != "ieee" else ():
                forms = ((False, True, False), (True, True, False), (False, False, False), (False, True, True))
                for kmajor, flatten, span in forms:
                    cases.append(case("matmul_scatter_persistent", persistent_kernels._matmul_scatter_persistent_kernel,
                                      dt, dict(base, B_KMAJOR=kmajor, FLATTEN=flatten, SPAN=span, W_BLOCK=8, **cfg),
                                      warps, stages, aligned=("N", "K", "ld"),
                                      descriptors=dict(a_desc=(cfg["BLOCK_M"], cfg["BLOCK_K"]),
                                                       b_desc=b_block(cfg, kmajor)),
                                      checks=("release_sys", "vector_store", "tma_load", "pipelined")))
        for warps, stages, cfg in family_configs(dt, "gathered_persistent"):
            # The all-gather GEMM consumer, persistent form: TMA loads of the shard and the gathered rows, one poll
            # of every chunk's flag (W = 8) and a wait per chunk still missing; both weight layouts; the split
            # epilogue of every pinned config.  fp32 only with TF32: the selector runs the pointer kernel for
            # compiled fp32 IEEE products.
            for kmajor in (False, True):
                a_block = (cfg["BLOCK_M"], cfg["BLOCK_K"])
                cases.append(case("gathered_matmul_persistent",
                                  gathered_persistent_kernels._gathered_matmul_persistent_kernel, dt,
                                  dict(UPCAST=False, INPUT_PRECISION="tf32", ROUND_BF16=False, HAS_BIAS=True,
                                       TIMED=True, EPILOGUE_SUBTILE=True, B_KMAJOR=kmajor, W_BLOCK=8, **cfg),
                                  warps, stages, aligned=("N", "K"),
                                  descriptors=dict(x_desc=a_block, g_desc=a_block, b_desc=b_block(cfg, kmajor)),
                                  checks=("acquire_sys", "tma_load", "vector_store")))
        for prec in precisions:
            for warps, stages, cfg in family_configs(dt, "pointer", prec):
                common = dict(UPCAST=False, INPUT_PRECISION=prec, ROUND_BF16=False, **cfg)
                for name, fn, extra, aligned, checks in pointer:
                    cases.append(case(name, fn, dt, dict(common, **extra), warps, stages, aligned=aligned,
                                      checks=checks))
        for c in get_chunk_reduce_configs(dt):
            # The pinned block of each audited world size W (W loads unrolled: the largest W of a BLOCK holds the
            # most registers), FLAT (ld == N: one 1-D walk); the row-block form (slot rows padded past N) with
            # 256- and 16-column blocks at the largest W.  PER_SM is a launch parameter, not a constexpr
            # (test_compile_audit checks registers x threads x PER_SM against the SM's register file).
            w, block = c.kwargs["W"], c.kwargs["BLOCK"]
            # At the largest W the flat walk also with its flags polled by acquire loads (DISTFUSE_FLAG_POLL=load).
            layouts = [(True, 256, False)] + ([(True, 256, True), (False, 256, False), (False, 16, False)]
                                              if w == max(REDUCE_AUDIT_W) else [])
            for flat, block_c, poll_loads in layouts:
                cases.append(case("chunk_reduce", chunk_reduce_kernels._chunk_reduce_kernel, dt,
                                  dict(W_UNROLL=w, W_BLOCK=triton.next_power_of_2(w), FLAT=flat, HAS_BIAS=True,
                                       ROUND_BF16=False, TIMED=True, CHECK_SIG=True, BLOCK_C=min(block_c, block),
                                       BLOCK=block, POLL_LOADS=poll_loads),
                                  c.num_warps, 1, aligned=("N", "ld"),
                                  checks=("acquire_sys", "vector_load", "vector_store")))
        for c in get_push_configs(dt):
            cases.append(case("ag_push", all_gather_kernels._ag_push_kernel, dt, dict(c.kwargs), c.num_warps, 1,
                              aligned=("K", "stride_xb", "stride_xn"), checks=("release_sys",)))
            cases.append(case("ag_push_columns", ag_features_kernels._ag_push_columns_kernel, dt, dict(c.kwargs),
                              c.num_warps, 1, aligned=("K", "stride_xm"), checks=("release_sys",)))
        # The library-GEMM producer's whole-GEMM schedule: the partial's rows into their owners' slots (W = 8).
        blocks = scatter_partial_kernels.gpu_blocks(dt.itemsize)
        cases.append(case("scatter_partial", scatter_partial_kernels._scatter_partial_kernel, dt,
                          dict(BLOCK_M=blocks["BLOCK_M"], BLOCK_N=blocks["BLOCK_N"], W_BLOCK=8), blocks["num_warps"], 1,
                          pointer_dtypes=dict(tables, src=_TT[dt]), aligned=("N", "ld"),
                          checks=("release_sys", "vector_load", "vector_store")))
        # The flag raise of the library-GEMM producer (cublas_chunks), launched after its last chunk GEMM.
        cases.append(case("raise_every_chunk_flag", chunk_flag.raise_every_chunk_flag_kernel, dt, {}, 1, 1,
                          checks=("release_sys",)))
        # The agreement check: signatures published to every peer (release), compared after the flag waits (acquire).
        cases.append(case("publish_signature", signature_kernels._publish_signature_kernel, dt, {}, 1, 1,
                          checks=("release_sys",)))
        cases.append(case("check_signatures", signature_kernels._check_signatures_kernel, dt,
                          dict(TIMED=True, W_BLOCK=8, BLOCK=1024), 4, 1, checks=("acquire_sys",)))
        # A rank without a payload (a refused input, a workspace to grow): its word, then every flag it owes.
        cases.append(case("abstain_signature", signature_kernels._abstain_kernel, dt, {}, 1, 1,
                          checks=("release_sys",)))
        # The probe that a store reaches pinned host memory (distfuse.fused.status_slots).
        cases.append(case("store_word", store_word_kernel, dt, {}, 1, 1))
        cases.append(case("gather_columns", all_reduce_kernels._gather_columns_kernel, dt,
                          dict(TIMED=True, **all_reduce_kernels._GATHER_CONFIG), 4, 1, aligned=("N", "stride_own"),
                          checks=("acquire_sys",)))
    return cases


def _halo_moving_cases(dt) -> list[KernelCase]:
    """The table gather and the one-launch staging of ``dt`` blocks: every GPU tile their launchers pick."""
    import triton.language as tl

    from distfuse.kernels import halo_programs as halo

    i64 = {n: "i64" for n in ("ptab_ptr", "btab_ptr", "stab_ptr", "bstart_ptr")}
    cases = []
    for bx in (128, 64, 32, 16):  # halo.pick_tile's GPU choices: 2048-element tiles
        tile = dict(COMPUTE=tl.float32, BLOCK_R=2048 // bx, BLOCK_X=bx)
        for region in (0, 1, 2):
            cases.append(KernelCase("halo_lut_gather", halo.lut_gather_kernel, dt, dict(tile, REGION=region),
                                    4, 1, pointer_dtypes={**_LUTS, **i64}))
    for bx in halo.STAGE_WIDTHS:  # halo.stage_tile's GPU choices: the one-launch staging
        br = halo.STAGE_TILE_ELEMENTS // bx
        tile = dict(NUM_BOX=halo.STAGE_BOXES, BLOCK_R=br, BLOCK_X=bx, SLAB_X=max(1, bx // halo.STAGE_SLAB_SPLIT),
                    STRIP_X=max(1, 32 * halo.STAGE_NUM_WARPS // br), X_ALIGN=1, OUT_ALIGN=1, SLAB_ROWS=True)
        # What stage_launch launches in NCHW (the staged rows of odd halos unaligned: OUT_ALIGN 1): int32 offsets, in
        # the one pass with the slabs one piece per row (where the block's rows are vector aligned, X_ALIGN), in the
        # overlap's local and remote passes (the remote one in strip tiles) with the slabs by the table walk per
        # element (halo_programs.choose_slab_rows); int64 offsets (buffers of 2^31 elements or more) and unaligned
        # block rows by the walk
        vec = 16 // dt.itemsize
        strip_r = max(br, halo.STAGE_STRIP_ELEMENTS // 2)  # a halo of 1: two columns beside the window
        variants = [(0, False, bx >= 64), (1, False, False), (2, False, False), (0, True, False)]
        variants += [(0, False, False)] if bx >= 64 else []  # the walk where the one pass takes one piece per row
        for region, wide, slab_rows in variants:
            cases.append(KernelCase("halo_stage", halo.stage_kernel, dt,
                                    dict(tile, REGION=region, WIDE=wide, SLAB_ROWS=slab_rows,
                                         X_ALIGN=vec if region or slab_rows else 1,
                                         **(dict(STRIP_X=2, STRIP_R=strip_r) if region == 2 else {})),
                                    halo.STAGE_NUM_WARPS, 1, pointer_dtypes={**_LUTS, **i64}))
        # rows 16-byte aligned in the block and the staged tensor (even halos; channels last): the window and the
        # slabs move in vectors
        cases.append(KernelCase("halo_stage", halo.stage_kernel, dt,
                                dict(tile, REGION=0, WIDE=False, X_ALIGN=vec, OUT_ALIGN=vec, SLAB_ALIGN=vec),
                                halo.STAGE_NUM_WARPS, 1, pointer_dtypes={**_LUTS, **i64},
                                checks=("vector_load", "vector_store")))
        # channels last: the columns beside the window in chunks of one spatial column's channels, aligned too
        cases.append(KernelCase("halo_stage", halo.stage_kernel, dt,
                                dict(tile, REGION=0, WIDE=False, X_ALIGN=16, OUT_ALIGN=16, SLAB_ALIGN=16,
                                     STRIP_ALIGN=16, STRIP_X=min(64, halo.strip_chunk(br, halo.STAGE_NUM_WARPS))),
                                halo.STAGE_NUM_WARPS, 1, pointer_dtypes={**_LUTS, **i64},
                                checks=("vector_load", "vector_store")))
        if bx in (512, 64):  # channels last, the remote pass: strips of STRIP_R rows, the chunks aligned
            # (their stores are vectors; Triton 3.9 loads fp32 chunks one element at a time, 3.6 in vectors)
            strip = min(64, halo.strip_chunk(br, halo.STAGE_NUM_WARPS))
            cases.append(KernelCase("halo_stage", halo.stage_kernel, dt,
                                    dict(tile, REGION=2, WIDE=False, X_ALIGN=16, OUT_ALIGN=16, SLAB_ALIGN=16,
                                         STRIP_ALIGN=16, STRIP_X=strip,
                                         STRIP_R=max(br, halo.STAGE_STRIP_ELEMENTS // strip)),
                                    halo.STAGE_NUM_WARPS, 1, pointer_dtypes={**_LUTS, **i64},
                                    checks=("vector_store",)))
        if bx in (512, 64):  # the split one-pass staging (halo.STAGE_SPLIT, the GPU default) at the 2-D and 3-D
            # NCHW blocks' widths: the window's programs (PART 1: 32-48 registers a thread under Triton 3.6), the
            # slabs' (PART 2, one piece per row as in the one pass: the window's branch is compiled in, never taken)
            for part in (1, 2):
                cases.append(KernelCase("halo_stage", halo.stage_kernel, dt,
                                        dict(tile, REGION=0, WIDE=False, SLAB_ROWS=True, X_ALIGN=vec, PART=part),
                                        halo.STAGE_NUM_WARPS, 1, pointer_dtypes={**_LUTS, **i64}))
        if bx in (512, 64):  # after the words form: the window's strips in STRIP_R-row programs, then the slabs
            # (PART 3), in the one pass (the slabs one piece per row) and the overlap's local pass (the walk)
            for region, slab_rows in ((0, True), (1, False)):
                cases.append(KernelCase("halo_stage", halo.stage_kernel, dt,
                                        dict(tile, REGION=region, WIDE=False, SLAB_ROWS=slab_rows, X_ALIGN=vec,
                                             PART=3, STRIP_X=2, STRIP_R=strip_r),
                                        halo.STAGE_NUM_WARPS, 1, pointer_dtypes={**_LUTS, **i64}))
        if bx == 64:  # the diagnosis' window copy alone (REGION 3), at the 3-D NCHW blocks' width
            cases.append(KernelCase("halo_stage", halo.stage_kernel, dt,
                                    dict(tile, REGION=3, WIDE=False, X_ALIGN=vec), halo.STAGE_NUM_WARPS, 1,
                                    pointer_dtypes={**_LUTS, **i64}))
    # The words form (halo_stage_words): the window's rows as flat words, one 16-byte store a group of four at any
    # word count (the group the end cuts goes apart); the magic multipliers reach 2^32 (i64)
    from distfuse.kernels import halo_stage_words as words

    cases.append(KernelCase("halo_stage_words", words.stage_words_kernel, dt,
                            dict(PER_WORD=4 // dt.itemsize, GROUPS=words.WORDS_GROUPS), halo.STAGE_NUM_WARPS, 1,
                            ints={"W2_M": "i64", "L1_M": "i64", "L0_M": "i64"}, checks=("vector_store",)))
    return cases


def _halo_cases(dtypes) -> list[KernelCase]:
    import triton.language as tl

    from distfuse.kernels import halo_programs as halo

    i64 = {n: "i64" for n in ("ptab_ptr", "btab_ptr", "bstart_ptr", "ctab_ptr", "blist_ptr")}
    fp32 = {"out1_ptr": "fp32", "self_ptr": "fp32"}
    # The staging and the table gather move values without arithmetic (they stay in the tensor's dtype), so fp16
    # compiles to bf16's code but for the type names: one 16-bit dtype is audited for them (bf16, else fp16).  The
    # box gather and the accumulate compute (replicate sums, fp32 accumulation, rounding): every dtype.
    sixteen = [dt for dt in (torch.bfloat16, torch.float16) if dt in dtypes][:1]
    cases = []
    for dt in dtypes:
        if dt.itemsize != 2 or dt in sixteen:
            cases += _halo_moving_cases(dt)
        # TRAIL 1: NCHW; 64: channels last (64 channels a vector)
        # programs per box (the GPU form: halo_launches.per_box_programs): int32, int64 offsets; channels last
        for wide, trail in ((False, 1), (True, 1), (False, 64)):
            cases.append(KernelCase("halo_box_gather", halo.box_gather_kernel, dt,
                                    dict(TRAIL=trail, LOG2_NBOX=5, COMPUTE=tl.float32, ROUND_BF16=False, WIDE=wide,
                                         BLOCK=1024, PER_BOX=True),
                                    halo.BOX_NUM_WARPS, 1, pointer_dtypes={**i64, **fp32, "pbox_ptr": "i32"}))
        # programs per cell: int32 offsets, int64 offsets; channels last
        for wide, trail in ((False, 1), (True, 1), (False, 64)):
            cases.append(KernelCase("halo_accumulate", halo.accumulate_kernel, dt,
                                    dict(TRAIL=trail, LOG2_NCELL=5, COMPUTE=tl.float32, ROUND_BF16=False, WIDE=wide,
                                         BLOCK=1024, PER_BOX=True),
                                    halo.BOX_NUM_WARPS, 1, pointer_dtypes={**i64, **fp32, "pcell_ptr": "i32"}))
    return cases


def _conv_implicit_cases(dtypes) -> list[KernelCase]:
    from distfuse.kernels import conv_implicit

    fn = conv_implicit._conv_implicit_kernel
    cases = []
    for dt in dtypes:  # the launcher's GPU tile for each precision of the products (fp32: IEEE and TF32)
        for prec in ("ieee", "tf32") if dt == torch.float32 else ("tf32",):
            tile = conv_implicit.gpu_tile(prec)
            consts = dict(conv_implicit._constexprs(dt, True, tile, interpret=False), INPUT_PRECISION=prec)
            cases.append(KernelCase("conv_implicit", fn, dt, consts, 4, 2, pointer_dtypes={**_LUTS, "ptab_ptr": "i64"}))
    return cases


def audit_cases(dtypes=DTYPES) -> list[KernelCase]:
    """Every kernel of the package in every config its launchers or autotuners can pick."""
    return _gemm_cases(dtypes) + _halo_cases(dtypes) + _conv_implicit_cases(dtypes)


def _select(dtypes, only: str | None) -> list[KernelCase]:
    """Every case, or those of the kernels whose name starts with ``only``."""
    cases = audit_cases(dtypes)
    if only is None:
        return cases
    picked = [c for c in cases if c.name.startswith(only)]
    if not picked:
        raise ValueError(f"compile_audit: no kernel matches {only!r}; kernels: {sorted({c.name for c in cases})}")
    return picked
