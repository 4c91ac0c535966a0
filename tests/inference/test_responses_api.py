"""``POST /v1/responses`` driven by the openai client: a tool loop (function_call -> function_call_output -> message),
the ``response`` object the SDK parses, and 400s naming what a stateless server cannot do."""

from __future__ import annotations

import asyncio
import json
import threading

import openai
import pytest
from aiohttp import web

from rlcore.inference.engine import Engine, EngineConfig
from rlcore.inference.openai_api import TOOL_PARSER_KEY
from rlcore.inference.server import make_app
from rlcore.inference.tool_parsers import ToolParser, openai_call
from tests.inference.test_server import tiny_model, tiny_tokenizer

TEMPLATE = (
    "{% if tools %}w9 {% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'tool' %}tool {{ m['content'] }} "
    "{% elif m.get('tool_calls') %}assistant w60 "
    "{% else %}{{ m['role'] }} {{ m['content'] }} {% endif %}"
    "{% endfor %}{% if add_generation_prompt %}w3 {% endif %}"
)


CALL_NEXT: list[bool] = []
"""The tiny random model writes no tool-call syntax: the next reply parsed while this holds an entry is a call."""


def parse_calls(text: str):
    """A toy tool parser: the reply is a ``get_weather`` call when ``CALL_NEXT`` asks for one, else plain text."""
    if CALL_NEXT:
        CALL_NEXT.pop()
        return None, [openai_call("get_weather", {"city": "Paris"})]
    return text, []


@pytest.fixture(scope="module")
def server():
    tok = tiny_tokenizer()
    tok.chat_template = TEMPLATE
    eng = Engine(tiny_model(), EngineConfig(max_batch=4, max_seq_len=96, device="cpu"), tokenizer=tok,
                 model_path="tiny").start()
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()

    async def up():
        app = make_app(eng)
        app[TOOL_PARSER_KEY] = ToolParser(parse_calls, None)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        return runner, site._server.sockets[0].getsockname()[1]

    runner, port = asyncio.run_coroutine_threadsafe(up(), loop).result(30)
    yield eng, openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=60)
    asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(30)
    loop.call_soon_threadsafe(loop.stop)
    eng.close()


TOOLS = [{"type": "function", "name": "get_weather", "description": "weather",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}]


def test_a_tool_loop_through_the_responses_api(server):
    eng, client = server
    CALL_NEXT.append(True)
    first = client.responses.create(model="tiny", input="w5 w6", tools=TOOLS, max_output_tokens=4,
                                    temperature=0, extra_body={"top_k": 1})
    assert first.object == "response" and first.status in ("completed", "incomplete")
    assert not CALL_NEXT  # the reply went through the server's tool parser
    calls = [o for o in first.output if o.type == "function_call"]
    assert len(calls) == 1 and not [o for o in first.output if o.type == "message"]
    call = calls[0]
    assert json.loads(call.arguments) == {"city": "Paris"}
    assert call.name == "get_weather" and call.call_id.startswith("call_")
    second = client.responses.create(
        model="tiny", tools=TOOLS, max_output_tokens=3, temperature=0,
        input=[{"role": "user", "content": "w5 w6"},
               {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
               {"type": "function_call_output", "call_id": call.call_id, "output": "w44"}])
    msgs = [o for o in second.output if o.type == "message"]
    assert msgs and second.output_text == msgs[0].content[0].text
    # the tool's output reached the prompt: the second prompt is the first plus the call and its output
    assert second.usage.input_tokens == first.usage.input_tokens + len("assistant w60 tool w44".split())


def test_plain_text_input_and_instructions_become_the_chat_prompt(server):
    eng, client = server
    resp = client.responses.create(model="tiny", input="w5 w6", instructions="w7", max_output_tokens=3,
                                   temperature=0)
    ref = eng.tokenizer.encode("system w7 user w5 w6 w3 ", add_special_tokens=False)
    assert resp.usage.input_tokens == len(ref)
    from rlcore.inference.protocol import SamplingParams

    out = eng.generate(ref, SamplingParams(max_new_tokens=3, temperature=0), timeout=60)
    assert resp.output_text == eng.tokenizer.decode(out.output_ids, skip_special_tokens=True)
    assert resp.status == ("incomplete" if len(out.output_ids) == 3 else "completed")


@pytest.mark.parametrize("extra, field", [
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"background": True}, "background"),
    ({"stream": True}, "stream"),
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"text": {"format": {"type": "json_object"}}}, "text"),
    ({"reasoning": {"effort": "high"}}, "reasoning"),
    ({"frobnicate": 1}, "frobnicate"),
])
def test_what_a_stateless_server_cannot_do_is_a_400_naming_it(server, extra, field):
    _, client = server
    with pytest.raises(openai.BadRequestError) as e:
        client.post("/responses", cast_to=object, body={"model": "tiny", "input": "w5", **extra})
    assert field in str(e.value)
