"""OpenAI-compatible ``POST /v1/completions`` and ``POST /v1/chat/completions`` over an ``Engine``.

``make_app`` (server.py) registers ``make_view(engine, endpoint)`` for both paths, next to SGLang's native
endpoints, as a real SGLang server does. Requests are validated by the schema layer shared with the agent
proxy (``chat.py``: pydantic v2 models + ``check_supported``); tool calls are parsed by ``tool_parsers``
(``app[TOOL_PARSER_KEY]``, ``rlcore.serve --tool-parser``); streams are written by ``sse.EventWriter`` and
detokenised incrementally by ``detok.StreamDecoder``. A request is parsed into a ``Plan`` (one engine request per
prompt and sample; nothing is queued until the whole request is valid), then answered as one JSON body
(``complete``) or as Server-Sent Events (``stream``). Bad input is a 400 in OpenAI's error shape,
``{"error": {"message", "type", "param", "code"}}``, whose message names the parameter and the fix.

Differences from OpenAI (docs/engine.md, "OpenAI-compatible API"): log-probs and their alternatives (chat
``top_logprobs``, completions ``logprobs: k``) are those of the distribution each token was drawn from; ``echo``
works without ``logprobs`` only; ``suffix``, ``best_of != n``, forced ``tool_choice`` and non-text message parts
answer 400, as does every SGLang field this server does not honour (``chat.SGLANG_REFUSED``). Text is decoded with
special tokens skipped (SGLang's OpenAI default). ``tokenize`` / ``detokenize`` serve SGLang's ``/tokenize`` and
``/detokenize``.

LoRA adapters (docs/lora.md), resolved as SGLang's ``OpenAIServingBase`` does: ``model="<base>:<adapter>"`` names
a loaded adapter (the text after the served model's name and ``:``, else after the first ``:``; the base part is not
checked), and wins over the ``lora_path`` extra field (a name, or one per prompt); a ``model`` without ``:`` is
echoed and otherwise ignored. A name that is not loaded is a 400 naming it and the loaded adapters.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from typing import Any, Literal

from aiohttp import web

from rlcore.inference import control, sse
from rlcore.inference.chat import (
    ENGINE_FIELDS,
    MAX_N,
    ChatRequest,
    CompletionRequest,
    OpenAIError,
    chat_chunk,
    chat_logprobs,
    check_sglang_fields,
    check_supported,
    parse_body,
    usage,
    validate,
)
from rlcore.inference.checks import context_advice
from rlcore.inference.detok import StreamDecoder
from rlcore.inference.engine import Engine, EngineBusy, EngineError, GenerateOutput
from rlcore.inference.protocol import (
    BadRequest,
    SamplingParams,
    parallel_sampling,
    parse_grammar,
    parse_logit_bias,
)
from rlcore.inference.tool_parsers import HERMES, ParseFn, ToolParser, resolve

Endpoint = Literal["completions", "chat"]

DEFAULT_COMPLETION_TOKENS = 16
"""``max_tokens`` of a completion request that gives none (OpenAI's and SGLang's default)."""
TOOL_PARSER_KEY = web.AppKey("rlcore_tool_parser", ToolParser)
"""``app[TOOL_PARSER_KEY] = parser`` sets the tool parser of an app's OpenAI routes (``rlcore.serve --tool-parser``);
default ``tool_parsers.HERMES``."""


# ------------------------------------------------------------------------------------------------ the plan
@dataclasses.dataclass
class Plan:
    """A validated OpenAI request: ``len(prompts) * n`` engine requests, choice ``i * n + j`` is sample ``j``
    of prompt ``i`` (OpenAI's order)."""

    endpoint: Endpoint
    """``"completions"`` or ``"chat"``: decides the response shapes."""
    model: str
    """Echoed ``model`` (any string; the served model id when the request has none)."""
    prompts: list[list[int]]
    """Prompt token ids, one list per prompt (chat: one, the templated conversation)."""
    samples: list[SamplingParams]
    """The ``n`` per-sample settings (sample ``j`` has seed ``seed + j`` when a seed is given)."""
    echo: list[str]
    """Completions with ``echo``: each prompt's text, prepended to its choices; else empty strings."""
    stream: bool
    """Answer with Server-Sent Events (``stream``) instead of one JSON body."""
    include_usage: bool
    """``stream_options.include_usage``: a last chunk with ``usage`` and no choices."""
    logprobs: bool
    """Return the sampled tokens' log-probs (completions ``logprobs=0``, chat ``logprobs: true``)."""
    tool_parser: ToolParser | None
    """Chat with ``tools`` (and ``tool_choice`` not ``"none"``): the parser of tool calls in the reply."""
    lora_path: list[str | None] = dataclasses.field(default_factory=list)
    """The adapter each prompt names (``resolve_lora``), checked to be loaded; the embedded engine serves every
    request with its applied adapter (docs/lora.md), as for ``/generate``'s ``lora_path``."""
    no_stop_trim: bool = False
    """Keep the matched stop string at the end of the text (SGLang's ``no_stop_trim``)."""
    top_logprobs: int = 0
    """Alternatives per token (completions ``logprobs=k``, chat ``top_logprobs=k``): the engine's
    ``top_logprobs_num``, of the distribution each token was drawn from."""
    id: str = dataclasses.field(default_factory=lambda: uuid.uuid4().hex)
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))

    @property
    def n(self) -> int:
        return len(self.samples)

    @property
    def parse_tools(self) -> bool:
        return self.tool_parser is not None

    @property
    def response_id(self) -> str:
        return ("chatcmpl-" if self.endpoint == "chat" else "cmpl-") + self.id

    def head(self, engine: Engine, chunk: bool) -> dict:
        """Fields every response (or chunk) starts with."""
        obj = "chat.completion" if self.endpoint == "chat" else "text_completion"
        return {
            "id": self.response_id,
            "object": obj + (".chunk" if chunk and self.endpoint == "chat" else ""),
            "created": self.created,
            "model": self.model,
            "system_fingerprint": f"rlcore-weights-v{engine.version}",
        }


