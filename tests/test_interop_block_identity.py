"""Per-rank checkpoints carry block identity: the wrong rank's or the wrong grid's file is refused.

A channel-distributed convolution with 4 channels in and out over a 2x2 weight grid
holds blocks of equal shapes on every rank, the case where a file from another rank
would load silently.  Each rank saves its ``state_dict()`` with ``torch.save``; loading
another rank's file must raise before any parameter changes, and loading its own file
must restore exactly what it saved.
"""

import os

import torch
import torch.distributed as dist

from distfuse import PartitionError
from distfuse.layers._params import BlockIdentityMixin, block_identity
from distfuse.layers.conv import DistributedConv2d
from distfuse.layers.norm_batch import DistributedBatchNorm2d
from distfuse.testing import run_ranks
from tests.test_conv_support import grid


def _layer(w_grid, w_ranks):
    P_w = grid(w_ranks, w_grid)
    P_x = grid(w_ranks[:w_grid[1]], (1, w_grid[1], 1, 1))
    P_y = grid([w_ranks[i * w_grid[1]] for i in range(w_grid[0])], (1, w_grid[0], 1, 1))
    return DistributedConv2d(P_x, 4, 4, 3, padding=1, P_y=P_y, P_w=P_w)


def _snapshot(layer):
    return {k: v.clone() for k, v in layer.state_dict().items() if isinstance(v, torch.Tensor)}


def _per_rank_files(path):
    me, world = dist.get_rank(), dist.get_world_size()
    out = {}
    layer = _layer((2, 2, 1, 1), (0, 1, 2, 3))
    torch.save(layer.state_dict(), os.path.join(path, f"rank{me}.pt"))
    ident = layer.state_dict()["_extra_state"]
    out["identity"] = (ident["blocks"]["weight"]["index"], ident["blocks"]["bias"]["index"])
    dist.barrier()
    before = _snapshot(layer)
    if layer.weight is not None:
        with torch.no_grad():
            layer.weight.add_(1.0)  # so that a wrong load would be visible
    changed = _snapshot(layer)
    other = torch.load(os.path.join(path, f"rank{(me + 1) % world}.pt"), weights_only=False)
    if me < 3:  # the blocks have the same shapes: only the identity tells them apart
        assert tuple(other["weight"].shape) == tuple(layer.weight.shape)
    try:
        layer.load_state_dict(other)
        out["other rank"] = "loaded"
    except PartitionError as exc:
        out["other rank"] = "holds block" in str(exc) and f"saved by world rank {(me + 1) % world}" in str(exc)
    out["untouched"] = all(torch.equal(v, changed[k]) for k, v in _snapshot(layer).items())
    layer.load_state_dict(torch.load(os.path.join(path, f"rank{me}.pt"), weights_only=False))
    out["own file"] = all(torch.equal(v, before[k]) for k, v in _snapshot(layer).items())
    # Another grid over the same ranks: refused even where the block shapes would fit.
    regrid = _layer((1, 4, 1, 1), (0, 1, 2, 3))
    try:
        regrid.load_state_dict(torch.load(os.path.join(path, f"rank{me}.pt"), weights_only=False))
        out["other grid"] = "loaded"
    except PartitionError as exc:
        out["other grid"] = "holds block [[" in str(exc) and "partition [1, 4, 1, 1]" in str(exc)
    # strict=False without the identity entry loads unchecked (the caller opted out).
    own = torch.load(os.path.join(path, f"rank{me}.pt"), weights_only=False)
    own.pop("_extra_state")
    layer.load_state_dict(own, strict=False)
    try:
        layer.load_state_dict(own)
        out["strict missing"] = "loaded"
    except RuntimeError as exc:
        out["strict missing"] = "_extra_state" in str(exc)
    out["json-able"] = block_identity(layer) == ident
    return out


def _copies(path):
    """P [2, 2, 1, 1]: ranks r and r ^ 2 hold copies of one channel block; r ^ 1 holds the other block."""
    me = dist.get_rank()
    layer = DistributedBatchNorm2d(grid((0, 1, 2, 3), (2, 2, 1, 1)), 4)  # blocks of equal shape: 2 and 2
    with torch.no_grad():
        layer.weight.copy_(torch.arange(4.0)[[0, 1] if me % 2 == 0 else [2, 3]])
    torch.save(layer.state_dict(), os.path.join(path, f"bn{me}.pt"))
    dist.barrier()
    out = {}
    layer.load_state_dict(torch.load(os.path.join(path, f"bn{me ^ 2}.pt"), weights_only=False))
    out["copy accepted"] = torch.equal(layer.weight, torch.arange(4.0)[[0, 1] if me % 2 == 0 else [2, 3]])
    try:
        layer.load_state_dict(torch.load(os.path.join(path, f"bn{me ^ 1}.pt"), weights_only=False))
        out["other block"] = "loaded"
    except PartitionError as exc:
        out["other block"] = "holds block" in str(exc)
    return out


def test_copies_of_a_block_are_interchangeable_other_blocks_are_not(tmp_path):
    for out in run_ranks(4, _copies, os.fspath(tmp_path)):
        assert out == {"copy accepted": True, "other block": True}, out


def test_wrong_rank_and_wrong_grid_are_refused_own_file_loads(tmp_path):
    for r, out in enumerate(run_ranks(5, _per_rank_files, os.fspath(tmp_path))):
        owner = r < 4
        assert out["identity"] == (([r // 2, r % 2, 0, 0] if owner else None),
                                   ([r // 2] if owner and r % 2 == 0 else None)), out
        # Rank 3 reads rank 4's file (it owns nothing); rank 4 reads rank 0's: refused either way.
        assert out["other rank"] is True, (r, out)
        assert out["untouched"] and out["own file"], (r, out)
        # Another grid: refused where this rank holds a block; rank 4 holds none on either grid, nothing to mix up.
        assert out["other grid"] == (True if owner else "loaded"), (r, out)
        assert out["strict missing"] is True and out["json-able"], (r, out)


#: Layers whose state holds no block (no parameters or buffers of their own, or only a loss's class weights,
#: which every worker holds whole): nothing to identify.
STATELESS = ("Pool", "Upsample", "Loss")


def test_every_layer_family_with_blocks_carries_its_identity():
    import distfuse.layers as L

    classes = [getattr(L, n) for n in L.__all__ if n.startswith("Distributed") and isinstance(getattr(L, n), type)]
    stateful = [c for c in classes if hasattr(c, "param_layouts") and not any(s in c.__name__ for s in STATELESS)]
    assert len(stateful) >= 20, [c.__name__ for c in stateful]
    missing = [c.__name__ for c in stateful if not issubclass(c, BlockIdentityMixin)]
    assert not missing, f"layers whose per-rank state_dict does not say which blocks it holds: {missing}"
