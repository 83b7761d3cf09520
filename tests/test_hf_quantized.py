"""pyexpcache.hf.offload of quantized experts: transformers' FP8Experts (FP8 block-scaled weights
with their inverse scales; static activation scales) served part by part from the banks, the
module's own implementation (eager, batched_mm, grouped_mm) computing from them. The caches of
quantized experts keep part-major banks: each tensor its own contiguous ``[cap, ...]`` view.

transformers computes FP8 experts with a Triton kernel it loads from the Hugging Face hub
(``kernels-community/finegrained-fp8``). On the CPU there is none: these tests give the module
a stand-in with the kernel's three entry points (:class:`ReferenceFP8`: each row's product with
the dequantized weight, in float32), used alike by the unmodified and the served model, so what
they check is that the served module reads the same bytes as the unmodified one. On a GPU the
real kernel runs where its source is on ``EXPCACHE_FP8_KERNEL_DIR`` (a directory holding the
``finegrained_fp8`` package), else those tests are skipped with the reason.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
fp8 = pytest.importorskip("transformers.integrations.finegrained_fp8")

from test_hf import DEVICES, greedy, tiny_model  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from _fp8_experts import install_kernel, quantize_experts, restore_kernel  # noqa: E402

from pyexpcache import ModelLayout  # noqa: E402
from pyexpcache.hf import find_experts, offload  # noqa: E402


class ReferenceFP8:
    """The finegrained-fp8 kernel's entry points in torch, row by row (a row's result does not
    depend on the rows beside it, so sorting rows by slot or by expert rounds them alike)."""

    @staticmethod
    def _dequantized(weight: torch.Tensor, scale: torch.Tensor, block) -> torch.Tensor:
        w = weight.to(torch.float32)
        s = scale.to(torch.float32)
        if block is None:
            return w * s.reshape(())
        rows = s.repeat_interleave(block[0], dim=0)[: w.shape[0]]
        return w * rows.repeat_interleave(block[1], dim=1)[:, : w.shape[1]]

    @classmethod
    def _rows(cls, a, weights, dtype):
        out = [a[i].to(torch.float32) @ weights(i).T for i in range(a.shape[0])]
        return torch.stack(out).to(dtype) if out else a.new_zeros(0, 0, dtype=dtype)

    @classmethod
    def matmul(cls, a, weight, scale, block_size, output_dtype=None, activation_scale=None):
        w = cls._dequantized(weight, scale, block_size)
        return cls._rows(a.reshape(-1, a.shape[-1]), lambda i: w, output_dtype or a.dtype).reshape(
            *a.shape[:-1], weight.shape[0]
        )

    @classmethod
    def batched_matmul(cls, a, weight, scale, expert_ids, block_size, output_dtype=None):
        ids = expert_ids.tolist()
        return cls._rows(
            a, lambda i: cls._dequantized(weight[ids[i]], scale[ids[i]], block_size), output_dtype or a.dtype
        )

    @classmethod
    def grouped_matmul(cls, a, weight, scale, offsets, tokens_per_expert, block_size, output_dtype=None):
        ends = offsets.tolist()
        group = [next(g for g, end in enumerate(ends) if i < end) for i in range(int(ends[-1]) if ends else 0)]
        out = cls._rows(
            a[: len(group)],
            lambda i: cls._dequantized(weight[group[i]], scale[group[i]], block_size),
            output_dtype or a.dtype,
        )
        return torch.cat([out, a.new_zeros(a.shape[0] - len(group), weight.shape[1], dtype=out.dtype)])


@pytest.fixture
def kernel(request, monkeypatch):
    """transformers' FP8 kernel slot filled: the stand-in on the CPU, the real kernel on CUDA."""
    callspec = getattr(request.node, "callspec", None)
    if (callspec.params.get("device", "cpu") if callspec else "cpu") == "cpu":
        bundle = fp8.FineGrainedFP8(ReferenceFP8.matmul, ReferenceFP8.batched_matmul, ReferenceFP8.grouped_matmul)
        monkeypatch.setattr(fp8, "_FINEGRAINED_FP8", bundle)
        yield bundle
        return
    where = os.environ.get("EXPCACHE_FP8_KERNEL_DIR")
    if not where:
        pytest.skip("the finegrained-fp8 Triton kernel: set EXPCACHE_FP8_KERNEL_DIR to its package's directory")
    before = install_kernel(where)
    yield fp8._FINEGRAINED_FP8
    restore_kernel(before)


