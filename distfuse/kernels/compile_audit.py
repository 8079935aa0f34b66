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
reads its registers and spills from the driver.  The cases, :class:`KernelCase` and
:func:`audit_cases`, are listed in :mod:`distfuse.kernels.compile_audit_cases`.

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

from distfuse.kernels.compile_audit_cases import _TT, DTYPES, KernelCase, _select, audit_cases  # re-exported

__all__ = ["KernelCase", "AuditRecord", "audit_cases", "compile_case", "run_audit", "SHARED_LIMITS"]

#: Shared memory per block that a kernel may use, by compute capability.
SHARED_LIMITS = {90: 232448, 80: 166912}

# The PTX each check asks for, and the problem reported where it is missing.  Triton 3.6-3.9 emit tl.atomic_* with
# sem= and scope="sys" as acquire / release atomics at system scope: an atomic add of 0 with acquire becomes
# "ld.global.sys.acquire.b32", a release exchange "atom.global.sys.release.exch.b32".  A TMA load of a tensor
# descriptor (sm_90+) is "cp.async.bulk.tensor.2d.shared::cluster.global...".
_PTX_CHECKS = {
    "acquire_sys": (re.compile(r"\b((atom|ld)\.global\.sys\.(acquire|acq_rel)|ld\.acquire\.sys\.global)\."),
                    "flag wait is not an acquire atomic at system scope (atom.global.sys.acquire)"),
    "release_sys": (re.compile(r"\batom\.global\.sys\.(release|acq_rel)\."),
                    "flag raise is not a release atomic at system scope (atom.global.sys.release)"),
    "vector_load": (re.compile(r"\bld\.global(\.[a-z]+)*\.v[24]\.b(32|64)\b"),
                    "partial loads are not vectorised (no ld.global.v2/v4)"),
    "tma_load": (re.compile(r"\bcp\.async\.bulk\.tensor\."), "operand loads do not use TMA (no cp.async.bulk.tensor)"),
    "vector_store": (re.compile(r"\bst\.global(\.[a-z]+)*\.v[24]\.b(32|64)\b"), "epilogue stores are not vectorised"),
}
#: A software-pipelined TMA loop (sm_90): the operand tiles live in a multi-buffered shared allocation, a leading
#: stage dimension of 2 or more (``!ttg.memdesc<3x128x64xbf16...``); unpipelined, each is one ``128x64`` buffer.
_PIPELINED = re.compile(r"ttg\.local_alloc\s*:\s*\(\)\s*->\s*!ttg\.memdesc<([2-9]|\d\d+)x\d+x\d+x")


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
    for check, (pattern, problem) in _PTX_CHECKS.items():
        if check in case.checks and (check != "tma_load" or arch >= 90) and not pattern.search(ptx):  # TMA: sm_90+
            found = sorted(set(re.findall(r"\bst\.global[.\w]*", ptx)))
            rec.problems.append(problem + (f" (found {found})" if check == "vector_store" else ""))
    if "pipelined" in case.checks and arch >= 90 and case.num_stages > 1 and not _PIPELINED.search(
            compiled.asm.get("ttgir", "")):
        rec.problems.append("the K loop is not software-pipelined: its operand buffers are not multi-buffered "
                            "(a barrier in the loop, or a loop the pipeliner does not take)")
    if not load:
        rec.registers, rec.spills = _static_usage(compiled.asm.get("cubin"))
        if rec.spills:
            rec.warnings.append(f"{rec.spills} bytes of stack/local memory per thread (register spills)")
    else:
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
    major, minor = torch.cuda.get_device_capability() if torch.cuda.is_available() else (None, 0)
    arch_here = major and major * 10 + minor  # load only binaries for this machine's GPU
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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", type=int, action="append", help="compute capability, e.g. 90 (repeatable; default 90)")
    p.add_argument("--kernel", default=None,
                   help="only the kernels whose name starts with this (matmul_scatter, chunk_reduce, halo, ...)")
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
