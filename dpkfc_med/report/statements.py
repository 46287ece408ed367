"""The report's sentences: the guarantee, the method, the sampling, the verdict, plurals.

Each is read off a report's plain JSON data; the summary box, the summary table and the
sections share them. Epsilon is printed rounded *up*
(:func:`~dpkfc_med.report.numbers.format_epsilon`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from dpkfc_med.methods import KFAC_CURVATURE, Method
from dpkfc_med.report.custodian import data_dependent_inputs
from dpkfc_med.report.document import fmt_value
from dpkfc_med.report.numbers import format_delta, format_epsilon
from dpkfc_med.report.schema.privacy_report import ACCOUNTANTS
from dpkfc_med.report.status import RunStatus
from dpkfc_med.report.wording import NO_GUARANTEE

__all__ = [
    "ACCOUNTANT_NAMES",
    "CURVATURE_TEXT",
    "DIAGNOSTICS_NOTE",
    "INCOMPLETE_NOTE",
    "NONPRIVATE_NOTE",
    "audit_sentence",
    "epsilon_odds",
    "expected_batch_text",
    "guarantee_sentence",
    "method_text",
    "other_accountants",
    "plural",
    "preconditioner_statement",
    "probe_summary",
    "q_text",
    "randomness_text",
    "release_verdict",
    "samples_text",
    "sampling_text",
    "steps_text",
    "unit_detail",
    "unit_head",
]


INCOMPLETE_NOTE = (
    "the figures below cover the steps taken before the interruption; the privacy spent is as "
    "stated"
)


NONPRIVATE_NOTE = (
    "this model was trained without differential privacy (no clipping, no noise); it may "
    "reveal information about individual training {units} and must be handled as the private "
    "data itself"
)


DIAGNOSTICS_NOTE = (
    "computed from un-noised private statistics; not covered by the privacy guarantee; for the "
    "data custodian only"
)


ACCOUNTANT_NAMES = {
    "prv": "PRV (Opacus; Gopi et al. 2021)",
    "rdp": "RDP (Opacus; Mironov 2017)",
    "pld": "PLD (Google dp_accounting; independent implementation)",
}


def guarantee_sentence(report: Mapping[str, Any]) -> str:
    """The one-sentence (epsilon, delta) statement, by the accountant that planned the run.

    The other accountants' bounds on the same mechanism are not part of it: they are shown
    apart, labelled as such (:func:`other_accountants`).
    """
    p, unit = report["privacy"], report["data"]["privacy_unit"]
    if not p["private"]:
        return f"{NO_GUARANTEE}: " + NONPRIVATE_NOTE.format(units=plural(unit_head(unit)))
    if (p.get("randomness") or {}).get("source") == "seeded":
        return str(p["guarantee"])  # no (epsilon, delta) claim: the noise can be replayed
    eps, primary = p["epsilon"], p["accountant"]
    return (
        f"(epsilon, delta) = ({format_epsilon(eps[primary])}, {format_delta(p['delta'])}) for the "
        f"add/remove-one-{unit_head(unit)} relation, Poisson sampling at rate {q_text(report)}, "
        f"by the {primary.upper()} accountant that planned the run"
    )


def other_accountants(report: Mapping[str, Any]) -> list[tuple[str, str, str]]:
    """The other accountants' bounds on the same mechanism: ``(name, epsilon, reading)``.

    Each accountant bounds the epsilon of the one mechanism that ran; they differ only in how
    tight the bound is. The stated figure is the planning accountant's; a larger figure here is
    a looser bound, not a second privacy cost.
    """
    p = report["privacy"]
    eps, primary = p["epsilon"], p["accountant"]
    stated = format_epsilon(eps[primary])
    rows = []
    for name in ACCOUNTANTS:
        if name == primary:
            continue
        shown = format_epsilon(eps[name])
        diff = float(shown) - float(stated)
        if diff > 0:
            reading = f"a looser bound on the same mechanism ({diff:+.3f})"
        elif diff < 0:
            reading = f"a slightly tighter estimate, not stated ({diff:+.3f})"
        else:
            reading = "the same figure"
        if name == "pld":
            reading += "; an independent implementation (Google dp_accounting)"
        rows.append((ACCOUNTANT_NAMES[name], shown, reading))
    return rows


def epsilon_odds(epsilon: float) -> str:
    """``e^epsilon`` rounded up to two decimals: how far one unit can move an attacker's odds."""
    value = math.exp(epsilon)
    if value >= 100:
        return f"{math.ceil(value):,}"
    return f"{math.ceil(value * 100 - 1e-9) / 100:.2f}"


