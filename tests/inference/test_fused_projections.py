"""Fused q/k/v and gate/up projections (``rlcore.inference.projections``, ``EngineConfig.fused_projections``).

Tiny float32 models on the CPU (``fused_projections=True`` runs there too). Tolerance: one GEMM over the fused
weight computes the same dot products as three, possibly blocked differently, so outputs agree to float32 rounding
(1e-5 on log-probs here; the ids are equal); against a teacher-forced forward of the unfused model, 1e-4 as in
``test_engine.py``. The weight-update and LoRA tests check that the fused GEMM (not a fallback) is what runs
after the load, by counting GEMMs: if the parameters were not views into the fused buffer, that count (or, with a
stale buffer, the log-probs) would be wrong.
"""

from __future__ import annotations

import collections
import copy
import dataclasses

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoConfig, AutoModelForCausalLM

from rlcore.inference import fusions, projections, weights
from rlcore.inference.engine import Engine, EngineConfig
from rlcore.inference.lora import LoraAdapter
from tests.inference.test_engine import PROMPTS, greedy, teacher_forced
from tests.inference.test_lora import make_adapter, merged_copy
from tests.inference.test_paged import sampled

V = 64
GEMMS = ("mm", "addmm", "bmm", "baddbmm")
CFG = EngineConfig(max_batch=4, max_seq_len=48, block_size=4, device="cpu", dtype="float32")


def tiny(
    kind: str = "qwen2", seed: int = 0, *, kv_heads: int = 2, random_bias: bool = True, **kw
) -> torch.nn.Module:
    """A 2-layer model of family ``kind``; biases (Qwen2's q/k/v) drawn at random so they count."""
    torch.manual_seed(seed)
    if kind == "gpt2":
        cfg = AutoConfig.for_model("gpt2", vocab_size=V, n_embd=32, n_layer=2, n_head=4, n_positions=96)
    else:
        cfg = AutoConfig.for_model(
            kind,
            vocab_size=V,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=kv_heads,
            head_dim=8,
            max_position_embeddings=96,
            pad_token_id=None,
            eos_token_id=None,
            bos_token_id=None,
            **kw,
        )
    model = AutoModelForCausalLM.from_config(cfg).eval()
    if random_bias:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("bias"):
                    p.normal_(0, 0.5)
    return model


class CountOps(TorchDispatchMode):
    """Counts aten ops by name (on the thread that enters it)."""

    def __init__(self) -> None:
        super().__init__()
        self.n: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


@torch.no_grad()
def gemms(model: torch.nn.Module, ids: list[int] = PROMPTS[1]) -> int:
    """GEMM launches of one no-grad forward (``mm``/``addmm``/``bmm``/``baddbmm``; ``F.linear`` lowers to these)."""
    with CountOps() as c:
        model(torch.tensor([ids]))
    return sum(c.n[g] for g in GEMMS)


@torch.no_grad()
def logits(model: torch.nn.Module, ids: list[int] = PROMPTS[1]) -> torch.Tensor:
    return model(torch.tensor([ids])).logits[0]


def groups(model: torch.nn.Module) -> list[projections.Group]:
    return [
        g
        for m in model.modules()
        for g in (getattr(m, "_rlcore_qkv", None), getattr(m, "_rlcore_gate_up", None))
        if g is not None
    ]


def run(model: torch.nn.Module, fused: bool, static: str | None = None, **cfg) -> tuple[Engine, list]:
    """Greedy and sampled requests through an engine over ``model`` (closed on return); with ``fused``, checks
    that every fused group's GEMM ran (``Group.weight`` is read only by the fused path)."""
    prompts = PROMPTS + [PROMPTS[1]] * 2
    sps = [greedy(10)] + [sampled(10, 40 + i) for i in range(len(prompts) - 1)]
    eng = Engine(model, dataclasses.replace(CFG, fused_projections=fused, **cfg))
    eng._static_mode = static
    reads: collections.Counter = collections.Counter()
    for g in groups(eng.model):
        g.weight = lambda g=g, read=g.weight: reads.update([id(g)]) or read()
    with eng:
        outs = [f.result(120) for f in [eng.submit(p, s) for p, s in zip(prompts, sps)]]
    assert len(reads) == (4 if fused else 0)  # 2 layers x (qkv, gate_up)
    return eng, outs


