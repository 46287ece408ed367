"""Probe-only KFAC curvature: hooks, layer adapters, Kronecker factors, preconditioner."""
