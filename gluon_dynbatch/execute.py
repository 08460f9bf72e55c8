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
import ctypes
import operator
import os
import threading
import time
import warnings

import mxnet as mx
import numpy as np
from mxnet.base import _LIB, NDArrayHandle, SymbolHandle, check_call, mx_uint
from mxnet.ndarray.ndarray import _DTYPE_NP_TO_MX, DLDataType, _int64_enabled

from . import accel
from .errors import FreedGraphWarning, InputError, user_stacklevel
from .graph import DONE, LazyValue
from .lanes import PADDED, SEGMENT
from .lower import (element_major, embedding_reads, host_part, host_split,
                    step_program)
from .trace import error_line

__all__ = ['run_plan', 'run_step', 'FlushTables', 'FlushHoist', 'collect', 'gather_rows',
           'pad_leaves', 'to_device', 'threaded_engine', 'ZeroRow', 'GradFree', 'grad_free',
           'RecordedOutput', 'OutputRows', 'FreedRows', 'rows_of',
           'flush_hoists',
           'RaggedInputs']

NDArray = mx.nd.NDArray


def run_plan(plan, wait=False, after_step=None):
    """Execute every step of ``plan`` in order; return each step's seconds
    (exact under NaiveEngine; with a threaded engine only launch time,
    unless ``wait``: then each step waits for its ops to finish, which
    costs the overlap of Python with the ops but times them).

    A plan that carries ``recipes`` (a cached plan: same structure as an
    earlier flush) runs each step from its recipe where one is known, with
    no per-row Python work, and fills in the recipes of steps run the long
    way.  A plan that carries a compiled ``program`` runs as one call
    (:func:`run_compiled`).  ``after_step(number, step)``, if given, is
    called once each step is launched (for a compiled plan, once with its
    last step)."""
    if plan.program is not None:
        seconds = run_compiled(plan)
        if after_step is not None:
            after_step(len(plan.steps) - 1, plan.steps[-1])
        return seconds
    seconds = []
    clock = time.perf_counter
    recipes = plan.recipes
    outputs = []                                  # per step, its output arrays
    where = {} if recipes is not None else None   # id(output) -> (step, output index)
    varied = set() if recipes is not None else None     # ids of outputs handed out per node
    # a hoisted step's outputs keep one row per call, so recipes replay with
    # it too; per-sample execution stays the unbatched baseline
    hoist = FlushHoist(plan.steps) if plan.strategy != 'per-sample' else None
    tables = FlushTables(plan.steps, hoist.groups if hoist is not None else ()) \
        if mx.autograd.is_recording() else None
    produced = [] if tables is not None else None     # training: every step's outputs
    if wait:
        mx.nd.waitall()
    for number, step in enumerate(plan.steps):
        start = clock()
        recipe = recipes[number] if recipes is not None else None
        hoisted = hoist.for_step(number) if hoist is not None else None
        outs, learned = run_step(step, step.sig.ctx, recipe, outputs, where, tables, hoisted,
                                 varied)
        if after_step is not None:
            after_step(number, step)
        if wait:
            mx.nd.waitall()
        if produced is not None:
            produced.append(outs)
        if recipes is not None:
            recipes[number] = learned
            outputs.append(outs)
            for index, array in enumerate(outs):
                where[id(array)] = (number, index)
        seconds.append(clock() - start)
    if produced is not None:
        for outs in produced:
            for out in outs:
                if type(out) is NDArray:
                    out.__class__ = RecordedOutput
    return seconds


def call_program(cached_op, inputs, signatures):
    """Call a step's (or a flush's) CachedOp; where MXNet refuses it and a
    parameter of one of ``signatures`` changed shape or dtype since that
    signature was traced (a ``cast`` of the wrapped block under pending
    calls), say so: MXNet's own error names only an operator and an input
    number."""
    try:
        return cached_op(*inputs)
    except mx.base.MXNetError as err:
        changed = changed_parameters_error(signatures, err)
        if changed is not None:
            raise changed from None
        raise


def changed_parameters_error(signatures, err):
    """The InputError for MXNet's ``err`` where a parameter of one of
    ``signatures`` changed shape or dtype since that signature was traced
    (see :func:`call_program`; the padding check runs such parameters
    too), else None."""
    for sig in signatures:
        changed = sig.changed_parameters()
        if changed:
            return InputError(
                'block %s: its recorded calls cannot run, since its parameters changed '
                'after they were traced (%s). A recorded call runs with the parameters as '
                'they are when its scope runs it: cast the block through its DynBatchBlock '
                'wrapper (whose cast() first runs the calls pending in this thread\'s '
                'scope), or close the scope (or read a value) before changing the '
                'parameters; calls made after a cast need inputs of the new dtype. MXNet '
                'said: %s' % (sig.block.name, changed, error_line(err)))
    return None


def run_compiled(plan):
    """Run a plan compiled into one :class:`~.lower.FlushProgram`: read the
    host rows of this flush (and the distinct rows of its hoisted groups),
    call it once, hand each step's outputs to its nodes.  Returns the total
    seconds spread evenly over the steps (there is no per-step time to
    measure)."""
    start = time.perf_counter()
    program, steps = plan.program, plan.steps
    ctx = program.ctx
    groups = [_HoistGroup([(number, steps[number].sig, items,
                            [host_item_rows(steps[number].nodes, item) for item in items])
                           for number, items, _ in members], 0) for members in program.hoists]
    distinct = [group.distinct(ctx) for group in groups]
    inputs = []
    for kind, what in program.feeds:
        if kind == 'param':                 # (a weak reference, see flush_program)
            inputs.append(what().data(ctx))
        elif kind == 'const':
            inputs.append(what)
        elif kind == 'hoist_rows':
            inputs.append(distinct[what[0]][what[1]])
        elif kind == 'hoist_inverse':
            inputs.append(to_device(groups[what].inverse, ctx))
        else:
            number, item = what
            rows = host_item_rows(steps[number].nodes, item)
            inputs.append(None if rows is None else to_device(rows, ctx))
    outs = call_program(program.cached_op, inputs, (step.sig for step in steps))
    if isinstance(outs, NDArray):
        outs = [outs]
    pos = 0
    finish = accel.finish_nodes or finish_nodes_py
    for step, count in zip(steps, program.out_counts):
        finish(step.nodes, outs[pos:pos + count])
        pos += count
    return [(time.perf_counter() - start) / len(steps)] * len(steps)


