"""One family of errors, each naming the block, the argument and the shapes
involved, and saying what to do."""

__all__ = ['DynBatchError', 'ScopeError', 'LazyValueError', 'InputError']


class DynBatchError(Exception):
    """Base class of every error gluon_dynbatch raises on purpose."""


class ScopeError(DynBatchError):
    """A ``batching()`` scope was misused (nested scopes, say)."""


class LazyValueError(DynBatchError):
    """A lazy result was used after the scope that recorded it failed."""


class InputError(DynBatchError):
    """A recorded call got arguments its block cannot take: a non-array,
    mixed contexts or dtypes, a missing batch axis, or shapes that contradict
    the block's parameters."""
