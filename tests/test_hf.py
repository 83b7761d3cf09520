"""pyexpcache.hf: tiny random models of each transformers MoE family, built from their config
classes (no download), served with 25 % of their experts cached, on the CPU (host backend) and,
with a GPU, on CUDA."""

import contextlib
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="pyexpcache.hf needs torch (pip install expcache[hf])")
transformers = pytest.importorskip(
    "transformers", minversion="5", reason="pyexpcache.hf needs transformers >= 5 (pip install expcache[hf])"
)

import expcache_bench as bench  # noqa: E402
from expcache_bench.traces import read_trace  # noqa: E402
from pyexpcache import ModelLayout, _lib  # noqa: E402
from pyexpcache.hf import (  # noqa: E402
    IMPLEMENTATION,
    GraphDecoder,
    _serve as hf_serve,
    find_experts,
    offload,
    record_routing,
)
from pyexpcache.hf._experts import split  # noqa: E402

from support.cache import CUDA_OK, CUDA_REASON  # noqa: E402
from support.child import run_child  # noqa: E402

COMMON = dict(
    vocab_size=96,
    hidden_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)
#: family -> (model class name, config class name, config arguments beyond COMMON). 8 experts, top-2.
FAMILIES = {
    "mixtral": (
        "MixtralForCausalLM",
        "MixtralConfig",
        dict(intermediate_size=48, num_local_experts=8, num_experts_per_tok=2),
    ),
    "qwen2_moe": (
        "Qwen2MoeForCausalLM",
        "Qwen2MoeConfig",
        dict(
            intermediate_size=64,
            moe_intermediate_size=24,
            shared_expert_intermediate_size=32,
            num_experts=8,
            num_experts_per_tok=2,
        ),
    ),
    "qwen3_moe": (
        "Qwen3MoeForCausalLM",
        "Qwen3MoeConfig",
        dict(intermediate_size=64, moe_intermediate_size=24, num_experts=8, num_experts_per_tok=2, head_dim=8),
    ),
    "olmoe": ("OlmoeForCausalLM", "OlmoeConfig", dict(intermediate_size=40, num_experts=8, num_experts_per_tok=2)),
    "deepseek_v3": (
        "DeepseekV3ForCausalLM",
        "DeepseekV3Config",
        dict(
            intermediate_size=64,
            moe_intermediate_size=24,
            n_routed_experts=8,
            n_shared_experts=1,
            num_experts_per_tok=2,
            first_k_dense_replace=1,
            n_group=1,
            topk_group=1,
            kv_lora_rank=16,
            q_lora_rank=None,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=8,
            num_key_value_heads=4,
        ),
    ),  # MLA: one key and value per head
    "gpt_oss": (
        "GptOssForCausalLM",
        "GptOssConfig",
        dict(intermediate_size=24, num_local_experts=8, num_experts_per_tok=2, head_dim=8, sliding_window=16),
    ),
}
PROMPT = [[5, 17, 33, 2, 61, 40]]
NEW_TOKENS = 8
#: Where the model computes: the CPU (expcache's host backend) and, with a GPU, CUDA. On CUDA the
#: models are bfloat16, the dtype transformers' grouped_mm kernels are made for.
DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=pytest.mark.skipif(
            not (CUDA_OK and torch.cuda.is_available()), reason=CUDA_REASON or "torch has no CUDA device"
        ),
    ),
]
#: Logits of one model computed two ways that round differently (GEMMs of other shapes, or
#: batched_mm against grouped_mm, which add the k experts' outputs in another order), by device.
#: float32 on the CPU: at most 6e-6 measured over the six families, on logits up to 6.4 in magnitude.
TOLERANCE = {"cpu": dict(rtol=1e-5, atol=5e-5), "cuda": dict(rtol=1e-5, atol=5e-5)}


def tiny_model(family: str, seed: int = 0, device: str = "cpu", **config):
    model_class, config_class, extra = FAMILIES[family]
    config = getattr(transformers, config_class)(**{**COMMON, **extra, **config})
    torch.manual_seed(seed)
    model = getattr(transformers, model_class)(config).eval()
    with torch.no_grad():  # random weights large enough that routing and tokens vary
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.3)
    return model.to(torch.bfloat16).to(device) if device == "cuda" else model


