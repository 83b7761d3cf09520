"""The experts implementation that serves a layer's experts from the cache's slot bank.

Registered with transformers' ``ExpertsInterface`` under :data:`IMPLEMENTATION`. For the ids the
router chose (``top_k_index`` [T, k]), ``cache.select_device`` makes the experts resident and
gives their slots, with no host synchronization (a CUDA graph can hold it). The layer is then
computed by the implementation the model had before (transformers' ``grouped_mm`` by default,
or ``batched_mm``, or the module's own ``eager`` loop), called with the slots for ids and with
the module seen through :class:`BankExperts`: its weights are the bank's ``[cap, ...]`` views,
which hold, at each slot, the bytes of the expert the slot was given. The same kernels run on the
same bytes, so the result is bit-identical to the unmodified model's. On the CPU, ``grouped_mm``
is called with the expert ids, its grouped products taking each expert from its slot
(:func:`by_expert_id`): a CPU GEMM rounds a row by its place, which sorting by slot would move.
"""

from __future__ import annotations

import inspect
import itertools
import types
from typing import Callable

import torch

#: The name the implementation is registered under (``config.experts_implementation``).
IMPLEMENTATION = "expcache"


#: torch._grouped_mm multiplies fewer than 1024 groups (here: slots) per call.
GROUPED_MM_GROUPS = 1023


def over_windows(inner: Callable, cap: int) -> Callable:
    """``inner``; or, when it is transformers' ``grouped_mm`` and the bank has more slots than one
    grouped product takes, the same function (its code object, unchanged) with its grouped
    products done over windows of at most :data:`GROUPED_MM_GROUPS` slots. The (token, expert)
    rows are sorted by slot, so each window's rows follow the previous window's: each window's
    product is kept for its rows (from the end of the previous window's groups on), computed
    by the same kernel on the same weights as one product would compute it."""
    from transformers.integrations import moe

    if inner is not moe.grouped_mm_experts_forward or cap <= GROUPED_MM_GROUPS:
        return inner
    if "_grouped_linear" not in inner.__code__.co_names:
        raise ValueError(
            f"this transformers' grouped_mm has no _grouped_linear to serve a bank of {cap} slots "
            f"(over {GROUPED_MM_GROUPS}) with: use batched_mm (model.set_experts_implementation) "
            "or a smaller budget"
        )
    one_product = moe._grouped_linear

    def grouped_linear(input, weight, offs, bias=None, is_transposed=False):
        out = None
        rows = torch.arange(input.shape[0], device=input.device)
        for first in range(0, weight.shape[0], GROUPED_MM_GROUPS):
            window = slice(first, first + GROUPED_MM_GROUPS)
            part = one_product(input, weight[window], offs[window], is_transposed=is_transposed)
            if out is None:
                out = part
            else:  # rows before this window's first group belong to earlier windows
                out = torch.where((rows >= offs[first - 1]).unsqueeze(-1), part, out)
        if bias is not None:
            out.add_(bias)
        return out

    return types.FunctionType(
        inner.__code__,
        {**inner.__globals__, "_grouped_linear": grouped_linear},
        inner.__name__,
        inner.__defaults__,
        inner.__closure__,
    )


def by_expert_id(inner: Callable, server: LayerServer) -> Callable | None:
    """On the CPU: transformers' ``grouped_mm`` (its code object, unchanged), called with the
    router's expert ids, with its grouped products made from the bank: group e (expert e's rows,
    where transformers' own sort by expert id puts them) is multiplied by the slot
    ``server.expert_slots[e]``. torch's CPU grouped product is one GEMM per group, and a GEMM
    rounds a row by its place (its alignment): with the rows where the unmodified model has them,
    each is rounded as there (sorted by slot, they moved). None for another implementation."""
    from transformers.integrations import moe

    if inner is not moe.grouped_mm_experts_forward or "_grouped_linear" not in inner.__code__.co_names:
        return None

    def grouped_linear(input, weight, offs, bias=None, is_transposed=False):
        weight = weight if is_transposed else weight.transpose(-2, -1)  # the bank, [cap, in, out]
        input = input.to(weight.dtype)
        out = input.new_zeros(input.shape[0], weight.shape[-1])
        slots, start = server.expert_slots, 0
        for expert, end in enumerate(offs.tolist()):
            if end > start:  # what torch's CPU grouped_mm computes for the group, from the expert's slot
                out[start:end] = torch.mm(input[start:end], weight[slots[expert]])
            start = end
        if bias is not None:
            out.add_(bias)
        return out

    return types.FunctionType(
        inner.__code__,
        {**inner.__globals__, "_grouped_linear": grouped_linear},
        inner.__name__,
        inner.__defaults__,
        inner.__closure__,
    )


