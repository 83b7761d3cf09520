"""The ``gguf`` package's reader, imported when a GGUF file is first read, with every read
bounds-checked against the file (:func:`_bounded_reader_class`), for :mod:`pyexpcache.gguf`."""

from __future__ import annotations

import functools

import numpy as np


def _import_gguf():
    try:
        import gguf  # lazy on purpose: the package is optional
    except ImportError as exc:
        raise ImportError(
            "reading GGUF files needs the 'gguf' package: pip install gguf (or pip install 'expcache[gguf]')"
        ) from exc
    return gguf


@functools.lru_cache(maxsize=1)
def _bounded_reader_class():
    """GGUFReader whose every read is bounds-checked against the file size.

    The stock reader slices its memmap without checking, so a truncated or corrupted
    file can make it read empty arrays (IndexError at best; a corrupted array length
    makes it loop for ~2^64 iterations without reading a byte). This raises instead,
    and rejects a metadata array whose length cannot fit in the rest of the file
    before the reader walks it item by item (through a multi-GB file, that walk
    would take hours).
    """
    gguf = _import_gguf()
    vt = gguf.GGUFValueType

    class _BoundedReader(gguf.GGUFReader):
        def _get(self, offset, dtype, count=1, *args, **kwargs):
            n = int(count)
            end = int(offset) + np.dtype(dtype).itemsize * n
            size = int(self.data.shape[0])
            if int(offset) < 0 or n < 0 or end > size:
                raise _Truncated(
                    f"a field at byte {int(offset)} needs {end - int(offset)} bytes but the file ends at byte {size}",
                    int(offset),
                    end,
                    size,
                )
            return super()._get(offset, dtype, count, *args, **kwargs)

        def _build_tensors(self, start_offs, fields, *args, **kwargs):
            try:
                return super()._build_tensors(start_offs, fields, *args, **kwargs)
            except _Truncated as exc:
                # Name the tensor whose data runs past the end (an incomplete download).
                try:
                    names = {
                        int(start_offs) + int(f.parts[-1][0]): bytes(f.parts[1]).decode("utf-8", "replace")
                        for f in fields
                    }
                except Exception:
                    raise exc from None
                name = names.get(exc.offset)
                if name is None:
                    raise
                raise _Truncated(
                    f"the data of tensor {name} (bytes {exc.offset}..{exc.end}) runs past the "
                    f"end of the file ({exc.size} bytes)",
                    exc.offset,
                    exc.end,
                    exc.size,
                ) from None

        def _get_field_parts(self, orig_offs, raw_type, *args, **kwargs):
            if int(raw_type) == int(vt.ARRAY):
                item_type = int(self._get(orig_offs, np.uint32)[0])
                length = int(self._get(orig_offs + 4, np.uint64)[0])
                scalar = {int(k): v for k, v in self.gguf_scalar_to_np.items()}.get(item_type)
                min_item = (
                    np.dtype(scalar).itemsize
                    if scalar is not None
                    else 8
                    if item_type == int(vt.STRING)
                    else 12
                    if item_type == int(vt.ARRAY)
                    else 1
                )
                left = int(self.data.shape[0]) - (int(orig_offs) + 12)
                if length * min_item > left:
                    raise _Truncated(
                        f"a metadata array at byte {int(orig_offs)} claims {length} items of at "
                        f"least {min_item} bytes but {left} bytes are left in the file"
                    )
            return super()._get_field_parts(orig_offs, raw_type, *args, **kwargs)

    return _BoundedReader


class _Truncated(ValueError):
    def __init__(self, message: str, offset: int = -1, end: int = -1, size: int = -1):
        super().__init__(message)
        self.offset, self.end, self.size = offset, end, size