def greedy(model, prompt=PROMPT, new_tokens=NEW_TOKENS, **kwargs):
    device = next(model.parameters()).device
    with torch.no_grad():
        out = model.generate(
            torch.tensor(prompt, device=device),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=0,
            **kwargs,
        )
    return out.sequences, torch.stack(out.logits)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_offload_generates_the_unmodified_models_tokens_and_logits(family, device):
    """One token per forward (a one-token prompt, then decoding): each layer's experts computed by
    the same kernels (grouped_mm, transformers' default) on the same bytes, bit-identical."""
    model = tiny_model(family, device=device)
    tokens, logits = greedy(model, prompt=[[5]])  # the unmodified model
    with offload(model, budget_fraction=0.25) as handle:
        assert model.config._experts_implementation == IMPLEMENTATION
        assert handle.computed_by == "grouped_mm"
        assert handle.caches[0].backend == ("cuda" if device == "cuda" else "host")
        served_tokens, served_logits = greedy(model, prompt=[[5]])
        total = handle.total_stats()
    assert torch.equal(served_tokens, tokens)
    assert torch.equal(served_logits, logits)
    assert total.misses > 0 and total.evictions > 0  # 25 %: experts were streamed
    assert model.config._experts_implementation == "grouped_mm"  # restored by close()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_prompt_is_served_in_chunks_the_cache_holds(family, device):
    """A 6-token prompt at 25 % of the experts: a select of n tokens needs n*k slots, so the
    prompt's forward is served cap//k tokens at a time. grouped_mm's per-expert groups are then
    smaller, and a GEMM's rounding depends on its shape: logits within TOLERANCE, tokens equal."""
    model = tiny_model(family, device=device)
    tokens, logits = greedy(model)
    with offload(model, budget_fraction=0.25):
        served_tokens, served_logits = greedy(model)
    assert torch.equal(served_tokens, tokens)
    torch.testing.assert_close(served_logits, logits, **TOLERANCE[device])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_prompt_the_cache_holds_at_once_gives_the_unmodified_logits(family, device):
    """A 12-token prompt with every expert cached (24 slots: one select of 12 x 2 ids a layer, no
    chunks), float32 on the CPU: the grouped product takes the (token, expert) rows in the order
    of expert ids, as the unmodified model's does, so every row is rounded where it was there
    (on the CPU a row's rounding depends on its place). Logits bit-identical."""
    model = tiny_model(family, device=device, **({"num_hidden_layers": 4} if family == "deepseek_v3" else {}))
    prompt = [[5, 17, 33, 2, 61, 40, 7, 9, 11, 13, 15, 19]]
    tokens, logits = greedy(model, prompt=prompt, new_tokens=4)
    with offload(model, budget_fraction=1.0) as handle:
        assert handle.cache.bank(handle.layout.moe_layers[0]).cap == 24
        served_tokens, served_logits = greedy(model, prompt=prompt, new_tokens=4)
    assert torch.equal(served_tokens, tokens)
    assert torch.equal(served_logits, logits)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("implementation", ["batched_mm", "eager"])
@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])  # GPT-OSS: transposed, with biases
def test_offload_computes_with_the_models_implementation(family, implementation, device):
    model = tiny_model(family, device=device)
    model.set_experts_implementation(implementation)
    tokens, logits = greedy(model, prompt=[[5]])
    with offload(model, budget_fraction=0.25) as handle:
        assert handle.computed_by == implementation
        served_tokens, served_logits = greedy(model, prompt=[[5]])
    assert torch.equal(served_tokens, tokens)
    assert torch.equal(served_logits, logits)
    assert model.config._experts_implementation == implementation
    if device == "cpu":
        model.set_experts_implementation("grouped_mm")
        torch.testing.assert_close(greedy(model, prompt=[[5]])[1], logits, **TOLERANCE[device])  # another order


@pytest.mark.parametrize("device", DEVICES)
def test_layers_are_grouped_into_caches_whose_banks_one_grouped_product_takes(device, monkeypatch):
    """With grouped_mm, a budget of more slots than one grouped product takes (1023; 10 here) is
    split over caches of consecutive layers, each bank under the limit: one product per layer,
    bit-identical to the unmodified model."""
    monkeypatch.setattr(hf_serve, "GROUPED_MM_GROUPS", 10)
    model = tiny_model("qwen3_moe", device=device)
    tokens, logits = greedy(model, prompt=[[5]])
    with offload(model, budget_fraction=1.0) as handle:  # 3 layers x 8 experts; 9 slots a cache at most
        assert len(handle.caches) == 3 and all(c.bank(c.layout.moe_layers[0]).cap <= 10 for c in handle.caches)
        with pytest.raises(ValueError, match="served by 3 caches"):
            _ = handle.cache
        served_tokens, served_logits = greedy(model, prompt=[[5]])
        assert handle.total_stats().hits > 0
    assert torch.equal(served_tokens, tokens)
    assert torch.equal(served_logits, logits)


