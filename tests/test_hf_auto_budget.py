"""pyexpcache.hf.offload(budget="auto"): the budget sized from the device's free memory, on the
CPU against the host backend's emulated device (``device_capacity_bytes``) and, with a GPU, on
CUDA; tiny random models of each family (tests/test_hf.py's)."""

import inspect
import logging

import pytest

torch = pytest.importorskip("torch", reason="pyexpcache.hf needs torch (pip install expcache[hf])")
transformers = pytest.importorskip(
    "transformers", minversion="5", reason="pyexpcache.hf needs transformers >= 5 (pip install expcache[hf])"
)

from test_hf import FAMILIES, greedy, tiny_model  # noqa: E402

from pyexpcache.hf import (  # noqa: E402
    AutoBudget,
    _auto_budget as auto,
    find_experts,
    offload,
)

from support.cache import CUDA_OK, CUDA_REASON  # noqa: E402

MiB = 1 << 20
TERMS = ("free device memory", "resident weights", "KV cache", "activation peak", "margin")


def sized(model, capacity=MiB, **kwargs):
    """offload(model, budget="auto") on the CPU, the emulated device ``capacity`` bytes."""
    kwargs.setdefault("max_len", 32)
    kwargs.setdefault("margin_bytes", 0)
    return offload(model, budget="auto", device_capacity_bytes=capacity, **kwargs)


def non_expert_bytes(model) -> int:
    experts = {id(e.first) for e in find_experts(model)} | {id(e.down) for e in find_experts(model)}
    tensors = list(model.parameters()) + list(model.buffers())
    return sum(t.numel() * t.element_size() for t in {id(t): t for t in tensors if id(t) not in experts}.values())


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_terms_add_up_and_the_model_decodes_as_unmodified(family):
    model = tiny_model(family)
    expected = greedy(model)
    with sized(model, max_len=24, batch=2, margin_bytes=20_000) as handle:
        b = handle.auto_budget
        assert isinstance(b, AutoBudget)
        assert (b.total_bytes, b.max_len, b.batch, b.margin_bytes, b.device) == (MiB, 24, 2, 20_000, "cpu")
        assert b.resident_bytes == non_expert_bytes(model) > 0
        assert b.free_bytes == b.total_bytes - b.resident_bytes
        assert b.kv_bytes == auto.kv_cache_bytes(model.config, 24, 2, model.dtype) > 0
        assert b.activation_bytes > 0
        assert b.left_bytes == b.free_bytes - b.kv_bytes - b.activation_bytes - b.margin_bytes
        assert b.budget_bytes == min(b.experts_bytes, b.left_bytes)
        assert b.fraction == b.budget_bytes / b.experts_bytes
        assert b.top_k == 2
        # the caches leave free what the budget does not take, so the library keeps to it
        assert sum(c.classes()[0].cap_experts for c in handle.caches) > 0
        tokens, logits = greedy(model)
    assert torch.equal(tokens, expected[0])
    torch.testing.assert_close(logits, expected[1], rtol=0, atol=0)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_kv_cache_term_is_the_bytes_of_transformers_static_cache(family):
    model = tiny_model(family)
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    for max_len in (8, 40):  # GPT-OSS: under and over its sliding window of 16
        cache = transformers.StaticCache(config=model.config, max_cache_len=max_len)
        with torch.no_grad():
            model(torch.randint(0, 96, (2, 4)), use_cache=True, **{name: cache})
        held = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
        assert auto.kv_cache_bytes(model.config, max_len, 2, model.dtype) == held


def test_free_memory_that_holds_everything_gives_every_expert():
    model = tiny_model("qwen3_moe")
    with sized(model, capacity=64 * MiB) as handle:
        b = handle.auto_budget
        assert b.capped and b.fraction == 1.0 and b.budget_bytes == b.experts_bytes < b.left_bytes
        assert handle.cache.classes()[0].cap_experts == sum(e.num_experts for e in find_experts(model))
        assert "every expert" in str(b)


def test_a_tight_device_gives_the_experts_their_share():
    model = tiny_model("qwen3_moe")
    with sized(model, capacity=64 * MiB) as handle:
        roomy = handle.auto_budget
    # what the terms took, and half the experts' bytes beyond
    capacity = roomy.total_bytes - roomy.left_bytes + roomy.experts_bytes // 2
    model = tiny_model("qwen3_moe")
    with sized(model, capacity=capacity) as handle:
        b = handle.auto_budget
        assert not b.capped and b.budget_bytes == b.left_bytes
        assert 0.4 < b.fraction < 0.6  # the activation peak differs a little with the dry step's cache
        experts = sum(e.num_experts for e in find_experts(model))
        cap = handle.cache.classes()[0].cap_experts
        assert cap == handle.cache.classes()[0].target_experts and 0.4 * experts < cap < 0.6 * experts
        assert f"{b.fraction:.1%}" in str(b)