def assert_same(a: list, b: list) -> None:
    for x, y in zip(a, b, strict=True):
        assert x.output_ids == y.output_ids
        torch.testing.assert_close(
            torch.tensor(x.output_logprobs), torch.tensor(y.output_logprobs), atol=1e-5, rtol=0
        )


def assert_teacher_forced(model: torch.nn.Module, outs: list) -> None:
    for p, o in zip(PROMPTS + [PROMPTS[1]] * 2, outs):
        ref = teacher_forced(model, p, o.output_ids).gather(-1, torch.tensor(o.output_ids)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(o.output_logprobs), ref, atol=1e-4, rtol=0)


# ----------------------------------------------------------------------------------------------------------------
# The engine serves the same tokens and log-probs


@pytest.mark.parametrize(
    "kind,kv_heads,attention,static",
    [
        ("qwen2", 2, "gather", None),  # GQA, biased q/k/v
        ("qwen2", 2, "varlen", "eager-static"),  # the CUDA-graph step's fixed shapes, run eagerly
        ("llama", 2, "gather", "eager-static"),  # GQA, no biases
        ("llama", 4, "varlen", None),  # MHA
    ],
)
def test_fused_engine_serves_what_the_unfused_engine_serves(kind, kv_heads, attention, static):
    model = tiny(kind, seed=3, kv_heads=kv_heads)
    _, ref = run(copy.deepcopy(model), False, static, decode_attention=attention)
    eng, got = run(copy.deepcopy(model), True, static, decode_attention=attention)
    assert (eng.fusions.fused_qkv, eng.fusions.fused_gate_up, eng.fusions.note) == (2, 2, "")
    assert_same(ref, got)
    assert_teacher_forced(model, got)


def test_auto_is_off_on_cpu_and_false_installs_nothing():
    for setting in ("auto", False):
        eng = Engine(tiny(), dataclasses.replace(CFG, fused_projections=setting))
        assert (eng.fusions.fused_qkv, eng.fusions.fused_gate_up) == (0, 0)
        assert not any("forward" in vars(m) for m in eng.model.modules())


# ----------------------------------------------------------------------------------------------------------------
# Weight loads, LoRA, release / resume


def test_a_weight_update_is_served_from_the_fused_buffer(tmp_path):
    old, new = tiny(seed=1), tiny(seed=2)
    eng = Engine(copy.deepcopy(old), dataclasses.replace(CFG, fused_projections=True))
    ids = [p.data_ptr() for p in eng.model.parameters()]
    fused_gemms = gemms(eng.model)
    assert fused_gemms == gemms(old) - 6
    with eng:
        eng.update_weights_from_state_dict(new.state_dict(), version=1)
        assert eng._call(lambda: gemms(eng.model)) == fused_gemms  # the fused path, on the loop thread
        outs = [eng.generate(p, greedy(10), timeout=60) for p in PROMPTS]
        old.save_pretrained(tmp_path / "old")
        eng.update_weights_from_disk(tmp_path / "old", version=2)
        again = [eng.generate(p, greedy(10), timeout=60) for p in PROMPTS]
    assert [p.data_ptr() for p in eng.model.parameters()] == ids  # loaded in place: nothing moved
    attn = eng.model.model.layers[0].self_attn
    w = torch.cat(
        [old.model.layers[0].self_attn.get_submodule(n).weight for n in ("q_proj", "k_proj", "v_proj")]
    )
    torch.testing.assert_close(
        attn._rlcore_qkv.weight(), w, atol=0, rtol=0
    )  # the buffer holds the loaded values
    for model, got in ((new, outs), (old, again)):
        eng_ref = Engine(copy.deepcopy(model), dataclasses.replace(CFG, fused_projections=False))
        with eng_ref:
            ref = [eng_ref.generate(p, greedy(10), timeout=60) for p in PROMPTS]
        assert_same(ref, got)


