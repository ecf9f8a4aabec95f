"""The benchmark: DFlash against plain AR on the same target, and the bundled prompt sets."""