def test_a_budget_that_cannot_serve_a_decode_step_is_refused_with_every_term():
    model = tiny_model("qwen3_moe")
    with sized(model, capacity=64 * MiB) as handle:
        roomy = handle.auto_budget
    # after the dry step: its activation peak leaves less than one decode step's experts
    capacity = roomy.total_bytes - roomy.left_bytes + roomy.least_bytes // 2
    model = tiny_model("qwen3_moe")
    with pytest.raises(
        ValueError, match=r"less than the .* that hold one decode step's experts \(batch 1 x top-2"
    ) as e:
        sized(model, capacity=capacity)
    for term in TERMS + ("max_len 32 x batch 1", "measured in a dry step of 1 x 32 tokens", "Lower max_len or batch"):
        assert term in str(e.value)
    assert model.config._experts_implementation != "expcache"  # nothing left served
    # before it: free memory less the KV cache and the margin already too small
    with pytest.raises(ValueError, match="activation peak not measured") as e:
        sized(model, capacity=roomy.resident_bytes + roomy.kv_bytes)
    assert all(term in str(e.value) for term in TERMS)
    with sized(model, capacity=64 * MiB):  # and the model can be offloaded after
        pass


def test_the_line_names_each_term_through_the_library_logger(caplog, capsys, monkeypatch):
    model = tiny_model("mixtral")
    with monkeypatch.context() as m:
        m.setattr(auto.logger, "hasHandlers", lambda: False)  # as without logging configured (pytest's is)
        with sized(model, capacity=64 * MiB):
            pass
    line = [x for x in capsys.readouterr().err.splitlines() if "budget='auto'" in x]
    assert len(line) == 1 and line[0].startswith("expcache: budget='auto': ")  # no logging configured: stderr
    assert all(term in line[0] for term in TERMS)
    with caplog.at_level(logging.INFO, logger="pyexpcache"), sized(model, capacity=64 * MiB) as handle:
        pass
    records = [r for r in caplog.records if "budget='auto'" in r.getMessage()]
    assert [r.levelno for r in records] == [logging.INFO]
    assert records[0].getMessage() == str(handle.auto_budget)
    assert "budget='auto'" not in capsys.readouterr().err


def test_max_len_defaults_to_the_models_and_batch_to_one():
    model = tiny_model("olmoe")  # max_position_embeddings=64, no max_length in its generation config
    with offload(model, budget="auto", device_capacity_bytes=64 * MiB, margin_bytes=0) as handle:
        assert (handle.auto_budget.max_len, handle.auto_budget.batch) == (64, 1)
    model.generation_config.max_length = 48
    with offload(model, budget="auto", device_capacity_bytes=64 * MiB, margin_bytes=0) as handle:
        assert handle.auto_budget.max_len == 48
    # the default margin: 1 GiB and 2 % of the device's memory
    with offload(model, budget="auto", device_capacity_bytes=2 << 30) as handle:
        assert handle.auto_budget.margin_bytes == (1 << 30) + int(0.02 * (2 << 30))


def test_auto_arguments_are_checked():
    model = tiny_model("qwen3_moe")
    with pytest.raises(ValueError, match="not budget and budget_fraction"):
        offload(model, budget="auto", budget_fraction=0.5)
    with pytest.raises(ValueError, match="budget must be 'auto'"):
        offload(model, budget="half")
    with pytest.raises(ValueError, match="size budget='auto'"):
        offload(model, budget_fraction=0.5, max_len=32)
    for bad in (dict(batch=0), dict(max_len=-1), dict(margin_bytes=1.5)):
        with pytest.raises(ValueError, match="max_len|batch|margin_bytes"):
            sized(model, **bad)
    assert model.config._experts_implementation != "expcache"


def test_the_cpu_peak_counts_what_a_step_allocates_and_frees():
    x = torch.ones(256, 256)  # 256 KiB, allocated before
    with auto._PeakAllocated() as peak:
        a = torch.ones(512, 256)  # 512 KiB
        b = a @ x  # 512 KiB
        c = b.t()  # a view: nothing
        c.relu_()  # in place: nothing
        del a, b, c
        d = torch.zeros(256, 256)  # 256 KiB, once the others are gone
    assert peak.peak == 2 * 512 * 1024 and peak.live == 256 * 1024
    del d


@pytest.mark.skipif(not (CUDA_OK and torch.cuda.is_available()), reason=CUDA_REASON or "torch has no CUDA device")
def test_on_cuda_free_memory_is_measured_and_the_model_decodes_as_unmodified():
    model = tiny_model("qwen3_moe", device="cuda")
    expected = greedy(model)
    with offload(model, budget="auto", max_len=32, batch=2) as handle:
        b = handle.auto_budget
        free, total = torch.cuda.mem_get_info()
        assert b.total_bytes == total and 0 < b.free_bytes <= total and b.activation_bytes > 0
        assert b.budget_bytes == min(b.experts_bytes, b.left_bytes) and b.capped
        info = handle.cache.classes()[0]  # the dry step's cache gone: the library keeps to the budget
        assert info.cap_experts == info.target_experts == sum(e.num_experts for e in find_experts(model))
        tokens, logits = greedy(model)
    assert torch.equal(tokens, expected[0])
    torch.testing.assert_close(logits, expected[1], rtol=0, atol=0)
