"""A file source opened by the caller's descriptor (``expcache_file_open_fd``), as an engine that
keeps its model's descriptor rather than a path opens it: the library reads through a duplicate
of its own, so the caller may close its descriptor at once, and misses are read from the file
byte-exact under either file_reads setting (O_DIRECT where the file system allows it). Through the
C ABI (the host backend)."""

from __future__ import annotations

import ctypes
import os
from ctypes import byref

import numpy as np
import pytest

from pyexpcache import InvalidArgumentError, SourceIOError, _lib

lib = _lib.lib
PART = 256
EXPERTS = 6


@pytest.fixture
def model_file(tmp_path):
    data = np.random.default_rng(7).integers(0, 256, size=EXPERTS * 3 * PART, dtype=np.uint8)
    path = tmp_path / "experts.bin"
    path.write_bytes(data.tobytes())
    return path, data


def _cache(file_reads):
    cfg = _lib.Config()
    lib.expcache_config_init(byref(cfg))
    cfg.num_layers, cfg.budget_experts, cfg.backend, cfg.log_level = 1, 3, _lib.BACKEND_HOST, 0
    cfg.file_reads = _lib.FILE_READS[file_reads]
    h = _lib.CachePtr()
    lib.expcache_create(byref(cfg), byref(h))
    return h


@pytest.mark.parametrize("file_reads", ["buffered", "direct"])
def test_a_file_opened_by_descriptor_serves_its_bytes_after_the_caller_closed_it(model_file, file_reads):
    path, data = model_file
    h = _cache(file_reads)
    try:
        fd = os.open(path, os.O_RDONLY)
        file_id = ctypes.c_uint32()
        lib.expcache_file_open_fd(h, fd, byref(file_id))
        os.close(fd)  # the library holds a duplicate of its own
        d = _lib.LayerDesc()
        lib.expcache_layer_desc_init(byref(d))
        d.num_experts, d.source_kind, d.file = EXPERTS, _lib.SOURCE_FILE, file_id.value
        d.gate_bytes = d.up_bytes = d.down_bytes = PART
        d.gate_base, d.up_base, d.down_base = 0, PART, 2 * PART  # expert e's parts at e * 3 * PART
        d.gate_stride = d.up_stride = d.down_stride = 3 * PART
        lib.expcache_layer_register(h, 0, byref(d))
        ids = np.array([4, 1, 5, 4, 0], dtype=np.uint32)  # more distinct than the 3 slots: some staged
        ptrs = np.zeros((ids.size, 3), dtype=np.uint64)
        lib.expcache_select_async(h, 0, ids.ctypes.data, ids.size, None, ptrs.ctypes.data)
        for e, row in zip(ids.tolist(), ptrs.tolist()):
            want = data[e * 3 * PART : (e + 1) * 3 * PART].reshape(3, PART)
            for p in range(3):
                got = np.zeros(PART, dtype=np.uint8)
                lib.expcache_testing_read_device(h, row[p], got.ctypes.data, PART)
                assert (got == want[p]).all(), f"expert {e} part {p}"
    finally:
        lib.expcache_destroy(h)


def test_descriptors_that_cannot_be_a_source_are_refused(model_file, tmp_path):
    path, _ = model_file
    h = _cache("buffered")
    out = ctypes.c_uint32()
    try:
        folder = os.open(tmp_path, os.O_RDONLY)
        write_only = os.open(path, os.O_WRONLY)
        try:
            with pytest.raises(SourceIOError, match=r"descriptor \d+ \(.*\) is not a regular file"):
                lib.expcache_file_open_fd(h, folder, byref(out))
            with pytest.raises(InvalidArgumentError, match="is not open for reading"):
                lib.expcache_file_open_fd(h, write_only, byref(out))
        finally:
            os.close(folder)
            os.close(write_only)
    finally:
        lib.expcache_destroy(h)
