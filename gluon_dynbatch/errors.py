"""One family of errors, each naming the block, the argument and the shapes
involved, and saying what to do."""
import contextlib
import os
import sys

__all__ = ['DynBatchError', 'ScopeError', 'LazyValueError', 'InputError', 'PerSampleWarning',
           'FreedGraphWarning', 'StatefulBlockWarning', 'ManySignaturesWarning']


class DynBatchError(Exception):
    """Base class of every error gluon_dynbatch raises on purpose about
    scopes, recorded calls and lazy values.  (Bad constructor arguments of
    ``CostModel``, ``Auto``, ``CachedPlan`` and ``FusedAdaGrad`` are a
    ValueError, misuse of ``register_batching_rule`` a TypeError or
    ValueError, NDArray operations on a lazy value a TypeError.)"""


class ScopeError(DynBatchError):
    """A ``batching()`` scope was misused: nested scopes, an unknown
    strategy, a bad ``flush_every`` or ``merge_repeats``, a plan of a
    user's strategy that does not run each call once, after the calls it
    reads, MXNet's numpy interface active, or a value read that is pending
    in another thread's scope."""


class LazyValueError(DynBatchError):
    """A lazy result was used after the scope that recorded it failed."""


class InputError(DynBatchError):
    """A recorded call got arguments its block cannot take (a non-array,
    keyword arguments, mixed contexts, dtypes its ops cannot take together,
    a missing batch axis, a list of arrays of different shapes or dtypes,
    shapes that contradict the block's parameters), or the block cannot be
    batched as written (it does not trace, an output lacks the batch axis, a
    ``pad_lists`` claim fails its check); ``concat_rows`` misused."""


class PerSampleWarning(UserWarning):
    """A block's calls run one at a time (correct, but unbatched): its graph
    has an op without a batching rule, or one used in a way that mixes the
    samples.  Warned once per block, with the reason; see
    :func:`~gluon_dynbatch.register_batching_rule` for ops that do act row
    by row, and ``warnings.filterwarnings('ignore',
    category=PerSampleWarning)`` for blocks meant to run so."""


class FreedGraphWarning(UserWarning):
    """A training flush read rows of an earlier one whose autograd graph a
    ``backward()`` (without ``retain_graph=True``) has freed, so no
    gradient flows through them into the calls that made them.  One step
    holds the rows of many calls, so ``backward()`` on one sample's loss
    frees them for every sample, where per sample only that sample's graph
    is freed.  Sum the losses and call ``backward()`` once (or pass
    ``retain_graph=True``); where the gradient is meant to stop there
    (truncated backpropagation), pass ``value.data.detach()`` instead of
    the value, which also silences the warning."""


class StatefulBlockWarning(UserWarning):
    """A block kept a value of its trace in a Python attribute (Gluon's
    ``ZoneoutCell`` keeps its previous output, ``VariationalDropoutCell``
    its dropout masks), state meant to carry from one call to the next.  A
    block's Python code runs once per signature, when it is traced, so
    batched calls never see that state: each computes as the first call of
    a sequence would (zoneout copies zeros, every step draws a new mask).
    Pass such state as an argument and return it as an output instead."""


class ManySignaturesWarning(UserWarning):
    """A wrapper traced :data:`~gluon_dynbatch.block.MANY_SIGNATURES`
    signatures, one per distinct combination of its arguments' shapes,
    dtypes, list lengths and context.  Each keeps its symbol and compiled
    programs for the wrapper's life (~0.1 MB for a small block) and took
    milliseconds to trace, so a process whose calls meet ever new shapes
    (free sequence lengths or image sizes passed as one array) grows
    without bound.  Pad such arguments to a few sizes, pass rows as a list
    to a ``pad_lists`` block, or drop the signatures now and then with
    :meth:`~gluon_dynbatch.DynBatchBlock.forget_signatures`."""


_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep
_CONTEXTLIB = contextlib.__file__


def user_stacklevel():
    """``stacklevel`` for a warning given here that points at the user's
    line: the first frame outside gluon_dynbatch (the C recorder adds no
    frame of its own, the Python one adds two) and ``contextlib`` (a
    scope's ``with`` that runs the flush)."""
    frame, level = sys._getframe(1), 1    # pylint: disable=protected-access
    while _ours(frame):
        frame, level = frame.f_back, level + 1
    return level


def user_line():
    """``(file, line)`` of the user's line that :func:`user_stacklevel`
    points at, or None."""
    frame = sys._getframe(1)    # pylint: disable=protected-access
    while _ours(frame):
        frame = frame.f_back
    return None if frame is None else (frame.f_code.co_filename, frame.f_lineno)


def _ours(frame):
    return frame is not None and (frame.f_code.co_filename.startswith(_PACKAGE) or
                                  frame.f_code.co_filename == _CONTEXTLIB)
