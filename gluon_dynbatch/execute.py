"""Run a :class:`~gluon_dynbatch.plan.Plan`: per step, gather each input slot
into one batched array, call the signature's CachedOp once, and note where
each node's rows landed.

Gathering reads rows by index from earlier steps' batched outputs (one
``take`` per slot, over a ``concat`` when rows come from several steps), so
no per-node arrays are made.  Host data (numpy leaves such as token ids) is
concatenated in numpy and sent to the device once per slot.  Every op here is
an ordinary recorded NDArray op, so ``autograd`` sees the batched execution
and ``backward()`` reaches the parameters and any user NDArrays fed in.
"""
import mxnet as mx
import numpy as np

from .graph import DONE, LazyValue

__all__ = ['run_plan', 'run_step', 'gather', 'to_device']

NDArray = mx.nd.NDArray


def run_plan(plan, ctx_of):
    """Execute every step of ``plan`` in order."""
    for step in plan.steps:
        run_step(step, ctx_of(step))


def run_step(step, ctx):
    """One batched call of ``step.sig`` over ``step.nodes``."""
    sig, nodes = step.sig, step.nodes
    inputs = [None] * len(sig.input_names)
    for j, slot in enumerate(sig.data_slots):
        inputs[slot] = gather([node.leaves[j] for node in nodes], ctx)
    for slot, param in sig.param_slots:
        inputs[slot] = param.data(ctx)
    outputs = sig.cached_op(*inputs)
    if isinstance(outputs, NDArray):
        outputs = [outputs]
    for row, node in enumerate(nodes):
        node.arrays = outputs
        node.row = row
        node.state = DONE
        node.leaves = None  # drop references to inputs as soon as possible


def gather(leaves, ctx):
    """One batched NDArray whose row ``i`` is ``leaves[i]``."""
    first = leaves[0]
    if isinstance(first, np.ndarray) and all(isinstance(x, np.ndarray) for x in leaves):
        return to_device(np.concatenate(leaves), ctx)
    sources, positions, index = [], {}, []
    offset = 0
    for leaf in leaves:
        if type(leaf) is LazyValue:
            array, row = leaf._node.arrays[leaf._index], leaf._node.row
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
    identity = offset == len(leaves) and index == list(range(offset))
    if len(sources) == 1:
        return sources[0] if identity else _take(sources[0], index, ctx)
    joined = mx.nd.concat(*sources, dim=0)
    return joined if identity else _take(joined, index, ctx)


def _take(array, index, ctx):
    return mx.nd.take(array, to_device(np.asarray(index, dtype='int32'), ctx))


def to_device(host, ctx):
    """Copy a numpy array into a new NDArray on ``ctx`` (``mx.nd.array``
    without its per-call type checks, which cost more than the copy)."""
    array = mx.nd.empty(host.shape, ctx=ctx, dtype=host.dtype)
    array._sync_copyfrom(host)
    return array
