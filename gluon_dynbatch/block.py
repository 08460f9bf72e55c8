"""The user-facing pieces: :class:`DynBatchBlock` and the :func:`batching`
scope.

Inside a scope, calling a wrapped block records one :class:`~.graph.Node`
and returns lazy results; nothing is computed.  The scope runs what was
recorded, batched, when it exits or when a lazy value is read.  Outside any
scope a wrapped block is just the block it wraps.
"""
import itertools
import threading
import time
from contextlib import contextmanager

import mxnet as mx
import numpy as np
from mxnet.gluon import Block

from . import debug
from .errors import InputError, ScopeError
from .execute import run_plan
from .graph import FAILED, PENDING, LazyValue, Node
from .plan import STRATEGIES, ByDepth
from .trace import flatten, regroup, trace_signature

__all__ = ['DynBatchBlock', 'batching', 'current_scope']

NDArray = mx.nd.NDArray
_LOCAL = threading.local()
_SIG_IDS = itertools.count()


def current_scope():
    """The open :class:`BatchingScope` of this thread, or None."""
    return getattr(_LOCAL, 'scope', None)


class BatchingScope:
    """Holds the calls recorded since the last flush, and runs them."""

    def __init__(self, strategy):
        self.strategy = strategy
        self.pending = []
        self.record_s = 0.0

    def record(self, dblock, args):
        """Record one call of ``dblock``; return its lazy result(s)."""
        start = time.perf_counter()
        leaves = []
        fmt = flatten(args, leaves)
        key, ctx, depth = _signature_key(dblock, fmt, leaves, self)
        sig = dblock._signatures.get(key)
        if sig is None:
            sig = dblock._trace(key, fmt, leaves, ctx)
        node = Node(sig, leaves, depth, self)
        outputs = [LazyValue(node, i, shape, dtype, ctx)
                   for i, (shape, dtype) in enumerate(zip(sig.out_shapes, sig.out_dtypes))]
        node.outputs = outputs
        self.pending.append(node)
        self.record_s += time.perf_counter() - start
        if sig.out_fmt == 0:
            return outputs[0]
        return tuple(regroup(sig.out_fmt, outputs)[0])

    def flush(self):
        """Plan and run every pending call."""
        if not self.pending:
            return
        nodes, self.pending = self.pending, []
        record_ms, self.record_s = self.record_s * 1e3, 0.0
        try:
            start = time.perf_counter()
            plan = self.strategy.plan(nodes)
            planned = time.perf_counter()
            run_plan(plan, lambda step: step.sig.ctx)
            done = time.perf_counter()
        except BaseException:
            _fail(nodes)
            raise
        debug.record_flush(plan, record_ms, (planned - start) * 1e3, (done - planned) * 1e3)

    def abandon(self):
        _fail(self.pending)
        self.pending = []


def _fail(nodes):
    for node in nodes:
        if node.state == PENDING:
            node.state = FAILED


@contextmanager
def batching(strategy='depth'):
    """Record wrapped-block calls in this scope and run them batched.

    Parameters
    ----------
    strategy : str or Strategy
        How to group calls: ``'depth'`` (default), ``'agenda'`` or
        ``'per-sample'`` (see :mod:`gluon_dynbatch.plan`).

    One scope per minibatch.  On normal exit everything recorded is run; if
    the body raises, what was recorded is dropped (its lazy values raise
    :class:`~.errors.LazyValueError` when read) and the next scope starts
    clean.  Scopes do not nest.
    """
    if current_scope() is not None:
        raise ScopeError('batching() scopes do not nest: a scope is already open in this '
                         'thread. Close it first, or record everything in the outer scope.')
    if isinstance(strategy, str):
        if strategy not in STRATEGIES:
            raise ScopeError('unknown strategy %r; choose one of %s'
                             % (strategy, sorted(STRATEGIES)))
        strategy = STRATEGIES[strategy]()
    scope = BatchingScope(strategy)
    _LOCAL.scope = scope
    try:
        yield scope
    except BaseException:
        scope.abandon()
        raise
    else:
        scope.flush()
    finally:
        _LOCAL.scope = None


