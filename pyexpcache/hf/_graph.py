"""GraphDecoder: greedy decoding with every decode step one CUDA graph replay."""

from __future__ import annotations

import contextlib
import inspect
from typing import Optional

import torch

#: The layer types whose decode-step mask GraphDecoder makes itself: causal over the static cache
#: (a sliding or chunked window no shorter than max_len masks nothing more).
_MASKED_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention")
#: The attention implementations whose masks it makes: sdpa's booleans and eager's 0 / finfo.min.
_MASKED_IMPLEMENTATIONS = ("sdpa", "eager")


def _capture_problem(model, kv, max_len: int) -> Optional[str]:
    """Why ``model``'s decode step over the static cache ``kv`` cannot be captured in a CUDA graph,
    or None."""
    for i, layer in enumerate(kv.layers):
        window = getattr(layer, "max_cache_len", max_len)
        if getattr(layer, "is_sliding", False) and window < max_len:
            return (
                f"layer {i}'s static KV cache keeps the last {window} positions (a sliding or chunked window), and "
                "transformers chooses on the host how it stores each new one (a Python count), which the replays "
                f"of a captured step cannot follow past {window} positions: use max_len <= {window}, or "
                "capture=False to decode eagerly"
            )
    if model.config._attn_implementation == "eager" and not _makes_step_mask(model, kv, max_len):
        return (
            "its eager attention masks are made by transformers with a host scalar that torch copies to the GPU "
            "(torch.where with a Python number), which a capture refuses, and GraphDecoder makes them itself only "
            f'for {", ".join(_MASKED_LAYER_TYPES)} layers: load the model with attn_implementation="sdpa", or '
            "use capture=False"
        )
    return None


def _makes_step_mask(model, kv, max_len: int) -> bool:
    """Whether the decoder makes the step's attention mask itself (see GraphDecoder)."""
    types = getattr(model.config, "layer_types", None) or ["full_attention"]
    return (
        model.config._attn_implementation in _MASKED_IMPLEMENTATIONS
        and set(types) <= set(_MASKED_LAYER_TYPES)
        and all(getattr(layer, "max_cache_len", max_len) >= max_len for layer in kv.layers)
    )


