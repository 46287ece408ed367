"""Fisher spectra, preconditioner alignment and per-layer signal-to-noise diagnostics."""

from dpkfc_med.analysis.spectra import effective_rank, factor_spectra, spectrum_table

__all__ = ["effective_rank", "factor_spectra", "spectrum_table"]
