"""The conftest fixture that keeps the SPINFER_* overrides from leaking between tests: a test that
sets one without monkeypatch fails at teardown; one that sets it through monkeypatch passes."""

from pathlib import Path

pytest_plugins = "pytester"


def test_a_leaked_override_fails_the_test_that_leaked_it(pytester):
    pytester.makeconftest(Path(__file__).with_name("conftest.py").read_text())
    pytester.makepyfile(
        """
        import os

        def test_leaks():
            os.environ["SPINFER_DECODE"] = "safe"

        def test_restores(monkeypatch):
            monkeypatch.setenv("SPINFER_DECODE", "safe")
            monkeypatch.delenv("SPINFER_CACHE", raising=False)
        """
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=2, errors=1)
    result.stdout.fnmatch_lines(["*the test changed the SPINFER_* environment*SPINFER_DECODE*"])
