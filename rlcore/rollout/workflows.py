"""Rollout workflows: async episode functions that turn one dataset item into a trajectory dict.

An *episode* is ``async def episode(client, item) -> dict[str, Tensor] | None`` (docs/spec/system.md §1.1).
``client`` has ``async agenerate(ModelRequest) -> ModelResponse`` and ``get_version()``
(rlcore.inference.client.EngineClient, or any fake with the same two methods). ``item`` is one
dataset row. The result is a trajectory dict (rlcore.data.trajectory): ``(b l)`` token tensors with
``loss_mask`` True exactly on sampled tokens, behaviour ``logprobs`` and per-token ``versions`` (−1 on
prompt, feedback and tool tokens), ``turn_ids`` and one reward per row; ``None`` rejects the item.

The factories below build episodes from a tokenizer and a reward function
``reward_fn(completion: str, item) -> float`` (e.g. rlcore.rollout.rewards.math.gsm8k_reward). Rewards always
run off the event loop: in a ``RewardPool`` when one is given (processes, hard timeout), else on a thread;
they must return an int, float or bool (``rewards.pool.as_reward``; strings are rejected):

- ``rlvr``: single-turn RL with a verifiable reward (docs/spec/system.md §1.5).
- ``multi_turn``: retry with feedback until the reward is non-zero, reward discounted per extra attempt
  (docs/spec/system.md §1.6, docs/spec/algorithms.md §14.4). Turns are joined at the TOKEN level: the next prompt is the previous
  prompt ++ the sampled tokens ++ a feedback suffix computed once from the chat template.
- ``tool_integrated``: the model writes ```python blocks; each block is run in the sandbox and its output
  is appended as masked tokens before generation continues.
- ``agent``: a hook for agent code that makes its own model calls through a recording client; every call
  becomes one row (individual export style) with the final reward discounted backwards.
- ``group``: runs an episode ``group_size`` times concurrently on one item (docs/spec/system.md §1.4).

Items name their prompt as ``input_ids`` (token ids, used as is), ``messages`` (chat-templated with a
generation prompt) or ``prompt`` (raw text, tokenized without the template), checked in that order.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import re
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from rlcore.data import trajectory
from rlcore.inference.protocol import ModelRequest, ModelResponse, SamplingParams
from rlcore.rollout.rewards import inline as _inline_rewards
from rlcore.rollout.rewards import pool as _reward_types
from rlcore.rollout.rewards import sandbox

log = logging.getLogger(__name__)

Traj = dict[str, torch.Tensor]
Episode = Callable[[Any, Mapping], Awaitable[Traj | None]]
RewardFn = Callable[[str, Mapping], float]

SAMPLE_IDX: contextvars.ContextVar[int] = contextvars.ContextVar("rlcore_sample_idx", default=0)
"""Index of the current run inside its group (set by ``group``)."""
TASK_ID: contextvars.ContextVar[str] = contextvars.ContextVar("rlcore_task_id", default="-")
"""Id of the current rollout task (set by the controller); used in warnings."""


@dataclass(frozen=True)
class WorkflowConfig:
    """Sampling settings shared by every workflow."""

    max_new_tokens: int = 256
    """Generation budget per episode (per turn for multi_turn; in total for tool_integrated)."""
    max_tokens: int | None = None
    """Cap on prompt + everything generated; None means no cap beyond max_new_tokens."""
    temperature: float = 1.0
    """Sampling temperature (0 = greedy)."""
    top_p: float = 1.0
    """Nucleus mass in (0, 1]."""
    top_k: int = -1
    """Top-k cut, -1 keeps all tokens."""
    stop_token_ids: tuple[int, ...] = ()
    """Extra stop ids; the tokenizer's eos and pad ids are always added."""
    prompt_field: Literal["auto", "input_ids", "messages", "prompt"] = "auto"
    """Which item field is the prompt; auto takes the first present of input_ids, messages, prompt."""

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.max_tokens is not None and self.max_tokens < 2:
            raise ValueError(f"max_tokens must be None or >= 2, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.prompt_field not in ("auto", "input_ids", "messages", "prompt"):
            raise ValueError(f"prompt_field must be auto, input_ids, messages or prompt, got {self.prompt_field!r}")

    def sampling(self, tokenizer: Any, max_new_tokens: int | None = None) -> SamplingParams:
        """SamplingParams with stop ids = configured ∪ {eos, pad} of ``tokenizer``."""
        stops = list(self.stop_token_ids)
        for tid in (getattr(tokenizer, "eos_token_id", None), getattr(tokenizer, "pad_token_id", None)):
            if tid is not None and tid not in stops:
                stops.append(int(tid))
        return SamplingParams(
            max_new_tokens=max_new_tokens or self.max_new_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            stop_token_ids=tuple(stops),
        )


@dataclass(frozen=True)
class MultiTurnConfig:
    """Retry-with-feedback settings (docs/spec/system.md §1.6)."""

    max_turns: int = 2
    """Attempts per episode (>= 1)."""
    turn_discount: float = 1.0
    """Reward factor per extra attempt, in (0, 1]: success at attempt k earns r * turn_discount**(k-1)."""
    feedback: str = "Your answer is either wrong or not parsable. Please think again and give a corrected answer."
    """User message inserted after a wrong attempt."""

    def __post_init__(self):
        if self.max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {self.max_turns}")
        if not 0 < self.turn_discount <= 1:
            raise ValueError(f"turn_discount must be in (0, 1], got {self.turn_discount}")


@dataclass(frozen=True)
class ToolConfig:
    """Tool-integrated reasoning with a Python executor."""

    max_tool_calls: int = 4
    """Code blocks executed per episode; generation after the last one runs without tools."""
    max_output_chars: int = 1024
    """Tool output (stdout, else the last stderr line) is cut to this many characters."""
    sandbox: sandbox.SandboxConfig = field(default_factory=lambda: sandbox.SandboxConfig(timeout_s=5.0, cpu_s=5))
    """Limits of each code execution."""

    def __post_init__(self):
        if self.max_tool_calls < 0:
            raise ValueError(f"max_tool_calls must be >= 0, got {self.max_tool_calls}")


# ----------------------------------------------------------------------------- tokenizer helpers
def _encode(tokenizer: Any, text: str) -> list[int]:
    return [int(t) for t in tokenizer(text, add_special_tokens=False)["input_ids"]]


def has_chat_template(tokenizer: Any) -> bool:
    """Whether ``tokenizer`` carries a chat template (base models usually do not)."""
    return bool(getattr(tokenizer, "chat_template", None))


def chat_text(tokenizer: Any, messages: Sequence[Mapping], *, add_generation_prompt: bool) -> str:
    """The chat template rendered as text (works on transformers 4.x and 5.x)."""
    if not has_chat_template(tokenizer):
        raise ValueError(
            f"the tokenizer ({type(tokenizer).__name__}, {getattr(tokenizer, 'name_or_path', '?')!r}) has no chat "
            "template, so chat messages cannot be rendered; use an instruct/chat model or a tokenizer directory "
            "with a chat_template (--tokenizer DIR), or give the data rows a raw 'prompt' field"
        )
    return tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=add_generation_prompt)


