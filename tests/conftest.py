"""Test configuration: two passes, interpreted and compiled, and shared rank pools.

Triton picks the interpreter or the compiler when the ``@triton.jit`` decorators run, once
per process, so one pytest process cannot run both kinds of kernel test:

* **Interpreted pass** (the default, on every machine): ``TRITON_INTERPRET=1`` is set
  before distfuse's kernels are imported, and kernels run on CPU tensors.  Tests marked
  ``cuda`` are skipped here; on a GPU machine they belong to the compiled pass.
* **Compiled pass** (``DISTFUSE_TEST_COMPILED=1``, GPU machines): the kernels compile for
  the GPU, and only the tests marked ``cuda`` run; the rest ran in the interpreted pass.

``scripts/test.sh`` runs the interpreted pass everywhere and adds the compiled pass
(``pytest -m cuda``) where a GPU is present.

The compile audit (``tests/test_compile_audit.py``: every kernel and config compiled for sm_90 in a subprocess) is
started in the background at collection, at the lowest CPU priority, and its tests run last: the rest of the
suite leaves a CPU idle about a fifth of the time on two cores, and the audit fills it.
"""

import os

COMPILED = os.environ.get("DISTFUSE_TEST_COMPILED", "0") not in ("", "0")
if COMPILED:
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise RuntimeError("DISTFUSE_TEST_COMPILED=1 runs the compiled pass: unset TRITON_INTERPRET")
else:
    # Must be set before any @triton.jit decorator executes (i.e. before distfuse.kernels imports).
    os.environ["TRITON_INTERPRET"] = "1"

# Dispatch tests build their own crossover tables; the package's shipped table changes with every GPU run, so
# it is off unless a test turns it on (tests/test_crossover_projection.py).  Rank pools inherit it.
os.environ.setdefault("DISTFUSE_SHIPPED_TABLE", "off")

import pytest  # noqa: E402
import torch  # noqa: E402

from distfuse.testing import shutdown_pools  # noqa: E402


@pytest.hookimpl(trylast=True)  # after -k / -m deselection: the audit starts only for tests that will run
def pytest_collection_modifyitems(config, items):
    has_cuda = torch.cuda.is_available()
    multi = has_cuda and torch.cuda.device_count() > 1
    for item in items:
        needs_gpu = "cuda" in item.keywords or "multigpu" in item.keywords
        if needs_gpu and not COMPILED:
            item.add_marker(pytest.mark.skip(reason="compiled-mode test: runs in the compiled pass on a GPU "
                                                    "machine (DISTFUSE_TEST_COMPILED=1 pytest -m cuda)"))
        elif not needs_gpu and COMPILED:
            item.add_marker(pytest.mark.skip(reason="interpreted-mode test: runs in the default pass"))
        elif "cuda" in item.keywords and not has_cuda:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
        elif "multigpu" in item.keywords and not multi:
            item.add_marker(pytest.mark.skip(reason="needs more than one CUDA GPU"))
    # The compile audit is about two minutes of compiler time in a subprocess of its own: start it now at the lowest
    # priority and run its tests last, so that it fills the time the rest of the suite leaves a CPU idle.
    audit = [item for item in items if item.module.__name__.endswith("test_compile_audit")
             and {"audit", "gpu_audit"} & set(getattr(item, "fixturenames", ()))]
    if audit and not COMPILED and not config.option.collectonly:
        items[:] = [item for item in items if item not in audit] + audit
        audit[0].module.start_background_audit()


def pytest_sessionfinish(session, exitstatus):
    import sys

    module = sys.modules.get("tests.test_compile_audit")
    if module is not None:
        module.stop_background_audit()


@pytest.fixture(scope="session", autouse=True)
def _close_rank_pools():
    yield
    shutdown_pools()