def _require_tokenizer(engine: Engine, endpoint: Endpoint) -> Any:
    if engine.tokenizer is None:
        path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
        raise OpenAIError(
            f"{path} needs a tokenizer to decode text and this server has none: start it with a tokenizer "
            "(python -m rlcore.serve --tokenizer DIR, or a model directory that holds one), or use /generate "
            "with input_ids",
            None,
        )
    return engine.tokenizer


def _model_name(engine: Engine, req: ChatRequest | CompletionRequest) -> str:
    return req.model if req.model is not None else served_model_name(engine)


def served_model_name(engine: Engine) -> str:
    """The id ``/v1/models`` lists for the base model (SGLang's ``served_model_name``)."""
    return getattr(engine, "served_model_name", None) or engine.model_path or "rlcore-engine"


def split_model(model: str, served: str) -> tuple[str, str | None]:
    """``model`` -> ``(base, adapter or None)``, SGLang's ``base:adapter`` rule: no ``:``, or exactly the served
    name (which may hold ``:``, e.g. ``s3://...``), is the base model; ``<served>:<adapter>`` splits after the
    served name, anything else at the first ``:``. The base part is not checked; an empty adapter is none."""
    if ":" not in model or model == served:
        return model, None
    if model.startswith(served + ":"):
        base, adapter = served, model[len(served) + 1 :]
    else:
        base, adapter = model.split(":", 1)
    return base.strip(), adapter.strip() or None


def resolve_lora(engine: Engine, req: ChatRequest | CompletionRequest, n_prompts: int) -> list[str | None]:
    """The adapter of each prompt: the one ``model`` names (``split_model``), else the ``lora_path`` extra field
    (a name for all prompts, or a list with one per prompt), else none. Every name must be loaded
    (``Engine.lora_adapters``): an unknown one is a 400 naming it and the loaded ones, never the base weights."""
    from_model = split_model(req.model, served_model_name(engine))[1] if req.model is not None else None
    raw = from_model if from_model is not None else req.lora_path
    param = "model" if from_model is not None else "lora_path"
    if raw is None:
        return [None] * n_prompts
    if isinstance(raw, list):
        if len(raw) != n_prompts:
            raise OpenAIError(f"lora_path: a list needs one entry per prompt ({n_prompts}), got {len(raw)}", param)
        names = raw
    else:
        names = [raw] * n_prompts
    loaded = engine.lora_adapters
    for x in names:
        if x is not None and x not in loaded:
            how = f'model "<base>:{x}"' if param == "model" else f"lora_path {x!r}"
            raise OpenAIError(
                f"LoRA adapter {x!r} (from {how}) is not loaded; loaded adapters: {list(loaded)}. Load it with "
                "/load_lora_adapter, or name one of these",
                param,
            )
    return names


def _sampling(
    engine: Engine, req: ChatRequest | CompletionRequest, endpoint: Endpoint, prompt_lens: list[int],
    top_logprobs: int = 0,
) -> list[SamplingParams]:
    """The validated sampling fields -> ``n`` engine settings. ``max_tokens`` is checked against the context."""
    if getattr(engine.cfg, "prefix_cache", False):
        for key in ("extra_key", "cache_salt"):
            if (req.model_extra or {}).get(key) not in (None, "", []):
                raise OpenAIError(f"{key} is not supported with EngineConfig.prefix_cache on: the cache is not "
                                  "partitioned per tenant; drop it", key)
    room = engine.max_seq_len - max(prompt_lens)
    if room < 1:
        param = "messages" if endpoint == "chat" else "prompt"
        raise OpenAIError(
            f"The input ({max(prompt_lens)} tokens) is longer than the model's context length ({engine.max_seq_len} "
            f"tokens): shorten {param}{_context_advice(engine)}",
            param,
            code="context_length_exceeded",
        )
    key, want = req.max_new if isinstance(req, ChatRequest) else ("max_tokens", req.max_tokens)
    if want is None:  # completions: OpenAI's 16; chat: the rest of the context
        max_new = min(DEFAULT_COMPLETION_TOKENS, room) if endpoint == "completions" else room
    elif want > engine.max_seq_len:  # SGLang's serving_chat text
        raise OpenAIError(
            f"max_completion_tokens is too large: {want}. This model supports at most {engine.max_seq_len} "
            f"completion tokens (lower {key} to at most {room} for this prompt)",
            key,
            code="context_length_exceeded",
        )
    elif want > room:  # SGLang's tokenizer-manager text
        raise OpenAIError(
            f"Requested token count exceeds the model's maximum context length of {engine.max_seq_len} tokens. You "
            f"requested a total of {want + max(prompt_lens)} tokens: {max(prompt_lens)} tokens from the input "
            f"messages and {want} tokens for the completion. Please reduce the number of tokens in the input "
            f"messages or the completion to fit within the limit (lower {key} to at most {room})",
            key,
            code="context_length_exceeded",
        )
    else:
        max_new = want
    total = len(prompt_lens) * req.n
    if total > engine.cfg.max_waiting:
        raise OpenAIError(
            f"this request asks for {total} completions (prompts x n) but the server queues at most "
            f"{engine.cfg.max_waiting}; lower n or send fewer prompts per request",
            "n",
        )
    if req.min_tokens > max_new:
        raise OpenAIError(
            f"min_tokens={req.min_tokens} exceeds the completion budget of {max_new} tokens", "min_tokens"
        )
    kw: dict[str, Any] = {
        "max_new_tokens": max_new,
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "top_p": 1.0 if req.top_p is None else req.top_p,
        "seed": req.seed,
        "stop": req.stops,
        "frequency_penalty": req.frequency_penalty,
        "presence_penalty": req.presence_penalty,
        "top_k": req.top_k,
        "repetition_penalty": req.repetition_penalty,
        "ignore_eos": req.ignore_eos,
        "min_new_tokens": req.min_tokens,
        "min_p": req.min_p or 0.0,
        "stop_regex": req.stop_regexes,
        "top_logprobs_num": top_logprobs,
    }
    kw["grammar"] = _grammar(req)
    if req.logit_bias:
        try:
            kw["logit_bias"] = parse_logit_bias(req.logit_bias, "logit_bias")
        except BadRequest as e:
            raise OpenAIError(str(e), "logit_bias") from None
        if any(t >= engine.vocab_size for t, _ in kw["logit_bias"]):
            raise OpenAIError(f"logit_bias keys must be token ids in [0, {engine.vocab_size})", "logit_bias")
    if req.stop_token_ids is not None:
        if any(t >= engine.vocab_size for t in req.stop_token_ids):
            raise OpenAIError(
                f"stop_token_ids must be a list of token ids in [0, {engine.vocab_size})", "stop_token_ids"
            )
        kw["stop_token_ids"] = tuple(req.stop_token_ids)
    return parallel_sampling(SamplingParams(**kw), req.n)


