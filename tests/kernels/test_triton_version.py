"""The kernels declare the Triton releases they support, once in pyproject.toml (pip enforces it)
and once at import (a clear ImportError instead of a kernel failing later); the two agree."""
from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
import triton

import deepinfer_kernels as dk

PYPROJECT = Path(dk.__file__).resolve().parents[1] / "pyproject.toml"


def test_declared_range_is_the_checked_range():
    deps = tomllib.loads(PYPROJECT.read_text())["project"]["dependencies"]
    assert [d.split(";")[0].strip() for d in deps if d.startswith("triton")] == [dk.TRITON_REQUIREMENT]
    dk.check_triton_version(triton.__version__)      # the installed one is inside it


@pytest.mark.parametrize("version", ["3.6.0", "3.7.1", "3.8.0", "3.9.0", "3.9.1+git0a1b2c3"])
def test_supported_versions_pass(version):
    dk.check_triton_version(version)


@pytest.mark.parametrize("version", ["3.5.1", "3.10.0", "4.0.0", "2.3.1"])
def test_other_versions_are_refused_naming_the_range(version):
    with pytest.raises(ImportError, match=rf"supports triton>=3\.6,<3\.10, found triton {version}"):
        dk.check_triton_version(version)
