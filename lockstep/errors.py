"""What a user must fix: each error's message says the value received, the rule, and the fix.

The CLI catches these and prints the message alone (no traceback); anything else is lockstep's own bug
or the environment's, and keeps its traceback.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration the user must change: the message says the value, the rule and the fix."""


class DataError(ValueError):
    """Data the user must change: the message says the value, the rule and the fix."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: the message says which, why, and what to do instead."""


class UnusedParameterError(ConfigError):
    """DDP was told every parameter gets a gradient, and a micro-batch's loss left one out."""


class GradientDivergence(RuntimeError):
    """`parallel.check_grads`: ranks hold different gradients after the all-reduce."""


class GradientOverflow(RuntimeError):
    """`parallel.grad_compression: fp16`: a gradient too large for float16 came back inf from the all-reduce."""
