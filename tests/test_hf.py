"""pyexpcache.hf on the CPU (host backend): tiny random models of each transformers MoE family,
built from their config classes (no download), served with 25 % of their experts cached."""

import pytest

torch = pytest.importorskip("torch", reason="pyexpcache.hf needs torch (pip install expcache[hf])")
transformers = pytest.importorskip("transformers", minversion="5",
                                   reason="pyexpcache.hf needs transformers >= 5 (pip install expcache[hf])")

from pyexpcache import ModelLayout  # noqa: E402
from pyexpcache import bench  # noqa: E402
from pyexpcache.hf import IMPLEMENTATION, find_experts, offload, record_routing  # noqa: E402
from pyexpcache.traces import read_trace  # noqa: E402

COMMON = dict(vocab_size=96, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=64)
#: family -> (model class name, config class name, config arguments beyond COMMON). 8 experts, top-2.
FAMILIES = {
    "mixtral": ("MixtralForCausalLM", "MixtralConfig",
                dict(intermediate_size=48, num_local_experts=8, num_experts_per_tok=2)),
    "qwen2_moe": ("Qwen2MoeForCausalLM", "Qwen2MoeConfig",
                  dict(intermediate_size=64, moe_intermediate_size=24, shared_expert_intermediate_size=32,
                       num_experts=8, num_experts_per_tok=2)),
    "qwen3_moe": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig",
                  dict(intermediate_size=64, moe_intermediate_size=24, num_experts=8, num_experts_per_tok=2,
                       head_dim=8)),
    "olmoe": ("OlmoeForCausalLM", "OlmoeConfig", dict(intermediate_size=40, num_experts=8, num_experts_per_tok=2)),
    "deepseek_v3": ("DeepseekV3ForCausalLM", "DeepseekV3Config",
                    dict(intermediate_size=64, moe_intermediate_size=24, n_routed_experts=8, n_shared_experts=1,
                         num_experts_per_tok=2, first_k_dense_replace=1, n_group=1, topk_group=1, kv_lora_rank=16,
                         q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
                         num_key_value_heads=4)),  # MLA: one key and value per head
    "gpt_oss": ("GptOssForCausalLM", "GptOssConfig",
                dict(intermediate_size=24, num_local_experts=8, num_experts_per_tok=2, head_dim=8,
                     sliding_window=16)),
}
PROMPT = [[5, 17, 33, 2, 61, 40]]
NEW_TOKENS = 8
#: Against the unmodified model (transformers' default experts implementation, grouped_mm, which
#: groups the (token, expert) pairs by expert and adds the outputs in another order), float32 logits
#: differ by rounding: at most 6e-6 measured over the six families, on logits up to 6.4 in magnitude
#: (tokens equal). Against batched_mm (the same kernels on the same bytes) they are bit-identical.
TOLERANCE = dict(rtol=1e-5, atol=5e-5)


def tiny_model(family: str, seed: int = 0):
    model_class, config_class, extra = FAMILIES[family]
    config = getattr(transformers, config_class)(**{**COMMON, **extra})
    torch.manual_seed(seed)
    model = getattr(transformers, model_class)(config).eval()
    with torch.no_grad():  # random weights large enough that routing and tokens vary
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.3)
    return model


def greedy(model, prompt=PROMPT, new_tokens=NEW_TOKENS):
    with torch.no_grad():
        out = model.generate(torch.tensor(prompt), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    return out.sequences, torch.stack(out.logits)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_offload_generates_the_unmodified_models_tokens(family):
    model = tiny_model(family)
    tokens, logits = greedy(model)  # the unmodified model
    model.set_experts_implementation("batched_mm")
    _, batched_logits = greedy(model)
    with offload(model, budget_fraction=0.25) as handle:
        assert model.config._experts_implementation == IMPLEMENTATION
        served_tokens, served_logits = greedy(model)
        total = handle.cache.stats().total
    assert torch.equal(served_tokens, tokens)
    assert torch.equal(served_logits, batched_logits)  # the same kernels on the same bytes
    torch.testing.assert_close(served_logits, logits, **TOLERANCE)
    assert total.misses > 0 and total.evictions > 0  # 25 %: experts were streamed
    assert model.config._experts_implementation == "batched_mm"  # restored by close()


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
            first = torch.cat((server.gate[slot], server.up[slot])).view(e.first.shape[1:])
            assert torch.equal(first, e.first[expert])
            assert torch.equal(server.down[slot], e.down[expert])


def test_a_model_without_experts_interface_layers_is_refused_by_name():
    config = transformers.LlamaConfig(**COMMON, intermediate_size=48)
    model = transformers.LlamaForCausalLM(config)
    with pytest.raises(ValueError, match="LlamaForCausalLM has no MoE layer"):
        offload(model, budget_fraction=0.5)


def test_a_budget_is_required():
    with pytest.raises(ValueError, match="budget"):
        offload(tiny_model("mixtral"), budget_bytes=None)


def test_the_recorded_routing_replays_to_the_live_hit_rate(tmp_path):
    model = tiny_model("qwen3_moe")
    trace_path = tmp_path / "routing.jsonl"
    # One prompt token: every forward is one token, so the live run selects token by token as the
    # replay does (a longer prompt's tokens are selected per layer together, in chunks).
    with offload(model, budget_fraction=0.25) as handle, record_routing(model, trace_path) as recorder:
        greedy(model, prompt=[[7]], new_tokens=24)
        live = handle.cache.stats().total
    assert recorder.layout_path == tmp_path / "routing.layout.json"
    layout = ModelLayout.from_json(recorder.layout_path)
    assert layout == handle.layout
    trace = read_trace(trace_path)
    assert recorder.records == 24 * 3 and trace.ids.shape[:2] == (24, 3)
    report = bench.run(layout, traces=[trace_path], budget_fraction=0.25, backend="host", variants=["lru"])
    (result,) = [r for r in report.results if r.variant == "lru"]
    assert (result.hits, result.misses) == (live.hits, live.misses)
    assert 0 < result.hit_rate < 1


def test_a_batch_of_prompts_is_served_and_recorded_per_sequence(tmp_path):
    model = tiny_model("qwen3_moe", seed=1)
    prompts = [[5, 17, 33, 2], [60, 1, 9, 14]]
    tokens, logits = greedy(model, prompt=prompts, new_tokens=4)
    with offload(model, budget_fraction=0.25), record_routing(model, tmp_path / "batch.npz") as recorder:
        served_tokens, served_logits = greedy(model, prompt=prompts, new_tokens=4)
    assert torch.equal(served_tokens, tokens)
    torch.testing.assert_close(served_logits, logits, **TOLERANCE)
    trace = read_trace(tmp_path / "batch.npz")
    # 4 prompt tokens and 3 decoded ones fed back (the 4th new token is not run) per sequence.
    assert recorder.records == 2 * 7 * 3
    assert sorted(set(trace.sequences)) == [0, 1]
