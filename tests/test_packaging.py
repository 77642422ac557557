"""What `pip install` gives a user: the wheel's metadata (the tested ranges as bounds, the plot
extra, py.typed), the README saying the same ranges, and one warning on a release outside them.

The wheel is built from a copy of the sources (`pip wheel --no-deps --no-build-isolation`, a few
seconds), not installed: its METADATA and file list are what pip reads."""

import logging
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from conftest import tiny_model

from remat import CheckpointedModel
from remat.compat import tested_versions
from remat.compat.tested_versions import TESTED, minor_release, warn_if_untested

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    source = tmp_path_factory.mktemp("source")
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, source / name)
    shutil.copytree(ROOT / "src", source / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", str(source), "-w", str(out)],
        check=True,
        capture_output=True,
        timeout=120,
    )
    (path,) = out.glob("remat-*.whl")
    with zipfile.ZipFile(path) as archive:
        names = archive.namelist()
        metadata = archive.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    return names, metadata


def _requirement(metadata, package):
    (line,) = [line for line in metadata.splitlines() if re.match(rf"Requires-Dist: {package}\b[<>=!, .0-9]*$", line)]
    bounds = dict(re.findall(r"(<|>=)(\d+\.\d+)", line))
    return minor_release(bounds[">="]), minor_release(bounds["<"])


def test_the_wheel_ships_py_typed_and_the_plot_extra(wheel):
    names, metadata = wheel
    assert "remat/py.typed" in names and "remat/assets/tiny_llama_config.json" in names
    assert "Provides-Extra: plot" in metadata
    assert re.search(r'^Requires-Dist: matplotlib>=3\.8; extra == "plot"$', metadata, flags=re.M)
    assert "Classifier: Typing :: Typed" in metadata


@pytest.mark.parametrize("package", sorted(TESTED))
def test_the_wheel_bounds_torch_and_transformers_one_minor_release_past_the_newest_tested(wheel, package):
    """And nothing older than the oldest tested: torch>=2.6 was declared, and before 2.12 'selective' ran unguarded
    (wrong gradients on an in-place change of a kept output), on 2.12 it failed to compile."""
    oldest, newest = TESTED[package]
    lower, upper = _requirement(wheel[1], package)
    assert lower == oldest, "every tested release installs, and no older one"
    assert upper == (newest[0], newest[1] + 2), "one untested minor release installs (with the warning), no more"


def test_the_readme_states_the_tested_ranges_and_the_declared_bounds():
    readme = (ROOT / "README.md").read_text()
    assert "## Install" in readme and "--index-url https://download.pytorch.org/whl/cpu" in readme
    assert 'pip install "./remat[plot]"' in readme and "git+" in readme
    (low, high) = TESTED["transformers"]
    assert f"transformers {low[0]}.{low[1]} to {high[0]}.{high[1]}" in readme
    assert f"torch {TESTED['torch'][1][0]}.{TESTED['torch'][1][1]}" in readme
    pyproject = (ROOT / "pyproject.toml").read_text()
    for declared in re.findall(r'"((?:torch|transformers)>=[^"]+)"', pyproject):
        assert f"`{declared}`" in readme, declared


def _faked(versions):
    return lambda package: versions[package]


def test_an_untested_release_is_one_warning_per_package_and_version(caplog, monkeypatch):
    monkeypatch.setattr(tested_versions, "_warned", set())
    caplog.set_level(logging.WARNING, logger="remat")
    assert warn_if_untested(_faked({"torch": "2.13.0+cpu", "transformers": "5.24.0"})) == []
    assert warn_if_untested(_faked({"torch": "2.13.1", "transformers": "4.57.6"})) == []
    said = warn_if_untested(_faked({"torch": "2.14.0+cu128", "transformers": "5.25.0.dev0"}))
    assert len(said) == 2 and "torch 2.14.0+cu128" in said[0] and "(torch 2.13)" in said[0]
    assert "transformers 5.25.0.dev0" in said[1] and "(transformers 4.57 to 5.24)" in said[1]
    assert warn_if_untested(_faked({"torch": "2.14.0+cu128", "transformers": "5.25.0.dev0"})) == [], "once"
    assert len(warn_if_untested(_faked({"torch": "2.13.0", "transformers": "4.56.2"}))) == 1
    warned = [r for r in caplog.records if r.name == "remat" and r.levelno == logging.WARNING]
    assert [r.getMessage() for r in warned] == [*said, warned[-1].getMessage()]


def test_building_a_wrapper_on_an_untested_transformers_warns_once(caplog, monkeypatch):
    monkeypatch.setattr(tested_versions, "_warned", set())
    versions = {"torch": "2.13.0", "transformers": "5.99.0"}
    monkeypatch.setattr(tested_versions, "installed_version", _faked(versions))
    with caplog.at_level(logging.WARNING, logger="remat"):
        CheckpointedModel(tiny_model())
        CheckpointedModel(tiny_model())
    assert (
        sum("transformers 5.99.0 is not a release remat is tested with" in r.getMessage() for r in caplog.records) == 1
    )


def test_every_public_name_is_visible_to_a_type_checker():
    """`remat.CheckpointedModel` and the Trainer names load on first use (`__getattr__`, so `import remat` stays free
    of torch), which a type checker cannot follow: mypy saw them as Any. Each is imported under TYPE_CHECKING, the
    block type checkers read: the names a checker sees at module level are `__all__`, all of it."""
    import ast

    import remat

    tree = ast.parse(Path(remat.__file__).read_text())
    seen = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            seen.update(alias.asname or alias.name for alias in node.names)
        elif isinstance(node, ast.Assign):
            seen.update(t.id for t in node.targets if isinstance(t, ast.Name))
    assert set(remat.__all__) <= seen, set(remat.__all__) - seen
