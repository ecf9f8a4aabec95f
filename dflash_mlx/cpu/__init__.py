"""What exists only for CPU devices: the BLAS preload, the dense-weights policy, the verify-cost curve."""
