"""Code reward: run the model's program against unit tests in the sandbox.

Two test formats, chosen per test:

- ``{"input": str, "output": str}`` — a stdin/stdout case; the program runs once per case and passes
  when its stdout equals ``output`` up to trailing whitespace on each line and trailing blank lines.
  The expected output never enters the sandbox; the comparison happens here.
- ``"assert f(2) == 4"`` — a statement about the program's top-level names. The verdicts cannot be forged:

  * the program runs in one sandbox (the *candidate*) and then serves its top-level names over a pair of
    pipes; the statements run in a second sandbox (the *tester*) that never runs a line of the program;
  * a name the statement uses (other than a builtin or a name it binds itself) is fetched from the
    candidate: plain data (None, bool, int, float, complex, str, bytes and list/tuple/dict/set/frozenset of
    those, exact types only) is copied, a module is imported afresh in the tester, anything else (functions,
    classes, instances, generators) becomes a proxy whose calls, attribute reads, iteration, ``len`` and
    indexing are forwarded; comparisons, ``bool`` and hashing of a proxy are the tester's own (identity),
    so an object with a rigged ``__eq__`` never compares equal;
  * the tester writes one ``i PASS|FAIL`` line per test to its own stdout, which only the harness reads
    (the statements' prints go to stderr). The candidate shares no process, file, fd or pid namespace with
    it, so reading a nonce, printing verdict lines or tampering with the interpreter gains nothing.

  Limits of the proxy: arguments sent to the program must be plain data or proxies (a test cannot pass
  its own lambda or class instance), and mutation of an argument inside the program is not visible to
  the test (arguments are copied).

Reward = fraction of tests passed (``mode="fraction"``) or 1.0 only when all pass (``mode="all"``).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from rlcore.rollout.rewards import sandbox

_BLOCK = re.compile(r"```(?:python|py|python3)?[^\n]*\n(.*?)```", re.DOTALL)


@dataclass(frozen=True)
class CodeRewardConfig:
    """How a program is scored."""

    mode: Literal["fraction", "all"] = "fraction"
    """fraction: passed/total; all: 1.0 only if every test passes."""
    sandbox: sandbox.SandboxConfig = field(default_factory=sandbox.SandboxConfig)
    """Limits of each sandboxed run (the candidate and the tester each get these limits)."""

    def __post_init__(self):
        if self.mode not in ("fraction", "all"):
            raise ValueError(f"mode must be 'fraction' or 'all', got {self.mode!r}")


def extract_code(completion: str) -> str:
    """The last fenced code block of the completion (```python ...```), else the whole text."""
    blocks = _BLOCK.findall(completion)
    return blocks[-1] if blocks else completion


def _same_output(got: str, want: str) -> bool:
    norm = lambda s: "\n".join(line.rstrip() for line in s.strip("\n").splitlines()).rstrip()  # noqa: E731
    return norm(got) == norm(want)


# The wire format shared by both sides: JSON lines; values are tagged lists (see _enc). Decoding accepts only
# the exact builtin types listed and handles; anything malformed raises, which fails the test that asked.
_CODEC = r'''
import json as _json

def _enc(x, handle, depth=0):
    if depth > 100:
        raise ValueError("value nested more than 100 deep")
    t = type(x)
    if x is None:
        return ["n"]
    if t is bool:
        return ["b", x]
    if t is int:
        return ["i", hex(x)]
    if t is float:
        return ["f", x.hex()]
    if t is complex:
        return ["c", x.real.hex(), x.imag.hex()]
    if t is str:
        return ["s", x]
    if t is bytes:
        return ["y", x.hex()]
    tag = {list: "l", tuple: "t", set: "S", frozenset: "F"}.get(t)
    if tag is not None:
        return [tag, [_enc(v, handle, depth + 1) for v in x]]
    if t is dict:
        return ["d", [[_enc(k, handle, depth + 1), _enc(v, handle, depth + 1)] for k, v in x.items()]]
    return handle(x)

def _dec(v, handle, depth=0):
    if depth > 100 or type(v) is not list or not v or type(v[0]) is not str:
        raise ValueError("malformed value")
    tag = v[0]
    if tag == "n":
        return None
    if tag == "b" and type(v[1]) is bool:
        return v[1]
    if tag == "i" and type(v[1]) is str:
        return int(v[1], 16)
    if tag == "f" and type(v[1]) is str:
        return float.fromhex(v[1])
    if tag == "c" and type(v[1]) is str and type(v[2]) is str:
        return complex(float.fromhex(v[1]), float.fromhex(v[2]))
    if tag == "s" and type(v[1]) is str:
        return v[1]
    if tag == "y" and type(v[1]) is str:
        return bytes.fromhex(v[1])
    if tag in ("l", "t", "S", "F") and type(v[1]) is list:
        items = [_dec(u, handle, depth + 1) for u in v[1]]
        return {"l": list, "t": tuple, "S": set, "F": frozenset}[tag](items)
    if tag == "d" and type(v[1]) is list:
        out = {}
        for kv in v[1]:
            if type(kv) is not list or len(kv) != 2:
                raise ValueError("malformed dict item")
            out[_dec(kv[0], handle, depth + 1)] = _dec(kv[1], handle, depth + 1)
        return out
    if tag in ("h", "m"):
        return handle(v)
    raise ValueError("malformed value")
'''

# Candidate side: runs after the program, in its interpreter (untrusted like the program itself).
_SERVER = _CODEC + r'''
import os as _os, types as _types
_objs = []
def _keep(x):
    _objs.append(x)
    if isinstance(x, _types.ModuleType):
        return ["m", len(_objs) - 1, str(getattr(x, "__name__", ""))]
    return ["h", len(_objs) - 1]
def _lookup(v):
    return _objs[v[1]]
def _send(msg):
    data = (_json.dumps(msg) + "\n").encode()
    while data:
        data = data[_os.write(_RESP_W, data):]
_send({"names": sorted(n for n in _main if not n.startswith("__"))})
for _line in _os.fdopen(_REQ_R, "rb"):
    try:
        _req = _json.loads(_line)
        _op = _req["op"]
        if _op == "get":
            _val = _main[_req["name"]]
        else:
            _obj = _objs[_req["h"]]
            if _op == "call":
                _val = _obj(*[_dec(a, _lookup) for a in _req["args"]],
                            **{k: _dec(a, _lookup) for k, a in _req["kwargs"].items()})
            elif _op == "getattr":
                _val = getattr(_obj, _req["name"])
            elif _op == "iter":
                _val = iter(_obj)
            elif _op == "next":
                _val = next(_obj)
            elif _op == "len":
                _val = len(_obj)
            elif _op == "getitem":
                _val = _obj[_dec(_req["key"], _lookup)]
            elif _op == "str":
                _val = str(_obj)
            else:
                raise ValueError("unknown op")
        _resp = {"v": _enc(_val, _keep)}
    except BaseException as _e:
        _resp = {"err": [type(_e).__name__, str(_e)[:500]]}
    _send(_resp)
'''

# Tester side: trusted; runs the test statements against proxies and writes verdicts to its stdout.
_TESTER = _CODEC + r'''
import ast, builtins, importlib, json, os, sys
_verdicts = os.fdopen(os.dup(1), "w", buffering=1)
os.dup2(2, 1)
_req = os.fdopen(_REQ_W, "wb", buffering=0)
_resp = os.fdopen(_RESP_R, "rb")

class RemoteError(Exception):
    """An exception raised by the program that is not a builtin exception type."""

def _exception(name, msg):
    cls = getattr(builtins, name, None) if type(name) is str else None
    if isinstance(cls, type) and issubclass(cls, Exception):
        return cls(msg)
    return RemoteError(f"{name}: {msg}")

def _recv():
    line = _resp.readline(1 << 26)
    if not line.endswith(b"\n"):
        raise RemoteError("the program closed the channel or sent an oversized reply")
    return json.loads(line)

def _to_wire(x):
    if type(x) is Remote:
        return ["h", object.__getattribute__(x, "_h")]
    raise TypeError(f"cannot pass a {type(x).__name__} to the program (plain data or its own objects only)")

def _from_wire(v):
    if type(v[1]) is not int:
        raise ValueError("malformed handle")
    if v[0] == "m" and len(v) == 3 and type(v[2]) is str and v[2]:
        try:
            return importlib.import_module(v[2])
        except Exception:
            pass
    return Remote(v[1])

def _rpc(op, **kw):
    _req.write((json.dumps(dict(kw, op=op)) + "\n").encode())
    msg = _recv()
    if type(msg) is not dict:
        raise RemoteError("malformed reply")
    if "err" in msg:
        e = msg["err"]
        raise _exception(e[0] if type(e) is list and e else None, str(e[1]) if type(e) is list and len(e) > 1 else "")
    return _dec(msg["v"], _from_wire)

class Remote:
    """A proxy of an object living in the program's process."""
    __slots__ = ("_h",)
    def __init__(self, h):
        object.__setattr__(self, "_h", h)
    def __call__(self, *args, **kwargs):
        return _rpc("call", h=self._h, args=[_enc(a, _to_wire) for a in args],
                    kwargs={str(k): _enc(v, _to_wire) for k, v in kwargs.items()})
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _rpc("getattr", h=object.__getattribute__(self, "_h"), name=name)
    def __iter__(self):
        it = _rpc("iter", h=self._h)
        return it if type(it) is Remote else builtins.iter(it)
    def __next__(self):
        return _rpc("next", h=self._h)
    def __len__(self):
        n = _rpc("len", h=self._h)
        if type(n) is not int:
            raise TypeError("len() of the program's object is not an int")
        return n
    def __getitem__(self, key):
        return _rpc("getitem", h=self._h, key=_enc(key, _to_wire))
    def __str__(self):
        s = _rpc("str", h=self._h)
        if type(s) is not str:
            raise TypeError("str() of the program's object is not a str")
        return s
    def __repr__(self):
        return f"<program object {self._h}>"

