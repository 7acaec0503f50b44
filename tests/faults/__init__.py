"""Fault-injection tests of issue #13 (a package, so its test_*.py names do not clash with tests/)."""