def prompt_ids(tokenizer: Any, item: Mapping, field: str = "auto") -> list[int]:
    """Prompt token ids of ``item`` from ``input_ids``, ``messages`` (templated) or ``prompt`` (raw text);
    ``field="auto"`` takes the first of these present (``prompt`` before ``messages`` when the tokenizer has no
    chat template), otherwise exactly the named one."""
    keys = ("input_ids", "messages", "prompt") if field == "auto" else (field,)
    key = next((k for k in keys if k in item), None)
    if key == "messages" and field == "auto" and "prompt" in item and not has_chat_template(tokenizer):
        key = "prompt"  # a base model's tokenizer: the row's raw prompt text instead of templated messages
    if key == "input_ids":
        return [int(t) for t in item["input_ids"]]
    if key == "messages":
        return _encode(tokenizer, chat_text(tokenizer, item["messages"], add_generation_prompt=True))
    if key == "prompt":
        return _encode(tokenizer, str(item["prompt"]))
    raise KeyError(f"item needs {' or '.join(repr(k) for k in keys)} (prompt_field={field!r}); it has {sorted(item)}")


def feedback_suffix(tokenizer: Any, feedback: str) -> list[int]:
    """Tokens that close an assistant turn, add the user ``feedback`` and open the next assistant turn.

    Computed once from the chat template: render ``[assistant: MARK, user: feedback]`` with a
    generation prompt and keep the text after MARK (so the end-of-turn token(s) are included and no
    system prompt is repeated). Raises ValueError if the template drops the assistant content.
    """
    mark = "\u2063MARK\u2063"
    convo = [{"role": "assistant", "content": mark}, {"role": "user", "content": feedback}]
    text = chat_text(tokenizer, convo, add_generation_prompt=True)
    pos = text.rfind(mark)
    if pos < 0:
        mark = "MARKER"
        convo[0]["content"] = mark
        text = chat_text(tokenizer, convo, add_generation_prompt=True)
        pos = text.rfind(mark)
    if pos < 0:
        raise ValueError("the chat template does not render assistant content; cannot build a feedback suffix")
    return _encode(tokenizer, text[pos + len(mark) :])


