"""``configs/inference.yaml``: the engine's evaluation preprocessing and inference in MONAI syntax.

The generated config runs with ``python -m monai.bundle run --config_file
BUNDLE/configs/inference.yaml --dataset_dir DATA --output_dir PRED``; it uses MONAI, PyTorch and
NumPy only (the network itself may need ``dpkfc-med``, see :mod:`.network`). It mirrors the
engine's evaluation exactly:

* classification (:mod:`dpkfc_med.data.medmnist`): the ``{split}_images`` of a MedMNIST-format
  ``.npz``, ``uint8`` scaled to ``[0, 1]`` (other dtypes unchanged), a channel axis added, MONAI
  ``Resize`` when the run used ``data.resize``; the softmax of the logits is written to
  ``PRED/{split}_probabilities.csv`` with one row per image (``index,prob_<class>...``);
* segmentation (:mod:`dpkfc_med.tasks.segmentation.task`): each NIfTI volume of the folder (or of
  its ``imagesTs/`` / ``imagesTr/``), z-scored over its nonzero voxels, padded to at least the
  training patch, predicted with a sliding-window inferer of that patch (overlap
  ``SW_OVERLAP``), the padding inverted, the argmax written as ``PRED/{name}_seg.nii.gz`` with
  the input's affine;
* 2D segmentation: the same for each 2-D image of the folder (or of its ``imagesTs/`` /
  ``imagesTr/`` / ``images/``): NIfTI (``(X, Y)`` or ``(X, Y, 1)``, written back as ``(X, Y)``)
  or PNG / JPEG / TIFF / BMP (read with MONAI's ``PILReader``, the label map written as
  ``PRED/{name}_seg.png``);
* several input channels: one 4-D NIfTI per case, or one file per modality named as nnU-Net
  does (``<case>_0000.nii.gz``, ``<case>_0001.nii.gz``, ...), read together as one image;
* a 2D network trained on slices of volumes (``data.slices``): each NIfTI volume padded in-plane
  and predicted slice by slice across the slice axis (``SliceInferer``), written as a volume.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

__all__ = ["HEADER", "bundle_root_expression", "inference_config"]

HEADER = (
    "# MONAI bundle inference config written by `dpkfc-med bundle export` (dpkfc_med.bundle).\n"
    "# Run: python -m monai.bundle run --config_file THIS_FILE --dataset_dir DATA "
    "--output_dir PRED\n"
    "# Regenerate it instead of editing it: its preprocessing mirrors the engine's evaluation.\n"
)

BUNDLE_ROOT = (
    "$next((os.path.abspath(p) for p in sys.path[1:2] "
    "if os.path.isfile(os.path.join(p, 'configs', 'metadata.json'))), os.path.abspath('.'))"
)
"""``monai.bundle run`` puts the bundle folder at ``sys.path[1]`` before running; the expression
takes it when it holds ``configs/metadata.json`` (else the working directory, MONAI's default).
``--bundle_root DIR`` overrides it."""


def bundle_root_expression() -> str:
    """The ``bundle_root`` expression shared by every bundle config of this package."""
    return BUNDLE_ROOT


def _column(name: str) -> str:
    return "prob_" + (re.sub(r"[^0-9A-Za-z]+", "_", name).strip("_") or "class")


def _common(network_def: Mapping[str, Any], dataset_help: str) -> dict[str, Any]:
    return {
        "imports": ["$import glob", "$import os", "$import sys", "$import numpy", "$import torch"],
        "bundle_root": BUNDLE_ROOT,
        "dataset_dir": dataset_help,
        "output_dir": "$@bundle_root + '/eval'",
        "device": "$torch.device('cuda' if torch.cuda.is_available() else 'cpu')",
        "ckpt_path": "$@bundle_root + '/models/model.pt'",
        "network_def": dict(network_def),
        "network": "$@network_def.to(@device)",
        "load_weights": (
            "$@network.load_state_dict(torch.load(@ckpt_path, map_location=@device, "
            "weights_only=True))"
        ),
    }


def inference_config(
    cfg: Any, task: Mapping[str, Any], network_def: Mapping[str, Any]
) -> dict[str, Any]:
    """The inference config of a run (or of a pipeline's run config).

    Args:
        cfg: The :class:`~dpkfc_med.training.config.RunConfig` the model was trained with.
        task: The task record (``kind``, ``spatial_dims``, ``in_channels``, ``num_classes``,
            ``spatial_shape``, ``label_names``).
        network_def: The bundle ``network_def`` (:func:`.network.network_definition`).

    Returns:
        The config as a plain mapping (dump it with ``yaml.safe_dump(sort_keys=False)``).
    """
    if task["kind"] == "segmentation":
        return _segmentation(cfg, task, network_def)
    return _classification(cfg, task, network_def)


def _classification(
    cfg: Any, task: Mapping[str, Any], network_def: Mapping[str, Any]
) -> dict[str, Any]:
    k = int(task["num_classes"])
    names = list(task.get("label_names") or [f"class_{c}" for c in range(k)])
    dims = int(task["spatial_dims"])
    out = _common(network_def, "REQUIRED: --dataset_dir FILE.npz (MedMNIST format)")
    transforms: list[dict[str, Any]] = [
        # MedMNIST arrays are [N, *S] (grey) or [N, *S, C]
        {"_target_": "EnsureChannelFirst", "channel_dim": "no_channel"}
        if int(task["in_channels"]) == 1
        else {"_target_": "EnsureChannelFirst", "channel_dim": -1},
        {
            "_target_": "ScaleIntensityRange",
            "a_min": 0.0,
            "a_max": "@intensity_max",
            "b_min": 0.0,
            "b_max": 1.0,
        },
    ]
    if cfg.data.resize is not None:
        transforms.append(
            {
                "_target_": "Resize",
                "spatial_size": [int(s) for s in cfg.data.resize],
                "mode": "bilinear" if dims == 2 else "trilinear",
            }
        )
    transforms.append({"_target_": "EnsureType", "dtype": "$torch.float32", "track_meta": False})
    header = "index," + ",".join(_column(n) for n in names)
    out.update(
        {
            "split": "test",
            "batch_size": int(cfg.training.eval_batch_size),
            "class_names": names,
            "raw_images": "$numpy.load(@dataset_dir)[@split + '_images']",
            # uint8 -> [0, 1] as in training; other dtypes are used unchanged
            "intensity_max": "$255.0 if @raw_images.dtype == numpy.uint8 else 1.0",
            "preprocessing": {"_target_": "Compose", "transforms": transforms},
            "dataset": {
                "_target_": "Dataset",
                "data": "$list(@raw_images)",
                "transform": "@preprocessing",
            },
            "dataloader": {
                "_target_": "DataLoader",
                "dataset": "@dataset",
                "batch_size": "@batch_size",
                "shuffle": False,
                "num_workers": 0,
            },
            "inferer": {"_target_": "SimpleInferer"},
            "postprocessing": {"_target_": "Activations", "softmax": True, "dim": 1},
            "probabilities": (
                "$torch.no_grad()(lambda: torch.cat([@postprocessing(@inferer(x.to(@device), "
                "@network).float()).cpu() for x in @dataloader]))()"
            ),
            "csv_file": "$os.path.join(@output_dir, @split + '_probabilities.csv')",
            "csv_header": header,
            "write_csv": (
                "$numpy.savetxt(@csv_file, numpy.column_stack([numpy.arange(len(@probabilities)),"
                " @probabilities.numpy()]), delimiter=',', fmt=['%d'] + ['%.6f'] * "
                "len(@class_names), header=@csv_header, comments='')"
            ),
            "run": [
                "$@load_weights",
                "$@network.eval()",
                "$os.makedirs(@output_dir, exist_ok=True)",
                "$@write_csv",
                "$print('probabilities of', len(@probabilities), 'images:', @csv_file)",
            ],
        }
    )
    return out


def _segmentation(
    cfg: Any, task: Mapping[str, Any], network_def: Mapping[str, Any]
) -> dict[str, Any]:
    from dpkfc_med.data.cases import IMAGE_SUFFIXES as _PICTURES
    from dpkfc_med.tasks.segmentation.task import SW_OVERLAP

    patch = [int(s) for s in task["spatial_shape"]]
    axis = getattr(getattr(cfg.data, "slices", None), "axis", None)
    images_2d = int(task["spatial_dims"]) == 2 and axis is None
    what = "NIfTI images" + (" (or PNG / JPEG)" if images_2d else "")
    out = _common(network_def, f"REQUIRED: --dataset_dir FOLDER of {what}")
    kinds = "NIfTI image (*.nii, *.nii.gz" + (", *.png, *.jpg, ..." if images_2d else "") + ")"
    missing = (
        f"FileNotFoundError('no {kinds} in ' + str(@dataset_dir) + "
        "' nor in its imagesTs/ or imagesTr/: pass --dataset_dir FOLDER')"
    )
    # NIfTI first; a 2D network also reads pictures (one kind per folder)
    patterns = "('*.nii*',)" + (
        " + tuple('*' + e for e in " + repr(_PICTURES) + ")" if images_2d else ""
    )
    subs = "('', 'imagesTs', 'imagesTr'" + (", 'images'" if images_2d else "") + ")"
    pad: Any = "@patch_size"
    if axis is not None:  # slices: pad in-plane only (-1 keeps the slice axis)
        pad = list(patch)
        pad.insert(int(axis), -1)
    load: list[dict[str, Any]] = [
        {
            "_target_": "LoadImaged",
            "keys": "image",
            "reader": "@reader" if images_2d else "NibabelReader",
            "image_only": True,
        },
        {"_target_": "EnsureChannelFirstd", "keys": "image"},
    ]
    if images_2d:
        # a 2-D image stored as NIfTI (X, Y, 1): drop the size-1 axis, and from the header's
        # spatial_shape too (SaveImaged would otherwise write the label map as (1, X, Y))
        load.append(
            {
                "_target_": "Lambdad",
                "keys": "image",
                "func": (
                    "$lambda x: (lambda y: y.meta.update(spatial_shape=numpy.asarray("
                    "y.shape[1:])) or y)(monai.transforms.SqueezeDim(dim=x.ndim - 1)(x)) "
                    "if x.ndim == 4 and x.shape[-1] == 1 else x"
                ),
            }
        )
    inferer: dict[str, Any] = {
        "_target_": "SlidingWindowInferer",
        "roi_size": "@patch_size",
        "sw_batch_size": "@sw_batch_size",
        "overlap": SW_OVERLAP,
    }
    if axis is not None:
        inferer = {**inferer, "_target_": "SliceInferer", "spatial_dim": int(axis)}
    out["imports"] = [*out["imports"], "$import monai"]
    if int(task["in_channels"]) > 1:  # the grouping of modality files below
        out["imports"] += ["$import functools", "$import re"]
    out.update(
        {
            "patch_size": patch,
            "sw_batch_size": int(cfg.training.eval_batch_size),
            "nifti_files": (
                "$[sorted(p for pat in " + patterns + " for p in glob.glob(os.path.join("
                "@dataset_dir, sub, pat)) if not os.path.basename(p).startswith('.')) for sub "
                "in " + subs + "]"
            ),
            "datalist": (
                f"$next((f for f in @nifti_files if f), None) or (_ for _ in ()).throw({missing})"
            ),
            "reader": (
                f"$'PILReader' if @datalist[0].lower().endswith({_PICTURES!r}) else 'NibabelReader'"
            ),
            "output_ext": "$'.png' if @reader == 'PILReader' else '.nii.gz'",
            "preprocessing": {
                "_target_": "Compose",
                "transforms": [
                    *load,
                    {
                        "_target_": "EnsureTyped",
                        "keys": "image",
                        "dtype": "$torch.float32",
                        "track_meta": True,
                    },
                    # per-volume z-score over nonzero voxels, as in training
                    {
                        "_target_": "NormalizeIntensityd",
                        "keys": "image",
                        "nonzero": True,
                        "channel_wise": True,
                    },
                    {"_target_": "SpatialPadd", "keys": "image", "spatial_size": pad},
                ],
            },
            # several channels may come one file per modality (<case>_0000, _0001, ...): the
            # files of a case, in order, are one image (LoadImaged stacks them as channels)
            "cases": (
                "$@datalist"
                if int(task["in_channels"]) == 1
                else "$(lambda groups: [g[0] if len(g) == 1 else g for g in groups.values()])("
                "functools.reduce(lambda acc, f: acc.setdefault(re.sub(r'_\\d{4}(?=\\.nii)', "
                "'', f), []).append(f) or acc, @datalist, {}))"
            ),
            "dataset": {
                "_target_": "Dataset",
                "data": "$[{'image': f} for f in @cases]",
                "transform": "@preprocessing",
            },
            "inferer": inferer,
            "postprocessing": {
                "_target_": "Compose",
                "transforms": [
                    {
                        "_target_": "Invertd",
                        "keys": "pred",
                        "transform": "@preprocessing",
                        "orig_keys": "image",
                        "nearest_interp": False,
                        "to_tensor": True,
                    },
                    {"_target_": "AsDiscreted", "keys": "pred", "argmax": True},
                    {
                        "_target_": "SaveImaged",
                        "keys": "pred",
                        "output_dir": "@output_dir",
                        "output_postfix": "seg",
                        "output_ext": "@output_ext",
                        "output_dtype": "$numpy.uint8",
                        "resample": False,
                        "separate_folder": False,
                        "print_log": False,
                    },
                ],
            },
            "predict": (
                "$torch.no_grad()(lambda: [@postprocessing({'image': d['image'], 'pred': "
                "@inferer(d['image'].unsqueeze(0).to(@device), @network)[0].cpu()}) "
                "for d in @dataset])()"
            ),
            "run": [
                "$@load_weights",
                "$@network.eval()",
                "$os.makedirs(@output_dir, exist_ok=True)",
                "$print('label maps of', len(@predict), 'volumes written to', @output_dir)",
            ],
        }
    )
    return out