def run_step(step, ctx, recipe=None, outputs=None, where=None, tables=None, hoisted=None,
             varied=None):
    """One batched call of ``step.sig`` over ``step.nodes``; returns its
    output arrays and a recipe for running it again in a flush of the same
    structure (None unless ``where`` maps earlier steps' outputs).  With
    ``tables`` (a :class:`FlushTables`, when training) host indices into
    embeddings read the flush's table instead.  With ``hoisted`` (from
    :meth:`FlushHoist.for_step`) the step reads the values of its host part
    from the flush's run of it instead of computing them.

    Nodes of a shorter signature of the same family get their lists padded
    with zero rows (see ``DynBatchBlock(pad_lists=True)``).  A recipe holds,
    per argument, ``'empty'`` (an empty list), ``'host'`` (host rows:
    concatenated anew, since their values change) or the earlier steps (and
    zero rows) whose outputs hold the rows, with the gather index already
    on the device (or None when the rows are the source in order);
    arguments that read user NDArrays or earlier flushes have no recipe
    (None) and are gathered the long way every time.  ``varied`` (a set,
    with a recipe) holds the ids of this flush's outputs that some of their
    nodes hand out detached (:func:`_grad_free_by_node`): a recipe reading
    one is not followed, since its rows must come from the nodes."""
    sig, nodes = step.sig, step.nodes
    if recipe is not None and not _recipe_usable(recipe, outputs, varied):
        recipe = None
    learned = [] if where is not None else None
    pattern, sources, indices, uploads = [], {}, {}, {}
    lists, ragged = {}, None     # items gathered anew: item -> (index, distinct, zero, lengths)
    for item, (fmt, (_, width)) in enumerate(zip(sig.fmt, sig.spans)):
        how = recipe[item] if recipe is not None else None
        if width == 0:
            pattern.append(None)
            if learned is not None:
                learned.append('empty')
            continue
        if hoisted is not None and item in hoisted.items:
            pattern.append(('hoisted', 1))
            if learned is not None:
                learned.append('host')
            continue
        if learned is not None and how is not None:
            learned.append(how)
        how_ragged = None
        if how is not None and how != 'host':
            parts, index = how[:2]
            if len(how) > 2:
                # (not reset by a later argument's recipe: a list of one
                # element, gathered as a plain argument, came after a ragged
                # list and its replay crashed, 'NoneType' not subscriptable)
                how_ragged = ragged = how[2]
            sources[item] = [outputs[number][out] if number >= 0
                             else _zero_row(sig, item, ctx).arrays[0] for number, out in parts]
        elif how == 'host':
            sources[item] = [host_item_rows(nodes, item)]
            index = None
        elif fmt != 0 and width > 1:      # laid out once every list is gathered
            sources[item], index, distinct, zero, lengths = _gather_item(
                nodes, sig, item, ctx, compact=step.ragged)
            lists[item] = (index, distinct, zero, lengths)
            if learned is not None:
                learned.append(None)
            pattern.append(None)
            continue
        else:
            sources[item], index, distinct, zero, _ = _gather_item(nodes, sig, item, ctx)
            if index is None and len(sources[item]) > 2:
                # rows in order over many arrays (user NDArrays, one a call):
                # read by index, so that their count pads as below, instead
                # of a program per number of calls
                index = np.arange(len(nodes), dtype=np.int32)
            index = _upload_index(index, uploads, ctx)
            if learned is not None:
                learned.append(_recipe_part(fmt, distinct, index, where, zero))
        if index is not None and len(sources[item]) > 2:
            _pad_parts(sources[item], sig, item, ctx)
        pattern.append(('direct' if index is None else
                        'ragged' if how_ragged is not None else 'take',
                        len(sources[item])))
        indices[item] = index
    if lists:
        ragged = _lay_out_lists(sig, lists, sources, indices, pattern, uploads, learned,
                                where, ctx, step.ragged)
    host = [item for item, parts in sources.items() if type(parts[0]) is np.ndarray]
    free, by_node = _grad_free_outputs(sig, nodes, sources) if tables is not None else ((), None)
    if host and tables is not None:
        for item in tables.reads(sig, host):
            sources[item] = [tables.positions(sources[item][0])]
            pattern[item] += ('table',)
    # outputs on distinct rows change the row layout with the data: not
    # where a recipe is replayed or learned
    inverse = _share_host_rows(sig, host, sources, pattern, where is None and recipe is None) \
        if host else None
    for item in host:
        sources[item] = [to_device(sources[item][0], ctx)]
    rows = None
    if hoisted is not None:
        inverse = hoisted.inverse
    elif inverse is not None and pattern[host[0]][0] == 'distinct':
        rows, inverse = inverse, None
    program = step_program(sig, tuple(pattern)).for_rows(len(nodes))
    inputs = [sources[item[0]][item[1]] if kind == 'src' else indices[item] if kind == 'idx'
              else tables.table(item, ctx) if kind == 'table'
              else hoisted.values[item] if kind == 'hoisted' else ragged[item] if kind == 'ragged'
              else to_device(inverse, ctx) if kind == 'inverse'
              else to_device(inverse[ragged.segment], ctx) if kind == 'inverse_segment'
              else item.data(ctx) for kind, item in program.feeds]
    if tables is not None:
        _warn_if_freed(step, sources)
        inputs = _own_handles(inputs, program.feeds, recipe is not None)
    outs = call_program(program.cached_op, inputs, (sig,))
    if isinstance(outs, NDArray):
        outs = [outs]
    if free:
        outs = [grad_free(out) if number in free else out for number, out in enumerate(outs)]
    (accel.finish_nodes or finish_nodes_py)(nodes, outs, rows)
    if by_node:
        for more, members in by_node.items():
            arrays = [grad_free(out) if number in more else out
                      for number, out in enumerate(outs)]
            for node in members:
                node.arrays = arrays
            if varied is not None:
                varied.update(id(outs[number]) for number in more)
    return outs, learned


def _recipe_usable(recipe, outputs, varied):
    """Whether a step may follow ``recipe``: not where it reads an output
    that some of its nodes hand out detached (in ``varied``, see
    :func:`run_step`), and not where it is ragged and has a list to find
    anew (every list is then laid out anew, so that all of the step's
    lists share one layout)."""
    if varied and any(type(how) is tuple and any(number >= 0 and id(outputs[number][out])
                                                 in varied for number, out in how[0])
                      for how in recipe):
        return False
    return not (None in recipe and any(type(how) is tuple and len(how) > 2 for how in recipe))


def _grad_free_outputs(sig, nodes, sources):
    """``(free, by_node)`` for a training step: the numbers of its outputs
    handed out detached, as per sample (outputs of host data alone, and of
    arguments that carry no gradient), and, where that differs between its
    nodes, :func:`_grad_free_by_node`'s map (else None)."""
    free = sig.grad_free_outputs((True,) * len(sig.fmt))
    if not free:
        return free, None
    flags = tuple(item not in sources or all(map(_carries_no_gradient, sources[item]))
                  for item in range(len(sig.fmt)))
    narrowed = sig.grad_free_outputs(flags)
    by_node = None
    if len(narrowed) < len(free) and any(
            not flag and any(map(_carries_no_gradient, sources[item]))
            for item, flag in enumerate(flags)):
        by_node = _grad_free_by_node(nodes, sig, flags, narrowed)
    return narrowed, by_node


def _own_handles(inputs, feeds, replayed):
    """A training step's ``inputs``, with a handle of their own (the same
    memory, :func:`grad_free`) for the arrays that other flushes read too:
    padding rows and other :class:`GradFree` arrays, and the index arrays
    of a replayed recipe.  Autograd gives the arrays a recorded op reads an
    entry in its graph, which the first ``backward()`` clears, so a second
    graph recorded before it that read the same array failed in its own
    backward (``The any container is empty``): losses of several training
    scopes each backpropagated in turn (gradient accumulation), and
    threads training at once on cached plans, which also crashed (found by
    a fuzzer).  ~1-2 us an array replaced."""
    return [grad_free(array) if type(array) is GradFree or
            (replayed and kind in ('idx', 'ragged') and array is not None) else array
            for array, (kind, _) in zip(inputs, feeds)]


