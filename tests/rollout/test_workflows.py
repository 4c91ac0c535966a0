"""Workflows against a scripted fake client and a tiny local char-level chat tokenizer."""

from __future__ import annotations

import asyncio
import string

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from rlcore.inference.protocol import ModelRequest, ModelResponse
from rlcore.rollout import workflows
from rlcore.rollout.rewards.math import gsm8k_reward

TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
EOS = "<|im_end|>"


def make_tokenizer() -> PreTrainedTokenizerFast:
    """One token per printable character; <|im_start|>/<|im_end|> specials; eos = <|im_end|>."""
    specials = ["<pad>", "<unk>", "<|im_start|>", EOS]
    vocab = {t: i for i, t in enumerate(specials + sorted(set(string.printable)))}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r".|\n"), behavior="isolated")
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", unk_token="<unk>", eos_token=EOS,
                                  additional_special_tokens=["<|im_start|>"])
    tok.chat_template = TEMPLATE
    return tok


TOK = make_tokenizer()


def enc(text: str) -> list[int]:
    return TOK(text, add_special_tokens=False)["input_ids"]


class ScriptedClient:
    """Returns the next scripted completion (text) for each request; tags tokens with ``version``."""

    def __init__(self, outputs: list[str], version: int = 0):
        self.outputs = list(outputs)
        self.version = version
        self.requests: list[ModelRequest] = []

    def get_version(self) -> int:
        return self.version

    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        self.requests.append(req)
        out = enc(self.outputs.pop(0))[: req.sampling.max_new_tokens]
        await asyncio.sleep(0)
        stop = "stop" if out and out[-1] in req.sampling.stop_token_ids else "length"
        return ModelResponse(list(req.input_ids), out, [-0.01 * (i + 1) for i in range(len(out))],
                             [self.version] * len(out), stop)


def run(coro):
    return asyncio.run(coro)


ITEM = {"messages": [{"role": "user", "content": "What is 2+3?"}], "answer": "5"}


@pytest.mark.parametrize("completion,reward", [("so #### 5" + EOS, 1.0), ("\\boxed{6}" + EOS, 0.0)])
def test_rlvr_row_layout_and_reward(completion, reward):
    client = ScriptedClient([completion], version=3)
    traj = run(workflows.rlvr(TOK, gsm8k_reward)(client, ITEM))
    prompt = enc(TOK.apply_chat_template(ITEM["messages"], tokenize=False, add_generation_prompt=True))
    out = enc(completion)
    assert client.requests[0].input_ids == prompt
    assert TOK.eos_token_id in client.requests[0].sampling.stop_token_ids
    assert traj["input_ids"][0].tolist() == prompt + out
    assert traj["loss_mask"][0].tolist() == [False] * len(prompt) + [True] * len(out)
    assert traj["versions"][0].tolist() == [-1] * len(prompt) + [3] * len(out)
    assert traj["turn_ids"][0].tolist() == [-1] * len(prompt) + [0] * len(out)
    assert torch.equal(traj["logprobs"][0, : len(prompt)], torch.zeros(len(prompt)))
    assert traj["rewards"].tolist() == [reward]


def test_feedback_suffix_is_end_of_turn_user_feedback_and_generation_prompt():
    suffix = workflows.feedback_suffix(TOK, "Try again.")
    assert TOK.decode(suffix) == EOS + "\n<|im_start|>user\nTry again." + EOS + "\n<|im_start|>assistant\n"


@given(max_turns=st.integers(1, 4), success_at=st.integers(1, 5), gamma=st.sampled_from([1.0, 0.5, 0.9]),
       eos=st.booleans())
