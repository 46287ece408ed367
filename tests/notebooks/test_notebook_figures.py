"""The notebooks' spectrum figures stay legible: no two tick labels of an axis overlap."""

import matplotlib
import pytest

matplotlib.use("Agg")

from dpkfc_med import analysis as an  # noqa: E402


def _overlapping_tick_labels(fig) -> list[tuple[str, str]]:
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    pairs = []
    for ax in fig.axes:
        frame = ax.get_window_extent(renderer)
        for k, axis in enumerate((ax.xaxis, ax.yaxis)):
            low, high = (frame.intervalx, frame.intervaly)[k]
            boxes = [
                (t.get_text(), box)
                for t in axis.get_ticklabels(minor=False) + axis.get_ticklabels(minor=True)
                if t.get_visible() and t.get_text()
                for box in [t.get_window_extent(renderer)]
                if low - 1 <= (box.min[k] + box.max[k]) / 2 <= high + 1  # drawn: tick in view
            ]
            pairs += [
                (a, b)
                for i, (a, box_a) in enumerate(boxes)
                for b, box_b in boxes[i + 1 :]
                if box_a.overlaps(box_b)
            ]
    return pairs


# the notebooks' shapes: 2D X-ray, 3D CT, anisotropic 3D MRI crops, and a wide 2D one
@pytest.mark.parametrize(
    "preset, shape, spacing",
    [
        ("xray", (28, 28), None),
        ("ct", (28, 28, 28), None),
        ("mri", (16, 24, 16), (2.5, 1.0, 1.0)),
        ("xray", (256, 256), 0.1),
    ],
)
def test_spectrum_plot_tick_labels_do_not_overlap(preset, shape, spacing):
    spectra = [
        an.probe_spectrum(preset, shape, spacing=spacing, num=2),
        an.probe_spectrum(preset, shape, spacing=spacing, num=2, alpha=3.0, label="alpha 3"),
    ]
    fig = an.plot_image_spectra(spectra, title="tick labels")
    try:
        assert _overlapping_tick_labels(fig) == []
    finally:
        matplotlib.pyplot.close(fig)