def _warn_if_freed(step, sources):
    """Warn (:class:`~gluon_dynbatch.FreedGraphWarning`) where a training
    step reads rows of an earlier training flush whose autograd graph a
    ``backward()`` freed: no gradient reaches the calls that made them.
    Per sample that is right only for the samples whose own losses were
    backpropagated, and the step cannot tell which (found by an autograd
    fuzzer: a loss built after another sample's ``backward()`` silently
    lost the gradient of its first calls).  Such an output was made by a
    recorded op, so carrying no gradient now (no graph, or only the bare
    variable autograd gives a freed array a recorded op reads) means its
    graph was freed.  One type test a source, and ~5 us a source from an
    earlier flush (rare: a scope flushed mid-way, or values carried over
    from an earlier scope)."""
    for parts in sources.values():
        for part in parts:
            kind = type(part)
            if kind is FreedRows or kind is RecordedOutput and _carries_no_gradient(part) or \
                    kind is OutputRows and _reads_freed_rows(part):
                maker = next((' of block %s' % leaf._node.sig.block.name for node in step.nodes
                              for leaf in node.leaves if type(leaf) is LazyValue and
                              leaf._node.arrays is not None and
                              any(array is part for array in leaf._node.arrays)), '')
                warnings.warn(FreedGraphWarning(
                    'block %s: this training flush reads outputs%s computed in an earlier '
                    'flush whose autograd graph a backward() without retain_graph=True has '
                    'freed, so no gradient flows back through them. One batched step holds '
                    'the rows of many calls: backward() on one sample\'s loss frees them for '
                    'every sample, where per sample only that sample\'s graph is freed. Sum '
                    'the losses and call backward() once, or pass retain_graph=True; if the '
                    'gradient is meant to stop here (truncated backpropagation), pass '
                    'value.data.detach() instead of the value.'
                    % (step.sig.block.name, maker)), stacklevel=user_stacklevel())
                return


def _grad_free_by_node(nodes, sig, flags, free):
    """Where an argument's rows mix host data with rows that carry a
    gradient (``flags`` False for it, though some of its sources carry
    none), the outputs that carry no gradient for each node by its own
    arguments, beyond ``free``: ``{outputs: [nodes]}``, so that those
    nodes' values are handed out detached, as per sample (a user's
    ``Embedding`` reading one as indices fails in backward otherwise).
    Their arrays are other objects than the step's outputs, so a cached
    plan finds the rows that read them anew instead of from a recipe
    (``varied`` in :func:`run_step`)."""
    mixed = [item for item, flag in enumerate(flags) if not flag]
    by_node, known = {}, {}
    for node in nodes:
        own = list(flags)
        spans = node.sig.spans
        for item in mixed:
            pos, width = spans[item]
            own[item] = all(map(_leaf_carries_no_gradient, node.leaves[pos:pos + width]))
        own = tuple(own)
        more = known.get(own)
        if more is None:
            more = known[own] = frozenset(sig.grad_free_outputs(own)) - set(free)
        if more:
            by_node.setdefault(more, []).append(node)
    return by_node


def _leaf_carries_no_gradient(leaf):
    """:func:`_carries_no_gradient` for one call's argument: host data, a
    padding row, a lazy value (its step's output as handed out) or an
    ``NDArray``."""
    if type(leaf) is LazyValue:
        leaf = leaf._node.arrays[leaf._index]
    elif type(leaf) is ZeroRow or not isinstance(leaf, mx.nd.NDArray):
        return True
    return _carries_no_gradient(leaf)


def _upload_index(index, uploads, ctx):
    """``index`` (int32, or None) on ``ctx``.  Arguments read from the same
    nodes (a Tree-LSTM's child h and c lists) have equal indices: one upload
    (kept in ``uploads``) serves them."""
    if index is None:
        return None
    key = (index.shape, index.tobytes())
    uploaded = uploads.get(key)
    if uploaded is None:
        uploaded = uploads[key] = to_device(index, ctx)
    return uploaded


def _lay_out_lists(sig, lists, sources, indices, pattern, uploads, learned, where, ctx,
                   ragged):
    """Index the list arguments of a step, gathered anew (``lists``: item
    -> its index, distinct sources, padding :class:`ZeroRow` and list
    lengths, as :func:`_gather_item` gives them), pad their sources (see
    :func:`_pad_parts`), set their patterns and note their recipes.
    Returns the step's ragged inputs (see :data:`~.lanes.SEGMENT`) when its
    lists run ragged, else None.

    Lists run ragged (pattern ``'ragged'``) when the plan says so
    (``ragged``: the plan checked :func:`~.lower.ragged_lists`, see
    :func:`~.plan.steps_of`; their gathers were then compact, elements
    only), some are shorter than the step's width, and every list of a
    call has the same length: then only the real elements are gathered,
    list after list.  Otherwise each is gathered whole, padding included,
    element-major where :func:`~.lower.element_major` says so."""
    lengths = None
    if ragged and len(lists) == sum(1 for fmt, (_, width) in zip(sig.fmt, sig.spans)
                                    if fmt != 0 and width > 1):
        lengths = _ragged_layout(sig, lists)
    ragged = None if lengths is None else \
        RaggedInputs(lengths, sig.spans[next(iter(lists))][1], ctx)
    for item, (index, distinct, zero, own_lengths) in lists.items():
        if ragged is not None:
            if index.ndim == 2:     # gathered padded: its elements only
                index = index[np.arange(index.shape[1]) < lengths[:, None]]
            how = 'ragged'
        else:
            if index.ndim == 1:     # gathered compact, laid out padded after all
                index, zero = _padded_index(sig, item, index, own_lengths, sources[item], ctx)
            if element_major(index.shape[1]):
                index = index.T
            how = 'take'
        index = indices[item] = _upload_index(np.ascontiguousarray(index), uploads, ctx)
        if learned is not None:     # before padding: a replay pads its parts anew
            part = _recipe_part(sig.fmt[item], distinct, index, where, zero)
            learned[item] = part if part is None or ragged is None else part + (ragged,)
        if len(sources[item]) > 2:
            _pad_parts(sources[item], sig, item, ctx)
        pattern[item] = (how, len(sources[item]))
    return ragged


def _padded_index(sig, item, compact, lengths, parts, ctx):
    """``(index, zero)``: the ``(N, K)`` index of list argument ``item``
    gathered compact (``compact``, its elements list after list, of
    ``lengths``), each list padded with the argument's zero row, appended
    to ``parts`` (which are the gather's distinct arrays too, so that a
    recipe finds it), and that :class:`ZeroRow`, or None when no list is
    short."""
    width = sig.spans[item][1]
    real = np.arange(width, dtype=np.int32) < lengths[:, None]
    if real.all():
        return compact.reshape(len(lengths), width), None
    zero = _zero_row(sig, item, ctx)
    index = np.full((len(lengths), width), sum(part.shape[0] for part in parts),
                    dtype=np.int32)
    index[real] = compact
    parts.append(zero.arrays[0])
    return index, zero


