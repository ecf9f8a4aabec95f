"""The trainer's settings (`TrainConfig`): schedule, batch shape, evaluation, head and soft labels.

Its own module so the held-out scoring (`eval`) reads it without importing the trainer.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TrainConfig:
    steps: int = 2000
    lr: float = 6e-4
    warmup: int = 100
    weight_decay: float = 0.01
    seqs_per_step: int = 2
    anchors_per_seq: int = 24
    decay: float = 4.0  # position weight exp(-(i-1)/decay) for slot i
    grad_clip: float = 1.0
    eval_every: int = 100
    eval_blocks: int = 512
    eval_block_size: int = 5
    checkpoint_every: int = 200
    seed: int = 0
    # >0: train through the restricted proposal head (the `head_vocab` ids most often
    # predicted in the training data), the head the draft uses at inference
    head_vocab: int = 0
    # the proposal ids to train through instead of choosing them from the data: a fine-tune on
    # a small new set keeps the head its starting draft was trained with
    head_ids: list[int] | None = None
    # >0: weight of the soft-label term, cross-entropy against the target's whole distribution
    # rebuilt from the deepest tap (soft.py); the rest stays on the argmax labels
    soft_labels: float = 0.0
    # >0: end training after this many minutes: the step count (and so the cosine schedule)
    # is cut to what fits, timed on the first steps and re-fitted at each evaluation
    minutes: float = 0.0
