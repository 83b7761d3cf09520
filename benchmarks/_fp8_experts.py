"""A float transformers MoE model's experts made transformers' FP8Experts, and transformers' FP8
kernel loaded from a local copy: what the FP8 benchmarks and tests run.

transformers quantizes to FP8 only while loading a checkpoint on a GPU, and computes FP8 experts
with a Triton kernel it downloads from the Hugging Face hub (``kernels-community/finegrained-fp8``).
:func:`quantize_experts` does the first in place on a model already built (transformers' own
``Fp8Quantize`` on each experts module's weights); :func:`install_kernel` puts the kernel's
package, from a directory holding it (a machine without the hub), where transformers looks first.
"""

from __future__ import annotations

import torch
import transformers
from _local_package import import_from
from transformers.integrations import finegrained_fp8 as fp8
from transformers.integrations.moe import use_experts_implementation

from pyexpcache.hf import find_experts


class _Quantizer:  # what transformers' Fp8Quantize reads of its quantizer
    def __init__(self, config):
        self.quantization_config = config


def quantize_experts(model, block=(128, 128), scale_fmt="float", activation_scheme="dynamic", seed=0):
    """Every experts module of ``model`` replaced by an ``FP8Experts`` (through transformers' FP8
    experts interface, as its FP8 loading builds them) holding the module's weights quantized by
    transformers' ``Fp8Quantize`` (``block``: the scales' block, None for one scale a matrix);
    static activation scales drawn from [0.5, 1.5). Returns ``model``."""
    qconfig = transformers.FineGrainedFP8Config(
        weight_block_size=list(block) if block else None, scale_fmt=scale_fmt, activation_scheme=activation_scheme
    )
    quantize = fp8.Fp8Quantize(_Quantizer(qconfig))
    generator = torch.Generator().manual_seed(seed)
    for e in find_experts(model):
        parent, _, child = e.name.rpartition(".")
        cls = use_experts_implementation(
            experts_class=fp8.FP8Experts, experts_interface=fp8.ALL_FP8_EXPERTS_FUNCTIONS, has_gate=e.module.has_gate
        )
        with torch.device(e.first.device):
            q = cls(
                e.module.config,
                block_size=qconfig.weight_block_size,
                activation_scheme=activation_scheme,
                scale_fmt=scale_fmt,
            )
        first = "gate_up_proj" if e.module.has_gate else "up_proj"
        with torch.no_grad():
            for name in (first, "down_proj"):
                out = quantize._quantize_one(name, getattr(e.module, name).data)
                if name + "_scale_inv" not in out:
                    raise ValueError(f"{e.name}.{name} {list(out[name].shape)} is not whole blocks of {block}")
                getattr(q, name).copy_(out[name])
                getattr(q, name + "_scale_inv").copy_(out[name + "_scale_inv"])
            if activation_scheme == "static":
                for name in (first, "down_proj"):
                    scales = torch.rand(q.num_experts, generator=generator) + 0.5
                    getattr(q, name + "_activation_scale").copy_(scales)
        q.requires_grad_(False)
        setattr(model.get_submodule(parent), child, q.eval())
    return model


def install_kernel(where: str):
    """transformers' FP8 kernel taken from the ``finegrained_fp8`` package in directory ``where``
    (the hub repository's ``torch-ext`` folder with its ``_ops`` module); returns what it replaced,
    for :func:`restore_kernel`. ImportError if the package is not there."""
    kernel = import_from(where, "finegrained_fp8")
    before = fp8._FINEGRAINED_FP8
    fp8._FINEGRAINED_FP8 = fp8.FineGrainedFP8(kernel.matmul_2d, kernel.matmul_batched, kernel.matmul_grouped)
    return before


def restore_kernel(before) -> None:
    fp8._FINEGRAINED_FP8 = before
