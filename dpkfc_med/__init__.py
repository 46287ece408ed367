"""dpkfc_med: differentially private training of MONAI models with a probe-only KFAC preconditioner.

Data flows one way: probes -> curvature -> privacy -> report. See ``dpkfc_med/README.md``.
"""

__version__ = "0.1.0"