def unit_head(unit: str) -> str:
    """The unit's noun without its description: ``"patient (unit ids)"`` -> ``"patient"``."""
    return unit.partition(" (")[0]


def unit_detail(data: Mapping[str, Any]) -> str | None:
    """Where the unit comes from, in words: ``data.unit_source``, else the unit's description."""
    bundle = data.get("bundle") if isinstance(data.get("bundle"), Mapping) else {}
    source = data.get("unit_source") or (bundle or {}).get("unit_source")
    if source:
        return str(source)
    _, sep, tail = str(data["privacy_unit"]).partition(" (")
    return tail.removesuffix(")") if sep else None


def _seeds(refreshes: Sequence[Mapping[str, Any]]) -> str:
    seeds = [r["probe_seed"] for r in refreshes]
    if not seeds:
        return "no probe seeds recorded"
    if len(seeds) == 1:
        return f"seed {seeds[0]}"
    if seeds == list(range(seeds[0], seeds[0] + len(seeds))):
        return f"seeds {seeds[0]}-{seeds[-1]}"
    shown = ", ".join(map(str, seeds[:6])) + (", ..." if len(seeds) > 6 else "")
    return f"seeds {shown}"


def probe_summary(pre: Mapping[str, Any]) -> str:
    """``"<generator>, <noise>, exponent ..., preset ..., seeds ..."`` from the provenance."""
    src = pre["probe_source"]
    parts = [str(src.get("source", "probe source"))]
    kind = src.get("kind")
    if kind in ("pink", "white"):
        parts.append(f"{kind} noise")
    elif kind is not None:
        parts.append(str(kind))
    if src.get("alpha") is not None:
        parts.append(f"exponent alpha = {fmt_value(src['alpha'])}")
    if src.get("zipf_exponent") is not None:
        parts.append(f"Zipf exponent {fmt_value(src['zipf_exponent'])}")
    if src.get("preset") is not None:
        parts.append(f"preset {src['preset']}")
    parts.append(_seeds(pre["refreshes"]))
    return ", ".join(parts)


CURVATURE_TEXT = {
    "kfac": KFAC_CURVATURE,
    "shampoo": "a Shampoo preconditioner (left and right factors of probe per-sample gradients)",
    "diagonal": "a diagonal preconditioner (the second moment of probe per-sample gradients)",
}
"""What preconditions the gradients, by ``preconditioner.config.family`` (the part of the
method's sentence that the family changes; a family not listed reads as K-FAC)."""


def method_text(report: Mapping[str, Any]) -> str:
    """The method in one sentence, naming the preconditioner family when it is not K-FAC."""
    p, pre = report["privacy"], report.get("preconditioner")
    family = ((pre or {}).get("config") or {}).get("family", "kfac")
    return Method(p["method"]).describe(
        unit_head(report["data"]["privacy_unit"]),
        curvature=CURVATURE_TEXT.get(family, KFAC_CURVATURE),
    )


def _short_digest(sha: Any) -> str:
    """The first 12 hex digits of a digest (or of each file's digest in a mapping)."""
    if isinstance(sha, Mapping):
        return ", ".join(f"{k}: {str(v)[:12]}" for k, v in sha.items())
    return str(sha)[:12]