@pytest.mark.parametrize("device", DEVICES)
def test_a_bank_of_more_slots_than_one_grouped_product_takes(device, monkeypatch):
    """torch's grouped_mm takes fewer than 1024 groups; a bank of more slots is multiplied over
    windows of slots (5 here). On CUDA the logits equal the unmodified model's. On the CPU the
    grouped product goes by expert id (one GEMM per expert, as torch's CPU kernel does) and needs
    no windows, but each layer's cache (8 slots) serves the 6-token prompt in chunks of 4 tokens,
    GEMMs of other shapes: there the logits are within TOLERANCE."""
    monkeypatch.setattr(hf_serve, "GROUPED_MM_GROUPS", 5)
    model = tiny_model("qwen3_moe", device=device)
    tokens, logits = greedy(model)
    with offload(model, budget_fraction=1.0) as handle:  # 24 slots: 5 windows
        served_tokens, served_logits = greedy(model)
        assert handle.total_stats().hits > 0
    assert torch.equal(served_tokens, tokens)
    if device == "cuda":
        assert torch.equal(served_logits, logits)
    else:
        torch.testing.assert_close(served_logits, logits, **TOLERANCE[device])


@pytest.mark.parametrize("device", DEVICES)
def test_a_checkpoint_loaded_with_from_pretrained_is_offloaded(tmp_path, device):
    """docs/hf.md's recipe with a real checkpoint, written here by save_pretrained (no
    download): from_pretrained on the host, then offload(device=...); the tokens and logits are
    those of the checkpoint loaded and run unmodified where the model computes. On CUDA the
    experts stay on the host, pinned (in place, or copied into pinned memory where loading
    mapped them from the file), and torch never holds them on the GPU: its peak allocation is
    under half their bytes (the experts are made 54 times the other weights)."""
    cuda = device == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    tiny_model("qwen3_moe", moe_intermediate_size=384).to(dtype).save_pretrained(tmp_path)
    # The unmodified model: the checkpoint loaded likewise, all of it where the model computes.
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=dtype).to(device)
    tokens, logits = greedy(reference, prompt=[[5]])
    experts_bytes = sum(p.numel() * p.element_size() for e in find_experts(reference) for p in (e.first, e.down))
    del reference
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=dtype)  # on the host
    with offload(model, budget_fraction=0.25, device=device) as handle:
        experts = {id(p) for e in find_experts(model) for p in (e.first, e.down)}
        for name, p in model.named_parameters():
            assert p.device.type == ("cpu" if id(p) in experts else device), name
            assert not cuda or id(p) not in experts or p.is_pinned(), name
        served_tokens, served_logits = greedy(model, prompt=[[5]])
        assert handle.total_stats().misses > 0
    if cuda:
        assert torch.cuda.max_memory_allocated() - before < experts_bytes / 2
    assert torch.equal(served_tokens, tokens)
    assert torch.equal(served_logits, logits)


@pytest.mark.skipif(not (CUDA_OK and torch.cuda.is_available()), reason=CUDA_REASON or "torch has no CUDA device")
def test_a_model_loaded_on_the_host_runs_on_the_gpu_with_its_experts_on_the_host():
    """The loading recipe of docs/hf.md: a checkpoint loaded on the host, then offload(device=)."""
    reference = tiny_model("qwen3_moe", device="cuda")
    tokens, logits = greedy(reference)
    model = tiny_model("qwen3_moe").to(torch.bfloat16)  # on the host, as from_pretrained loads it
    with offload(model, budget_fraction=0.25, device="cuda") as handle:
        experts = {id(p) for e in find_experts(model) for p in (e.first, e.down)}
        for name, p in model.named_parameters():
            assert p.device.type == ("cpu" if id(p) in experts else "cuda"), name
            if id(p) in experts:
                assert p.is_pinned(), name  # page-locked in place: the GPU reads misses from it
        served_tokens, served_logits = greedy(model)
        assert handle.total_stats().misses > 0
    assert torch.equal(served_tokens, tokens)
    assert torch.equal(served_logits, logits)


@pytest.mark.parametrize("device", DEVICES)
def test_graph_decoder_captures_the_offloaded_step(device):
    """GraphDecoder: static KV cache, each decode step one CUDA graph replay (eager on the CPU).
    Offloaded at 25 %, its logits equal the unmodified model's under the same decoder, and its
    tokens those of generate()."""
    model = tiny_model("qwen3_moe", device=device)
    tokens, _ = greedy(model, prompt=[[5]])  # one token: the prefill is not served in chunks
    prompt = torch.tensor([[5]])
    decoder = GraphDecoder(model, max_len=32)
    want, want_logits = decoder.generate(prompt, NEW_TOKENS, output_logits=True)
    assert torch.equal(want.cpu(), tokens.cpu())
    with offload(model, budget_fraction=0.25) as handle:
        served = GraphDecoder(model, max_len=32)
        got, got_logits = served.generate(prompt, NEW_TOKENS, output_logits=True)
        assert served.captured == (device == "cuda")
        again = served.generate(prompt, NEW_TOKENS)  # the capture replayed for a second sequence
        total = handle.total_stats()
    assert torch.equal(got, want) and torch.equal(again, want)
    assert torch.equal(got_logits, want_logits)
    assert total.misses > 0 and total.hits > 0


