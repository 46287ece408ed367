"""Token-sequence probes: Zipf-distributed ids framed by the tokenizer's own special tokens.

Word and sub-word frequencies in text follow approximately a Zipf law, p(rank r) proportional to
r^(-s) with s about 1 (Zipf 1949; Piantadosi 2014, "Zipf's word frequency law in natural
language: a critical review and future directions", Psychon Bull Rev 21(5):1112-1130). The
ordinary (non-special) ids are ranked in increasing id order, which matches tokenizers whose
vocabularies are sorted roughly by frequency (BPE merge order, frequency-sorted word lists).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
from torch import Tensor, nn

from dpkfc_med.probes.checks import (
    check_generator,
    check_num_classes,
    check_positive_int,
    check_seed,
)
from dpkfc_med.probes.sources import (
    ProbeBatch,
    TargetRule,
    Task,
    check_probe_batch,
    sample_model_targets,
)
from dpkfc_med.utils import check_choice, did_you_mean

__all__ = ["SPECIAL_TOKEN_KEYS", "TokenProbeSource", "zipf_tokens"]

SPECIAL_TOKEN_KEYS = ("bos", "eos", "pad", "cls")
"""Keys accepted in ``special_ids``."""


def _check_special_ids(special_ids: Mapping[str, int] | None, vocab_size: int) -> dict[str, int]:
    """Validate special-token ids: known keys, ints in ``[0, vocab_size)``."""
    specials = dict(special_ids or {})
    for key, value in specials.items():
        if key not in SPECIAL_TOKEN_KEYS:
            raise ValueError(
                f"special_ids key {key!r} is not allowed"
                f"{did_you_mean(str(key), SPECIAL_TOKEN_KEYS)}; choose one of "
                f"{list(SPECIAL_TOKEN_KEYS)}"
            )
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < vocab_size:
            raise ValueError(
                f"special_ids[{key!r}]={value!r} must be an int in [0, vocab_size={vocab_size})"
            )
    return specials


def zipf_tokens(
    batch: int,
    seq_len: int,
    *,
    vocab_size: int,
    exponent: float = 1.0,
    special_ids: Mapping[str, int] | None = None,
    generator: torch.Generator | None = None,
    device: torch.device | str | None = None,
) -> Tensor:
    """Token sequences with Zipf-distributed ordinary ids and the tokenizer's special tokens.

    Each sequence is ``[CLS] [BOS] w_1 ... w_n [EOS]`` (each special only when its id is given;
    CLS first because classification heads read position 0). The body ids ``w_i`` are i.i.d.
    with ``P(rank r) proportional to r^(-exponent)`` over the ordinary ids (all ids except the
    given special ones, PAD included), ranked in increasing id order. Sequences are full length,
    so PAD never appears. Drawn on the CPU with ``generator``, then moved to ``device``.

    Args:
        batch: Number of sequences B.
        seq_len: Total length T, special tokens included.
        vocab_size: Size of the vocabulary (ids ``0 .. vocab_size - 1``).
        exponent: Zipf exponent s (>= 0; 0 is uniform).
        special_ids: Optional ids for ``"bos"``, ``"eos"``, ``"pad"`` and ``"cls"``.
        generator: CPU generator; the same seeded state gives the same tokens.
        device: Device of the result.

    Returns:
        ``[B, T]`` int64 token ids.

    Raises:
        ValueError: On invalid sizes, exponent or special ids, or if the specials leave no
            room (``seq_len``) or no ordinary ids (``vocab_size``).

    Example:
        >>> g = torch.Generator().manual_seed(0)
        >>> x = zipf_tokens(2, 6, vocab_size=100, special_ids={"bos": 0, "eos": 1}, generator=g)
        >>> x[:, 0].tolist(), x[:, -1].tolist()
        ([0, 0], [1, 1])
    """
    check_positive_int(batch, "batch")
    check_positive_int(seq_len, "seq_len")
    check_positive_int(vocab_size, "vocab_size")
    check_generator(generator)
    if not (math.isfinite(exponent) and exponent >= 0):
        raise ValueError(f"exponent={exponent!r} must be finite and >= 0")
    specials = _check_special_ids(special_ids, vocab_size)
    prefix = [specials[k] for k in ("cls", "bos") if k in specials]
    suffix = [specials["eos"]] if "eos" in specials else []
    body_len = seq_len - len(prefix) - len(suffix)
    if body_len < 1:
        raise ValueError(
            f"seq_len={seq_len} leaves no room for ordinary tokens after the "
            f"{len(prefix) + len(suffix)} special tokens; increase seq_len"
        )
    special_set = set(specials.values())
    ordinary = torch.tensor([i for i in range(vocab_size) if i not in special_set])
    if ordinary.numel() == 0:
        raise ValueError(f"vocab_size={vocab_size} has no ids left besides the special tokens")

    ranks = torch.arange(1, ordinary.numel() + 1, dtype=torch.float64)
    cdf = (ranks ** (-float(exponent))).cumsum(0)
    cdf = cdf / cdf[-1]
    # Inverse-CDF sampling (searchsorted) has no category limit, unlike torch.multinomial.
    u = torch.rand(batch * body_len, generator=generator, dtype=torch.float64)
    index = torch.searchsorted(cdf, u, right=True).clamp_(max=ordinary.numel() - 1)
    body = ordinary[index].reshape(batch, body_len)
    parts = [torch.full((batch, 1), i, dtype=torch.int64) for i in prefix]
    parts.append(body)
    parts.extend(torch.full((batch, 1), i, dtype=torch.int64) for i in suffix)
    return torch.cat(parts, dim=1).to(device=device)


class TokenProbeSource:
    """Zipf token sequences with uniform or model-sampled class targets.

    Every call to :meth:`sample` seeds a fresh CPU ``torch.Generator`` with ``seed``; tokens
    are drawn first, then targets.

    Args:
        seq_len: Total sequence length T, special tokens included.
        vocab_size: Vocabulary size of the tokenizer.
        num_classes: Number of classes K (>= 2).
        exponent: Zipf exponent (about 1 for natural language).
        special_ids: The tokenizer's ``"bos"``, ``"eos"``, ``"pad"``, ``"cls"`` ids.
        target: ``"uniform"`` (uniform class ids) or ``"model"`` (sampled from
            ``softmax(model(tokens))``, which must return ``[M, K]``).

    Example:
        >>> src = TokenProbeSource(8, vocab_size=50, num_classes=2, special_ids={"cls": 0})
        >>> tuple(src.sample(3, seed=0).inputs.shape)
        (3, 8)
    """

    def __init__(
        self,
        seq_len: int,
        *,
        vocab_size: int,
        num_classes: int,
        exponent: float = 1.0,
        special_ids: Mapping[str, int] | None = None,
        target: TargetRule | str = TargetRule.UNIFORM,
    ) -> None:
        self.seq_len = check_positive_int(seq_len, "seq_len")
        self.vocab_size = check_positive_int(vocab_size, "vocab_size")
        self.num_classes = check_num_classes(num_classes)
        if not (math.isfinite(exponent) and exponent >= 0):
            raise ValueError(f"exponent={exponent!r} must be finite and >= 0")
        self.exponent = float(exponent)
        self.special_ids = _check_special_ids(special_ids, vocab_size)
        self.target = check_choice("target", target, TargetRule)
        # Fail at construction, not at the first refresh, if the specials leave no room.
        zipf_tokens(1, seq_len, vocab_size=vocab_size, exponent=exponent, special_ids=special_ids)

    def sample(
        self,
        num: int,
        *,
        seed: int,
        model: nn.Module | None = None,
        device: torch.device | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> ProbeBatch:
        """Draw ``num`` token probes.

        Args:
            num: Number of sequences M.
            seed: Seed of the CPU generator that draws this batch.
            model: Required for ``target="model"``; maps ``[M, T]`` ids to ``[M, K]`` logits
                and lives on ``device``.
            device: Device of the returned tensors.
            dtype: Unused (token ids are int64); accepted for the probe-source protocol.

        Returns:
            ``ProbeBatch(inputs [M, T] int64, targets [M] int64)``.
        """
        check_positive_int(num, "num")
        check_seed(seed)
        generator = torch.Generator().manual_seed(seed)
        inputs = zipf_tokens(
            num,
            self.seq_len,
            vocab_size=self.vocab_size,
            exponent=self.exponent,
            special_ids=self.special_ids,
            generator=generator,
            device=device,
        )
        if self.target is TargetRule.MODEL:
            targets = sample_model_targets(
                model,
                inputs,
                num_classes=self.num_classes,
                task=Task.CLASSIFICATION,
                generator=generator,
            )
        else:
            targets = torch.randint(self.num_classes, (num,), generator=generator)
        return check_probe_batch(ProbeBatch(inputs, targets.to(device=device)), source=repr(self))

    def describe(self) -> dict[str, object]:
        """JSON-serialisable provenance of the probes, for the privacy report."""
        return {
            "source": type(self).__name__,
            "uses_private_data": False,
            "task": Task.CLASSIFICATION.value,
            "kind": "zipf_tokens",
            "seq_len": self.seq_len,
            "vocab_size": self.vocab_size,
            "zipf_exponent": self.exponent,
            "special_ids": dict(self.special_ids),
            "layout": "[CLS] [BOS] body [EOS] (specials only where given); body ids ranked "
            "in increasing id order, P(rank r) proportional to r^(-exponent)",
            "num_classes": self.num_classes,
            "target": self.target.value,
            "target_rule": (
                "sampled from softmax(model(tokens)) under torch.no_grad() in the model's "
                "current mode"
                if self.target is TargetRule.MODEL
                else "uniform random class ids"
            ),
            "seed_rule": "each sample(num, seed=s) call draws from torch.Generator('cpu') "
            "seeded with s: tokens first, then targets",
        }

    def __repr__(self) -> str:
        return (
            f"TokenProbeSource(seq_len={self.seq_len}, vocab_size={self.vocab_size}, "
            f"num_classes={self.num_classes}, exponent={self.exponent}, "
            f"target={self.target.value!r})"
        )
