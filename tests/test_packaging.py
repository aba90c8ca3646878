"""pyproject.toml lists packages by hand; the list must match the tree, and no top-level folder may shadow the PyPI
package `kernels` (transformers >= 5.25 imports it)."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _packages_under(folder: Path, dotted: str) -> set[str]:
    """Every directory with an __init__.py under `folder` (itself included), as dotted package names."""
    out = set()
    for init in folder.rglob("__init__.py"):
        rel = init.parent.relative_to(folder)
        if "__pycache__" in rel.parts:
            continue
        out.add(".".join((dotted, *rel.parts)))
    return out


def _source_dirs_without_init(folder: Path) -> list[Path]:
    bad = []
    for py in folder.rglob("*.py"):
        d = py.parent
        if "__pycache__" not in d.parts and not (d / "__init__.py").exists():
            bad.append(d)
    return sorted(set(bad))


def test_package_list_matches_tree():
    st = _pyproject()["tool"]["setuptools"]
    listed = st["packages"]
    assert len(listed) == len(set(listed)), "duplicate entries in [tool.setuptools] packages"
    assert "package-dir" not in st  # every package lives under its import name
    on_disk = {pkg for name in ("orl_jax", "orl_jax_kernels") for pkg in _packages_under(ROOT / name, name)}
    assert "orl_jax" in on_disk and "orl_jax.model" in on_disk and "orl_jax_kernels" in on_disk
    assert set(listed) == on_disk, (f"missing from pyproject: {sorted(on_disk - set(listed))}; "
                                    f"listed but not packages: {sorted(set(listed) - on_disk)}")


def test_every_source_folder_is_a_package():
    """A folder of .py files without __init__.py would silently not ship."""
    for folder in (ROOT / "orl_jax", ROOT / "orl_jax_kernels"):
        assert _source_dirs_without_init(folder) == []


def test_console_script_and_markers():
    project = _pyproject()["project"]
    assert project["scripts"]["orl-jax"] == "orl_jax.cli:main"
    from orl_jax import cli

    assert callable(cli.main)
    markers = " ".join(_pyproject()["tool"]["pytest"]["ini_options"]["markers"])
    for m in ("gpu:", "slow:", "hf:"):
        assert m in markers


def test_no_top_level_folder_shadows_the_pypi_kernels_package():
    """With the repository root on sys.path (a notebook started there, `python -m ...`, the benchmarks), a folder
    named `kernels` there is what `import kernels` finds, and transformers >= 5.25 imports the PyPI package of that
    name when it loads a model (an ImportError in session 36's CI)."""
    assert not (ROOT / "kernels").exists()
