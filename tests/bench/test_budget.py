"""The benchmark's budget (expcache_bench/budget.py, bench.Bench): a host run at divided sizes keeps
the slot counts of the full-size run (or refuses the scale), its caches hold every size class of the
layout at once, and a budget that rounds to 0 bytes names the option it came from and the smallest
value of it that holds an expert."""

from __future__ import annotations

import pytest

import expcache_bench as bench
from expcache_bench import cli, options
from expcache_bench.modes import devices, graph_loop
from expcache_bench.modes.variants import run_variant
from expcache_bench.traces import synthetic_trace
from pyexpcache import ExpertCache, HostSource, ModelLayout
from pyexpcache.budget import class_targets, resolve_budget
from pyexpcache.layout import LayerSpec

#: Qwen3-30B-A3B's config.json (the keys from_hf_config reads): 48 layers x 128 experts, [768, 2048]
#: gate and up; in Q4_K each part is 884,736 B, 3,456 B at / 256, whose slot stride is 3,584 B.
QWEN3 = dict(
    model_type="qwen3_moe",
    num_hidden_layers=48,
    num_experts=128,
    num_experts_per_tok=8,
    hidden_size=2048,
    moe_intermediate_size=768,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    torch_dtype="bfloat16",
)


def full_cap(layout: ModelLayout, budget_bytes: int) -> list[int]:
    """Each class's cap in a cache of the full-size ``layout`` itself (a source of its real bytes)."""
    with (
        HostSource(layout) as source,
        ExpertCache(
            layout,
            source,
            budget_bytes=budget_bytes,
            backend="host",
            max_classes=len(layout.classes()),
            log_level=0,
            device_capacity_bytes=1 << 40,
        ) as cache,
    ):
        for layers in layout.classes().values():
            cache.select(layers[0], [0])
        return [c.cap_experts for c in cache.classes()]


def bench_caps(b: bench.Bench) -> list[int]:
    """Each class's cap in a cache the bench makes (as the policy variants do)."""
    with b.make_cache(budget_bytes=b.budget_bytes, policy="lru", log_level=0) as cache:
        for layers in b.layout.classes().values():
            cache.select(layers[0], [0])
        return [c.cap_experts for c in cache.classes()]


def small_model() -> ModelLayout:
    """A small model: 4 layers of 32 experts, parts of 12,288 B (48 B at / 256, a 256 B stride each)."""
    return ModelLayout((LayerSpec(32, 12288, 12288, 12288),) * 4, name="small")


