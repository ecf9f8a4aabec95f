"""Helpers shared by the tests (and a few scripts): import them as `support.<module>`."""