@pytest.mark.parametrize("device", DEVICES)
def test_graph_decoder_decodes_a_batch(device):
    """Two sequences per step (one select of 2 x k ids a layer): the offloaded decoder's tokens
    and logits equal the same decoder's over the unmodified model, row by row."""
    model = tiny_model("qwen3_moe", seed=1, device=device)
    prompts = torch.tensor([[5, 17, 33], [60, 1, 9]])
    want, want_logits = GraphDecoder(model, max_len=32, batch=2).generate(prompts, NEW_TOKENS, output_logits=True)
    assert not torch.equal(want[0], want[1])
    with offload(model, budget_fraction=0.5) as handle:
        served = GraphDecoder(model, max_len=32, batch=2)
        got, got_logits = served.generate(prompts, NEW_TOKENS, output_logits=True)
        assert served.captured == (device == "cuda")
        total = handle.total_stats()
    assert torch.equal(got, want)
    assert torch.equal(got_logits, want_logits)
    assert total.misses > 0 and total.hits > 0


@pytest.mark.parametrize("device", DEVICES)
def test_graph_decoder_captures_a_model_with_eager_masks_and_sliding_layers(device):
    """GPT-OSS: eager attention (its sinks), every other layer a sliding window of 16. The decoder
    makes the step's masks on the device (transformers' eager masks copy a host scalar to the
    GPU, which a capture refuses, and its sliding masks read a host count fixed at the capture):
    captured on CUDA, the tokens are generate()'s, and offloaded its logits are the unmodified
    decoder's."""
    model = tiny_model("gpt_oss", device=device)
    assert model.config._attn_implementation == "eager" and "sliding_attention" in model.config.layer_types
    prompt = torch.tensor([[5, 17, 33]])
    tokens, _ = greedy(model, prompt=prompt.tolist(), new_tokens=12)
    decoder = GraphDecoder(model, max_len=16)  # prompt and new tokens within the window
    want, want_logits = decoder.generate(prompt, 12, output_logits=True)
    assert decoder.captured == (device == "cuda")
    assert torch.equal(want.cpu(), tokens.cpu())
    with offload(model, budget_fraction=0.5):
        served = GraphDecoder(model, max_len=16)
        got, got_logits = served.generate(prompt, 12, output_logits=True)
        assert served.captured == (device == "cuda")
    assert torch.equal(got, want)
    assert torch.equal(got_logits, want_logits)


@pytest.mark.parametrize("family", ["gpt_oss", "qwen3_moe"])  # eager and sliding layers; sdpa
def test_graph_decoder_makes_the_masks_transformers_makes(family):
    """The step's masks, made on the device from the decoder's position, are the ones transformers'
    masking functions make from the cache at that step: the same values (eager: 0 and the dtype's
    minimum; sdpa: booleans) for full and sliding attention layers."""
    from transformers import masking_utils

    model = tiny_model(family)
    decoder = GraphDecoder(model, max_len=16)
    decoder.generate(torch.tensor([[5, 17, 33]]), 4)  # the cache holds 6 positions; the step is at 6
    assert decoder.position.item() == 6
    embeds = model.get_input_embeddings()(decoder.token)
    arguments = dict(
        config=model.config,
        inputs_embeds=embeds,
        attention_mask=None,
        position_ids=decoder.position.view(1, -1),
        **{decoder._kv_name: decoder.kv},
    )
    ours = decoder._step_mask()
    assert ours is not None and ours.shape == (1, 1, 1, 16)
    theirs = [masking_utils.create_causal_mask(**arguments)]
    if "sliding_attention" in (getattr(model.config, "layer_types", None) or []):
        theirs.append(masking_utils.create_sliding_window_causal_mask(**arguments))
    for mask in theirs:
        assert mask.dtype == ours.dtype and torch.equal(mask, ours)


def test_graph_decoder_refuses_a_step_it_cannot_capture_with_the_reason():
    """Checked before capturing (on CUDA, when the decoder is made): a sliding window shorter than
    max_len (transformers stores each new position of such a layer by a host count, which replays
    cannot follow), and eager attention over layers whose masks the decoder does not make."""
    from pyexpcache.hf import _graph

    model = tiny_model("gpt_oss")  # sliding window 16
    decoder = GraphDecoder(model, max_len=32)  # on the CPU: decodes eagerly, nothing refused
    problem = _graph._capture_problem(model, decoder.kv, 32)
    assert problem.startswith("layer 0's static KV cache keeps the last 16 positions (a sliding or chunked window)")
    assert "use max_len <= 16, or capture=False" in problem
    assert _graph._capture_problem(model, GraphDecoder(model, max_len=16).kv, 16) is None
    qwen = tiny_model("qwen3_moe")
    qwen.config._attn_implementation = "eager"
    qwen.config.layer_types = ["full_attention", "linear_attention", "full_attention"]
    problem = _graph._capture_problem(qwen, GraphDecoder(tiny_model("qwen3_moe"), max_len=16).kv, 16)
    assert "eager attention masks are made by transformers with a host scalar" in problem
    if CUDA_OK and torch.cuda.is_available():
        with pytest.raises(
            ValueError,
            match=r"GraphDecoder cannot capture GptOssForCausalLM's decode step: layer 0's "
            r"static KV cache keeps the last 16 positions",
        ):
            GraphDecoder(tiny_model("gpt_oss", device="cuda"), max_len=32)


