"""Group privacy and the table of MedMNIST sets with several images per patient."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest

from dpkfc_med.units import KNOWN_MULTI_IMAGE_DATASETS, group_privacy, unit_note_for


def _phi(x: float) -> float:
    return 0.5 * math.erfc(-x / math.sqrt(2))


def _gaussian_delta(eps: float, sensitivity: float, sigma: float) -> float:
    """Exact delta(eps) of the Gaussian mechanism (Balle & Wang 2018, Thm. 8)."""
    a = sensitivity / (2 * sigma)
    b = eps * sigma / sensitivity
    return _phi(a - b) - math.exp(eps) * _phi(-a - b)


@pytest.mark.parametrize("k", [1, 2, 3, 7])
@pytest.mark.parametrize(("eps", "delta"), [(0.5, 1e-5), (1.0, 1e-6), (8.0, 1e-5), (0.0, 0.01)])
def test_group_privacy_is_the_formula(eps, delta, k):
    eps_k, delta_k = group_privacy(eps, delta, k)
    assert eps_k == k * eps
    assert delta_k == min(1.0, k * math.exp((k - 1) * eps) * delta)


def test_group_privacy_k1_identity_cap_and_errors():
    assert group_privacy(1.3, 1e-5, 1) == (1.3, 1e-5)
    assert group_privacy(20.0, 1e-3, 5)[1] == 1.0  # vacuous, capped
    with pytest.raises(ValueError, match=r"k=0: must be an integer >= 1.*delta=2: must be in"):
        group_privacy(1.0, 2, 0)
    with pytest.raises(ValueError, match=r"epsilon=-1.0"):
        group_privacy(-1.0, 1e-5, 2)


@pytest.mark.parametrize("sigma", [0.8, 1.5, 4.0])
@pytest.mark.parametrize("k", [2, 3])
def test_group_bound_holds_for_the_exact_gaussian_mechanism(sigma, k):
    """A Gaussian mechanism with sensitivity 1 is, for k units, one with sensitivity k.

    Its exact delta at k * eps never exceeds the group-privacy bound built from the
    single-unit delta at eps.
    """
    for eps in (0.1, 0.5, 1.0, 2.0):
        delta = _gaussian_delta(eps, 1.0, sigma)
        eps_k, delta_k = group_privacy(eps, delta, k)
        exact = _gaussian_delta(eps_k, float(k), sigma)
        assert exact <= delta_k * (1 + 1e-12), (eps, exact, delta_k)
        # the chain bound delta * sum_i e^(i eps) sits between the exact value and the formula
        chain = min(1.0, delta * sum(math.exp(i * eps) for i in range(k)))
        assert exact <= chain * (1 + 1e-12) and chain <= delta_k * (1 + 1e-12)


def test_known_datasets_quote_medmnist_info_verbatim():
    from dpkfc_med.data import medmnist_info

    info = medmnist_info()
    assert info, "medmnist is a declared dependency; its INFO table must load"
    for flag, entry in KNOWN_MULTI_IMAGE_DATASETS.items():
        assert flag in info, flag
        assert entry["quote"] in info[flag]["description"], flag
        assert entry["images"] >= entry["patients"] >= 1
        k = entry["images_per_patient"]
        assert k is None or entry["images"] == k * entry["patients"]
    # AdrenalMNIST3D: exactly left + right gland; the counts are its official split sizes
    assert KNOWN_MULTI_IMAGE_DATASETS["adrenalmnist3d"]["images"] == sum(
        info["adrenalmnist3d"]["n_samples"].values()
    )
    assert "pneumoniamnist" not in KNOWN_MULTI_IMAGE_DATASETS  # no patient count is stated


def test_unit_note_is_machine_readable():
    note = unit_note_for("adrenalmnist3d")
    assert note is not None
    assert note["unit"] == "image" and note["images_per_patient"] == 2
    assert note["dataset"] == "adrenalmnist3d" and "Scientific Data" in note["source"]
    assert (
        "(2 eps, 2 e^(1 eps) delta)" in note["statement"] and "data.unit_ids" in note["statement"]
    )
    chest = unit_note_for("chestmnist")
    assert chest is not None and chest["images_per_patient"] is None
    assert chest["mean_images_per_patient"] == 3.6 and "maximum is not stated" in chest["statement"]
    assert unit_note_for("pneumoniamnist") is None and unit_note_for(None) is None


def test_units_module_imports_without_torch():
    code = "import sys, dpkfc_med.units; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
