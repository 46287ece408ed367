"""MONAI network registry and DP-compatibility fixes (norm layers, in-place activations)."""
