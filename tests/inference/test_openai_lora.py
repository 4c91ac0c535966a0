"""LoRA adapters on the OpenAI-compatible routes, resolved as SGLang's ``OpenAIServingBase`` does.

``model="<base>:<adapter>"`` (or the ``lora_path`` extra field) names a loaded adapter; an unknown name is a 400
naming it and the loaded ones; ``/v1/models`` lists the loaded adapters. One tiny engine (the openai tests' one)
with adapter ``a`` loaded for the module; the base model's outputs are taken before the load.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from rlcore.inference import lora
from rlcore.inference.openai_api import split_model
from rlcore.inference.protocol import SamplingParams
from tests.inference.conftest_tokenizer import char_chat_tokenizer
from tests.inference.test_lora import make_adapter
from tests.inference.test_openai_api import MSGS, SEED, Server, chat_ids, http, tiny_engine

openai = pytest.importorskip("openai", reason="these tests drive the server with the official openai client")

SAMPLED = {"temperature": 1.0, "seed": SEED, "extra_body": {"ignore_eos": True}}
N_TOK = 6


@pytest.fixture(scope="module")
def tok():
    return char_chat_tokenizer()


@pytest.fixture(scope="module")
def setup(tok, tmp_path_factory):
    """(engine, server, client, base outputs {prompt ids tuple: (ids, logprobs) of samples SEED, SEED + 1})."""
    eng = tiny_engine(tok).start()
    prompts = [tok("The cat")["input_ids"], chat_ids(tok, MSGS)]
    base = {}
    for ids in prompts:
        outs = [eng.generate(ids, SamplingParams(max_new_tokens=N_TOK, temperature=1.0, ignore_eos=True, seed=s),
                             timeout=60) for s in (SEED, SEED + 1)]
        base[tuple(ids)] = [(o.output_ids, o.output_logprobs) for o in outs]
    tensors, config = make_adapter(eng.model, scale=0.5)
    path = str(lora.write_peft_adapter(tmp_path_factory.mktemp("lora") / "a", tensors, config))
    eng.load_lora_adapter("a", path)
    server = Server(eng)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=60)
    yield eng, server, client, base, path
    server.close()
    eng.close()


def generate(server, ids: list[int], seed: int, lora_path: str | None) -> tuple[list[int], list[float]]:
    """SGLang's native ``/generate`` with ``lora_path`` and the same seed: (output ids, output log-probs)."""
    body = {"input_ids": ids, "return_logprob": True, "lora_path": lora_path,
            "sampling_params": {"max_new_tokens": N_TOK, "temperature": 1.0, "ignore_eos": True, "seed": seed}}
    status, raw = http(server.url + "/generate", body)
    assert status == 200, raw
    meta = json.loads(raw)["meta_info"]
    return [t for _, t, _ in meta["output_token_logprobs"]], [lp for lp, _, _ in meta["output_token_logprobs"]]


def test_model_base_colon_adapter_equals_generate_with_lora_path_for_n_2(setup, tok):
    eng, server, client, base, _ = setup
    ids = tok("The cat")["input_ids"]
    want = [generate(server, ids, SEED + j, "a") for j in range(2)]
    assert [w[0] for w in want] != [b[0] for b in base[tuple(ids)]]  # the adapter changes the samples
    for model, extra in (("tiny-chat:a", {}), ("anything:a", {}), ("tiny-chat", {"lora_path": "a"})):
        r = client.completions.create(model=model, prompt=ids, max_tokens=N_TOK, n=2, logprobs=0,
                                      **{**SAMPLED, "extra_body": {**SAMPLED["extra_body"], **extra}})
        assert r.model == model
        for j, c in enumerate(r.choices):
            assert c.logprobs.tokens == [tok.decode([t], skip_special_tokens=False) for t in want[j][0]]
            assert c.text == tok.decode(want[j][0], skip_special_tokens=True)
            assert c.logprobs.token_logprobs == pytest.approx(want[j][1], abs=1e-5)
    # the adapter was resolved, not ignored: the same request naming an adapter that is not loaded is refused
    with pytest.raises(openai.BadRequestError, match="'b'"):
        client.completions.create(model="tiny-chat:b", prompt=ids, max_tokens=N_TOK, n=2, **SAMPLED)