async def _score(reward_fn: RewardFn, text: str, item: Mapping, pool: Any | None) -> float:
    """Score off the event loop: in ``pool`` (worker processes, hard timeout) when given, else on a thread
    (``rewards.inline``: the calls of one loop tick share a thread-pool job), so a slow or blocking reward never
    freezes the other rollouts. The result must be an int, float or bool (``rewards.pool.as_reward``): a string such
    as ``"0.75"`` raises TypeError, which rejects that run."""
    if pool is not None:
        sample_id = f"{TASK_ID.get()}/{SAMPLE_IDX.get()}"
        return float(await pool.acall(reward_fn, text, dict(item), sample_id=sample_id))
    value = await _inline_rewards.score(reward_fn, text, item)
    return _reward_types.as_reward(value, reward_fn)


class _Row:
    """A growing single row: token ids with loss mask, behaviour log-probs, versions and turn ids."""

    def __init__(self, prompt: Sequence[int]):
        self.ids = [int(t) for t in prompt]
        self.mask = [False] * len(self.ids)
        self.logp = [0.0] * len(self.ids)
        self.ver = [-1] * len(self.ids)
        self.turn = [-1] * len(self.ids)

    def add_fixed(self, ids: Sequence[int]) -> None:
        self.ids += [int(t) for t in ids]
        self.mask += [False] * len(ids)
        self.logp += [0.0] * len(ids)
        self.ver += [-1] * len(ids)
        self.turn += [-1] * len(ids)

    def add_sampled(self, ids: Sequence[int], logp: Sequence[float], ver: Sequence[int], turn: int) -> None:
        if not len(ids) == len(logp) == len(ver):
            raise ValueError(f"engine returned {len(ids)} tokens, {len(logp)} log-probs and {len(ver)} versions")
        self.ids += [int(t) for t in ids]
        self.mask += [True] * len(ids)
        self.logp += [float(x) for x in logp]
        self.ver += [int(v) for v in ver]
        self.turn += [turn] * len(ids)

    def to_traj(self, reward: float, truncated: bool | None = None) -> Traj:
        """The row as a trajectory ``(1, l)``; ``truncated`` (its last sample was cut at the length limit, or the
        episode ran out of budget before it ended) adds the ``(1,)`` bool key GAE bootstraps and
        ``GAEConfig.mask_no_eos_with_zero`` zeroes (``trajectory.make_row``'s); None leaves it out."""
        ids = torch.tensor(self.ids, dtype=torch.long)[None]
        row = {
            "input_ids": ids,
            "attention_mask": torch.ones_like(ids, dtype=torch.bool),
            "loss_mask": torch.tensor(self.mask, dtype=torch.bool)[None],
            "logprobs": torch.tensor(self.logp, dtype=torch.float32)[None],
            "versions": torch.tensor(self.ver, dtype=torch.long)[None],
            "turn_ids": torch.tensor(self.turn, dtype=torch.long)[None],
            "rewards": torch.tensor([float(reward)], dtype=torch.float32),
        }
        if truncated is not None:
            row["truncated"] = torch.tensor([bool(truncated)])
        return row


# ----------------------------------------------------------------------------- workflows
@dataclass(frozen=True)
class GroupEpisode:
    """An episode that samples a whole group of one prompt itself (``group`` passes it through instead of running
    it ``group_size`` times); called like any episode, it returns the group's ``(g, l)`` rows (``g <= group_size``:
    samples whose reward failed are dropped, as ``group`` drops failed runs) or None."""

    run: Episode
    group_size: int

    async def __call__(self, client: Any, item: Mapping) -> Traj | None:
        return await self.run(client, item)


