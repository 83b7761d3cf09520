"""The EXPCACHE_* environment variables, as an engine embedding the library meets them
(expcache_config_t.environment): read by default, an operator's overrides; a malformed one never
fails create (it is ignored, with a warning); one that replaces a value the caller set says so in
a notice; each such line once per process; ``environment="ignore"`` reads none. Lines logged at
create reach stderr (no callback exists yet), so each case runs in a child process."""

from __future__ import annotations

import pytest

from pyexpcache import ExpertCache, HostSource, ModelLayout

from support.cache import SCALE
from support.child import run_child

CHILD = """
    from pyexpcache import ExpertCache, HostSource, ModelLayout
    lay = ModelLayout.preset("q2", scale=4096)
    with HostSource(lay) as src:
        for _ in range(2):  # a second cache: the same lines are not logged again
            with ExpertCache(lay, src, budget_experts=4, backend="host", {kwargs}) as cache:
                cache.select(5, [1, 2])
                print("reserve", cache.classes()[0].cap_experts)
    print("done")
"""


def _child(monkeypatch, env: dict, code: str = CHILD, kwargs: str = ""):
    """``code`` in a child process that inherits ``env`` (set here for this test only)."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return run_child(code.format(kwargs=kwargs))


@pytest.mark.parametrize(
    "name, value",
    [("EXPCACHE_RESERVE_GB", "lots"), ("EXPCACHE_VERBOSE", "maybe"), ("EXPCACHE_STAGING_COPY", "avx2")],
)
def test_a_malformed_variable_is_ignored_with_one_warning(monkeypatch, name, value):
    out = _child(monkeypatch, {name: value})
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("reserve") == 2 and "done" in out.stdout
    lines = [line for line in out.stderr.splitlines() if f'{name}="{value}" is not' in line]
    assert len(lines) == 1 and lines[0].endswith("; ignored"), out.stderr


def test_an_override_of_an_explicit_value_is_logged_once(monkeypatch):
    out = _child(monkeypatch, {"EXPCACHE_RESERVE_GB": "0"}, kwargs="reserve_bytes=12345")
    assert out.returncode == 0, out.stderr
    lines = [line for line in out.stderr.splitlines() if "overrides the reserve_bytes the caller set" in line]
    assert len(lines) == 1 and "(12345 B)" in lines[0] and "keeps 0 B free" in lines[0], out.stderr


def test_an_override_of_the_default_is_quiet(monkeypatch):
    out = _child(monkeypatch, {"EXPCACHE_RESERVE_GB": "0"})
    assert out.returncode == 0, out.stderr
    assert "overrides" not in out.stderr


def test_ignore_reads_no_variable(monkeypatch):
    """environment="ignore": a malformed variable says nothing, a good one changes nothing (the
    1 MiB device keeps the 512 KiB reserve the caller gave: no slot fits beside it)."""
    code = """
        from pyexpcache import ExpertCache, HostSource, ModelLayout
        lay = ModelLayout.preset("q2", scale=4096)
        with HostSource(lay) as src:
            for env in ("read", "ignore"):
                with ExpertCache(lay, src, budget_experts=64, backend="host", log_level=1, environment=env,
                                 device_capacity_bytes=1 << 20, reserve_bytes=(1 << 20) - 2304 * 3) as cache:
                    cache.select(5, list(range(8)))
                    print(env, cache.classes()[0].cap_experts)
    """
    out = _child(monkeypatch, {"EXPCACHE_RESERVE_GB": "0", "EXPCACHE_VERBOSE": "maybe"}, code)
    assert out.returncode == 0, out.stderr
    caps = dict(line.split() for line in out.stdout.splitlines())
    assert int(caps["ignore"]) == 3 and int(caps["read"]) > 3, out.stdout
    assert out.stderr.count("EXPCACHE_VERBOSE") == 1  # the "read" cache's warning only


def test_an_unknown_environment_is_refused():
    layout = ModelLayout.preset("q2", scale=SCALE)
    with HostSource(layout) as src:
        with pytest.raises(ValueError, match="environment must be one of"):
            ExpertCache(layout, src, budget_experts=4, backend="host", environment="sometimes")
