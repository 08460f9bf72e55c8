"""Run the per-element work on a list argument as one op over all elements.

A step program gathers a list argument of length K element-major, as
``(K, N, ...)`` rows, and cuts them (:func:`~.lower.step_program`) into the
K elements the per-sample block reads, its *lanes*.  A block that does the same thing to
every element (a child-sum Tree-LSTM: ``sigmoid(f_x + h2h_f(h_k)) * c_k``
per child, then the sum over children) then runs K copies of each of those
ops on N rows: at SICK minibatch 25, 3 in 5 ops of a node step.
:func:`vectorize_lists` runs each set of copies as one op over the uncut
``(K, N, ...)`` rows instead, so a step costs the same number of ops
whatever its arity, and ``h2h_f`` becomes one GEMM over all children:

* copies are found by structure: same op and attributes, and inputs equal
  except for the lane they read (output ``k`` of a cut, or the copy for
  lane ``k`` of an earlier set);
* a set is used only when it has exactly one copy per lane, its op acts on
  each row and lane alone (:data:`UNARY`, :data:`BINARY`, and
  ``FullyConnected`` over the last axis), and its copies are read by
  nothing but later sets and one ``add_n`` of all K copies of a set, which
  becomes a ``dot`` with a vector of K ones (MXNet 1.9.1's ``sum`` over an
  axis measured up to 20x slower than ``add_n``, the ``dot`` 3x; a 1-D
  vector needs no ``Reshape`` after the ``dot``);
* a value every copy reads (the node's own ``f_x``) gets a length-1 axis 0
  and, for inference, meets the lanes in the broadcasting form of the op
  (element-major, so that the broadcast axis is the outer one: 2x faster
  than axis 1).  For training it is repeated K times by a ``dot`` with a
  column of K ones instead: the backward of MXNet 1.9.1's broadcasting ops
  is a generic reduction (with them the pass ran SICK training at minibatch
  256 at 0.98x, NaiveEngine), while a ``dot``'s backward is another ``dot``
  (1.08x).  In inference the extra ``dot`` cost 3% at minibatch 25.

Every lane's row of a vectorized op is the same arithmetic on the same
values as its copy's, so results equal those of the cut graph up to the
order of the final sum.  Anything the pass does not recognise is left as it
was.

Lists of different lengths in one step can run *ragged* (``ragged=True``):
the lanes are then the real elements only, list after list, and shared
values and sums go through index inputs (:data:`SEGMENT`) instead of the
K-fold layout, so no padding element is computed.
"""
import json

import numpy as np

from .trace import graph_readers, load_graph, moved_entry, symbol_json

__all__ = ['CUT', 'SEGMENT', 'PADDED', 'vectorize_lists']

CUT = 'dynbatch_cut'
"""Name prefix of the ``SliceChannel`` that cuts a list argument into its
lanes (axis 0, squeezed); only cuts named so are vectorized."""

UNARY = frozenset((
    'Activation', 'sigmoid', 'tanh', 'relu', 'softsign', 'exp', 'log', 'negative', 'abs',
    'square', 'sqrt', 'rsqrt', 'clip', '_copy', '_mul_scalar', '_plus_scalar', '_minus_scalar',
    '_rminus_scalar', '_div_scalar', '_rdiv_scalar', '_power_scalar', '_maximum_scalar',
    '_minimum_scalar'))
"""Ops of one input that act on each element alone, at any shape."""

BINARY = {'elemwise_add': 'broadcast_add', 'elemwise_sub': 'broadcast_sub',
          'elemwise_mul': 'broadcast_mul', 'elemwise_div': 'broadcast_div',
          '_maximum': 'broadcast_maximum', '_minimum': 'broadcast_minimum'}
"""Elementwise ops of two equal-shaped inputs, and their broadcasting form
(used when one input is the same value for every lane)."""