def _grammar(req: ChatRequest | CompletionRequest) -> tuple[str, str] | None:
    """Constrained decoding from SGLang's ``regex`` / ``ebnf`` / ``json_schema`` extension fields or OpenAI's
    ``response_format`` (``json_object``; ``json_schema`` with ``json_schema.schema``); one at most."""
    extra = req.model_extra or {}
    fmt = extra.get("response_format") if isinstance(req, CompletionRequest) else (
        req.response_format.model_dump() if req.response_format is not None else None)
    given: list[tuple[str, str, Any]] = [(k, k, extra[k]) for k in ("regex", "ebnf", "json_schema")
                                         if extra.get(k) is not None]
    if isinstance(fmt, dict) and fmt.get("type") == "json_object":
        given.append(("response_format", "json_object", "{}"))
    elif isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        schema = (fmt.get("json_schema") or {}).get("schema") if isinstance(fmt.get("json_schema"), dict) else None
        if schema is None:
            raise OpenAIError("response_format json_schema needs json_schema.schema (a JSON Schema object)",
                              "response_format")
        given.append(("response_format", "json_schema", schema))
    elif isinstance(fmt, dict) and fmt.get("type") not in (None, "text"):
        raise OpenAIError(f"response_format type {fmt.get('type')!r} is not supported; use text, json_object or "
                          "json_schema", "response_format")
    if not given:
        return None
    if len(given) > 1:
        raise OpenAIError(f"give one of regex, ebnf, json_schema and response_format, got {[g[0] for g in given]}",
                          given[1][0])
    field, kind, spec = given[0]
    try:
        return parse_grammar(kind, spec, field)
    except BadRequest as e:
        raise OpenAIError(str(e), field) from None


def _check_prompt_ids(engine: Engine, ids: list[int], param: str) -> None:
    if not ids:
        raise OpenAIError(f"{param} is empty (no tokens); send at least one token", param)
    if min(ids) < 0 or max(ids) >= engine.vocab_size:
        raise OpenAIError(f"{param} contains token ids outside [0, {engine.vocab_size})", param)


def _early_length_check(engine: Engine, body: Any) -> None:
    """A token-id prompt longer than the context is refused before the schema validation, which walks every id
    holding the GIL (seconds for a 20 MB body, during which no other request is served)."""
    raw = body.get("prompt") if isinstance(body, dict) else None
    if not isinstance(raw, list) or not raw or isinstance(raw[0], str):
        return
    rows = raw if isinstance(raw[0], list) else [raw]
    longest = max(len(r) if isinstance(r, list) else 0 for r in rows)
    if longest >= engine.max_seq_len:
        raise OpenAIError(
            f"The input ({longest} tokens) is longer than the model's context length ({engine.max_seq_len} tokens): "
            f"shorten prompt{_context_advice(engine)}", "prompt", code="context_length_exceeded",
        )


def _context_advice(engine: Engine) -> str:
    """How to fit a longer prompt: a larger ``--max-seq-len``, unless the model's positions clipped the context."""
    limit = getattr(engine, "context_limit", "max_seq_len")
    if limit == "max_seq_len":
        return " (or restart the server with a larger --max-seq-len)"
    return context_advice(limit, "--max-seq-len")


