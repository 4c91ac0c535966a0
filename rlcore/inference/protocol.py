"""Data types shared by the engine, its HTTP server, the client and the rollout system.

These mirror the SGLang-native protocol (design docs/spec/system.md §1.2, §4, outside this repository) so that
the same rollout code runs against the embedded engine, our HTTP server and a real SGLang server.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import itertools
import json
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any, Literal

StopReason = Literal["stop", "length", "abort", "tool_calls"]


def _new_rid_source() -> tuple[str, itertools.count]:
    return os.urandom(8).hex(), itertools.count()


_RID_PREFIX, _RID_COUNT = _new_rid_source()


def new_rid() -> str:
    """A fresh request id: 32 lowercase hex characters, like ``uuid.uuid4().hex`` (what it replaces), made of a
    random 64-bit prefix drawn once per process (``os.urandom``) and a 64-bit counter. Unique within the process and,
    with the prefix, across processes and restarts; about ten times cheaper than a ``uuid4``, which reads the OS's
    random source (a system call that also drops the GIL) on every request."""
    return f"{_RID_PREFIX}{next(_RID_COUNT):016x}"


def _reseed_rids() -> None:
    global _RID_PREFIX, _RID_COUNT
    _RID_PREFIX, _RID_COUNT = _new_rid_source()


if hasattr(os, "register_at_fork"):  # a forked child draws its own prefix (spawned ones import afresh)
    os.register_at_fork(after_in_child=_reseed_rids)


@dataclass(frozen=True)
class SamplingParams:
    """Sampling settings of one request (SGLang's ``sampling_params``)."""

    max_new_tokens: int = 256
    """Maximum number of tokens to generate for this request."""
    temperature: float = 1.0
    """Softmax temperature; 0 means greedy decoding."""
    top_p: float = 1.0
    """Nucleus sampling mass, in (0, 1]."""
    top_k: int = -1
    """Keep the k most likely tokens; -1 (or >= vocab) keeps all."""
    stop_token_ids: tuple[int, ...] = ()
    """Generation stops after emitting any of these ids (the stop token is returned)."""
    ignore_eos: bool = False
    """Do not stop on the model's eos token."""
    seed: int | None = None
    """Per-request sampling seed (SGLang's ``sampling_seed``)."""
    stop: tuple[str, ...] = ()
    """Stop strings: generation ends once the decoded output contains one (needs the engine's tokenizer). The
    tokens are all returned; the server's ``text`` is cut before the match unless ``no_stop_trim``."""
    no_stop_trim: bool = False
    """Keep the matched stop string at the end of the returned ``text`` (SGLang's ``no_stop_trim``)."""
    min_new_tokens: int = 0
    """The eos ids and ``stop_token_ids`` cannot be sampled before this many tokens (logits set to -inf)."""
    frequency_penalty: float = 0.0
    """OpenAI rule, in [-2, 2]: subtract ``frequency_penalty * count`` from each generated token's logit."""
    presence_penalty: float = 0.0
    """OpenAI rule, in [-2, 2]: subtract ``presence_penalty`` from the logit of every generated token."""
    repetition_penalty: float = 1.0
    """CTRL rule, > 0 (1 = off): the logit of a token generated so far is divided by it when positive and
    multiplied by it otherwise. Penalties change the sampling distribution: RL should leave all three off."""
    min_p: float = 0.0
    """In [0, 1] (0 = off): drop tokens whose probability is below ``min_p`` times the most likely token's."""
    logit_bias: tuple[tuple[int, float], ...] = ()
    """``(token id, bias)`` pairs added to the logits before sampling (OpenAI's ``logit_bias``; -100 bans)."""
    stop_regex: tuple[str, ...] = ()
    """Regular expressions: generation ends once the decoded output matches one (``re.search``); the matched text
    is ``finish_reason.matched`` and the server's ``text`` is cut before it unless ``no_stop_trim``."""
    top_logprobs_num: int = 0
    """Report the ``k`` most likely tokens of every generated position (SGLang's top-level ``top_logprobs_num``,
    not one of its ``sampling_params``): ``GenerateOutput.output_top_logprobs``."""
    grammar: tuple[str, str] | None = None
    """Constrained decoding: ``(kind, spec)``, kind one of ``grammar.KINDS`` (``regex``, ``json_schema``, ``ebnf``,
    ``json_object``); needs xgrammar (``rlcore[grammar]``)."""
    token_ids_logprob: tuple[int, ...] = ()
    """Report these tokens' log-probs at every generated position (SGLang's top-level ``token_ids_logprob``):
    ``GenerateOutput.output_token_ids_logprobs``."""

    def to_sglang(self) -> dict:
        """The ``sampling_params`` JSON object SGLang's /generate expects."""
        d = {
            "max_new_tokens": int(self.max_new_tokens),
            "temperature": float(self.temperature),
            "top_p": float(self.top_p),
            "top_k": int(self.top_k),
            "stop_token_ids": [int(t) for t in self.stop_token_ids],
            "ignore_eos": bool(self.ignore_eos),
            "skip_special_tokens": False,
        }
        if self.seed is not None:
            d["sampling_seed"] = int(self.seed)
        # Newer fields are sent only when set, so the JSON of existing callers is unchanged.
        if self.stop:
            d["stop"] = [self.stop] if isinstance(self.stop, str) else [str(s) for s in self.stop]
        if self.no_stop_trim:
            d["no_stop_trim"] = True
        if self.min_new_tokens:
            d["min_new_tokens"] = int(self.min_new_tokens)
        if self.frequency_penalty:
            d["frequency_penalty"] = float(self.frequency_penalty)
        if self.presence_penalty:
            d["presence_penalty"] = float(self.presence_penalty)
        if self.repetition_penalty != 1.0:
            d["repetition_penalty"] = float(self.repetition_penalty)
        if self.min_p:
            d["min_p"] = float(self.min_p)
        if self.logit_bias:
            d["logit_bias"] = {str(t): float(b) for t, b in self.logit_bias}
        if self.stop_regex:
            d["stop_regex"] = list(self.stop_regex)
        if self.grammar is not None:
            kind, spec = self.grammar
            d["json_schema" if kind == "json_object" else kind] = '{"type": "object"}' if kind == "json_object" else spec
        # top_logprobs_num / token_ids_logprob are top-level /generate fields in SGLang, never sampling_params
        return d


@dataclass
class GenerateOutput:
    """Result of one request; the three ``output_*`` lists have one entry per generated token."""

    rid: str
    input_ids: list[int]
    output_ids: list[int]
    output_logprobs: list[float]
    output_versions: list[int]
    finish_reason: dict
    """SGLang shape: ``{"type": "stop", "matched": id}``, ``{"type": "length", "length": n}`` or
    ``{"type": "abort", "message": str}``."""
    weight_version: int = 0
    """Engine version when the request finished."""
    latency: float = 0.0
    ttft: float = 0.0
    output_top_logprobs: list[list[tuple[int, float]]] | None = None
    """With ``top_logprobs_num = k``: per generated token, its ``k`` most likely ``(token id, log-prob)`` pairs
    (descending) under the distribution it was drawn from, the one ``output_logprobs`` reports; else None."""
    cached_tokens: int = 0
    """Prompt tokens served from the prefix cache (``EngineConfig.prefix_cache``) instead of prefilled."""
    output_token_ids_logprobs: list[list[float]] | None = None
    """With ``token_ids_logprob``: per generated token, those tokens' log-probs under the same distribution."""


class EngineError(ValueError):
    """Bad input to the engine; the message names the offending field and the fix."""


class EngineBusy(EngineError):
    """The engine cannot take more work now (a full waiting queue, a busy control slot): retry later (503)."""


@dataclass
class ModelRequest:
    """One generation request at the rollout level (n_samples is always 1 here)."""

    input_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    rid: str = field(default_factory=new_rid)
    max_tokens: int | None = None
    """Optional cap on prompt + completion length."""
    metadata: dict = field(default_factory=dict)


@dataclass
class ModelResponse:
    """What ``agenerate`` returns: one entry per output token in each list."""

    input_tokens: list[int]
    output_tokens: list[int]
    output_logprobs: list[float]
    output_versions: list[int]
    stop_reason: StopReason
    latency: float = 0.0
    ttft: float = 0.0

    @property
    def output_len(self) -> int:
        return len(self.output_tokens)

    @property
    def head_version(self) -> int:
        return min(self.output_versions) if self.output_versions else -1

    @property
    def tail_version(self) -> int:
        return max(self.output_versions) if self.output_versions else -1


def parallel_sampling(sp: SamplingParams, n: int) -> list[SamplingParams]:
    """The ``n`` per-sample settings of one prompt: sample ``j`` gets seed ``seed + j`` (wrapped to int64)
    when the request has a seed, else none (the engine draws a fresh one per sample)."""
    if sp.seed is None or n == 1:
        return [sp] * n
    return [
        dataclasses.replace(sp, seed=((sp.seed + j + (1 << 63)) % (1 << 64)) - (1 << 63)) for j in range(n)
    ]


# ----------------------------------------------------------------------------------------------------------------
# SGLang JSON -> SamplingParams (the server's parsing; ``SamplingParams.to_sglang`` is the other direction)

MAX_N = 128
"""Most samples per prompt (``sampling_params.n`` on /generate, ``n`` on the OpenAI routes)."""


class BadRequest(ValueError):
    """A malformed request; the message names the field and the fix."""



def json_int(x: Any, name: str, lo: int | None = None) -> int:
    if type(x) is int and (lo is None or x >= lo):  # the common case first (bool is not type int)
        return x
    if (
        isinstance(x, bool)
        or not isinstance(x, (int, float))
        or (isinstance(x, float) and not x.is_integer())
    ):
        raise BadRequest(f"{name} must be an integer, got {x!r}")
    if lo is not None and x < lo:
        raise BadRequest(f"{name} must be >= {lo}, got {x!r}")
    return int(x)


def json_float(x: Any, name: str) -> float:
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(float(x)):
        raise BadRequest(f"{name} must be a finite number, got {x!r}")
    return float(x)


def json_ids(x: Any, name: str) -> list[int]:
    if not isinstance(x, list) or not x:
        raise BadRequest(f"{name} must be a non-empty list of token ids")
    if _all_ints(x) and min(x) >= 0:  # every id a plain int: what the loop below would return, without its names
        return list(x)
    return [json_int(t, f"{name}[{i}]", 0) for i, t in enumerate(x)]


def _all_ints(x: list) -> bool:
    """Every element is exactly an ``int`` (not a bool, float or subclass)."""
    return all(t is int for t in set(map(type, x)))


def json_version(x: Any, name: str) -> int | None:
    """A weight version: an integer (or integer string) in ``[0, 2**63)``, as every token it labels is stored in an
    int64 tensor by training (and -1 marks prompt tokens there); None when absent."""
    if x is None:
        return None
    if isinstance(x, str):
        try:
            v = int(x)
        except ValueError:
            raise BadRequest(f"{name} must be an integer (or an integer string), got {x!r}") from None
    else:
        v = json_int(x, name)
    if not 0 <= v <= _INT64_MAX:
        raise BadRequest(f"{name} must be in [0, 2**63) (token versions are int64 in training), got {x!r}")
    return v


SGLANG_SAMPLING_KEYS = frozenset({
    "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k", "min_p",
    "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n", "json_schema", "regex",
    "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim",
    "stream_interval", "logit_bias", "sampling_seed", "custom_params", "beam_width", "watermark", "choice",
})
"""SGLang's ``sampling_params`` fields (``sglang.api.v1.SamplingParams``, 0.5.23, which refuses any other key;
0.5.4's ``SamplingParams(**sampling_params)`` raised on one too). ``seed`` is accepted as rlcore's alias of
``sampling_seed``."""
_SAMPLING_ALIASES = {"max_tokens": "max_new_tokens", "max_completion_tokens": "max_new_tokens",
                     "min_tokens": "min_new_tokens", "stop_sequences": "stop"}


def _check_sampling_keys(sp: dict) -> None:
    """An unknown key is a 400 naming it (a typo such as ``max_tokens`` would otherwise run to the context end)."""
    for key in sp:
        if key in SGLANG_SAMPLING_KEYS or key == "seed":
            continue
        hint = _SAMPLING_ALIASES.get(key) or next(iter(difflib.get_close_matches(str(key), SGLANG_SAMPLING_KEYS, 1)),
                                                  None)
        raise BadRequest(
            f"sampling_params.{key} is not an SGLang sampling parameter"
            + (f"; did you mean {hint}?" if hint else f"; use one of {sorted(SGLANG_SAMPLING_KEYS)}")
        )
    if sp.get("beam_width") not in (None, 0, 1):
        raise BadRequest("sampling_params.beam_width: beam search is not supported by the embedded engine; omit it")
    if sp.get("choice"):
        raise BadRequest("sampling_params.choice: constrained decoding is not supported by the embedded engine")
    if isinstance(sp.get("watermark"), dict) and sp["watermark"].get("enabled"):
        raise BadRequest("sampling_params.watermark is not supported by the embedded engine; omit it")
    if sp.get("custom_params"):
        raise BadRequest("sampling_params.custom_params: custom logit processors do not run in the embedded engine; "
                         "omit it")
    if sp.get("stream_interval") not in (None, 1):
        raise BadRequest("sampling_params.stream_interval: the engine streams every token (1); omit it or send 1")
    if sp.get("spaces_between_special_tokens") is False:
        raise BadRequest("sampling_params.spaces_between_special_tokens: false is not supported (text is decoded "
                         "by the tokenizer's own rule); omit it")


def parse_sampling_params(sp: Any) -> SamplingParams:
    """SGLang ``sampling_params`` JSON -> ``SamplingParams``; a key SGLang does not know is a 400 (as in SGLang)."""
    if sp is None:
        sp = {}
    if not isinstance(sp, dict):
        raise BadRequest("sampling_params must be a JSON object")
    _check_sampling_keys(sp)
    kw: dict[str, Any] = {}
    if "max_new_tokens" in sp and sp["max_new_tokens"] is not None:
        kw["max_new_tokens"] = json_int(sp["max_new_tokens"], "sampling_params.max_new_tokens", 0)
    if "temperature" in sp and sp["temperature"] is not None:
        kw["temperature"] = json_float(sp["temperature"], "sampling_params.temperature")
        if kw["temperature"] < 0:
            raise BadRequest("sampling_params.temperature must be >= 0 (0 means greedy)")
    if "top_p" in sp and sp["top_p"] is not None:
        kw["top_p"] = json_float(sp["top_p"], "sampling_params.top_p")
        if not 0 < kw["top_p"] <= 1:
            raise BadRequest("sampling_params.top_p must be in (0, 1]")
    if "top_k" in sp and sp["top_k"] is not None:
        k = json_int(sp["top_k"], "sampling_params.top_k")
        if k == 0 or k < -1:
            raise BadRequest("sampling_params.top_k must be -1 (off) or >= 1")
        kw["top_k"] = k
    if sp.get("stop_token_ids") is not None:
        st = sp["stop_token_ids"]
        if not isinstance(st, list):
            raise BadRequest("sampling_params.stop_token_ids must be a list of token ids")
        if _all_ints(st) and (not st or min(st) >= 0):
            kw["stop_token_ids"] = tuple(st)
        else:
            kw["stop_token_ids"] = tuple(json_int(t, "sampling_params.stop_token_ids[]", 0) for t in st)
    for key in ("max_new_tokens", "min_new_tokens", "stop_token_ids"):
        vals = kw.get(key, ())
        for v in vals if isinstance(vals, tuple) else (vals,):
            if v > _INT64_MAX:
                raise BadRequest(f"sampling_params.{key} must fit in a signed 64-bit integer, got {v}")
    if "ignore_eos" in sp and sp["ignore_eos"] is not None:
        if not isinstance(sp["ignore_eos"], bool):
            raise BadRequest("sampling_params.ignore_eos must be true or false")
        kw["ignore_eos"] = sp["ignore_eos"]
    seed = sp.get("sampling_seed", sp.get("seed"))
    if seed is not None:
        kw["seed"] = json_int(seed, "sampling_params.sampling_seed")
        if not -(1 << 63) <= kw["seed"] < (1 << 63):
            raise BadRequest("sampling_params.sampling_seed must fit in a signed 64-bit integer")
    stop = sp.get("stop")
    if stop is not None:
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list) or not all(isinstance(x, str) and x for x in stops):
            raise BadRequest("sampling_params.stop must be a non-empty string or a list of non-empty strings")
        kw["stop"] = tuple(stops)
    if sp.get("structural_tag") is not None:
        raise BadRequest("sampling_params.structural_tag is not supported by the embedded engine; use regex, "
                         "json_schema or ebnf")
    given = [k for k in ("regex", "json_schema", "ebnf") if sp.get(k) is not None]
    if len(given) > 1:
        raise BadRequest(f"sampling_params: give one of regex, json_schema and ebnf, got {given}")
    if given:
        kw["grammar"] = parse_grammar(given[0], sp[given[0]], f"sampling_params.{given[0]}")
    if sp.get("min_p") is not None:
        kw["min_p"] = json_float(sp["min_p"], "sampling_params.min_p")
        if not 0 <= kw["min_p"] <= 1:
            raise BadRequest("sampling_params.min_p must be in [0, 1] (0 = off)")
    if sp.get("logit_bias") is not None:
        kw["logit_bias"] = parse_logit_bias(sp["logit_bias"], "sampling_params.logit_bias")
    for key in ("skip_special_tokens", "spaces_between_special_tokens"):
        if sp.get(key) is not None and not isinstance(sp[key], bool):
            raise BadRequest(f"sampling_params.{key} must be true or false")
    if sp.get("stop_regex") is not None:
        kw["stop_regex"] = parse_stop_regex(sp["stop_regex"], "sampling_params.stop_regex")
    if sp.get("no_stop_trim") is not None:
        if not isinstance(sp["no_stop_trim"], bool):
            raise BadRequest("sampling_params.no_stop_trim must be true or false")
        kw["no_stop_trim"] = sp["no_stop_trim"]
    if sp.get("min_new_tokens") is not None:
        kw["min_new_tokens"] = json_int(sp["min_new_tokens"], "sampling_params.min_new_tokens", 0)
        if kw["min_new_tokens"] > kw.get("max_new_tokens", SamplingParams.max_new_tokens):
            raise BadRequest("sampling_params.min_new_tokens must be <= max_new_tokens")
    for key in ("frequency_penalty", "presence_penalty"):
        if sp.get(key) is not None:
            kw[key] = json_float(sp[key], f"sampling_params.{key}")
            if not -2 <= kw[key] <= 2:
                raise BadRequest(f"sampling_params.{key} must be in [-2, 2] (0 = off)")
    if sp.get("repetition_penalty") is not None:
        kw["repetition_penalty"] = json_float(sp["repetition_penalty"], "sampling_params.repetition_penalty")
        if kw["repetition_penalty"] <= 0:
            raise BadRequest("sampling_params.repetition_penalty must be > 0 (1 = off)")
    parse_n(sp)
    return SamplingParams(**kw)


