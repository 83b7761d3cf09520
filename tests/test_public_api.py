"""pyexpcache's public namespace: every type a cache's method returns (and every type those hold) is
exported from the package, so an engine can annotate with it; nothing of the test hooks is."""

from __future__ import annotations

import dataclasses
import inspect
import typing

import pyexpcache
from pyexpcache import ExpertCache, MultiDeviceCache, testing


def _own_classes(hint, seen: set) -> None:
    """Every pyexpcache class named in the type ``hint``, and those its fields, its constructor's
    parameters and its public methods' results name."""
    if isinstance(hint, type) and hint.__module__.startswith("pyexpcache."):
        if hint not in seen:
            seen.add(hint)
            _named_by(hint, seen)
        return
    for arg in typing.get_args(hint):
        _own_classes(arg, seen)


def _named_by(cls, seen: set) -> None:
    hints = list(typing.get_type_hints(cls).values()) if dataclasses.is_dataclass(cls) else []
    hints += typing.get_type_hints(cls.__init__).values() if inspect.isfunction(cls.__init__) else []
    for name, member in inspect.getmembers(cls):
        fn = member.fget if isinstance(member, property) else member
        if not name.startswith("_") and inspect.isfunction(fn):
            hints.append(typing.get_type_hints(fn).get("return"))
    for h in hints:
        _own_classes(h, seen)


def _returned(cls) -> set:
    seen: set = set()
    _named_by(cls, seen)
    return seen


def test_all_is_sorted_and_every_name_resolves():
    assert pyexpcache.__all__ == sorted(pyexpcache.__all__)
    assert len(set(pyexpcache.__all__)) == len(pyexpcache.__all__)
    assert all(hasattr(pyexpcache, name) for name in pyexpcache.__all__)


def test_every_returned_type_is_exported():
    returned = _returned(ExpertCache) | _returned(MultiDeviceCache)
    # What the caches return today; the check below is what matters when one is added.
    assert {
        "Batch",
        "CacheStats",
        "ClassInfo",
        "ClassStats",
        "CompactBuffer",
        "DeviceBatch",
        "DeviceSelection",
        "ExpertView",
        "PathStats",
        "PoolStats",
        "PrefetchStats",
        "Selection",
        "StagingStats",
        "TensorView",
    } <= {c.__name__ for c in returned}
    for cls in returned:
        assert cls.__name__ in pyexpcache.__all__, f"{cls.__module__}.{cls.__name__} is returned but not exported"
        assert getattr(pyexpcache, cls.__name__) is cls


def test_the_test_hooks_stay_out_of_the_package_namespace():
    assert "testing" not in pyexpcache.__all__
    assert not set(testing.__all__) & set(pyexpcache.__all__)
