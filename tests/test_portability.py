"""The test suite's own set-up works on a user's machine, not only on CI's: the checks tests/conftest.py runs."""

from __future__ import annotations

from tests.conftest import kernels_name_clash

REQUIRES_525 = ["huggingface-hub<2.0,>=1.5.0", "kernels<0.20,>=0.19.1", "torch>=2.4; extra == \"torch\"",
                "kernels<0.20,>=0.19.1; extra == \"kernels\""]


def test_a_transformers_that_imports_kernels_is_named_with_the_fix():
    msg = kernels_name_clash("5.25.0", REQUIRES_525, kernels_installed=True)
    assert msg is not None and "transformers 5.25.0" in msg and "kernels/" in msg
    assert "pip install 'transformers<5.25'" in msg


def test_no_warning_where_nothing_clashes():
    extra_only = [r for r in REQUIRES_525 if "extra ==" in r]
    assert kernels_name_clash("5.24.0", extra_only, kernels_installed=True) is None  # kernels is only an extra
    assert kernels_name_clash("5.25.0", REQUIRES_525, kernels_installed=False) is None  # not installed
    assert kernels_name_clash(None, [], kernels_installed=True) is None  # no transformers at all