class RaggedInputs:
    """The index inputs of a step whose lists run ragged (see
    :data:`~.lanes.SEGMENT`) for lists of ``lengths`` (int32, one per call)
    in a step ``width`` elements wide, by name: made on the host and sent
    to ``ctx`` when a program first reads them (a program whose lanes read
    no shared value needs no ``SEGMENT``)."""
    __slots__ = ('lengths', 'width', 'segment', 'ctx', '_arrays')

    def __init__(self, lengths, width, ctx):
        self.lengths, self.width, self.ctx = lengths, width, ctx
        self.segment = np.repeat(np.arange(len(lengths), dtype=np.int32), lengths)
        self._arrays = {}

    def __contains__(self, name):
        return name in (SEGMENT, PADDED)

    def __getitem__(self, name):
        array = self._arrays.get(name)
        if array is None:
            if name not in self:
                raise KeyError(name)
            array = self._arrays[name] = to_device(self.host(name), self.ctx)
        return array

    def host(self, name):
        """Input ``name`` as a numpy array."""
        lengths, segment = self.lengths, self.segment
        if name == SEGMENT:
            return segment
        if name != PADDED:
            raise KeyError(name)
        ends = np.cumsum(lengths, dtype=np.int32)
        lane = np.arange(self.width, dtype=np.int32)[:, None]
        return np.where(lane < lengths, ends - lengths + lane, len(segment)).astype(np.int32)


def _ragged_layout(sig, lists):
    """The list lengths (int32, one per call) shared by every list argument
    of a step (``lists``, as :func:`_lay_out_lists` gets them) when they
    have one width and some list is shorter than it, else None."""
    layout = width = None
    for number, (item, (index, _, _, lengths)) in enumerate(lists.items()):
        if lengths is None:
            lengths = np.full(index.shape[0], index.shape[1], dtype=np.int32)
        if number == 0:
            layout, width = lengths, sig.spans[item][1]
        elif sig.spans[item][1] != width or not np.array_equal(layout, lengths):
            return None
    return layout if layout.min() < width else None


def _pad_parts(parts, sig, item, ctx):
    """Pad the source ``parts`` of a gathered argument to a power of two
    with its zero row, which the index never reads.

    The step program is compiled per number of parts, and that number
    follows the data (a Tree-LSTM step at depth d reads children from up to
    d earlier steps): at SICK minibatch 256 a pass over the test split
    compiled ~90 programs at ~4 ms each (build and first call).  Powers of
    two cut the variants per signature to a handful, for a one-row copy."""
    count = len(parts)
    filler = _zero_row(sig, item, ctx).arrays[0]
    parts += [filler] * ((1 << (count - 1).bit_length()) - count)


SHARE_ROWS = 8
"""Fewest host rows for which a step runs its host-only ops on the distinct rows."""

SHARE_BELOW = 0.8
"""A step runs its host-only ops on the distinct host rows (see
:mod:`~gluon_dynbatch.lower`) when there are at most this fraction of its
rows; with few repeats the expanding ``take`` would cost what it saves."""


def _share_host_rows(sig, items, sources, pattern, distinct_outputs):
    """If the host rows of ``items`` (numpy arrays in ``sources``) repeat
    enough and ``sig`` has ops on them alone, replace them by their distinct
    rows, mark those items ``'unique'`` in ``pattern`` (``'distinct'`` when
    ``distinct_outputs`` and every output depends on them alone: the
    outputs then have a row per distinct row) and return the int32 index of
    each row's distinct row; else None."""
    items = tuple(items)
    found = sig.host_parts.get(items)
    if found is None:
        host = {sig.data_names[sig.item_pos(item)] for item in items}
        # (a folded signature's values may have several rows per call,
        # which one row per distinct host row cannot hand on)
        found = sig.host_parts[items] = (False, False) if sig.folded else host_part(
            sig.symbol, host, {p.name for _, p in sig.param_slots})
    worth, outputs_host = found
    rows = [sources[item][0] for item in items]
    count = len(rows[0])
    if not worth or count < SHARE_ROWS:
        return None
    _, first, inverse = np.unique(_row_keys(rows), return_index=True, return_inverse=True)
    if len(first) > SHARE_BELOW * count:
        return None
    how = ('distinct' if distinct_outputs and outputs_host else 'unique', 1)
    for item, array in zip(items, rows):
        sources[item] = [array[first]]
        pattern[item] = how + pattern[item][2:]
    return inverse.astype(np.int32)


def _row_keys(rows):
    """One key per row of the host arrays ``rows`` (all of one length),
    equal exactly when the rows are equal bit for bit in every array
    (floats: -0.0 and NaNs stay apart)."""
    if len(rows) == 1 and rows[0].ndim == 1 and rows[0].dtype.kind in 'iu':
        return rows[0]
    count = len(rows[0])
    raw = np.concatenate([np.ascontiguousarray(r).reshape(count, -1).view(np.uint8)
                          for r in rows], axis=1)
    width = raw.shape[1]
    # rows of 1, 2, 4 or 8 bytes (float32 token ids) as unsigned integers:
    # the same bits, sorted ~2x faster by np.unique than as raw bytes
    kind = np.dtype('u%d' % width) if width in (1, 2, 4, 8) else np.dtype((np.void, width))
    return np.ascontiguousarray(raw).view(kind).ravel()


HOIST_ROWS = 64
"""Steps share a run of their host part (:class:`FlushHoist`) only when
they have this many rows together: the run is one more CachedOp call
(~0.1 ms), and at SICK minibatch 1 that cost 6%."""


class Hoisted:
    """What a step reads of its group's run of the host part (see
    :class:`FlushHoist`): its host arguments ``items``, the part's output
    ``values`` over the group's distinct rows, and ``inverse`` (int32, the
    distinct row of each of the step's rows)."""
    __slots__ = ('items', 'values', 'inverse')

    def __init__(self, items, values, inverse):
        self.items, self.values, self.inverse = items, values, inverse


class FlushHoist:
    """The host parts of a flush's steps, each run once for all the steps
    that share it.

    Steps of different signatures of a block often apply the same ops to
    their host rows: every Tree-LSTM node step, whatever its arity, embeds
    its token and applies the ``i2h`` GEMM.  :func:`~.lower.split_host_part`
    cuts that part out with a key; the steps whose keys are equal form a
    group, and the group's part runs once over the distinct host rows of
    all its steps, each step reading its rows by ``take``.  At SICK
    minibatch 256 that is ~510 rows instead of ~930 summed over the steps
    deduplicating their own rows (:func:`_share_host_rows`, still used for
    steps alone in their group).  A group runs when its first step does,
    and only when it has :data:`HOIST_ROWS` rows that repeat (see
    :data:`SHARE_BELOW`).

    With ``alone``, a step whose part no other step shares forms a group
    of its own when its rows repeat enough (as in :func:`_share_host_rows`,
    which a compiled plan cannot call: see :func:`flush_hoists`)."""

    def __init__(self, steps, alone=False):
        groups = {}
        for number, step in enumerate(steps):
            sig = step.sig
            if not sig.batch_safe:
                continue
            host = _host_items(step)
            split = host_split(sig, host) if host else None
            if split is not None:
                groups.setdefault((split.key, sig.ctx), []).append((number, step, host))
        self.groups = {}      # step number -> its _HoistGroup
        for members in groups.values():
            fewest = SHARE_ROWS if alone and len(members) == 1 else HOIST_ROWS
            if (len(members) < 2 and not alone) or \
                    sum(len(step.nodes) for _, step, _ in members) < fewest:
                continue
            by_rows = {}
            for number, step, host in members:
                rows = [host_item_rows(step.nodes, item) for item in host]
                if all(r is not None for r in rows):
                    kinds = tuple((r.dtype.str, r.shape[1:]) for r in rows)
                    by_rows.setdefault(kinds, []).append((number, step.sig, host, rows))
            for group in by_rows.values():
                hoist = _HoistGroup(group, fewest) if len(group) > 1 or alone else None
                if hoist is not None and hoist.worth:
                    for member in group:
                        self.groups[member[0]] = hoist

    def for_step(self, number):
        """The :class:`Hoisted` of step ``number``, or None when it runs
        its host part itself."""
        group = self.groups.get(number)
        return None if group is None else group.for_step(number)


