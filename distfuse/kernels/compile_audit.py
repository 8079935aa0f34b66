"""Compile every ``@triton.jit`` kernel of distfuse for a GPU target, with or without a GPU.

The Triton interpreter accepts code that the compiler rejects (loop-carried type changes,
mismatched branch types), and says nothing about shared memory, registers or which PTX
instructions a flag operation becomes.  This audit compiles each kernel for each config
a launcher or an autotuner can pick, in fp32, fp16 and bf16, for sm_90 (and sm_80), and
checks:

* it compiles;
* its shared memory fits the target (227 KB per block on sm_90, 163 KB on sm_80);
* flag waits and raises lower to acquire / release atomics at system scope (peers read
  and write them over NVLink, so ``gpu`` scope would be a data race);
* the GEMM + scatter epilogue stores 16 bytes per thread (``st.global.v4``) into peers'
  buffers, not one element at a time.

On a machine with a GPU, :func:`run_audit` with ``load=True`` also loads each binary and
reads its registers and spills from the driver.

Run it as ``python -m distfuse.kernels.compile_audit [--arch 90] [--json FILE]``; it must
run in a process without ``TRITON_INTERPRET`` (``@triton.jit`` picks the interpreter at
import time).  ``tests/test_compile_audit.py`` runs it in CI on CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from dataclasses import asdict, dataclass, field

import torch

__all__ = ["KernelCase", "AuditRecord", "audit_cases", "compile_case", "run_audit", "SHARED_LIMITS"]

#: Shared memory per block that a kernel may use, by compute capability.
SHARED_LIMITS = {90: 232448, 80: 166912}

_TT = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# PTX of an acquire load / release store at system scope, as Triton 3.6-3.9 emit them
# for tl.atomic_* with sem= and scope="sys": an atomic add of 0 with acquire becomes
# "ld.global.sys.acquire.b32", a release exchange "atom.global.sys.release.exch.b32".
_ACQUIRE_SYS = re.compile(r"\b(atom|ld)\.global\.sys\.(acquire|acq_rel)\.")
_RELEASE_SYS = re.compile(r"\batom\.global\.sys\.(release|acq_rel)\.")
_VECTOR_STORE = re.compile(r"\bst\.global(\.[a-z]+)*\.v[24]\.b(32|64)\b")
_VECTOR_LOAD = re.compile(r"\bld\.global(\.[a-z]+)*\.v[24]\.b(32|64)\b")
# A TMA load of a tensor descriptor (sm_90+): "cp.async.bulk.tensor.2d.shared::cluster.global...".
_TMA_LOAD = re.compile(r"\bcp\.async\.bulk\.tensor\.")


@dataclass
class KernelCase:
    """One compilation: a kernel, its constexprs and launch options, and the checks its PTX must pass.

    ``pointer_dtypes`` maps pointer arguments to Triton element types (default: the
    case's dtype for ``*_ptr`` arguments); ``ints`` maps integer arguments to ``i32`` or
    ``i64`` (default ``i32``).  ``aligned`` lists the integer arguments that are
    multiples of 16 in the case (Triton specialises those at run time; pointers are
    always taken as 16-byte aligned, as torch allocates them).
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

    def signature(self) -> tuple[dict, dict]:
        fn = self.fn
        tt = _TT[self.dtype]
        sig, attrs = {}, {}
        dont = set(getattr(fn, "do_not_specialize", ()) or ())
        for i, name in enumerate(fn.arg_names):
            if name in self.constexprs:
                sig[name] = "constexpr"
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
        shown = ("INPUT_PRECISION", "REGION", "LOG2_NBOX", "W_UNROLL", "B_KMAJOR")
        meta = ",".join(f"{k}={v}" for k, v in self.constexprs.items() if k.startswith("BLOCK") or k in shown)
        return f"{self.name}[{_TT[self.dtype]};{meta};w{self.num_warps}s{self.num_stages}]"


@dataclass
class AuditRecord:
    case: str
    kernel: str
    dtype: str
    arch: int
    ok: bool
    shared: int | None = None
    shared_limit: int | None = None
    registers: int | None = None
    spills: int | None = None
    seconds: float = 0.0
    problems: list = field(default_factory=list)
    warnings: list = field(default_factory=list)


def _gemm_cases(dtypes) -> list[KernelCase]:
    import triton

    import distfuse.kernels.all_gather_features_matmul as ag_features_kernels
    import distfuse.kernels.all_gather_matmul as all_gather_kernels
    import distfuse.kernels.chunk_flag as chunk_flag
    import distfuse.kernels.matmul_all_reduce as all_reduce_kernels
    import distfuse.kernels.matmul_reduce_scatter as reduce_scatter_kernels
    import distfuse.kernels.matmul_reduce_scatter_features as rs_features_kernels
    import distfuse.kernels.matmul_scatter_persistent as persistent_kernels
    import distfuse.kernels.signature as signature_kernels
    from distfuse.kernels._utils import (
        get_chunk_reduce_configs,
        get_gemm_configs,
        get_push_configs,
        pinned_gemm_config,
    )

    tables = {"data_ptrs": "i64", "flag_ptrs": "i64", "counter_ptr": "i32", "flags_ptr": "i32", "status_ptr": "i32",
              "epoch_ptr": "i32"}
    ints = {"timeout": "i64"}
    cases = []
    for dt in dtypes:
        configs = [dict(c.kwargs, num_warps=c.num_warps, num_stages=c.num_stages) for c in get_gemm_configs(dt)]
        for rows, cols in ((4096, 4096), (4096, 128), (64, 4096), (16, 16)):  # every bucket of the pinned rule
            pinned = pinned_gemm_config(dt, rows, cols)
            if pinned not in configs:
                configs.append(pinned)
        precisions = ("ieee", "tf32") if dt == torch.float32 else ("tf32",)
        for cfg in configs:
            cfg = dict(cfg)
            warps, stages = cfg.pop("num_warps"), cfg.pop("num_stages")
            for prec in precisions:
                common = dict(UPCAST=False, INPUT_PRECISION=prec, ROUND_BF16=False, **cfg)
                cases.append(KernelCase("matmul_scatter", reduce_scatter_kernels._matmul_scatter_kernel, dt, common,
                                        warps, stages, pointer_dtypes=tables, ints=ints,
                                        aligned=("N", "K", "ld", "stride_ab", "stride_an", "stride_bn"),
                                        checks=("release_sys", "vector_store")))
                cases.append(KernelCase("gathered_matmul", all_gather_kernels._gathered_matmul_kernel, dt,
                                        dict(common, HAS_BIAS=True, TIMED=True), warps, stages,
                                        pointer_dtypes=tables, ints=ints,
                                        aligned=("N", "K", "stride_xb", "stride_xn", "stride_bn"),
                                        checks=("acquire_sys",)))
                # The feature-direction pair (column chunks; the K chunks of the gathered input).
                cases.append(KernelCase("matmul_scatter_columns", rs_features_kernels._matmul_scatter_columns_kernel,
                                        dt, dict(common, HAS_BIAS=True), warps, stages, pointer_dtypes=tables,
                                        ints=ints, aligned=("N", "K", "ld", "stride_am", "stride_bn"),
                                        checks=("release_sys", "vector_store")))
                cases.append(KernelCase("gathered_k_matmul", ag_features_kernels._gathered_k_matmul_kernel, dt,
                                        dict(common, HAS_BIAS=True, TIMED=True), warps, stages,
                                        pointer_dtypes=tables, ints=ints, aligned=("N", "K", "stride_xm", "stride_bn"),
                                        checks=("acquire_sys",)))
                # The persistent form: tensor-descriptor loads (TMA), deferred per-chunk arrival; both weight layouts.
                for kmajor in (False, True):
                    cases.append(KernelCase("matmul_scatter_persistent",
                                            persistent_kernels._matmul_scatter_persistent_kernel, dt,
                                            dict(common, B_KMAJOR=kmajor), warps, stages, pointer_dtypes=tables,
                                            ints=ints, aligned=("N", "K", "ld", "stride_am", "stride_b"),
                                            checks=("release_sys", "vector_store", "tma_load")))
                # GEMM + one-shot all-reduce: each tile stored into every rank's slot.
                cases.append(KernelCase("matmul_push", all_reduce_kernels._matmul_push_kernel, dt,
                                        dict(common, HAS_BIAS=True), warps, stages, pointer_dtypes=tables, ints=ints,
                                        aligned=("N", "K", "ld", "stride_am", "stride_bn"),
                                        checks=("release_sys", "vector_store")))
        for c in get_chunk_reduce_configs(dt):
            # W_UNROLL = W unrolls the W loads (chunk_reduce); 0 is the runtime loop (column_reduce, W_BLOCK 128).
            for block_c, w in ((256, 8), (16, 8), (256, 2), (256, 3), (256, 0)):
                cases.append(KernelCase("chunk_reduce", reduce_scatter_kernels._chunk_reduce_kernel, dt,
                                        dict(W_UNROLL=w, W_BLOCK=triton.next_power_of_2(w) if w else 128,
                                             HAS_BIAS=True, ROUND_BF16=False, TIMED=True, BLOCK_C=block_c,
                                             **c.kwargs),
                                        c.num_warps, 1, pointer_dtypes=tables, ints=ints, aligned=("N", "ld"),
                                        checks=("acquire_sys", "vector_load", "vector_store")))
        for c in get_push_configs(dt):
            cases.append(KernelCase("ag_push", all_gather_kernels._ag_push_kernel, dt, dict(c.kwargs), c.num_warps, 1,
                                    pointer_dtypes=tables, ints=ints, aligned=("K", "stride_xb", "stride_xn"),
                                    checks=("release_sys",)))
            cases.append(KernelCase("ag_push_columns", ag_features_kernels._ag_push_columns_kernel, dt, dict(c.kwargs),
                                    c.num_warps, 1, pointer_dtypes=tables, ints=ints, aligned=("K", "stride_xm"),
                                    checks=("release_sys",)))
        # The flag raise of the library-GEMM producer (cublas_chunks), launched after each chunk's GEMM.
        cases.append(KernelCase("raise_chunk_flag", chunk_flag.raise_chunk_flag_kernel, dt, {}, 1, 1,
                                pointer_dtypes={"flag_ptrs": "i64", "epoch_ptr": "i32"}, checks=("release_sys",)))
        # The agreement check: signatures published to every peer (release), compared after the flag waits (acquire).
        cases.append(KernelCase("publish_signature", signature_kernels._publish_signature_kernel, dt, {}, 1, 1,
                                pointer_dtypes={"flag_ptrs": "i64"}, checks=("release_sys",)))
        cases.append(KernelCase("check_signatures", signature_kernels._check_signatures_kernel, dt,
                                dict(TIMED=True, W_BLOCK=8, BLOCK=1024), 4, 1,
                                pointer_dtypes={"flags_ptr": "i32", "sigs_ptr": "i32", "status_ptr": "i32",
                                                "epoch_ptr": "i32"}, ints=ints, checks=("acquire_sys",)))
        # A rank without a payload (a refused input, a workspace to grow): its word, then every flag it owes.
        cases.append(KernelCase("abstain_signature", signature_kernels._abstain_kernel, dt, {}, 1, 1,
                                pointer_dtypes={"flag_ptrs": "i64", "epoch_ptr": "i32"}, checks=("release_sys",)))
        cases.append(KernelCase("gather_columns", all_reduce_kernels._gather_columns_kernel, dt,
                                dict(TIMED=True, **all_reduce_kernels._GATHER_CONFIG), 4, 1, pointer_dtypes=tables,
                                ints=ints, aligned=("N", "stride_own"), checks=("acquire_sys",)))
    return cases


def _halo_cases(dtypes) -> list[KernelCase]:
    import triton.language as tl

    from distfuse.kernels import halo_programs as halo

    luts = {f"{k}{a}_ptr": "i32" for a in range(3) for k in ("seg", "crd")}
    i64 = {n: "i64" for n in ("ptab_ptr", "btab_ptr", "bstart_ptr", "atab_ptr", "m0_ptr", "m1_ptr", "m2_ptr")}
    fp32 = {"out1_ptr": "fp32", "self_ptr": "fp32"}
    cases = []
    for dt in dtypes:
        for bx in (128, 64, 32, 16):  # halo.pick_tile's GPU choices: 2048-element tiles
            tile = dict(COMPUTE=tl.float32, BLOCK_R=2048 // bx, BLOCK_X=bx)
            for region in (0, 1, 2):
                cases.append(KernelCase("halo_lut_gather", halo.lut_gather_kernel, dt, dict(tile, REGION=region),
                                        4, 1, pointer_dtypes={**luts, **i64}))
            cases.append(KernelCase("halo_accumulate", halo.accumulate_kernel, dt, dict(tile, ROUND_BF16=False), 4, 1,
                                    pointer_dtypes={**i64, **fp32}))
        for log2 in (1, 5):
            cases.append(KernelCase("halo_box_gather", halo.box_gather_kernel, dt,
                                    dict(LOG2_NBOX=log2, COMPUTE=tl.float32, ROUND_BF16=False, BLOCK=1024),
                                    halo.BOX_NUM_WARPS, 1,
                                    pointer_dtypes={**i64, **fp32}))
    return cases


def _conv_implicit_cases(dtypes) -> list[KernelCase]:
    from distfuse.kernels import conv_implicit

    fn = conv_implicit._conv_implicit_kernel
    luts = {f"{k}{a}_ptr": "i32" for a in range(3) for k in ("seg", "crd")}
    tile = tuple(conv_implicit._GPU_TILE)  # the launcher's only GPU tile (BLOCK_M != BLOCK_K)
    return [KernelCase("conv_implicit", fn, dt, conv_implicit._constexprs(dt, True, tile, interpret=False), 4, 2,
                       pointer_dtypes={**luts, "ptab_ptr": "i64"}) for dt in dtypes]


def audit_cases(dtypes=DTYPES) -> list[KernelCase]:
    """Every kernel of the package in every config its launchers or autotuners can pick."""
    return _gemm_cases(dtypes) + _halo_cases(dtypes) + _conv_implicit_cases(dtypes)


def compile_case(case: KernelCase, arch: int = 90, *, load: bool = False) -> AuditRecord:
    """Compile one case for ``sm_<arch>``; check shared memory and the PTX; optionally load it for registers."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    rec = AuditRecord(case.label(), case.name, _TT[case.dtype], arch, ok=False, shared_limit=SHARED_LIMITS.get(arch))
    sig, attrs = case.signature()
    t0 = time.perf_counter()
    try:
        compiled = triton.compile(ASTSource(fn=case.fn, signature=sig, constexprs=case.constexprs, attrs=attrs),
                                  target=GPUTarget("cuda", arch, 32),
                                  options=dict(num_warps=case.num_warps, num_stages=case.num_stages))
    except Exception as exc:  # noqa: BLE001 - the audit reports every failure, then fails as a whole
        rec.problems.append(f"does not compile: {type(exc).__name__}: {str(exc).strip()[:600]}")
        rec.seconds = time.perf_counter() - t0
        return rec
    rec.seconds = time.perf_counter() - t0
    rec.shared = int(compiled.metadata.shared)
    if rec.shared_limit is not None and rec.shared > rec.shared_limit:
        rec.problems.append(f"shared memory {rec.shared} B exceeds sm_{arch}'s {rec.shared_limit} B per block")
    ptx = compiled.asm.get("ptx", "")
    if "acquire_sys" in case.checks and not _ACQUIRE_SYS.search(ptx):
        rec.problems.append("flag wait is not an acquire atomic at system scope (atom.global.sys.acquire)")
    if "release_sys" in case.checks and not _RELEASE_SYS.search(ptx):
        rec.problems.append("flag raise is not a release atomic at system scope (atom.global.sys.release)")
    if "vector_load" in case.checks and not _VECTOR_LOAD.search(ptx):
        rec.problems.append("partial loads are not vectorised (no ld.global.v2/v4)")
    if "tma_load" in case.checks and arch >= 90 and not _TMA_LOAD.search(ptx):  # TMA exists from sm_90
        rec.problems.append("operand loads do not use TMA (no cp.async.bulk.tensor)")
    if "vector_store" in case.checks and not _VECTOR_STORE.search(ptx):
        scalar = sorted(set(re.findall(r"\bst\.global[.\w]*", ptx)))
        rec.problems.append(f"epilogue stores are not vectorised (found {scalar})")
    if not load:
        rec.registers, rec.spills = _static_usage(compiled.asm.get("cubin"))
        if rec.spills:
            rec.warnings.append(f"{rec.spills} bytes of stack/local memory per thread (register spills)")
    if load:
        try:
            compiled._init_handles()
            rec.registers, rec.spills = int(compiled.n_regs), int(compiled.n_spills)
            if rec.spills:  # slow, not wrong: reported, not failed
                rec.warnings.append(f"{rec.spills} register spills")
        except Exception as exc:  # noqa: BLE001
            rec.problems.append(f"does not load on this GPU: {type(exc).__name__}: {str(exc)[:300]}")
    rec.ok = not rec.problems
    return rec


def _static_usage(cubin: bytes | None) -> tuple[int | None, int | None]:
    """(registers per thread, stack + local bytes per thread) of a cubin, read with Triton's ``cuobjdump``: no GPU.

    Stack and local memory in a Triton kernel are register spills (it allocates no arrays there).
    ``(None, None)`` where the tool or the cubin is missing.
    """
    import shutil
    import subprocess
    import tempfile

    if not cubin:
        return None, None
    tool = os.path.join(os.path.dirname(__import__("triton").__file__), "backends", "nvidia", "bin", "cuobjdump")
    tool = tool if os.path.exists(tool) else shutil.which("cuobjdump")
    if tool is None:
        return None, None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        try:
            text = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True,
                                  timeout=60).stdout
        except (OSError, subprocess.SubprocessError):
            return None, None
    regs = re.search(r"\bREG:(\d+)", text)
    spilled = [int(m.group(1)) for m in re.finditer(r"\b(?:STACK|LOCAL):(\d+)", text)]
    return (int(regs.group(1)) if regs else None), (sum(spilled) if spilled else None)


def _select(dtypes, only: str | None) -> list[KernelCase]:
    if only is None:
        return audit_cases(dtypes)
    families = {"matmul_scatter": _gemm_cases, "matmul_scatter_persistent": _gemm_cases,
                "raise_chunk_flag": _gemm_cases, "gathered_matmul": _gemm_cases, "chunk_reduce": _gemm_cases,
                "ag_push": _gemm_cases, "gathered_k_matmul": _gemm_cases, "matmul_push": _gemm_cases,
                "gather_columns": _gemm_cases, "publish_signature": _gemm_cases, "check_signatures": _gemm_cases,
                "abstain_signature": _gemm_cases,
                "halo": _halo_cases,
                "conv_implicit": _conv_implicit_cases}
    builders = {f for name, f in families.items() if name.startswith(only) or only.startswith(name)}
    if not builders:
        raise ValueError(f"compile_audit: no kernel family matches {only!r}; families: {sorted(families)}")
    return [c for build in builders for c in build(dtypes) if c.name.startswith(only)]


def _worker(job) -> AuditRecord:
    """One case in a worker process (spawned: a forked child must not inherit a CUDA context)."""
    index, arch, dtypes, load, only = job
    return compile_case(_select(dtypes, only)[index], arch, load=load)


def run_audit(arches=(90,), dtypes=DTYPES, *, load: bool = False, only: str | None = None,
              progress: bool = False, jobs: int = 1) -> list[AuditRecord]:
    """Compile every case for every arch; return one record per (case, arch).

    ``jobs`` > 1 compiles in that many spawned processes (compilation is CPU-bound).
    """
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise RuntimeError("compile_audit: run it in a process without TRITON_INTERPRET (the kernels were "
                           "decorated for the interpreter at import)")
    dtypes = tuple(dtypes)
    cases = _select(dtypes, only)
    arch_here = _device_arch()
    work = [(i, arch, dtypes, load and arch == arch_here, only) for arch in arches for i in range(len(cases))]
    if jobs > 1:
        import multiprocessing

        with multiprocessing.get_context("spawn").Pool(jobs) as pool:
            records = pool.map(_worker, work, chunksize=1)
    else:
        records = [compile_case(cases[i], arch, load=ld) for i, arch, _, ld, _ in work]
    if progress:
        for rec in records:
            print(("ok  " if rec.ok else "FAIL") + f" sm_{rec.arch} {rec.case} shared={rec.shared} "
                  f"regs={rec.registers} spills={rec.spills} {rec.seconds:.1f}s"
                  + ("" if rec.ok else f": {'; '.join(rec.problems)}")
                  + (f" [warning: {'; '.join(rec.warnings)}]" if rec.warnings else ""), flush=True)
    return records


def _device_arch() -> int | None:
    if not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability()
    return major * 10 + minor


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", type=int, action="append", help="compute capability, e.g. 90 (repeatable; default 90)")
    p.add_argument("--kernel", default=None,
                   help="only this kernel family (matmul_scatter, gathered_matmul, chunk_reduce, ag_push, halo, ...)")
    p.add_argument("--load", action="store_true", help="load each binary on this machine's GPU: registers, spills")
    p.add_argument("--json", default=None, help="write the records here")
    p.add_argument("--jobs", type=int, default=1, help="compile in this many processes")
    args = p.parse_args(argv)
    records = run_audit(tuple(args.arch or (90,)), load=args.load, only=args.kernel, progress=True, jobs=args.jobs)
    bad = [r for r in records if not r.ok]
    spilling = sorted({r.case for r in records if r.spills})
    if spilling:
        print(f"compile audit: {len(spilling)} case(s) spill registers: {', '.join(spilling)}")
    print(f"compile audit: {len(records) - len(bad)} ok, {len(bad)} failed "
          f"(triton {__import__('triton').__version__}, arches {sorted({r.arch for r in records})})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in records], f, indent=1)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