async def _generate_group(client: Any, req: ModelRequest, n: int) -> list[ModelResponse]:
    """``client.agenerate_group(req, n)`` when the client has it (one engine call), else ``n`` concurrent
    ``agenerate`` calls."""
    if hasattr(client, "agenerate_group"):
        return await client.agenerate_group(req, n)
    return list(await asyncio.gather(*(client.agenerate(req) for _ in range(n))))


def rlvr(tokenizer: Any, reward_fn: RewardFn, cfg: WorkflowConfig = WorkflowConfig(), *, reward_pool: Any = None,
         group_size: int | None = None) -> Episode:
    """Single-turn RLVR episode: one ``agenerate``, reward on the decoded completion, one ``(1, l)`` row.

    ``reward_pool`` (rlcore.rollout.rewards.pool.RewardPool) runs ``reward_fn`` in a worker process with a timeout.
    ``group_size``: a :class:`GroupEpisode` instead, which asks for the group's ``group_size`` samples in one engine
    call (``EngineClient.agenerate_group``: the prompt once, its KV shared) and scores them together: the same
    samples, rewards and rows as ``group(rlvr(...), group_size)`` with one request, task and reward hop per group
    instead of per sample (the rollout loop's Python cost, which bounds small-model jobs).
    """
    sampling = cfg.sampling(tokenizer)
    if group_size is not None:
        if group_size < 1:
            raise ValueError(f"rlvr: group_size must be >= 1, got {group_size}")

        async def group_episode(client: Any, item: Mapping) -> Traj | None:
            prompt = prompt_ids(tokenizer, item, cfg.prompt_field)
            req = ModelRequest(input_ids=prompt, sampling=sampling, max_tokens=cfg.max_tokens)
            resps = await _generate_group(client, req, group_size)
            texts = [tokenizer.decode(r.output_tokens, skip_special_tokens=True) for r in resps]

            async def scored(i: int, text: str) -> float:
                SAMPLE_IDX.set(i)  # each gathered task runs in its own copy of the context
                return await _score(reward_fn, text, item, reward_pool)

            rewards = await asyncio.gather(*(scored(i, t) for i, t in enumerate(texts)), return_exceptions=True)
            for e in rewards:
                if isinstance(e, BaseException) and not isinstance(e, Exception):
                    raise e
            ok = [(r, float(w)) for r, w in zip(resps, rewards) if not isinstance(w, BaseException)]
            failed = [w for w in rewards if isinstance(w, BaseException)]
            if failed and not ok:
                raise failed[0]
            for e in failed:
                log.warning("task %s: one sample of the group failed its reward: %s: %s", TASK_ID.get(),
                            type(e).__name__, e)
            # the rows of the group in one pass: the same tensors as concat([make_row(...) for each sample])
            return trajectory.make_group(
                prompt, [(r.output_tokens, r.output_logprobs, r.output_versions) for r, _ in ok], [w for _, w in ok],
                truncated=[r.stop_reason == "length" for r, _ in ok],
            ) if ok else None

        return GroupEpisode(group_episode, group_size)

    async def episode(client: Any, item: Mapping) -> Traj | None:
        prompt = prompt_ids(tokenizer, item, cfg.prompt_field)
        resp = await client.agenerate(ModelRequest(input_ids=prompt, sampling=sampling, max_tokens=cfg.max_tokens))
        text = tokenizer.decode(resp.output_tokens, skip_special_tokens=True)
        reward = await _score(reward_fn, text, item, reward_pool)
        # a length stop (no EOS) marks the row truncated: GAE bootstraps it, --gae.mask-no-eos-with-zero zeroes it
        return trajectory.make_row(prompt, resp.output_tokens, resp.output_logprobs, resp.output_versions, reward,
                                   truncated=resp.stop_reason == "length")

    return episode