class _HoistGroup:
    """Steps (``(number, sig, host items, host rows)``) whose host parts
    have one key: their distinct rows, whether they repeat enough
    (``worth``: at least ``fewest`` rows, see :data:`SHARE_BELOW`), and the
    part's run, made at the first :meth:`for_step`."""

    def __init__(self, members, fewest):
        self.members = members
        self.columns = [np.concatenate([rows[k] for _, _, _, rows in members])
                        for k in range(len(members[0][3]))]
        total = len(self.columns[0])
        _, self.first, inverse = np.unique(_row_keys(self.columns), return_index=True,
                                           return_inverse=True)
        self.inverse = inverse.astype(np.int32)     # of every member's rows, in order
        self.worth = total >= fewest and len(self.first) <= SHARE_BELOW * total
        self.hoisted = None

    def distinct(self, ctx):
        """The distinct host rows on ``ctx``, one array per host argument."""
        return [to_device(column[self.first], ctx) for column in self.columns]

    def for_step(self, number):
        if self.hoisted is None:
            self.hoisted = self._run()
        return self.hoisted[number]

    def _run(self):
        members = self.members
        _, sig, host, _ = members[0]
        ctx = sig.ctx
        split = host_split(sig, host)
        distinct = self.distinct(ctx)
        values = split.cached_op(*[distinct[what] if kind == 'host' else what.data(ctx)
                                   for kind, what in split.feeds])
        if isinstance(values, NDArray):
            values = [values]
        hoisted, start = {}, 0
        for number, _, items, rows in members:
            stop = start + len(rows[0])
            hoisted[number] = Hoisted(frozenset(items), values, self.inverse[start:stop])
            start = stop
        return hoisted


def flush_hoists(steps):
    """The groups of steps that :class:`FlushHoist` forms for ``steps``, as
    ``(HostSplit, [(step number, host items, its number of rows)])``: what a
    compiled plan (:func:`~.lower.flush_program`) hoists in every later
    flush of the same structure, whatever its data."""
    groups = {id(group): group for group in FlushHoist(steps, alone=True).groups.values()}
    return [(host_split(group.members[0][1], group.members[0][2]),
             [(number, tuple(items), len(rows[0])) for number, _, items, rows in group.members])
            for group in groups.values()]


class FlushTables:
    """The rows of each embedding weight that a training flush reads by
    host indices (token ids), looked up once per flush.

    Each step program reading an ``Embedding`` by host indices would
    otherwise return a dense gradient of the whole weight (vocabulary x
    width) in backward, and autograd would sum one per step: at SICK
    minibatch 25, nine dense 2,412 x 300 gradients for one lookup's worth
    of rows.  Instead the flush takes the rows of its distinct ids once
    (one op, one dense weight gradient) and the steps read that table by
    position (:func:`~.lower.read_tables`).  Inference has no gradient to
    save and keeps the plain lookups."""

    def __init__(self, steps, hoisted=()):
        # every id, read before any step runs (a step that ran has dropped
        # its arguments); steps numbered in ``hoisted`` read none
        self.tokens = self._read_ahead(
            [step for number, step in enumerate(steps) if number not in hoisted])
        # (weight, context) -> table; weights are Parameter objects (two
        # blocks may name theirs alike), one copy per context a flush uses
        self.arrays = {}

    def reads(self, sig, items):
        """``{item: [weight names]}`` for the host ``items`` of ``sig``
        read only as indices of embeddings whose weights get gradients."""
        items = tuple(items)
        found = sig.table_reads.get(items)
        if found is None:
            names = {sig.data_names[sig.item_pos(item)]: item for item in items}
            params = {p.name for _, p in sig.param_slots if p.grad_req != 'null'}
            found = sig.table_reads[items] = {
                names[name]: weights
                for name, weights in embedding_reads(sig.symbol, set(names), params).items()}
        return found

    def positions(self, rows):
        """Host indices ``rows`` as positions in the flush's tables (a NaN
        id, which the lookup clips as ``Embedding`` does, finds the NaN that
        ``np.unique`` sorts last)."""
        found = np.searchsorted(self.tokens, rows)
        if not (found < len(self.tokens)).all() or \
                not np.array_equal(self.tokens[found], rows, equal_nan=True):
            raise RuntimeError('gluon_dynbatch: a host index was not read ahead for the '
                               'flush\'s embedding tables (please report this)')
        # as the ids' dtype, unless it cannot hold every position (float16
        # ids beyond 2,048 distinct ones)
        positions = found.astype(rows.dtype)
        return positions if np.array_equal(positions, found) else found.astype(np.int32)

    def table(self, weight, ctx):
        """The rows of ``weight`` on ``ctx`` for the flush's ids (one
        ``take``, made at first use and recorded by autograd like any op)."""
        array = self.arrays.get((weight, ctx))
        if array is None:
            array = self.arrays[weight, ctx] = mx.nd.take(
                weight.data(ctx), to_device(self.tokens, ctx), mode='clip')
        return array

    def _read_ahead(self, steps):
        """Every id that one of ``steps`` reads through a table, sorted, in
        a dtype MXNet holds: ids of two signatures may differ in dtype, and
        numpy gives int8 with uint8 ids int16, which MXNet lacks (int32
        holds them)."""
        ids = []
        for step in steps:
            host = _host_items(step)
            for item in self.reads(step.sig, host) if host else ():
                rows = host_item_rows(step.nodes, item)
                if rows is not None:
                    ids.append(rows.ravel())
        if not ids:
            return np.zeros(0, np.float32)
        tokens = np.unique(np.concatenate(ids))
        return tokens if tokens.dtype.type in _DTYPE_NP_TO_MX else tokens.astype(np.int32)


def finish_nodes_py(nodes, arrays, rows=None):
    """The nodes of a step that ran: their outputs are rows of ``arrays``,
    in order, or rows ``rows[i]`` (int32 array; see ``'distinct'`` in
    :mod:`~gluon_dynbatch.lower`).  They drop their argument leaves
    (references to inputs) at once."""
    for i, node in enumerate(nodes):
        node.arrays = arrays
        node.row = i if rows is None else int(rows[i])
        node.state = DONE
        node.leaves = None


def _host_items(step):
    """The top-level arguments of ``step`` whose rows are host (numpy)
    rows, by its first node (see :func:`_host_first`)."""
    return [item for item, fmt in enumerate(step.sig.fmt)
            if fmt == 0 and _host_first(step.nodes, item)]


def _host_first(nodes, item):
    """Whether the first node's argument ``item`` is a host (numpy) row:
    the cheap test for which way a step's argument is gathered."""
    first = nodes[0]
    return isinstance(first.leaves[first.sig.item_pos(item)], np.ndarray)


