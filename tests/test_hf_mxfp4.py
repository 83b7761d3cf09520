"""pyexpcache.hf.offload of GPT-OSS's MXFP4 experts (transformers' ``Mxfp4GptOssExperts``): the
packed FP4 weights and their scales, in the swizzled layouts the GPU's matmul reads, and the
biases, served part by part from the banks; triton_kernels' ``matmul_ogs`` computing from them
over routing metadata rebuilt by slot.

transformers computes MXFP4 experts only on CUDA, with triton_kernels loaded from the Hugging Face
hub (``kernels-community/gpt-oss-triton-kernels``): the tests that run them need a CUDA device and
the package's directory in ``EXPCACHE_MXFP4_KERNEL_DIR`` (the hub repository's ``torch-ext``
folder), else they are skipped with the reason. The rest (what is refused, and how an expert's
bytes are found in a tensor) run everywhere.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
mxfp4 = pytest.importorskip("transformers.integrations.mxfp4")

from test_hf import NEW_TOKENS, greedy, tiny_model  # noqa: E402

from pyexpcache.hf import GraphDecoder, find_experts, offload  # noqa: E402
from pyexpcache.hf._mxfp4 import TENSORS, _expert_bytes, _like  # noqa: E402

from support.cache import CUDA_OK, CUDA_REASON  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

cuda_only = pytest.mark.skipif(
    not (CUDA_OK and torch.cuda.is_available()), reason=CUDA_REASON or "MXFP4 experts compute on CUDA only"
)


@pytest.fixture
def kernel():
    """triton_kernels, from EXPCACHE_MXFP4_KERNEL_DIR, where transformers' MXFP4 integration takes it."""
    where = os.environ.get("EXPCACHE_MXFP4_KERNEL_DIR")
    if not where:
        pytest.skip("triton_kernels: set EXPCACHE_MXFP4_KERNEL_DIR to the gpt_oss_triton_kernels package's directory")
    from _mxfp4_experts import install_kernel

    return install_kernel(where)


def mxfp4_model(seed: int = 0):
    """A tiny GPT-OSS on CUDA whose experts are transformers' MXFP4 experts, quantized from its
    random weights as transformers' MXFP4 loading does. Its experts are 512 wide (the swizzled
    layouts take whole tiles); no sliding window under 32 positions, so GraphDecoder captures it."""
    from _mxfp4_experts import quantize_experts

    model = tiny_model("gpt_oss", seed=seed, device="cuda", hidden_size=512, intermediate_size=512, sliding_window=64)
    return quantize_experts(model)


@cuda_only
def test_mxfp4_experts_served_bit_identical(kernel):
    model = mxfp4_model()
    tokens, logits = greedy(model)
    with offload(model, budget_fraction=0.4) as handle:
        assert handle.computed_by == "mxfp4"
        spec = handle.layout[find_experts(model)[0].layer]
        assert spec.part_names == TENSORS
        assert handle.cache.bank(find_experts(model)[0].layer).arrangement == "parts"
        served_tokens, served_logits = greedy(model)
        stats = handle.total_stats()
    assert torch.equal(served_tokens, tokens)
    assert torch.equal(served_logits, logits)
    assert stats.misses > 0 and stats.evictions > 0  # the budget made the cache work
    # closed: the module computes by itself again, its weights and scales moved back to the GPU
    assert "forward" not in vars(find_experts(model)[0].module)
    assert find_experts(model)[0].weights[0].device.type == "cuda"
    again_tokens, again_logits = greedy(model)
    assert torch.equal(again_tokens, tokens) and torch.equal(again_logits, logits)


@cuda_only
def test_mxfp4_graph_decoder_captures_the_served_step(kernel):
    """Each decode step one CUDA graph replay, the select and the routing by slot inside it:
    tokens and logits equal the same decoder's over the unmodified model."""
    model = mxfp4_model(seed=1)
    prompt = torch.tensor([[5, 17, 33]])
    want, want_logits = GraphDecoder(model, max_len=32).generate(prompt, NEW_TOKENS, output_logits=True)
    with offload(model, budget_fraction=0.3) as handle:
        served = GraphDecoder(model, max_len=32)
        got, got_logits = served.generate(prompt, NEW_TOKENS, output_logits=True)
        assert served.captured
        total = handle.total_stats()
    assert torch.equal(got, want) and torch.equal(got_logits, want_logits)
    assert total.misses > 0 and total.hits > 0


