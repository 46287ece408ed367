"""Analysis for notebooks: image and factor spectra, probe-vs-oracle alignment, per-layer SNR.

Results computed from private data (real-image spectra, :class:`OracleFactors`, run
diagnostics) are research and custodian diagnostics, not differentially private releases.
"""

from dpkfc_med.analysis.alignment import (
    FactorAlignment,
    align_factor,
    compare_factors,
    depth_summary,
    eigenvalue_decay,
    relative_frobenius_error,
    subspace_overlap,
    top_eigenvector_cosines,
)
from dpkfc_med.analysis.factor_sets import (
    ORACLE_LABEL,
    ROLES,
    CurvatureFactors,
    OracleFactors,
    ProbeFactors,
    forward_order,
    oracle_factors,
    probe_factors,
    role_damping,
)
from dpkfc_med.analysis.image_spectra import (
    ImageSpectrum,
    band_exponents,
    hann_window,
    image_spectrum,
    probe_spectrum,
    spectrum_rows,
)
from dpkfc_med.analysis.plots import (
    plot_alignment,
    plot_benchmark_accuracy,
    plot_clipped_fraction,
    plot_eigenvalue_decay,
    plot_image_spectra,
    plot_layer_snr,
)
from dpkfc_med.analysis.run_diagnostics import (
    NOT_DP,
    RunDiagnostics,
    read_run_diagnostics,
    snr_rows,
)
from dpkfc_med.analysis.runs import benchmark_accuracy, public_proxy, released_model
from dpkfc_med.analysis.samples import RealSample, medmnist_sample, segmentation_sample
from dpkfc_med.analysis.spectra import effective_rank, factor_spectra, spectrum_table

__all__ = [
    "NOT_DP",
    "ORACLE_LABEL",
    "ROLES",
    "CurvatureFactors",
    "FactorAlignment",
    "ImageSpectrum",
    "OracleFactors",
    "ProbeFactors",
    "RealSample",
    "RunDiagnostics",
    "align_factor",
    "band_exponents",
    "benchmark_accuracy",
    "compare_factors",
    "depth_summary",
    "effective_rank",
    "eigenvalue_decay",
    "factor_spectra",
    "forward_order",
    "hann_window",
    "image_spectrum",
    "medmnist_sample",
    "oracle_factors",
    "plot_alignment",
    "plot_benchmark_accuracy",
    "plot_clipped_fraction",
    "plot_eigenvalue_decay",
    "plot_image_spectra",
    "plot_layer_snr",
    "probe_factors",
    "probe_spectrum",
    "public_proxy",
    "read_run_diagnostics",
    "relative_frobenius_error",
    "released_model",
    "role_damping",
    "segmentation_sample",
    "snr_rows",
    "spectrum_rows",
    "spectrum_table",
    "subspace_overlap",
    "top_eigenvector_cosines",
]
