"""Tensors handed between processes of one host without copying them through Python objects.

SGLang's ``/update_weights_from_tensor`` carries, per tensor-parallel rank, one base64 string: a
``multiprocessing`` (``ForkingPickler``) pickle of ``[(name, tensor), ...]``. For a CUDA tensor the pickle holds a
CUDA IPC handle of its storage (the receiver maps the sender's memory and copies device-to-device); for a CPU
tensor it holds a file descriptor of a shared-memory segment, passed over a Unix socket. Only metadata crosses
HTTP; the bytes stay where they are.

The receiving side never unpickles a request body, not even with an allow-list: torch's rebuild functions are
gadgets of their own (a caller-chosen shared-memory manager socket aborts the process, a ``DupFd`` connects out
and blocks, a BUILD opcode patches classes). :func:`loads_named_tensors` reads the pickle's opcodes with a small
interpreter that only builds plain values (strings, bytes, numbers, tuples, lists) and records calls to the few
names torch's reductions emit without making them; it then checks the exact shapes of those calls and rebuilds
each tensor itself: a CPU tensor from a ``/dev/shm/torch_*`` file of this user (opened once with ``O_NOFOLLOW``,
checked with ``fstat``, mapped read-only), a CUDA tensor through torch's CUDA IPC rebuild with every field
validated first (device index, handle lengths, the reference-counter file and its offset). Descriptor passing
(torch's ``file_descriptor`` strategy) is not accepted: no file descriptor crosses, none can leak. The server
answers the endpoint only to a peer that holds the run key (:mod:`rlcore.inference.guard`) and decodes payloads
on a control worker, never on its event loop.

Lifetime: the sender must keep the tensors alive (and unmodified) until the receiver acknowledged the load;
:mod:`rlcore.training.weight_sync` keeps one flat buffer per model for this and reuses it every publish, so the
receiver maps each IPC handle once (torch caches mapped storages by handle).
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import io
import mmap
import os
import pickletools
import re
import stat
import struct
import threading
from collections.abc import Sequence
from typing import Any

import torch

SHM_DIR = "/dev/shm"
"""Where ``shm_open`` (torch's ``file_system`` sharing strategy) keeps its files on Linux."""
SHM_HEADER_BYTES = 64
"""torch's ``RefcountedMapAllocator`` keeps a reference count in the first 64 bytes of each file; data follows."""
CUDA_IPC_REF_COUNTER_FILE_SIZE = 10000
"""int64 counters in one of torch's CUDA IPC reference-counter files (``torch/csrc/CudaIPCTypes.h``)."""
MAX_TENSORS = 1 << 16
"""Most tensors one payload may name."""
MAX_STORAGES = 4096
"""Most distinct shared storages (files mapped, IPC handles opened) one payload may name."""
MAX_OPS = 1 << 22
"""Most pickle opcodes one payload may have."""
_SHM_NAME = re.compile(r"/torch_[0-9]+_[0-9]+(?:_[0-9]+)?")
"""A name torch's ``file_system`` strategy (and its CUDA IPC reference counters) gives a shared-memory file."""

_R = "torch.multiprocessing.reductions"
_DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name) for name in dir(torch) if isinstance(getattr(torch, name, None), torch.dtype)
}
ALLOWED_GLOBALS: frozenset[tuple[str, str]] = frozenset(
    {(_R, n) for n in ("rebuild_tensor", "rebuild_cuda_tensor", "rebuild_storage_filename", "rebuild_typed_storage")}
    | {("torch", "Tensor"), ("torch.nn.parameter", "Parameter"), ("torch", "Size")}
    | {("torch.storage", "UntypedStorage"), ("torch.storage", "TypedStorage"), ("torch", "UntypedStorage")}
    | {("torch", d) for d in _DTYPES}
)
"""``(module, name)`` pairs a payload may name: what torch's ``ForkingPickler`` reductions of CPU (``file_system``
strategy) and CUDA tensors emit. They are recorded, never resolved or called, by the interpreter."""

_STRATEGY_LOCK = threading.Lock()


class TensorIPCError(ValueError):
    """A serialized tensor payload that is malformed, names a global outside :data:`ALLOWED_GLOBALS`, or points at
    memory this process may not map."""


@dataclasses.dataclass(frozen=True, eq=False)
class _Global:
    module: str
    name: str


@dataclasses.dataclass(frozen=True, eq=False)
class _Call:
    fn: _Global
    args: tuple