def test_lora_load_and_unload_with_fused_projections():
    base = tiny(seed=5)
    tensors, config = make_adapter(base, targets=("q_proj", "k_proj", "v_proj", "gate_proj", "down_proj"))
    adapter = LoraAdapter.from_peft(tensors, config)
    eng = Engine(copy.deepcopy(base), dataclasses.replace(CFG, fused_projections=True))
    before = {k: v.clone() for k, v in eng.model.state_dict().items()}
    fused_gemms = gemms(eng.model)
    assert fused_gemms == gemms(base) - 6
    with eng:
        eng.load_lora_adapter("a", adapter)
        assert eng._call(lambda: gemms(eng.model)) == fused_gemms
        merged = [eng.generate(p, greedy(10), timeout=60) for p in PROMPTS]
        eng.unload_lora_adapter("a")
        restored = [eng.generate(p, greedy(10), timeout=60) for p in PROMPTS]
    assert all(torch.equal(before[k], v) for k, v in eng.model.state_dict().items())  # the base, exactly
    for model, got in ((merged_copy(base, tensors, config), merged), (base, restored)):
        ref_eng = Engine(copy.deepcopy(model), dataclasses.replace(CFG, fused_projections=False))
        with ref_eng:
            assert_same([ref_eng.generate(p, greedy(10), timeout=60) for p in PROMPTS], got)
    assert all(m._rlcore_qkv.bound() for m in eng.model.modules() if hasattr(m, "_rlcore_qkv"))


def test_weights_moved_apart_fall_back_and_resume_fuses_them_again():
    """``release_memory_occupation`` moves each parameter alone (on CUDA): simulated here by giving every one its
    own storage. Until ``resume_memory_occupation`` re-fuses them, each layer runs its own (correct) weight."""
    model = tiny(seed=6)
    eng = Engine(copy.deepcopy(model), dataclasses.replace(CFG, fused_projections=True))
    fused_gemms, plain_gemms = gemms(eng.model), gemms(model)
    assert fused_gemms == plain_gemms - 6
    with eng:
        eng.release_memory_occupation(["weights"])
        for p in eng.model.parameters():
            p.data = p.data.clone()
        assert gemms(eng.model) == plain_gemms
        torch.testing.assert_close(logits(eng.model), logits(model), atol=1e-5, rtol=0)
        eng.resume_memory_occupation(["weights"])
        assert all(m._rlcore_qkv.bound() for m in eng.model.modules() if hasattr(m, "_rlcore_qkv"))
        assert gemms(eng.model) == fused_gemms
        outs = [eng.generate(p, greedy(8), timeout=60) for p in PROMPTS]
    assert_teacher_forced(model, outs + [outs[1]] * 2)


# ----------------------------------------------------------------------------------------------------------------
# Names, shapes, ties


def test_names_shapes_parameter_objects_and_tie_detection_are_unchanged():
    model = tiny(seed=7, tie_word_embeddings=True)
    specs = {k: (v.shape, v.dtype) for k, v in model.state_dict().items()}
    params = {k: id(p) for k, p in model.named_parameters(remove_duplicate=False)}
    named = set(weights.named_tensors(model))
    got = projections.fuse_projections(model)
    assert (got.qkv, got.gate_up) == (2, 2)
    assert {k: (v.shape, v.dtype) for k, v in model.state_dict().items()} == specs
    assert {k: id(p) for k, p in model.named_parameters(remove_duplicate=False)} == params
    assert set(weights.named_tensors(model)) == named  # no extra buffer to be sent or refused
    sd = {k: v + 1 for k, v in model.state_dict().items()}  # the tied embedding and head both sent, equal
    sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
    pairs = weights.stage_weights(model, sd.items())
    assert len(pairs) == len({id(p) for p in model.parameters()})
    weights.commit_weights(pairs)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    attn = model.model.layers[1].self_attn
    assert torch.equal(attn._rlcore_qkv.weight()[:32], sd["model.layers.1.self_attn.q_proj.weight"])


def test_a_shared_parameter_is_left_alone_with_a_note():
    model = tiny(seed=8)
    layers = model.model.layers
    layers[1].self_attn.k_proj.weight = layers[0].self_attn.k_proj.weight  # one weight in two layers
    ref = copy.deepcopy(model)
    got = projections.fuse_projections(model)
    assert (
        (got.qkv, got.gate_up) == (0, 2) and "shared (tied)" in got.note and "layers.0.self_attn" in got.note
    )
    assert layers[1].self_attn.k_proj.weight is layers[0].self_attn.k_proj.weight
    torch.testing.assert_close(logits(model), logits(ref), atol=1e-5, rtol=0)


@pytest.mark.parametrize("kind", ["gpt2", "phi3"])
def test_other_layouts_are_untouched_with_a_note(kind):
    model = tiny(kind)
    ref = copy.deepcopy(model)
    got = fusions.apply(
        model, fused_kernels=False, compile_layers=False, device=torch.device("cpu"), fused_projections=True
    )
    assert (got.fused_qkv, got.fused_gate_up) == (0, 0)
    assert f"model_type {kind!r}" in got.note and "already projects q/k/v in one layer" in got.note
    assert not any("forward" in vars(m) for m in model.modules())
    assert torch.equal(logits(model), logits(ref))


