"""Distributed layers (filled in by the layer modules)."""
