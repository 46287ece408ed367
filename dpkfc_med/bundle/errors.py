"""The error of a run that cannot be exported as a bundle (a run's or a tuning's)."""

from __future__ import annotations

from pathlib import Path

__all__ = ["BundleExportError"]


class BundleExportError(ValueError):
    """A run directory that cannot be exported; one line per problem, each with its fix."""

    def __init__(self, problems: list[str], run_dir: Path) -> None:
        self.problems = problems
        super().__init__(f"cannot export {run_dir} as a bundle:\n  " + "\n  ".join(problems))