@settings(max_examples=25)
def test_multi_turn_token_level_join_and_discount(max_turns, success_at, gamma, eos):
    end = EOS if eos else ""
    outputs = ["#### 5" + end if k == success_at else f"#### {k + 10}" + end for k in range(1, max_turns + 1)]
    client = ScriptedClient(outputs, version=1)
    cfg = workflows.MultiTurnConfig(max_turns=max_turns, turn_discount=gamma, feedback="Wrong.")
    traj = run(workflows.multi_turn(TOK, gsm8k_reward, turns=cfg)(client, ITEM))
    attempts = min(success_at, max_turns)
    assert len(client.requests) == attempts
    want = gamma ** (attempts - 1) if success_at <= max_turns else 0.0
    assert traj["rewards"].tolist() == pytest.approx([want])
    suffix = workflows.feedback_suffix(TOK, "Wrong.")
    for k in range(1, attempts):  # request k+1 = request k ++ its sample ++ suffix (eos not doubled)
        prev, out = client.requests[k - 1].input_ids, enc(outputs[k - 1])
        tail = suffix[1:] if eos else suffix
        assert client.requests[k].input_ids == prev + out + tail
    last_out = enc(outputs[attempts - 1])
    ids = traj["input_ids"][0].tolist()
    assert ids == client.requests[-1].input_ids + last_out
    mask, turns = traj["loss_mask"][0], traj["turn_ids"][0]
    assert int(mask.sum()) == sum(len(enc(o)) for o in outputs[:attempts])
    assert torch.equal(turns >= 0, mask) and torch.equal(traj["versions"][0] >= 0, mask)
    assert turns.max().item() == attempts - 1


def test_tool_integrated_runs_code_and_masks_its_output():
    first = "Compute it.\n```python\nprint(6*7)\n```\nBOGUS tail"
    client = ScriptedClient([first, "So \\boxed{42}" + EOS], version=2)
    item = {"prompt": "Q: 6*7?\n", "answer": "42"}
    traj = run(workflows.tool_integrated(TOK, gsm8k_reward)(client, item))
    assert len(client.requests) == 2
    second_input = TOK.decode(client.requests[1].input_ids)
    kept = "Compute it.\n```python\nprint(6*7)\n```"
    assert second_input == "Q: 6*7?\n" + kept + "\n```output\n42\n\n```\n"
    text = TOK.decode(traj["input_ids"][0])
    assert "BOGUS" not in text and text.endswith("So \\boxed{42}" + EOS)
    sampled = TOK.decode(traj["input_ids"][0][traj["loss_mask"][0]])
    assert sampled == kept + "So \\boxed{42}" + EOS  # tool output and prompt are masked
    assert traj["rewards"].tolist() == [1.0]
    assert set(traj["turn_ids"][0][traj["loss_mask"][0]].tolist()) == {0, 1}


def test_tool_integrated_reports_errors_to_the_model():
    client = ScriptedClient(["```python\nimport socket; socket.socket()\n```", "ok" + EOS])
    run(workflows.tool_integrated(TOK, gsm8k_reward)(client, {"prompt": "x", "answer": "1"}))
    assert "PermissionError: sandbox: socket" in TOK.decode(client.requests[1].input_ids)


def test_agent_rows_get_backward_discounted_final_reward():
    async def agent_fn(client, item):
        a = await client.agenerate(ModelRequest(input_ids=enc("hi")))
        await client.agenerate(ModelRequest(input_ids=enc("hi") + a.output_tokens + enc("more")))
        return 2.0

    traj = run(workflows.agent(agent_fn, turn_discount=0.5)(ScriptedClient(["ab", "cde"]), {}))
    assert traj["rewards"].tolist() == [1.0, 2.0]
    assert traj["loss_mask"].sum(1).tolist() == [2, 3]
    assert traj["turn_ids"].max(1).values.tolist() == [0, 1]