_PUSH_ARG = frozenset({
    "BININT", "BININT1", "BININT2", "LONG1", "BINFLOAT", "SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8",
    "SHORT_BINBYTES", "BINBYTES", "BINBYTES8",
})
_PUSH_CONST = {"NONE": None, "NEWTRUE": True, "NEWFALSE": False}


def dumps_named_tensors(named: Sequence[tuple[str, torch.Tensor]]) -> str:
    """``[(name, tensor)]`` → base64 text of a ``ForkingPickler`` pickle (SGLang's ``MultiprocessingSerializer``
    format, ``output_str=True``). CUDA tensors travel as IPC handles, CPU tensors as named shared-memory
    segments (their storage is moved to shared memory once, in place).

    Each call counts one more reference on every CPU storage's file (torch's reduction does; a torch receiver gives
    it back when it maps the file, :func:`loads_named_tensors` maps it privately and does not): the file then lives
    until the sender's shared-memory manager exits. Publish from buffers kept for the run (as
    ``weight_sync.flat_publish_views`` does) so that this stays one file per buffer."""
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


def _global(module: Any, name: Any) -> _Global:
    if not isinstance(module, str) or not isinstance(name, str) or (module, name) not in ALLOWED_GLOBALS:
        raise TensorIPCError(
            f"serialized_named_tensors refers to {module}.{name}, which is not a tensor reduction; only "
            "ForkingPickler pickles of [(name, tensor), ...] (CPU tensors shared by file name, CUDA tensors by IPC "
            "handle) are accepted"
        )
    return _Global(module, name)


def _interpret(data: bytes) -> Any:
    """Run the pickle's opcodes on plain values only: globals become :class:`_Global` records (allow-listed), REDUCE
    becomes a :class:`_Call` record (``torch.Size`` of ints becomes a tuple); any opcode that would build an object,
    set state or look up an extension (BUILD, NEWOBJ, INST, OBJ, PERSID, EXT*, dict and set ops) is refused."""
    stack: list[Any] = []
    marks: list[int] = []
    memo: dict[int, Any] = {}

    def pop_mark() -> list[Any]:
        k = marks.pop()
        items = stack[k:]
        del stack[k:]
        return items

    for n, (op, arg, _) in enumerate(pickletools.genops(data)):
        if n >= MAX_OPS:
            raise TensorIPCError(f"serialized_named_tensors has more than {MAX_OPS} pickle opcodes")
        name = op.name
        if name in ("PROTO", "FRAME"):
            continue
        if name == "STOP":
            if len(stack) != 1 or marks:
                raise TensorIPCError("serialized_named_tensors is not one pickled object")
            return stack[0]
        if name in _PUSH_ARG:
            stack.append(arg)
        elif name in _PUSH_CONST:
            stack.append(_PUSH_CONST[name])
        elif name == "EMPTY_LIST":
            stack.append([])
        elif name == "EMPTY_TUPLE":
            stack.append(())
        elif name == "MARK":
            marks.append(len(stack))
        elif name == "TUPLE":
            stack.append(tuple(pop_mark()))
        elif name in ("TUPLE1", "TUPLE2", "TUPLE3"):
            k = int(name[-1])
            if len(stack) < k:
                raise TensorIPCError("serialized_named_tensors: a tuple opcode with too few items")
            items = tuple(stack[-k:])
            del stack[-k:]
            stack.append(items)
        elif name == "LIST":
            stack.append(pop_mark())
        elif name in ("APPEND", "APPENDS"):
            items = [stack.pop()] if name == "APPEND" else pop_mark()
            if not stack or not isinstance(stack[-1], list):
                raise TensorIPCError("serialized_named_tensors: APPEND to something that is not a list")
            stack[-1].extend(items)
        elif name == "MEMOIZE":
            memo[len(memo)] = stack[-1]
        elif name in ("BINPUT", "LONG_BINPUT"):
            memo[int(arg)] = stack[-1]
        elif name in ("BINGET", "LONG_BINGET"):
            stack.append(memo[int(arg)])
        elif name == "STACK_GLOBAL":
            gname, module = stack.pop(), stack.pop()
            stack.append(_global(module, gname))
        elif name == "GLOBAL":
            module, _, gname = str(arg).partition(" ")
            stack.append(_global(module, gname))
        elif name == "REDUCE":
            args, fn = stack.pop(), stack.pop()
            if not isinstance(fn, _Global) or not isinstance(args, tuple):
                raise TensorIPCError("serialized_named_tensors: REDUCE of something that is not an allowed call")
            if (fn.module, fn.name) == ("torch", "Size"):
                if len(args) != 1 or not _ints(args[0]):
                    raise TensorIPCError("serialized_named_tensors: torch.Size of something that is not ints")
                stack.append(tuple(args[0]))
            else:
                stack.append(_Call(fn, args))
        else:
            raise TensorIPCError(
                f"serialized_named_tensors uses the pickle opcode {name}, which a tensor payload never needs; "
                "only ForkingPickler pickles of [(name, tensor), ...] are accepted"
            )
    raise TensorIPCError("serialized_named_tensors ends without a STOP opcode")


