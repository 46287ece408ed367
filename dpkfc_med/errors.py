"""Errors every layer may raise.

:class:`ConfigError` lives here so that tasks and data readers can name a config field without
importing the config itself (:mod:`dpkfc_med.training.config` re-exports it).
"""

from __future__ import annotations

__all__ = ["ConfigError"]


class ConfigError(ValueError):
    """One or more problems in a run configuration.

    Attributes:
        problems: One line per problem, e.g. ``"training.lr: must be > 0, got -1"``.
        source: Where the problems are, in words (a file, ``"the --set overrides"``, ...).
        set_by: Per problem, ``(KEY=VALUE, what is wrong)`` when a ``--set`` override is its
            culprit, else ``None``; empty when nothing was attributed.
        file: The YAML file holding the problems not attributed to an override, if any.
    """

    def __init__(
        self,
        problems: list[str],
        source: str = "config",
        *,
        set_by: list[tuple[str, str] | None] | None = None,
        file: str | None = None,
    ) -> None:
        self.problems, self.source = problems, source
        self.set_by, self.file = list(set_by or []), file
        super().__init__(f"config error in {source}:\n  " + "\n  ".join(problems))
