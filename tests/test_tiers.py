"""The tiers (tests/conftest.py, docs/development.md "Test tiers"): a test without a tier marker, or with two, stops
the whole run at collection, naming it; `-m` then selects tiers exactly. Run in a scratch pytest session with this
suite's conftest and markers."""
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]
pytestmark = pytest.mark.unit

HERE = Path(__file__).parent
INI = """[pytest]
addopts = --strict-markers
markers =
    unit: u
    integration: i
    validation: v
    numerics: n
"""


@pytest.fixture
def scratch(pytester):
    pytester.makeconftest((HERE / "conftest.py").read_text())
    pytester.makeini(INI)
    return pytester


def test_a_test_without_a_tier_stops_the_run_naming_it(scratch):
    scratch.makepyfile(test_x="""
import pytest

@pytest.mark.unit
def test_tiered():
    pass

def test_untiered():
    pass

@pytest.mark.unit
@pytest.mark.integration
def test_twice():
    pass
""")
    res = scratch.runpytest_inprocess("-m", "unit")
    assert res.ret != 0
    text = res.stdout.str() + res.stderr.str()
    assert "test_x.py::test_untiered: no tier" in text and "test_x.py::test_twice: integration, unit" in text
    assert "test_tiered" not in text.split("every test needs")[1]


def test_tiers_select_exactly_and_numerics_is_added_to_a_tier(scratch):
    scratch.makepyfile(test_y="""
import pytest

pytestmark = pytest.mark.unit

def test_a():
    pass

@pytest.mark.numerics
def test_b():
    pass
""", test_z="""
import pytest

@pytest.mark.validation
def test_c():
    pass
""")
    scratch.runpytest_inprocess("-m", "unit").assert_outcomes(passed=2)
    scratch.runpytest_inprocess("-m", "numerics").assert_outcomes(passed=1)
    scratch.runpytest_inprocess("-m", "validation").assert_outcomes(passed=1)
    scratch.runpytest_inprocess("-m", "unknown_tier").assert_outcomes()
    assert scratch.runpytest_inprocess("-m", "unit", "-p", "no:cacheprovider").ret == 0
