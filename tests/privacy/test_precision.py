"""Mixed precision: bfloat16 forward passes, float32 per-sample gradients, clipping and noise."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from dpkfc_med.curvature.preconditioner import PreconditionerConfig
from dpkfc_med.engines.precision import Precision, backend_settings, forward_autocast
from dpkfc_med.privacy.engine import PrivacyEngine
from tests.conftest import GaussianProbes, per_sample_ce, summed_clipped, tiny_cnn_2d

# every device this machine has (the GPU check runs the same tests on CUDA)
DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]
METHODS = {
    "dp-sgd": ("dp-sgd", None),
    "dp-kfc": ("dp-kfc", PreconditionerConfig(num_probes=32, chunk_size=32)),
}
C = 0.5


def _private(method: str, device: str, clipping: str, n: int = 24, backward: str = "sum"):
    kind, pre = METHODS[method]
    torch.manual_seed(3)
    net = tiny_cnn_2d().to(device)  # conv, conv + GroupNorm, linear
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(n, 1, 8, 8, generator=g), torch.randint(0, 3, (n,), generator=g)
    pm, popt, _ = PrivacyEngine(seed=1).make_private(
        module=net,
        optimizer=torch.optim.SGD(net.parameters(), lr=0.1),
        data_loader=DataLoader(TensorDataset(x, y), batch_size=8),
        noise_multiplier=1.0,
        max_grad_norm=C,
        delta=1e-5,
        method=kind,
        probe_source=GaussianProbes((1, 8, 8), num_classes=3),
        probe_loss=per_sample_ce,
        preconditioner=pre,
        clipping=clipping,
        backward_reduction=backward,
    )
    return pm, popt, x.to(device), y.to(device)


def _backward(pm, x, y, precision: Precision):
    def run() -> None:
        with forward_autocast(precision, x.device):
            out = pm(x)
        F.cross_entropy(out.float(), y, reduction="sum").backward()

    return run


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("method", sorted(METHODS))
def test_bf16_per_sample_gradients_are_float32(method, device):
    """Every layer's per-sample gradient (norm affines included) comes out in float32."""
    pm, popt, x, y = _private(method, device, "per_sample")
    popt.zero_grad()
    _backward(pm, x, y, Precision.BF16)()
    for p in popt.params:
        assert p.grad_sample.dtype == torch.float32, p.shape
    popt.zero_grad()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("method", sorted(METHODS))
def test_bf16_clipping_modes_agree_in_float32(method, device):
    """Under bf16 autocast, ghost and per-sample clipping agree to float32 rounding.

    Both start from the same bfloat16 activations and errors; the hooks cast them to float32
    first, so the two computations differ by float32 rounding only (bfloat16 arithmetic would
    leave them about 1e-2 apart). The result points where the float32 run's does (the
    whitening amplifies bfloat16 rounding in weak directions, so the vectors are not equal).
    """
    pm, popt, x, y = _private(method, device, "per_sample")
    units = torch.arange(24, device=device) // 3
    sums = {}
    for clipping in ("per_sample", "ghost"):
        pm.set_clipping(clipping)
        sums[clipping] = summed_clipped(popt, _backward(pm, x, y, Precision.BF16), units)
    torch.testing.assert_close(sums["ghost"], sums["per_sample"], rtol=1e-5, atol=1e-6)
    pm.set_clipping("per_sample")
    exact = summed_clipped(popt, _backward(pm, x, y, Precision.FLOAT32), units)
    assert float(F.cosine_similarity(sums["per_sample"], exact, dim=0)) > 0.99
    assert sums["per_sample"].dtype == torch.float32


@pytest.mark.parametrize("device", DEVICES)
def test_bf16_sensitivity_with_units_of_k_patches(device):
    """Removing one patient (3 images) moves the bf16 run's clipped sum by at most C."""
    pm, popt, x, y = _private("dp-kfc", device, "auto")
    x = x * 20  # large gradients: every unit is clipped
    units = torch.arange(24, device=device) // 3
    full = summed_clipped(popt, _backward(pm, x, y, Precision.BF16), units)
    for patient in range(8):
        keep = units != patient
        kept = units[keep] - (units[keep] > patient).long()
        neighbour = summed_clipped(popt, _backward(pm, x[keep], y[keep], Precision.BF16), kept)
        assert float((full - neighbour).norm()) <= C * (1 + 1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("clipping", ["per_sample", "ghost", "auto"])
@pytest.mark.parametrize("method", sorted(METHODS))
def test_bf16_sensitivity_does_not_grow_with_the_batch_size(method, clipping, device):
    """Under bf16 a unit's clipped contribution is a function of that unit alone.

    The secret Poisson batch size ``B`` must not enter any unit's contribution: with the sum
    of per-sample losses backpropagated, removing one unit from a batch of ``B`` (powers of
    two and not) moves the clipped sum by at most ``C`` up to float32 rounding. (A batch-mean
    loss rounded ``(1/B) g`` to bfloat16 and reached 1.1 C at ``B = 256``.)
    """
    sizes = (1, 2, 3, 7, 64, 100, 255, 256)
    pm, popt, x, y = _private(method, device, clipping, n=max(sizes))
    x = x * 20  # large gradients: every unit is clipped
    worst = 0.0
    for b in sizes:
        full = summed_clipped(popt, _backward(pm, x[:b], y[:b], Precision.BF16))
        for j in sorted({0, b // 2, b - 1}):
            keep = torch.arange(b, device=x.device) != j
            neighbour = summed_clipped(
                popt, _backward(pm, x[:b][keep], y[:b][keep], Precision.BF16)
            )
            worst = max(worst, float((full - neighbour).norm()) / C)
    assert worst <= 1 + 1e-6, worst


@pytest.mark.parametrize("method", sorted(METHODS))
def test_bf16_mean_loss_is_refused(method):
    """A batch-mean loss under bf16 carries (1/B) g rounded to bf16: the hooks refuse it."""
    pm, popt, x, y = _private(method, "cpu", "per_sample", backward="mean")
    with forward_autocast(Precision.BF16, x.device):
        out = pm(x)
    with pytest.raises(RuntimeError, match=r"batch-mean loss.*backward_reduction='sum'"):
        F.cross_entropy(out.float(), y).backward()
    popt.zero_grad()


def test_backend_settings_turn_tf32_off_on_cuda_only_and_restore():
    before = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    with backend_settings(torch.device("cpu")) as settings:
        assert settings == {}
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        with backend_settings(torch.device("cuda")) as settings:
            assert settings["matmul_allow_tf32"] is False
            assert torch.backends.cuda.matmul.allow_tf32 is False
            assert torch.backends.cudnn.allow_tf32 is False
            assert torch.backends.cudnn.benchmark is False
        assert torch.backends.cuda.matmul.allow_tf32 is True
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before
