"""Hugging Face config.json files of MoE models, for the layout tests: the keys a layout reads
and a few beside them, with the numbers of the published files (the rest of each file left out).
Each entry names its source. ``write(tmp_path, name)`` writes one as ``<name>/config.json``."""

from __future__ import annotations

import json
from pathlib import Path

CONFIGS = {
    # https://huggingface.co/mistralai/Mixtral-8x7B-v0.1/blob/main/config.json
    "Mixtral-8x7B-v0.1": {
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "vocab_size": 32000,
        "torch_dtype": "bfloat16",
    },
    # https://huggingface.co/Qwen/Qwen1.5-MoE-A2.7B/blob/main/config.json (Qwen2-MoE)
    "Qwen1.5-MoE-A2.7B": {
        "architectures": ["Qwen2MoeForCausalLM"],
        "model_type": "qwen2_moe",
        "hidden_size": 2048,
        "intermediate_size": 5632,
        "moe_intermediate_size": 1408,
        "shared_expert_intermediate_size": 5632,
        "num_hidden_layers": 24,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "num_experts": 60,
        "num_experts_per_tok": 4,
        "decoder_sparse_step": 1,
        "norm_topk_prob": False,
        "vocab_size": 151936,
        "torch_dtype": "bfloat16",
    },
    # https://huggingface.co/Qwen/Qwen3-30B-A3B/blob/main/config.json
    "Qwen3-30B-A3B": {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": True,
        "vocab_size": 151936,
        "torch_dtype": "bfloat16",
    },
    # https://huggingface.co/allenai/OLMoE-1B-7B-0924/blob/main/config.json
    "OLMoE-1B-7B-0924": {
        "architectures": ["OlmoeForCausalLM"],
        "model_type": "olmoe",
        "hidden_size": 2048,
        "intermediate_size": 1024,
        "num_hidden_layers": 16,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "num_experts": 64,
        "num_experts_per_tok": 8,
        "norm_topk_prob": False,
        "vocab_size": 50304,
        "torch_dtype": "float32",
    },
    # https://huggingface.co/deepseek-ai/DeepSeek-V3/blob/main/config.json (its weights are fp8:
    # quantization_config)
    "DeepSeek-V3": {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "hidden_size": 7168,
        "intermediate_size": 18432,
        "moe_intermediate_size": 2048,
        "num_hidden_layers": 61,
        "num_attention_heads": 128,
        "n_routed_experts": 256,
        "n_shared_experts": 1,
        "num_experts_per_tok": 8,
        "first_k_dense_replace": 3,
        "moe_layer_freq": 1,
        "vocab_size": 129280,
        "torch_dtype": "bfloat16",
        "quantization_config": {
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "quant_method": "fp8",
            "weight_block_size": [128, 128],
        },
    },
    # https://huggingface.co/openai/gpt-oss-20b/blob/main/config.json
    "gpt-oss-20b": {
        "architectures": ["GptOssForCausalLM"],
        "model_type": "gpt_oss",
        "hidden_size": 2880,
        "intermediate_size": 2880,
        "num_hidden_layers": 24,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "num_local_experts": 32,
        "num_experts_per_tok": 4,
        "vocab_size": 201088,
        "torch_dtype": "bfloat16",
        "quantization_config": {
            "modules_to_not_convert": [
                "model.layers.*.self_attn",
                "model.layers.*.mlp.router",
                "model.embed_tokens",
                "lm_head",
            ],
            "quant_method": "mxfp4",
        },
    },
}


def write(folder: Path, name: str, config: dict | None = None) -> Path:
    """``CONFIGS[name]`` (or ``config``) written as ``folder/name/config.json``; its path."""
    path = Path(folder) / name / "config.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(CONFIGS[name] if config is None else config, indent=2))
    return path
