"""Run a :class:`~gluon_dynbatch.plan.Plan`: per step, find where each
argument's rows live, call the step's compiled program (gathers + block, see
:mod:`gluon_dynbatch.lower`) once, and note where each node's rows landed.

Rows are read by index from earlier steps' batched outputs (concatenated when
they come from several), so no per-node arrays are made.  Host data (numpy
leaves such as token ids) is concatenated in numpy and sent to the device once
per argument.  Every op here is an ordinary recorded NDArray op or CachedOp
call, so ``autograd`` sees the batched execution and ``backward()`` reaches
the parameters and any user NDArrays fed in.
"""
import time

import mxnet as mx
import numpy as np

from .graph import DONE, LazyValue
from .lower import step_program

__all__ = ['run_plan', 'run_step', 'collect', 'pad_leaves', 'to_device', 'ZERO']

NDArray = mx.nd.NDArray


def run_plan(plan):
    """Execute every step of ``plan`` in order; return each step's seconds
    (exact under NaiveEngine; with a threaded engine only launch time)."""
    seconds = []
    clock = time.perf_counter
    for step in plan.steps:
        start = clock()
        run_step(step, step.sig.ctx)
        seconds.append(clock() - start)
    return seconds


def run_step(step, ctx):
    """One batched call of ``step.sig`` over ``step.nodes``.  Nodes of a
    shorter signature of the same family get their lists padded with
    :data:`ZERO` rows (see ``DynBatchBlock(pad_lists=True)``)."""
    sig, nodes = step.sig, step.nodes
    rows = [node.leaves if node.sig is sig else
            pad_leaves(node.sig.fmt, node.leaves, sig.fmt, lambda item: ZERO)
            for node in nodes]
    pattern, sources, indices = [], {}, {}
    pos = 0
    for item, fmt in enumerate(sig.fmt):
        width = 1 if fmt == 0 else len(fmt)
        if width == 0:
            pattern.append('direct')
            continue
        if width == 1:
            leaves = [leaves[pos] for leaves in rows]
        else:
            leaves = [leaf for leaves in rows for leaf in leaves[pos:pos + width]]
        source, index = collect(leaves, ctx, sig.in_shapes[pos])
        pos += width
        sources[item] = source
        if index is None and fmt == 0:
            pattern.append('direct')
        else:
            pattern.append('take')
            if index is None:
                index = range(len(leaves))
            indices[item] = to_device(np.asarray(index, dtype='int32').reshape(
                (len(nodes), -1) if fmt != 0 else (-1,)), ctx)
    program = step_program(sig, tuple(pattern))
    inputs = [sources[item] if kind == 'src' else indices[item] if kind == 'idx'
              else item.data(ctx) for kind, item in program.feeds]
    outputs = program.cached_op(*inputs)
    if isinstance(outputs, NDArray):
        outputs = [outputs]
    for row, node in enumerate(nodes):
        node.arrays = outputs
        node.row = row
        node.state = DONE
        node.leaves = None  # drop references to inputs as soon as possible


ZERO = object()
"""Stands for a zero row in a padded list argument."""


def pad_leaves(fmt, leaves, padded_fmt, filler):
    """Leaves of a call with nesting ``fmt`` laid out for the longer lists of
    ``padded_fmt``; ``filler(item)`` fills the missing elements of top-level
    argument ``item``."""
    out, pos = [], 0
    for item, (short, long) in enumerate(zip(fmt, padded_fmt)):
        width = 1 if short == 0 else len(short)
        out += leaves[pos:pos + width]
        pos += width
        if short != 0:
            out += [filler(item) for _ in range(len(long) - len(short))]
    return out


def collect(leaves, ctx, shape):
    """``(source, index)`` such that row ``i`` of ``source[index]`` is
    ``leaves[i]``; ``index`` is None when ``source`` already is that.  The
    source is the one array the rows live in, or the concatenation of the
    several (earlier steps' outputs, user NDArrays, a zero row for padding)."""
    first = leaves[0]
    if isinstance(first, np.ndarray) and all(isinstance(x, np.ndarray) for x in leaves):
        return to_device(np.concatenate(leaves), ctx), None
    sources, positions, index = [], {}, []
    offset = 0
    zero = None
    for leaf in leaves:
        if type(leaf) is LazyValue:
            array, row = leaf._node.arrays[leaf._index], leaf._node.row
        elif leaf is ZERO:
            if zero is None:
                zero = mx.nd.zeros(shape, ctx=ctx, dtype=first_dtype(leaves))
            array, row = zero, 0
        elif isinstance(leaf, np.ndarray):
            array, row = to_device(leaf, ctx), 0
        else:
            array, row = leaf, 0
        start = positions.get(id(array))
        if start is None:
            start = positions[id(array)] = offset
            sources.append(array)
            offset += array.shape[0]
        index.append(start + row)
    source = sources[0] if len(sources) == 1 else mx.nd.concat(*sources, dim=0)
    identity = offset == len(leaves) and index == list(range(offset))
    return source, None if identity else index


def first_dtype(leaves):
    for leaf in leaves:
        if leaf is not ZERO:
            return leaf.dtype
    return np.float32


def to_device(host, ctx):
    """Copy a numpy array into a new NDArray on ``ctx`` (``mx.nd.array``
    without its per-call type checks, which cost more than the copy)."""
    array = mx.nd.empty(host.shape, ctx=ctx, dtype=host.dtype)
    array._sync_copyfrom(host)
    return array
