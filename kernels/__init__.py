"""Fused GPU kernels with pure-torch references in rlcore.ops."""
