"""The layouts of well-known MoE models, by name (:meth:`~pyexpcache.ModelLayout.preset`).

The DeepSeek V4 Flash presets use the sizes from the GGUF block formats
(IQ2_XXS: 66 B per 256 weights, Q2_K: 84 B, Q4_K: 144 B) and the model's
shape (43 layers, 256 routed experts, 4096 x 2048 gate/up and 2048 x 4096
down matrices, 8,388,608 weights each):

=========  =============  ===========  ==========
preset     gate / up      down         expert
=========  =============  ===========  ==========
q2         2.0625 MiB     2.625 MiB    6.75 MiB
q4 (Q4_K)  4.5 MiB        4.5 MiB      13.5 MiB
mixed      q4 in layers 37-42, q2 elsewhere
=========  =============  ===========  ==========

The others are read from their models' Hugging Face configs (:data:`MODEL_CONFIGS`).
"""

from __future__ import annotations

from .layer_spec import LayerSpec
from .quant import matrix_bytes

WEIGHTS_PER_MATRIX = 4096 * 2048
NUM_LAYERS = 43
NUM_EXPERTS = 256
TOP_K = 6
FIRST_ROUTED_LAYER = 3  # layers 0-2 route by token-id hash and are absent from decode traces
MIXED_Q4_LAYERS = range(37, 43)


def _matrix_bytes(block: str) -> int:
    """A DeepSeek V4 Flash expert matrix (every row length a multiple of 256) in ``block``."""
    return matrix_bytes(block, WEIGHTS_PER_MATRIX // 4096, 4096)


def deepseek_v4_flash_layers(quant: str) -> list[LayerSpec]:
    """DeepSeek V4 Flash's routed experts, layer by layer: ``quant`` is "q2", "q4" or "mixed"."""
    q2 = LayerSpec(NUM_EXPERTS, _matrix_bytes("IQ2_XXS"), _matrix_bytes("IQ2_XXS"), _matrix_bytes("Q2_K"))
    q4 = LayerSpec(NUM_EXPERTS, _matrix_bytes("Q4_K"), _matrix_bytes("Q4_K"), _matrix_bytes("Q4_K"))
    if quant == "q2":
        specs = [q2] * NUM_LAYERS
    elif quant == "q4":
        specs = [q4] * NUM_LAYERS
    elif quant == "mixed":
        specs = [q4 if i in MIXED_Q4_LAYERS else q2 for i in range(NUM_LAYERS)]
    else:
        raise ValueError(f"unknown quant {quant!r}: expected 'q2', 'q4' or 'mixed'")
    return specs


# The config.json numbers of well-known MoE models that from_hf_config reads (the files' other
# keys left out), each with its source. The presets give the type explicitly.
MODEL_CONFIGS = {
    "mixtral-8x7b": (
        dict(
            model_type="mixtral", num_hidden_layers=32, num_local_experts=8, hidden_size=4096, intermediate_size=14336
        ),
        "https://huggingface.co/mistralai/Mixtral-8x7B-v0.1/blob/main/config.json",
    ),
    "qwen3-30b-a3b": (
        dict(
            model_type="qwen3_moe",
            num_hidden_layers=48,
            num_experts=128,
            hidden_size=2048,
            moe_intermediate_size=768,
            decoder_sparse_step=1,
            mlp_only_layers=[],
        ),
        "https://huggingface.co/Qwen/Qwen3-30B-A3B/blob/main/config.json",
    ),
    "olmoe-1b-7b": (
        dict(model_type="olmoe", num_hidden_layers=16, num_experts=64, hidden_size=2048, intermediate_size=1024),
        "https://huggingface.co/allenai/OLMoE-1B-7B-0924/blob/main/config.json",
    ),
    "deepseek-v3": (
        dict(
            model_type="deepseek_v3",
            num_hidden_layers=61,
            n_routed_experts=256,
            hidden_size=7168,
            moe_intermediate_size=2048,
            first_k_dense_replace=3,
            moe_layer_freq=1,
        ),
        "https://huggingface.co/deepseek-ai/DeepSeek-V3/blob/main/config.json",
    ),
    "gpt-oss-20b": (
        dict(
            model_type="gpt_oss", num_hidden_layers=24, num_local_experts=32, hidden_size=2880, intermediate_size=2880
        ),
        "https://huggingface.co/openai/gpt-oss-20b/blob/main/config.json",
    ),
}
# Preset name -> (model, type of every expert matrix).
PRESET_MODELS = {
    "mixtral-8x7b-q4k": ("mixtral-8x7b", "Q4_K"),
    "qwen3-30b-a3b-bf16": ("qwen3-30b-a3b", "BF16"),
    "olmoe-1b-7b-bf16": ("olmoe-1b-7b", "BF16"),
    "deepseek-v3-q4k": ("deepseek-v3", "Q4_K"),
    "gpt-oss-20b-mxfp4": ("gpt-oss-20b", "MXFP4"),
}
#: Every name :meth:`ModelLayout.preset` takes.
PRESETS = (
    "q2",
    "q4",
    "mixed",
    "deepseek-v4-flash-q2",
    "deepseek-v4-flash-q4",
    "deepseek-v4-flash-mixed",
    *PRESET_MODELS,
)
#: Where each preset's numbers come from.
PRESET_SOURCES = {
    **{
        n: "the antirez/ds4 engine's issue #503 and PR #504 (DeepSeek V4 Flash: 43 layers x 256 experts, "
        "[2048, 4096] gate/up, [4096, 2048] down)"
        for n in PRESETS[:6]
    },
    **{n: MODEL_CONFIGS[model][1] for n, (model, _) in PRESET_MODELS.items()},
}