_tests = json.load(open("_tests.json", encoding="utf-8"))
try:
    _hello = _recv()
    _names = set(_hello["names"])
except Exception:
    _names = None
_g = {"__name__": "__test__", "__builtins__": builtins}  # shared: a test may use what an earlier one bound
for _i, _stmt in enumerate(_tests):
    _ok = False
    if _names is not None:
        try:
            _code = compile(_stmt, f"<test {_i}>", "exec")
            for _n in sorted({n.id for n in ast.walk(ast.parse(_stmt)) if isinstance(n, ast.Name)}):
                if _n in _names and _n not in _g and not hasattr(builtins, _n):
                    _g[_n] = _rpc("get", name=_n)
            exec(_code, _g)
            _ok = True
        except BaseException:
            _ok = False
    _verdicts.write(f"{_i} {'PASS' if _ok else 'FAIL'}\n")
'''


def _run_asserts(program: str, asserts: Sequence[str], cfg: sandbox.SandboxConfig) -> list[bool]:
    """Run the statements in a tester sandbox against the program served from a candidate sandbox."""
    req_r, req_w = os.pipe()
    resp_r, resp_w = os.pipe()
    fds = [req_r, req_w, resp_r, resp_w]
    quiet = subprocess.DEVNULL
    try:
        with sandbox.spawn(program, cfg=cfg, stdin=quiet, stdout=quiet, stderr=quiet, pass_fds=(req_r, resp_w),
                           epilogue=f"_REQ_R, _RESP_W = {req_r}, {resp_w}\n" + _SERVER) as candidate, \
             sandbox.spawn(f"_REQ_W, _RESP_R = {req_w}, {resp_r}\n" + _TESTER, cfg=cfg, stdin=quiet,
                           stdout=subprocess.PIPE, stderr=quiet, pass_fds=(req_w, resp_r),
                           files={"_tests.json": json.dumps(list(asserts))}) as tester:
            for fd in fds:
                os.close(fd)
            fds = []
            try:
                out, _ = tester.proc.communicate(timeout=max(tester.started + cfg.timeout_s - time.monotonic(), 0.01))
            except subprocess.TimeoutExpired:
                tester.kill()
                out, _ = tester.proc.communicate(timeout=5.0)
            candidate.kill()
            candidate.proc.wait()
            for box in (tester, candidate):
                if "error" in box.status():
                    raise sandbox.SandboxSetupError(box.status()["error"])
    finally:
        for fd in fds:
            os.close(fd)
    passed = {int(m.group(1)) for m in re.finditer(rb"^(\d+) PASS$", out or b"", re.M)}
    return [j in passed for j in range(len(asserts))]


def run_tests(program: str, tests: Sequence[str | Mapping[str, str]], cfg: CodeRewardConfig = CodeRewardConfig()
              ) -> list[bool]:
    """Pass/fail of each test, in order (see the module docstring for the two test formats)."""
    for i, t in enumerate(tests):
        if not isinstance(t, str) and (not isinstance(t, Mapping) or "input" not in t or "output" not in t):
            raise ValueError(f"test {i} must be an assert string or a mapping with 'input' and 'output', got {t!r}")
    verdict = [False] * len(tests)
    asserts = [(i, t) for i, t in enumerate(tests) if isinstance(t, str)]
    if asserts:
        for (i, _), ok in zip(asserts, _run_asserts(program, [t for _, t in asserts], cfg.sandbox)):
            verdict[i] = ok
    for i, t in enumerate(tests):
        if isinstance(t, str):
            continue
        res = sandbox.run_python(program, stdin=str(t["input"]), cfg=cfg.sandbox)
        verdict[i] = res.ok and _same_output(res.stdout, str(t["output"]))
    return verdict


def score(completion: str, tests: Sequence[str | Mapping[str, str]], cfg: CodeRewardConfig = CodeRewardConfig()
          ) -> float:
    """Reward of a completion against ``tests`` (0.0 for an empty test list)."""
    if not tests:
        return 0.0
    verdict = run_tests(extract_code(completion), tests, cfg)
    if cfg.mode == "all":
        return 1.0 if all(verdict) else 0.0
    return sum(verdict) / len(verdict)


def code_reward(completion: str, item: Mapping) -> float:
    """Workflow reward: ``score(completion, item["tests"])`` with the default config."""
    return score(completion, item["tests"])
