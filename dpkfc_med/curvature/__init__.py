"""Probe-only KFAC curvature: hooks, per-layer adapters, Kronecker factors and the preconditioner operator."""
