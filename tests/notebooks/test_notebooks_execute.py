"""Execute every notebook at toy size (they hold no logic of their own)."""

import os
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOK_DIR = Path(__file__).resolve().parents[2] / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
# notebooks that test a claim: they open with what they test and close with what they found
CLAIM_NOTEBOOKS = (
    "01_probe_spectra",
    "02_synthetic_vs_oracle",
    "03_snr_per_layer",
    "04_public_proxy_shift",
)


def _figures() -> dict[str, float]:
    return {p.name: p.stat().st_mtime for p in NOTEBOOK_DIR.glob("*.png")}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs(path, monkeypatch, tmp_path):
    monkeypatch.setenv("DPKFC_NB_TOY", "1")
    monkeypatch.setenv("DPKFC_NB_OUT", str(tmp_path))
    monkeypatch.setenv("MPLBACKEND", "Agg")
    # the kernel gets this worker's share of the cores (pytest-xdist runs two workers)
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    monkeypatch.setenv("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // workers)))
    nb = nbformat.read(path, as_version=4)
    before = _figures()
    NotebookClient(
        nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}
    ).execute()
    errors = [
        o
        for c in nb.cells
        if c.cell_type == "code"
        for o in c.get("outputs", [])
        if o.output_type == "error"
    ]
    assert not errors
    # runs of any size write their figures beside their runs, never over the committed ones
    assert _figures() == before
    if any("def save(" in c.source for c in nb.cells):
        (out,) = tmp_path.iterdir()  # one new folder per execution
        assert out.name.startswith(path.stem) and any(out.glob("*.png"))
        if any("train(" in c.source for c in nb.cells):
            assert (out / "runs").is_dir()  # the training runs lie beside the figures
    assert len(NOTEBOOKS) >= 1 and os.environ["DPKFC_NB_TOY"] == "1"


@pytest.mark.parametrize("stem", CLAIM_NOTEBOOKS)
def test_claim_notebooks_state_what_they_test_and_found(stem):
    path = NOTEBOOK_DIR / f"{stem}.ipynb"
    assert path.is_file(), f"{path} is missing"
    nb = nbformat.read(path, as_version=4)
    first, last = nb.cells[0], nb.cells[-1]
    assert first.cell_type == "markdown" and "What this tests" in first.source
    assert last.cell_type == "markdown" and "What it found" in last.source
    assert "FINDINGS" not in last.source  # the closing text is written from a full-size run
    assert any(ch.isdigit() for ch in last.source.split("What it found", 1)[1])