@pytest.mark.parametrize("device", DEVICES)
def test_graph_decoder_decodes_in_generates_decode_phase(device):
    """Every decode step (captured or eager) runs inside the model's _optimize_model_for_decode,
    where generate() runs its own (transformers switches grouped_mm to batched_mm there, on a
    GPU); the prompt's forward runs outside it."""
    model = tiny_model("qwen3_moe", device=device)
    seen = []  # the experts implementation of each forward, and whether it ran in the phase
    inside = [False]
    original = model._optimize_model_for_decode

    @contextlib.contextmanager
    def recording():
        with original():
            inside[0] = True
            try:
                yield
            finally:
                inside[0] = False

    def record(module, args):  # args[0]: the hidden states, [tokens, hidden]
        seen.append((args[0].shape[0], inside[0], module.config._experts_implementation))

    model._optimize_model_for_decode = recording
    hook = find_experts(model)[0].module.register_forward_pre_hook(record)
    try:
        GraphDecoder(model, max_len=16).generate(torch.tensor([[5, 17]]), 4)
    finally:
        hook.remove()
        del model._optimize_model_for_decode
    prefills = [(phase, impl) for tokens, phase, impl in seen if tokens == 2]
    steps = [(phase, impl) for tokens, phase, impl in seen if tokens == 1]
    assert prefills and not any(phase for phase, _ in prefills)
    assert steps and all(phase for phase, _ in steps)
    if device == "cuda":  # the implementation generate() decodes with on a GPU
        assert {impl for _, impl in steps} == {"batched_mm"}, steps


def test_graph_decoder_refuses_bad_arguments():
    model = tiny_model("qwen3_moe")
    with pytest.raises(ValueError, match="max_len must be an int >= 2"):
        GraphDecoder(model, max_len=1)
    decoder = GraphDecoder(model, max_len=8)
    with pytest.raises(ValueError, match="exceed max_len 8"):
        decoder.generate(torch.tensor(PROMPT), 4)
    with pytest.raises(ValueError, match=r"input_ids must be \[1, P\]"):
        decoder.generate(torch.tensor([[1], [2]]), 2)


def test_the_offloaded_forward_compiles_into_one_graph():
    """torch.compile with fullgraph=True (a graph break raises) through generate's own compilation
    (asked for on the CPU too, backend "eager"): the select is an operator in the graph. Under
    dynamo transformers' grouped_mm takes its fallback for float32 (one product per expert),
    so the logits round otherwise than the eager reference: within TOLERANCE, tokens equal."""
    from torch._dynamo.utils import counters

    model = tiny_model("qwen3_moe")
    tokens, logits = greedy(model, prompt=[[5]], cache_implementation="static")
    config = transformers.CompileConfig(fullgraph=True, backend="eager", mode=None)
    config._compile_all_devices = True  # transformers' switch to compile on the CPU
    counters.clear()
    with offload(model, budget_fraction=0.25) as handle:
        served_tokens, served_logits = greedy(model, prompt=[[5]], cache_implementation="static", compile_config=config)
        assert handle.total_stats().misses > 0
    assert counters["stats"]["unique_graphs"] == 1
    assert torch.equal(served_tokens, tokens)
    torch.testing.assert_close(served_logits, logits, **TOLERANCE["cpu"])


@pytest.mark.skipif(not (CUDA_OK and torch.cuda.is_available()), reason=CUDA_REASON or "torch has no CUDA device")
def test_generate_with_a_static_cache_compiles_the_offloaded_model():
    """generate() with a static KV cache compiles the forward (torch.compile, reduce-overhead, CUDA
    graphs) and the expert select stays in the compiled graph (no graph break). Inductor fuses the
    offloaded graph's neighbours of the experts otherwise than the unmodified graph's: bf16
    logits then round differently (within 0.05 on logits up to 4, measured); tokens equal."""
    from torch._dynamo.utils import counters

    model = tiny_model("qwen3_moe", device="cuda")
    tokens, logits = greedy(model, cache_implementation="static")
    counters.clear()
    with offload(model, budget_fraction=0.25) as handle:
        served_tokens, served_logits = greedy(model, cache_implementation="static")
        assert handle.total_stats().misses > 0
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] >= 1  # the offloaded forward was compiled
    assert torch.equal(served_tokens, tokens)
    torch.testing.assert_close(served_logits.float(), logits.float(), rtol=0, atol=0.05)