def preconditioner_statement(report: Mapping[str, Any]) -> str:
    """Whether private data went into the preconditioner, in one line."""
    pre = report["preconditioner"]
    if pre is None:
        return "Not applicable: no preconditioner"
    ext = pre["external_data"]
    if ext is not None:  # named by its digest: its path stays in the custodian report
        name = ext.get("path") or f"(SHA-256 {_short_digest(ext.get('sha256'))})"
        if pre["uses_private_data"]:
            return (
                f"YES: the public proxy {name} overlaps the private training set (allowed by "
                "probes.allow_public_overlap); NOT covered by the guarantee"
            )
        return f"No private data; external public data {name}"
    return f"No: built from synthetic probes only ({probe_summary(pre)})"


def release_verdict(
    report: Mapping[str, Any],
) -> tuple[tuple[str, str], Literal["ok", "warning", "danger"]]:
    """Whether the run is a valid DP release, as ``((headline, reason), box kind)``.

    The headline is a full sentence (``"Valid DP release: yes."``); the reason follows it.
    """
    p = report["privacy"]
    if (p.get("randomness") or {}).get("source") == "seeded":
        return (
            (
                "Valid DP release: no.",
                "The noise was generated from a seed this report publishes "
                "(privacy.reproducible_noise: true), so it can be replayed: research use only.",
            ),
            "danger",
        )
    if (report.get("preconditioner") or {}).get("uses_private_data"):
        return (
            (
                "Valid DP release: no.",
                "The preconditioner was built partly from private training images "
                "(probes.allow_public_overlap: true), which the guarantee does not cover.",
            ),
            "danger",
        )
    target, eps = p.get("target_epsilon"), p["epsilon"][p["accountant"]]
    if target is not None and eps > target:
        return (
            (
                "Valid DP release: not at the target.",
                f"The run spent epsilon {format_epsilon(eps)}, more than its target "
                f"{format_epsilon(target)}; only the spent figure holds.",
            ),
            "danger",
        )
    inputs = data_dependent_inputs(report)
    if inputs:
        return (
            (
                "Valid DP release: for the training mechanism only.",
                "The training steps are private as stated below, but the model also depends on "
                f"{plural('bundle input', len(inputs))} computed from the private training data "
                f"outside them ({', '.join(inputs)}), which the guarantee does not cover.",
            ),
            "warning",
        )
    if report["status"] != RunStatus.COMPLETE:
        return (
            (
                "Valid DP release: not yet.",
                "The run stopped before its planned steps; the privacy spent so far is as "
                "stated, but the run is incomplete: continue it with --resume before releasing "
                "its model.",
            ),
            "warning",
        )
    return (
        (
            "Valid DP release: yes.",
            "The released model and everything this run publishes are covered by the guarantee "
            "below, provided the items that are not covered are handled as described.",
        ),
        "ok",
    )


def audit_sentence(report: Mapping[str, Any]) -> str | None:
    """The empirical audit's lower bound next to the accounted epsilon, or ``None``."""
    audit = report.get("audit")
    if not isinstance(audit, Mapping):
        return None
    return (
        f"empirical lower bound {format_epsilon(audit['epsilon_lower_bound'])} against the "
        f"accounted {format_epsilon(audit['epsilon_accounted'])} (one-run canary audit, "
        f"{plural('canary', audit['canaries'])}, confidence {audit['confidence']:g})"
    )


def _plural_word(word: str) -> str:
    if word.endswith("s"):
        return word
    if len(word) > 1 and word.endswith("y") and word[-2] not in "aeiou":
        return word[:-1] + "ies"  # canary -> canaries
    return word + "s"


def steps_text(p: Mapping[str, Any]) -> str:
    """``"<steps> of <planned> planned (<epochs> epochs)"``."""
    planned = f" of {p['planned_steps']} planned" if p["planned_steps"] is not None else ""
    return f"{p['steps']}{planned} ({plural('epoch', float(p['epochs']))})"