def multi_turn(
    tokenizer: Any,
    reward_fn: RewardFn,
    cfg: WorkflowConfig = WorkflowConfig(),
    turns: MultiTurnConfig = MultiTurnConfig(),
    *,
    reward_pool: Any = None,
) -> Episode:
    """Retry-with-feedback episode: one ``(1, l)`` row holding every attempt (``turn_ids`` = attempt index).

    The sequence only ever grows by tokens: request k+1's input is request k's input ++ its sampled
    tokens ++ the feedback suffix (without its first token when the sample already ended with that
    end-of-turn token). Final reward = last reward * turn_discount**(attempts - 1).
    """
    sampling = cfg.sampling(tokenizer)
    suffix = feedback_suffix(tokenizer, turns.feedback)

    async def episode(client: Any, item: Mapping) -> Traj | None:
        prompt = prompt_ids(tokenizer, item, cfg.prompt_field)
        row = _Row(prompt)
        inputs = list(prompt)
        reward, discount = 0.0, 1.0
        for turn in range(turns.max_turns):
            resp = await client.agenerate(ModelRequest(input_ids=inputs, sampling=sampling, max_tokens=cfg.max_tokens))
            if inputs[: len(row.ids)] != row.ids:
                raise RuntimeError("multi_turn: the running sequence is not a prefix of the next request")
            row.add_fixed(inputs[len(row.ids) :])  # feedback tokens of this turn (masked)
            row.add_sampled(resp.output_tokens, resp.output_logprobs, resp.output_versions, turn)
            text = tokenizer.decode(resp.output_tokens, skip_special_tokens=True)
            reward = await _score(reward_fn, text, item, reward_pool)
            if reward != 0 or turn + 1 == turns.max_turns:
                break
            out = list(resp.output_tokens)
            tail = suffix[1:] if out and suffix and out[-1] == suffix[0] else suffix
            nxt = inputs + out + tail
            if cfg.max_tokens is not None and len(nxt) >= cfg.max_tokens:
                break
            inputs = nxt
            discount *= turns.turn_discount
        # the last attempt cut at the length limit (no EOS): GAE bootstraps the row, mask_no_eos_with_zero zeroes it
        return row.to_traj(reward * discount, truncated=resp.stop_reason == "length")

    return episode


_CODE = re.compile(r"```python[^\n]*\n(.*?)```", re.DOTALL)


def _first_block_end(tokenizer: Any, tokens: Sequence[int]) -> int | None:
    """Smallest k such that ``decode(tokens[:k])`` contains a complete ```python block, or None."""
    dec = lambda k: tokenizer.decode(tokens[:k], skip_special_tokens=True)  # noqa: E731
    if not _CODE.search(dec(len(tokens))):
        return None
    lo, hi = 1, len(tokens)
    while lo < hi:
        mid = (lo + hi) // 2
        if _CODE.search(dec(mid)):
            hi = mid
        else:
            lo = mid + 1
    return lo


def _tool_output(res: sandbox.SandboxResult, limit: int) -> str:
    if res.timed_out:
        out = "TimeoutError: execution timed out"
    elif res.returncode != 0:
        lines = [ln for ln in res.stderr.strip().splitlines() if ln.strip()]
        out = lines[-1] if lines else f"process exited with code {res.returncode}"
    else:
        out = res.stdout
    return out[:limit]


def tool_integrated(
    tokenizer: Any,
    reward_fn: RewardFn,
    cfg: WorkflowConfig = WorkflowConfig(),
    tools: ToolConfig = ToolConfig(),
    *,
    reward_pool: Any = None,
) -> Episode:
    """Tool-integrated reasoning: generate; when a ```python block closes, cut the sample right after it,
    run the code in the sandbox, append "```output ...```" tokens (masked) and continue.

    Tokens the model sampled after a closed block in the same request are discarded (never trained on).
    ``max_new_tokens`` is the total budget of sampled tokens. The reward sees the model-written text only
    (segments joined), so a printed answer must still be restated by the model. ``turn_ids`` = segment index.
    """
    async def episode(client: Any, item: Mapping) -> Traj | None:
        prompt = prompt_ids(tokenizer, item, cfg.prompt_field)
        row = _Row(prompt)
        inputs = list(prompt)
        written: list[int] = []
        budget = cfg.max_new_tokens
        truncated = False
        for seg in range(tools.max_tool_calls + 1):
            req = ModelRequest(input_ids=inputs, sampling=cfg.sampling(tokenizer, budget), max_tokens=cfg.max_tokens)
            resp = await client.agenerate(req)
            out, lp, ver = list(resp.output_tokens), list(resp.output_logprobs), list(resp.output_versions)
            cut = _first_block_end(tokenizer, out) if seg < tools.max_tool_calls else None
            if cut is not None:
                out, lp, ver = out[:cut], lp[:cut], ver[:cut]
            row.add_sampled(out, lp, ver, seg)
            written += out
            budget -= len(out)
            # truncated: the last segment hit the length limit, or a tool call was cut off by the budget or context
            truncated = cut is not None or resp.stop_reason == "length"
            if cut is None or budget <= 0:
                break
            code = _CODE.findall(tokenizer.decode(out, skip_special_tokens=True))[0]
            res = await asyncio.to_thread(sandbox.run_python, code, cfg=tools.sandbox)
            obs = _encode(tokenizer, "\n```output\n" + _tool_output(res, tools.max_output_chars) + "\n```\n")
            inputs = inputs + out + obs
            if cfg.max_tokens is not None and len(inputs) >= cfg.max_tokens:
                break
            row.add_fixed(obs)
        text = tokenizer.decode(written, skip_special_tokens=True)
        reward = await _score(reward_fn, text, item, reward_pool)
        return row.to_traj(reward, truncated=truncated)

    return episode


