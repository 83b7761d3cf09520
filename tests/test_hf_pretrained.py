"""pyexpcache.hf.offload_pretrained: tiny random checkpoints written by save_pretrained in several
shards (the experts of one layer spread over files), loaded with their experts never in host
memory and served from the files: tokens and logits bit-identical to the checkpoint loaded whole."""

import json

import pytest

torch = pytest.importorskip("torch", reason="pyexpcache.hf needs torch (pip install expcache[hf])")
transformers = pytest.importorskip("transformers", minversion="5", reason="pyexpcache.hf needs transformers >= 5")

from test_hf import CUDA_OK, CUDA_REASON, greedy, tiny_model  # noqa: E402

from pyexpcache import FileSource  # noqa: E402
from pyexpcache.hf import find_experts, offload_pretrained  # noqa: E402
from pyexpcache.hf._checkpoint import Lazy, Tensor  # noqa: E402

from support.child import run_child  # noqa: E402

#: Families whose checkpoints keep each expert's tensors apart (qwen3_moe's gate_proj/up_proj/down_proj,
#: mixtral's w1/w3/w2, renamed at load) or store them fused (gpt_oss: gate_up_proj [E, H, 2I], with biases).
CHECKPOINTS = {"qwen3_moe": dict(moe_intermediate_size=64), "mixtral": dict(intermediate_size=64), "gpt_oss": {}}


def _checkpoint(tmp_path, family):
    tiny_model(family, **CHECKPOINTS[family]).save_pretrained(tmp_path, max_shard_size="20KB")
    assert len(list(tmp_path.glob("*.safetensors"))) > 3
    return tmp_path


@pytest.mark.parametrize("family", sorted(CHECKPOINTS))
def test_the_checkpoints_tokens_and_logits_served_from_its_files(tmp_path, family):
    path = _checkpoint(tmp_path, family)
    reference = transformers.AutoModelForCausalLM.from_pretrained(path)
    tokens, logits = greedy(reference, prompt=[[5]])
    with offload_pretrained(path, budget_fraction=0.25) as handle:
        model = handle.model
        experts = {id(p) for e in find_experts(model) for p in (e.first, e.down)}
        for name, p in model.named_parameters():  # no expert weight in host memory, every other one there
            assert p.device.type == ("meta" if id(p) in experts else "cpu"), name
        source = handle.sources[0]
        assert isinstance(source, FileSource) and len(source.file_paths) > 3
        files = {source.locate(e.layer, x, p)[0] for e in find_experts(model) for x in range(8) for p in range(3)}
        assert len(files) > 1  # experts spread over shards
        served_tokens, served_logits = greedy(model, prompt=[[5]])
        assert handle.total_stats().misses > 0 and handle.total_stats().evictions > 0
        with pytest.raises(ValueError, match="served from the checkpoint's files"):
            handle.refresh()
    assert torch.equal(served_tokens, tokens)
    assert torch.equal(served_logits, logits)


@pytest.mark.skipif(not (CUDA_OK and torch.cuda.is_available()), reason=CUDA_REASON or "torch has no CUDA device")
@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_cuda_the_checkpoint_served_from_its_files_on_the_gpu(tmp_path, family):
    """On a GPU: the bf16 checkpoint loaded whole on the device against the same checkpoint served
    from its files (misses read by the feed threads, the device select in the step)."""
    tiny_model(family, **CHECKPOINTS[family]).to(torch.bfloat16).save_pretrained(tmp_path, max_shard_size="20KB")
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16).to("cuda")
    tokens, logits = greedy(reference, prompt=[[5]])
    del reference
    with offload_pretrained(tmp_path, budget_fraction=0.25, device="cuda", dtype=torch.bfloat16) as handle:
        assert handle.caches[0].backend == "cuda"
        served_tokens, served_logits = greedy(handle.model, prompt=[[5]])
        stats = handle.total_stats()
    assert stats.misses > 0 and stats.evictions > 0
    assert torch.equal(served_tokens, tokens)
    assert torch.equal(served_logits, logits)


