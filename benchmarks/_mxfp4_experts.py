"""A GPT-OSS model's experts made transformers' MXFP4 experts, and triton_kernels loaded from a
local copy: what the MXFP4 benchmarks and tests run.

transformers quantizes to MXFP4 only while loading a checkpoint on a GPU, and computes MXFP4
experts with triton_kernels, which it downloads from the Hugging Face hub
(``kernels-community/gpt-oss-triton-kernels``). :func:`install_kernel` puts that package, from a
directory holding it (a machine without the hub), where transformers' loader finds it;
:func:`quantize_experts` then does what loading does, in place on a model already built on a
GPU: transformers' own ``replace_with_mxfp4_linear``, and each experts module's weights
quantized and swizzled by transformers' ``quantize_to_mxfp4`` and ``swizzle_mxfp4``.
"""

from __future__ import annotations

import torch
import transformers
from _local_package import import_from
from transformers.integrations import hub_kernels, mxfp4

#: The hub repository transformers loads triton_kernels from.
REPOSITORY = "kernels-community/gpt-oss-triton-kernels"


def install_kernel(where: str):
    """triton_kernels taken from the ``gpt_oss_triton_kernels`` package in directory ``where``
    (the hub repository's ``torch-ext`` folder): transformers' ``get_kernel`` returns it for
    :data:`REPOSITORY`. Returns the package. ImportError if it is not there."""
    hub = import_from(where, "gpt_oss_triton_kernels")
    get_kernel = hub_kernels.get_kernel
    if not getattr(get_kernel, "_expcache_local", False):

        def local_get_kernel(repo_id, *args, **kwargs):
            return hub if repo_id == REPOSITORY else get_kernel(repo_id, *args, **kwargs)

        local_get_kernel._expcache_local = True
        hub_kernels.get_kernel = local_get_kernel
    mxfp4.triton_kernels_hub = hub
    return hub


def quantize_experts(model: torch.nn.Module) -> torch.nn.Module:
    """Every ``GptOssExperts`` of ``model`` (on a GPU) replaced as transformers' MXFP4 loading
    replaces it, the new ``Mxfp4GptOssExperts`` holding the module's weights quantized to MXFP4
    and swizzled for the GPU, and its biases. Needs :func:`install_kernel` first. Returns ``model``."""
    hub = mxfp4.triton_kernels_hub
    old = {name: m for name, m in model.named_modules() if type(m).__name__ == "GptOssExperts"}
    mxfp4.replace_with_mxfp4_linear(model, quantization_config=transformers.Mxfp4Config())
    for name, before in old.items():
        after = model.get_submodule(name)
        if type(after).__name__ != mxfp4.Mxfp4GptOssExperts.__name__:
            raise RuntimeError(f"{name}: transformers did not replace it with {mxfp4.Mxfp4GptOssExperts.__name__}")
        device = before.gate_up_proj.device
        with torch.no_grad(), torch.device(device):
            for proj in ("gate_up_proj", "down_proj"):
                # GptOssExperts holds [E, in, out], what the loader's transpose of a checkpoint's [E, out, in] gives
                blocks, scales = mxfp4.quantize_to_mxfp4(getattr(before, proj).data, hub)
                weight, scale = mxfp4.swizzle_mxfp4(blocks, scales, hub)
                after._parameters.pop(proj, None)
                setattr(after, proj, weight)
                setattr(
                    after,
                    f"{proj}_precision_config",
                    hub.matmul_ogs.PrecisionConfig(
                        weight_scale=scale, flex_ctx=hub.matmul_ogs.FlexCtx(rhs_data=hub.matmul_ogs.InFlexData())
                    ),
                )
                bias = getattr(before, f"{proj}_bias").data.to(device=device, dtype=torch.float32)
                setattr(after, f"{proj}_bias", torch.nn.Parameter(bias.clone(), requires_grad=False))
    return model