def _item_rows(nodes, item):
    """Leaf ``item`` (not a list) of every node, read from each node's own
    layout (in a padded step a longer list before it moves it)."""
    positions = {sig: sig.item_pos(item) for sig in {node.sig for node in nodes}}
    if len(positions) == 1:
        pos = positions[nodes[0].sig]
        return [node.leaves[pos] for node in nodes]
    return [node.leaves[positions[node.sig]] for node in nodes]


def host_item_rows(nodes, item):
    """``host_rows(_item_rows(nodes, item))``: in one C pass over the nodes
    when :mod:`~gluon_dynbatch.accel` is active."""
    fast = accel.host_item
    data = fast(nodes, lambda s: (s.item_pos(item), 1)) if fast is not None else None
    if data is None:
        return host_rows(_item_rows(nodes, item))
    return _rows_from_bytes(data, nodes[0].leaves[nodes[0].sig.item_pos(item)], len(nodes))


def _rows_from_bytes(data, first, count):
    """The numpy rows of ``count`` host arrays shaped and typed as
    ``first``, concatenated in ``data`` (bytes from the C extension); not
    reshaped by -1 rows, since (1, 0) rows have no bytes to divide."""
    return np.frombuffer(data, dtype=first.dtype).reshape(
        (count * first.shape[0],) + first.shape[1:])


def _gather_item(nodes, sig, item, ctx, compact=False):
    """Where argument ``item`` of every node lives: ``(parts, index,
    distinct, zero, lengths)`` with ``parts`` and ``index`` as :func:`collect` gives
    them, but ``index`` an int32 array, ``(N, K)`` for a list that ``sig``
    makes K long and ``(N,)`` otherwise, or None when the parts already are
    the rows in order; ``distinct``, the arrays the parts are made of (None
    for host rows); ``zero``, the :class:`ZeroRow` that pads shorter lists
    (None when none is shorter); ``lengths``, each node's list length
    (int32; None when none is shorter).  Shorter lists are padded in the
    index, at their end, not per node.

    With ``compact`` (a list argument of a step that may run ragged) the
    index is ``(M,)``, the lists' M elements only, list after list, with no
    zero row, and ``lengths`` is always given: a SICK minibatch's lists
    are ~2.7 times as many entries padded as they have elements.  (A step
    whose lists gathered that way still runs padded when its lists'
    lengths differ: :func:`_padded_index`.)"""
    fmt = sig.fmt[item]
    width = sig.spans[item][1]      # a nested list is gathered as its flat leaves
    fast = accel.gather_item
    if fast is not None and compact and not _host_first(nodes, item):
        found = fast(nodes, lambda s: s.spans[item], width, None, ZeroRow, True)
        if found is not None:
            parts, index, lengths = found
            lengths = np.frombuffer(lengths, dtype=np.int32)
            index = np.arange(int(lengths.sum()), dtype=np.int32) if index is None else \
                np.frombuffer(index, dtype=np.int32)
            return parts, index, parts, None, lengths
    elif fast is not None and not _host_first(nodes, item):
        zero = None if fmt == 0 else _zero_row(sig, item, ctx)
        found = fast(nodes, lambda s: s.spans[item], width, zero, ZeroRow)
        if found is not None:
            parts, index, lengths = found
            distinct = parts
            if index is not None:
                index = np.frombuffer(index, dtype=np.int32)
            if fmt == 0:
                return parts, index, distinct, None, None
            if index is None:
                index = np.arange(len(nodes) * width, dtype=np.int32)
            if lengths is None:
                return parts, index.reshape(len(nodes), width), distinct, None, None
            return (parts, index.reshape(len(nodes), width), distinct, zero,
                    np.frombuffer(lengths, dtype=np.int32))
    if fmt == 0:
        host = host_item_rows(nodes, item) if _host_first(nodes, item) else None
        if host is not None:   # sent to the device by run_step
            return [host], None, None, None, None
        parts, index, distinct = collect(_item_rows(nodes, item), ctx)
        return (parts, None if index is None else np.asarray(index, dtype=np.int32),
                distinct, None, None)
    spans = {s: s.spans[item] for s in {node.sig for node in nodes}}
    if compact:
        leaves, counts = _list_elements(nodes, spans)
        if leaves and not isinstance(leaves[0], np.ndarray):    # host lists: padded below
            parts, index, distinct = collect(leaves, ctx)
            return (parts, _row_index(index, len(leaves)), distinct, None,
                    np.asarray(counts, dtype=np.int32))
    counts = None
    if len(spans) == 1 and next(iter(spans.values()))[1] == width:
        pos = next(iter(spans.values()))[0]
        leaves = [leaf for node in nodes for leaf in node.leaves[pos:pos + width]]
    else:
        leaves, counts = _list_elements(nodes, spans)
    zero = None
    if counts is not None and min(counts) < width:
        zero = _zero_row(sig, item, ctx)
        leaves.append(zero)
    parts, index, distinct = collect(leaves, ctx)
    index = _row_index(index, len(leaves))
    if zero is None:
        return parts, index.reshape(len(nodes), width), distinct, None, None
    lengths = np.asarray(counts, dtype=np.int32)
    matrix = np.full((len(nodes), width), index[-1], dtype=np.int32)
    matrix[np.arange(width) < lengths[:, None]] = index[:-1]
    return parts, matrix, distinct, zero, lengths


def _list_elements(nodes, spans):
    """A list argument's elements, node after node (``spans``: per
    signature, the list's position and length among a node's leaves), and
    each node's list length."""
    leaves, counts = [], []
    for node in nodes:
        pos, length = spans[node.sig]
        leaves += node.leaves[pos:pos + length]
        counts.append(length)
    return leaves, counts


def _row_index(index, rows):
    """:func:`collect`'s index as int32, or every row in order where it
    gave none (the rows are one source array, in order)."""
    return np.arange(rows, dtype=np.int32) if index is None else np.asarray(index, dtype=np.int32)


def _zero_row(sig, item, ctx):
    """The padding row of list argument ``item`` of ``sig``, made once per
    (signature, argument, thread) and shared: making a zeros array per
    padded step cost ~6% of a SICK minibatch of 25.  Each thread has its
    own: autograd gives a recorded op's inputs a graph entry, which
    backward clears again, and threads training at once on one shared row
    failed in backward or corrupted the heap (found by a review)."""
    key = (item, ctx, threading.get_ident())
    zero = sig.zero_rows.get(key)
    if zero is None:
        zero = sig.zero_rows[key] = ZeroRow(sig.item_shape(item), sig.item_dtype(item), ctx)
    return zero


def _recipe_part(fmt, distinct, index, where, zero):
    """How to find one argument's rows again: ``'host'`` (a single host
    array per call), ``(sources, index)`` with sources as (step, output)
    pairs (step -1: a zero row), or None when the rows must be found anew
    (a source that is not an output of this flush's steps, or a list of
    host arrays)."""
    if distinct is None:
        return 'host' if fmt == 0 else None
    parts = []
    for array in distinct:
        if zero is not None and array is zero.arrays[0]:
            parts.append((-1, 0))
        else:
            found = where.get(id(array))
            if found is None:
                return None
            parts.append(found)
    return tuple(parts), index


class ZeroRow:
    """A padding element of a list argument: reads like a lazy value whose
    producer holds a single zero row (made once per padded argument)."""
    __slots__ = ('_node', '_index', 'arrays', 'row')

    def __init__(self, shape, dtype, ctx):
        self._node, self._index, self.row = self, 0, 0
        self.arrays = [grad_free(mx.nd.zeros(shape, ctx=ctx, dtype=dtype))]


