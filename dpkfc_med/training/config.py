"""Typed, validated run configuration (YAML).

Every field has a default except ``data.path``; unknown keys, wrong types and bad values are
collected and reported together, each naming the dotted field and the fix::

    config error in configs/x.yaml:
      training.optimiser: unknown field (did you mean 'optimizer'?)
      privacy.target_epsilon=-1: must be a positive number

``--set a.b=value`` overrides are parsed as YAML scalars and validated the same way.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import yaml

from dpkfc_med.curvature.preconditioner import PreconditionerConfig
from dpkfc_med.errors import ConfigError
from dpkfc_med.methods import Method
from dpkfc_med.training.config_build import build_dataclass, leaf_paths
from dpkfc_med.training.config_checks import attribute_overrides, settings, value_problems

__all__ = [
    "ConfigError",
    "DataConfig",
    "Method",
    "ModelConfig",
    "OutputConfig",
    "PrivacyConfig",
    "PretrainConfig",
    "ProbeConfig",
    "RunConfig",
    "SliceConfig",
    "TrackingConfig",
    "TrainingConfig",
    "load_config",
]


@dataclass
class SliceConfig:
    """2D segmentation on slices of 3D NIfTI volumes; the patient (volume) stays the privacy unit.

    Attributes:
        axis: voxel axis of the volumes that the slices are cut across (0, 1 or 2; in
            RAS-ordered volumes such as MSD's, 2 gives axial slices); null = off, as is the
            whole section null (``slices: null``, ``--set data.slices=null``). The network
            is 2D, ``data.patch_size`` and ``data.spacing`` are in-plane (2 values), and the
            slices of a volume are evaluated and reported per volume.
        per_unit: slices of one volume per draw, all in that volume's one gradient (summed
            before clipping); a config constant, so it is the public bound on samples per
            unit. null = every slice (the count then follows each volume's extent, which the
            shareable report does not state).
        pick: which ``per_unit`` positions along ``axis``: ``random`` (new uniform positions
            on every draw, from the volume's own random stream) or ``even`` (evenly spaced,
            the same on every draw). Neither reads the labels.
    """

    NULL_IS_DEFAULT: ClassVar[bool] = True  # ``data.slices: null`` = this section's defaults

    axis: int | None = None
    per_unit: int | None = 8
    pick: str = "random"


@dataclass
class DataConfig:
    """Where the private data is and how to read it.

    Attributes:
        path: a MedMNIST-format ``.npz``, a bare MedMNIST flag (``pneumoniamnist``), or a
            NIfTI folder (``imagesTr``/``labelsTr`` or ``dataset.json``) for segmentation (or
            ``images/`` + ``masks/`` of PNG / JPEG for 2D segmentation). Several modalities
            come as one 4-D file per case or one file each (``<case>_0000.nii.gz``,
            ``<case>_0001.nii.gz``, ... in channel order, as nnU-Net names them).
        task: ``classification`` or ``segmentation``.
        spatial_dims: force 2 or 3 (default: inferred from the file; segmentation: the
            length of ``patch_size``).
        max_train: use only this many training units (quick runs); ``null`` = all.
        max_eval: cap on validation/test items (quick runs).
        download: allow downloading a MedMNIST flag (needs internet).
        split_fractions: segmentation: train/val/test fractions of the keyed-hash split (each
            case joins a split by a hash of its own id keyed by ``training.seed``). A small
            folder can leave a split empty; the error then names fractions that fill every
            split for the folder's case ids. Not used with ``split_file``.
        split_file: segmentation: your own split instead of the hash, a JSON file with the
            case ids of each split, ``{"train": [...], "val": [...], "test": [...]}`` (a
            run's ``split.json`` has this form; ``val`` and ``test`` may be empty), or
            nnU-Net's ``splits_final.json`` (``[{"train": [...], "val": [...]}, ...]``, one
            entry per fold; the test split is empty unless the fold has a ``"test"`` list).
            A relative path is looked up in the data folder first, then like ``path``. Each
            case at most once; every listed case must be in the folder; cases of the folder
            the file does not list are left out of the run (the data record counts them).
        split_fold: the fold of an nnU-Net ``split_file`` (0-based).
        patch_size: segmentation: training patch (and probe) size, 3 values for volumes and
            2 for images or slices; required -- it shapes the preconditioner, so it must not be
            read off the private volumes. Whole volumes: give a patch at least as large as the
            largest volume (they are padded to it).
        patches_per_unit: patches drawn per volume per step (segmentation).
        augmentations_per_unit: classification: ``k`` random views (shifts of up to 2 pixels,
            left-right flips) of every image of a drawn unit, their gradients summed before
            clipping (augmentation multiplicity; :mod:`dpkfc_med.data.augment`). 1: the
            images as they are.
        spacing: segmentation: voxel spacing of the probes in mm, one value per axis of
            ``patch_size``; required (the protocol's spacing, not the private NIfTI headers';
            the error suggests the headers' median; PNG / JPEG pixels: 1.0 unless known).
        resize: classification: resize every image to this spatial size (MONAI ``Resize``,
            bilinear / trilinear) before the network; probes are drawn at the same size. Use it
            when a network downsamples more than the file's size allows (DenseNet121 needs at
            least 32x32; MedMNIST files are 28x28).
        unit_ids: classification: a CSV mapping every training image to its patient (or study)
            id, header ``index,unit_id`` (``index``: 0-based row of ``train_images`` in the
            ``.npz``). The patient becomes the privacy unit: Poisson sampling draws patients
            and a patient's images are clipped together. Without it, a ``train_unit_ids``
            array inside the ``.npz`` is used if present, else the unit is one image. See
            :mod:`dpkfc_med.data.units` for the formats.
        num_classes: the declared number of classes (segmentation: required when the folder's
            ``dataset.json`` declares no labels). Classification: labels outside
            ``0..num_classes-1`` are refused (default: ``medmnist.INFO`` for a MedMNIST file
            name, else a ``classes`` array of class names in the file; never the labels
            themselves: a file with neither is refused).
        modality: free text for what the images are (``"MRI T1"``, ``"chest X-ray"``), shown
            in the shareable report's bundle metadata; unset: "not stated". Nothing shareable
            is derived from the data's path or folder names.
        source: free text for where the data comes from, as you want it published (e.g.
            ``"MSD Task04 Hippocampus"``); unset: "not stated".
        shard: ``[k, n]``: train on every ``n``-th unit of the training split starting at
            ``k`` (site ``k`` of ``n`` in ``dpkfc-med federated``, which sets it); the units
            outside the shard are not used, and the privacy unit count is the shard's.
        dicom_series: segmentation on a folder of DICOM series (``<case>/*.dcm`` or
            ``imagesTr/<case>/*.dcm``): a regular expression searched in ``SeriesDescription``
            that picks the one series to read where a case folder holds several (e.g.
            ``"T1"``); it must match exactly one series of every case. Unset: a case folder
            with several series is refused, listing their UIDs and descriptions.
        channels: segmentation: the input channels' names, in channel order. Required for one
            folder per case with one file per modality (the BraTS layout
            ``<case>/<case>_<channel>.nii.gz`` + ``<case>_seg.nii.gz``; e.g. ``[t1n, t1c,
            t2w, t2f]``, the file suffixes); for other NIfTI folders, every case must have this
            many channels. Unset: as many as the files hold.
        slices: segmentation: train a 2D network on slices of the folder's 3D volumes
            (:class:`SliceConfig`); 2D images (a folder of 2D NIfTI, or ``images/`` + ``masks/``
            of PNG / JPEG) need no slicing, only a 2-value ``patch_size``.
    """

    path: str = ""
    task: str = "classification"
    spatial_dims: int | None = None
    max_train: int | None = None
    max_eval: int | None = None
    download: bool = False
    split_fractions: list[float] = field(default_factory=lambda: [0.7, 0.15, 0.15])
    split_file: str | None = None
    split_fold: int = 0
    patch_size: list[int] | None = None
    patches_per_unit: int = 1
    augmentations_per_unit: int = 1
    spacing: list[float] | None = None
    resize: list[int] | None = None
    unit_ids: str | None = None
    num_classes: int | None = None
    modality: str | None = None
    source: str | None = None
    shard: list[int] | None = None
    dicom_series: str | None = None
    channels: list[str] | None = None
    slices: SliceConfig = field(default_factory=SliceConfig)


@dataclass
class ModelConfig:
    r"""Network choice (see ``dpkfc_med.models``), constructor overrides and starting weights.

    Attributes:
        pretrained: start from these weights instead of the fresh initialisation: a
            ``.pt``/``.pth`` state dict (or ``{"model": state_dict}``), a finished run's
            ``model.pt``, or a MONAI bundle folder (its ``models/model.pt``). Loaded after the
            network is built and DP-fixed; every key and shape must match
            (:mod:`dpkfc_med.models.finetune`). The guarantee covers the private fine-tuning
            only: the weights must not come from the private records. The report names them
            by SHA-256 digest; the path stays in the custodian part. Not combinable with
            ``pretrain.steps`` (data-free pretraining would overwrite them).
        pretrained_source: free text for where the weights come from, as you want it
            published (e.g. ``"MONAI model zoo spleen_ct_segmentation 0.5.4"``); shown in the
            report; unset: "not stated".
        pretrained_skip: regular expressions (searched in the dotted state-dict key, e.g.
            ``'^classifier\.3\.'``) of keys that keep their fresh initialisation, and always
            train: re-initialise the output layer when the class count differs.
        pretrained_class_map: start the output layer from the file's instead: for each class
            of this task, the class of the pretrained network it starts from (``[0, 1, 1]``:
            background from background, anterior and posterior both from a merged
            "hippocampus" class). A config constant; it changes no guarantee.
    """

    name: str = "small_cnn"
    norm: str = "group"
    kwargs: dict[str, Any] = field(default_factory=dict)
    pretrained: str | None = None
    pretrained_source: str | None = None
    pretrained_skip: list[str] = field(default_factory=list)
    pretrained_class_map: list[int] | None = None


@dataclass
class PrivacyConfig:
    """Privacy budget and mechanism settings.

    Attributes:
        target_epsilon: epsilon the whole run may spend (at ``delta``).
        delta: ``null`` = ``min(1e-5, 1 / N_units)``; larger values than ``1 / N`` are refused.
        max_grad_norm: clip norm ``C``.
        noise_multiplier: ``null`` = calibrated to the target; a number is checked against it.
        accountant: ``prv`` (primary) or ``rdp``.
        secure_rng: draw every sampling decision and noise value from the OS CSPRNG
            (``os.urandom``; slower). Off (default): PyTorch generators seeded once from OS
            entropy, a seed that is never written anywhere.
        reproducible_noise: research only: seed the noise and the Poisson sampler from
            ``training.seed``. Anyone who knows the seed (it is in the config and the report)
            can replay the noise, so such a run is NOT a valid DP release and its report says
            so in its headline.
        clipping: how each unit's norm is computed before clipping: ``auto`` (per layer,
            ghost norms on the transformed rows where they cost less than a materialised
            per-sample gradient, judged from the layer's shapes), ``ghost`` (ghost norms for
            every layer that has a row form -- Linear, ConvNd, attention projections -- and
            at most 4096 positions per sample) or
            ``per_sample`` (materialised per-sample gradients; DP-SGD's then equal Opacus'
            to float rounding: Opacus' formulas for Linear and normalisation layers, the
            layer adapter's rows or the layer's own kernel for convolutions). The clipped
            sum, the noise and the guarantee are the same in every mode.
        stp_eps: method ``dp-stp``: the constant added to ``sqrt(v)`` in its scale ``s``
            (``null``: the optimizer's ``eps``, 1e-8). Large values scale every coordinate
            alike (DP-SGD in the limit); small ones let coordinates whose noisy second moment
            is small dominate the clipped norm.
    """

    target_epsilon: float = 1.0
    delta: float | None = None
    max_grad_norm: float = 1.0
    noise_multiplier: float | None = None
    accountant: str = "prv"
    secure_rng: bool = False
    reproducible_noise: bool = False
    clipping: str = "auto"
    stp_eps: float | None = None


@dataclass
class TrainingConfig:
    """Optimisation settings.

    Attributes:
        recipe: ``manual`` (the defaults below for what you leave unset) or ``auto``: every
            recipe field you leave unset (batch, epochs, clip norm, optimizer and lr, method,
            crops per unit, pretraining, preconditioner) is chosen by a rule on public facts
            only (:mod:`dpkfc_med.recipe.rule`); the report lists each with its origin.
        recipe_chosen: the fields ``recipe: auto`` chose, written into a run's stored config
            so that a resumed run reports them as chosen by the rule, not set by you.
        optimizer: ``sgd`` (with ``momentum``), ``adam``, or ``adambc`` (DP-AdamBC: Adam with
            the DP-noise variance ``(sigma C / B)^2`` subtracted from its second moment,
            :mod:`dpkfc_med.privacy.adambc`; plain Adam when non-private).
        adambc_gamma: floor of DP-AdamBC's corrected second moment; ``null`` = the noise
            variance itself (1e-8 when non-private).
        lr_schedule: ``constant``, or ``cosine`` (the learning rate falls from ``lr`` to 0 along
            a half cosine over the planned steps, after ``warmup_steps`` of linear warm-up).
            The schedule is a function of the step count and the config only.
        warmup_steps: steps of linear warm-up from ``lr / warmup_steps`` to ``lr``.
        ema_decay: keep an exponential moving average of the weights with this decay (e.g.
            0.99) and use it for validation, model selection and the released model; ``null``
            = off. It averages released (noisy) parameters only, so it is free post-processing
            under differential privacy.
        eval_every: validate (and consider for model selection) every this many epochs, and
            after the last one.
        select_epoch: ``best_val``: release the weights of the epoch with the best
            validation metric (a choice made on private data without noise, which the report
            lists as not covered); ``last``: release the last epoch's weights (post-processing;
            ``dpkfc-med tune`` uses it and accounts for its own selection).
        max_physical_batch: the most privacy units in one forward/backward pass (``null``:
            the whole Poisson batch). A larger batch runs in chunks of whole units whose
            clipped gradients are summed before the one noise draw and update: the same
            mechanism and privacy plan, the memory of one chunk (large volumes, small GPUs).
        precision: ``float32``, or ``bf16``: the training forward and backward passes under
            bfloat16 autocast (faster on GPUs), with per-sample gradients, norms, clipping and
            noise in float32 (:mod:`dpkfc_med.engines.precision`). Refreshes, pretraining
            and evaluation stay in float32.
        finetune: which parameters train (the others are frozen before the privacy engine
            wraps the network: no per-sample gradient, clipping share, noise or curvature
            block): ``full``; ``last_layers`` (the last ``finetune_last`` modules with
            parameters of their own, in registration order; norm layers count);
            ``first_and_last_layers`` (the first and the last ``finetune_last`` such modules);
            ``norms_and_biases`` (normalisation affines, every bias and the output layer);
            ``lora`` (low-rank adapters on ``lora_targets``, plus the output layer in full;
            needs ``pip install 'dpkfc-med[finetune]'``). The released ``model.pt`` is a plain
            network (LoRA merged into the base weights).
        finetune_last: modules trained by ``finetune: last_layers`` (1 = the output layer),
            at each end by ``first_and_last_layers``, and by the first stage of
            ``head_first_epochs``.
        head_first_epochs: staged fine-tuning of public weights: for the first ``K`` epochs
            only the last ``finetune_last`` trainable modules (the output layer by default)
            learn; from epoch ``K + 1`` every parameter of ``finetune`` does. One mechanism
            and one ledger throughout: every step clips each unit's gradient over the
            parameters learning at that step to ``C`` and noises it as planned. ``0``: one
            stage. Needs ``model.pretrained`` and fewer than ``epochs``.
        lora_rank: LoRA rank ``r``.
        lora_alpha: LoRA ``alpha`` (the adapter's update is scaled by ``alpha / r``).
        lora_targets: layers that get LoRA adapters: regular expressions searched in module
            names, or type names (``Linear``, ``Conv1d``, ``Conv2d``, ``Conv3d``); ``null`` =
            every Linear and convolution except the output layer. Transposed convolutions and
            norms take no adapter (frozen).
    """

    recipe: str = "manual"
    recipe_chosen: list[str] = field(default_factory=list)
    epochs: int = 5
    batch_size: int = 256
    optimizer: str = "sgd"
    lr: float = 0.05
    momentum: float = 0.9
    adambc_gamma: float | None = None
    lr_schedule: str = "constant"
    warmup_steps: int = 0
    ema_decay: float | None = None
    eval_every: int = 1
    select_epoch: str = "best_val"
    weight_decay: float = 0.0
    seed: int = 0
    eval_batch_size: int = 256
    max_physical_batch: int | None = None
    device: str = "cpu"
    precision: str = "float32"
    threads: int | None = None
    progress: bool = True
    finetune: str = "full"
    finetune_last: int = 1
    head_first_epochs: int = 0
    lora_rank: int = 8
    lora_alpha: float = 16.0
    lora_targets: list[str] | None = None


@dataclass
class ProbeConfig:
    """Synthetic probes (dp-kfc) or the public proxy (dp-kfc-public).

    Attributes:
        public_data: dp-kfc-public: the public MedMNIST-format ``.npz`` whose training images
            are the probes.
        allow_public_overlap: dp-kfc-public: run even when the public proxy shares images with
            the private training split (or is the same MedMNIST dataset); the preconditioner
            then depends on private data, which the report states, and the guarantee does not
            cover it. Default: refused.
    """

    preset: str = "natural"
    kind: str = "pink"
    alpha: float | None = None
    num_probes: int = 256
    refresh_every: int | str = "auto"
    refresh_budget: float = 0.05
    target: str = "uniform"
    seed: int = 0
    public_data: str | None = None
    allow_public_overlap: bool = False


@dataclass
class PretrainConfig:
    """Data-free pretraining on synthetic shape volumes before private training (segmentation).

    Attributes:
        steps: non-private Adam steps on synthetic volumes (0 = off). The volumes come from the
            config only (:mod:`dpkfc_med.training.pretrain`): no privacy cost.
        batch_size: synthetic volumes per step.
        lr: Adam learning rate of pretraining.
        seed: seed of the synthetic volumes.
        cache_dir: folder where pretrained weights are kept and reused, keyed by a hash of
            everything that determines them (initial weights, network, these settings, the
            synthetic data's shape, spacing and classes, loss, device type, versions). ``auto``
            (default): ``.pretrain_cache`` beside the run directory (``runs/.pretrain_cache``
            for ``output.dir: runs/{name}``), so a retried or resumed run, and runs that differ
            only in method, epsilon, learning rate or private data, pretrain once; null = no
            cache. The folder holds no private data.
    """

    steps: int = 0
    batch_size: int = 8
    lr: float = 0.003
    seed: int = 0
    cache_dir: str | None = "auto"


@dataclass
class OutputConfig:
    """Run directory (``{name}`` is replaced by the run name)."""

    dir: str = "runs/{name}"


@dataclass
class TrackingConfig:
    """Experiment tracking with TensorBoard or MLflow, in a shareable and a custodian stream.

    Attributes:
        backend: ``none``, ``tensorboard`` (event files) or ``mlflow`` (needs
            ``pip install 'dpkfc-med[tracking]'``). Two streams are written. The shareable
            stream holds the epsilon after every noisy step, the recipe (the config without
            its paths, the privacy plan) and the released model's version (SHA-256 of
            ``model.pt``, status, package version); it is written once, when the privacy report
            is, from that report alone, with no per-step times (they would follow the secret
            batch sizes). The custodian stream is written live by MONAI's handlers: the
            un-noised training loss and clipping diagnostics per step, the validation score
            and the spent epsilon per epoch; none of it is covered by the guarantee.
        uri: where the shareable stream goes: a folder (TensorBoard's event files, or an
            MLflow SQLite store ``mlflow.db``), or an MLflow tracking URI (``sqlite:///...``,
            ``http(s)://`` of a shared server; ``file://`` stores are refused by MLflow and
            MONAI). ``null`` = ``<run>/tracking``. ``MLFLOW_TRACKING_URI`` is ignored.
        custodian_uri: where the custodian stream goes; ``null`` (the default, and the safe
            choice) = ``<run>/private_not_for_release/tracking``. WARNING: setting it sends
            un-noised statistics of the private data (losses, validation scores, clipping
            diagnostics, batch sizes) there, outside the run's custodian folder: set it only to
            a place as closed as ``private_not_for_release/``, never to a shared server whose
            readers may not see the private data. The report lists the custodian stream as
            not covered, and says when it left ``private_not_for_release/``.
        experiment: the MLflow experiment of both streams (run names: the run's name, and the
            run's name with ``-private_not_for_release`` for the custodian stream).
    """

    backend: str = "none"
    uri: str | None = None
    custodian_uri: str | None = None
    experiment: str = "dpkfc-med"


@dataclass
class RunConfig:
    """A complete run description."""

    name: str = "run"
    method: str = "dp-kfc"
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    privacy: PrivacyConfig = field(default_factory=PrivacyConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    probes: ProbeConfig = field(default_factory=ProbeConfig)
    pretrain: PretrainConfig = field(default_factory=PretrainConfig)
    preconditioner: dict[str, Any] = field(default_factory=dict)
    output: OutputConfig = field(default_factory=OutputConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    # set when loading and by recipe: auto, never read from a file (see dpkfc_med.recipe)
    set_by_user: list[str] = field(default_factory=list, metadata={"internal": True})
    recipe_rows: list[dict[str, Any]] = field(default_factory=list, metadata={"internal": True})

    # ------------------------------------------------------------------ derived
    @property
    def method_enum(self) -> Method:
        """The method as an enum."""
        return Method(self.method)

    def preconditioner_config(self) -> PreconditionerConfig:
        """The validated preconditioner settings (probe count taken from ``probes``)."""
        kw = dict(self.preconditioner)
        kw.setdefault("num_probes", self.probes.num_probes)
        return PreconditionerConfig(**kw)

    def run_dir(self) -> Path:
        """The output directory."""
        return Path(self.output.dir.replace("{name}", self.name))

    def to_dict(self) -> dict[str, Any]:
        """Plain nested dict (YAML/JSON-serialisable) of the settings."""
        return settings(self)

    def sha256(self) -> str:
        """Hash of the canonical JSON form (recorded in the privacy report)."""
        blob = json.dumps(self.to_dict(), sort_keys=True, default=str).encode()
        return hashlib.sha256(blob).hexdigest()


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``a.b.c=value`` overrides (values parsed as YAML) to a nested dict."""
    problems = []
    for item in overrides:
        if "=" not in item:
            problems.append(f"--set {item!r}: expected KEY=VALUE, e.g. training.lr=0.1")
            continue
        key, raw = item.split("=", 1)
        node = data
        parts = key.strip().split(".")
        for part in parts[:-1]:
            if node.get(part) is None:  # absent, or a section cleared by an earlier KEY=null
                node[part] = {}
            node = node[part]
            if not isinstance(node, dict):
                problems.append(f"--set {key}: {part} is not a section")
                break
        else:
            node[parts[-1]] = yaml.safe_load(raw)
    if problems:
        raise ConfigError(problems, "command line")
    return data


def config_from_dict(data: dict[str, Any], source: str = "config") -> RunConfig:
    """Validate a nested dict into a :class:`RunConfig` (all problems reported at once)."""
    problems: list[str] = []
    cfg = build_dataclass(RunConfig, data, "", problems)
    if not problems:
        problems.extend(value_problems(cfg))
    if problems:
        raise ConfigError(problems, source)
    cfg.set_by_user = leaf_paths(data)
    return cfg


def load_config(path: str | Path, overrides: list[str] | None = None) -> RunConfig:
    """Read a YAML run config, apply ``--set`` overrides and validate it."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(
            [f"{p}: no such file; pass the path of a YAML config (see configs/)"], str(p)
        )
    try:
        data = yaml.safe_load(p.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as err:
        raise ConfigError([f"not valid YAML: {err}"], str(p)) from None
    if not isinstance(data, dict):
        raise ConfigError(["the file must hold a mapping of sections (data, model, ...)"], str(p))
    data.setdefault("name", p.stem)
    apply_overrides(data, overrides or [])
    try:
        return config_from_dict(data, str(p))
    except ConfigError as err:
        named = attribute_overrides(err.problems, overrides or [], str(p))
        raise ConfigError(
            named.problems, named.source, set_by=named.set_by, file=named.file
        ) from None