def _signature_key(dblock, fmt, leaves, scope):
    """(signature key, context, depth) of a call; checks the leaves."""
    key = [fmt]
    ctx = dtype = None
    depth = 0
    for pos, leaf in enumerate(leaves):
        if type(leaf) is LazyValue:
            node = leaf._node
            if node.state != 1:  # not DONE
                if node.state == FAILED:
                    leaf.data  # raises LazyValueError with the details
                depth = max(depth, node.depth + 1)
            shape, leaf_dtype, leaf_ctx = leaf.shape, leaf.dtype, leaf.context
        elif isinstance(leaf, NDArray):
            shape, leaf_dtype, leaf_ctx = leaf.shape, leaf.dtype, leaf.context
        elif isinstance(leaf, np.ndarray):
            shape, leaf_dtype, leaf_ctx = leaf.shape, leaf.dtype.type, None
        else:
            raise InputError('block %s, argument %s: got %s, expected an NDArray, a lazy '
                             'value or a numpy array (per-sample, leading axis of 1).'
                             % (dblock.block.name, _leaf_path(fmt, pos), type(leaf).__name__))
        if leaf_ctx is not None and ctx != leaf_ctx:
            if ctx is not None:
                raise InputError('block %s, argument %s is on %s but earlier arguments are on '
                                 '%s; move all arguments of a call to one context.'
                                 % (dblock.block.name, _leaf_path(fmt, pos), leaf_ctx, ctx))
            ctx = leaf_ctx
        if leaf_dtype != dtype:
            if dtype is not None:
                raise InputError('block %s, argument %s has dtype %s but earlier arguments have '
                                 '%s; cast them to one dtype (token ids as float32, as MXNet\'s '
                                 'Embedding expects).' % (dblock.block.name, _leaf_path(fmt, pos),
                                                          np.dtype(leaf_dtype).name,
                                                          np.dtype(dtype).name))
            dtype = leaf_dtype
        key.append(shape)
    key.append(dtype)
    if ctx is None:
        ctx = mx.current_context()
    key.append(ctx)
    return tuple(key), ctx, depth


def _leaf_path(fmt, index):
    """Human name of flat leaf ``index`` in nesting ``fmt``, e.g. ``#2[1]``."""
    counter = itertools.count()
    def walk(items, prefix):
        for i, item in enumerate(items):
            name = '%s[%d]' % (prefix, i) if prefix else '#%d' % i
            if item == 0:
                if next(counter) == index:
                    return name
            else:
                found = walk(item, name)
                if found:
                    return found
        return None
    return walk(fmt, '') or '#%d' % index


def _materialize(args):
    """Arguments for the wrapped block outside a scope: lazy values become
    their NDArrays and host numpy arrays become NDArrays."""
    out = []
    for arg in args:
        if isinstance(arg, (list, tuple)):
            out.append(type(arg)(_materialize(arg)))
        elif type(arg) is LazyValue:
            out.append(arg.data)
        elif isinstance(arg, np.ndarray):
            out.append(mx.nd.array(arg, dtype=arg.dtype))
        else:
            out.append(arg)
    return out


class DynBatchBlock(Block):
    """Wrap a Gluon ``HybridBlock`` so that per-sample calls inside a
    :func:`batching` scope are recorded and run batched.

    Parameters are the wrapped block's own: ``collect_params``,
    ``initialize``, ``save_parameters`` and ``load_parameters`` act on it
    with the same names, so files move freely between the two.
    """

    def __init__(self, block, prefix=None):
        if not isinstance(block, mx.gluon.HybridBlock):
            raise InputError('DynBatchBlock wraps a gluon HybridBlock (it traces the block\'s '
                             'hybrid_forward symbolically); got %s.' % type(block).__name__)
        super().__init__(prefix=prefix)
        self.block = block
        self._signatures = {}

    def __call__(self, *args):
        scope = current_scope()
        if scope is None:
            return self.block(*_materialize(args))
        return scope.record(self, args)

    def forward(self, *args):  # pylint: disable=arguments-differ
        return self.block(*_materialize(args))

    def _trace(self, key, fmt, leaves, ctx):
        shapes = key[1:-2]
        dtypes = [key[-2]] * len(shapes)
        for pos, shape in enumerate(shapes):
            if not shape or shape[0] != 1:
                raise InputError(
                    'block %s, argument %s has shape %s: per-sample inputs need a leading batch '
                    'axis of 1 (use x[i:i+1] or x.reshape((1,) + x.shape)).'
                    % (self.block.name, _leaf_path(fmt, pos), shape))
        with ctx:
            sig = trace_signature(next(_SIG_IDS), self.block, fmt, shapes, dtypes)
        sig.ctx = ctx
        self._signatures[key] = sig
        return sig

    def signatures(self):
        """Traced signatures so far (one per distinct call signature)."""
        return list(self._signatures.values())

    def collect_params(self, select=None):
        return self.block.collect_params(select)

    def _collect_params_with_prefix(self, prefix=''):
        return self.block._collect_params_with_prefix(prefix)

    def hybridize(self, active=True, **kwargs):
        self.block.hybridize(active, **kwargs)

    def __repr__(self):
        return 'DynBatchBlock(%r)' % (self.block,)
