"""Visible trouble: a class left with cap 0 warns once (Python warnings and the C log
callback); EXPCACHE_VERBOSE takes on/off words and ignores anything else with a warning; the library's
lines reach stderr when Python's logging is not configured."""

from __future__ import annotations

import logging
import re
import subprocess
import sys
import textwrap
import warnings

import pytest

from pyexpcache import ExpcacheWarning, ExpertCache, HostSource, LayerSpec, ModelLayout, testing

from support.cache import SCALE


def small_device_cache(src, layout, **kw):
    # An emulated device of 1 MiB with a 2 MiB reserve: no memory is left for any slot.
    return ExpertCache(
        layout, src, budget_experts=8, backend="host", device_capacity_bytes=1 << 20, reserve_bytes=2 << 20, **kw
    )


def test_cap_zero_warns_once_per_class(policy):
    layout = ModelLayout.preset("mixed", scale=SCALE)
    with HostSource(layout) as src, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with small_device_cache(src, layout, log_level=1, policy=policy) as cache:
            for token in range(3):
                for layer in (5, 40):  # a q2 and a q4 layer: two classes
                    cache.select(layer, [token, token + 1])
                    assert testing.read_expert(cache, layer, token) is None  # loaded directly, never cached
            assert cache.stats().hit_rate == 0.0
    ours = [w for w in caught if issubclass(w.category, ExpcacheWarning)]
    assert len(ours) == 2, [str(w.message) for w in ours]
    for w in ours:
        assert "cap 0" in str(w.message) and "reserve" in str(w.message)
        assert w.filename == __file__  # points at the user's line, not at the wrapper


def test_cap_zero_warns_even_when_notices_are_off(policy):
    layout = ModelLayout.preset("q2", scale=SCALE)
    with HostSource(layout) as src, pytest.warns(ExpcacheWarning, match="cap 0"):
        with small_device_cache(src, layout, log_level=1, policy=policy) as cache:
            cache.select(5, [1])


def serve_one_layer(layout, src, layer, **kw):
    """Select two experts of ``layer`` on a host cache made with ``kw``: (its class's info, the
    ExpcacheWarning texts issued)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with ExpertCache(layout, src, backend="host", log_level=1, **kw) as cache:
            cache.select(layer, [1, 2])
            info = next(i for i in cache.classes() if i.key == layout[layer].class_key)
    return info, [str(w.message) for w in caught if issubclass(w.category, ExpcacheWarning)]


def test_a_budget_below_one_expert_warns_with_the_smallest_that_holds_one(policy):
    layout = ModelLayout.preset("mixed", scale=SCALE)
    with HostSource(layout) as src:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with ExpertCache(layout, src, budget_bytes=1, backend="host", log_level=1, policy=policy) as cache:
                for token in range(3):
                    for layer in (5, 40):  # a q2 and a q4 layer: two classes
                        cache.select(layer, [token, token + 1])
        ours = [str(w.message) for w in caught if issubclass(w.category, ExpcacheWarning)]
        assert len(ours) == 2, ours  # once per class
        for layer in (5, 40):
            info, texts = serve_one_layer(layout, src, layer, budget_bytes=1, policy=policy)
            assert info.cap_experts == 0 and len(texts) == 1, texts
            assert "cap 0 experts" in texts[0] and "less than one expert" in texts[0], texts[0]
            need = int(re.search(r"budget_bytes of at least (\d+) B", texts[0]).group(1))
            assert serve_one_layer(layout, src, layer, budget_bytes=need, policy=policy)[0].cap_experts >= 1
            assert serve_one_layer(layout, src, layer, budget_bytes=need - 1, policy=policy)[0].cap_experts == 0


def test_a_reserve_above_free_memory_warns_with_the_largest_that_leaves_one_expert(policy):
    layout = ModelLayout.preset("q2", scale=SCALE)
    small = dict(budget_experts=8, device_capacity_bytes=1 << 20, policy=policy)
    with HostSource(layout) as src:
        info, texts = serve_one_layer(layout, src, 5, reserve_bytes=2 << 20, **small)
        assert info.cap_experts == 0 and len(texts) == 1, texts
        most = int(re.search(r"reserve_bytes of at most (\d+) B", texts[0]).group(1))
        assert serve_one_layer(layout, src, 5, reserve_bytes=most, **small)[0].cap_experts >= 1
        assert serve_one_layer(layout, src, 5, reserve_bytes=most + 1, **small)[0].cap_experts == 0


def test_a_failed_first_slot_allocation_warns(make_cache):
    cache, _ = make_cache(budget_experts=4, log_level=1)
    testing.fail_device_alloc_after(cache, 0)
    with pytest.warns(ExpcacheWarning, match=r"cap 0 experts.*a slot allocation failed.*free device memory"):
        cache.select(5, [1])


def test_no_warning_when_memory_suffices(make_cache):
    cache, _ = make_cache(budget_experts=8)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ExpcacheWarning)
        cache.select(5, [1, 2])


def run_child(code: str, env_extra: dict) -> subprocess.CompletedProcess:
    import os

    env = dict(os.environ, **env_extra)
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120, env=env
    )


CHILD = """
    from pyexpcache import ExpertCache, HostSource, ModelLayout
    lay = ModelLayout.preset("q2", scale=4096)
    with HostSource(lay) as src, ExpertCache(lay, src, budget_experts=4, backend="host") as cache:
        cache.select(5, [1, 2])
    print("done")