def experts_interface(module: torch.nn.Module):
    """The experts interface ``module``'s forward dispatches through: the one
    ``use_experts_implementation`` wrapped its class with (``FP8Experts``: transformers' FP8
    interface), else transformers' ``ALL_EXPERTS_FUNCTIONS``."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    forward = type(module).forward
    cells = dict(zip(forward.__code__.co_freevars, forward.__closure__ or ()))
    interface = cells["experts_interface"].cell_contents if "experts_interface" in cells else None
    return interface if interface is not None else ALL_EXPERTS_FUNCTIONS


def inner_implementation(module: torch.nn.Module) -> tuple[str, Callable]:
    """The implementation ``module`` runs now (by its config), as (name, function of (module,
    hidden_states, top_k_index, top_k_weights)): a registered one, or the module's own forward
    for ``"eager"`` (unwrapped: transformers wraps a quantized class's forward once per layer it
    builds)."""
    name = module.config._experts_implementation
    if name == IMPLEMENTATION:
        raise ValueError(f"{type(module).__name__} is already served by expcache: close its handle first")
    if name in (None, "eager"):
        return "eager", inspect.unwrap(type(module).forward)  # the forward use_experts_implementation wrapped
    return name, experts_interface(module)[name]


#: The caches the select op serves, by the key it is given (its arguments are tensors and ints).
_CACHES: dict[int, object] = {}
_KEYS = itertools.count()


def serve_cache(cache) -> int:
    """Makes ``cache`` reachable by :func:`select_device`; returns its key (:func:`forget_cache` drops it)."""
    key = next(_KEYS)
    _CACHES[key] = cache
    return key


def forget_cache(key: int) -> None:
    _CACHES.pop(key, None)


@torch.library.custom_op("expcache::select_device", mutates_args=())
def select_device(ids: torch.Tensor, cache: int, layer: int) -> torch.Tensor:
    """``ExpertCache.select_device`` as a torch operator, so that torch.compile keeps it in its
    graph (no graph break) and a CUDA graph captures its kernels with the rest of the step. Its
    effect on the bank is ordered by the data: the slots it returns are what reads the bank."""
    return _CACHES[cache].select_device(layer, ids)


@select_device.register_fake
def _(ids: torch.Tensor, cache: int, layer: int) -> torch.Tensor:
    return torch.empty_like(ids, dtype=torch.int32)


class SlotIndexed:
    """A module's per-expert rows (a bias, read from the module each time: a bias edited or
    replaced is served as it is) seen by slot: ``rows_by_slot[slots]`` is ``rows[experts]``, for
    the experts the slots were last given (``slot_expert``, written by each select)."""

    def __init__(self, module: torch.nn.Module, name: str, slot_expert: torch.Tensor):
        self.module, self.name, self.slot_expert = module, name, slot_expert

    def __getitem__(self, slots):
        return getattr(self.module, self.name)[self.slot_expert[slots]]


class BankExperts:
    """An experts module as an experts implementation sees it, served from a bank: every attribute
    is the module's, except its served weights (``gate_up_proj`` or ``up_proj`` and ``down_proj``;
    a quantized module's every per-expert tensor), the bank's ``[cap, ...]`` views with the
    parameters' shapes, ``num_experts`` (``cap``: ids are slots) and the biases, indexed by slot."""

    def __init__(
        self,
        module: torch.nn.Module,
        weights: dict[str, torch.Tensor],
        cap: int,
        slot_expert: torch.Tensor | None,
    ):
        self._module = module
        for name, view in weights.items():
            setattr(self, name, view)
        self.num_experts = cap
        if slot_expert is not None:
            first_name = "gate_up_proj" if module.has_gate else "up_proj"
            setattr(self, first_name + "_bias", SlotIndexed(module, first_name + "_bias", slot_expert))
            self.down_proj_bias = SlotIndexed(module, "down_proj_bias", slot_expert)

    def __getattr__(self, name):  # everything not replaced is the module's
        return getattr(self._module, name)