class RecordingClient:
    """Wraps a client and records every ``agenerate`` call (request input and response) in order."""

    def __init__(self, client: Any):
        self.client = client
        self.calls: list[ModelResponse] = []

    def get_version(self) -> int:
        return self.client.get_version()

    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        resp = await self.client.agenerate(req)
        self.calls.append(resp)
        return resp


def agent(run: Callable[[Any, Mapping], Awaitable[float | None]], *, turn_discount: float = 1.0) -> Episode:
    """Agent workflow hook: ``run(client, item) -> final reward | None`` makes its own model calls.

    ``run`` gets a ``RecordingClient``; each of its calls becomes one row (prompt masked, output
    trainable, ``turn_ids`` = call index). The final reward ``r`` is propagated backwards: row i of K
    gets ``turn_discount**(K-1-i) * r`` (docs/spec/algorithms.md §14.4 with only a final reward). ``None`` or no
    calls rejects the item. For black-box agents that speak the OpenAI API use the agent proxy
    (rlcore.rollout.proxy) instead.
    """
    if not 0 < turn_discount <= 1:
        raise ValueError(f"turn_discount must be in (0, 1], got {turn_discount}")

    async def episode(client: Any, item: Mapping) -> Traj | None:
        rec = RecordingClient(client)
        reward = await run(rec, item)
        if reward is None or not rec.calls:
            return None
        k = len(rec.calls)
        rows = []
        for i, resp in enumerate(rec.calls):
            row = _Row(resp.input_tokens)
            row.add_sampled(resp.output_tokens, resp.output_logprobs, resp.output_versions, i)
            rows.append(row.to_traj(float(reward) * turn_discount ** (k - 1 - i), truncated=resp.stop_reason == "length"))
        return trajectory.concat(rows)

    return episode


def group(episode: Episode, group_size: int, *, drop_incomplete: bool = False) -> Episode:
    """Run ``episode`` ``group_size`` times concurrently on one item and concatenate the rows (docs/spec/system.md §1.4).

    Each run sees its index in ``SAMPLE_IDX``. Runs that return None or raise are dropped (logged); if
    all runs raise, the first exception is re-raised (so the controller can retry on engine failures);
    if none is left the group is None; with ``drop_incomplete`` any missing run makes the group None.
    """
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    if isinstance(episode, GroupEpisode):  # it samples the group itself
        if episode.group_size != group_size:
            raise ValueError(f"the episode samples groups of {episode.group_size}, the controller asks for "
                             f"{group_size}; build it with the controller's group_size")

        async def whole(client: Any, item: Mapping) -> Traj | None:
            rows = await episode(client, item)
            if rows is None or (drop_incomplete and int(rows["input_ids"].shape[0]) < group_size):
                return None
            return rows

        return whole

    async def run(client: Any, item: Mapping) -> Traj | None:
        async def one(i: int) -> Traj | None:
            SAMPLE_IDX.set(i)
            return await episode(client, item)

        results = await asyncio.gather(*(asyncio.create_task(one(i)) for i in range(group_size)),
                                       return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        for e in errors:
            if not isinstance(e, Exception):
                raise e
        if errors and len(errors) == group_size:
            raise errors[0]
        for e in errors:
            log.warning("task %s: one run of the group failed: %s: %s", TASK_ID.get(), type(e).__name__, e)
        valid = [r for r in results if r is not None and not isinstance(r, BaseException)]
        if not valid or (drop_incomplete and len(valid) < group_size):
            return None
        return trajectory.concat(valid)

    return run
