"""pyproject.toml lists packages by hand (kernels/ ships as orl_jax_kernels); the list must match the tree."""

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
    package_dir = st.get("package-dir", {})
    assert package_dir.get("orl_jax_kernels") == "kernels"
    on_disk = _packages_under(ROOT / "orl_jax", "orl_jax")
    for name, folder in package_dir.items():
        on_disk |= _packages_under(ROOT / folder, name)
    assert "orl_jax" in on_disk and "orl_jax.model" in on_disk and "orl_jax_kernels" in on_disk
    assert set(listed) == on_disk, (f"missing from pyproject: {sorted(on_disk - set(listed))}; "
                                    f"listed but not packages: {sorted(set(listed) - on_disk)}")


def test_every_source_folder_is_a_package():
    """A folder of .py files without __init__.py would silently not ship."""
    for folder in (ROOT / "orl_jax", ROOT / "kernels"):
        assert _source_dirs_without_init(folder) == []


def test_console_script_and_markers():
    project = _pyproject()["project"]
    assert project["scripts"]["orl-jax"] == "orl_jax.cli:main"
    from orl_jax import cli

    assert callable(cli.main)
    markers = " ".join(_pyproject()["tool"]["pytest"]["ini_options"]["markers"])
    for m in ("gpu:", "slow:", "hf:"):
        assert m in markers