def test_a_host_run_keeps_qwen3s_slot_counts():
    """Qwen3-30B-A3B Q4_K at / 256: the budget of 64 full-size slots gave 61 (the stride of 3,456 B
    is 3,584 B); now the caches get the budget that gives 64."""
    full = ModelLayout.from_hf_config(QWEN3, "Q4_K")
    slot = 3 * 884736
    b = bench.Bench(full.scaled(256), backend="host", budget_bytes=64 * slot // 256, scale=256)
    try:
        assert bench_caps(b) == [64]
        assert b.full_budget_bytes == 64 * slot and b.budget_bytes >= 64 * 3 * 3584
    finally:
        b.close()


def test_a_host_run_of_a_small_model_keeps_its_slot_counts_and_hit_rate():
    """Parts of 48 B at / 256 took a 768 B slot: cap 3 where the full size has 16, 0 % hits. The
    caps and the hit rate now equal a full-size cache's, and the header says so."""
    full = small_model()
    trace = synthetic_trace(60, 4, 32, 4, seed=3, first_layer=0, name="small")
    budget_bytes = 16 * 3 * 12288
    at_full = bench.run(full, "decode", variants=["lru"], traces=[trace], budget_bytes=budget_bytes, backend="host")
    at_256 = bench.run(
        full.scaled(256),
        "decode",
        variants=["lru"],
        traces=[trace],
        budget_bytes=budget_bytes // 256,
        backend="host",
        host_scale=256,
    )
    assert full_cap(full, budget_bytes) == [16]
    b = bench.Bench(full.scaled(256), backend="host", budget_bytes=budget_bytes // 256, scale=256)
    try:
        assert bench_caps(b) == [16]
    finally:
        b.close()
    assert at_256.results[0].hit_rate == at_full.results[0].hit_rate > 0.3
    header = bench.format_report(at_256).splitlines()[1]
    assert "budget 576 KiB = 12.5 % of the experts' bytes (sizes / 256 here" in header
    assert "the same slot counts" in header


def test_two_classes_keep_their_slot_counts():
    """DeepSeek V4 Flash mixed at / 4096: its parts (528 B for IQ2_XXS) take 768 B strides; both
    classes keep the counts of a full-size cache of the same budget."""
    full = ModelLayout.preset("mixed")
    b = bench.Bench(full.scaled(4096), backend="host", budget_bytes=(12 << 30) // 4096, scale=4096)
    try:
        assert bench_caps(b) == [1374, 222]  # a full-size cache's (12 GiB over 2,100 + 258 slots of 5.6 and 8.6 MiB)
    finally:
        b.close()


def test_deepseek_at_256_keeps_its_budget():
    """Where the budget divided by the scale already gives the full-size counts (every preset part
    a multiple of 256 B at / 256), it is the caches' budget: the bench's results do not change."""
    layout = ModelLayout.preset("mixed", scale=256)
    b = bench.Bench(layout, backend="host", budget_bytes=(12 << 30) // 256, scale=256)
    try:
        assert b.budget_bytes == (12 << 30) // 256
    finally:
        b.close()


def test_a_scale_no_budget_can_keep_is_refused_naming_the_class():
    from expcache_bench import budget

    """Three classes whose counts at / 256 move together where at full size they do not (parts of
    1 B and 257 B at / 256 take 768 B and 1,536 B slots, 3 and 3 x 257 times less at full size):
    at this budget (found by a search) no budget at / 256 gives the full-size counts [2, 1, 0]."""
    full = ModelLayout(
        (LayerSpec(60000, 256, 256, 256), LayerSpec(59999, 65792, 65792, 65792), LayerSpec(1, 256000, 256000, 256000)),
        name="tri",
    )
    assert class_targets(full, 396308) == [2, 1, 0]
    message = (
        r"^at sizes / 256 no budget keeps every size class's slot count of the full-size tri at a budget of "
        r"396308 B: class \[gate 65792, up 65792, down 65792 B\] has 1 at full size and 2 at the smallest "
        r"budget that gives every class at least its count \(the slots' alignment does not scale\); scale 8 "
        r"keeps them$"
    )
    with pytest.raises(ValueError, match=message):
        budget.scaled_budget(full.scaled(256), 396308, 256)
    assert class_targets(full.scaled(8), budget.scaled_budget(full.scaled(8), 396308, 8)) == [2, 1, 0]


def test_the_caches_hold_every_size_class_at_once():
    """A layout of five size classes: the bench's caches (variants, graph loop, devices) hold all
    five, where the library's default of 4 made a device-lookup cache refuse the fifth and the
    others release a class for each new one."""
    specs = [LayerSpec(16, 256 * (i + 1), 256, 256) for i in range(5)]
    layout = ModelLayout(tuple(specs * 2), name="five")
    trace = synthetic_trace(30, 10, 16, 2, seed=1, first_layer=0, name="five")
    b = bench.Bench(layout, backend="host", pinned=True, budget_bytes=layout.total_bytes // 4)  # the graph loop's
    try:
        with b.make_cache(budget_bytes=b.budget_bytes) as cache:
            assert cache.max_classes == 5
        w = bench.build_workload("decode", [trace])
        lru = run_variant(b, "lru", w)
        assert lru.releases == 0 and lru.hits > 0
        assert run_variant(b, "slab", w).releases > 0  # the seed design's one slab: max_classes=1, kept
        report = graph_loop.run_graph_loop(b, traces=[trace])
        assert report.settings["same_hits_as_c_loop"] is True
        report = devices.run_devices(b, 2, traces=[trace], placement="round-robin")
        assert report.checksum_errors == 0
    finally:
        b.close()


def test_the_devices_caches_hold_every_size_class(monkeypatch):
    made = []
    real = devices.MultiDeviceCache

    def spy(*args, **kwargs):
        multi = real(*args, **kwargs)
        made.extend(c.max_classes for c in multi.caches)
        return multi

    monkeypatch.setattr(devices, "MultiDeviceCache", spy)
    specs = [LayerSpec(16, 256 * (i + 1), 256, 256) for i in range(5)]
    layout = ModelLayout(tuple(specs), name="five")
    b = bench.Bench(layout, backend="host", budget_bytes=layout.total_bytes // 4)
    try:
        devices.run_devices(b, 2, traces=[synthetic_trace(10, 5, 16, 2, first_layer=0, name="t")])
    finally:
        b.close()
    assert made and set(made) == {5}


# -- a budget of 0 bytes -----------------------------------------------------------------------


def holds_an_expert(layout: ModelLayout, budget_bytes: int) -> bool:
    """Whether a cache of ``layout`` at ``budget_bytes`` gives every class a slot (the library's caps)."""
    return min(full_cap(layout, budget_bytes)) >= 1


def test_a_fraction_that_rounds_to_0_names_it_and_the_smallest_that_holds_an_expert():
    layout = small_model()
    with pytest.raises(ValueError) as raised:
        resolve_budget(layout, budget_fraction=1e-12)
    message = str(raised.value)
    assert message.startswith(
        "budget_fraction=1e-12 is a budget of 0 bytes; the smallest budget_fraction that holds one expert is "
    )
    least = float(message.rpartition(" ")[2])
    assert holds_an_expert(layout, resolve_budget(layout, budget_fraction=least))
    assert not holds_an_expert(layout, resolve_budget(layout, budget_fraction=least * 0.98))
    assert "set budget_experts or budget_bytes" not in message
    with pytest.raises(
        ValueError,
        match=r"^budget_bytes=0 is a budget of 0 bytes; the smallest budget_bytes that "
        r"holds one expert is 36864$",
    ):
        resolve_budget(layout, 0)


def test_the_command_line_names_the_option_in_its_units():
    layout = ModelLayout.preset("mixed", scale=256)
    parser = cli._mode_parser(bench.modes.by_name("variants"))
    with pytest.raises(
        options.UsageError,
        match=r"^--budget-gib 1e-09 is a budget of 0 bytes at the host run's "
        r"sizes / 256; the smallest --budget-gib that holds one expert of "
        r"each of its 2 size classes is [0-9.e-]+$",
    ) as raised:
        options.budget_bytes(parser.parse_args(["--budget-gib", "1e-9"]), layout, 256)

    least = float(str(raised.value).rpartition(" ")[2])
    assert min(class_targets(ModelLayout.preset("mixed"), int(least * (1 << 30)))) == 1
    with pytest.raises(
        options.UsageError,
        match=r"^--budget-fraction 1e-12 is a budget of 0 bytes at the host "
        r"run's sizes / 256; the smallest --budget-fraction that holds",
    ):
        options.budget_bytes(parser.parse_args(["--budget-fraction", "1e-12"]), layout, 256)


@pytest.mark.parametrize(
    "argv,option",
    [(["--budget-fraction", "1e-12"], "--budget-fraction 1e-12"), (["--budget-gib", "1e-9"], "--budget-gib 1e-09")],
)
def test_the_cli_prints_a_zero_budget_as_one_line(capsys, argv, option):
    assert cli.main(["bench", "--backend", "host", "--traces", "smoke_count64", "--quiet"] + argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith(f"expcache bench: {option} is a budget of 0 bytes") and "budget_experts" not in err


def test_offload_names_budget_fraction():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers", minversion="5")
    from pyexpcache.hf import offload

    config = transformers.Qwen3MoeConfig(
        vocab_size=96,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        intermediate_size=64,
        moe_intermediate_size=24,
        num_experts=8,
        num_experts_per_tok=2,
        head_dim=8,
    )
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(config).eval()
    with pytest.raises(
        ValueError,
        match=r"^budget_fraction=1e-09 is a budget of 0 bytes; the smallest "
        r"budget_fraction that holds one expert is ",
    ):
        offload(model, budget_fraction=1e-9, progress=False)
