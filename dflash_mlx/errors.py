"""Typed errors. Each message says what went wrong and what the user can do about it."""


class DFlashError(Exception):
    """Base class: the CLI prints the message on one line and exits with code 2."""


class ConfigError(DFlashError):
    """A draft or target config.json is missing a field or holds an invalid value."""


class CheckpointError(DFlashError):
    """Weights are missing, corrupt, truncated or do not match the config."""


class PairMismatchError(DFlashError):
    """The draft cannot serve this target (hidden size, vocabulary, layer ids)."""


class ModelNotFoundError(DFlashError):
    """A model name, path or repository could not be resolved or downloaded."""


class InvalidArgumentError(DFlashError):
    """A generation setting is out of range (block size, temperature, prompt...)."""


class TrainingDataError(DFlashError, ValueError):
    """Features too few or too short to train a draft on."""


class SpeculationUnsupportedError(DFlashError):
    """The target keeps a cache the engine cannot roll back exactly: only plain AR can run."""


class TrainingStoppedError(DFlashError):
    """Training stopped before its last step (a NaN loss, a full disk); the last good
    checkpoint, if any, is kept as it was."""