def _edited_weights(model):
    """Every experts module's weights and biases with a change of their own (a merged adapter, say),
    made on the host in float32 so that two models of one seed get the same bytes."""
    generator = torch.Generator().manual_seed(7)
    out = []
    for e in find_experts(model):
        names = ["gate_up_proj" if e.module.has_gate else "up_proj", "down_proj"]
        names += [
            n for n in ("gate_up_proj_bias", "down_proj_bias") if isinstance(getattr(e.module, n, None), torch.Tensor)
        ]
        for name in names:
            p = getattr(e.module, name)
            new = p.detach().float().cpu() + 0.2 * torch.randn(p.shape, generator=generator)
            out.append((e.module, name, new.to(p.dtype)))
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("edit", ["copy_", "replaced", "data"])
def test_edited_expert_weights_are_served_after_refresh(edit, device):
    """The experts' weights are the cache's host source; the experts resident in the slots keep
    the bytes they were copied with. An edit (in place: copy_; a new Parameter; or through .data,
    which the check cannot see) then refresh(): the offloaded model, and a decoder captured before,
    equal the unmodified model with the same edit. An edit the parameters show (a new version or
    tensor) is refused at the next forward until refresh()."""
    reference = tiny_model("gpt_oss", device=device)  # transposed, with biases
    with torch.no_grad():
        for module, name, new in _edited_weights(reference):
            getattr(module, name).copy_(new)
    want_tokens, want_logits = greedy(reference, prompt=[[5]])
    want_decoded = GraphDecoder(reference, max_len=16).generate(torch.tensor([[7]]), NEW_TOKENS)  # its window: 16

    model = tiny_model("gpt_oss", device=device)
    tokens, _ = greedy(model, prompt=[[5]])
    assert not torch.equal(tokens, want_tokens)  # the edit changes the tokens
    with offload(model, budget_fraction=0.5) as handle:
        decoder = GraphDecoder(model, max_len=16)
        decoder.generate(torch.tensor([[7]]), NEW_TOKENS)  # captured on CUDA, with experts resident
        served = [(module, name, getattr(module, name).data_ptr()) for module, name, _ in _edited_weights(model)]
        with torch.no_grad():
            for module, name, new in _edited_weights(model):
                p = getattr(module, name)
                if edit == "copy_":
                    p.copy_(new)
                elif edit == "data":
                    p.data.copy_(new)
                else:
                    setattr(module, name, torch.nn.Parameter(new.to(p.device)))
        if edit != "data":
            with pytest.raises(
                RuntimeError,
                match=r"model.layers.0.mlp.experts: the experts' weights changed since "
                r"offload \(or the last refresh\).*call refresh\(\)",
            ):
                greedy(model, prompt=[[5]])
        handle.refresh()
        # Every weight and bias where it was served from: the banks' sources and a captured graph read there.
        assert [getattr(module, name).data_ptr() for module, name, _ in served] == [ptr for _, _, ptr in served]
        served_tokens, served_logits = greedy(model, prompt=[[5]])
        decoded = decoder.generate(torch.tensor([[7]]), NEW_TOKENS)
        experts = {id(p) for e in find_experts(model) for p in (e.first, e.down)}
        assert all(p.device.type == "cpu" for p in model.parameters() if id(p) in experts)
    assert torch.equal(served_tokens, want_tokens)
    assert torch.equal(served_logits, want_logits)
    assert torch.equal(decoded, want_decoded)


def test_refresh_refuses_a_weight_of_another_shape_and_a_closed_handle():
    model = tiny_model("qwen3_moe")
    with offload(model, budget_fraction=0.5) as handle:
        e = find_experts(model)[1]
        e.module.down_proj = torch.nn.Parameter(e.down.detach()[:, :, :8].contiguous())
        with pytest.raises(
            ValueError,
            match=r"model.layers.1.mlp.experts.down_proj is now torch.float32 \[8, 32, 8\];"
            r" it was offloaded as torch.float32 \[8, 32, 24\]: close the handle "
            r"and offload again",
        ):
            handle.refresh()
    with pytest.raises(ValueError, match="this handle is closed"):
        handle.refresh()


def _expert_weights(model):
    return [p for e in find_experts(model) for p in (e.first, e.down)]


