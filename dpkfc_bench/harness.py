"""What every study shares: provenance, result files, Markdown tables and the run grid.

A study's result is one JSON file under ``dpkfc_bench/results/`` that grows run by run (an
interrupted study resumes where it stopped, see :func:`pending` and :func:`record`), with a
Markdown summary generated from it. Every result records the machine, the library versions
and the git commit of the code that made it.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import platform
import subprocess
from collections.abc import Callable, Hashable, Iterable, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "dpkfc_bench" / "results"


# ----------------------------------------------------------------------------- provenance


def git_commit() -> str | None:
    """The checkout's ``HEAD`` commit, or ``None`` outside a git checkout."""
    try:
        proc = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return (proc.stdout.strip() or None) if proc.returncode == 0 else None


def environment() -> dict[str, Any]:
    """The report's environment record (versions, machine, git state) plus torch threads."""
    import torch

    from dpkfc_med.report import collect_environment

    env = collect_environment(ROOT)
    env["torch_threads"] = torch.get_num_threads()
    env["platform"] = platform.platform()
    return env


def versions() -> dict[str, str | None]:
    """Python, torch, Opacus, MONAI and this package's versions."""
    import torch

    out: dict[str, str | None] = {"python": platform.python_version(), "torch": torch.__version__}
    for name in ("opacus", "monai", "dpkfc_med"):
        try:
            out[name] = str(getattr(__import__(name), "__version__", None))
        except ImportError:
            out[name] = None
    return out


def package_digest() -> dict[str, Any]:
    """SHA-256 over the package's ``.py`` files: identifies the measured code even when the
    working tree differs from the recorded commit."""
    root = ROOT / "dpkfc_med"
    files = sorted(root.rglob("*.py"))
    h = hashlib.sha256()
    for f in files:
        h.update(str(f.relative_to(ROOT)).encode())
        h.update(f.read_bytes())
    newest = max((f.stat().st_mtime for f in files), default=0.0)
    return {
        "sha256": h.hexdigest(),
        "files": len(files),
        "newest_mtime": datetime.fromtimestamp(newest, timezone.utc).isoformat(timespec="seconds"),
    }


def available_bytes(device: Any) -> int | None:
    """Free memory now: ``MemAvailable`` (CPU) or ``cudaMemGetInfo`` free (a CUDA device)."""
    if device.type == "cuda":
        import torch

        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return 1024 * int(line.split()[1])
    except OSError:
        return None
    return None


def machine(device: Any) -> dict[str, Any]:
    """Platform, CPU model and count, torch threads, free memory and the GPU of ``device``."""
    import torch

    out: dict[str, Any] = {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "device": str(device),
        "gpu": None,
    }
    try:
        with open("/proc/cpuinfo") as f:
            names = [ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")]
        if names:
            out["cpu_model"] = names[0]
    except OSError:
        pass
    mem = available_bytes(torch.device("cpu"))
    out["cpu_mem_available_gib_at_start"] = None if mem is None else round(mem / 2**30, 1)
    if device.type == "cuda":
        out["gpu"] = torch.cuda.get_device_name(device)
        out["gpu_mem_total_gib"] = round(
            torch.cuda.get_device_properties(device).total_memory / 2**30, 1
        )
        out["cuda"] = torch.version.cuda
        out["cudnn"] = torch.backends.cudnn.version()
    return out


def loadavg() -> list[float] | None:
    """The 1, 5 and 15 minute load averages (``None`` where the system has none)."""
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except OSError:
        return None


def display_path(path: Path) -> str:
    """``path`` relative to the repository root when it lies inside it, else absolute."""
    p = path.resolve()
    return str(p.relative_to(ROOT)) if p.is_relative_to(ROOT) else str(p)


def error_text(exc: BaseException) -> str:
    """One line naming an exception, for a result file."""
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:500]


# ----------------------------------------------------------------------------- result files


def runs_dir(study: str) -> Path:
    """Where a study's training runs go: ``$DPKFC_BENCH_RUNS/<study>`` (default under /tmp)."""
    return Path(os.environ.get("DPKFC_BENCH_RUNS", "/tmp/dpkfc_bench_runs")) / study


def load_results(path: Path) -> dict[str, Any]:
    """A study's result JSON, or an empty one (``{"runs": []}``) when it does not exist yet."""
    if path.is_file():
        return json.loads(path.read_text(encoding="utf-8"))
    return {"runs": []}


def save_results(path: Path, data: dict[str, Any]) -> None:
    """Write the result JSON atomically (a killed study never leaves half a file)."""
    from dpkfc_med.utils import write_json

    write_json(path, data)