"""


@pytest.mark.parametrize("value", ["1", "true", "YES", "On"])
def test_verbose_on_reaches_stderr_without_logging_setup(value):
    out = run_child(CHILD, {"EXPCACHE_VERBOSE": value})
    assert out.returncode == 0, out.stderr
    assert "select layer 5 k 2" in out.stderr  # a per-call (DEBUG) line


@pytest.mark.parametrize("value", ["0", "false", "No", "OFF"])
def test_verbose_off_keeps_per_call_lines_away(value):
    out = run_child(CHILD, {"EXPCACHE_VERBOSE": value})
    assert out.returncode == 0, out.stderr
    assert "select layer" not in out.stderr
    assert "cap 4 experts" in out.stderr  # notices still reach stderr by default


@pytest.mark.parametrize("value", ["2", "maybe", "verbose", " 1"])
def test_verbose_other_values_are_ignored_with_a_warning(value):
    out = run_child(CHILD, {"EXPCACHE_VERBOSE": value})
    assert out.returncode == 0, out.stderr
    assert f'EXPCACHE_VERBOSE="{value}" is not one of' in out.stderr and "; ignored" in out.stderr
    assert "select layer" not in out.stderr  # not verbose


def test_lines_go_to_the_logger_when_logging_is_configured(make_cache, caplog):
    import logging

    with caplog.at_level(logging.DEBUG, logger="pyexpcache"):
        cache, _ = make_cache(budget_experts=4, log_level=3)
        cache.select(5, [1, 2])
    assert any("select layer 5 k 2" in r.message and r.levelno == logging.DEBUG for r in caplog.records)
    assert any("cap 4 experts" in r.message and r.levelno == logging.INFO for r in caplog.records)


# -- callbacks outside the lock --------------------------------------------------------------------

HANDLER_CHILD = """
    import logging
    from pyexpcache import ExpertCache, HostSource, ModelLayout
    lay = ModelLayout.preset("mixed", scale=4096)
    src = HostSource(lay)
    cache = ExpertCache(lay, src, budget_bytes=lay.total_bytes // 8, backend="host", policy="lru")
    seen = []

    class OnNotice(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())
            {action}

    log = logging.getLogger("pyexpcache")
    log.addHandler(OnNotice())
    log.setLevel(logging.INFO)
    cache.select(5, [1, 2])  # the class's first cap notice
    if not cache.closed:
        cache.select(40, [3])  # the second class's
    assert seen, "no notice reached the handler"
    print("done", len(seen), cache.closed)
"""


@pytest.mark.parametrize(
    "action",
    ["cache.stats()", "cache.select(6, [7])", "cache.close()", "cache.load_compact(7, [1, 2]); cache.classes()"],
)
def test_a_log_handler_may_call_the_cache(action):
    # The cap notice is logged inside the first select; a handler that calls the cache deadlocked
    # on the library's lock (select, stats) or on close waiting for the call that logged.
    out = child(HANDLER_CHILD.replace("{action}", action))
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("done"), out.stdout
    assert out.stdout.split()[2] == str(action == "cache.close()")


C_CALLBACK_CHILD = """
    import ctypes
    from pyexpcache import ExpertCache, HostSource, ModelLayout, _lib
    lay = ModelLayout.preset("q2", scale=4096)
    src = HostSource(lay)
    cache = ExpertCache(lay, src, budget_experts=4, backend="host", policy="lru")
    calls = []
    with cache.raw_handle() as h:
        def on_line(user, level, message):
            # The C callback itself calls the cache: the library's lock must not be held.
            st = _lib.Stats()
            st.struct_size = ctypes.sizeof(st)
            calls.append(_lib.lib.expcache_stats_get(h, 0, 0, ctypes.byref(st)))
        fn = _lib.LOG_FN(on_line)
        _lib.lib.expcache_log_set_callback(h, fn, None)
        _lib.lib.expcache_release_all(h)
        ids = (ctypes.c_uint32 * 2)(1, 2)
        out = (ctypes.c_uint64 * 6)()
        _lib.lib.expcache_select_async(h, 5, ids, 2, None, out)  # the cap notice
        err = _lib.lib.expcache_last_error()
    assert calls, "the callback was not called"
    print("done", len(calls), err)
"""


def test_a_c_log_callback_may_call_the_cache():
    out = child(C_CALLBACK_CHILD)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("done"), out.stdout


def child(code: str) -> subprocess.CompletedProcess:
    """A child run that a hang fails in 60 s instead of blocking the suite."""
    try:
        return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("the child hung (a callback that called the cache deadlocked)")


# -- warnings as errors ----------------------------------------------------------------------------


def test_a_warning_made_an_error_raises_at_the_call(policy):
    layout = ModelLayout.preset("q2", scale=SCALE)
    with HostSource(layout) as src, small_device_cache(src, layout, log_level=1, policy=policy) as cache:
        with warnings.catch_warnings():
            warnings.simplefilter("error", ExpcacheWarning)
            with pytest.raises(ExpcacheWarning, match="cap 0"):
                cache.select(5, [1])
        assert cache.stats().path("decode").calls == 1  # the call itself was made


def test_python_W_error_surfaces_the_cap_zero_warning():
    code = """
        from pyexpcache import ExpertCache, HostSource, ModelLayout
        lay = ModelLayout.preset("q2", scale=4096)
        with HostSource(lay) as src, ExpertCache(lay, src, budget_experts=8, backend="host",
                device_capacity_bytes=1 << 20, reserve_bytes=2 << 20, log_level=1) as cache:
            try:
                cache.select(5, [1])
            except Exception as e:
                print("raised", type(e).__name__)
    """
    out = subprocess.run(
        [sys.executable, "-W", "error", "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "raised ExpcacheWarning", (out.stdout, out.stderr)


def test_a_warning_goes_out_once_when_logging_is_configured(policy, caplog):
    # Through warnings the first time; not through the logger as well (one line, not two).
    layout = ModelLayout.preset("q2", scale=SCALE)
    with (
        HostSource(layout) as src,
        warnings.catch_warnings(record=True) as caught,
        caplog.at_level(logging.INFO, logger="pyexpcache"),
    ):
        warnings.simplefilter("always")
        with small_device_cache(src, layout, log_level=1, policy=policy) as cache:
            cache.select(5, [1])
    ours = [w for w in caught if issubclass(w.category, ExpcacheWarning)]
    logged = [r for r in caplog.records if "cap 0" in r.getMessage()]
    assert len(ours) == 1 and not logged, ([str(w.message) for w in ours], [r.getMessage() for r in logged])


# -- size classes ----------------------------------------------------------------------------------


def five_class_layout() -> ModelLayout:
    sizes = [(256 * (i + 1), 256 * (i + 1), 512) for i in range(5)]
    return ModelLayout([LayerSpec(8, *sizes[i % 5]) for i in range(10)], name="five-classes")


def test_max_classes_defaults_to_the_layouts_classes(policy):
    layout = five_class_layout()
    with HostSource(layout) as src, warnings.catch_warnings():
        warnings.simplefilter("error", ExpcacheWarning)
        with ExpertCache(layout, src, budget_bytes=layout.total_bytes, backend="host", policy=policy) as cache:
            assert cache.max_classes == 5
            for _ in range(3):  # a repeated decode pattern over the five classes
                for layer in range(10):
                    cache.select(layer, [1, 2])
            assert cache.stats().hit_rate == pytest.approx(2 / 3)
            assert all(s.class_reuses == 0 for c in cache.stats().classes for s in c.paths.values())


def test_fewer_max_classes_than_the_layout_has_warns_at_construction_and_at_the_first_reuse(policy):
    layout = five_class_layout()
    with HostSource(layout) as src, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with ExpertCache(
            layout, src, budget_bytes=layout.total_bytes, backend="host", policy=policy, max_classes=4
        ) as cache:
            made = [str(w.message) for w in caught if issubclass(w.category, ExpcacheWarning)]
            assert len(made) == 1 and "5 expert size classes and max_classes is 4" in made[0], made
            assert "set max_classes to 5" in made[0]
            for layer in range(10):
                cache.select(layer, [1])
    reuses = [str(w.message) for w in caught if "reused it" in str(w.message)]
    assert len(reuses) == 1 and "raise max_classes" in reuses[0], reuses


def test_partition_layer_warns_when_layers_get_no_share(policy):
    layout = ModelLayout.preset("q2", scale=SCALE)  # 43 layers of one class
    with HostSource(layout) as src, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with ExpertCache(
            layout, src, budget_experts=10, backend="host", partition="layer", policy=policy, log_level=1
        ) as cache:
            cache.select(5, [1, 2])
    ours = [str(w.message) for w in caught if issubclass(w.category, ExpcacheWarning)]
    assert len(ours) == 1, ours
    assert "leaves 33 of them" in ours[0] and "a share of 0" in ours[0], ours
    assert "cap of at least 43 experts" in ours[0] and "partition global" in ours[0], ours
    with HostSource(layout) as src, warnings.catch_warnings():
        warnings.simplefilter("error", ExpcacheWarning)
        with ExpertCache(layout, src, budget_experts=43, backend="host", partition="layer", policy=policy) as cache:
            cache.select(5, [1, 2])  # every layer has a slot: no warning
