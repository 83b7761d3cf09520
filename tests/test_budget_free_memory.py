"""budget_bytes = EXPCACHE_BUDGET_FREE_MEMORY (C): the budget is the device's free memory less the
reserve, measured by expcache_create and again by expcache_budget_set and expcache_reserve_set, said
in a notice, read back with expcache_budget_get; too little memory is refused with the figures. On
the host backend, whose device is emulated at device_capacity_bytes."""

from __future__ import annotations

import ctypes
from ctypes import byref, c_uint32, c_uint64

import numpy as np
import pytest

from pyexpcache import _lib
from pyexpcache._errors import ExpcacheError

lib = _lib.lib
FREE = (1 << 64) - 1  # EXPCACHE_BUDGET_FREE_MEMORY
MiB = 1 << 20
OUT_OF_DEVICE_MEMORY = 2  # EXPCACHE_ERR_OUT_OF_DEVICE_MEMORY


def _make(capacity, reserve, lines=None):
    cfg = _lib.Config()
    lib.expcache_config_init(byref(cfg))
    cfg.num_layers, cfg.backend, cfg.environment = 2, _lib.BACKEND_HOST, 1  # no environment variable read
    cfg.device_capacity_bytes, cfg.reserve_bytes, cfg.budget_bytes = capacity, reserve, FREE
    handle = _lib.CachePtr()
    lib.expcache_create(byref(cfg), byref(handle))
    return handle


def _budget(handle):
    experts, nbytes, free = c_uint64(), c_uint64(), c_uint32()
    lib.expcache_budget_get(handle.value, byref(experts), byref(nbytes), byref(free))
    return experts.value, nbytes.value, free.value


def _register(handle, layer, part_bytes, n=64):
    src = np.zeros(n * 3 * part_bytes, np.uint8)
    _register.keep = getattr(_register, "keep", []) + [src]
    d = _lib.LayerDesc()
    lib.expcache_layer_desc_init(byref(d))
    d.num_experts = n
    for i, name in enumerate(("gate", "up", "down")):
        setattr(d, f"{name}_bytes", part_bytes)
        setattr(d, f"{name}_stride", part_bytes)
        setattr(d, f"{name}_base", src.ctypes.data + i * n * part_bytes)
    lib.expcache_layer_register(handle.value, layer, byref(d))


def _cap(handle, layer):
    """The cap of the layer's class, once it has grown (a select of one expert)."""
    slot = ctypes.c_int32()
    lib.expcache_select_slots_async(handle.value, layer, (ctypes.c_int32 * 1)(0), 32, 1, byref(slot), None)
    lib.expcache_synchronize(handle.value, None)
    c = c_uint32()
    lib.expcache_layer_bind_class(handle.value, layer, byref(c))
    info = _lib.ClassInfo()
    info.struct_size = ctypes.sizeof(_lib.ClassInfo)
    lib.expcache_class_info_get(handle.value, c.value, byref(info))
    return info.cap_experts, info.slot_bytes


def test_the_budget_is_free_memory_less_the_reserve():
    h = _make(64 * MiB, 16 * MiB)
    try:
        free, total = c_uint64(), c_uint64()
        lib.expcache_device_memory_get(h.value, byref(free), byref(total))
        assert total.value == 64 * MiB
        assert _budget(h) == (0, free.value - 16 * MiB, 1)
    finally:
        lib.expcache_destroy(h.value)


def test_classes_share_the_measured_budget_by_their_bytes():
    """Two classes get their shares of free - reserve, not the first bound taking all of it."""
    h = _make(64 * MiB, 16 * MiB)
    try:
        _register(h, 0, 64 << 10)  # 192 KiB experts
        _register(h, 1, 32 << 10)  # 96 KiB experts
        budget = _budget(h)[1]
        (cap0, slot0), (cap1, slot1) = _cap(h, 0), _cap(h, 1)
        assert cap0 > 0 and cap1 > 0
        assert cap0 * slot0 + cap1 * slot1 <= budget
        # Shares in proportion to the classes' bytes (both have 64 experts): class 0 twice class 1's.
        assert abs(cap0 * slot0 - 2 * cap1 * slot1) <= 2 * slot0
    finally:
        lib.expcache_destroy(h.value)


def test_reserve_and_budget_changes_measure_again():
    h = _make(64 * MiB, 16 * MiB)
    try:
        _register(h, 0, 64 << 10)
        before = _budget(h)[1]
        lib.expcache_reserve_set(h.value, 32 * MiB)
        assert _budget(h)[1] == before - 16 * MiB  # the cache's own slots count as free
        lib.expcache_budget_set(h.value, 0, 8 * MiB)  # an explicit budget ends the measuring
        assert _budget(h) == (0, 8 * MiB, 0)
        lib.expcache_reserve_set(h.value, 40 * MiB)
        assert _budget(h) == (0, 8 * MiB, 0)
        lib.expcache_budget_set(h.value, 0, FREE)
        assert _budget(h)[1:] == (before - 24 * MiB, 1)
    finally:
        lib.expcache_destroy(h.value)


def test_a_reserve_above_free_memory_is_refused_with_the_figures():
    cfg = _lib.Config()
    lib.expcache_config_init(byref(cfg))
    cfg.num_layers, cfg.backend, cfg.environment = 2, _lib.BACKEND_HOST, 1
    cfg.device_capacity_bytes, cfg.reserve_bytes, cfg.budget_bytes = 64 * MiB, 80 * MiB, FREE
    with pytest.raises(ExpcacheError) as info:
        lib.expcache_create(byref(cfg), byref(_lib.CachePtr()))
    assert info.value.status == OUT_OF_DEVICE_MEMORY
    assert "is not above reserve_bytes (80.0 MiB)" in info.value.message
    h = _make(64 * MiB, 16 * MiB)
    try:
        with pytest.raises(ExpcacheError) as info:
            lib.expcache_reserve_set(h.value, 80 * MiB)
        assert "lower the reserve" in info.value.message
        assert _budget(h)[2] == 1  # nothing changed
    finally:
        lib.expcache_destroy(h.value)
