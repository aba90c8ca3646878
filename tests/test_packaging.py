"""pyproject.toml lists packages by hand; the list must match the tree, and the kernels/ folder (the package
`orl_jax_kernels`) must never shadow the PyPI package `kernels` (transformers >= 5.25 imports it)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _packages_under(folder: Path, dotted: str) -> set[str]:
    """`folder` itself and every directory with an __init__.py under it, as dotted package names."""
    out = {dotted}
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
    assert st["package-dir"] == {"orl_jax_kernels": "kernels"}  # the one package not under its import name
    on_disk = _packages_under(ROOT / "orl_jax", "orl_jax") | _packages_under(ROOT / "kernels", "orl_jax_kernels")
    assert "orl_jax.model" in on_disk and "orl_jax_kernels.decode_attention" in on_disk
    assert set(listed) == on_disk, (f"missing from pyproject: {sorted(on_disk - set(listed))}; "
                                    f"listed but not packages: {sorted(set(listed) - on_disk)}")


def test_every_source_folder_is_a_package():
    """A folder of .py files without __init__.py would silently not ship (kernels/ itself is the namespace root)."""
    assert _source_dirs_without_init(ROOT / "orl_jax") == []
    assert _source_dirs_without_init(ROOT / "kernels") == [ROOT / "kernels"]


def test_console_script_and_markers():
    project = _pyproject()["project"]
    assert project["scripts"]["orl-jax"] == "orl_jax.cli:main"
    from orl_jax import cli

    assert callable(cli.main)
    markers = " ".join(_pyproject()["tool"]["pytest"]["ini_options"]["markers"])
    for m in ("gpu:", "slow:", "hf:"):
        assert m in markers


def test_kernels_folder_never_shadows_the_pypi_kernels_package():
    """With the repository root on sys.path (a notebook started there, `python -m ...`, the benchmarks), a regular
    package named `kernels` there is what `import kernels` finds, and transformers >= 5.25 imports the PyPI package of
    that name when it loads a model (an ImportError in session 36's CI). kernels/ has no __init__.py, so Python takes
    a regular `kernels` package from anywhere on sys.path before it, or else treats it as an empty namespace."""
    assert not (ROOT / "kernels" / "__init__.py").exists()
    probe = ("import importlib.util, sys; s = importlib.util.find_spec('kernels'); "
             "print(s.origin, list(s.submodule_search_locations or []))")
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=60,
                         env={"PYTHONPATH": str(ROOT), "PATH": ""})
    assert out.returncode == 0, out.stderr
    origin = out.stdout.split()[0]
    if importlib.util.find_spec("kernels") is not None and origin != "None":  # the PyPI package is installed
        assert not Path(origin).resolve().is_relative_to(ROOT / "kernels"), out.stdout
    else:
        assert origin == "None", out.stdout  # our folder as a namespace: no code runs on `import kernels`


def test_kernels_import_as_orl_jax_kernels():
    import orl_jax_kernels.decode_attention.kernel as attention

    assert Path(attention.__file__).resolve().is_relative_to(ROOT / "kernels")