def plural(noun: str, count: float | None = None) -> str:
    """A noun phrase in the plural, or ``"<count> <noun>"`` in the number that agrees with it.

    Only the head of the phrase is inflected: the part before ``" ("``, each ``/``-separated
    word of it, and of a phrase ``"<noun> of <what>"`` the noun only. Examples:
    ``plural("image (MedMNIST)") == "images (MedMNIST)"``,
    ``plural("item of train#dataset") == "items of train#dataset"``,
    ``plural("patient/volume") == "patients/volumes"``, ``plural("epoch", 1) == "1 epoch"``,
    ``plural("step", 2) == "2 steps"``, ``plural("epoch", 0.5) == "0.5 epochs"``,
    ``plural("canary", 3) == "3 canaries"``.

    Args:
        noun: The singular phrase.
        count: When given, the count to print before it (integers in full, other numbers to
            three significant digits); the phrase is singular exactly when the count prints
            as ``1``.
    """
    head, sep, tail = noun.partition(" (")
    head, of, rest = head.partition(" of ")  # "item of train#dataset" -> "items of ..."
    many = "/".join(_plural_word(w) for w in head.split("/")) + of + rest + sep + tail
    if count is None:
        return many
    text = str(count) if isinstance(count, int) else f"{count:.3g}"
    return f"{text} {noun if text == '1' else many}"


def randomness_text(p: Mapping[str, Any]) -> str:
    """Where the noise and the sampling drew their randomness from, in words."""
    source = (p.get("randomness") or {}).get("source")
    if source == "os-csprng":
        return "every draw from the OS CSPRNG (secure_rng = true), floating-point hardened"
    if source == "os-entropy":
        return (
            "PyTorch's generator seeded from OS entropy; the seed is never written anywhere, so "
            "nothing published lets anyone replay the noise (the guarantee assumes ideal "
            "randomness)"
        )
    if source == "seeded":
        return (
            "SEEDED from the published training seed (reproducible_noise = true): the noise can "
            "be replayed; NOT a valid DP release"
        )
    return "n/a"


def samples_text(n: int | None) -> str:
    """``"<n> samples"``, or ``"any number of samples"`` for patient units."""
    if n is None:  # patient units: the most images one patient has is a private statistic
        return "any number of samples"
    return plural("sample", n)


def q_text(report: Mapping[str, Any]) -> str:
    """The sample rate with its one definition, e.g. ``"q = 1/ceil(N/B) = 1/19 = 0.0526316"``.

    ``q = 1/ceil(N/B)`` (``N`` training units, ``B`` = ``training.batch_size``): the number of
    batches of an epoch is ``ceil(N/B)`` and each unit joins each batch with probability ``q``,
    so the expected batch is ``q N`` (:func:`expected_batch_text`), not ``B``.
    """
    p = report["privacy"]
    if p["sample_rate"] is None:
        return "n/a"
    q = f"{p['sample_rate']:.6g}"
    if p.get("steps_per_epoch") is None:  # a report from before these fields were recorded
        return f"q = {q}"
    return f"q = 1/ceil(N/B) = 1/{p['steps_per_epoch']} = {q}"


def expected_batch_text(report: Mapping[str, Any]) -> str:
    """The expected batch with its definition, e.g. ``"248 (q N = 247.79, rounded)"``."""
    p, n = report["privacy"], report["data"]["num_train_units"]
    if p["expected_batch_size"] is None:
        return "n/a"
    if p["sample_rate"] is None or not isinstance(n, int):
        return str(p["expected_batch_size"])
    mean = p["sample_rate"] * n
    if abs(mean - round(mean)) < 1e-9:
        return f"{p['expected_batch_size']} (q N)"
    return f"{p['expected_batch_size']} (q N = {mean:.5g}, rounded)"


def sampling_text(report: Mapping[str, Any]) -> str:
    """The sampler, its rate ``q`` with its definition, ``N``, ``B`` and the expected batch."""
    p = report["privacy"]
    if p["sampler"] is None:
        return "n/a"
    sizes = ""
    if p.get("batch_size") is not None:
        sizes = (
            f", N = {report['data']['num_train_units']} units, B = {p['batch_size']} "
            "(training.batch_size)"
        )
    return (
        f"{p['sampler'].capitalize()} sampling: each unit joins each batch independently "
        f"with probability {q_text(report)}{sizes}; expected batch size "
        f"{expected_batch_text(report)}"
    )
