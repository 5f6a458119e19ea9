"""Helpers shared by tests and benches (importable as `tests.support`; not test modules themselves)."""