class _ReadsAsNDArray(type):
    """The type of this module's ``NDArray`` subclasses: each compares
    equal to ``NDArray`` (and to the other), since MXNet's ``__setitem__``
    takes an array value by ``type(value) == self.__class__`` only, and
    otherwise fails (``buf[:] = value.data``, ``mx.nd.array(value.data)``,
    ``param.set_data(value.data)``: ``does not support assignment``, found
    by a review) where the value is one (a step output handed out by
    ``value.data`` or ``concat_rows``).  Hashes stay by identity."""

    def __eq__(cls, other):
        return other is cls or other is NDArray or type(other) is _ReadsAsNDArray

    def __ne__(cls, other):
        return not cls.__eq__(other)

    __hash__ = type.__hash__


class GradFree(NDArray, metaclass=_ReadsAsNDArray):
    """An array that carries no gradient: a step output computed from
    host data alone, handed out detached from autograd's graph as per-sample
    execution would leave it (see
    :meth:`~gluon_dynbatch.trace.TracedSignature.grad_free_outputs`), or a
    padding row.  A step whose argument reads only such arrays passes the
    flag on to its outputs that read nothing else.  Attaching a gradient
    to one makes it a plain ``NDArray`` again (the user may read a step's
    output itself: :func:`~gluon_dynbatch.concat_rows`)."""
    __slots__ = []

    def attach_grad(self, grad_req='write', stype=None):
        self.__class__ = NDArray
        return NDArray.attach_grad(self, grad_req, stype)


class _StepRows(NDArray, metaclass=_ReadsAsNDArray):
    """Base of :class:`RecordedOutput`, :class:`OutputRows` and
    :class:`FreedRows`: MXNet makes views (``x[i:j]``, ``x[i]``,
    ``x.reshape``) of the array's own class, which :meth:`_view` decides
    instead (by default: made under ``autograd.record()`` they keep the
    class, others are constants, as per sample, and plain ``NDArray``
    objects).  Attaching a gradient makes one a plain ``NDArray`` leaf, as
    per sample (no warning then: the gradient stops there on purpose)."""
    __slots__ = []

    def _slice(self, start, stop):
        return self._view(NDArray._slice(self, start, stop))

    def _at(self, idx):
        return self._view(NDArray._at(self, idx))

    def reshape(self, *shape, **kwargs):
        return self._view(NDArray.reshape(self, *shape, **kwargs))

    def attach_grad(self, grad_req='write', stype=None):
        # a leaf of its own, as per sample: the gradient stops there on purpose
        _READ_FROM.pop(id(self), None)
        self.__class__ = NDArray
        return NDArray.attach_grad(self, grad_req, stype)

    def _view(self, view):
        if not mx.autograd.is_recording():
            view.__class__ = NDArray
        return view


class RecordedOutput(_StepRows):
    """A batched output of a training flush that has ended, as the nodes
    of a later flush read it: a later training step checks that its
    autograd graph is still there (:func:`_warn_if_freed`).  It is an
    ``NDArray`` in every other way (``concat_rows`` and ``value.data`` may
    hand one out).  Its views made under ``autograd.record()`` are
    :class:`OutputRows` or :class:`FreedRows` (:func:`rows_of`); others
    are plain ``NDArray`` objects: they have no graph, as per sample, and
    a later flush reading one warned that a backward() had freed it
    (found by a review)."""
    __slots__ = []

    def _view(self, view):
        view.__class__ = NDArray
        return rows_of((self,), view, False)


class OutputRows(_StepRows):
    """Rows read out of a :class:`RecordedOutput` while its graph was
    still there (:func:`rows_of`: ``value.data``, ``concat_rows``, views
    made under ``autograd.record()``): a ``backward()`` may free the
    output's graph later while these rows keep theirs, which then ends at
    the freed output, so a later training step reading them checks the
    outputs they were read out of (:func:`_reads_freed_rows`, from
    :data:`_READ_FROM`; found by a review: ``hs[1].data`` read before
    another sample's ``backward()`` and passed to a call after it lost its
    gradient silently)."""
    __slots__ = []

    def _view(self, view):
        if not mx.autograd.is_recording():
            view.__class__ = NDArray
        else:
            _READ_FROM[id(view)] = _READ_FROM.get(id(self), ())
        return view

    def __del__(self):
        _READ_FROM.pop(id(self), None)
        NDArray.__del__(self)


_READ_FROM = {}
"""``id`` of each live :class:`OutputRows` -> the :class:`RecordedOutput`
arrays it was read out of (dropped as it is freed, or given a gradient)."""


class FreedRows(_StepRows):
    """Rows read out of a :class:`RecordedOutput` whose graph a
    ``backward()`` had freed (:func:`rows_of`): they hold its values, but
    no gradient reaches the calls that made them, so a later training
    step reading them warns, as for the output itself (found by a review:
    ``value.data`` read after another sample's ``backward()`` and passed
    to a call lost its gradient silently)."""
    __slots__ = []


def rows_of(sources, rows, always=True):
    """``rows``, a new array read out of ``sources`` (step outputs, or
    arrays read out of them), as a :class:`FreedRows` where one of them is
    a :class:`RecordedOutput` whose graph a ``backward()`` freed (or
    itself such rows), else as :class:`OutputRows` where one is a
    :class:`RecordedOutput` (or :class:`OutputRows`); unless ``always`` (a
    view, which per sample is a constant when made outside
    ``autograd.record()``) only while autograd records.  ~2-7 us a
    training step's output, nothing for others."""
    if not always and not mx.autograd.is_recording():
        return rows
    read_from = []
    for source in sources:
        kind = type(source)
        if kind is FreedRows or kind is RecordedOutput and _carries_no_gradient(source):
            rows.__class__ = FreedRows
            return rows
        if kind is RecordedOutput:
            read_from.append(source)
        elif kind is OutputRows:
            read_from.extend(_READ_FROM.get(id(source), ()))
    if read_from:
        rows.__class__ = OutputRows
        _READ_FROM[id(rows)] = tuple(read_from)
    return rows


def _reads_freed_rows(rows):
    """Whether :class:`OutputRows` ``rows`` lost their graph, or a
    ``backward()`` without ``retain_graph=True`` freed one of the step
    outputs they were read out of: the gradient stops there.  ~2-7 us an
    output (a walk down the rows' graph instead cost ~2.4 ms a row of a
    SICK minibatch of 25, through every earlier step)."""
    return _autograd_symbol(rows) is None or \
        any(map(_carries_no_gradient, _READ_FROM.get(id(rows), ())))


def _autograd_symbol(array):
    """The symbol of ``array``'s autograd graph, None where it has none."""
    handle = SymbolHandle()
    try:
        check_call(_LIB.MXAutogradGetSymbol(array.handle, ctypes.byref(handle)))
    except mx.base.MXNetError:
        return None
    return mx.sym.Symbol(handle)


