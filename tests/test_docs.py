"""The user documentation: README code runs, generated pages are fresh, links resolve."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
PACKAGE_README = ROOT / "dpkfc_med" / "README.md"
MAX_README_LINES = 170
SNIPPET_TIMEOUT_S = 180  # the snippet takes ~15 s on one thread; the margin is for busy machines


def _user_docs() -> list[Path]:
    return [README, *sorted(DOCS.glob("*.md"))]


def _without_code(text: str) -> str:
    """The Markdown outside fenced code blocks and inline code spans."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.MULTILINE | re.DOTALL)
    return re.sub(r"`[^`\n]*`", "", text)


def _python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.MULTILINE | re.DOTALL)


def _load_results_doc():
    from dpkfc_bench import results_doc

    return results_doc


def test_readme_python_blocks_run_as_written(tmp_path):
    from dpkfc_med.data import DataNotFoundError, resolve_data_path

    blocks = _python_blocks(README.read_text(encoding="utf-8"))
    assert blocks, "README.md has no ```python block"
    try:
        resolve_data_path("pneumoniamnist")
    except DataNotFoundError as err:  # the bundled data is part of the test set-up
        pytest.fail(f"the README snippet reads the bundled PneumoniaMNIST: {err}")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    for i, code in enumerate(blocks):
        script = tmp_path / f"readme_block_{i}.py"
        script.write_text(code, encoding="utf-8")
        proc = subprocess.run(
            [sys.executable, str(script)],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=SNIPPET_TIMEOUT_S,
        )
        assert proc.returncode == 0, (
            f"README.md python block {i} failed:\n{code}\n--- stderr ---\n{proc.stderr[-4000:]}"
        )
        spent = re.search(r"epsilon spent: ([0-9.]+)", proc.stdout)
        if spent is not None:  # the library snippet: its epsilon stays within its target
            assert 0 < float(spent.group(1)) <= 1.0 + 1e-9, proc.stdout


def test_configuration_reference_is_fresh():
    from dpkfc_med.training.config_reference import render

    page = DOCS / "configuration.md"
    assert page.read_text(encoding="utf-8") == render(), (
        "docs/configuration.md is stale: run "
        "python -m dpkfc_med.training.config_reference > docs/configuration.md"
    )


def test_configuration_reference_lists_every_field():
    import dataclasses

    from dpkfc_med.training.config_reference import SECTIONS, field_rows

    text = (DOCS / "configuration.md").read_text(encoding="utf-8")
    for section, cls in SECTIONS:
        documented = {r["field"] for r in field_rows(section, cls)}
        nested = {
            f.name
            for f in dataclasses.fields(cls)
            if isinstance(f.default_factory, type) and dataclasses.is_dataclass(f.default_factory)
        }
        public = {f.name for f in dataclasses.fields(cls) if not f.metadata.get("internal")}
        assert documented | nested == public
        for name in documented:
            assert f"| `{name}` |" in text
        rows = field_rows(section, cls)
        undocumented = [r["field"] for r in rows if not r["description"]]
        assert not undocumented, f"{section or 'top level'}: no description for {undocumented}"


def test_results_page_is_fresh():
    module = _load_results_doc()
    assert (DOCS / "results.md").read_text(encoding="utf-8") == module.render(), (
        "docs/results.md is stale: run python -m dpkfc_bench results-doc"
    )


def test_results_page_holds_every_results_file(tmp_path):
    module = _load_results_doc()
    (tmp_path / "accuracy_new_suite.md").write_text(
        "## new_suite (test split)\n\n| a |\n|---|\n", encoding="utf-8"
    )
    (tmp_path / "accuracy_new_suite.png").write_bytes(b"")
    (tmp_path / "zzz_other.md").write_text("# Something else\n\ntext\n", encoding="utf-8")
    page = module.render(tmp_path)
    assert "### accuracy_new_suite\n\nnew_suite (test split)." in page
    assert "#### new_suite (test split)" in page  # headings demoted below the file's heading
    assert "![accuracy_new_suite](../dpkfc_bench/results/accuracy_new_suite.png)" in page
    assert "## Other results" in page and "# Something else" in page
    for results_md in sorted((ROOT / "dpkfc_bench" / "results").glob("*.md")):
        if results_md.name == "README.md":  # the index of the results folder
            continue
        assert f"### {results_md.stem}\n" in (DOCS / "results.md").read_text(encoding="utf-8")


BENCHMARK_READMES = [ROOT / "dpkfc_bench" / "README.md", ROOT / "dpkfc_bench/results/README.md"]


@pytest.mark.parametrize(
    "doc",
    [*_user_docs(), PACKAGE_README, *BENCHMARK_READMES],
    ids=lambda p: str(p.relative_to(ROOT)),
)
def test_relative_links_point_at_existing_files(doc):
    links = re.findall(r"!?\[[^\]]*\]\(([^)\s]+)\)", _without_code(doc.read_text(encoding="utf-8")))
    broken = []
    for target in links:
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # absolute URL or in-page anchor
        path = (doc.parent / target.split("#", 1)[0]).resolve()
        if not path.is_file():
            broken.append(target)
    assert not broken, f"{doc.relative_to(ROOT)}: links to missing files: {broken}"


def test_readme_is_short():
    lines = README.read_text(encoding="utf-8").count("\n")
    assert lines <= MAX_README_LINES, (
        f"README.md has {lines} lines (at most {MAX_README_LINES}); move detail to docs/"
    )


def test_readme_keeps_the_two_commands():
    text = README.read_text(encoding="utf-8")
    setup = 'python3 -m venv .venv && .venv/bin/pip install -q -e ".[dev]" && '
    assert f"{setup}.venv/bin/dpkfc-med train configs/pneumoniamnist_cnn_2d_eps1.yaml\n" in text
    assert f"{setup}.venv/bin/python -m pytest\n" in text
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert f"{setup}.venv/bin/python -m pytest" in ci


@pytest.mark.parametrize("doc", _user_docs(), ids=lambda p: p.name)
def test_no_development_notes_in_user_docs(doc):
    text = doc.read_text(encoding="utf-8")
    assert "DESIGN.md" not in text, f"{doc.name} points at DESIGN.md, which users do not have"
    found = re.findall(r"\bsessions?\b", text, flags=re.IGNORECASE)
    assert not found, f"{doc.name} reads like a development diary ({found})"


def test_readme_names_every_model_and_config():
    from dpkfc_med.models import list_models

    text = README.read_text(encoding="utf-8")
    missing = [name for name in list_models() if f"`{name}`" not in text]
    assert not missing, f"README.md does not list the registered networks {missing}"
    for config in sorted((ROOT / "configs").glob("*.yaml")):
        stem = re.sub(r"_eps\d+$", "", config.stem)
        assert stem in text, f"README.md does not mention configs/{config.name}"


def test_package_readme_lists_every_subpackage():
    text = PACKAGE_README.read_text(encoding="utf-8")
    listed = set(re.findall(r"^\| `(\w+)/` \|", text, flags=re.MULTILINE))
    packages = {p.parent.name for p in (ROOT / "dpkfc_med").glob("*/__init__.py")}
    assert listed == packages, f"dpkfc_med/README.md lists {sorted(listed)}, not {sorted(packages)}"
