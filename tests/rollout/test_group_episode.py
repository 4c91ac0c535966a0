"""A GRPO group from one engine call: rlvr(group_size=G), EngineClient.agenerate_group, the coalescer's batches."""

from __future__ import annotations

import asyncio

import pytest
import torch

from rlcore import tiny
from rlcore.data.loader import PromptLoader
from rlcore.inference import client as engine_client
from rlcore.inference import coalesce
from rlcore.inference import engine as engine_lib
from rlcore.inference.protocol import ModelRequest, SamplingParams
from rlcore.rollout import controller, workflows

TOK = tiny.load_tokenizer(str(tiny.COUNTDOWN_TINY_DIR))
ITEMS = [{"prompt": f"{i % 10}{(i * 7) % 10}{(i * 3) % 10}:{i % 13}="} for i in range(64)]


def reward(completion: str, item: dict) -> float:
    if completion.startswith("*"):
        raise ValueError("reward refuses completions that start with '*'")
    return float(len(completion) % 2)


def teacher_logp(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits.float()
    return torch.log_softmax(logits[0, :-1], -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]


def rows_of(groups: list[dict]) -> list[dict]:
    out = []
    for g in groups:
        for i in range(g["input_ids"].shape[0]):
            n = int(g["attention_mask"][i].sum())
            out.append({k: (v[i, :n] if v.dim() == 2 else v[i]) for k, v in g.items()})
    return out


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_group_episode_rows_match_the_per_sample_path_and_the_weights(temperature):
    """Greedy: the group episode's rows equal group(rlvr) row for row; sampled: every token's log-prob is the
    engine weights' (teacher-forced) and every reward is reward_fn of the decoded sample."""
    model = tiny.build_model(TOK, seed=4)
    wcfg = workflows.WorkflowConfig(max_new_tokens=6, temperature=temperature)
    got = {}
    for mode in ("group", "per_sample"):
        eng = engine_lib.Engine(model, engine_lib.EngineConfig(max_batch=64, max_seq_len=32, device="cpu",
                                                               dtype="float32", seed=0))
        with eng:
            ep = workflows.rlvr(TOK, lambda c, it: float(len(c) % 2), wcfg,
                                group_size=4 if mode == "group" else None)
            cfg = controller.RolloutConfig(batch_size=3, group_size=4, max_staleness=0)
            with controller.RolloutController(engine_client.EngineClient(eng), ep, PromptLoader(ITEMS, seed=1),
                                              cfg) as ctl:
                got[mode] = rows_of(ctl.prepare_batch())
    assert len(got["group"]) == len(got["per_sample"]) == 12
    for r in got["group"]:
        ids, gen = r["input_ids"].tolist(), r["loss_mask"]
        lp = torch.cat([torch.zeros(1), teacher_logp(model, ids)])  # token t's log-prob given tokens < t
        torch.testing.assert_close(r["logprobs"][gen], lp[gen], atol=2e-5, rtol=0)
        text = TOK.decode(r["input_ids"][gen].tolist(), skip_special_tokens=True)
        assert float(r["rewards"]) == float(len(text) % 2)
    if temperature == 0.0:
        key = lambda r: (tuple(r["input_ids"].tolist()), float(r["rewards"]))  # noqa: E731
        assert sorted(map(key, got["group"])) == sorted(map(key, got["per_sample"]))


def test_a_failing_reward_drops_only_its_sample_and_all_failing_raises():
    class Fixed:
        def get_version(self):
            return 0

        async def agenerate(self, req):
            raise AssertionError("agenerate_group must be used")

        async def agenerate_group(self, req, n):
            from rlcore.inference.protocol import ModelResponse
            outs = [TOK("*1").input_ids, TOK("12").input_ids, TOK("*3").input_ids][:n]
            return [ModelResponse(input_tokens=list(req.input_ids), output_tokens=o, output_logprobs=[-1.0] * len(o),
                                  output_versions=[0] * len(o), stop_reason="stop") for o in outs]

    ep = workflows.rlvr(TOK, reward, workflows.WorkflowConfig(max_new_tokens=4), group_size=3)
    rows = asyncio.run(ep(Fixed(), ITEMS[0]))
    assert rows["input_ids"].shape[0] == 1 and float(rows["rewards"][0]) == 0.0  # "12": even length, kept alone
    ep1 = workflows.rlvr(TOK, reward, workflows.WorkflowConfig(max_new_tokens=4), group_size=1)
    with pytest.raises(ValueError, match="refuses"):
        asyncio.run(ep1(Fixed(), ITEMS[0]))
    with pytest.raises(ValueError, match="samples groups of 3"):
        workflows.group(ep, 4)
    whole = workflows.group(ep, 3, drop_incomplete=True)
    assert asyncio.run(whole(Fixed(), ITEMS[0])) is None  # two of three failed: incomplete


class Scripted:
    """An in-process transport answering /generate from a script; records every payload."""

    def __init__(self, answers):
        self.answers, self.payloads = list(answers), []

    async def handle(self, endpoint, payload=None):
        self.payloads.append(payload)
        return 200, self.answers.pop(0)


def body(tokens, reason, versions):
    return {"output_ids": tokens, "meta_info": {
        "finish_reason": {"type": reason}, "output_token_logprobs": [[-0.5, t, None] for t in tokens],
        "completion_tokens": len(tokens), "output_token_versions": versions}}


def test_agenerate_group_sends_one_batch_and_resumes_an_aborted_sample_alone():
    tr = Scripted([
        [body([5, 6, 7], "length", [0, 0, 0]), body([8], "abort", [0])],  # sample 1 cut by a pause
        body([9, 10], "length", [1, 1]),  # its continuation, under version 1
    ])
    cli = engine_client.EngineClient(tr)

    async def go():
        cli.set_version(0)
        cli.pause()
        task = asyncio.ensure_future(cli.agenerate_group(
            ModelRequest(input_ids=[1, 2], sampling=SamplingParams(max_new_tokens=3)), 2))
        await asyncio.sleep(0.05)
        cli.resume()  # the batch goes out at version 0; the abort is "expected" once the version moves
        await asyncio.sleep(0)
        cli.set_version(1)
        return await task

    a, b = asyncio.run(go())
    assert tr.payloads[0]["input_ids"] == [[1, 2], [1, 2]] and tr.payloads[0]["sampling_params"]["max_new_tokens"] == 3
    assert tr.payloads[1]["input_ids"] == [1, 2, 8] and tr.payloads[1]["sampling_params"]["max_new_tokens"] == 2
    assert a.output_tokens == [5, 6, 7] and a.output_versions == [0, 0, 0]
    assert b.output_tokens == [8, 9, 10] and b.output_versions == [0, 1, 1] and b.stop_reason == "length"


def test_the_coalescer_merges_a_group_call_with_single_calls_and_splits_the_answers():
    co = coalesce.CoalescingHTTP("http://127.0.0.1:1")
    sent = []

    async def fake_http(method, endpoint, payload):
        sent.append(payload)
        return 200, [{"i": x[0]} for x in payload["input_ids"]]

    co._http = fake_http
    sp = {"sampling_params": {"max_new_tokens": 2}, "return_logprob": True}

    async def go():
        return await asyncio.gather(co.handle("/generate", {"input_ids": [1], **sp}),
                                    co.handle("/generate", {"input_ids": [[2], [3], [4]], **sp}),
                                    co.handle("/generate", {"input_ids": [5], **sp}))

    one, grp, last = asyncio.run(go())
    assert len(sent) == 1 and sent[0]["input_ids"] == [[1], [2], [3], [4], [5]]
    assert one == (200, {"i": 1}) and grp == (200, [{"i": 2}, {"i": 3}, {"i": 4}]) and last == (200, {"i": 5})


def test_a_group_sample_that_fails_on_resubmission_is_named_by_its_index():
    class Failing(Scripted):
        async def handle(self, endpoint, payload=None):
            self.payloads.append(payload)
            if len(self.payloads) == 1:
                return 200, self.answers.pop(0)
            return 200, {"output_ids": [], "meta_info": {"finish_reason": {
                "type": "abort", "message": "engine error: boom", "status_code": 500}, "output_token_logprobs": []}}

    tr = Failing([[body([5, 6, 7], "length", [0, 0, 0]), body([5], "length", [0]), body([8], "abort", [0])]])
    cli = engine_client.EngineClient(tr)

    async def go():
        cli.set_version(0)
        return await cli.agenerate_group(
            ModelRequest(rid="grp", input_ids=[1, 2], sampling=SamplingParams(max_new_tokens=3)), 3)

    with pytest.raises(Exception, match=r"grp/2"):
        asyncio.run(go())
