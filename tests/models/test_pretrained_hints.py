"""The fix a pretrained-weights shape mismatch suggests: a class-count change only where the
output layer alone differs, the network's widths otherwise."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dpkfc_med.models.finetune import PretrainedWeightsError, load_pretrained


def _net(width: int, classes: int) -> nn.Module:
    return nn.Sequential(nn.Conv2d(1, width, 3), nn.Tanh(), nn.Flatten(), nn.LazyLinear(classes))


def _cnn(width: int, classes: int) -> nn.Module:
    net = _net(width, classes)
    net(torch.zeros(1, 1, 6, 6))  # materialise the lazy layer
    return net


def test_width_mismatch_names_the_widths_not_a_class_count(tmp_path):
    path = tmp_path / "public.pt"
    torch.save(_cnn(4, 2).state_dict(), path)
    with pytest.raises(PretrainedWeightsError) as err:
        load_pretrained(_cnn(8, 2), path)
    text = str(err.value)
    assert "the layers' widths differ from the file's" in text and "model.kwargs" in text
    assert "class count" not in text and "pretrained_skip: ['^0" not in text


def test_output_layer_mismatch_names_the_class_count_and_its_regex(tmp_path):
    path = tmp_path / "public.pt"
    torch.save(_cnn(4, 2).state_dict(), path)
    with pytest.raises(PretrainedWeightsError, match=r"class count .*pretrained_skip: \['\^3\\\."):
        load_pretrained(_cnn(4, 3), path)
