"""Fixtures shared by the contract suites: every cache test runs against each available
backend (host always; CUDA when a device is present) and each eviction policy of the library
(support.cache.POLICIES). What the test modules import lives in tests/support/ (this file puts
tests/ on sys.path, so ``from support.cache import ...`` works from any folder under tests/)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

_TESTS = str(Path(__file__).resolve().parent)
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)

from pyexpcache import ExpertCache, HostSource, ModelLayout  # noqa: E402

from support.cache import ARRANGEMENTS, BACKENDS, POLICIES, SCALE  # noqa: E402

try:
    from hypothesis import settings as hypothesis_settings
except ImportError:  # the fuzz suites skip without hypothesis
    pass
else:
    # How long the stateful fuzz machines (the `fuzz` marker) run: "quick" by default (make test),
    # "long" with --hypothesis-profile=long (make test-long). Each machine scales these counts
    # (tests/test_stateful.py's fuzz_counts); EXPCACHE_FUZZ_EXAMPLES/STEPS override both.
    hypothesis_settings.register_profile("quick", max_examples=100, stateful_step_count=30)
    hypothesis_settings.register_profile("long", max_examples=400, stateful_step_count=50)
    hypothesis_settings.load_profile("quick")  # the plugin's --hypothesis-profile, read later, replaces it


@pytest.fixture(params=BACKENDS)
def backend(request) -> str:
    return request.param


@pytest.fixture(params=POLICIES)
def policy(request) -> str:
    """The eviction policy of the caches a test makes. A test pins one with
    ``@pytest.mark.parametrize("policy", ["lru"])`` (a direct parametrization overrides this
    fixture, for make_cache too)."""
    return request.param


@pytest.fixture
def bank_arrangement() -> str:
    """The bank arrangement of the caches make_cache makes (and of those a test passes it to):
    ``"slots"``, unless the test (or its module, through ``pytestmark``) is marked
    ``@pytest.mark.arrangements``, which runs it against each of support.cache.ARRANGEMENTS."""
    return "slots"


def pytest_generate_tests(metafunc):
    if metafunc.definition.get_closest_marker("arrangements") and "bank_arrangement" in metafunc.fixturenames:
        metafunc.parametrize("bank_arrangement", ARRANGEMENTS)


@pytest.fixture
def make_cache(backend, policy, bank_arrangement):
    """make_cache(layout=None, *, pinned=None, arrangement="tensor", **cache_kwargs) -> (cache, source).
    Every cache gets the test's backend, ``policy=`` explicitly (never the library's default) and
    the test's ``bank_arrangement`` (a keyword argument replaces it). Everything made is closed at
    teardown, caches before sources."""
    made = []

    def make(layout=None, *, pinned=None, arrangement="tensor", **kwargs):
        layout = layout or ModelLayout.preset("q2", scale=SCALE)
        if pinned is None:
            pinned = backend == "cuda"
        source = HostSource(layout, pinned=pinned, arrangement=arrangement)
        kwargs.setdefault("log_level", 2)
        kwargs.setdefault("policy", policy)
        kwargs.setdefault("bank_arrangement", bank_arrangement)
        cache = ExpertCache(layout, source, backend=backend, **kwargs)
        made.append((cache, source))
        return cache, source

    yield make
    for cache, source in reversed(made):
        cache.close()
        source.close()


#: The devices axis of the multi-device suites: how many devices one MultiDeviceCache spreads over.
DEVICE_COUNTS = [1, 2, 3]


@pytest.fixture(params=DEVICE_COUNTS, ids=[f"{n}dev" for n in DEVICE_COUNTS])
def num_devices(request) -> int:
    return request.param


@pytest.fixture
def make_multi(backend, policy, num_devices):
    """make_multi(layout=None, *, placement=None, **cache_kwargs) -> (multi, source): a
    MultiDeviceCache over ``num_devices`` devices (host backend: emulated; CUDA: the GPUs there
    are, the same one repeated when there are fewer). Closed at teardown, caches before sources."""
    from pyexpcache import MultiDeviceCache, _cuda

    made = []

    def make(layout=None, *, placement=None, pinned=None, **kwargs):
        layout = layout or ModelLayout.preset("q2", scale=SCALE)
        if pinned is None:
            pinned = backend == "cuda"
        gpus = _cuda.device_count() if backend == "cuda" else num_devices
        devices = [i % max(gpus, 1) for i in range(num_devices)]
        source = HostSource(layout, pinned=pinned)
        kwargs.setdefault("log_level", 0)
        kwargs.setdefault("policy", policy)
        multi = MultiDeviceCache(layout, source, devices=devices, placement=placement, backend=backend, **kwargs)
        made.append((multi, source))
        return multi, source

    yield make
    for multi, source in reversed(made):
        multi.close()
        source.close()