def test_a_budget_below_every_expert_reads_each_miss_from_the_files_byte_for_byte(tmp_path):
    path = _checkpoint(tmp_path, "qwen3_moe")
    reference = transformers.AutoModelForCausalLM.from_pretrained(path)
    layers = find_experts(reference)
    one = layers[0].spec().expert_bytes
    with offload_pretrained(path, budget_bytes=2 * one * len(layers)) as handle:  # 2 of 8 experts a layer
        for e in find_experts(handle.model):
            ref = next(r for r in layers if r.layer == e.layer)
            server = e.module._expcache_server
            for x in range(8):
                (slot,) = handle.cache.select_device(e.layer, torch.tensor([[x]]))[0].tolist()
                assert torch.equal(server.weights[ref.weight_names[0]][slot], ref.first[x])
                assert torch.equal(server.weights["down_proj"][slot], ref.down[x])
        assert handle.total_stats().evictions > 0
        tokens, logits = greedy(handle.model, prompt=[[5]])
    expected_tokens, expected_logits = greedy(reference, prompt=[[5]])
    assert torch.equal(tokens, expected_tokens) and torch.equal(logits, expected_logits)


def test_budget_auto_and_a_progress_callable(tmp_path):
    path = _checkpoint(tmp_path, "qwen3_moe")
    seen = []
    handle = offload_pretrained(
        path,
        budget="auto",
        max_len=16,
        margin_bytes=0,
        device_capacity_bytes=1 << 20,
        progress=lambda *a: seen.append(a),
    )
    with handle:
        assert handle.auto_budget is not None and handle.auto_budget.budget_bytes > 0
        greedy(handle.model, prompt=[[5]])
    labels = {label for label, _, _ in seen}
    assert labels == {"non-expert weights", "experts in files"}
    assert seen[-1][1:] == (3, 3)


def test_a_host_pool_between_the_files_and_the_device(tmp_path):
    """host_budget_bytes reaches the caches (shared between them as the budget is): the device's
    misses of the checkpoint's files go through the pool, and the generation is the same."""
    path = _checkpoint(tmp_path, "qwen3_moe")
    with offload_pretrained(path, budget_fraction=0.25) as plain:
        tokens, logits = greedy(plain.model, prompt=[[5]])
    with offload_pretrained(path, budget_fraction=0.25, host_budget_bytes=1 << 20) as handle:
        served_tokens, served_logits = greedy(handle.model, prompt=[[5]])
        pools = [c.pool_stats() for c in handle.caches]
        misses = sum(c.stats().path("device").misses for c in handle.caches)
    assert torch.equal(served_tokens, tokens) and torch.equal(served_logits, logits)
    assert 0 < sum(p.budget_bytes for p in pools) <= 1 << 20
    assert sum(p.hits + p.source_reads for p in pools) == misses > 0
    assert sum(p.inserts for p in pools) > 0


def test_refusals_name_the_reason(tmp_path):
    path = _checkpoint(tmp_path, "qwen3_moe")
    with pytest.raises(ValueError, match=r"host_budget_bytes must be in \[0, 281474976710656\], got -1"):
        offload_pretrained(path, budget_fraction=0.5, host_budget_bytes=-1)
    with pytest.raises(
        ValueError,
        match=r"model\.layers\.0\.mlp\.experts\.0\.(gate|up)_proj\.weight is torch\.float32 in the checkpoint, "
        r"torch\.bfloat16 in the model: the cache serves the checkpoint's bytes as they are, unconverted",
    ):
        offload_pretrained(path, budget_fraction=0.5, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="offload_pretrained sets device_map itself"):
        offload_pretrained(path, budget_fraction=0.5, device_map="cpu")
    with pytest.raises(ValueError, match="give budget='auto', budget_bytes or budget_fraction"):
        offload_pretrained(path)
    with pytest.raises(ValueError, match="no safetensors checkpoint"):
        offload_pretrained(tmp_path / "nowhere", budget_fraction=0.5)