def test_group_concurrent_runs_and_incomplete_handling():
    async def episode(client, item):
        i = workflows.SAMPLE_IDX.get()
        await asyncio.sleep(0.01 * (3 - i))
        if i == item["none_at"]:
            return None
        if i == item["raise_at"]:
            raise ValueError("boom")
        from rlcore.data.trajectory import make_row
        return make_row([1, 2], [i + 3] * (i + 1), [-0.5] * (i + 1), [0] * (i + 1), float(i))

    g = workflows.group(episode, 4)
    traj = run(g(None, {"none_at": 1, "raise_at": 2}))
    assert traj["rewards"].tolist() == [0.0, 3.0]  # order of sample_idx, failures dropped
    assert run(workflows.group(episode, 4, drop_incomplete=True)(None, {"none_at": 1, "raise_at": -1})) is None

    async def always_fails(client, item):
        raise ConnectionError("engine down")

    with pytest.raises(ConnectionError):
        run(workflows.group(always_fails, 3)(None, {}))


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="turn_discount"):
        workflows.MultiTurnConfig(turn_discount=0.0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        workflows.WorkflowConfig(max_new_tokens=0)
    with pytest.raises(KeyError, match="messages"):
        workflows.prompt_ids(TOK, {"question": "x"})
    item = {"messages": [{"role": "user", "content": "ab"}], "prompt": "ab"}
    assert workflows.prompt_ids(TOK, item, "prompt") == enc("ab")
    assert len(workflows.prompt_ids(TOK, item)) > len(enc("ab"))  # auto prefers the templated chat
    with pytest.raises(KeyError, match="input_ids"):
        workflows.prompt_ids(TOK, item, "input_ids")


def test_base_model_tokenizer_without_chat_template():
    """A base model's tokenizer has no chat template: 'auto' falls back to the row's raw prompt, and rendering
    messages explicitly raises an error that names the fix."""
    import copy

    base = copy.deepcopy(TOK)
    base.chat_template = None
    item = {"messages": [{"role": "user", "content": "ab"}], "prompt": "ab"}
    assert workflows.prompt_ids(base, item) == enc("ab")
    assert len(workflows.prompt_ids(TOK, item)) > len(enc("ab"))  # with a template, messages still win
    with pytest.raises(ValueError, match="no chat template.*--tokenizer"):
        workflows.prompt_ids(base, item, "messages")
    with pytest.raises(ValueError, match="no chat template"):
        workflows.prompt_ids(base, {"messages": item["messages"]})


def test_gsm8k_rows_carry_a_raw_prompt_for_base_models(tmp_path):
    import json

    from rlcore.data import gsm8k

    f = tmp_path / "t.jsonl"
    f.write_text(json.dumps({"question": "What is 2+3?", "answer": "2+3=5\n#### 5"}) + "\n")
    (row,) = gsm8k.load(f)
    assert row["prompt"].startswith("Question: What is 2+3?") and row["prompt"].endswith("\nAnswer:")
    assert row["messages"][0]["content"] in row["prompt"]


# ------------------------------------------------------------------ rewards off the event loop
def test_a_blocking_reward_does_not_delay_another_tasks_generation():
    """A reward that blocks its thread (a verifier that shells out, no pool) runs off the event loop: another task's
    generation, which needs the loop, finishes while the reward still blocks. Told by events, not by a clock: the
    blocking reward waits (up to 60 s) for the other task to finish, which a reward run on the loop waits for in vain
    (the loop is frozen), on an idle machine or a loaded one."""
    import threading

    reward_started, other_done, released = threading.Event(), threading.Event(), []

    def slow_reward(text, item):
        if item.get("slow"):
            reward_started.set()
            released.append(other_done.wait(60))  # blocks its thread until the other task's generation finished
        return 1.0

    episode = workflows.rlvr(TOK, slow_reward, workflows.WorkflowConfig(max_new_tokens=4))

    class Ticking:
        """A client whose generation needs the loop: it starts once the blocking reward runs, then 20 steps of 10 ms."""

        def get_version(self):
            return 0

        async def agenerate(self, req):
            for _ in range(6000):  # bounded: 60 s
                if reward_started.is_set():
                    break
                await asyncio.sleep(0.01)
            for _ in range(20):
                await asyncio.sleep(0.01)
            out = enc("ok")
            return ModelResponse(list(req.input_ids), out, [-0.1] * len(out), [0] * len(out), "stop")

    async def main():
        other = asyncio.create_task(episode(Ticking(), {"prompt": "q2"}))  # generating: needs the loop
        slow = asyncio.create_task(episode(ScriptedClient(["abc"]), {"prompt": "q", "slow": True}))
        other = await other
        other_done.set()
        await slow
        return other

    other = asyncio.run(main())
    assert float(other["rewards"][0]) == 1.0 and reward_started.is_set()
    assert released == [True], "another task's generation waited behind a blocking reward"


def test_inline_reward_must_be_a_number():
    episode = workflows.rlvr(TOK, lambda text, item: "0.75", workflows.WorkflowConfig(max_new_tokens=4))
    with pytest.raises(TypeError, match="returned str '0.75'"):
        asyncio.run(episode(ScriptedClient(["abc"]), {"prompt": "q"}))
    episode = workflows.rlvr(TOK, lambda text, item: True, workflows.WorkflowConfig(max_new_tokens=4))
    assert float(asyncio.run(episode(ScriptedClient(["abc"]), {"prompt": "q"}))["rewards"][0]) == 1.0


def test_multi_turn_tool_and_agent_rows_mark_length_stops_truncated():
    """Every workflow marks a row whose last sample was cut at the length limit (no EOS) ``truncated``, as rlvr
    does, so GAE bootstraps it and ``GAEConfig.mask_no_eos_with_zero`` zeroes it. Regression: only rlvr set the
    key; multi-turn, tool-integrated, agent and agent-proxy rows counted as ended by EOS."""
    from rlcore.rollout.proxy import rows_to_trajectory

    one = workflows.MultiTurnConfig(max_turns=1)
    for end, want in ((EOS, False), ("", True)):
        traj = run(workflows.multi_turn(TOK, gsm8k_reward, turns=one)(ScriptedClient(["#### 5" + end]), ITEM))
        assert traj["truncated"].tolist() == [want]

    item, block = {"prompt": "x", "answer": "1"}, "```python\nprint(1)\n```"
    traj = run(workflows.tool_integrated(TOK, gsm8k_reward)(ScriptedClient([block, "ok" + EOS]), item))
    assert traj["truncated"].tolist() == [False]  # the answer after the tool call ended with EOS
    tight = workflows.WorkflowConfig(max_new_tokens=len(enc(block)))  # the budget ends right after the tool call
    traj = run(workflows.tool_integrated(TOK, gsm8k_reward, tight)(ScriptedClient([block, "ok" + EOS]), item))
    assert traj["truncated"].tolist() == [True]
    traj = run(workflows.tool_integrated(TOK, gsm8k_reward)(ScriptedClient(["no answer"]), item))
    assert traj["truncated"].tolist() == [True]

    class Stops:
        def __init__(self):
            self.reasons = iter(["length", "stop"])

        async def agenerate(self, req):
            return ModelResponse(list(req.input_ids), [5, 6], [-1.0, -1.0], [0, 0], next(self.reasons))

    async def agent_fn(client, item):
        a = await client.agenerate(ModelRequest(input_ids=enc("hi")))
        await client.agenerate(ModelRequest(input_ids=enc("hi") + a.output_tokens + enc("more")))
        return 1.0

    traj = run(workflows.agent(agent_fn)(Stops(), {}))
    assert traj["truncated"].tolist() == [True, False]

    row = {"input_ids": [1, 2, 3], "loss_mask": [0, 1, 1], "logprobs": [0.0, -1.0, -1.0], "versions": [-1, 0, 0],
           "turn_ids": [-1, 0, 0], "reward": 1.0, "original_reward": None}
    traj = rows_to_trajectory({"a": {**row, "stop_reason": "length"}, "b": {**row, "stop_reason": "stop"}})
    assert traj["truncated"].tolist() == [True, False]
