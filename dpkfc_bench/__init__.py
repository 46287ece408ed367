"""Benchmarks of dpkfc_med: one module per study, run as ``python -m dpkfc_bench STUDY``.

Results (JSON plus a generated Markdown table) are committed under ``dpkfc_bench/results/``;
``dpkfc_bench/results/README.md`` says what each file shows and where it is cited.
"""