@cuda_only
def test_what_mxfp4_experts_refuse_names_the_way(kernel, tmp_path):
    """refresh() (the copies are of swizzled tensors) and record_routing (the routes are in
    triton_kernels' metadata) are refused with the reason and the way."""
    from pyexpcache.hf import record_routing

    model = mxfp4_model()
    with offload(model, budget_fraction=0.5) as handle:
        with pytest.raises(ValueError, match="swizzled tensors, which refresh cannot make .* offload the model again"):
            handle.refresh()
    with pytest.raises(ValueError, match=r"routed by triton_kernels' routing data.*dequantize=True"):
        record_routing(model, tmp_path / "routing.jsonl")


@cuda_only
def test_mxfp4_budget_auto(kernel):
    """budget="auto" sizes the cache around the model with its dry step through the MXFP4
    experts; the tokens are the unmodified model's."""
    model = mxfp4_model(seed=2)
    tokens, _ = greedy(model)
    with offload(model, budget="auto", max_len=32) as handle:
        assert handle.auto_budget is not None and handle.auto_budget.budget_bytes > 0
        served, _ = greedy(model)
    assert torch.equal(served, tokens)


@cuda_only
def test_mxfp4_banks_hold_every_tensor_byte_for_byte(kernel):
    """Each of an expert's six tensors, at its slot in its part, holds the bytes the GPU held for
    it before offload (weights and scales as swizzled, biases as float32)."""
    model = mxfp4_model()
    e = find_experts(model)[1]
    before = [t.detach().clone() for t in e.weights]
    with offload(model, budget_fraction=1.0) as handle:
        ids = torch.tensor([[3, 6], [0, 7]], device="cuda")
        slots = handle.cache.select_device(e.layer, ids)
        bank = handle.cache.bank(e.layer)
        for name, rows in zip(TENSORS, before):
            view = torch.from_dlpack(bank.part(name, dtype="uint8"))
            for expert, slot in zip(ids.reshape(-1).tolist(), slots.reshape(-1).tolist()):
                assert torch.equal(view[slot].cpu(), rows[expert].cpu()), (name, expert)


def test_mxfp4_experts_without_weights_refused_with_the_reason():
    """An Mxfp4GptOssExperts that holds no MXFP4 weights yet (built, not loaded) is refused,
    naming the module and what to do."""
    model = tiny_model("gpt_oss")
    model.model.layers[0].mlp.experts = mxfp4.Mxfp4GptOssExperts(model.config)
    with pytest.raises(ValueError, match=r"Mxfp4GptOssExperts holds no MXFP4 weights yet .* load the checkpoint"):
        offload(model, budget_fraction=0.5)


def test_an_experts_bytes_are_found_in_a_transposed_tensor():
    """A tensor whose experts each fill one dense block in another order (a transposed view, as
    the swizzled layouts give) is read as rows of bytes, and viewed again over other rows in its
    own format; one whose experts are not dense blocks is refused with the reason."""
    base = torch.arange(3 * 4 * 8, dtype=torch.float32).reshape(3, 4, 8)
    t = base.mT  # [3, 8, 4], strides (32, 1, 8)
    rows = _expert_bytes(t, 3, "t")
    assert rows.shape == (3, 128) and torch.equal(rows[1], base[1].reshape(-1).view(torch.uint8))
    wide = torch.zeros(5, 256, dtype=torch.uint8)  # rows of 256 bytes, as a bank's parts are
    wide[:3, :128] = rows
    again = _like(t, wide, 3)
    assert again.shape == t.shape and torch.equal(again, t)
    with pytest.raises(ValueError, match=r"not one dense block at expert \* stride\(0\)"):
        _expert_bytes(base[:, :, ::2], 3, "strided")
    with pytest.raises(ValueError, match="does not lead with the 4 experts"):
        _expert_bytes(base, 4, "short")