def _ints(x: Any) -> bool:
    return isinstance(x, tuple) and all(type(v) is int and v >= 0 for v in x)


def _is(x: Any, module: str, name: str) -> bool:
    return isinstance(x, _Global) and (x.module, x.name) == (module, name)


def _untyped(x: Any) -> bool:
    return _is(x, "torch.storage", "UntypedStorage") or _is(x, "torch", "UntypedStorage")


def _dtype(x: Any, where: str) -> torch.dtype:
    if not isinstance(x, _Global) or x.module != "torch" or x.name not in _DTYPES:
        raise TensorIPCError(f"serialized_named_tensors: {where} is not a torch dtype")
    return _DTYPES[x.name]


def _tensor_class(x: Any, where: str) -> None:
    if not (_is(x, "torch", "Tensor") or _is(x, "torch.nn.parameter", "Parameter")):
        raise TensorIPCError(f"serialized_named_tensors: {where} is not torch.Tensor or Parameter")


def _check_view(name: str, size: Any, stride: Any, offset: Any, numel: int) -> None:
    """Raise unless ``(size, stride, offset)`` (elements) stays inside a storage of ``numel`` elements."""
    if not (_ints(size) and _ints(stride) and len(size) == len(stride) and type(offset) is int and offset >= 0):
        raise TensorIPCError(f"serialized_named_tensors: tensor {name!r} has a malformed size, stride or offset")
    if len(size) > 64:
        raise TensorIPCError(f"serialized_named_tensors: tensor {name!r} has {len(size)} dimensions")
    if all(s > 0 for s in size):
        last = offset + sum((s - 1) * st for s, st in zip(size, stride))
        if last >= numel:
            raise TensorIPCError(
                f"serialized_named_tensors: tensor {name!r} reaches element {last} of a storage of {numel}"
            )


