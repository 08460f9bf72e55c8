"""Lower one plan step to a compiled batched call.

A step runs a signature's per-sample symbol over N calls.  Each top-level
argument of the block arrives either *direct* (an array whose rows already
are the N calls in order, e.g. host token ids) or *gathered*: a source array
(the earlier batched outputs the rows come from, concatenated) plus an index
array.  A list argument of length K is gathered with one ``(N, K)`` index
into ``(N, K, ...)`` rows and cut into its K elements by one ``SliceChannel``
(a single op whose backward writes each gradient once, unlike K slices).

The gathers and the block's ops compile into one CachedOp per (signature,
gather pattern), so a step costs one CachedOp call plus its index uploads,
whatever the arity.
"""
import mxnet as mx

__all__ = ['StepProgram', 'step_program']


class StepProgram:
    """A compiled step: ``cached_op`` and, for each of its inputs, where the
    value comes from: ``('src', item)``, ``('idx', item)`` or
    ``('param', Parameter)``."""
    __slots__ = ('cached_op', 'feeds')

    def __init__(self, symbol, feeds):
        self.cached_op = mx.nd.CachedOp(symbol)
        self.feeds = feeds


def step_program(sig, pattern):
    """The :class:`StepProgram` of ``sig`` under ``pattern`` (per top-level
    argument: ``'direct'`` or ``'take'``), built once and cached on ``sig``."""
    program = sig.programs.get(pattern)
    if program is None:
        program = sig.programs[pattern] = _build(sig, pattern)
    return program


def _build(sig, pattern):
    replace = {}
    names = iter(sig.data_names)
    for item, (fmt, how) in enumerate(zip(sig.fmt, pattern)):
        width = 1 if fmt == 0 else len(fmt)
        if width == 0:
            continue
        rows = mx.sym.var('src%d' % item)
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
        else:
            kind, item = name[:3], int(name[3:])
            feeds.append((kind, item))
    return StepProgram(symbol, feeds)