def completion_plan(engine: Engine, body: Any) -> Plan:
    """Validate a ``/v1/completions`` body (``CompletionRequest``). ``prompt``: a string, a list of strings, a
    list of token ids or a list of token-id lists. Raises ``OpenAIError``; queues nothing."""
    _early_length_check(engine, body)
    req = validate(CompletionRequest, body)
    check_sglang_fields(req, body)
    tok = _require_tokenizer(engine, "completions")
    raw = req.prompt
    if isinstance(raw, str):
        texts: list[str] | None = [raw]
    elif isinstance(raw[0], str):
        texts = list(raw)  # type: ignore[arg-type]
    else:
        texts = None
    if texts is not None:
        prompts = [list(tok(t)["input_ids"]) for t in texts]
    else:
        prompts = [list(raw)] if isinstance(raw[0], int) else [list(x) for x in raw]  # type: ignore[arg-type]
    for i, ids in enumerate(prompts):
        _check_prompt_ids(engine, ids, "prompt" if len(prompts) == 1 else f"prompt[{i}]")
    if req.suffix:
        raise OpenAIError(
            "suffix is not supported by this server: insertion is not implemented; put the text in prompt",
            "suffix",
        )
    if req.echo and req.logprobs is not None:
        raise OpenAIError(
            "echo with logprobs needs prompt log-probs, which the engine does not compute; drop one of them",
            "echo",
        )
    if req.stream_options is not None and not req.stream:
        raise OpenAIError("stream_options is only allowed with stream: true", "stream_options")
    adapters = resolve_lora(engine, req, len(prompts))
    samples = _sampling(engine, req, "completions", [len(p) for p in prompts], req.logprobs or 0)
    if req.best_of is not None and req.best_of != len(samples):
        raise OpenAIError(
            "best_of is not supported (every sample is returned); omit it or set it to n", "best_of"
        )
    echo_texts = [""] * len(prompts)
    if req.echo:
        echo_texts = (
            list(texts) if texts is not None else [tok.decode(p, skip_special_tokens=False) for p in prompts]
        )
    return Plan(
        "completions",
        _model_name(engine, req),
        prompts,
        samples,
        echo_texts,
        req.stream,
        req.include_usage,
        req.logprobs is not None,
        None,
        adapters,
        no_stop_trim=req.no_stop_trim,
        top_logprobs=req.logprobs or 0,
    )


def _render_chat(engine: Engine, req: ChatRequest, add_generation_prompt: bool | None = None) -> list[int]:
    """The chat template applied to ``req`` (``add_generation_prompt``: None opens the assistant turn unless
    ``continue_final_message``) -> prompt ids."""
    tok = _require_tokenizer(engine, "chat")
    if getattr(tok, "chat_template", None) is None:
        raise OpenAIError(
            "the server's tokenizer has no chat template; serve a tokenizer that has one, or use "
            "/v1/completions with an already formatted prompt",
            "messages",
        )
    messages, tools = req.template_messages(), req.template_tools()
    try:
        kw: dict[str, Any] = {**(req.chat_template_kwargs or {}), **({"tools": tools} if tools else {})}
        if req.continue_final_message:  # the reply continues the last assistant message (no new turn)
            kw["continue_final_message"] = True
        gen = not req.continue_final_message if add_generation_prompt is None else add_generation_prompt
        text = tok.apply_chat_template(messages, add_generation_prompt=gen, tokenize=False, **kw)
    except Exception as e:  # template errors (role order, missing fields) are the caller's to fix
        raise OpenAIError(
            f"the chat template failed on these messages: {type(e).__name__}: {e}", "messages"
        ) from None
    return list(tok.encode(text, add_special_tokens=False))


def chat_plan(engine: Engine, body: Any, tool_parser: str | ToolParser | ParseFn = HERMES) -> Plan:
    """Validate a ``/v1/chat/completions`` body (``ChatRequest`` + ``check_supported``, shared with the agent
    proxy) and apply the tokenizer's chat template (``add_generation_prompt=True``). Raises ``OpenAIError``;
    queues nothing."""
    req = validate(ChatRequest, body)
    check_supported(req, ENGINE_FIELDS)
    prompt = _render_chat(engine, req)
    _check_prompt_ids(engine, prompt, "messages")
    adapters = resolve_lora(engine, req, 1)
    samples = _sampling(engine, req, "chat", [len(prompt)], (req.top_logprobs or 0) if req.logprobs else 0)
    return Plan(
        "chat",
        _model_name(engine, req),
        [prompt],
        samples,
        [""],
        req.stream,
        req.include_usage,
        req.logprobs,
        resolve(tool_parser) if req.parse_tools else None,
        adapters,
        no_stop_trim=req.no_stop_trim,
        top_logprobs=(req.top_logprobs or 0) if req.logprobs else 0,
    )


# -------------------------------------------------------------------------------------------- the answers
@dataclasses.dataclass
class Choice:
    """One finished choice, before it is shaped as JSON."""

    text: str
    """Completion text: special tokens skipped, cut before the matched stop string."""
    finish_reason: str
    """``stop`` | ``length`` | ``tool_calls`` | ``abort`` (SGLang's extra value for an aborted request)."""
    matched_stop: int | str | None
    """The stop token id or stop string that ended the request (SGLang's ``matched_stop``)."""
    pieces: list[str]
    """Decoded text of each returned token (only with logprobs)."""
    logprobs: list[float]
    starts: list[int]
    """Offset of each returned token in ``text`` (cumulative lengths of the per-token decodes)."""
    tops: list[list[tuple[str, float]]] = dataclasses.field(default_factory=list)
    """Per returned token, its ``top_logprobs`` alternatives as ``(text, log-prob)`` (empty lists when none asked)."""
    content: str | None = None
    """Chat: the message content (text before the first tool call, or None when that is empty)."""
    tool_calls: list[dict] = dataclasses.field(default_factory=list)


def _pieces(tok: Any, ids: list[int]) -> tuple[list[str], list[int]]:
    """Per-token display strings and their text offsets (special tokens show their name, length 0)."""
    shown = tok.batch_decode([[t] for t in ids], skip_special_tokens=False)
    plain = tok.batch_decode([[t] for t in ids], skip_special_tokens=True)
    starts, at = [], 0
    for p in plain:
        starts.append(at)
        at += len(p)
    return shown, starts