class GraphDecoder:
    """Greedy decoding of a transformers causal LM with a static KV cache, each decode step one
    CUDA graph replay: the forward of one token per row (every layer; the experts served from
    expcache's banks when the model is offloaded) and the argmax that feeds the next step are
    captured once, by the first :meth:`generate`, and replayed from then on. Works for a model offloaded by
    :func:`~pyexpcache.hf.offload` or not (the benchmark compares the two this way). On the CPU
    the same step runs eagerly, as it does everywhere with ``capture=False``.

    >>> decoder = GraphDecoder(model, max_len=512)
    >>> tokens = decoder.generate(input_ids, max_new_tokens=64)   # [B, P + 64]

    The capture is made once per decoder, by the first ``generate``; later calls (with the same
    batch size) replay it. The capture costs one more step and one more forward of the prompt
    (see :meth:`generate`), whose expert selects count in the cache's stats.

    Decode steps run the experts implementation ``generate`` decodes with: inside the model's
    ``_optimize_model_for_decode`` (transformers switches ``grouped_mm`` to ``batched_mm`` there,
    on a GPU), where the model has it. For an offloaded model this also keeps the step's cost
    apart from the bank's size: a grouped kernel's grid grows with the experts it is given (the
    bank's slots), a batched one's with the rows only.

    The step's attention mask is made by the decoder, on the device from the step's position
    (for sdpa and eager attention over full, sliding and chunked attention layers: causal over
    the static cache, the values transformers makes), so a replay masks by its own position.
    transformers' own masks would be fixed at the capture where they read a host count (a
    sliding layer's), and its eager masks copy a host scalar to the GPU, which a capture refuses.

    Raises:
        ValueError: on CUDA with ``capture``, a step that cannot be captured, with the reason: a
            sliding or chunked window shorter than ``max_len`` (transformers stores each new
            position of such a layer by a host count), or eager attention over layers whose mask
            the decoder does not make. ``capture=False`` decodes such a model eagerly.
    """

    def __init__(self, model, max_len: int, *, batch: int = 1, capture: bool = True):
        from transformers import StaticCache

        if type(max_len) is not int or max_len < 2:
            raise ValueError(f"max_len must be an int >= 2 (prompt and new tokens), got {max_len!r}")
        if type(batch) is not int or batch < 1:
            raise ValueError(f"batch must be an int >= 1, got {batch!r}")
        self.model, self.max_len, self.batch, self.capture = model, max_len, batch, bool(capture)
        self.device = next(model.parameters()).device
        self.kv = StaticCache(config=model.config, max_cache_len=max_len)
        # transformers 5.24 renamed the forward's past_key_values to cache (the old name warns)
        parameters = inspect.signature(model.forward).parameters
        self._kv_name = "cache" if "cache" in parameters else "past_key_values"
        self._takes_cache_position = "cache_position" in parameters
        # The prompt's forward asks for its last position's logits only, as generate() does: the
        # whole prompt's would be [B, P, vocab] (9 GiB for 4 x 8192 tokens of a 152k vocabulary).
        self._keeps_logits = "logits_to_keep" in parameters
        self.token = torch.zeros(batch, 1, dtype=torch.long, device=self.device)
        self.position = torch.zeros(1, dtype=torch.long, device=self.device)
        self.graph: Optional[torch.cuda.CUDAGraph] = None
        self._logits: Optional[torch.Tensor] = None
        if self.capture and self.device.type == "cuda":
            problem = _capture_problem(model, self.kv, max_len)
            if problem is not None:
                raise ValueError(f"GraphDecoder cannot capture {type(model).__name__}'s decode step: {problem}")
        # The step's mask (see the class): the cache's positions, and eager's two values, on the device.
        self._mask_positions = None
        if _makes_step_mask(model, self.kv, max_len):
            self._mask_positions = torch.arange(max_len, device=self.device)
            if model.config._attn_implementation == "eager":
                dtype = model.get_input_embeddings().weight.dtype
                self._mask_values = (
                    torch.zeros((), dtype=dtype, device=self.device),
                    torch.full((), torch.finfo(dtype).min, dtype=dtype, device=self.device),
                )
            else:
                self._mask_values = None

    @property
    def captured(self) -> bool:
        return self.graph is not None

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attention_mask=None, last_only=False):
        """The model's forward at ``positions`` [L], writing the KV cache. The cache tracks its own
        length on the device (it decides where keys are written); the positions given agree with it."""
        kwargs = {self._kv_name: self.kv, "position_ids": positions.view(1, -1).expand(input_ids.shape[0], -1)}
        if self._takes_cache_position:  # transformers before the cache tracked its length
            kwargs["cache_position"] = positions
        if attention_mask is not None:
            kwargs["attention_mask"] = attention_mask
        if last_only and self._keeps_logits:
            kwargs["logits_to_keep"] = 1
        return self.model(input_ids=input_ids, use_cache=True, **kwargs)

    def _step_mask(self) -> Optional[torch.Tensor]:
        """The step's attention mask [B, 1, 1, max_len] (see the class), made on the device from
        ``position``: the cache's positions up to it attend. None where the model makes its own."""
        if self._mask_positions is None:
            return None
        mask = self._mask_positions <= self.position
        if self._mask_values is not None:  # eager: 0 where a position attends, the dtype's minimum elsewhere
            mask = torch.where(mask, *self._mask_values)
        return mask.view(1, 1, 1, -1).expand(self.batch, 1, 1, -1)

    def _step(self) -> torch.Tensor:
        logits = self._forward(self.token, self.position, self._step_mask()).logits[:, -1, :]
        self.token.copy_(logits.argmax(-1, keepdim=True))
        self.position.add_(1)
        return logits

    def _prefill(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The prompt's forward from an empty cache; ``token`` becomes its argmax, ``position`` its length."""
        self.kv.reset()
        prompt = input_ids.shape[1]
        logits = self._forward(input_ids, torch.arange(prompt, device=self.device), last_only=True).logits[:, -1, :]
        self.token.copy_(logits.argmax(-1, keepdim=True))
        self.position.fill_(prompt)
        return logits

    def _decoding(self):
        """The context ``generate`` decodes in (see the class): the model's
        ``_optimize_model_for_decode``, or none where the model has no such method."""
        phase = getattr(self.model, "_optimize_model_for_decode", None)
        return phase() if phase is not None else contextlib.nullcontext()

    def _capture(self) -> None:
        """Captures the step. It runs once first on a side stream (cuBLAS and the allocator warm
        up, as ``torch.cuda.graph`` asks), which advances the KV cache: the caller starts again."""
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with self._decoding():
            with torch.cuda.stream(side):
                self._step()
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self._logits = self._step()
        self.graph = graph

    def _next(self) -> torch.Tensor:
        """One decode step: the logits [B, vocab] of ``token`` at ``position`` (on CUDA a buffer the
        next step overwrites); ``token`` becomes their argmax and the position advances."""
        if self.graph is None:
            with self._decoding():
                return self._step()
        self.graph.replay()
        return self._logits

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int, *, output_logits: bool = False):
        """Greedy: the prompt ``input_ids`` [B, P] (a forward of its own, eager), then
        ``max_new_tokens`` tokens, the first from the prompt's logits and each other from one step.
        Returns the tokens [B, P + max_new_tokens], and with ``output_logits`` also the logits of
        each new token, [max_new_tokens, B, vocab]. The first call on CUDA captures the step
        after the prompt's forward, and runs that forward again (the capture's warm-up step moved
        the KV cache on)."""
        if input_ids.dim() != 2 or input_ids.shape[0] != self.batch:
            raise ValueError(f"input_ids must be [{self.batch}, P] (the decoder's batch), got {tuple(input_ids.shape)}")
        prompt = input_ids.shape[1]
        if type(max_new_tokens) is not int or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
        if prompt + max_new_tokens > self.max_len:
            raise ValueError(f"{prompt} prompt + {max_new_tokens} new tokens exceed max_len {self.max_len}")
        input_ids = input_ids.to(self.device)
        logits = self._prefill(input_ids)
        if max_new_tokens > 1 and self.graph is None and self.capture and self.device.type == "cuda":
            self._capture()
            logits = self._prefill(input_ids)
        tokens, kept = [self.token.clone()], [logits.clone()] if output_logits else None
        for _ in range(max_new_tokens - 1):
            logits = self._next()
            tokens.append(self.token.clone())
            if output_logits:
                kept.append(logits.clone())
        sequences = torch.cat([input_ids, *tokens], dim=1)
        return (sequences, torch.stack(kept)) if output_logits else sequences
