"""Modality presets for probe images: spectral exponent, intensity mapping and channels, as data.

Every preset is a fixed, cited record; none is ever fitted to private data (estimating an
exponent from private data would cost privacy budget and must go through the ledger). Exponents
follow the convention of :mod:`dpkfc_med.probes.noise`: the power spectrum is proportional to
f^(-alpha). Where no measured exponent is published for a modality, the preset says so in its
``rationale`` and uses the natural-image default ``alpha = 2``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from types import MappingProxyType

from dpkfc_med.probes.noise import IntensityMode
from dpkfc_med.utils import check_choice, did_you_mean

__all__ = ["MODALITY_PRESETS", "PRESETS", "ModalityPreset", "get_preset", "preset_for_modality"]


@dataclass(frozen=True)
class ModalityPreset:
    """Probe settings for one imaging modality.

    Attributes:
        name: Lower-case key in :data:`PRESETS`.
        alpha: Power-spectrum exponent (power proportional to f^(-alpha)).
        intensity: How standardised noise is mapped to the preprocessed intensity range
            (:class:`~dpkfc_med.probes.noise.IntensityMode`).
        low: Lower end of the intensity range (None for ``"zscore"``).
        high: Upper end of the intensity range (None for ``"zscore"``).
        channels: Usual number of image channels (1 grey-level, 3 RGB).
        citation: Source of the exponent, or of the default used in its place.
        rationale: Why this exponent and intensity mapping, including what is *not* known.
    """

    name: str
    alpha: float
    intensity: IntensityMode
    low: float | None
    high: float | None
    channels: int
    citation: str
    rationale: str

    def __post_init__(self) -> None:
        # Normalise a plain-string intensity so the table can be written with literals.
        object.__setattr__(
            self, "intensity", check_choice("intensity", self.intensity, IntensityMode)
        )
        if not math.isfinite(self.alpha):
            raise ValueError(f"preset {self.name!r}: alpha={self.alpha!r} must be finite")
        if self.channels < 1:
            raise ValueError(f"preset {self.name!r}: channels={self.channels!r} must be >= 1")
        if self.intensity is IntensityMode.ZSCORE:
            if self.low is not None or self.high is not None:
                raise ValueError(f"preset {self.name!r}: 'zscore' takes no low/high")
        elif self.low is None or self.high is None or not self.low < self.high:
            raise ValueError(f"preset {self.name!r}: needs low < high for {self.intensity.value}")

    def to_dict(self) -> dict[str, object]:
        """JSON-serialisable record of the preset (for provenance reports)."""
        record = asdict(self)
        record["intensity"] = self.intensity.value
        return record


_NATURAL_CITATION = (
    "Field DJ (1987) Relations between the statistics of natural images and the response "
    "properties of cortical cells. J Opt Soc Am A 4(12):2379-2394; van der Schaaf A, "
    "van Hateren JH (1996) Modelling the power spectra of natural images: statistics and "
    "information. Vision Research 36(17):2759-2770"
)
_NO_EXPONENT = (
    "No measured power-spectrum exponent for this modality was adopted here, so the "
    "natural-image default alpha = 2 is used (see the 'natural' preset). "
)

_TABLE = (
    ModalityPreset(
        name="natural",
        alpha=2.0,
        intensity=IntensityMode.UNIT_RANGE,
        low=0.0,
        high=1.0,
        channels=1,
        citation=_NATURAL_CITATION,
        rationale=(
            "Natural images have Fourier amplitude close to 1/f, i.e. power f^-2 (measured "
            "exponents scatter around 2). Default for modalities without a published exponent."
        ),
    ),
    ModalityPreset(
        name="xray",
        alpha=2.0,
        intensity=IntensityMode.UNIT_RANGE,
        low=0.0,
        high=1.0,
        channels=1,
        citation=_NATURAL_CITATION,
        rationale=(
            _NO_EXPONENT + "Projection radiographs of the breast measure near 3 (see "
            "'mammography'), but that value is specific to breast parenchyma; for chest "
            "radiographs (e.g. PneumoniaMNIST) a controlled comparison found alpha = 3 probes "
            "worse than alpha = 2. Intensities scaled to "
            "[0, 1] as in the usual MedMNIST / ScaleIntensity preprocessing."
        ),
    ),
    ModalityPreset(
        name="ct",
        alpha=2.0,
        intensity=IntensityMode.UNIT_RANGE,
        low=0.0,
        high=1.0,
        channels=1,
        citation=(
            _NATURAL_CITATION + "; for breast CT only: Chen L, Abbey CK, Nosratieh A, "
            "Lindfors KK, Boone JM (2012) Anatomical complexity in breast parenchyma and its "
            "implications for optimal breast imaging strategies. Med Phys 39(3):1435-1441"
        ),
        rationale=(
            _NO_EXPONENT + "For dedicated breast CT, Chen et al. (2012) measured anatomical "
            "noise exponents of about 1.75-1.83, consistent with 2; no comparable measurement "
            "for body CT was adopted. Intensities as after a fixed HU window scaled to [0, 1] "
            "(MONAI ScaleIntensityRange with b_min=0, b_max=1)."
        ),
    ),
    ModalityPreset(
        name="mri",
        alpha=2.0,
        intensity=IntensityMode.ZSCORE,
        low=None,
        high=None,
        channels=1,
        citation=_NATURAL_CITATION,
        rationale=(
            _NO_EXPONENT + "MRI is usually z-score normalised per volume (MONAI "
            "NormalizeIntensity), so the probes are left standardised."
        ),
    ),
    ModalityPreset(
        name="ultrasound",
        alpha=2.0,
        intensity=IntensityMode.UNIT_RANGE,
        low=0.0,
        high=1.0,
        channels=1,
        citation=_NATURAL_CITATION,
        rationale=(
            _NO_EXPONENT + "B-mode speckle is correlated over the resolution cell and is "
            "not a power law at fine scales, so any single exponent is a rough proxy. "
            "Intensities in [0, 1]."
        ),
    ),
    ModalityPreset(
        name="mammography",
        alpha=3.0,
        intensity=IntensityMode.UNIT_RANGE,
        low=0.0,
        high=1.0,
        channels=1,
        citation=(
            "Burgess AE, Jacobson FL, Judy PF (2001) Human observer detection experiments "
            "with mammograms and power-law noise. Med Phys 28(4):419-437; Chen L, Abbey CK, "
            "Nosratieh A, Lindfors KK, Boone JM (2012) Anatomical complexity in breast "
            "parenchyma and its implications for optimal breast imaging strategies. "
            "Med Phys 39(3):1435-1441"
        ),
        rationale=(
            "Mammographic anatomical backgrounds have power spectra close to f^-3 (Burgess et "
            "al. 2001; Chen et al. 2012 report about 3.2-3.3 for CC and MLO views). "
            "Intensities in [0, 1]."
        ),
    ),
    ModalityPreset(
        name="histopathology",
        alpha=2.0,
        intensity=IntensityMode.UNIT_RANGE,
        low=0.0,
        high=1.0,
        channels=3,
        citation=_NATURAL_CITATION,
        rationale=(
            _NO_EXPONENT + "RGB (e.g. H&E slides, PathMNIST); the three channels are "
            "independent noise fields, while real stain channels are strongly correlated. "
            "Intensities in [0, 1]."
        ),
    ),
    ModalityPreset(
        name="fundus",
        alpha=2.0,
        intensity=IntensityMode.UNIT_RANGE,
        low=0.0,
        high=1.0,
        channels=3,
        citation=_NATURAL_CITATION,
        rationale=(
            _NO_EXPONENT + "RGB retinal photographs (e.g. RetinaMNIST); channels are "
            "independent noise fields. Intensities in [0, 1]."
        ),
    ),
)

PRESETS: MappingProxyType[str, ModalityPreset] = MappingProxyType({p.name: p for p in _TABLE})
"""Read-only table of modality presets, keyed by lower-case name."""


def _key(name: str) -> str:
    """Lookup key: case-insensitive, ignoring spaces, dashes and underscores ("X-ray")."""
    return "".join(ch for ch in name.strip().lower() if ch not in " -_")


def get_preset(name: str | ModalityPreset) -> ModalityPreset:
    """Look up a modality preset by name (case-insensitive; "X-ray" finds "xray").

    Args:
        name: Preset name, or a :class:`ModalityPreset` (returned unchanged).

    Returns:
        The preset.

    Raises:
        ValueError: If no preset has that name; the message lists the allowed names and
            suggests the closest one.
    """
    if isinstance(name, ModalityPreset):
        return name
    if isinstance(name, str):
        key = _key(name)
        for preset_name, preset in PRESETS.items():
            if _key(preset_name) == key:
                return preset
        hint = did_you_mean(key, PRESETS)
    else:
        hint = ""
    raise ValueError(f"preset={name!r} is not allowed{hint}; choose one of {sorted(PRESETS)}")


MODALITY_PRESETS: MappingProxyType[str, str] = MappingProxyType(
    {
        # DICOM modality codes (PS3.3 C.7.3.1.1.1) and the words bundles use
        "mr": "mri",
        "mri": "mri",
        "magneticresonance": "mri",
        "ct": "ct",
        "computedtomography": "ct",
        "cr": "xray",
        "dx": "xray",
        "xr": "xray",
        "xray": "xray",
        "radiograph": "xray",
        "us": "ultrasound",
        "ultrasound": "ultrasound",
        "mg": "mammography",
        "mammography": "mammography",
        "sm": "histopathology",
        "histopathology": "histopathology",
        "pathology": "histopathology",
        "wsi": "histopathology",
        "op": "fundus",
        "fundus": "fundus",
        "opt": "fundus",
    }  # fmt: skip
)
"""A declared modality (a bundle's ``network_data_format`` ``modality``, a DICOM code) ->
its probe preset; a public statement of the user's, never read from the images."""


def preset_for_modality(modality: str | None) -> str | None:
    """The probe preset of a declared modality (``"MR"`` -> ``"mri"``), or ``None``.

    Examples:
        >>> preset_for_modality("MR"), preset_for_modality("X-Ray"), preset_for_modality("PT")
        ('mri', 'xray', None)
    """
    if not modality:
        return None
    return MODALITY_PRESETS.get(_key(str(modality)))
