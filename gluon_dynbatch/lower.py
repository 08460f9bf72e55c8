"""Lower one plan step to a compiled batched call.

A step runs a signature's per-sample symbol over N calls.  Each top-level
argument of the block arrives either *direct* (an array whose rows already
are the N calls in order, e.g. host token ids) or *gathered*: a source array
(the earlier batched outputs the rows come from, passed as separate inputs
and concatenated inside the program) plus an index array.  A list argument of length K is gathered with one ``(N, K)`` index
into ``(N, K, ...)`` rows and cut into its K elements by one ``SliceChannel``
(a single op whose backward writes each gradient once, unlike K slices).

The gathers and the block's ops compile into one CachedOp per (signature,
gather pattern), so a step costs one CachedOp call plus its index uploads,
whatever the arity.

A cached plan whose structure keeps coming back can go one level further:
:func:`flush_program` chains the step programs of the whole plan, their
gathers replayed from the plan's recipes, into one CachedOp.  A flush then
costs one call forward and one backward, and each parameter's gradient is
summed inside the graph instead of once per step.
"""
import mxnet as mx

from .trace import leaf_count

__all__ = ['StepProgram', 'step_program', 'FlushProgram', 'flush_program']


class StepProgram:
    """A compiled step: its ``symbol``, the ``cached_op`` and, for each of
    its inputs, where the value comes from: ``('src', (item, part))``,
    ``('idx', item)`` or ``('param', Parameter)``."""
    __slots__ = ('symbol', 'cached_op', 'feeds')

    def __init__(self, symbol, feeds):
        self.symbol = symbol
        self.cached_op = mx.nd.CachedOp(symbol)
        self.feeds = feeds


def step_program(sig, pattern):
    """The :class:`StepProgram` of ``sig`` under ``pattern`` (per top-level
    argument: None for an empty list, else ``(how, parts)``: ``how`` is
    ``'direct'`` or ``'take'``, ``parts`` the number of arrays whose
    concatenation is the source), built once and cached on ``sig``."""
    program = sig.programs.get(pattern)
    if program is None:
        program = sig.programs[pattern] = _build(sig, pattern)
        BUILT[0] += 1
    return program


BUILT = [0]
"""Step programs built so far: a flush that built one ran slower than it
will next time (the cost model ignores such flushes)."""


def _build(sig, pattern):
    replace = {}
    names = iter(sig.data_names)
    for item, (fmt, way) in enumerate(zip(sig.fmt, pattern)):
        width = leaf_count(fmt)     # a nested list is cut into its flat leaves
        if width == 0:
            continue
        how, count = way
        parts = [mx.sym.var('src%d_%d' % (item, part)) for part in range(count)]
        rows = parts[0] if count == 1 else mx.sym.concat(*parts, dim=0)
        if how == 'take':
            rows = mx.sym.take(rows, mx.sym.var('idx%d' % item))
        if fmt == 0:
            replace[next(names)] = rows
        elif width == 1:
            replace[next(names)] = mx.sym.squeeze(rows, axis=1) if how == 'take' else rows
        else:
            parts = mx.sym.SliceChannel(rows, num_outputs=width, axis=1, squeeze_axis=True)
            for j in range(width):
                replace[next(names)] = parts[j]
    symbol = sig.symbol(**replace)
    params = {p.name: p for _, p in sig.param_slots}
    feeds = []
    for name in symbol.list_inputs():
        if name in params:
            feeds.append(('param', params[name]))
        elif name.startswith('src'):
            feeds.append(('src', tuple(int(n) for n in name[3:].split('_'))))
        else:
            feeds.append(('idx', int(name[3:])))
    return StepProgram(symbol, feeds)


class FlushProgram:
    """A whole plan compiled into one CachedOp: ``feeds`` says per input
    whether it is a parameter, a constant (a recorded gather index or a zero
    row) or host rows to read from the flush (``('host', (step, item))``);
    ``out_counts`` says how many of the outputs belong to each step."""
    __slots__ = ('cached_op', 'feeds', 'out_counts', 'ctx')

    def __init__(self, symbol, feeds, out_counts, ctx):
        # A structure fixes every shape, so memory is planned once
        # (static_shape; ~10% faster at SICK minibatch 25).  Outputs are
        # still fresh arrays on every call; a call recorded for backward
        # keeps its own buffers (tests/test_cost.py checks both).
        self.cached_op = mx.nd.CachedOp(symbol, [('static_alloc', True), ('static_shape', True)])
        self.feeds = feeds
        self.out_counts = out_counts
        self.ctx = ctx


def flush_program(steps, recipes):
    """One :class:`FlushProgram` for ``steps`` whose every argument has a
    replayable recipe (see :func:`~.execute.run_step`), or None when one
    has not (it reads user NDArrays or an earlier flush) or the steps span
    several contexts."""
    if len({step.sig.ctx for step in steps}) != 1 or \
            any(recipe is None or None in recipe for recipe in recipes):
        return None
    ctx = steps[0].sig.ctx
    outputs, spec, params = [], {}, {}
    for number, (step, recipe) in enumerate(zip(steps, recipes)):
        sig = step.sig
        pattern = tuple(None if how == 'empty' else
                        ('direct' if how == 'host' or how[1] is None else 'take', 1)
                        for how in recipe)
        bind = {}
        for item, how in enumerate(recipe):
            if how == 'empty':
                continue
            name = 's%d_%d' % (number, item)
            if how == 'host':
                bind['src%d_0' % item] = mx.sym.var('host_' + name)
                spec['host_' + name] = ('host', (number, item))
                continue
            parts, index = how
            sources = []
            for step_number, out in parts:
                if step_number < 0:   # padding: a zero row
                    sources.append(mx.sym.var('zero_' + name))
                    spec['zero_' + name] = ('const', mx.nd.zeros(
                        sig.item_shape(item), ctx=ctx, dtype=sig.key[-2]))
                else:
                    sources.append(outputs[step_number][out])
            bind['src%d_0' % item] = sources[0] if len(sources) == 1 else \
                mx.sym.concat(*sources, dim=0)
            if index is not None:
                bind['idx%d' % item] = mx.sym.var('idx_' + name)
                spec['idx_' + name] = ('const', index)
        for _, param in sig.param_slots:   # one input per parameter, shared by all steps
            params[param.name] = param
            bind[param.name] = param.var()
        symbol = step_program(sig, pattern).symbol(**bind)
        outputs.append([symbol[i] for i in range(len(symbol.list_outputs()))])
    group = mx.sym.Group([out for outs in outputs for out in outs])
    feeds = [('param', params[name]) if name in params else spec[name]
             for name in group.list_inputs()]
    return FlushProgram(group, feeds, [len(outs) for outs in outputs], ctx)
