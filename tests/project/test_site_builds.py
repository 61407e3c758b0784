"""The documentation site builds with `mkdocs build --strict` in every test run: the README's test command is one
pytest run, so a failing test does not skip the docs build and a broken page fails the run."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").exists())


@pytest.mark.slow
def test_the_site_builds_strict(tmp_path):
    try:
        import mkdocs  # noqa: F401
    except ImportError:
        if os.environ.get("CI"):
            raise  # CI installs the docs extra: a missing mkdocs there is a broken install, not a skip
        pytest.skip("mkdocs not installed (pip install -e '.[docs]')")
    site = tmp_path / "site"
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site),
                           "--config-file", str(ROOT / "mkdocs.yml")], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"}, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert (site / "index.html").exists() and (site / "zh").is_dir()
    assert not list(site.rglob("__pycache__")), "the built site carries Python caches"
