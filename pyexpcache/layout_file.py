"""Layout files: a model's layout as JSON (docs/models.md has the format), read into a
:class:`~pyexpcache.ModelLayout` (:meth:`~pyexpcache.ModelLayout.from_json`) and written from
one (:meth:`~pyexpcache.ModelLayout.to_json`), with errors that name the file and the entry."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Optional

from ._errors import ArgumentRangeError
from ._ints import checked_int
from ._lib import MAX_EXPERTS_LIMIT, MAX_LAYERS_LIMIT, MAX_PART_BYTES_LIMIT
from .layer_spec import PARTS, LayerSpec
from .quant import matrix_bytes, quant_type


class LayoutFileError(ValueError):
    """A layout file or a Hugging Face ``config.json`` that cannot be read as a layout. The
    message names the file and the entry, as ``mixtral.json: layers[0].gate.shape: ...``."""


def read_json(path: str):
    with open(path, encoding="utf-8") as f:
        text = f.read()
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise LayoutFileError(f"{path}: not JSON: {exc}") from None


def shown(value) -> str:
    """A value as JSON writes it, for messages."""
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


class LayoutFile:
    """One layout file being read: its name for messages, and the checks that name the entry."""

    def __init__(self, where: str):
        self.where = where

    def fail(self, at: str, message: str) -> LayoutFileError:
        return LayoutFileError(f"{self.where}: {at}: {message}")

    def keys(self, obj, at: str, allowed: tuple) -> None:
        if not isinstance(obj, Mapping):
            raise self.fail(at, f"expected an object, got {shown(obj)}")
        unknown = [k for k in obj if k not in allowed and k != "comment"]
        if unknown:
            raise self.fail(at, f"unknown key {', '.join(map(repr, unknown))}; expected {', '.join(allowed)}")

    def whole(self, value, at: str, limit: int) -> int:
        try:
            return checked_int(value, at, 1, limit)
        except TypeError:
            raise self.fail(at, f"expected a whole number, got {shown(value)}") from None
        except ArgumentRangeError:
            raise self.fail(at, f"must be 1..{limit} (the library's limit), got {value}") from None

    def type_at(self, obj, at: str, inherited: Optional[str]) -> Optional[str]:
        """The type ``obj`` gives ("type" or "dtype"), else ``inherited``."""
        given = [k for k in ("type", "dtype") if k in obj]
        if len(given) > 1:
            raise self.fail(at, 'give "type" or "dtype", not both')
        if not given:
            return inherited
        try:
            return quant_type(obj[given[0]])
        except (TypeError, ValueError) as exc:
            raise self.fail(f"{at}.{given[0]}", str(exc)) from None

    def part_bytes(self, layer, at: str, part: str, quant: Optional[str]) -> int:
        key = f"{part}_bytes"
        if key in layer and part in layer:
            raise self.fail(at, f'give "{key}" or "{part}", not both')
        if key in layer:
            return self.whole(layer[key], f"{at}.{key}", MAX_PART_BYTES_LIMIT)
        if part not in layer:
            raise self.fail(at, f'no "{key}" (or "{part}": {{"type": ..., "shape": [rows, cols]}})')
        here = f"{at}.{part}"
        spec = layer[part]
        self.keys(spec, here, ("type", "dtype", "shape"))
        quant = self.type_at(spec, here, quant)
        if quant is None:
            raise self.fail(here, 'no type: give "type" here, in the layer or at the top of the file')
        shape = spec.get("shape")
        if not isinstance(shape, list) or len(shape) != 2:
            raise self.fail(f"{here}.shape", f"expected [rows, cols], got {shown(shape)}")
        rows, cols = (self.whole(v, f"{here}.shape[{k}]", MAX_PART_BYTES_LIMIT) for k, v in enumerate(shape))
        try:
            return matrix_bytes(quant, rows, cols)
        except ValueError as exc:
            raise self.fail(here, str(exc)) from None

    def layer(self, entry, at: str, quant: Optional[str]) -> Optional[LayerSpec]:
        if entry is None:
            return None
        self.keys(entry, at, ("experts", "type", "dtype") + PARTS + tuple(f"{p}_bytes" for p in PARTS))
        quant = self.type_at(entry, at, quant)
        if "experts" not in entry:
            raise self.fail(at, 'no "experts" (the number of routed experts; null is a dense layer)')
        experts = self.whole(entry["experts"], f"{at}.experts", MAX_EXPERTS_LIMIT)
        sizes = [self.part_bytes(entry, at, p, quant) for p in PARTS]
        try:
            return LayerSpec(experts, *sizes)
        except (TypeError, ValueError) as exc:
            raise self.fail(at, str(exc)) from None

    def layer_list(self, entries, at: str, quant: Optional[str]) -> list[Optional[LayerSpec]]:
        if not isinstance(entries, list):
            raise self.fail(at, f"expected a list of layers, got {shown(entries)}")
        out: list[Optional[LayerSpec]] = []
        for i, entry in enumerate(entries):
            here = f"{at}[{i}]"
            if isinstance(entry, Mapping) and "repeat" in entry:
                self.keys(entry, here, ("repeat", "layer", "layers", "type", "dtype"))
                times = self.whole(entry["repeat"], f"{here}.repeat", MAX_LAYERS_LIMIT)
                inner = self.type_at(entry, here, quant)
                if ("layer" in entry) == ("layers" in entry):
                    raise self.fail(
                        here,
                        'a repeat takes "layer" (one layer, or null) or "layers" (a group of '
                        "layers, repeated in order)",
                    )
                group = (
                    [self.layer(entry["layer"], f"{here}.layer", inner)]
                    if "layer" in entry
                    else self.layer_list(entry["layers"], f"{here}.layers", inner)
                )
                if not group:
                    raise self.fail(f"{here}.layers", "an empty group")
                added = group * times if len(out) + times * len(group) <= MAX_LAYERS_LIMIT else None
            else:
                added = [self.layer(entry, here, quant)]
            if added is None or len(out) + len(added) > MAX_LAYERS_LIMIT:
                raise self.fail(here, f"the layers pass the library's limit of {MAX_LAYERS_LIMIT}")
            out.extend(added)
        return out


def _looks_like_hf_config(obj) -> bool:
    return isinstance(obj, Mapping) and ("model_type" in obj or "architectures" in obj)


def layout_from_object(cls, obj, where: str, default_name: str):
    """A ``cls`` (:class:`~pyexpcache.ModelLayout`) from a layout file's parsed contents
    ``obj`` (see :meth:`~pyexpcache.ModelLayout.from_json`), read from ``where``."""
    file = LayoutFile(where)
    if not isinstance(obj, Mapping):
        raise LayoutFileError(f'{where}: expected an object {{"name": ..., "layers": [...]}}, got {shown(obj)}')
    if "layers" not in obj:
        hint = (
            ": this looks like a Hugging Face config.json (ModelLayout.from_hf_config reads it)"
            if _looks_like_hf_config(obj)
            else ""
        )
        raise LayoutFileError(f'{where}: no "layers" list{hint}')
    file.keys(obj, "top level", ("name", "layers", "type", "dtype"))
    name = obj.get("name", default_name)
    if not isinstance(name, str) or not name:
        raise file.fail("name", f"expected a non-empty string, got {shown(name)}")
    layers = file.layer_list(obj["layers"], "layers", file.type_at(obj, "top level", None))
    try:
        return cls(tuple(layers), name=name)
    except ValueError as exc:
        raise file.fail("layers", str(exc)) from None


def layout_to_object(layout) -> dict:
    """``layout`` (a :class:`~pyexpcache.ModelLayout`) as a layout file's contents (see
    :meth:`~pyexpcache.ModelLayout.to_json`)."""
    entries: list = []
    i = 0
    while i < len(layout.layers):
        spec, run = layout.layers[i], 1
        while i + run < len(layout.layers) and layout.layers[i + run] == spec:
            run += 1
        item = (
            None
            if spec is None
            else {
                "experts": spec.num_experts,
                "gate_bytes": spec.gate_bytes,
                "up_bytes": spec.up_bytes,
                "down_bytes": spec.down_bytes,
            }
        )
        entries.append(item if run == 1 else {"repeat": run, "layer": item})
        i += run
    return {"name": layout.name, "layers": entries}
