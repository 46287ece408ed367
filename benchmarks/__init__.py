"""Benchmarks of dpkfc_med: one module per study, run as ``python -m benchmarks STUDY``.

Results (JSON plus a generated Markdown table) are committed under ``benchmarks/results/``;
``benchmarks/results/README.md`` says what each file shows and where it is cited.
"""
