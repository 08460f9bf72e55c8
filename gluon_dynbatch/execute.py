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
import operator
import time

import mxnet as mx
import numpy as np

from .graph import DONE, LazyValue
from .lower import step_program

__all__ = ['run_plan', 'run_step', 'collect', 'gather_rows', 'pad_leaves', 'to_device',
           'ZeroRow']

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
    shorter signature of the same family get their lists padded with zero
    rows (see ``DynBatchBlock(pad_lists=True)``)."""
    sig, nodes = step.sig, step.nodes
    zeros = {}

    def zero_row(item):
        if item not in zeros:
            zeros[item] = ZeroRow(sig.item_shape(item), sig.key[-2], ctx)
        return zeros[item]
    rows = [node.leaves if node.sig is sig else
            pad_leaves(node.sig.fmt, node.leaves, sig.fmt, zero_row)
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
        source, index = collect(leaves, ctx)
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


class ZeroRow:
    """A padding element of a list argument: reads like a lazy value whose
    producer holds a single zero row (made once per padded argument)."""
    __slots__ = ('_node', '_index', 'arrays', 'row')

    def __init__(self, shape, dtype, ctx):
        self._node, self._index, self.row = self, 0, 0
        self.arrays = [mx.nd.zeros(shape, ctx=ctx, dtype=dtype)]


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


def collect(leaves, ctx):
    """``(source, index)`` such that row ``i`` of ``source[index]`` is
    ``leaves[i]``; ``index`` is None when ``source`` already is that.  The
    source is the one array the rows live in, or the concatenation of the
    several (earlier steps' outputs, user NDArrays, zero rows for padding).

    This runs over every argument row of a flush, so the common case (every
    leaf a computed lazy value or a padding row) is a few comprehensions."""
    first = leaves[0]
    if isinstance(first, np.ndarray) and all(isinstance(x, np.ndarray) for x in leaves):
        return to_device(np.concatenate(leaves), ctx), None
    try:
        arrays = [leaf._node.arrays[leaf._index] for leaf in leaves]
        rows = [leaf._node.row for leaf in leaves]
    except AttributeError:      # user NDArrays or host rows among the lazy values
        arrays, rows = [], []
        for leaf in leaves:
            if type(leaf) is LazyValue or type(leaf) is ZeroRow:
                arrays.append(leaf._node.arrays[leaf._index])
                rows.append(leaf._node.row)
            else:
                arrays.append(to_device(leaf, ctx) if isinstance(leaf, np.ndarray) else leaf)
                rows.append(0)
    return gather_rows(arrays, rows)


def gather_rows(arrays, rows):
    """``(source, index)`` for the rows ``rows[i]`` of ``arrays[i]``: the
    distinct arrays concatenated (in order of first use) and each row's
    position there; ``index`` is None when that is ``0, 1, 2, ...``."""
    keys = list(map(id, arrays))
    distinct = dict(zip(keys, arrays))
    if len(distinct) == 1:
        source = arrays[0]
        index = rows
    else:
        offsets, offset = {}, 0
        for key, array in distinct.items():
            offsets[key] = offset
            offset += array.shape[0]
        source = mx.nd.concat(*distinct.values(), dim=0)
        index = list(map(operator.add, map(offsets.__getitem__, keys), rows))
    if index[0] == 0 and index[-1] == len(index) - 1 and source.shape[0] == len(index) \
            and index == list(range(len(index))):
        index = None
    return source, index


def to_device(host, ctx):
    """Copy a numpy array into a new NDArray on ``ctx`` (``mx.nd.array``
    without its per-call type checks, which cost more than the copy)."""
    array = mx.nd.empty(host.shape, ctx=ctx, dtype=host.dtype)
    array._sync_copyfrom(host)
    return array
