"""Fused GPU kernels with pure-torch references in rlcore.ops.

The import name ``kernels`` is also that of Hugging Face's ``kernels`` distribution, which recent transformers
releases depend on and import at start (``transformers.integrations.hub_kernels``). With this package first on
``sys.path`` (a checkout, an editable install), that import would find this package and fail. So when HF's
package is installed too, its directory joins this package's ``__path__`` (this package's modules are found
first; none shares a name with one of HF's) and its top-level names are defined here, as its own ``__init__``
defines them: both packages import under the one name.
"""

from __future__ import annotations

import sys as _sys
from pathlib import Path as _Path


def _join_hf_kernels() -> None:
    here = _Path(__file__).resolve().parent
    for entry in _sys.path:
        other = _Path(entry or ".").resolve() / "kernels"
        init = other / "__init__.py"
        if other != here and init.is_file() and (other / "_internals").is_dir():
            __path__.append(str(other))  # noqa: F821 (the package's own __path__)
            exec(compile(init.read_text(), str(init), "exec"), globals())  # noqa: S102
            return


try:
    _join_hf_kernels()
except Exception as _e:  # a broken HF install must not stop rlcore's own kernels from importing
    import warnings as _warnings

    _warnings.warn(f"kernels: Hugging Face's kernels package is installed but failed to load ({_e!r})", stacklevel=1)