def finish_choice(engine: Engine, plan: Plan, out: GenerateOutput) -> Choice:
    """A finished engine request -> its ``Choice`` (stop-trimmed text, finish reason, log-probs, tool calls).

    Tokens after the stop-string cut (or a final stop token that decodes to nothing) are left out of the
    log-probs, as OpenAI returns them; ``usage`` still counts every generated token."""
    tok = engine.tokenizer
    ids = list(out.output_ids)
    text = tok.decode(ids, skip_special_tokens=True)
    kind, matched = out.finish_reason.get("type"), out.finish_reason.get("matched")
    if kind == "stop" and isinstance(matched, str) and (pos := text.find(matched)) >= 0:
        text = text[: pos + len(matched)] if plan.no_stop_trim else text[:pos]
    finish = {"stop": "stop", "length": "length"}.get(kind, "abort")
    pieces: list[str] = []
    logps: list[float] = []
    starts: list[int] = []
    if plan.logprobs:
        pieces, starts = _pieces(tok, ids)
        keep = sum(s < len(text) for s in starts) if kind == "stop" else len(ids)
        pieces, starts, logps = pieces[:keep], starts[:keep], list(out.output_logprobs[:keep])
    tops = alternatives(tok, (out.output_top_logprobs or [])[: len(pieces)], len(pieces))
    choice = Choice(text, finish, matched if kind == "stop" else None, pieces, logps, starts, tops, content=text)
    if plan.tool_parser is not None:
        choice.content, choice.tool_calls = plan.tool_parser.parse(text)
        if choice.tool_calls and finish != "abort":
            choice.finish_reason = "tool_calls"
    return choice


MASKED_LOGPROB = -9999.0
"""What a log-prob of ``-inf`` (a token outside the sampled distribution: top-k / top-p / min-p, a -100 bias) is
reported as on the OpenAI routes, vLLM's convention: JSON has no infinity."""


def json_logprob(x: float) -> float:
    """``x``, with ``-inf`` as ``MASKED_LOGPROB``."""
    return x if x > MASKED_LOGPROB else MASKED_LOGPROB


def alternatives(tok: Any, rows: list, n: int) -> list[list[tuple[str, float]]]:
    """``(id, log-prob)`` alternatives per token -> ``(text, log-prob)`` (``n`` rows; empty when none were asked)."""
    if not rows:
        return [[] for _ in range(n)]
    flat = [t for row in rows for t, _ in row]
    texts = iter(tok.batch_decode([[t] for t in flat], skip_special_tokens=False)) if flat else iter(())
    out = [[(next(texts), json_logprob(lp)) for _, lp in row] for row in rows]
    return out + [[] for _ in range(n - len(out))]


def _completion_logprobs(
    pieces: list[str], logps: list[float], starts: list[int], offset: int, tops: list | None = None
) -> dict:
    """Completions' ``logprobs`` object; ``top_logprobs[i]`` maps the text of token ``i``'s alternatives and of the
    sampled token to their log-probs (OpenAI's: up to ``logprobs + 1`` entries; tokens with the same text share
    one key)."""
    tops = tops or [[] for _ in pieces]
    return {
        "tokens": pieces,
        "token_logprobs": [json_logprob(x) for x in logps],
        "top_logprobs": [{**dict(alt), p: json_logprob(lp)} for p, lp, alt in zip(pieces, logps, tops)],
        "text_offset": [offset + s for s in starts],
    }


def _usage(plan: Plan, outs: list[GenerateOutput]) -> dict:
    # prompts are counted once per prompt, whatever n is (as OpenAI does)
    return usage(sum(len(p) for p in plan.prompts), sum(len(o.output_ids) for o in outs))


