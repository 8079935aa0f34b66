"""distfuse's benchmark suite: ``python -m bench run | compare | plot`` (see ``bench/README.md``).

Kept import-light: ``python -m bench`` decides ``TRITON_INTERPRET`` before any kernel module loads.
"""