def _open_shm(handle: Any, what: str, min_bytes: int) -> int:
    """An open descriptor of the shared-memory file ``handle`` names, checked: a torch name, a regular file of
    this user (opened with O_NOFOLLOW | O_NONBLOCK, checked by ``fstat`` of the open descriptor), at least
    ``min_bytes`` long. The caller closes it."""
    try:
        name = handle.decode("ascii") if isinstance(handle, bytes) else None
    except UnicodeDecodeError:
        name = None
    if name is None or not _SHM_NAME.fullmatch(name):
        raise TensorIPCError(f"serialized_named_tensors: {what} {handle!r} is not a torch shared-memory name")
    try:
        fd = os.open(SHM_DIR + name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise TensorIPCError(
            f"serialized_named_tensors: {what} {name!r} cannot be opened ({e.strerror}); is the sending process "
            "alive and on this host?"
        ) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise TensorIPCError(f"serialized_named_tensors: {what} {name!r} is not a regular file")
        if st.st_uid != os.geteuid():
            raise TensorIPCError(
                f"serialized_named_tensors: {what} {name!r} belongs to uid {st.st_uid}, not to this server's "
                f"uid {os.geteuid()}; only the server's own user may hand it tensors"
            )
        if st.st_size < min_bytes:
            raise TensorIPCError(
                f"serialized_named_tensors: {what} {name!r} has {st.st_size} bytes, fewer than the {min_bytes} named"
            )
    except BaseException:
        os.close(fd)
        raise
    return fd


def _map_cpu_storage(handle: Any, nbytes: Any) -> torch.Tensor:
    """The bytes of a CPU storage shared by file name, as a ``uint8`` tensor over a private read mapping."""
    if type(nbytes) is not int or nbytes <= 0:
        raise TensorIPCError(f"serialized_named_tensors: storage size {nbytes!r} is not a positive int")
    fd = _open_shm(handle, "storage", SHM_HEADER_BYTES + nbytes)
    try:
        mm = mmap.mmap(fd, SHM_HEADER_BYTES + nbytes, access=mmap.ACCESS_COPY)
    finally:
        os.close(fd)
    return torch.frombuffer(mm, dtype=torch.uint8, offset=SHM_HEADER_BYTES, count=nbytes)


def _cpu_tensor(name: str, args: tuple, storages: dict[bytes, torch.Tensor]) -> torch.Tensor:
    if len(args) != 3:
        raise TensorIPCError(f"serialized_named_tensors: tensor {name!r}: rebuild_tensor takes 3 arguments")
    cls, typed, meta = args
    _tensor_class(cls, f"the class of {name!r}")
    if not (isinstance(typed, _Call) and _is(typed.fn, _R, "rebuild_typed_storage") and len(typed.args) == 2):
        raise TensorIPCError(f"serialized_named_tensors: tensor {name!r}'s storage is not a typed shared storage")
    raw, dt = typed.args
    dtype = _dtype(dt, f"the dtype of {name!r}")
    by_name = isinstance(raw, _Call) and _is(raw.fn, _R, "rebuild_storage_filename") and len(raw.args) == 4
    if not (by_name and _untyped(raw.args[0])):
        raise TensorIPCError(
            f"serialized_named_tensors: tensor {name!r} is not shared by file name (torch's file_system strategy; "
            "tensor_ipc.dumps_named_tensors uses it); descriptor passing is not accepted"
        )
    _, _manager, handle, nbytes = raw.args  # the sender's manager socket is never contacted
    if not isinstance(handle, bytes):
        raise TensorIPCError(f"serialized_named_tensors: tensor {name!r}'s storage handle is not bytes")
    if handle not in storages:
        if len(storages) >= MAX_STORAGES:
            raise TensorIPCError(f"serialized_named_tensors names more than {MAX_STORAGES} storages")
        storages[handle] = _map_cpu_storage(handle, nbytes)
    u8 = storages[handle]
    if u8.numel() != nbytes:
        raise TensorIPCError(f"serialized_named_tensors: storage {handle!r} is named with two sizes")
    if not (isinstance(meta, tuple) and len(meta) == 4 and isinstance(meta[3], bool)):
        raise TensorIPCError(f"serialized_named_tensors: tensor {name!r} has malformed metadata")
    offset, size, stride, _ = meta
    item = torch.empty((), dtype=dtype).element_size()
    if nbytes % item:
        raise TensorIPCError(f"serialized_named_tensors: storage of {name!r} is not a whole number of {dtype}")
    _check_view(name, size, stride, offset, nbytes // item)
    return torch.as_strided(u8.view(dtype), size, stride, offset)


def _cuda_tensor(name: str, args: tuple) -> torch.Tensor:
    """Rebuild a CUDA tensor through torch's own IPC rebuild, after checking every field it trusts."""
    if len(args) != 15:
        raise TensorIPCError(f"serialized_named_tensors: tensor {name!r}: rebuild_cuda_tensor takes 15 arguments")
    (cls, size, stride, offset, storage_cls, dt, device, handle, storage_bytes, storage_offset, requires_grad,
     rc_handle, rc_offset, event_handle, event_sync) = args
    _tensor_class(cls, f"the class of {name!r}")
    if not (_is(storage_cls, "torch.storage", "TypedStorage") or _untyped(storage_cls)):
        raise TensorIPCError(f"serialized_named_tensors: tensor {name!r}'s storage class is not a torch storage")
    dtype = _dtype(dt, f"the dtype of {name!r}")
    if not torch.cuda.is_available():
        raise TensorIPCError(f"serialized_named_tensors: tensor {name!r} is a CUDA tensor but this server has no GPU")
    if type(device) is not int or not 0 <= device < torch.cuda.device_count():
        raise TensorIPCError(f"serialized_named_tensors: tensor {name!r} names CUDA device {device!r}")
    for v, what in ((handle, "IPC handle"), (event_handle, "event handle")):
        if not (isinstance(v, bytes) and 0 < len(v) <= 4096) and not (what == "event handle" and v is None):
            raise TensorIPCError(f"serialized_named_tensors: tensor {name!r} has a malformed {what}")
    for v, what in ((storage_bytes, "storage size"), (storage_offset, "storage offset"), (rc_offset, "counter offset")):
        if type(v) is not int or v < 0:
            raise TensorIPCError(f"serialized_named_tensors: tensor {name!r} has a malformed {what} {v!r}")
    if not (isinstance(requires_grad, bool) and isinstance(event_sync, bool)):
        raise TensorIPCError(f"serialized_named_tensors: tensor {name!r} has malformed flags")
    if rc_offset >= CUDA_IPC_REF_COUNTER_FILE_SIZE:
        raise TensorIPCError(f"serialized_named_tensors: tensor {name!r}'s counter offset {rc_offset} is out of range")
    # torch maps the counter file by name and writes at rc_offset: check it is one of ours and long enough first
    os.close(_open_shm(rc_handle, "reference counter", 8 * CUDA_IPC_REF_COUNTER_FILE_SIZE))
    item = torch.empty((), dtype=dtype).element_size()
    _check_view(name, size, stride, offset, storage_bytes // item)
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    return rebuild_cuda_tensor(torch.Tensor, torch.Size(size), tuple(stride), offset, torch.storage.TypedStorage,
                               dtype, device, handle, storage_bytes, storage_offset, False, rc_handle, rc_offset,
                               event_handle, event_sync)


def loads_named_tensors(data: str | bytes) -> list[tuple[str, torch.Tensor]]:
    """Inverse of :func:`dumps_named_tensors`, without unpickling: the payload's opcodes are read as data
    (:func:`_interpret`), the calls torch's reductions would make are checked field by field, and each tensor is
    rebuilt here (see the module docstring). Blocking (files are opened and mapped): call it off an event loop.

    Returns ``[(name, tensor)]`` in payload order; each tensor shares the sender's memory (read-only for CPU
    tensors). Raises :class:`TensorIPCError` naming what is wrong (bad base64, a forbidden global or opcode, not a
    non-empty list of ``(str, tensor)`` pairs, memory that is gone or not this user's)."""
    if isinstance(data, str):
        try:
            data = base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError) as e:
            raise TensorIPCError(f"serialized_named_tensors is not valid base64: {e}") from None
    try:
        obj = _interpret(data)
    except TensorIPCError:
        raise
    except (ValueError, IndexError, KeyError, TypeError, EOFError, struct.error, UnicodeDecodeError) as e:
        raise TensorIPCError(
            f"serialized_named_tensors could not be parsed as a pickle: {type(e).__name__}: {e}"
        ) from None
    if not isinstance(obj, list) or not all(
        isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], str) and isinstance(x[1], _Call) for x in obj
    ):
        raise TensorIPCError("serialized_named_tensors must decode to a list of (name, tensor) pairs")
    if not obj:
        raise TensorIPCError("serialized_named_tensors holds no tensors; send at least one (name, tensor) pair")
    if len(obj) > MAX_TENSORS:
        raise TensorIPCError(f"serialized_named_tensors holds {len(obj)} tensors, more than {MAX_TENSORS}")
    storages: dict[bytes, torch.Tensor] = {}
    out = []
    cuda_handles: set[tuple[bytes, int]] = set()
    try:
        for name, call in obj:
            if _is(call.fn, _R, "rebuild_tensor"):
                out.append((name, _cpu_tensor(name, call.args, storages)))
            elif _is(call.fn, _R, "rebuild_cuda_tensor"):
                key = (call.args[7], call.args[9]) if len(call.args) == 15 else (b"", 0)
                if key not in cuda_handles and len(cuda_handles) >= MAX_STORAGES:
                    raise TensorIPCError(f"serialized_named_tensors names more than {MAX_STORAGES} storages")
                cuda_handles.add(key)
                out.append((name, _cuda_tensor(name, call.args)))
            else:
                raise TensorIPCError(f"serialized_named_tensors: {name!r} is not a tensor")
    except TensorIPCError:
        raise
    except (OSError, RuntimeError, ValueError, TypeError) as e:  # mapping failed: the sender's memory is gone
        raise TensorIPCError(
            f"the tensors of serialized_named_tensors could not be mapped (is the sending process alive and on "
            f"this host?): {type(e).__name__}: {e}"
        ) from None
    return out


__all__ = ["ALLOWED_GLOBALS", "TensorIPCError", "dumps_named_tensors", "loads_named_tensors"]
