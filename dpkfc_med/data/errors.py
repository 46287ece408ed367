"""Exceptions shared by the data readers.

Readers collect every problem they find in a file or folder and raise once, so a user fixing a
dataset sees the whole list instead of one problem per run.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

__all__ = ["AmbiguousFormatError", "DataNotFoundError", "DataValidationError"]


class DataValidationError(ValueError):
    """A dataset file or folder failed validation.

    Attributes:
        source: The file or folder that was checked.
        problems: One line per problem; each names the key, case or field, and the fix.
    """

    def __init__(self, source: str | Path, problems: Iterable[str]) -> None:
        self.source = str(source)
        self.problems = list(problems)
        n = len(self.problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"{self.source}: {n} problem{'s' if n != 1 else ''} found:\n{lines}")


class AmbiguousFormatError(DataValidationError):
    """Two or more registered data formats recognise the same folder.

    The readers never guess by an order: the user removes the files of the layout they do not
    mean, or names the format.

    Attributes:
        formats: The names of the formats that recognise the folder, sorted.
    """

    def __init__(self, source: str | Path, formats: dict[str, str]) -> None:
        self.formats = sorted(formats)
        named = "; ".join(f"{name!r} ({formats[name]})" for name in self.formats)
        super().__init__(
            source,
            [
                f"the folder matches {len(formats)} data formats: {named}; remove the files of "
                "the layout you do not mean, or name the format (load_segmentation_folder(..., "
                f"format=NAME) with NAME one of {self.formats})"
            ],
        )


class DataNotFoundError(FileNotFoundError):
    """A data path could not be resolved.

    Attributes:
        spec: What the user asked for.
        tried: Every location that was looked at, in search order.
    """

    def __init__(self, spec: str | Path, tried: Iterable[str], hint: str) -> None:
        self.spec = str(spec)
        self.tried = list(tried)
        lines = "\n".join(f"  - {t}" for t in self.tried)
        super().__init__(f"could not find data {self.spec!r}; looked in:\n{lines}\n{hint}")

    def __str__(self) -> str:
        # FileNotFoundError.__str__ would print "[Errno None] None: ..." for a 1-arg init.
        return str(self.args[0])
