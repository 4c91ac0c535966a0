"""One generation request as the engine's scheduler holds it: the prompt, the sampling settings, the tokens so far
with their log-probs and versions, and its KV state (decode row, block table, weight epoch)."""

from __future__ import annotations

import concurrent.futures as cf
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rlcore.inference.protocol import SamplingParams
from rlcore.inference.sampling import stop_strings, uses_penalty


@dataclass(eq=False)
class Request:
    rid: str
    prompt: list[int]
    sampling: SamplingParams
    seed: int
    future: cf.Future
    out_ids: list[int] = field(default_factory=list)
    out_logp: list[float] = field(default_factory=list)
    out_ver: list[int] = field(default_factory=list)
    out_top: list[list[tuple[int, float]]] | None = None
    """Per generated token, its ``top_logprobs_num`` alternatives (None when the request asks for none)."""
    out_tid: list[list[float]] | None = None
    """Per generated token, the log-probs of ``token_ids_logprob`` (None when the request gives none)."""
    slot: int = -1
    epoch: int = -1
    """Weight epoch its KV was computed under (-1: it has none, a prefill is due)."""
    blocks: list[int] = field(default_factory=list)
    """Block table: block ``j`` holds KV of tokens ``[j * block_size, (j + 1) * block_size)`` of
    ``prompt + out_ids`` (the newest token's KV is written by the next decode step)."""
    cow: bool = False
    """May still share its last, partial block with group members: copied before the first write into it."""
    parked: bool = False
    """Retracted while keeping its blocks: resumes decoding without a prefill if the weights did not change."""
    order: int = 0
    """Arrival order (the youngest running request is preempted first)."""
    key: tuple[int, ...] | None = None
    """``tuple(prompt)``, computed once when first needed (prefill grouping, the live-prefix index)."""
    t_submit: float = field(default_factory=time.perf_counter)
    t_first: float = 0.0
    stops: tuple[str, ...] = ()
    """Stop strings (normalised from ``sampling.stop``)."""
    stop_window: int = 0
    """Output tokens decoded per step to look for a stop string (0: the request has none)."""
    stop_regex: tuple = ()
    """Compiled ``sampling.stop_regex`` patterns (searched in the whole decoded output after each token)."""
    penalized: bool = False
    """Uses a frequency / presence / repetition penalty (its token counts live in ``Scheduler.counts``)."""
    on_token: Callable[[int, float, int], None] | None = None
    """Called on the loop thread with ``(token id, log-prob, version)`` after each committed token."""
    solo: bool = False
    """Was in a forward that raised: prefilled alone next time, so a request that breaks the forward fails alone."""
    cached_tokens: int = 0
    """Prompt tokens whose KV came from the prefix cache (SGLang's ``meta_info.cached_tokens``)."""
    constraint: Any = None
    """``grammar.Constraint`` of a request with ``sampling.grammar`` (its matcher advances with every token)."""
    strikes: int = 0
    """Failed forwards this request was part of; at ``_MAX_STRIKES`` it fails even when not alone."""

    @property
    def kv_tokens(self) -> int:
        """Tokens whose KV a prefilled request holds: all but the newest, ``len(prompt + out_ids) - 1``."""
        return len(self.prompt) + len(self.out_ids) - 1


def new_request(
    rid: str, prompt: list[int], sampling: SamplingParams, seed: int, future: cf.Future,
    on_token: Callable[[int, float, int], None] | None = None, engine: Any = None,
) -> Request:
    """A ``Request`` with what its settings imply computed once: stop strings and their window, compiled
    ``stop_regex``, penalties, and the lists that collect the asked-for alternatives."""
    req = Request(rid, prompt, sampling, seed, future, on_token=on_token)
    req.stops = stop_strings(sampling)
    if req.stops:
        # A stop string completed by the newest token starts within its last len(utf-8 bytes) tokens
        # (every token decodes to at least one byte), so one more token of context is enough.
        req.stop_window = max(len(x.encode("utf-8")) for x in req.stops) + 1
    req.penalized = uses_penalty(sampling)
    req.stop_regex = tuple(re.compile(x) for x in sampling.stop_regex)
    req.out_top = [] if sampling.top_logprobs_num > 0 else None
    req.out_tid = [] if sampling.token_ids_logprob else None
    if sampling.grammar is not None:  # compiled here (cached per grammar): a bad grammar is refused at submit
        from rlcore.inference.grammar import compile_constraint

        req.constraint = compile_constraint(engine.tokenizer, engine.vocab_size, sampling.grammar)
    return req