_INT64_MAX = (1 << 63) - 1


def parse_logit_bias(x: Any, name: str) -> tuple[tuple[int, float], ...]:
    """OpenAI's / SGLang's ``logit_bias``: ``{"token id": bias}`` (keys are token-id strings, as JSON keys must be)
    -> sorted ``(id, bias)`` pairs. Biases must lie in OpenAI's [-100, 100]."""
    if not isinstance(x, dict):
        raise BadRequest(f'{name} must be an object mapping token ids to biases, e.g. {{"42": -100}}')
    out = []
    for k, b in x.items():
        try:
            t = int(k)
        except (TypeError, ValueError):
            raise BadRequest(f"{name}: key {k!r} is not a token id; keys are token ids as strings") from None
        if t < 0:
            raise BadRequest(f"{name}: key {k!r} is not a token id (>= 0)")
        v = json_float(b, f"{name}[{k!r}]")
        if not -100 <= v <= 100:
            raise BadRequest(f"{name}[{k!r}] must be in [-100, 100], got {v}")
        out.append((t, v))
    return tuple(sorted(out))


def parse_stop_regex(x: Any, name: str) -> tuple[str, ...]:
    """``stop_regex``: a regular expression or a list of them, each compiled here so a bad one is a 400."""
    pats = [x] if isinstance(x, str) else x
    if not isinstance(pats, list) or not all(isinstance(p, str) and p for p in pats):
        raise BadRequest(f"{name} must be a non-empty string or a list of non-empty strings (regular expressions)")
    for p in pats:
        try:
            re.compile(p)
        except re.error as e:
            raise BadRequest(f"{name}: {p!r} is not a valid regular expression ({e})") from None
    return tuple(pats)