def test_an_mxfp4_checkpoint_is_refused_with_the_reason(tmp_path):
    """An MXFP4 checkpoint's files hold the experts unswizzled, and the GPU's matmul reads them
    swizzled: refused before anything is loaded, naming the way that serves it."""
    path = _checkpoint(tmp_path, "gpt_oss")
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4"}
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        ValueError, match=r"MXFP4 checkpoint's experts are stored unswizzled .* pyexpcache\.hf\.offload"
    ):
        offload_pretrained(path, budget_fraction=0.5)


def test_a_tensor_transformers_would_transpose_is_refused_with_its_name():
    t = Tensor("model.layers.0.mlp.experts.gate_up_proj", 0, 64, 4 * 8 * 6 * 4, torch.float32, (4, 8, 6))
    loaded = Lazy(t)[...].to(device="cpu").transpose(1, 2)  # as qwen3_vl_moe's conversion does
    assert loaded.refused == (
        "transformers' loading applies transpose to model.layers.0.mlp.experts.gate_up_proj: "
        "not a byte range of the file"
    )
    assert Lazy(t)[...].to(torch.float32).ranges[0].offset == 64  # moved, not converted: still the range


def test_the_experts_are_never_in_host_memory(tmp_path):
    """Process memory: 144 MiB of experts (3 layers x 8 x 6 MiB), a quarter of them cached (the host
    backend's emulated device is host memory too, 36 MiB): the peak RSS growth while the checkpoint
    loads and its caches are built stays well below the experts' bytes (measured once a small
    checkpoint of the family has loaded: transformers' imports aside). A forward then reads the
    misses from the files (the CPU's expert product itself gathers its tokens' experts' weights)."""
    tiny_model("qwen3_moe", hidden_size=512, moe_intermediate_size=1024).save_pretrained(
        tmp_path / "big", max_shard_size="40MB"
    )
    _checkpoint(tmp_path / "small", "qwen3_moe")
    out = run_child(
        f"""
        import re
        import torch
        from pyexpcache.hf import offload_pretrained
        def status(key):
            return int(re.search(key + r":\\s+(\\d+) kB", open("/proc/self/status").read()).group(1)) << 10
        offload_pretrained({str(tmp_path / "small")!r}, budget_fraction=0.25).close()
        before = status("VmRSS")
        with offload_pretrained({str(tmp_path / "big")!r}, budget_fraction=0.25) as handle:
            growth = status("VmHWM") - before
            with torch.no_grad():
                handle.model(torch.tensor([[5, 17, 33, 2]]))
            misses = handle.total_stats().misses
        print(growth, misses)
        """,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    growth, misses = map(int, out.stdout.split()[-2:])
    experts = 3 * 8 * 3 * 512 * 1024 * 4
    assert misses > 0
    assert growth < experts * 0.4, (growth, experts)


def test_misses_read_with_o_direct(tmp_path):
    """file_reads="direct": the misses read the shards with O_DIRECT (safetensors' offsets are not
    block-aligned: the library widens each read), the same tokens and logits."""
    path = _checkpoint(tmp_path, "qwen3_moe")
    tokens, logits = greedy(transformers.AutoModelForCausalLM.from_pretrained(path), prompt=[[5]])
    with offload_pretrained(path, budget_fraction=0.25, file_reads="direct") as handle:
        served = greedy(handle.model, prompt=[[5]])
        assert handle.total_stats().misses > 0
    assert torch.equal(served[0], tokens) and torch.equal(served[1], logits)
    with pytest.raises(ValueError, match="file_reads must be 'buffered' or 'direct'"):
        offload_pretrained(path, budget_fraction=0.25, file_reads="mmap")
