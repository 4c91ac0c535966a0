"""Tensors handed between processes of one host without copying them through Python objects.

SGLang's ``/update_weights_from_tensor`` carries, per tensor-parallel rank, one base64 string: a
``multiprocessing`` (``ForkingPickler``) pickle of ``[(name, tensor), ...]``. For a CUDA tensor the pickle holds a
CUDA IPC handle of its storage (the receiver maps the sender's memory and copies device-to-device); for a CPU
tensor it holds a file descriptor of a shared-memory segment, passed over a Unix socket. Only metadata crosses
HTTP; the bytes stay where they are.

The receiving side never runs a plain ``pickle.loads`` on request bodies: :func:`loads_named_tensors` unpickles
with an allow-list of the exact globals torch's tensor reductions produce (the rebuild functions, storage and
tensor classes, dtypes), so a request that names anything else (``os.system``, ``builtins.eval``, a module's
``__import__`` gadget) is refused before any of it runs. The endpoint is still an administrative one: the
server binds 127.0.0.1 by default, and sharing memory this way only works between processes of one host anyway.

Lifetime: the sender must keep the tensors alive (and unmodified) until the receiver acknowledged the load;
:mod:`rlcore.training.weight_sync` keeps one flat buffer per model for this and reuses it every publish, so the
receiver maps each IPC handle once (torch caches mapped storages by handle).
"""

from __future__ import annotations

import base64
import binascii
import io
import multiprocessing
import pickle
import threading
from collections.abc import Sequence

import torch

_TORCH_DTYPES = {
    name
    for name in dir(torch)
    if isinstance(getattr(torch, name, None), torch.dtype)
}

ALLOWED_GLOBALS: frozenset[tuple[str, str]] = frozenset(
    {
        ("builtins", n)
        for n in ("list", "tuple", "dict", "int", "float", "bool", "str", "bytes", "bytearray", "slice")
    }
    | {("collections", "OrderedDict"), ("copyreg", "__newobj__")}
    | {("torch", "Size"), ("torch", "device"), ("torch", "dtype"), ("torch", "Tensor")}
    | {("torch", d) for d in _TORCH_DTYPES}
    | {("torch.nn.parameter", "Parameter")}
    | {("torch.storage", "UntypedStorage"), ("torch.storage", "TypedStorage"), ("torch", "UntypedStorage")}
    | {("torch._utils", "_rebuild_tensor_v2"), ("torch._utils", "_rebuild_parameter")}
    | {
        ("torch.multiprocessing.reductions", n)
        for n in (
            "rebuild_tensor",
            "rebuild_cuda_tensor",
            "rebuild_storage_fd",
            "rebuild_storage_filename",
            "rebuild_storage_empty",
            "rebuild_typed_storage",
            "rebuild_typed_storage_child",
            "rebuild_event",
            "rebuild_nested_tensor",
        )
    }
    | {("multiprocessing.resource_sharer", "DupFd")}
)
"""``(module, name)`` pairs the unpickler may resolve: what torch's ``ForkingPickler`` reductions of CPU and CUDA
tensors (and their storages) emit, plus plain containers. Nothing that runs code of the caller's choosing."""


_STRATEGY_LOCK = threading.Lock()


class TensorIPCError(ValueError):
    """A serialized tensor payload that is malformed or names a global outside :data:`ALLOWED_GLOBALS`."""


class _AllowListUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):  # noqa: D401 - pickle API
        if (module, name) not in ALLOWED_GLOBALS:
            raise TensorIPCError(
                f"serialized_named_tensors refers to {module}.{name}, which is not a tensor reduction; only "
                "ForkingPickler pickles of [(name, tensor), ...] are accepted"
            )
        return super().find_class(module, name)


def dumps_named_tensors(named: Sequence[tuple[str, torch.Tensor]]) -> str:
    """``[(name, tensor)]`` → base64 text of a ``ForkingPickler`` pickle (SGLang's ``MultiprocessingSerializer``
    format, ``output_str=True``). CUDA tensors travel as IPC handles, CPU tensors as named shared-memory
    segments (their storage is moved to shared memory once, in place)."""
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing as tmp

    buf = io.BytesIO()
    with _STRATEGY_LOCK:
        # CPU storages: shared by file name (any process of this host can map them), not by descriptor passing,
        # which only works between multiprocessing children of one parent (they share an auth key).
        before = tmp.get_sharing_strategy()
        if before != "file_system" and any(t.device.type == "cpu" for _, t in named):
            tmp.set_sharing_strategy("file_system")
        try:
            ForkingPickler(buf).dump([(str(n), t) for n, t in named])
        finally:
            tmp.set_sharing_strategy(before)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def loads_named_tensors(data: str | bytes) -> list[tuple[str, torch.Tensor]]:
    """Inverse of :func:`dumps_named_tensors`, with the allow-list unpickler; checks the result's shape.

    Raises :class:`TensorIPCError` naming what is wrong (bad base64, a forbidden global, not a list of
    ``(str, Tensor)`` pairs, a sender that is gone)."""
    import torch.multiprocessing  # noqa: F401 - the rebuild functions live there

    if isinstance(data, str):
        try:
            data = base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError) as e:
            raise TensorIPCError(f"serialized_named_tensors is not valid base64: {e}") from None
    try:
        obj = _AllowListUnpickler(io.BytesIO(data)).load()
    except TensorIPCError:
        raise
    except (pickle.UnpicklingError, EOFError, AttributeError, TypeError, IndexError, KeyError) as e:
        raise TensorIPCError(f"serialized_named_tensors could not be unpickled: {type(e).__name__}: {e}") from None
    except (OSError, RuntimeError, multiprocessing.AuthenticationError) as e:  # the sender's memory is gone
        raise TensorIPCError(
            f"the tensors of serialized_named_tensors could not be mapped (is the sending process alive and on "
            f"this host?): {type(e).__name__}: {e}"
        ) from None
    if not isinstance(obj, list) or not all(
        isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], str) and isinstance(x[1], torch.Tensor) for x in obj
    ):
        raise TensorIPCError("serialized_named_tensors must decode to a list of (name, tensor) pairs")
    return obj


__all__ = ["ALLOWED_GLOBALS", "TensorIPCError", "dumps_named_tensors", "loads_named_tensors"]
