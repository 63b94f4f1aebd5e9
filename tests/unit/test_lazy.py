"""``clusterflow._lazy``: a package's names loaded on first use, unknown names refused."""

from __future__ import annotations

import subprocess
import sys

import pytest

from clusterflow._lazy import lazy_exports


def test_a_name_is_loaded_from_its_home_on_first_use() -> None:
    getattr_ = lazy_exports("pkg", {"dumps": "json", "sqrt": "math"})
    assert getattr_("dumps")([1]) == "[1]"
    assert getattr_("sqrt")(9.0) == 3.0


def test_an_unknown_name_is_an_attribute_error_naming_the_package() -> None:
    with pytest.raises(AttributeError, match="module 'pkg' has no attribute 'nope'"):
        lazy_exports("pkg", {})("nope")


def test_the_packages_load_torch_only_when_a_lazy_name_is_used() -> None:
    code = (
        "import sys, clusterflow, clusterflow.strategies, clusterflow.collective;"
        "before = 'torch' in sys.modules;"
        "clusterflow.collective.CollectiveGroup;"
        "print(before, 'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "True"]