def response_body(engine: Engine, plan: Plan, outs: list[GenerateOutput]) -> dict:
    """The non-streaming JSON answer (``text_completion`` or ``chat.completion``) for finished requests."""
    choices = []
    for k, out in enumerate(outs):
        c = finish_choice(engine, plan, out)
        prefix = plan.echo[k // plan.n]
        row: dict[str, Any] = {"index": k, "finish_reason": c.finish_reason, "matched_stop": c.matched_stop}
        if plan.endpoint == "completions":
            row["text"] = prefix + c.text
            row["logprobs"] = (
                _completion_logprobs(c.pieces, c.logprobs, c.starts, len(prefix), c.tops) if plan.logprobs else None
            )
        else:
            # SGLang's ChatMessage: reasoning_content and tool_calls are always present (null when absent)
            msg: dict[str, Any] = {"role": "assistant", "content": c.content, "reasoning_content": None,
                                   "tool_calls": c.tool_calls or None}
            row["message"] = msg
            row["logprobs"] = chat_logprobs(c.pieces, c.logprobs, c.tops) if plan.logprobs else None
        choices.append(row)
    return {**plan.head(engine, chunk=False), "choices": choices, "usage": _usage(plan, outs)}


def _submit_all(engine: Engine, plan: Plan, on_token=None) -> tuple[list[str], list]:
    """Submit every (prompt, sample) of ``plan`` (``control.submit_each``: a refusal aborts the ones before it)."""
    n = len(plan.prompts) * plan.n
    rids = [f"{plan.response_id}-{k}" for k in range(n)]
    if on_token is None:
        cbs: list = [None] * n
    elif plan.top_logprobs:  # the token's alternatives are read on the loop thread, while the request is in flight
        cbs = [lambda t, lp, v, k=k: on_token(k, t, lp, engine.alternatives_so_far(rids[k], -1)[0][0])
               for k in range(n)]
    else:
        cbs = [lambda t, lp, v, k=k: on_token(k, t, lp, None) for k in range(n)]
    jobs = ((plan.prompts[k // plan.n], plan.samples[k % plan.n], rids[k], cbs[k]) for k in range(n))
    return rids, control.submit_each(engine, jobs)


async def complete(engine: Engine, plan: Plan) -> dict:
    """Run every request of ``plan`` and return the JSON answer; requests still running when the caller is
    cancelled (client gone) are aborted."""
    rids, futs = _submit_all(engine, plan)
    return response_body(engine, plan, await control.wait_or_abort(engine, rids, futs))


async def handle(engine: Engine, endpoint: str, body: Any) -> tuple[int, dict]:
    """In-process, non-streaming: ``endpoint`` is ``"v1/completions"`` or ``"v1/chat/completions"``."""
    ep = endpoint.strip("/")
    try:
        if ep == "v1/completions":
            plan = completion_plan(engine, body)
        elif ep == "v1/chat/completions":
            plan = chat_plan(engine, body)
        else:
            raise OpenAIError(f"unknown endpoint /{ep}", status=404, kind="not_found_error")
        if plan.stream:
            raise OpenAIError("stream: true is served over HTTP only (make_app)", "stream")
        return 200, await complete(engine, plan)
    except OpenAIError as e:
        return e.status, e.body()
    except EngineBusy as e:
        return 503, _busy(e).body()
    except EngineError as e:
        return 400, OpenAIError(str(e)).body()


def _busy(e: EngineBusy) -> OpenAIError:
    return OpenAIError(str(e), status=503, code="engine_busy", kind="server_error")


# ----------------------------------------------------------------------------------------------- streaming
def held_back(text: str, holds: tuple[str, ...]) -> int:
    """How much of ``text`` may be sent while more tokens can still arrive: everything before the first
    occurrence of a hold string (a stop string, or ``<tool_call>``), minus a tail that could be the start of
    one, minus trailing replacement characters (a UTF-8 sequence still incomplete)."""
    safe = len(text)
    for h in holds:
        pos = text.find(h)
        if pos >= 0:
            safe = min(safe, pos)
            continue
        for j in range(min(len(h) - 1, len(text)), 0, -1):
            if text.endswith(h[:j]):
                safe = min(safe, len(text) - j)
                break
    while safe > 0 and text[safe - 1] == "\ufffd":
        safe -= 1
    return safe


@dataclasses.dataclass
class _Live:
    """What one streamed choice has received and sent."""

    decoder: StreamDecoder
    """Incremental detokeniser: ``decoder.text`` is the output so far, O(1) decode work per token."""
    sent: int = 0
    """Characters of ``decoder.text`` sent."""
    blocked: bool = False
    """A hold string (stop string or tool-call tag) appeared: nothing more is sent before the finish."""
    logps: list[float] = dataclasses.field(default_factory=list)
    tops: list[list] = dataclasses.field(default_factory=list)
    """Per token, its ``(id, log-prob)`` alternatives (empty lists without ``top_logprobs``)."""
    sent_tokens: int = 0
    starts: list[int] = dataclasses.field(default_factory=list)
    pieces: list[str] = dataclasses.field(default_factory=list)
    end: int = 0
    """Cumulative length of the per-token decodes so far."""

    def advance(self, holds: tuple[str, ...]) -> str:
        """The text that may be sent now. Only the unsent tail is scanned: no hold string starts before
        ``sent`` (``held_back``'s invariant), so the work per token is bounded by the longest hold string."""
        if self.blocked:
            return ""
        pending = self.decoder.text[self.sent :]
        safe = held_back(pending, holds)
        self.blocked = any(h in pending for h in holds)
        self.sent += safe
        return pending[:safe]


def _chunk(
    engine: Engine,
    plan: Plan,
    k: int,
    text: str | None,
    pieces: list[str],
    logps: list[float],
    starts: list[int],
    finish: str | None,
    extra_delta: dict | None = None,
    tops: list | None = None,
) -> dict:
    lp = None
    head = plan.head(engine, chunk=True)
    if plan.endpoint == "completions":
        if plan.logprobs:
            lp = _completion_logprobs(pieces, logps, starts, len(plan.echo[k // plan.n]), tops)
        row: dict[str, Any] = {"index": k, "finish_reason": finish, "text": text or "", "logprobs": lp}
        body: dict[str, Any] = {**head, "choices": [row]}
    else:
        # SGLang's DeltaMessage: reasoning_content and tool_calls are always present (null when absent)
        delta: dict[str, Any] = {"content": text, "reasoning_content": None, "tool_calls": None}
        delta.update(extra_delta or {})
        body = chat_chunk(head, k, delta, finish, chat_logprobs(pieces, logps, tops) if plan.logprobs else None)
    if plan.include_usage:
        body["usage"] = None
    return body


async def stream(engine: Engine, plan: Plan, request: web.Request) -> web.StreamResponse:
    """Answer ``plan`` as Server-Sent Events (``sse.EventWriter``): ``data: {chunk}\n\n`` per choice and
    wake-up, then ``data: [DONE]\n\n``. Chunks carry *new* text only (OpenAI's deltas), detokenised
    incrementally (``detok.StreamDecoder``); choices of ``n > 1`` interleave, each chunk naming its ``index``.
    Text is held back while it could still turn into a stop string (or, with tools, a tool call); the last
    chunk of a choice has its ``finish_reason``. With ``stream_options.include_usage`` every chunk has
    ``usage: null`` and one last chunk has the usage and no choices. A client that goes away has its
    requests aborted."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    tok = engine.tokenizer
    tag = plan.tool_parser.start if plan.tool_parser is not None else None
    holds = tuple(plan.samples[0].stop) + ((tag,) if tag else ())

    def post(item: tuple) -> None:  # on the engine's loop thread
        if not loop.is_closed():
            loop.call_soon_threadsafe(queue.put_nowait, item)

    rids, futs = _submit_all(engine, plan, on_token=lambda k, t, lp, alt: post((k, t, lp, alt)))
    for k, f in enumerate(futs):
        f.add_done_callback(lambda f, k=k: post((k, None, None, None)))
    live = [_Live(StreamDecoder(tok)) for _ in futs]
    open_reqs = set(range(len(futs)))
    out = sse.EventWriter(request)
    finished = False
    try:
        await out.open()
        for k in range(len(futs)):  # OpenAI opens each chat choice with the role; completions echo the prompt
            if plan.endpoint == "chat":
                await out.send(_chunk(engine, plan, k, "", [], [], [], None, {"role": "assistant"}))
            elif plan.echo[k // plan.n]:
                await out.send(_chunk(engine, plan, k, plan.echo[k // plan.n], [], [], [], None))
        while open_reqs:
            items = await sse.next_stream_items(queue, request, out.resp)
            if items is None:  # the client went away
                break
            touched: dict[int, bool] = {}
            for k, t, lp, alt in items:
                if t is None:
                    touched[k] = True
                elif k in open_reqs:
                    s = live[k]
                    s.decoder.step(t)
                    s.logps.append(lp)
                    s.tops.append(alt or [])
                    if plan.logprobs:
                        s.pieces.append(tok.decode([t], skip_special_tokens=False))
                        s.starts.append(s.end)
                        s.end += len(tok.decode([t], skip_special_tokens=True))
                    touched.setdefault(k, False)
            for k, done in touched.items():
                if k not in open_reqs:
                    continue
                s = live[k]
                if done:
                    open_reqs.discard(k)
                    c = finish_choice(engine, plan, futs[k].result())
                    final = c.text if not c.tool_calls else ""
                    sent = s.decoder.text[: s.sent]
                    delta = final[len(sent) :] if final.startswith(sent) else ""
                    new = slice(s.sent_tokens, max(len(c.logprobs), s.sent_tokens))
                    calls = [{"index": i, **tc} for i, tc in enumerate(c.tool_calls)]
                    if delta or new.stop > new.start or calls:
                        await out.send(
                            _chunk(
                                engine,
                                plan,
                                k,
                                delta if (delta or plan.endpoint == "completions") else None,
                                c.pieces[new],
                                c.logprobs[new],
                                c.starts[new],
                                None,
                                {"tool_calls": calls} if calls else None,
                                c.tops[new],
                            )
                        )
                    await out.send(_chunk(engine, plan, k, None, [], [], [], c.finish_reason))
                    continue
                delta = s.advance(holds)
                n_new = 0
                if plan.logprobs:
                    while s.sent_tokens + n_new < len(s.starts) and s.starts[s.sent_tokens + n_new] < s.sent:
                        n_new += 1
                if delta or n_new:
                    new = slice(s.sent_tokens, s.sent_tokens + n_new)
                    s.sent_tokens += n_new
                    tops = alternatives(tok, s.tops[new], n_new) if plan.top_logprobs else None
                    await out.send(
                        _chunk(engine, plan, k, delta, s.pieces[new], s.logps[new], s.starts[new], None, None, tops)
                    )
        if not open_reqs:
            if plan.include_usage:
                outs = [f.result() for f in futs]
                await out.send({**plan.head(engine, chunk=True), "choices": [], "usage": _usage(plan, outs)})
            await out.done()
            finished = True
    except ConnectionError:  # the client went away mid-write
        pass
    except Exception as e:  # headers are sent: report in-band, as OpenAI does, then end the stream
        err = OpenAIError(f"{type(e).__name__}: {e}", status=500, kind="server_error")
        try:
            await out.send(err.body())
            await out.done()
        except ConnectionError:
            pass
    finally:
        if not finished:
            for rid, f in zip(rids, futs):
                if not f.done():
                    await asyncio.to_thread(engine.abort, rid)
    return out.resp


# ------------------------------------------------------------------------------------------ tokenize / detokenize
async def tokenize(engine: Engine, body: Any) -> tuple[int, dict]:
    """SGLang's ``/tokenize`` (``/v1/tokenize``, ``serving_tokenize.py``): ``prompt`` (a string or a list of them)
    or ``messages`` (rendered by the chat template as for a chat completion: ``add_generation_prompt`` defaults to
    true, ``tools`` and ``chat_template_kwargs`` are passed) -> ``{"tokens", "count", "max_model_len"}``; a list of
    prompts gives lists. ``add_special_tokens`` (default true) applies to ``prompt``."""
    try:
        if not isinstance(body, dict):
            raise OpenAIError("the request body must be a JSON object")
        tok = _require_tokenizer(engine, "completions")
        special = body.get("add_special_tokens", True)
        if not isinstance(special, bool):
            raise OpenAIError("add_special_tokens must be true or false", "add_special_tokens")
        known = {"model", "prompt", "messages", "tools", "tool_choice", "add_special_tokens", "add_generation_prompt",
                 "continue_final_message", "chat_template_kwargs", "reasoning_effort"}
        for key in body:
            if key not in known:
                raise OpenAIError(f"{key} is not a /tokenize field; send prompt or messages", key)
        if body.get("reasoning_effort") is not None:
            raise OpenAIError("reasoning_effort is not supported by this server: there is no reasoning parser",
                              "reasoning_effort")
        if body.get("messages") is not None:
            chat_body = {k: body[k] for k in ("messages", "tools", "tool_choice", "continue_final_message",
                                               "chat_template_kwargs") if body.get(k) is not None}
            add_gen = body.get("add_generation_prompt")
            ids = await asyncio.to_thread(_chat_ids, engine, chat_body, add_gen)
            tokens: Any = ids
            count: Any = len(ids)
        elif isinstance(body.get("prompt"), str):
            tokens = list(tok.encode(body["prompt"], add_special_tokens=special))
            count = len(tokens)
        elif isinstance(body.get("prompt"), list) and all(isinstance(x, str) for x in body["prompt"]):
            tokens = [list(tok.encode(x, add_special_tokens=special)) for x in body["prompt"]]
            count = [len(x) for x in tokens]
        else:
            raise OpenAIError("send prompt (a string or a list of strings) or messages", "prompt")
        return 200, {"tokens": tokens, "count": count, "max_model_len": engine.max_seq_len}
    except OpenAIError as e:
        return e.status, e.body()


def _chat_ids(engine: Engine, body: dict, add_generation_prompt: bool | None) -> list[int]:
    """The prompt ids ``/v1/chat/completions`` would generate from (``chat_plan``'s template rendering)."""
    req = validate(ChatRequest, body)
    check_supported(req, ENGINE_FIELDS)
    return _render_chat(engine, req, add_generation_prompt)


async def detokenize(engine: Engine, body: Any) -> tuple[int, dict]:
    """SGLang's ``/detokenize`` (``/v1/detokenize``): ``tokens`` (ids, or a list of id lists) -> ``{"text"}`` (a string,
    or a list of them); ``skip_special_tokens`` defaults to true, as SGLang's."""
    try:
        if not isinstance(body, dict):
            raise OpenAIError("the request body must be a JSON object")
        tok = _require_tokenizer(engine, "completions")
        for key in body:
            if key not in ("model", "tokens", "skip_special_tokens"):
                raise OpenAIError(f"{key} is not a /detokenize field; send tokens", key)
        skip = body.get("skip_special_tokens", True)
        if not isinstance(skip, bool):
            raise OpenAIError("skip_special_tokens must be true or false", "skip_special_tokens")
        raw = body.get("tokens")

        def ids_ok(x: Any) -> bool:
            return isinstance(x, list) and all(type(t) is int and 0 <= t < engine.vocab_size for t in x)

        if ids_ok(raw) and (not raw or isinstance(raw[0], int)):
            return 200, {"text": tok.decode(raw, skip_special_tokens=skip)}
        if isinstance(raw, list) and raw and all(ids_ok(x) for x in raw):
            return 200, {"text": [tok.decode(x, skip_special_tokens=skip) for x in raw]}
        raise OpenAIError(f"Invalid input: 'tokens' must be a list of token ids in [0, {engine.vocab_size}) or a list "
                          "of such lists", "tokens")
    except OpenAIError as e:
        return e.status, e.body()


_THREAD_BYTES = 64 << 10
"""Bodies larger than this are parsed and tokenised off the event loop."""


def make_view(engine: Engine, endpoint: str, tool_parser: str | ToolParser | ParseFn | None = None):
    """The aiohttp handler of ``POST /v1/completions`` or ``POST /v1/chat/completions`` for ``engine``.
    ``tool_parser``: a name in ``tool_parsers.PARSERS``, a ``ToolParser`` or a parse callable; None reads
    ``app[TOOL_PARSER_KEY]`` (default ``HERMES``)."""
    ep = endpoint.strip("/")
    if ep not in ("v1/completions", "v1/chat/completions"):
        raise ValueError(f"make_view: unknown endpoint {endpoint!r}")
    fixed = resolve(tool_parser) if tool_parser is not None else None

    def plan_of(raw: bytes, parser: Any) -> Plan:
        body = parse_body(raw)
        return completion_plan(engine, body) if ep == "v1/completions" else chat_plan(engine, body, parser)

    async def view(request: web.Request) -> web.StreamResponse:
        try:
            try:
                raw = await request.read()
            except web.HTTPRequestEntityTooLarge as e:
                limit = e.text.rstrip(".")
                raise OpenAIError(
                    f"the request body is too large ({limit}; make_app(client_max_size=...)); send a shorter prompt",
                    status=413, code="request_too_large",
                ) from None
            parser = fixed or request.app.get(TOOL_PARSER_KEY, HERMES)
            # large bodies are parsed, validated and tokenised off the event loop (a 20 MB prompt took 10 s)
            plan = await asyncio.to_thread(plan_of, raw, parser) if len(raw) > _THREAD_BYTES else plan_of(raw, parser)
            if plan.stream:
                return await stream(engine, plan, request)
            return web.json_response(await sse.while_connected(complete(engine, plan), request))
        except ConnectionResetError:  # the client left: complete() aborted its requests
            return web.Response(status=499)
        except OpenAIError as e:
            return web.json_response(e.body(), status=e.status)
        except EngineBusy as e:  # a full queue is transient: 503 + Retry-After, which the openai client retries
            return web.json_response(_busy(e).body(), status=503, headers={"Retry-After": str(control.RETRY_AFTER_S)})
        except EngineError as e:
            return web.json_response(OpenAIError(str(e)).body(), status=400)
        except Exception as e:  # never let one request take the server down
            err = OpenAIError(f"{type(e).__name__}: {e}", status=500, kind="server_error")
            return web.json_response(err.body(), status=500)

    return view


__all__ = [
    "MAX_N",
    "TOOL_PARSER_KEY",
    "Choice",
    "OpenAIError",
    "Plan",
    "chat_plan",
    "complete",
    "completion_plan",
    "finish_choice",
    "handle",
    "held_back",
    "make_view",
    "resolve_lora",
    "response_body",
    "served_model_name",
    "split_model",
    "stream",
]