def pending(
    jobs: Iterable[dict[str, Any]],
    runs: Iterable[dict[str, Any]],
    key: Callable[[dict[str, Any]], Hashable],
) -> list[dict[str, Any]]:
    """The jobs of a run grid that no recorded run matches under ``key`` (the resume)."""
    done = {key(r) for r in runs}
    return [j for j in jobs if key(j) not in done]


def record(path: Path, data: dict[str, Any], run: dict[str, Any]) -> None:
    """Append one finished run to ``data["runs"]`` and save the result file.

    Runs another process recorded in the file meanwhile (two invocations of one study on
    different workloads) are kept: the file's runs are read again, ``run`` is appended to them
    and ``data["runs"]`` becomes that list.
    """
    on_disk = load_results(path)["runs"] if path.is_file() else []
    known = {json.dumps(r, sort_keys=True, default=str) for r in on_disk}
    mine = [r for r in data["runs"] if json.dumps(r, sort_keys=True, default=str) not in known]
    data["runs"] = [*on_disk, *mine, run]
    save_results(path, data)


def merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """A deep copy of ``base`` with ``extra`` merged in (nested dicts merged key by key)."""
    out = copy.deepcopy(base)
    for k, v in extra.items():
        out[k] = merge(out.get(k, {}), v) if isinstance(v, dict) else v
    return out


def floats(text: str) -> list[float]:
    """``"1,8"`` -> ``[1.0, 8.0]`` (a comma list of a command-line option)."""
    return [float(x) for x in text.split(",")]


def ints(text: str) -> list[int]:
    """``"1,2,3"`` -> ``[1, 2, 3]``."""
    return [int(x) for x in text.split(",")]


# ----------------------------------------------------------------------------- tables


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for one value)."""
    import numpy as np

    a = np.asarray(values, dtype=float)
    return float(a.mean()), float(a.std(ddof=1)) if len(a) > 1 else 0.0


def fmt_mean_std(values: Sequence[float]) -> str:
    """``"0.812 +- 0.004"``: mean and sample standard deviation to three decimals."""
    m, s = mean_std(values)
    return f"{m:.3f} +- {s:.3f}"


def reading_lines(data: dict[str, Any]) -> list[str]:
    """A result file's ``"reading"`` (one paragraph or a list of them) as a Markdown section."""
    reading = data.get("reading") or []
    lines: list[str] = ["", "## Reading"] if reading else []
    for paragraph in [reading] if isinstance(reading, str) else reading:
        lines += ["", paragraph]
    return lines


def table(header: Sequence[str], rows: Iterable[Sequence[str]] = ()) -> list[str]:
    """Markdown table lines: the header, its rule and one line per row."""
    return [
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
        *("| " + " | ".join(row) + " |" for row in rows),
    ]


def layer_evidence(run: Path) -> dict[str, Any]:
    """A run's per-layer SNR and clipped fraction (custodian diagnostics, not DP), if it kept them."""
    from dpkfc_med.analysis.run_diagnostics import read_run_diagnostics

    try:
        diag = read_run_diagnostics(run)
    except (FileNotFoundError, ValueError):
        return {}
    return {"clipped_fraction": round(diag.mean_clipped_fraction, 4),
            "layer_snr": {k: float(f"{v:.4g}") for k, v in diag.mean_layer_snr.items()}}  # fmt: skip


SNR_EXPLAINED = (
    "Each layer's clipped signal's squared norm over the noise's expected squared norm on it, "
    "mean over steps (and seeds), in the space the method clips in (custodian diagnostics from "
    "un-noised gradients, not DP)."
)


def snr_table(columns: dict[str, list[dict[str, float]]]) -> list[str]:
    """Markdown rows: one per layer, one column per label, the mean SNR over its runs.

    DP-KFC marks a layer without a curvature block ``" (fallback)"``; the mark is dropped so
    that the methods' rows line up.
    """

    def strip(name: str) -> str:
        return name.removesuffix(" (fallback)")

    layers = list(dict.fromkeys(strip(k) for runs in columns.values() for r in runs for k in r))

    def mean(runs: list[dict[str, float]], layer: str) -> str:
        vals = [v for r in runs for k, v in r.items() if strip(k) == layer]
        return f"{sum(vals) / len(vals):.3g}" if vals else "-"

    return table(
        ["layer", *columns], [[x, *[mean(c, x) for c in columns.values()]] for x in layers]
    )