@pytest.mark.parametrize("family", ["qwen2_moe", "gpt_oss"])  # a shared expert added to the output; biases
def test_the_served_experts_are_inference_only(family):
    """The served product reads the bank's copies, not the parameters: a backward that would give
    the experts' weights a gradient raises, naming the layer and the way out (also when they are
    the only weights asking for one). With them frozen the rest of the model trains: its
    gradients (the router's, the biases', attention's, ...) are the unmodified model's with
    frozen experts, bit for bit."""
    ids = torch.tensor([[5, 17, 33, 2, 61, 40]])
    reference = tiny_model(family)
    for p in _expert_weights(reference):
        p.requires_grad_(False)
    reference(ids, labels=ids).loss.backward()
    want = {n: p.grad for n, p in reference.named_parameters() if p.requires_grad}

    model = tiny_model(family)
    with offload(model, budget_fraction=1.0):
        loss = model(ids, labels=ids).loss  # a forward with gradients on: served as always
        with pytest.raises(
            RuntimeError,
            match=r"model.layers.2.mlp.experts: the experts served by expcache are "
            r"inference-only: their weights \(gate_up_proj, down_proj\) get no "
            r"gradient.*requires_grad_\(False\)",
        ):
            loss.backward()
        for p in model.parameters():  # only the experts ask: torch would say that nothing does
            p.requires_grad_(False)
        for p in _expert_weights(model):
            p.requires_grad_(True)
        with pytest.raises(RuntimeError, match="inference-only"):
            model(ids, labels=ids).loss.backward()
        for p in model.parameters():
            p.requires_grad_(True)
            p.grad = None
        for p in _expert_weights(model):
            p.requires_grad_(False)
        model(ids, labels=ids).loss.backward()
    got = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    assert got.keys() == want.keys() and all(g is not None for g in got.values())
    for name in want:
        assert torch.equal(got[name], want[name]), name
    assert all(p.grad is None for p in _expert_weights(model))


def test_layout_and_source_describe_the_parameters_byte_for_byte():
    model = tiny_model("deepseek_v3")
    layers = find_experts(model)
    assert [e.layer for e in layers] == [1, 2]  # layer 0 is dense (first_k_dense_replace=1)
    with offload(model, budget_fraction=1.0) as handle:
        assert handle.layout.layers[0] is None
        e = layers[0]
        ids = torch.tensor([[3, 6]])
        slots = handle.cache.select_device(e.layer, ids)
        server = e.module._expcache_server
        for expert, slot in zip(ids[0].tolist(), slots[0].tolist()):
            # the bank is gate_up_proj by slot
            assert torch.equal(server.weights[e.weight_names[0]][slot], e.first[expert])
            assert torch.equal(server.weights["down_proj"][slot], e.down[expert])


@pytest.mark.parametrize("device", DEVICES)
def test_a_model_outlives_its_dropped_handle_and_the_interpreter_exits_cleanly(device):
    """In a child process (a failure would be a crash): a handle dropped without close() leaves
    the model served, and the interpreter exits with the model, its caches, a captured decode
    step and the page-locked experts all still alive."""
    tests = str(Path(__file__).resolve().parent)
    out = run_child(f"""
        import sys
        sys.path[:0] = [{tests!r}]
        import torch
        from test_hf import greedy, tiny_model
        from pyexpcache.hf import GraphDecoder, offload
        model = tiny_model("qwen3_moe", device="{device}")
        tokens, _ = greedy(model)
        handle = offload(model, budget_fraction=0.25, progress=False)
        decoder = GraphDecoder(model, max_len=16)
        decoder.generate(torch.tensor([[3]]), 4)
        del handle
        served, _ = greedy(model)
        assert torch.equal(served, tokens), (served, tokens)
        print("served after the handle was dropped")
    """)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "served after the handle was dropped" in out.stdout


def test_a_second_offload_is_refused():
    model = tiny_model("mixtral")
    with offload(model, budget_fraction=0.5):
        with pytest.raises(ValueError, match="already served by expcache: close its handle first"):
            offload(model, budget_fraction=0.5)


def test_experts_too_small_for_a_slot_are_refused():
    with pytest.raises(ValueError, match="slab of 192 B cannot be served"):
        split(192)
    assert split(6144) == 3072 and split(1000) == 256  # half, rounded down to the 256 B alignment


def test_a_model_without_experts_interface_layers_is_refused_by_name():
    config = transformers.LlamaConfig(**COMMON, intermediate_size=48)
    model = transformers.LlamaForCausalLM(config)
    with pytest.raises(ValueError, match="LlamaForCausalLM has no MoE layer"):
        offload(model, budget_fraction=0.5)


def test_llama4_is_refused_naming_its_experts_and_why():
    """Llama4's experts run every expert on every token, outside the experts interface: the
    refusal names the module and says so."""
    config = transformers.Llama4TextConfig(
        **COMMON,
        intermediate_size=48,
        intermediate_size_mlp=48,
        head_dim=8,
        num_local_experts=4,
        num_experts_per_tok=1,
        interleave_moe_layer_step=1,
    )
    model = transformers.Llama4ForCausalLM(config)
    with pytest.raises(ValueError) as refused:
        offload(model, budget_fraction=0.5)
    message = str(refused.value)
    assert message.startswith("Llama4ForCausalLM has no MoE layer")
    assert "its Llama4TextExperts (model.layers.0.feed_forward.experts and 2 more)" in message
    assert "runs every expert on every token" in message


