"""Layout files: a model's layout as JSON (docs/models.md has the format), read into a
:class:`~pyexpcache.ModelLayout` (:meth:`~pyexpcache.ModelLayout.from_json`) and written from
one (:meth:`~pyexpcache.ModelLayout.to_json`), with errors that name the file and the entry."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Optional

from ._errors import ArgumentRangeError
from ._ints import checked_int
from ._lib import MAX_EXPERTS_LIMIT, MAX_LAYERS_LIMIT, MAX_PART_BYTES_LIMIT, MAX_PARTS
from .layer_spec import PARTS, LayerSpec, PartSpec, dtype_itemsize, dtype_name
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
        return self.matrix(spec, here, quant)

    def matrix(self, spec, here: str, quant: Optional[str]) -> int:
        """The bytes of a ``{"type": ..., "shape": [rows, cols]}`` matrix (``quant``: the type
        when it gives none)."""
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
        parted = isinstance(entry, Mapping) and "parts" in entry
        shorthand = PARTS + tuple(f"{p}_bytes" for p in PARTS)
        self.keys(entry, at, ("experts", "type", "dtype") + (("parts",) if parted else shorthand + ("parts",)))
        quant = self.type_at(entry, at, quant)
        if "experts" not in entry:
            raise self.fail(at, 'no "experts" (the number of routed experts; null is a dense layer)')
        experts = self.whole(entry["experts"], f"{at}.experts", MAX_EXPERTS_LIMIT)
        try:
            if parted:
                return LayerSpec.of_parts(experts, self.parts(entry["parts"], f"{at}.parts", quant))
            return LayerSpec(experts, *(self.part_bytes(entry, at, p, quant) for p in PARTS))
        except LayoutFileError:
            raise
        except (TypeError, ValueError) as exc:
            raise self.fail(at, str(exc)) from None

    def parts(self, entries, at: str, quant: Optional[str]) -> list[PartSpec]:
        """A layer's ``"parts"``: 1..8 objects, each ``{"name": ..., "bytes": n}``, or sized by
        ``"dtype"`` and ``"shape"`` (the part's items: ``"float8_e4m3fn"``, ``"float32"``, ...), or
        by a GGUF ``"type"`` and a ``[rows, cols]`` ``"shape"`` (the layer's or file's type by
        default)."""
        if not isinstance(entries, list) or not 1 <= len(entries) <= MAX_PARTS:
            raise self.fail(at, f"expected a list of 1..{MAX_PARTS} parts (the library's limit), got {shown(entries)}")
        out = []
        for i, part in enumerate(entries):
            here = f"{at}[{i}]"
            self.keys(part, here, ("name", "bytes", "dtype", "type", "shape"))
            name = part.get("name")
            if not isinstance(name, str) or not name:
                raise self.fail(here, f'no "name" (a non-empty string), got {shown(name)}')
            if "dtype" in part and "type" in part:
                raise self.fail(
                    here,
                    'give "dtype" (the items\' type, with any "shape") or "type" (a GGUF type, [rows, cols]), not both',
                )
            shape = part.get("shape")
            if shape is not None and not isinstance(shape, list):
                raise self.fail(f"{here}.shape", f"expected a list of whole numbers, got {shown(shape)}")
            if "dtype" in part:
                try:
                    dtype = dtype_name(part["dtype"])
                except TypeError as exc:
                    raise self.fail(f"{here}.dtype", str(exc)) from None
                dims = None
                if shape is not None:  # [] for one item (a scale per expert)
                    dims = [self.whole(v, f"{here}.shape[{k}]", MAX_PART_BYTES_LIMIT) for k, v in enumerate(shape)]
                nbytes = part.get("bytes", None if dims is None else math.prod(dims) * dtype_itemsize(dtype))
                if nbytes is None:
                    raise self.fail(here, 'no "bytes" (or a "shape" to size the part by its dtype)')
                out.append(
                    self._part(name, self.whole(nbytes, f"{here}.bytes", MAX_PART_BYTES_LIMIT), dtype, dims, here)
                )
            elif "bytes" in part and "type" not in part:
                if shape is not None:
                    raise self.fail(here, 'a "shape" needs a "dtype" (or a GGUF "type")')
                out.append(
                    self._part(name, self.whole(part["bytes"], f"{here}.bytes", MAX_PART_BYTES_LIMIT), None, None, here)
                )
            elif "type" in part or shape is not None:
                if "bytes" in part:
                    raise self.fail(here, 'give "bytes" or a GGUF "type" and its [rows, cols], not both')
                out.append(self._part(name, self.matrix(part, here, quant), None, None, here))
            else:
                raise self.fail(
                    here, 'no size: give "bytes", a "dtype" and "shape", or a GGUF "type" and a [rows, cols] "shape"'
                )
        return out

    def _part(self, name, nbytes, dtype, shape, at: str) -> PartSpec:
        try:
            return PartSpec(name, nbytes, dtype, shape)
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
        item = None if spec is None else layer_object(spec)
        entries.append(item if run == 1 else {"repeat": run, "layer": item})
        i += run
    return {"name": layout.name, "layers": entries}


def layer_object(spec: LayerSpec) -> dict:
    """One layer as a layout file writes it: gate/up/down byte sizes for the three-part shorthand,
    else its ``"parts"``, each with its name, bytes, and dtype and shape where it has them."""
    if spec.part_names == PARTS and all(p.dtype is None for p in spec.parts):
        return {"experts": spec.num_experts, **{f"{p}_bytes": b for p, b in zip(PARTS, spec.class_key)}}
    parts = []
    for p in spec.parts:
        part = {"name": p.name, "bytes": p.nbytes}
        if p.dtype is not None:
            part["dtype"] = p.dtype
        if p.shape is not None:
            part["shape"] = list(p.shape)
        parts.append(part)
    return {"experts": spec.num_experts, "parts": parts}
