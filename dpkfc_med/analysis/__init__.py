"""Fisher spectra, preconditioner alignment and per-layer signal-to-noise diagnostics."""
