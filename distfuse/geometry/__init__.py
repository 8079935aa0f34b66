"""Pure geometry below the primitives and the kernels: who owns what, who sends what to whom.

Nothing here communicates, and no module here imports ``torch`` or ``torch.distributed``
itself (the error classes come from :mod:`distfuse.errors`, which reads the rank); every
function is a pure function of shapes, so every rank computes the same answer without
talking: the balanced decomposition (:mod:`~distfuse.geometry.decomposition`), the halo
geometry of a partitioned convolution (:mod:`~distfuse.geometry.halo_plan`) and of the
pooling, upsampling and transposed convolution built on it, and the sources of a
Broadcast or a SumReduce (:mod:`~distfuse.geometry.broadcast_plan`).

Layering: ``primitives/`` and ``kernels/`` import its modules (the package re-exports
nothing); it imports neither of them, nor ``fused/`` or ``layers/``.
"""
