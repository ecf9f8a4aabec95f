"""The draft trainer: features from the target, block sampling, the training loop, held-out scoring."""