# ----------------------------------------------------------------------------------------------------------------
# GEMM count, families, autograd, scope


@pytest.mark.parametrize("kind", sorted(projections.PROJECTION_FAMILIES))
def test_three_fewer_gemms_per_layer_and_the_same_logits_in_every_family(kind):
    model = tiny(kind, seed=9)
    ref = copy.deepcopy(model)
    got = projections.fuse_projections(model)
    assert (got.qkv, got.gate_up, got.note) == (2, 2, "")
    assert gemms(ref) - gemms(model) == 3 * 2  # q,k,v -> 1 and gate,up -> 1, in each of the 2 layers
    torch.testing.assert_close(logits(model), logits(ref), atol=1e-5, rtol=0)
    again = projections.fuse_projections(model)  # idempotent
    assert (again.qkv, again.gate_up) == (0, 0) and gemms(ref) - gemms(model) == 6


def test_with_grad_enabled_every_layer_runs_its_own_weight_and_gets_its_gradient():
    model, ref = tiny(seed=10), tiny(seed=10)
    projections.fuse_projections(model)
    ids = torch.tensor([PROMPTS[1]])
    for m in (model, ref):
        m(ids).logits.square().mean().backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-6, rtol=0, msg=name)


def test_the_stash_lives_only_inside_an_attention_forward():
    model = tiny(seed=11)
    projections.fuse_projections(model)
    attn = model.model.layers[0].self_attn
    x = torch.randn(1, 3, 32)
    with torch.no_grad(), CountOps() as c:
        k = attn.k_proj(x)  # outside the attention's scope: its own weight, nothing stashed
    assert sum(c.n[g] for g in GEMMS) == 1 and k.shape == (1, 3, 16) and k.is_contiguous()
    logits(model)
    assert getattr(projections._LOCAL, "stash", None) is None


@pytest.mark.slow
def test_fused_projections_compose_with_compiled_decoder_layers():
    sp = greedy(10)
    outs = {}
    for fused in (False, True):
        model = tiny(seed=12)
        if fused:
            projections.fuse_projections(model)
        assert fusions.compile_decoder_layers(model) == 2
        with Engine(model, dataclasses.replace(CFG, fused_projections=False)) as eng:
            outs[fused] = [eng.generate(p, sp, timeout=600) for p in PROMPTS]
    assert_same(outs[False], outs[True])


# ----------------------------------------------------------------------------------------------------------------
# The paged decode kernel (under the Triton interpreter on CPU) and CUDA graphs


def check_paged() -> None:
    """Run under ``TRITON_INTERPRET=1``: the paged kernel reads the strided k/v slices of the fused GEMM."""
    model = tiny(seed=13)
    _, ref = run(copy.deepcopy(model), False, "eager-static", decode_attention="paged")
    eng, got = run(copy.deepcopy(model), True, "eager-static", decode_attention="paged")
    assert eng.decode_attention == "paged-triton" and eng.fusions.fused_qkv == 2
    assert_same(ref, got)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU test below runs the kernel natively")
def test_paged_decode_reads_the_fused_slices_under_the_interpreter():
    from tests.kernels.interpreted import run_interpreted

    run_interpreted("tests.inference.test_fused_projections", "check_paged()")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind", ["qwen2", "qwen3", "llama"])
def test_cuda_graph_engine_with_fused_projections_matches_unfused(kind):
    model = tiny(kind, seed=14)
    cfg = dict(device="cuda", max_seq_len=64)
    _, ref = run(copy.deepcopy(model), False, "graph", **cfg)
    eng, got = run(copy.deepcopy(model), True, "graph", **cfg)
    assert eng.fusions.fused_qkv == 2 and eng._graphs.graphs
    assert_same(ref, got)
    assert_teacher_forced(model, got)


@pytest.mark.parametrize("name", ["fused_projections", "fused_kernels"])
def test_tri_state_fusion_knobs_refuse_strings_that_would_read_as_on(name):
    """``bool("off")`` is True: a string other than "auto" is refused, naming the field."""
    with pytest.raises(ValueError, match=f"EngineConfig.{name}"):
        EngineConfig(**{name: "off"})
    EngineConfig(**{name: False})  # the spellings that are meant work