def bank_weights(e, bank) -> dict[str, torch.Tensor]:
    """The bank's views of ``e``'s served weights, by parameter name: each ``[rows, ...]`` in the
    parameter's dtype and per-expert shape (the first weight the slot's gate and up parts as one).
    A part is taken as bytes and viewed as its dtype in torch, whatever dtypes DLPack carries."""
    if not e.quantized:
        first_name = "gate_up_proj" if e.module.has_gate else "up_proj"
        return {
            first_name: torch.from_dlpack(bank.gate_up(shape=tuple(e.first.shape[1:]), dtype=e.dtype_name)),
            "down_proj": torch.from_dlpack(bank.part("down", dtype=e.dtype_name, shape=tuple(e.down.shape[1:]))),
        }
    views = {}
    for name, t in zip(e.weight_names, e.weights):
        raw = torch.from_dlpack(bank.part(name, dtype="uint8")).view(t.dtype)
        views[name] = raw.unflatten(1, tuple(t.shape[1:])) if t.dim() > 1 else raw[:, 0]
    return views


class InferenceOnly(torch.autograd.Function):
    """A served layer's output, tied to the experts' weights that ask for a gradient: the product
    read the bank's copies, so none can be computed, and a backward through it raises."""

    @staticmethod
    def forward(ctx, output, name, *weights):
        ctx.name = name
        return output

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError(
            f"{ctx.name}: the experts served by expcache are inference-only: their weights "
            "(gate_up_proj, down_proj) get no gradient, the product reading the cache's copies of them. "
            "Freeze them "
            "to train the rest of the model (for e in pyexpcache.hf.find_experts(model): "
            "e.first.requires_grad_(False); e.down.requires_grad_(False): the router, the biases and "
            "everything else get their gradients), or close the handle to train the experts"
        )


def weights_state(module: torch.nn.Module, names: tuple[str, ...]) -> tuple:
    """What shows an edit of an experts module's served weights ``names``: each one's tensor and
    its version (an in-place operation on the parameter counts one; one on its ``.data`` does not)."""
    return tuple((t.data_ptr(), t.device, t._version) for t in (getattr(module, n) for n in names))


