"""Networks only, mlx-lm style: the DFlash drafts, the target wrapper, their caches."""