def test_chat_streams_the_adapters_tokens_and_refuses_an_unknown_adapter_before_streaming(setup, tok):
    eng, server, client, base, _ = setup
    ids = chat_ids(tok, MSGS)
    want = [generate(server, ids, SEED + j, "a") for j in range(2)]
    assert [w[0] for w in want] != [b[0] for b in base[tuple(ids)]]
    texts = ["", ""]
    logps: list[list[float]] = [[], []]
    chunks = client.chat.completions.create(model="tiny-chat:a", messages=MSGS, max_tokens=N_TOK, n=2,
                                            logprobs=True, stream=True, **SAMPLED)
    for ch in chunks:
        assert ch.model == "tiny-chat:a"
        for c in ch.choices:
            texts[c.index] += c.delta.content or ""
            logps[c.index] += [x.logprob for x in (c.logprobs.content if c.logprobs else None) or []]
    for j in range(2):
        assert texts[j] == tok.decode(want[j][0], skip_special_tokens=True)
        assert logps[j] == pytest.approx(want[j][1], abs=1e-5)
    whole = client.chat.completions.create(model="tiny-chat:a", messages=MSGS, max_tokens=N_TOK, n=2, **SAMPLED)
    assert [c.message.content for c in whole.choices] == texts
    for stream in (True, False):  # a 400 before any chunk, as SGLang answers (never the applied weights)
        with pytest.raises(openai.BadRequestError, match="'nope'") as e:
            client.chat.completions.create(model="tiny-chat:nope", messages=MSGS, max_tokens=2, stream=stream)
        assert e.value.status_code == 400 and "'a'" in e.value.message


def test_an_unknown_adapter_is_a_400_naming_it_and_the_loaded_ones(setup, tok):
    _, server, _, _, _ = setup
    cases = [
        ("/v1/completions", {"model": "tiny-chat:zz", "prompt": "hi", "max_tokens": 2}, "model"),
        ("/v1/completions", {"model": "tiny-chat", "prompt": "hi", "max_tokens": 2, "lora_path": "zz"}, "lora_path"),
        ("/v1/completions", {"prompt": ["hi", "ho"], "max_tokens": 2, "lora_path": ["a", "zz"]}, "lora_path"),
        ("/v1/chat/completions", {"model": "x:zz", "messages": MSGS, "max_tokens": 2, "stream": True}, "model"),
        ("/v1/chat/completions", {"messages": MSGS, "max_tokens": 2, "lora_path": "zz"}, "lora_path"),
    ]
    for path, body, param in cases:
        status, raw = http(server.url + path, body)
        err = json.loads(raw)["error"]
        assert status == 400 and err["param"] == param, (path, body, raw)
        assert "'zz'" in err["message"] and "['a']" in err["message"] and "/load_lora_adapter" in err["message"]
    status, raw = http(server.url + "/v1/completions", {"prompt": ["hi", "ho"], "max_tokens": 2, "lora_path": ["a"]})
    assert status == 400 and "one entry per prompt" in json.loads(raw)["error"]["message"]
    # names without ':' are any model (today's behaviour, SGLang's too); '<base>:' names no adapter
    for model in ("tiny-chat", "gpt-4o", "tiny-chat:", None):
        body = {"prompt": "hi", "max_tokens": 2} | ({"model": model} if model else {})
        assert http(server.url + "/v1/completions", body)[0] == 200, model


def test_v1_models_lists_the_loaded_adapters_as_sglang_does(setup):
    eng, server, client, _, path = setup
    cards = {m.id: m for m in client.models.list().data}
    assert list(cards) == ["tiny-chat", "a"]
    assert cards["a"].model_extra["root"] == path and cards["a"].model_extra["parent"] == "tiny-chat"
    assert cards["a"].model_extra["max_model_len"] is None and cards["a"].object == "model"
    assert cards["tiny-chat"].model_extra["parent"] is None
    assert client.models.retrieve("tiny-chat").id == "tiny-chat"
    with pytest.raises(openai.NotFoundError):  # SGLang's retrieve_model knows the served model only
        client.models.retrieve("a")


def test_split_model_follows_sglangs_rule():
    assert split_model("m", "m") == ("m", None)
    assert split_model("anything", "m") == ("anything", None)
    assert split_model("m:a", "m") == ("m", "a")
    assert split_model("other:a:b", "m") == ("other", "a:b")
    assert split_model("m: ", "m") == ("m", None)
    served = "s3://bucket/model"  # a served name holding ':' is the base model, and splits after itself
    assert split_model(served, served) == (served, None)
    assert split_model(served + ":pol-v3", served) == (served, "pol-v3")


def test_in_process_handle_resolves_the_adapter(setup):
    from rlcore.inference.openai_api import handle

    eng = setup[0]
    status, body = asyncio.run(handle(eng, "v1/completions", {"model": "tiny-chat:q", "prompt": "hi", "max_tokens": 1}))
    assert status == 400 and "'q'" in body["error"]["message"]