def vectorize_lists(symbol, lane_ndims, dtype, training=False, ragged=False):
    """``symbol`` with each complete set of per-lane copies run once over
    all lanes (see the module docstring).  ``lane_ndims`` gives, per cut
    name, the number of axes of one lane (2 for ``(N, D)`` rows): a
    ``FullyConnected`` that flattens its input is vectorized only for 2.
    ``dtype`` is the lanes' (the rows of ones are made in it).
    ``training`` repeats shared values by a ``dot`` (cheaper backward)
    instead of broadcasting them (cheaper forward).  Returns ``symbol``
    itself when nothing was vectorized.

    With ``ragged`` the cuts' inputs are *ragged* rows instead: the ``M``
    elements of N lists of different lengths, list after list (see
    :data:`SEGMENT`); every lane of every cut must then be read by
    vectorized sets alone, and the rank of every summed lane be known,
    or None is returned.

    Lanes of other dtypes than float32 and float64 (or of no one dtype,
    ``dtype`` None) are left as they are (``symbol``, or None when
    ``ragged``): MXNet's ``dot`` has no CPU kernel for them."""
    if dtype is None or np.dtype(dtype) not in (np.float32, np.float64):
        return None if ragged else symbol
    graph = json.loads(symbol_json(symbol))
    nodes = graph['nodes']
    lanes = _find_lanes(nodes, lane_ndims)
    sums = _closed_sums(nodes, graph['heads'], lanes)
    if ragged:
        closed = _all_cuts_closed(nodes, graph['heads'], sums) and \
            all(group.ndim for group in sums.values())      # the zero row's rank
        return _rewrite(graph, sums, dtype, training, ragged=True) \
            if closed else None
    if not sums:
        return symbol
    return _rewrite(graph, sums, dtype, training)


SEGMENT = 'dynbatch_segment'
"""Ragged lanes (:func:`vectorize_lists` with ``ragged``) read two more
inputs: ``SEGMENT``, the list (0..N-1) of each of the M elements, int32;
and :data:`PADDED`, ``(K, N)`` int32, the position among the M elements of
element k of list n, or M where list n is shorter.  A value every lane
reads is repeated per element by ``take`` along ``SEGMENT``; a sum over
the lanes appends one row of zeros to the M elements (a constant, so no
element's value, NaN or not, reaches a list that does not hold it), takes
them along ``PADDED`` into ``(K, N, ...)`` and sums by the ``dot`` with K
ones.  (A ``SequenceMask`` over the ``(K, N, ...)`` rows did the zeroing
before: ~4x the cost of the row's ``Concat`` at SICK's steps of ~170
lists, and 1.5-2.5% of a SICK minibatch, inference and training, in an
in-process A/B.)

Training once summed small steps' lists by one ``dot`` with an ``(N, M)``
incidence matrix instead (one op and its backward in place of four, 7-13%
of a training minibatch's op time at SICK minibatch 25), but its zeros
meet every element, so a NaN or an infinity in one list reached every
list of the step (0 x inf is NaN), where per-sample execution keeps it in
its own: a tree that overflowed made every tree's output NaN."""
PADDED = 'dynbatch_padded'
"""Input of ragged lanes: ``(K, N)`` positions of the elements, M for a
missing one (see :data:`SEGMENT`)."""


def _all_cuts_closed(nodes, heads, sums):
    """Whether every cut's lanes are read only by ``sums`` and the copies in
    their sets (so the cuts themselves can go): what ragged lanes need."""
    readers = _sums_and_copies(sums)
    cuts = {i for i, node in enumerate(nodes)
            if node['op'] == 'SliceChannel' and node['name'].startswith(CUT)}
    if not cuts or not sums:
        return False
    if any(entry[0] in cuts for entry in heads):
        return False
    return all(i in readers for i, node in enumerate(nodes)
               if any(entry[0] in cuts for entry in node['inputs']))


class _Set:
    """One set of per-lane copies: ``members[k]`` is the node of lane ``k``
    (a cut: its index, for every ``k``), ``inputs`` per input slot the
    :class:`_Set` read or None (a shared value), ``ndim`` the axes of one
    lane (None when unknown)."""
    __slots__ = ('width', 'members', 'inputs', 'ndim', 'valid')

    def __init__(self, width, inputs, ndim):
        self.width, self.inputs, self.ndim = width, inputs, ndim
        self.members = {}
        self.valid = True


