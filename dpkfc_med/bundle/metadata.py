"""``configs/metadata.json`` of a bundle: MONAI's required fields plus the privacy block.

MONAI validates bundle metadata against the model-zoo JSON schema
(``python -m monai.bundle verify_metadata``), which it downloads from :data:`SCHEMA_URL`.
:data:`REQUIRED_KEYS` and :data:`TENSOR_KEYS` are that schema's ``required`` lists, so that
:func:`metadata_problems` checks a bundle offline; with internet, ``verify_metadata`` checks
the whole schema.

The ``differential_privacy`` block states the guarantee of the released weights: mechanism,
method, accountant, target and spent epsilon at delta (per accountant, from the run's ledger),
unit of privacy, sampler and rate, noise multiplier, clip norm, steps, and the SHA-256 of the
privacy report shipped in ``docs/``; the released model of an accounted tuning adds a
``tuning`` entry (:mod:`dpkfc_med.bundle.tuned`). A non-private run says
``NO PRIVACY GUARANTEE`` in its ``task``, ``description`` and privacy block. A run fine-tuned
from pretrained weights names them (:func:`pretrained_block`: digest and stated source) and
says the guarantee covers the fine-tuning only.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import dpkfc_med
from dpkfc_med.report.wording import NO_GUARANTEE, NOT_VALID

__all__ = [
    "NO_GUARANTEE",
    "REQUIRED_KEYS",
    "SCHEMA_URL",
    "TENSOR_KEYS",
    "UNTRAINED",
    "dp_block",
    "metadata_problems",
    "network_data_format",
    "preconditioner_block",
    "pretrained_block",
    "sha256_file",
    "versions",
]

SCHEMA_URL = (
    "https://github.com/Project-MONAI/MONAI-extra-test-data/releases/download/0.8.1/"
    "meta_schema_20240725.json"
)
"""The MONAI model-zoo metadata schema the bundles declare (needs internet to download)."""

REQUIRED_KEYS: tuple[str, ...] = (
    "schema",
    "version",
    "monai_version",
    "pytorch_version",
    "numpy_version",
    "required_packages_version",
    "task",
    "description",
    "authors",
    "copyright",
    "network_data_format",
)
"""Top-level keys the schema requires (``changelog`` is written too: MONAI's default has it)."""

TENSOR_KEYS: tuple[str, ...] = (
    "type",
    "format",
    "num_channels",
    "spatial_shape",
    "dtype",
    "value_range",
)
"""Keys the schema requires of every tensor in ``network_data_format.inputs/outputs``."""

DP_KEYS: tuple[str, ...] = (
    "private",
    "guarantee",
    "mechanism",
    "method",
    "preconditioner",
    "accountant",
    "delta",
    "epsilon_target",
    "epsilon_spent",
    "unit_of_privacy",
    "neighbouring_relation",
    "sampler",
    "sample_rate",
    "noise_multiplier",
    "max_grad_norm",
    "steps",
    "privacy_report",
)
"""Keys of the ``differential_privacy`` block (this package's contract, checked by tests)."""

NOT_STATED = "not stated (set data.modality / data.source in the run config)"
UNTRAINED = "filled in by `dpkfc-med bundle export`"
"""What the spent values of a pipeline that has not been trained yet say."""

MECHANISM = (
    "Poisson-subsampled Gaussian mechanism: per-unit gradients (after the probe-only "
    "preconditioner) clipped to L2 norm C, summed, plus N(0, (sigma C)^2) noise per step"
)


def sha256_file(path: str | Path) -> str:
    """Hex SHA-256 of a file's bytes."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def versions() -> dict[str, str]:
    """``monai_version``, ``pytorch_version`` and ``numpy_version`` of this environment."""
    import monai
    import numpy
    import torch

    return {
        "monai_version": str(monai.__version__),
        "pytorch_version": str(torch.__version__).split("+")[0],
        "numpy_version": str(numpy.__version__),
    }


def metadata_problems(meta: Mapping[str, Any]) -> list[str]:
    """Every required field of the MONAI schema (and of the privacy block) that is missing.

    Args:
        meta: A parsed ``metadata.json``.

    Returns:
        One line per problem, naming the dotted field; empty when the metadata is complete.
    """
    problems = [
        f"{k}: required by the MONAI metadata schema" for k in REQUIRED_KEYS if k not in meta
    ]
    fmt = meta.get("network_data_format") or {}
    for part in ("inputs", "outputs"):
        tensors = fmt.get(part)
        if not isinstance(tensors, Mapping) or not tensors:
            problems.append(f"network_data_format.{part}: required (one entry per tensor)")
            continue
        for name, spec in tensors.items():
            problems += [
                f"network_data_format.{part}.{name}.{k}: required by the MONAI metadata schema"
                for k in TENSOR_KEYS
                if not isinstance(spec, Mapping) or k not in spec
            ]
    dp = meta.get("differential_privacy")
    if not isinstance(dp, Mapping):
        problems.append("differential_privacy: required (the guarantee of the released weights)")
    else:
        problems += [f"differential_privacy.{k}: required" for k in DP_KEYS if k not in dp]
    return problems


def network_data_format(task: Mapping[str, Any], *, modality: str) -> dict[str, Any]:
    """``network_data_format`` of a task: the network's input image and output logits.

    Args:
        task: ``kind``, ``spatial_dims``, ``in_channels``, ``num_classes``, ``spatial_shape``,
            ``label_names`` (the task record of ``model.pt``).
        modality: Free text for ``inputs.image.modality`` (e.g. ``"MRI"``).

    Returns:
        The MONAI ``{"inputs": {"image": ...}, "outputs": {"pred": ...}}`` block; the input
        shape is the network's training input (segmentation: the sliding-window patch).
    """
    seg = task["kind"] == "segmentation"
    k = int(task["num_classes"])
    names = list(task.get("label_names") or [f"class_{c}" for c in range(k)])
    shape = [int(s) for s in task["spatial_shape"]]
    image = {
        "type": "image",
        "format": "magnitude",
        "modality": modality,
        "num_channels": int(task["in_channels"]),
        "spatial_shape": shape,
        "dtype": "float32",
        # z-scored intensities have no fixed range; MedMNIST images are scaled to [0, 1]
        "value_range": [] if seg else [0, 1],
        "is_patch_data": seg,
        "channel_def": {str(c): "image" for c in range(int(task["in_channels"]))},
    }
    pred = {
        "type": "image" if seg else "probabilities",
        "format": "segmentation" if seg else "classes",
        "num_channels": k,
        "spatial_shape": shape if seg else [k],
        "dtype": "float32",
        "value_range": [] if seg else [0, 1],
        "is_patch_data": seg,
        "channel_def": {str(c): n for c, n in enumerate(names)},
    }
    return {"inputs": {"image": image}, "outputs": {"pred": pred}}


def preconditioner_block(report: Mapping[str, Any]) -> dict[str, Any] | None:
    """The ``preconditioner`` entry of the ``differential_privacy`` block.

    Args:
        report: A run's ``privacy_report.json`` (or a tuning trial's record of one).

    Returns:
        The curvature family and factors, the probe source's kind, whether it used private
        data and the number of refreshes; ``None`` for a method without a preconditioner.
    """
    pre = report.get("preconditioner")
    if not pre:
        return None
    cfg = pre.get("config") or {}
    return {
        "family": cfg.get("family"),
        "factors": cfg.get("factors"),
        "source": (pre.get("probe_source") or {}).get("kind"),
        "uses_private_data": bool(pre.get("uses_private_data")),
        "refreshes": len(pre.get("refreshes") or []),
    }


def dp_block(
    report: Mapping[str, Any],
    *,
    epsilon_spent: Mapping[str, float] | None,
    report_sha256: str | None,
) -> dict[str, Any]:
    """The ``differential_privacy`` block of an exported run.

    Args:
        report: The run's ``privacy_report.json``.
        epsilon_spent: Epsilon per accountant recomputed from the run's ``ledger.json``
            (``None`` for a non-private run).
        report_sha256: SHA-256 of the shipped ``docs/privacy_report.json``.

    Returns:
        The block; a non-private run has ``private: false``, a guarantee starting with
        :data:`NO_GUARANTEE` and null privacy parameters.
    """
    p = report["privacy"]
    private = bool(p.get("private"))
    pre = preconditioner_block(report)
    block: dict[str, Any] = {
        "private": private,
        "guarantee": p.get("guarantee") if private else f"{NO_GUARANTEE}: non-private training",
        "valid_dp_release": bool((p.get("randomness") or {}).get("valid_dp_release")),
        "headline_warnings": list(p.get("headline_warnings") or []),
        "mechanism": MECHANISM if private else None,
        "method": p.get("method"),
        "preconditioner": pre,
        "accountant": p.get("accountant") if private else None,
        "delta": p.get("delta"),
        "epsilon_target": p.get("target_epsilon"),
        "epsilon_spent": dict(epsilon_spent) if epsilon_spent is not None else None,
        "unit_of_privacy": report["data"].get("privacy_unit"),
        "neighbouring_relation": p.get("neighbouring_relation"),
        "sampler": p.get("sampler"),
        "sample_rate": p.get("sample_rate"),
        "expected_batch_size": p.get("expected_batch_size"),
        "noise_multiplier": p.get("noise_multiplier"),
        "max_grad_norm": p.get("max_grad_norm"),
        "steps": p.get("steps") if private else None,
        "not_covered": list(p.get("not_covered") or []),
        "privacy_report": {"file": "docs/privacy_report.json", "sha256": report_sha256},
    }
    if not private:
        block["warning"] = (
            f"{NO_GUARANTEE}: this model was trained without differential privacy; it may "
            "reveal its training data. Do not release it as a private model."
        )
    return block


def pretrained_block(model: Mapping[str, Any]) -> dict[str, Any] | None:
    """The public weights a run was fine-tuned from, for the ``differential_privacy`` block.

    Args:
        model: The ``model`` section of the run's ``privacy_report.json``.

    Returns:
        ``sha256`` and ``source`` (as the user stated it, or "not stated"), ``format``,
        ``fine_tuning`` (the mode; LoRA adapters are merged into the released weights) and
        ``covered`` (what the guarantee covers); ``None`` for a run trained from scratch.
    """
    weights = model.get("pretrained")
    if not isinstance(weights, Mapping):
        return None
    mode = model.get("finetune") or "full"
    staged = model.get("head_first") or {}
    return {
        "sha256": weights.get("sha256"),
        "source": weights.get("source") or "not stated",
        "format": weights.get("format"),
        "fine_tuning": mode
        + (" (adapters merged into the released weights)" if mode == "lora" else "")
        + (f", after {staged['epochs']} epoch(s) of the head alone" if staged else ""),
        "covered": "The released weights were fine-tuned privately from these weights: the "
        "guarantee covers the private fine-tuning only. Whatever the starting weights reveal "
        "about their own training data is not covered, so they must not have been trained on "
        "the private data.",
    }


def _text(value: Any) -> str:
    """An option as its plain string (enums included)."""
    return str(getattr(value, "value", value))


def untrained_dp_block(cfg: Any, *, unit: str) -> dict[str, Any]:
    """The privacy block of a pipeline before training: targets set, spent values pending.

    Args:
        cfg: The pipeline's :class:`~dpkfc_med.training.config.RunConfig`.
        unit: The unit of privacy of its task (e.g. ``"image"``).
    """
    private = cfg.method_enum.private
    pending = UNTRAINED if private else None
    pre = cfg.preconditioner_config()
    block: dict[str, Any] = {
        "private": private,
        "guarantee": (
            f"pending: {UNTRAINED} from the run's ledger"
            if private
            else f"{NO_GUARANTEE}: non-private training"
        ),
        "mechanism": MECHANISM if private else None,
        "method": cfg.method,
        "preconditioner": (
            {"family": _text(pre.family), "factors": _text(pre.factors)}
            if cfg.method_enum.preconditioned
            else None
        ),
        "accountant": cfg.privacy.accountant if private else None,
        "delta": cfg.privacy.delta if cfg.privacy.delta is not None else pending,
        "epsilon_target": cfg.privacy.target_epsilon if private else None,
        "epsilon_spent": {"prv": None, "rdp": None, "pld": None, "max": None, "note": pending},
        "unit_of_privacy": unit,
        "neighbouring_relation": f"add or remove one {unit}",
        "sampler": "poisson" if private else None,
        "sample_rate": pending,
        "noise_multiplier": cfg.privacy.noise_multiplier
        if cfg.privacy.noise_multiplier is not None
        else pending,
        "max_grad_norm": cfg.privacy.max_grad_norm if private else None,
        "steps": pending,
        "privacy_report": {"file": "docs/privacy_report.json", "sha256": pending},
    }
    return block


def _package_version(name: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return "unknown"


def bundle_metadata(
    cfg: Any,
    task: Mapping[str, Any],
    *,
    dp: Mapping[str, Any],
    bundle_version: str,
    changelog: str,
    needs_dpkfc: bool,
    what: str,
) -> dict[str, Any]:
    """A complete ``metadata.json`` (MONAI schema fields and the privacy block).

    Args:
        cfg: The run's :class:`~dpkfc_med.training.config.RunConfig`.
        task: The task record (see :func:`network_data_format`).
        dp: The ``differential_privacy`` block (:func:`dp_block` or
            :func:`untrained_dp_block`).
        bundle_version: The bundle's version.
        changelog: What this version is.
        needs_dpkfc: Whether the bundle needs ``dpkfc-med`` (training, or a network that plain
            MONAI cannot build).
        what: One sentence on what the bundle holds (a trained model or a training recipe).

    Returns:
        The metadata; :func:`metadata_problems` of it is empty.
    """
    seg = task["kind"] == "segmentation"
    names = list(task.get("label_names") or [])
    # nothing shareable may come from a path (folder names can name projects, wards, people):
    # the modality and the data source are what the user states in the config
    modality = getattr(cfg.data, "modality", None) or NOT_STATED
    source = getattr(cfg.data, "source", None) or NOT_STATED
    private = bool(dp.get("private"))
    report_md = str((dp.get("privacy_report") or {}).get("file") or "docs/privacy_report.json")
    report_md = report_md.removesuffix(".json") + ".md"
    replayable = private and not dp.get("valid_dp_release", True)
    loud = "" if private else f"{NO_GUARANTEE} (non-private training). "
    if replayable:
        loud = f"{NOT_VALID} (replayable noise; research use only). "
        eps_words = (
            "a differential-privacy mechanism whose noise and sampling were seeded from a "
            "published seed, so no privacy guarantee holds"
        )
    elif private:
        delta = dp["delta"]
        delta_words = f"{delta:g}" if isinstance(delta, float) else "min(1e-5, 1/N)"
        eps_words = (
            f"(epsilon {dp['epsilon_target']:g} target, delta {delta_words}) "
            f"differential privacy per {dp['unit_of_privacy']}, method {dp['method']}"
        )
        if dp.get("tuning"):
            eps_words += (
                f", covering its hyperparameter tuning (expected "
                f"{dp['tuning']['expected_trials']:.3g} trials) and the selection"
            )
    else:
        eps_words = "no differential privacy"
    start = dp.get("pretrained_weights")
    started = (
        f" Fine-tuned from pretrained weights (SHA-256 {start['sha256']}; source: "
        f"{start['source']}); the guarantee covers the private fine-tuning only."
        if isinstance(start, Mapping)
        else ""
    )
    kind = (
        f"{task['spatial_dims']}D segmentation of {', '.join(names[1:])}"
        if seg
        else f"{task['num_classes']}-class {task['spatial_dims']}D classification"
    )
    packages: dict[str, str] = {}
    if seg:
        packages["nibabel"] = _package_version("nibabel")
    if needs_dpkfc:
        packages["dpkfc-med"] = dpkfc_med.__version__
        packages["opacus"] = _package_version("opacus")
    return {
        "schema": SCHEMA_URL,
        "version": bundle_version,
        "changelog": {bundle_version: changelog},
        **versions(),
        "required_packages_version": packages,
        "optional_packages_version": {},
        "task": f"{loud}{kind} ({cfg.model.name}) trained with {eps_words}",
        "description": (
            f"{loud}{what} Network {cfg.model.name} for {cfg.data.task} (modality: "
            f"{modality}; data: {source}), trained by dpkfc-med with {eps_words}.{started} The "
            "privacy guarantee, its unit and what it does not cover are in "
            f"`differential_privacy` and {report_md}."
        ),
        "authors": "dpkfc-med (differentially private training of MONAI models)",
        "copyright": "Copyright (c) the dpkfc-med authors; the training data is the data "
        "custodian's",
        "data_source": source,
        "data_type": "nibabel" if seg else "numpy (MedMNIST .npz)",
        "image_classes": "single-channel image, intensities z-scored per volume"
        if seg
        else "single-channel image scaled to [0, 1]",
        "label_classes": ", ".join(f"{i}: {n}" for i, n in enumerate(names)),
        "pred_classes": ", ".join(f"{i}: {n}" for i, n in enumerate(names)),
        "intended_use": (
            "Research on differentially private medical imaging; not for clinical use."
            + (
                f" {NO_GUARANTEE}: do not release as a private model."
                if not private or replayable
                else ""
            )
        ),
        "references": [
            "Abadi et al., Deep Learning with Differential Privacy, CCS 2016",
            "Martens & Grosse, Optimizing Neural Networks with Kronecker-factored Approximate "
            "Curvature, ICML 2015",
        ],
        "network_data_format": network_data_format(task, modality=modality),
        "differential_privacy": dict(dp),
    }
