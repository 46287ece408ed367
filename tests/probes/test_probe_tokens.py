import json

import pytest
import torch
from torch import nn

from dpkfc_med.probes import ProbeSource, TokenProbeSource, zipf_tokens

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
SPECIALS = {"cls": 5, "bos": 0, "eos": 2, "pad": 1}


def test_specials_at_ends_and_excluded_from_body() -> None:
    x = zipf_tokens(
        64, 12, vocab_size=40, special_ids=SPECIALS, generator=torch.Generator().manual_seed(0)
    )
    assert x.shape == (64, 12) and x.dtype == torch.int64
    assert bool((x[:, 0] == 5).all()) and bool((x[:, 1] == 0).all()) and bool((x[:, -1] == 2).all())
    body = x[:, 2:-1]
    assert not bool(torch.isin(body, torch.tensor([0, 1, 2, 5])).any())
    assert int(body.min()) >= 0 and int(body.max()) < 40


def test_zipf_frequencies() -> None:
    x = zipf_tokens(
        200, 50, vocab_size=1000, special_ids={"pad": 0}, generator=torch.Generator().manual_seed(1)
    )
    counts = torch.bincount(x.flatten(), minlength=1000)
    # Ordinary ids are ranked by increasing id: id 1 has rank 1, id 10 has rank 10.
    assert counts[0] == 0
    assert counts[1] > 3 * counts[10]
    assert counts[1] > counts[2] > counts[10]


def test_determinism_and_device() -> None:
    a = zipf_tokens(4, 9, vocab_size=30, generator=torch.Generator().manual_seed(7))
    b = zipf_tokens(4, 9, vocab_size=30, generator=torch.Generator().manual_seed(7))
    c = zipf_tokens(4, 9, vocab_size=30, generator=torch.Generator().manual_seed(8))
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_errors() -> None:
    with pytest.raises(ValueError, match="did you mean 'eos'"):
        zipf_tokens(1, 5, vocab_size=10, special_ids={"eso": 2})
    with pytest.raises(ValueError, match="no room"):
        zipf_tokens(1, 2, vocab_size=10, special_ids={"bos": 0, "eos": 1})
    with pytest.raises(ValueError, match=r"must be an int in \[0, vocab_size=10\)"):
        zipf_tokens(1, 5, vocab_size=10, special_ids={"bos": 10})
    with pytest.raises(ValueError, match="no ids left"):
        zipf_tokens(1, 5, vocab_size=1, special_ids={"pad": 0})


class _BagOfTokens(nn.Module):
    def __init__(self, vocab: int, bias: list[float]) -> None:
        super().__init__()
        self.emb = nn.EmbeddingBag(vocab, 4)
        self.head = nn.Linear(4, len(bias))
        with torch.no_grad():
            self.head.weight.zero_()
            self.head.bias.copy_(torch.tensor(bias))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(ids))


@pytest.mark.parametrize("device", DEVICES)
def test_token_source(device: str) -> None:
    src = TokenProbeSource(10, vocab_size=50, num_classes=3, special_ids={"cls": 0, "eos": 1})
    assert isinstance(src, ProbeSource)
    batch = src.sample(32, seed=3, device=torch.device(device))
    assert batch.inputs.shape == (32, 10) and batch.targets.shape == (32,)
    assert batch.inputs.device.type == device and batch.targets.device.type == device
    assert int(batch.targets.max()) < 3
    again = src.sample(32, seed=3, device=torch.device(device))
    assert torch.equal(batch.inputs, again.inputs) and torch.equal(batch.targets, again.targets)
    json.dumps(src.describe())


def test_token_source_model_targets() -> None:
    src = TokenProbeSource(10, vocab_size=50, num_classes=3, target="model")
    model = _BagOfTokens(50, [0.0, 12.0, 0.0])
    batch = src.sample(200, seed=0, model=model)
    assert float((batch.targets == 1).float().mean()) > 0.98
    with pytest.raises(ValueError, match="pass model="):
        src.sample(4, seed=0)
