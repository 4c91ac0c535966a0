"""rlcore: fully asynchronous RL for LLMs. Pure objectives, a thin stateful runtime."""

import importlib.machinery as _machinery
import importlib.util as _util
import sys as _sys
from pathlib import Path as _Path

__version__ = "0.2.0"


def _kernels_from_the_checkout() -> None:
    """The Triton kernels live in the ``kernels/`` folder beside ``rlcore/`` and install as the package
    ``rlcore_kernels`` (pyproject's package-dir). Run from a checkout that is not installed (``python -m ...`` in the
    repository), that folder is made the package ``rlcore_kernels`` here, so the fused paths are the same either way.
    It never takes the name ``kernels``, which belongs to Hugging Face's package.

    The checkout's own folder wins over whatever else answers to ``rlcore_kernels`` on ``sys.path`` (a stale
    editable install of another checkout resolves it to an empty namespace package), so ``rlcore`` and its kernels
    always come from one tree."""
    if "rlcore_kernels" in _sys.modules:
        return
    folder = _Path(__file__).resolve().parent.parent / "kernels"
    if not (folder / "logp_entropy.py").is_file():
        return  # an installed rlcore: rlcore_kernels was installed beside it
    spec = _machinery.ModuleSpec("rlcore_kernels", None, is_package=True)
    spec.submodule_search_locations = [str(folder)]
    _sys.modules["rlcore_kernels"] = _util.module_from_spec(spec)


_kernels_from_the_checkout()