CONSTRAINED_DECODING = ("regex", "json_schema", "ebnf", "structural_tag")
"""SGLang's grammar-constrained ``sampling_params`` (``structural_tag`` is refused; the others need xgrammar)."""


GRAMMAR_EXTRA = "pip install 'rlcore[grammar]' (xgrammar)"


def grammar_available() -> bool:
    """True when xgrammar can be imported here (constrained decoding, ``rlcore.inference.grammar``)."""
    return importlib.util.find_spec("xgrammar") is not None


def parse_grammar(kind: str, spec: Any, name: str) -> tuple[str, str]:
    """A grammar field -> ``SamplingParams.grammar``; a 400 naming ``name`` for a non-string, and naming the extra
    when xgrammar is not installed (the fields are never ignored)."""
    if kind == "json_schema" and isinstance(spec, dict):
        spec = json.dumps(spec)
    if not isinstance(spec, str) or not spec:
        raise BadRequest(f"{name} must be a non-empty string")
    if not grammar_available():
        raise BadRequest(f"{name}: constrained decoding needs xgrammar, which is not installed; {GRAMMAR_EXTRA}")
    return kind, spec


def parse_n(sp: Any) -> int:
    """``sampling_params.n``: how many independent samples of each prompt (default 1, at most ``MAX_N``)."""
    if not isinstance(sp, dict) or sp.get("n") is None:
        return 1
    n = json_int(sp["n"], "sampling_params.n", 1)
    if n > MAX_N:
        raise BadRequest(f"sampling_params.n must be <= {MAX_N}, got {n}; send several requests instead")
    return n