def _find_lanes(nodes, lane_ndims):
    """``{(node, output): (set, lane)}`` for every value that is one lane
    of a cut or of a complete, valid set of copies."""
    lanes, sets = {}, {}
    for i, node in enumerate(nodes):
        op = node['op']
        if op == 'SliceChannel' and node['name'].startswith(CUT) and \
                node['attrs'].get('axis') == '0':
            width = int(node['attrs']['num_outputs'])
            cut = _Set(width, (), lane_ndims.get(node['name']))
            cut.members = dict.fromkeys(range(width), i)
            for k in range(width):
                lanes[(i, k)] = (cut, k)
            continue
        read = [lanes.get((entry[0], entry[1])) for entry in node['inputs']]
        if op == 'null' or not any(read):
            continue
        ins = {lane for _, lane in filter(None, read)}
        widths = {s.width for s, _ in filter(None, read)}
        ndim = _lane_ndim(node, read)
        if len(ins) != 1 or len(widths) != 1 or ndim is False:
            continue
        key = (op, json.dumps(node.get('attrs', {}), sort_keys=True),
               tuple(id(r[0]) if r else (entry[0], entry[1])
                     for r, entry in zip(read, node['inputs'])))
        group = sets.get(key)
        if group is None:
            group = sets[key] = _Set(widths.pop(), [r[0] if r else None for r in read], ndim)
        lane = ins.pop()
        if lane in group.members:
            group.valid = False      # two copies for one lane: leave them be
        group.members[lane] = i
        lanes[(i, 0)] = (group, lane)
    # only sets with every lane, made from valid sets, are lanes
    return {entry: (s, k) for entry, (s, k) in lanes.items() if _complete(s)}


def _lane_ndim(node, read):
    """The axes of one lane of ``node``'s output, None when unknown, or
    False when the op does not act on each lane alone."""
    op = node['op']
    ndim = next(s.ndim for s, _ in filter(None, read))
    if op in UNARY:
        return ndim
    if op in BINARY:
        return ndim if len(read) == 2 else False
    if op == 'FullyConnected' and read[0] and not any(read[1:]):
        flatten = node.get('attrs', {}).get('flatten', 'True') in ('True', 'true', '1')
        return 2 if ndim == 2 else (ndim if not flatten and ndim else False)
    return False


def _complete(group):
    """Whether ``group`` has a copy for every lane, one each, and so has
    every set it reads."""
    if not group.valid or len(group.members) != group.width:
        return False
    return all(_complete(s) for s in group.inputs if s is not None)


def _closed_sums(nodes, heads, lanes):
    """``{add_n node: set}`` for each ``add_n`` of all lanes of one set
    whose sets (that one and those it reads, up to the cuts) are read by
    nothing else, so that their copies can go."""
    readers = graph_readers(nodes, heads)
    sums = {}
    for i, node in enumerate(nodes):
        if node['op'] != 'add_n':
            continue
        read = [lanes.get((entry[0], entry[1])) for entry in node['inputs']]
        if not read or not all(read) or len({id(s) for s, _ in read}) != 1:
            continue
        group = read[0][0]
        if sorted(k for _, k in read) == list(range(group.width)):
            sums[i] = group
    while True:   # drop sums whose copies are read elsewhere, until none is
        allowed = _sums_and_copies(sums)
        bad = [i for i, group in sums.items()
               if any(r not in allowed for s in _sets_below([group]) for m in _copies(s)
                      for r in readers.get(m, ()))]
        if not bad:
            return sums
        for i in bad:
            del sums[i]


def _sums_and_copies(sums):
    """The nodes that may read the lanes of ``sums``' sets: the sums and
    the copies in those sets and the sets they read."""
    return set(sums) | {m for s in _sets_below(sums.values()) for m in _copies(s)}


def _copies(group):
    """The copy nodes of ``group`` (none for a cut: it stays, if read)."""
    return group.members.values() if group.inputs else ()