def _carries_no_gradient(part):
    """Whether a step's source ``part`` is outside autograd's graph: host
    rows, a :class:`GradFree` array, or an NDArray that no recorded op made
    and that has no gradient attached (MXNet has no cheaper way to ask
    than for its graph's symbol, which it refuses then: ~7 us an array,
    ~4-6 us when it has one, with the look at that symbol; asked only for
    a signature with an output that reads no trained parameter), or only
    the variable that autograd gave such an array when a recorded op read
    it."""
    if type(part) is GradFree or type(part) is np.ndarray:
        return True
    symbol = _autograd_symbol(part)
    if symbol is None:
        return True
    # a variable without a gradient attached: autograd made it when a
    # recorded op read the array (MXNet's RecordOp does so for every input
    # that has none), as a batched step whose other rows carry a gradient
    # does where the per-sample op was not recorded
    return symbol.get_children() is None and part.grad is None


def grad_free(array):
    """``array`` detached from autograd's graph (its data shared), as a
    :class:`GradFree`."""
    handle = NDArrayHandle()
    check_call(_LIB.MXNDArrayDetach(array.handle, ctypes.byref(handle)))
    return GradFree(handle, writable=array.writable)


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
    """``(parts, index, distinct)`` such that, with ``source`` the
    concatenation of the arrays ``parts``, row ``i`` of ``source[index]`` is
    ``leaves[i]``; ``index`` is None when ``source`` already is that.  The
    parts are the ``distinct`` arrays the rows live in (earlier steps'
    outputs, user NDArrays, the zero rows of padding), or one array of host
    rows (``distinct`` None).  Step programs concatenate the parts
    themselves (one op inside the CachedOp instead of one imperative call).

    This runs over every argument row of a flush, so the common case (every
    leaf a computed lazy value or a padding row) is a few comprehensions."""
    first = leaves[0]
    if isinstance(first, np.ndarray):
        host = host_array(leaves, ctx)
        if host is not None:
            return [host], None, None
    fast = accel.gather_index
    if fast is not None and type(leaves) is list:
        found = fast(leaves, ZeroRow)      # None unless all are lazy values / padding
        if found is not None:
            parts, index = found
            return parts, None if index is None else np.frombuffer(index, np.int32), parts
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
                # a copy: to_device may wrap the memory, which the user may reuse
                arrays.append(to_device(np.array(leaf), ctx) if isinstance(leaf, np.ndarray)
                              else leaf)
                rows.append(0)
    return gather_rows(arrays, rows)


def host_array(leaves, ctx):
    """Host rows (numpy arrays of one shape, e.g. a token id per call) as
    one NDArray on ``ctx``, sent once (see :func:`host_rows`).  None unless
    every leaf is a numpy array."""
    host = host_rows(leaves)
    return None if host is None else to_device(host, ctx)


def host_rows(leaves):
    """Host rows (numpy arrays of one shape) concatenated into one numpy
    array, in C when :mod:`~gluon_dynbatch.accel` is active.  None unless
    every leaf is a numpy array."""
    fast = accel.host_rows
    data = fast(leaves) if fast is not None else None
    if data is not None:
        return _rows_from_bytes(data, leaves[0], len(leaves))
    if all(isinstance(leaf, np.ndarray) for leaf in leaves):
        return np.concatenate(leaves)
    return None


def gather_rows(arrays, rows):
    """``(parts, index, distinct)`` (see :func:`collect`) for the rows
    ``rows[i]`` of ``arrays[i]``: the ``distinct`` arrays in order of first
    use, and each row's position in their concatenation; ``index`` is None
    when that is ``0, 1, 2, ...``."""
    keys = list(map(id, arrays))
    distinct = dict(zip(keys, arrays))
    parts = list(distinct.values())
    if len(distinct) == 1:
        index = rows
        rows_in_parts = arrays[0].shape[0]
    else:
        offsets, offset = {}, 0
        for key, array in distinct.items():
            offsets[key] = offset
            offset += array.shape[0]
        index = list(map(operator.add, map(offsets.__getitem__, keys), rows))
        rows_in_parts = offset
    if index[0] == 0 and index[-1] == len(index) - 1 and rows_in_parts == len(index) \
            and index == list(range(len(index))):
        index = None
    return parts, index, parts


def to_device(host, ctx):
    """Copy a numpy array into a new NDArray on ``ctx`` (``mx.nd.array``
    without its per-call type checks, which cost more than the copy).

    Under a threaded engine (MXNet's default) a CPU array wraps the numpy
    array's memory instead (zero-copy), so ``host`` must be an array made
    for the purpose, never changed afterwards (never a user's).  A copy
    goes through ``SyncCopyFromCPU``, which waits for every op queued on
    the worker before it, so each step waited for the one before and
    Python could not prepare the next step while the last one ran (SICK
    minibatch 25, ``ThreadedEnginePerDevice``: 14.9 -> 13.1 ms).  The
    wrapping is :func:`~.accel.wrap_host` (C) where built, else
    ``mx.nd.from_numpy``, whose DLPack structures cost ~18 us of ctypes
    and whose deleter, a Python callback, takes the GIL on the engine's
    worker, stalling it while Python runs: with the C version (~2 us, the
    release deferred to the main thread) ``auto`` ran SICK minibatches of
    1 / 25 1.54x / 1.33x faster under that engine.  (Both make arrays on
    ``cpu(0)`` only.)  Both copy the bytes as they are, so an array in the
    other byte order (``'>f4'`` on x86) is converted first: its values,
    not its bytes, must arrive."""
    if not host.dtype.isnative:
        host = host.astype(host.dtype.newbyteorder('='))
    if ctx.device_type == 'cpu' and ctx.device_id == 0 and threaded_engine():
        host = np.ascontiguousarray(host)
        handle = accel.wrap_host(host) if accel.wrap_host else None
        if handle is not None:      # the same, its DLPack structures built in C
            return NDArray(NDArrayHandle(handle))
        if str(host.dtype) in DLDataType.TYPE_MAP:      # (not int8, bool)
            return mx.nd.from_numpy(host, zero_copy=True)
    # ``mx.nd.empty`` + ``_sync_copyfrom`` made the same two C calls with
    # 12 us of Python checks around them; this is 6 us (~230 uploads per
    # SICK minibatch of 256)
    host = np.ascontiguousarray(host)
    handle = NDArrayHandle()
    shape = host.shape
    check_call(_CREATE_ARRAY((_SHAPE_INT * len(shape))(*shape), len(shape), ctx.device_typeid,
                             ctx.device_id, 0, _DTYPE_NP_TO_MX[host.dtype.type],
                             ctypes.byref(handle)))
    array = NDArray(handle)         # owns the handle from here on
    check_call(_LIB.MXNDArraySyncCopyFromCPU(handle, ctypes.c_void_p(host.ctypes.data),
                                             ctypes.c_size_t(host.size)))
    return array


if _int64_enabled():
    _CREATE_ARRAY, _SHAPE_INT = _LIB.MXNDArrayCreateEx64, ctypes.c_int64
else:
    _CREATE_ARRAY, _SHAPE_INT = _LIB.MXNDArrayCreateEx, mx_uint


_ENGINE = []


def threaded_engine():
    """Whether MXNet runs ops on worker threads (its engine is chosen once,
    from ``MXNET_ENGINE_TYPE``, default ``ThreadedEnginePerDevice``)."""
    if not _ENGINE:
        _ENGINE.append(os.environ.get('MXNET_ENGINE_TYPE', 'ThreadedEnginePerDevice')
                       != 'NaiveEngine')
    return _ENGINE[0]