def test_a_budget_is_required():
    with pytest.raises(ValueError, match="budget"):
        offload(tiny_model("mixtral"), budget_bytes=None)


def test_offload_shows_its_progress_when_asked(capsys):
    model = tiny_model("qwen3_moe")
    with offload(model, budget_fraction=0.25, progress=True):
        pass
    err = capsys.readouterr().err
    assert "experts in host memory" in err and "3/3" in err
    with offload(model, budget_fraction=0.25, progress=False):
        pass
    assert capsys.readouterr().err.count("experts in host memory") == 0
    with pytest.raises(TypeError, match="progress must be None, True, False or a callable, got str"):
        offload(model, budget_fraction=0.25, progress="yes")


@pytest.mark.parametrize("device", DEVICES)
def test_the_recorded_routing_replays_to_the_live_hit_rate(tmp_path, device):
    """The live run on ``device`` (on CUDA, the device lookup's kernels), the replay by the bench
    on the host backend: the same policy (the library's default), the same hits."""
    model = tiny_model("qwen3_moe", device=device)
    trace_path = tmp_path / "routing.jsonl"
    # One prompt token: every forward is one token, so the live run selects token by token as the
    # replay does (a longer prompt's tokens are selected per layer together, in chunks).
    with offload(model, budget_fraction=0.25) as handle, record_routing(model, trace_path) as recorder:
        greedy(model, prompt=[[7]], new_tokens=24)
        live = handle.total_stats()
    assert recorder.layout_path == tmp_path / "routing.layout.json"
    layout = ModelLayout.from_json(recorder.layout_path)
    assert layout == handle.layout
    trace = read_trace(trace_path)
    assert recorder.records == 24 * 3 and trace.ids.shape[:2] == (24, 3)
    policy = _lib.DEFAULT_POLICY
    report = bench.run(layout, traces=[trace_path], budget_fraction=0.25, backend="host", variants=[policy])
    (result,) = [r for r in report.results if r.variant == policy]
    assert (result.hits, result.misses) == (live.hits, live.misses)
    assert 0 < result.hit_rate < 1


def test_a_batch_of_prompts_is_served_and_recorded_per_sequence(tmp_path):
    model = tiny_model("qwen3_moe", seed=1)
    prompts = [[5, 17, 33, 2], [60, 1, 9, 14]]
    tokens, logits = greedy(model, prompt=prompts, new_tokens=4)
    with offload(model, budget_fraction=0.25), record_routing(model, tmp_path / "batch.npz") as recorder:
        served_tokens, served_logits = greedy(model, prompt=prompts, new_tokens=4)
    assert torch.equal(served_tokens, tokens)
    torch.testing.assert_close(served_logits, logits, **TOLERANCE["cpu"])
    trace = read_trace(tmp_path / "batch.npz")
    # 4 prompt tokens and 3 decoded ones fed back (the 4th new token is not run) per sequence.
    assert recorder.records == 2 * 7 * 3
    assert sorted(set(trace.sequences)) == [0, 1]


def test_the_decode_benchmark_runs_side_by_side_on_the_cpu(tmp_path):
    """benchmarks/hf_decode.py at a tiny size: every mode and budget beside the unmodified model,
    the offloaded tokens equal to its tokens, the JSON written."""
    import importlib.util
    import json

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "hf_decode.py"
    spec = importlib.util.spec_from_file_location("hf_decode", path)
    hf_decode = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hf_decode)
    out = tmp_path / "hf.json"
    rc = hf_decode.main(
        [
            "--device",
            "cpu",
            "--layers",
            "2",
            "--experts",
            "8",
            "--top-k",
            "2",
            "--hidden",
            "64",
            "--ffn",
            "32",
            "--heads",
            "4",
            "--kv-heads",
            "2",
            "--head-dim",
            "16",
            "--vocab",
            "256",
            "--tokens",
            "6",
            "--rounds",
            "2",
            "--json",
            str(out),
        ]
    )
    assert rc == 0
    results = json.loads(out.read_text())["results"]
    assert [(r["budget"], r["mode"]) for r in results] == [
        (1.0, "eager"),
        (1.0, "graph"),
        (0.25, "eager"),
        (0.25, "graph"),
    ]
    for r in results:  # two rounds each, the unmodified copy timed in the same rounds
        assert r["tokens_equal"] and len(r["ratios"]) == len(r["runs_tok_s"]) == 2
        assert r["tok_s"] > 0 and r["unmodified_tok_s"] > 0
    assert results[0]["hit_rate"] == 1.0 and 0 < results[2]["hit_rate"] < 1
