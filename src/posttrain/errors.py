"""Errors a user can act on.

Every error here carries a one-line message that names the problem and the
fix; the CLI prints it without a traceback and exits non-zero.
"""


class PosttrainError(Exception):
    """Base class: an error caused by the user's input, not by a bug."""


class ConfigError(PosttrainError):
    """A config key or value is wrong."""


class DataError(PosttrainError):
    """A dataset file is missing, unreadable, or not of the expected schema."""


class ModelError(PosttrainError):
    """A model directory is missing or incomplete."""


class RewardError(PosttrainError):
    """A reward function cannot be loaded."""


class CheckpointError(PosttrainError):
    """A checkpoint cannot be written, read or resumed from."""


class Preempted(PosttrainError):
    """The run was asked to stop (SIGTERM/SIGINT) and saved a checkpoint."""


class NonfiniteError(PosttrainError):
    """Too many steps in a row had a NaN or inf; the last good state was saved."""
