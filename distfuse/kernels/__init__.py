"""Triton kernel families: one file each (launcher, @triton.jit kernels, torch reference)."""

from distfuse.kernels._interpreter_compat import patch_interpreter_index

patch_interpreter_index()
