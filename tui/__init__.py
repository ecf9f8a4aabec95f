"""Textual chat app for dflash-mlx: streams accepted tokens and shows what speculation does."""