def _sets_below(groups):
    """``groups`` and every set they read, each once, inputs first."""
    out, seen = [], set()

    def visit(group):
        if id(group) in seen:
            return
        seen.add(id(group))
        for s in group.inputs:
            if s is not None:
                visit(s)
        out.append(group)
    for group in groups:
        visit(group)
    return out


def _rewrite(graph, sums, dtype, training, ragged=False):
    """The graph with one node per needed set, emitted after its last copy,
    and every sum in ``sums`` reading it (ragged: see :data:`SEGMENT`)."""
    nodes = graph['nodes']
    needed = _sets_below(sums.values())
    last = {max(group.members.values()): group for group in needed}
    out, moved, vector, expanded, ones, inputs = [], {}, {}, {}, {}, {}

    def entry(old):
        return moved_entry(old, moved)

    def add(op, attrs, inputs, name=None):
        out.append({'op': op, 'name': name or 'dynbatch_lanes%d' % len(out), 'attrs': attrs,
                    'inputs': inputs})
        return [len(out) - 1, 0, 0]

    def ones_shaped(shape):
        if shape not in ones:
            ones[shape] = add('_ones', {'shape': str(shape), 'dtype': np.dtype(dtype).name}, [])
        return ones[shape]

    def ragged_input(name):
        if name not in inputs:
            inputs[name] = add('null', {}, [], name)
        return inputs[name]

    def shared(old, width):
        """``old`` with a length-1 axis 0, to broadcast over the lanes; for
        training, ``(K, 1) ones . (1, N, ...)``: ``old`` once per lane;
        ragged, ``old`` taken once per element."""
        key = (old[0], old[1])
        if ragged:
            if key not in expanded:
                expanded[key] = add('take', {'axis': '0', 'mode': 'clip'},
                                    [entry(old), ragged_input(SEGMENT)])
            return expanded[key]
        if key not in expanded:
            expanded[key] = add('expand_dims', {'axis': '0'}, [entry(old)])
        if not training:
            return expanded[key]
        if (key, width) not in expanded:
            expanded[(key, width)] = add('dot', {}, [ones_shaped((width, 1)), expanded[key]])
        return expanded[(key, width)]

    for i, node in enumerate(nodes):
        if i in sums:       # (K,) ones . (K, N, ...) lanes -> (N, ...)
            lanes = vector[id(sums[i])]
            if ragged:      # the M elements and a zero row, laid out (K, N, ...)
                # a lane's other axes are left to shape inference (-1: unknown,
                # under legacy and numpy shape semantics alike; 0 is a real
                # zero under numpy's)
                zero = add('_zeros', {'shape': str((1,) + (-1,) * (sums[i].ndim - 1)),
                                      'dtype': np.dtype(dtype).name}, [])
                lanes = add('Concat', {'dim': '0', 'num_args': '2'}, [lanes, zero])
                lanes = add('take', {'axis': '0', 'mode': 'clip'},
                            [lanes, ragged_input(PADDED)])
            moved[i] = add('dot', {}, [ones_shaped((sums[i].width,)), lanes],
                           node['name'])[0]
            continue
        node = dict(node, inputs=[entry(e) for e in node['inputs']])
        moved[i] = len(out)
        out.append(node)
        group = last.get(i)
        if group is None:
            continue
        if not group.inputs:        # a cut: its input is all lanes already
            vector[id(group)] = out[moved[i]]['inputs'][0]
            continue
        original = nodes[i]
        attrs = dict(original.get('attrs', {}))
        op = original['op']
        ins = [vector[id(s)] if s is not None else None for s in group.inputs]
        if op == 'FullyConnected':
            attrs['flatten'] = 'False'
            ins = [ins[0]] + [entry(e) for e in original['inputs'][1:]]
        elif op in BINARY and None in ins:
            op = op if training or ragged else BINARY[op]
            ins = [v if v is not None else shared(e, group.width)
                   for v, e in zip(ins, original['inputs'])]
        vector[id(group)] = add(op, attrs, ins)
    return load_graph(graph, out, [entry(e) for e in graph['heads']])