class LayerServer:
    """One layer's side of the implementation: its cache, layer, the bank seen as the module's
    weights (:class:`BankExperts`), and the implementation that computes it (``inner``). The bank
    holds copies of the weights made at each miss: a forward after an edit that the parameters
    show (:func:`weights_state`) raises until the handle's ``refresh()`` (which calls
    :meth:`remember_weights`)."""

    def __init__(self, cache_key: int, e, bank, inner_name: str, inner: Callable, device):
        module = e.module
        self.cache_key, self.layer, self.name, self.inner_name = cache_key, e.layer, e.name, inner_name
        self.weight_names = e.weight_names
        self.cap = bank.cap
        self.inner = over_windows(inner, self.cap)
        self.decode_inner = None  # while generate() decodes: what transformers switches grouped_mm to (batched_mm)
        # The bank's slots (a device select gives slot ids below cap; the staging rows past them
        # are a host select's).
        self.weights = {name: view[: self.cap] for name, view in bank_weights(e, bank).items()}
        for t in self.weights.values():  # torch.compile: fixed addresses, never copied into a graph's inputs
            torch._dynamo.mark_static_address(t)
        # Biases are small and stay on the compute device: each select records which expert each
        # slot was given, and the biases are read by that.
        slot_expert = torch.zeros(self.cap, dtype=torch.long, device=device) if module.has_bias else None
        self.slot_expert = slot_expert
        self.experts = BankExperts(module, self.weights, self.cap, slot_expert)
        # On the CPU, grouped_mm by expert id (by_expert_id): the module seen with its own expert
        # count and biases, the bank for its weights; expert_slots is set by each select.
        self.by_expert = by_expert_id(inner, self) if torch.device(device).type == "cpu" else None
        self.experts_by_id = BankExperts(module, self.weights, e.num_experts, None)
        self.expert_slots: list[int] = []
        # The biases' tensors where the model computes: a graph captured with them reads these.
        self.bias_tensors = {
            name: getattr(module, name).data
            for name in ("gate_up_proj_bias", "up_proj_bias", "down_proj_bias")
            if isinstance(getattr(module, name, None), torch.Tensor)
        }
        self.remember_weights(module)

    def remember_weights(self, module: torch.nn.Module) -> None:
        """The module's weights as they are now are the ones served (see :func:`weights_state`)."""
        self.weights_state = weights_state(module, self.weight_names)

    def __call__(self, module, hidden_states, top_k_index, top_k_weights):
        if not torch.compiler.is_compiling() and weights_state(module, self.weight_names) != self.weights_state:
            raise RuntimeError(
                f"{self.name}: the experts' weights changed since offload (or the last refresh): the "
                "experts resident in the cache still hold the old bytes and the others would be read "
                "anew; call refresh() on the handle offload returned to serve the weights as they are"
            )
        tokens, k = top_k_index.shape
        if k > self.cap:
            raise RuntimeError(
                f"{self.name}: the router chose {k} experts per token but the cache holds {self.cap}; raise the budget"
            )
        rows = self.cap // k  # a select of n rows needs n*k slots it may fill
        if tokens <= rows:
            out = self._serve(hidden_states, top_k_index, top_k_weights)
        else:
            out = torch.cat(
                [
                    self._serve(hidden_states[i : i + rows], top_k_index[i : i + rows], top_k_weights[i : i + rows])
                    for i in range(0, tokens, rows)
                ]
            )
        if torch.is_grad_enabled():
            asking = [w for w in (getattr(module, n) for n in self.weight_names) if w.requires_grad]
            if asking:
                out = InferenceOnly.apply(out, self.name, *asking)
        return out

    def _serve(self, hidden_states, top_k_index, top_k_weights):
        ids = top_k_index.contiguous()
        if torch.compiler.is_compiling():  # the operator keeps the select in torch.compile's graph
            slots = select_device(ids, self.cache_key, self.layer)
        else:  # eager or captured by hand: the call itself, without the operator's dispatch
            slots = _CACHES[self.cache_key].select_device(self.layer, ids)
        if self.by_expert is not None and not torch.compiler.is_compiling():
            expert_slots = [0] * self.experts_by_id.num_experts
            for expert, slot in zip(top_k_index.reshape(-1).tolist(), slots.reshape(-1).tolist()):
                expert_slots[expert] = slot
            self.expert_slots = expert_slots
            return self.by_expert(self.experts_by_id, hidden_states, top_k_index, top_k_weights)
        batched = self.decode_inner is not None or self.inner_name == "batched_mm"
        if not batched:  # batched_mm indexes by the ids as given; the others may need the router's dtype
            slots = slots.to(top_k_index.dtype)
        if self.slot_expert is not None:
            self.slot_expert[slots.reshape(-1)] = top_k_index.reshape(-1)
        return (self.decode_inner or self.inner)(self.experts, hidden_states, slots, top_k_weights)


def unserve(module: torch.nn.Module) -> None:
    """``module`` served no more: its server dropped, and a forward the server took the place of
    (an MXFP4 module's) the class's again."""
    server = module.__dict__.pop("_expcache_server", None)
    if hasattr(server, "detach"):
        server.detach(module)


def experts_forward(module, hidden_states, top_k_index, top_k_weights):
    """The registered implementation: the module's :class:`LayerServer` serves it."""
    server = getattr(module, "_expcache_server", None)
    if server is None:
        raise RuntimeError(
            f"{type(module).__name__} runs the {IMPLEMENTATION!r} experts implementation but is not "
            "offloaded (pyexpcache.hf.offload), or its handle was closed"
        )
    return server(module, hidden_states, top_k_index, top_k_weights)


def register(modules=()) -> None:
    """Register :func:`experts_forward` with transformers' experts interface and with the one
    each of ``modules`` dispatches through (idempotent)."""
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(IMPLEMENTATION, experts_forward)
    for module in modules:
        type(experts_interface(module)).register(IMPLEMENTATION, experts_forward)