def fp8_model(device="cpu", scale_fmt="float", activation_scheme="dynamic"):
    """A tiny Qwen3-MoE whose experts are transformers' FP8Experts, quantized from its random
    float weights by transformers' own Fp8Quantize; everything else as it was. On CUDA its
    experts are wider, in blocks of 32 (the Triton kernel's products take 16 or more a side)."""
    if device == "cuda":
        model, block = tiny_model("qwen3_moe", device=device, moe_intermediate_size=64), (32, 32)
    else:
        model, block = tiny_model("qwen3_moe"), (8, 8)
    return quantize_experts(model, block, scale_fmt, activation_scheme)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("implementation", ["eager", "batched_mm", "grouped_mm"])
def test_fp8_experts_served_bit_identical(device, implementation, kernel):
    model = fp8_model(device)
    model.set_experts_implementation(implementation)
    tokens, logits = greedy(model)
    with offload(model, budget_fraction=0.4) as handle:
        assert handle.computed_by == implementation
        spec = handle.layout[find_experts(model)[0].layer]
        assert spec.part_names == ("gate_up_proj", "gate_up_proj_scale_inv", "down_proj", "down_proj_scale_inv")
        assert spec.part("gate_up_proj").dtype == "float8_e4m3fn"
        served_tokens, served_logits = greedy(model)
        stats = handle.total_stats()
    assert torch.equal(served_tokens, tokens)
    assert torch.equal(served_logits, logits)
    assert stats.misses > 0 and stats.evictions > 0  # the budget made the cache work


@pytest.mark.parametrize("scale_fmt, activation_scheme", [("ue8m0", "dynamic"), ("float", "static")])
def test_fp8_scale_formats_and_static_activation_scales(scale_fmt, activation_scheme, kernel):
    """UE8M0 scales (float8_e8m0fnu) and per-expert static activation scales are parts too."""
    model = fp8_model(scale_fmt=scale_fmt, activation_scheme=activation_scheme)
    if activation_scheme == "static":  # transformers' batched and grouped FP8 products are dynamic only
        model.set_experts_implementation("eager")
    tokens, logits = greedy(model)
    with offload(model, budget_fraction=0.4) as handle:
        spec = handle.layout[find_experts(model)[0].layer]
        served_tokens, served_logits = greedy(model)
    if activation_scheme == "static":
        assert (
            "gate_up_proj_activation_scale" in spec.part_names and spec.part("down_proj_activation_scale").nbytes == 4
        )
    else:
        assert spec.part("down_proj_scale_inv").dtype == "float8_e8m0fnu"
    assert torch.equal(served_tokens, tokens) and torch.equal(served_logits, logits)


def test_fp8_layout_matches_the_config_layout(kernel):
    """The parts found on the modules are those ModelLayout.from_hf_config gives for the same
    config with its quantization_config: a layout written from a config benchmarks these bytes."""
    model = fp8_model()
    config = {**model.config.to_dict(), "quantization_config": {"quant_method": "fp8", "weight_block_size": [8, 8]}}
    from_config = ModelLayout.from_hf_config(config)
    e = find_experts(model)[0]
    assert from_config[e.layer].parts == e.spec().parts


def test_fp8_refresh_serves_edited_scales(kernel):
    """An edited scale shows on the parameter: a forward raises until refresh(), then the new
    bytes are served."""
    model = fp8_model()
    with offload(model, budget_fraction=0.4) as handle:
        e = find_experts(model)[0]
        greedy(model, new_tokens=1)
        with torch.no_grad():
            e.module.down_proj_scale_inv.mul_(2.0)
        with pytest.raises(RuntimeError, match="refresh"):
            greedy(model, new_tokens=1)
        handle.refresh()
        served = greedy(model)
    handle.close()
    assert torch.equal(served[1], greedy(model)[1])


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone().reshape(-1).view(torch.uint8)


@pytest.mark.parametrize("activation_scheme", ["dynamic", "static"])
def test_fp8_banks_hold_every_tensor_byte_for_byte(activation_scheme, kernel):
    """Each quantized tensor of an expert, at its slot in its part's view, is the parameter's row:
    weights, scales and static activation scales (a part of one float32)."""
    model = fp8_model(activation_scheme=activation_scheme)
    e = find_experts(model)[1]
    with offload(model, budget_fraction=1.0) as handle:
        ids = torch.tensor([[3, 6], [0, 7]])
        slots = handle.cache.select_device(e.layer, ids)
        server = e.module._expcache_server
        assert len(server.weights) == (6 if activation_scheme == "static" else 4)
        assert handle.cache.bank(e.layer).arrangement == "parts"
        for name, view in server.weights.items():
            param = getattr(e.module, name)
            assert view.dtype == param.dtype and view.shape[1:] == param.shape[1:], name
            if name in ("gate_up_proj", "down_proj"):  # whole 256-byte rows: [cap, N, K] as kernels want it
                assert view.is_contiguous(), name
            for expert, slot in zip(ids.reshape(-1).tolist(), slots.reshape(-1).tolist()):
                assert torch.equal(_bytes(view[slot]), _bytes(param[expert])), (name, expert)
