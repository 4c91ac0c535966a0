"""The agent proxy's ``/v1/responses``: an openai-client tool loop over the Responses API, recorded as a trajectory
like chat completions are."""

from __future__ import annotations

import asyncio
import json

import pytest

from rlcore.inference.client import ClientConfig, EngineClient
from rlcore.rollout.proxy import AgentProxy, ProxyConfig, run_agent
from tests.inference.conftest_tokenizer import char_chat_tokenizer
from tests.rollout.test_proxy import ADMIN, ScriptedEngine

openai = pytest.importorskip("openai")

TOOLS = [{"type": "function", "name": "add", "description": "a + b",
          "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}]


def test_a_responses_api_tool_loop_through_the_proxy_is_recorded():
    tok = char_chat_tokenizer()
    call = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
    eng = ScriptedEngine(tok, [call, "It is 3."])

    class Agent:
        async def run(self, data, *, base_url, api_key):
            c = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
            first = await c.responses.create(model="p", input=data["q"], tools=TOOLS, instructions="Use tools.")
            calls = [o for o in first.output if o.type == "function_call"]
            assert len(calls) == 1 and calls[0].name == "add"
            assert json.loads(calls[0].arguments) == {"a": 1, "b": 2}
            second = await c.responses.create(model="p", tools=TOOLS, instructions="Use tools.", input=[
                {"role": "user", "content": data["q"]},
                {"type": "function_call", "call_id": calls[0].call_id, "name": "add", "arguments": calls[0].arguments},
                {"type": "function_call_output", "call_id": calls[0].call_id, "output": "3"}])
            assert second.output_text == "It is 3." and second.status == "completed"
            with pytest.raises(openai.BadRequestError, match="previous_response_id"):
                await c.responses.create(model="p", input="x", previous_response_id=first.id)
            await c.close()
            return 1.0

    async def main():
        async with AgentProxy(EngineClient(eng, ClientConfig(timeout_s=60, retries=0, seed=0)), tok,
                              ProxyConfig(admin_key=ADMIN)) as proxy:
            return await run_agent(proxy, Agent(), {"q": "1+2?"}, task_id="job")

    traj = asyncio.run(main())
    assert traj is not None and traj["input_ids"].shape[0] == 2  # both turns recorded
    n_call = len(tok.encode(call, add_special_tokens=False)) + 1
    assert traj["loss_mask"].sum(1).tolist()[0] == n_call
