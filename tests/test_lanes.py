"""The list-lane pass (gluon_dynbatch.lanes): what it rewrites, what it
leaves alone, and that rewritten graphs compute the same values and
gradients as the per-element graphs they replace."""
import contextlib
import json
import threading
import time

import mxnet as mx
import numpy as np
import pytest
from hypothesis import given, strategies as st
from mxnet import autograd

import gluon_dynbatch as dyb
from gluon_dynbatch import execute, lanes, lower
from gluon_dynbatch.lanes import CUT, vectorize_lists

from test_equivalence import make_tree_model, pair_forward, random_pairs

K, N, D, H = 3, 5, 4, 6


def cut(name, width=K, item=0):
    """The lanes of input ``name`` (``(width, N, D)``), cut as lower.py cuts."""
    parts = mx.sym.SliceChannel(mx.sym.var(name), num_outputs=width, axis=0,
                                squeeze_axis=True, name='%s%d' % (CUT, item))
    return [parts[k] for k in range(width)]


def ops(symbol):
    return [node['op'] for node in json.loads(symbol.tojson())['nodes'] if node['op'] != 'null']


def forget_products(hs, cs, x, w):
    """A child-sum Tree-LSTM's per-child forget products sigmoid(x + W h_k) * c_k."""
    return [mx.sym.Activation(x + mx.sym.FullyConnected(h, w, num_hidden=H, no_bias=True),
                              act_type='sigmoid') * c for h, c in zip(hs, cs)]


def child_sum(hs, cs, x, w):
    """Their sum, and the plain sum of the h_k."""
    return mx.sym.Group([mx.sym.add_n(*forget_products(hs, cs, x, w)), mx.sym.add_n(*hs)])


def evaluate(symbol, shapes, seed=0):
    """Outputs and input gradients of ``symbol`` on random inputs, with a
    random weighting of the outputs as the loss."""
    rng = np.random.RandomState(seed)
    names = symbol.list_inputs()
    # by name, so that graphs listing their inputs in other orders get the same values
    values = {name: mx.nd.array(rng.uniform(-1, 1, shapes[name])) for name in sorted(names)}
    args = [values[name] for name in names]
    for arg in args:
        arg.attach_grad()
    op = mx.nd.CachedOp(symbol)
    with autograd.record():
        outs = op(*args)
        outs = outs if isinstance(outs, (list, tuple)) else [outs]
        loss = sum((o * mx.nd.array(rng.uniform(-1, 1, o.shape))).sum() for o in outs)
    loss.backward()
    return [o.asnumpy() for o in outs], {n: a.grad.asnumpy() for n, a in zip(names, args)}


def assert_same_function(before, after, shapes):
    (out_a, grad_a), (out_b, grad_b) = evaluate(before, shapes), evaluate(after, shapes)
    for a, b in zip(out_a, out_b):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)
    assert sorted(grad_a) == sorted(grad_b)
    for name in grad_a:
        np.testing.assert_allclose(grad_b[name], grad_a[name], rtol=1e-5, atol=1e-6,
                                   err_msg=name)


SHAPES = {'h': (K, N, D), 'c': (K, N, H), 'x': (N, H), 'w': (H, D)}


@pytest.mark.parametrize('training', [False, True])
def test_per_child_work_runs_once_over_all_children(training):
    before = child_sum(cut('h'), cut('c', item=1), mx.sym.var('x'), mx.sym.var('w'))
    after = vectorize_lists(before, {CUT + '0': 2, CUT + '1': 2}, np.float32, training)
    assert ops(before).count('FullyConnected') == K
    # one op per set of copies, whatever K; the cuts are gone
    assert ops(after).count('FullyConnected') == 1
    assert ops(after).count('Activation') == 1
    assert 'SliceChannel' not in ops(after) and 'add_n' not in ops(after)
    # the shared x meets the lanes broadcast (inference) or repeated by a
    # dot (training), besides the dots of the two sums
    assert ('broadcast_add' in ops(after)) != training
    assert ops(after).count('dot') == 2 + training
    assert_same_function(before, after, SHAPES)


def test_copies_read_elsewhere_are_left_alone():
    hs, cs = cut('h'), cut('c', item=1)
    kept = forget_products(hs, cs, mx.sym.var('x'), mx.sym.var('w'))
    # the first child's forget product is also an output: that sum stays
    # per child, the plain sum of the h_k still runs over all children
    before = mx.sym.Group([mx.sym.add_n(*kept), mx.sym.add_n(*hs), kept[0]])
    after = vectorize_lists(before, {CUT + '0': 2, CUT + '1': 2}, np.float32)
    assert ops(after).count('FullyConnected') == K
    assert ops(after).count('add_n') == 1 and ops(after).count('dot') == 1
    assert_same_function(before, after, SHAPES)


def test_unrecognised_or_incomplete_sets_are_left_alone():
    hs = cut('h')
    w = mx.sym.var('w')
    cases = [
        # a different op per child
        mx.sym.add_n(mx.sym.relu(hs[0]), mx.sym.tanh(hs[1]), hs[2]),
        # one child left out of the sum
        mx.sym.add_n(mx.sym.relu(hs[0]), mx.sym.relu(hs[1])),
        # an op not known to act on each lane alone
        mx.sym.add_n(*[mx.sym.softmax(h) for h in hs]),
        # a different weight per child
        mx.sym.add_n(*[mx.sym.FullyConnected(h, mx.sym.var('w%d' % k), num_hidden=H,
                                             no_bias=True) for k, h in enumerate(hs)]),
        # two copies for one lane
        mx.sym.add_n(mx.sym.relu(hs[0]), mx.sym.relu(hs[0]), mx.sym.relu(hs[1])),
    ]
    for before in cases:
        after = vectorize_lists(before, {CUT + '0': 2}, np.float32)
        assert after is before
    # a FullyConnected that flattens 3-D lanes is not one over the last axis
    flat = mx.sym.add_n(*[mx.sym.FullyConnected(h, w, num_hidden=H, no_bias=True)
                          for h in hs])
    assert vectorize_lists(flat, {CUT + '0': 3}, np.float32) is flat
    assert 'dot' in ops(vectorize_lists(flat, {CUT + '0': 2}, np.float32))


@pytest.mark.parametrize('training', [False, True])
def test_shared_value_on_the_left_and_lane_by_lane_ops(training):
    hs, cs = cut('h'), cut('c', item=1)
    x = mx.sym.var('x')
    w = mx.sym.var('w')
    before = mx.sym.add_n(*[(x - mx.sym.FullyConnected(h, w, num_hidden=H, no_bias=True))
                            * mx.sym.tanh(c) / 3 for h, c in zip(hs, cs)])
    after = vectorize_lists(before, {CUT + '0': 2, CUT + '1': 2}, np.float32, training)
    assert 'add_n' not in ops(after)
    assert ('broadcast_sub' in ops(after)) != training
    assert_same_function(before, after, SHAPES)


ELEMENT_OPS = {
    'sigmoid': lambda v: mx.sym.Activation(v, act_type='sigmoid'),
    'tanh': lambda v: mx.sym.Activation(v, act_type='tanh'),
    'abs': mx.sym.abs, 'square': mx.sym.square, 'negative': mx.sym.negative,
    'scale': lambda v: v * 0.7, 'shift': lambda v: v + 0.3,
}
PAIR_OPS = {'add': mx.sym.elemwise_add, 'sub': mx.sym.elemwise_sub,
            'mul': mx.sym.elemwise_mul, 'max': mx.sym._internal._maximum}


@st.composite
def lane_programs(draw):
    """A random per-element program: its width, and per op ``(kind, name,
    operand, shared on the left)``; operands index earlier values, where
    values 0 and 1 are the two cut inputs and a negative one a shared value."""
    width = draw(st.integers(2, 4))
    program = []
    for step in range(draw(st.integers(1, 6))):
        kind = draw(st.sampled_from(['unary', 'pair', 'pair', 'fc']))
        name = draw(st.sampled_from(sorted(ELEMENT_OPS if kind == 'unary' else PAIR_OPS)))
        operand = draw(st.integers(-2, step + 1))   # -2, -1: x, y (shared)
        program.append((kind, name, operand, draw(st.booleans())))
    return width, program


def build_lane_program(width, program):
    """Per lane, the program's ops on that lane's values, then the sum over
    lanes of the last value and of the first."""
    hs, cs = cut('h', width), cut('c', width, item=1)
    shared = {-2: mx.sym.var('x'), -1: mx.sym.var('y')}
    weight = mx.sym.var('w')
    lanes = []
    for h, c in zip(hs, cs):
        values = [h, c]
        for kind, name, operand, left in program:
            last = values[-1]
            if kind == 'unary':
                values.append(ELEMENT_OPS[name](last))
            elif kind == 'fc':
                values.append(mx.sym.FullyConnected(last, weight, num_hidden=D,
                                                    no_bias=True))
            else:
                other = shared[operand] if operand < 0 else values[operand]
                values.append(PAIR_OPS[name](*((other, last) if left else (last, other))))
        lanes.append(values)
    return mx.sym.Group([mx.sym.add_n(*[v[-1] for v in lanes]),
                         mx.sym.add_n(*[v[2] for v in lanes])])


@given(lane_programs())
def test_random_lane_programs_compute_the_same(drawn):
    """Random chains of elementwise ops, shared operands and a shared-weight
    ``FullyConnected`` on each element: vectorized, in either form, they
    give the per-element graph's values and input gradients."""
    width, program = drawn
    before = build_lane_program(width, program)
    shapes = {'h': (width, N, D), 'c': (width, N, D), 'x': (N, D), 'y': (N, D), 'w': (D, D)}
    for training in (False, True):
        after = vectorize_lists(before, {CUT + '0': 2, CUT + '1': 2}, np.float32, training)
        assert 'add_n' not in ops(after)            # every set was complete and closed
        # one op per set of copies (the program's), not one per element
        assert ops(after).count('FullyConnected') == sum(kind == 'fc' for kind, *_ in program)
        assert_same_function(before, after, shapes)


@pytest.mark.parametrize('strategy', ['depth', 'agenda', 'cached', 'auto'])
def test_inference_uses_lane_programs_with_per_sample_results(strategy):
    node, head = make_tree_model(pad_lists=True)
    pairs = random_pairs(np.random.RandomState(5), 8)
    forward = pair_forward(node, head, pairs)
    expected = [o.asnumpy() for o in forward()]
    for _ in range(2):          # the cached plan's miss, then its hit
        with dyb.batching(strategy):
            outs = forward()
        for want, got in zip(expected, outs):
            np.testing.assert_allclose(got.data.asnumpy(), want, rtol=1e-4, atol=1e-5)
    lane_ops = [op for sig in node.signatures()
                for program in sig.inference_programs.values() for op in ops(program.symbol)]
    assert 'dot' in lane_ops          # some child sums ran over all children
    assert 'broadcast_add' in lane_ops
    assert not any(sig.programs for sig in node.signatures())


def outputs_and_gradients(forward, params, strategy, training=True):
    """The pairs' outputs, and with ``training`` the parameters' gradients
    of a weighted sum of them: per sample (``strategy`` None) or batched."""
    with autograd.record() if training else contextlib.nullcontext():
        if strategy is None:
            outs = forward()
        else:
            with dyb.batching(strategy):
                outs = [o.data for o in forward()]
        loss = sum((o * (k + 1)).sum() for k, o in enumerate(outs))
    if training:
        loss.backward()
    return [o.asnumpy() for o in outs], \
        [p.grad().asnumpy().copy() for p in params] if training else []


@pytest.mark.parametrize('strategy', ['depth', 'cached'])
def test_training_uses_lane_programs_with_per_sample_gradients(strategy):
    node, head = make_tree_model(pad_lists=True)
    pairs = random_pairs(np.random.RandomState(5), 6)
    forward = pair_forward(node, head, pairs)
    params = list(node.collect_params().values()) + list(head.collect_params().values())

    want_outs, want_grads = outputs_and_gradients(forward, params, None)
    for _ in range(2):          # the cached plan's miss, then its hit
        got_outs, got_grads = outputs_and_gradients(forward, params, strategy)
        for want, got in zip(want_outs, got_outs):
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
        for param, want, got in zip(params, want_grads, got_grads):
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5, err_msg=param.name)
    train_ops = [op for sig in node.signatures()
                 for program in sig.programs.values() for op in ops(program.symbol)]
    assert 'dot' in train_ops
    # shared values are repeated by a dot, not broadcast from a new axis (the
    # training programs' adds are all broadcast_add: lower.adds_by_broadcast)
    for sig in node.signatures():
        for program in sig.programs.values():
            nodes = json.loads(program.symbol.tojson())['nodes']
            assert not any(node['op'].startswith('broadcast_') and
                           any(nodes[entry[0]]['op'] == 'expand_dims' for entry in node['inputs'])
                           for node in nodes)
            assert 'elemwise_add' not in ops(program.symbol)
    assert not any(sig.inference_programs for sig in node.signatures())


def test_switch_turns_lane_programs_off(monkeypatch):
    monkeypatch.setattr(lower, 'VECTORIZE_LISTS', False)
    node, head = make_tree_model(pad_lists=True)
    with dyb.batching('depth'):
        pair_forward(node, head, random_pairs(np.random.RandomState(5), 4))()
    assert not any('dot' in ops(program.symbol) for sig in node.signatures()
                   for program in sig.inference_programs.values())


# --- ragged lanes: lists of different lengths, no padding elements ---------

def ragged_inputs(lengths, width):
    """``segment`` and ``padded`` (see lanes.SEGMENT) of lists of
    ``lengths`` in a step ``width`` elements wide, as NDArrays.
    A missing element's position is M, the zero row after the M elements."""
    lengths = np.asarray(lengths, dtype=np.int32)
    ends = np.cumsum(lengths)
    lane = np.arange(width)[:, None]
    segment = np.repeat(np.arange(len(lengths)), lengths)
    return {lanes.SEGMENT: mx.nd.array(segment, dtype='int32'),
            lanes.PADDED: mx.nd.array(np.where(lane < lengths, ends - lengths + lane,
                                               len(segment)), dtype='int32')}


def ragged_and_reference(width, program, lengths, seed=0, poison=None):
    """Outputs and input gradients of ``program`` on lists of ``lengths``:
    once ragged (one call), once per list through the per-element graph of
    that list's length.  ``poison`` puts that value in every input row of the
    first list."""
    rng = np.random.RandomState(seed)
    total, count = sum(lengths), len(lengths)
    values = {'h': rng.uniform(-1, 1, (total, D)), 'c': rng.uniform(-1, 1, (total, D)),
              'x': rng.uniform(-1, 1, (count, D)), 'y': rng.uniform(-1, 1, (count, D)),
              'w': rng.uniform(-1, 1, (D, D))}
    if poison is not None:
        for name in 'hc':
            values[name][:lengths[0]] = poison
        for name in 'xy':
            values[name][0] = poison
    weights = [rng.uniform(-1, 1, (count, D)) for _ in range(2)]
    ragged = vectorize_lists(build_lane_program(width, program),
                             {CUT + '0': 2, CUT + '1': 2}, np.float32, ragged=True)
    assert ragged is not None
    assert '_zeros' in ops(ragged) and 'SequenceMask' not in ops(ragged)
    starts = np.cumsum([0] + list(lengths))

    def run(use_ragged):
        arrays = {name: mx.nd.array(value) for name, value in values.items()}
        for array in arrays.values():
            array.attach_grad()
        with autograd.record():
            if use_ragged:
                feed = dict(arrays, **ragged_inputs(lengths, width))
                outs = mx.nd.CachedOp(ragged)(*[feed[n] for n in ragged.list_inputs()])
            else:
                per_list = []
                for n, length in enumerate(lengths):
                    symbol = build_lane_program(length, program) if length > 1 else None
                    rows = mx.nd.arange(starts[n], starts[n] + length)
                    feed = {'x': arrays['x'][n:n + 1], 'y': arrays['y'][n:n + 1],
                            'w': arrays['w']}
                    for name in 'hc':    # (length, 1, D): one list, element-major
                        feed[name] = mx.nd.take(arrays[name], rows).expand_dims(1)
                    if symbol is None:   # a list of one: the element's own value
                        symbol = build_lane_program(2, program)
                        for name in 'hc':
                            feed[name] = mx.nd.concat(feed[name], feed[name] * 0, dim=0)
                        per_list.append(_single(program, feed))
                        continue
                    per_list.append(mx.nd.CachedOp(symbol)(
                        *[feed[name] for name in symbol.list_inputs()]))
                outs = [mx.nd.concat(*[o[k] for o in per_list], dim=0) for k in range(2)]
            loss = sum((o * mx.nd.array(w)).sum() for o, w in zip(outs, weights))
        loss.backward()
        return [o.asnumpy() for o in outs], {n: a.grad.asnumpy() for n, a in arrays.items()}
    return run(True), run(False)


def _single(program, feed):
    """The program on a list of one element (its lane 0), as NDArray ops."""
    h, c = feed['h'][0], feed['c'][0]
    shared = {-2: feed['x'], -1: feed['y']}
    values = [h, c]
    nd_ops = {'sigmoid': lambda v: mx.nd.Activation(v, act_type='sigmoid'),
              'tanh': lambda v: mx.nd.Activation(v, act_type='tanh'),
              'abs': mx.nd.abs, 'square': mx.nd.square, 'negative': mx.nd.negative,
              'scale': lambda v: v * 0.7, 'shift': lambda v: v + 0.3}
    pairs = {'add': mx.nd.elemwise_add, 'sub': mx.nd.elemwise_sub, 'mul': mx.nd.elemwise_mul,
             'max': mx.nd.maximum}
    for kind, name, operand, left in program:
        last = values[-1]
        if kind == 'unary':
            values.append(nd_ops[name](last))
        elif kind == 'fc':
            values.append(mx.nd.FullyConnected(last, feed['w'], num_hidden=D, no_bias=True))
        else:
            other = shared[operand] if operand < 0 else values[operand]
            values.append(pairs[name](*((other, last) if left else (last, other))))
    return [values[-1], values[2]]


@given(lane_programs(), st.lists(st.integers(1, 4), min_size=1, max_size=6))
def test_random_ragged_lane_programs_equal_each_lists_own_graph(drawn, lengths):
    """Ragged lanes give every list what the per-element graph of its own
    length gives (values and input gradients): no padding element is
    computed, so none has to be neutral."""
    width, program = drawn
    width = max(width, max(lengths), 2)
    (out_r, grad_r), (out_p, grad_p) = ragged_and_reference(width, program, lengths)
    for got, want in zip(out_r, out_p):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    for name in grad_p:
        np.testing.assert_allclose(grad_r[name], grad_p[name], rtol=1e-4, atol=1e-5,
                                   err_msg=name)


def test_ragged_lanes_keep_a_lists_nan_to_itself():
    """A short list's missing slots read a constant zero row, not an
    element: a NaN in the first list reaches no other list (an incidence
    ``dot`` would spread it, 0 x NaN)."""
    program = [('fc', 'fc', 0, False), ('pair', 'mul', 1, False)]
    lengths = [2, 1, 3, 1]
    (out, _), _ = ragged_and_reference(3, program, lengths, poison=np.nan)
    for o in out:
        assert np.isnan(o[0]).all() and np.isfinite(o[1:]).all()


@pytest.mark.parametrize('numpy_shapes', [False, True])
def test_ragged_sums_of_lanes_with_more_axes(numpy_shapes):
    """Lanes of rank 3 ((M, 2, D) elements): the zero row's other axes come
    from shape inference, under MXNet's legacy shape semantics and numpy's
    (where a 0 in a shape is a real zero), and each list's sums are its own
    elements'."""
    hs, cs = cut('h'), cut('c', item=1)
    symbol = mx.sym.Group([mx.sym.add_n(*[mx.sym.Activation(h, act_type='sigmoid') * c
                                          for h, c in zip(hs, cs)]), mx.sym.add_n(*hs)])
    ragged = vectorize_lists(symbol, {CUT + '0': 3, CUT + '1': 3}, np.float32, ragged=True)
    assert ragged is not None and ops(ragged).count('_zeros') == 2
    lengths = [2, 1, 3]
    rng = np.random.RandomState(3)
    h, c = (rng.uniform(-1, 1, (sum(lengths), 2, D)).astype(np.float32) for _ in 'hc')
    feed = dict(ragged_inputs(lengths, K), h=mx.nd.array(h), c=mx.nd.array(c))
    with mx.util.np_shape(numpy_shapes):
        kept, total = (o.asnumpy() for o in mx.nd.CachedOp(ragged)(
            *[feed[name] for name in ragged.list_inputs()]))
    starts = np.cumsum([0] + lengths)
    for n, (a, b) in enumerate(zip(starts[:-1], starts[1:])):
        np.testing.assert_allclose(total[n], h[a:b].sum(axis=0), rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(kept[n], (c[a:b] / (1 + np.exp(-h[a:b]))).sum(axis=0),
                                   rtol=1e-5, atol=1e-6)


def test_ragged_needs_every_lane_closed():
    hs, cs = cut('h'), cut('c', item=1)
    kept = forget_products(hs, cs, mx.sym.var('x'), mx.sym.var('w'))
    closed = child_sum(hs, cs, mx.sym.var('x'), mx.sym.var('w'))
    open_ = mx.sym.Group([mx.sym.add_n(*kept), mx.sym.add_n(*hs), kept[0]])
    ndims = {CUT + '0': 2, CUT + '1': 2}
    assert vectorize_lists(open_, ndims, np.float32, ragged=True) is None
    after = vectorize_lists(closed, ndims, np.float32, ragged=True)
    assert 'SliceChannel' not in ops(after) and ops(after).count('_zeros') == 2


@pytest.fixture
def ragged_always(monkeypatch):
    """Padding made so costly that every mixed-length group runs ragged."""
    from gluon_dynbatch import plan
    monkeypatch.setitem(plan.PADDING_COST, 'elem_us', 1e6)
    monkeypatch.setitem(plan.PADDING_COST, 'family_step_us', {})


@pytest.mark.parametrize('training', [False, True])
@pytest.mark.parametrize('strategy', ['depth', 'agenda', 'cached'])
def test_ragged_steps_equal_per_sample(strategy, training, ragged_always):
    """Node steps over children lists of every length run ragged, in
    inference and training, and for a cached plan on its miss, its first
    hit (recipes learned) and compiled; values and gradients equal
    per-sample execution."""
    node, head = make_tree_model(pad_lists=True)
    pairs = random_pairs(np.random.RandomState(9), 8)
    forward = pair_forward(node, head, pairs)
    params = list(node.collect_params().values()) + list(head.collect_params().values())
    chosen = dyb.CachedPlan(compile_after=2) if strategy == 'cached' else strategy
    want_outs, want_grads = outputs_and_gradients(forward, params, None, training)
    runs = []
    for _ in range(4 if strategy == 'cached' else 1):
        got_outs, got_grads = outputs_and_gradients(forward, params, chosen, training)
        runs.append(dyb.stats()['last']['strategy'])
        for want, got in zip(want_outs, got_outs):
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
        for param, want, got in zip(params, want_grads, got_grads):
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5, err_msg=param.name)
    programs = [p for sig in node.signatures()
                for p in (sig.programs if training else sig.inference_programs).items()]
    assert any(way and way[0] == 'ragged' for pattern, _ in programs for way in pattern)
    assert any('_zeros' in ops(program.symbol) for _, program in programs)
    if strategy == 'cached':    # compiled for inference; replayed in training
        assert runs[-1] == ('cached' if training else 'cached-compiled')


class TwoListSums(mx.gluon.HybridBlock):
    """``tanh(x + sum_k A a_k + sum_k B b_k)``: two list arguments, each
    read only by per-element ops that are summed, so a family of its calls
    may run ragged, whatever the lengths of each list."""

    def __init__(self, units):
        super().__init__()
        with self.name_scope():
            self.a = mx.gluon.nn.Dense(units, in_units=units, use_bias=False)
            self.b = mx.gluon.nn.Dense(units, in_units=units, use_bias=False)

    def hybrid_forward(self, F, x, a, b):
        for dense, elements in ((self.a, a), (self.b, b)):
            if elements:    # each list summed by itself: its lanes close (see lanes)
                x = x + F.add_n(*[dense(e) for e in elements])
        return F.Activation(x, act_type='tanh')


@pytest.mark.parametrize('training', [False, True])
@pytest.mark.parametrize('strategy', ['depth', 'cached'])
def test_lists_of_different_lengths_in_a_call_run_padded(strategy, training, ragged_always,
                                                          monkeypatch):
    """A step that may run ragged gathers its lists' elements only; when
    its calls' two lists differ in length (3 and 2, 2 and 3 elements) it
    lays them out padded after all, with the zero row appended to the
    gathered sources (execute._padded_index), and a cached plan replays
    and compiles that; values and gradients equal per-sample execution."""
    block = dyb.DynBatchBlock(TwoListSums(D), pad_lists=True)
    block.initialize(mx.init.Uniform(0.5))
    rng = np.random.RandomState(3)
    xs = [rng.uniform(-1, 1, (1, D)).astype(np.float32) for _ in range(12)]   # host rows
    lengths = [(3, 2), (2, 3), (3, 2), (2, 3), (3, 3)]

    def forward():
        values = [block(x, [], []) for x in xs[:6]]
        for k, x in enumerate(xs[6:]):
            len_a, len_b = lengths[k % len(lengths)]
            values.append(block(x, values[k:k + len_a], values[k + 1:k + 1 + len_b]))
        return values[6:]
    padded = []
    real_padded_index = execute._padded_index
    monkeypatch.setattr(execute, '_padded_index', lambda *args: padded.append(
        real_padded_index(*args)) or padded[-1])
    _matches_per_sample(forward, list(block.collect_params().values()), strategy, training,
                        rtol=1e-5, atol=1e-6)
    assert any(zero is not None for _, zero in padded), 'no list was padded: test moot'


@pytest.mark.parametrize('training', [False, True])
def test_a_ragged_list_before_a_list_of_one_element_replays(training, ragged_always):
    """A ragged step whose second list has one element in every call (a
    padded width of 1, gathered as a plain argument): replaying its recipe
    read that argument's recipe after the ragged list's and forgot the
    ragged inputs ('NoneType' object is not subscriptable, found by
    benchmarks/bench_graph.py); values and gradients equal per sample."""
    block = dyb.DynBatchBlock(TwoListSums(D), pad_lists=True)
    block.initialize(mx.init.Uniform(0.5))
    rng = np.random.RandomState(4)
    xs = [rng.uniform(-1, 1, (1, D)).astype(np.float32) for _ in range(12)]

    def forward():
        values = [block(x, [], []) for x in xs[:6]]
        return [block(x, values[k:k + 1 + k % 3], values[k + 2:k + 3])
                for k, x in enumerate(xs[6:])]
    _matches_per_sample(forward, list(block.collect_params().values()), 'cached', training,
                        rtol=1e-5, atol=1e-6)
    programs = [pattern for sig in block.signatures()
                for pattern in (sig.programs if training else sig.inference_programs)]
    assert any(way and way[0] == 'ragged' for pattern in programs for way in pattern), \
        'no step ran ragged: test moot'


def _tree_model_matches_per_sample(strategy, training, seed):
    """A Tree-LSTM model run on 8 random pairs by ``strategy`` ('depth', or
    'cached', four times so that the plan compiles): values and gradients
    equal per-sample execution.  Returns the model's node block."""
    node, head = make_tree_model(pad_lists=True)
    forward = pair_forward(node, head, random_pairs(np.random.RandomState(seed), 8))
    params = list(node.collect_params().values()) + list(head.collect_params().values())
    _matches_per_sample(forward, params, strategy, training)
    return node


def _matches_per_sample(forward, params, strategy, training, rtol=1e-4, atol=1e-5):
    """``forward`` run by ``strategy`` ('depth', or 'cached', four times so
    that the plan compiles, in inference) gives per-sample execution's values and, when
    ``training``, gradients of ``params``."""
    chosen = dyb.CachedPlan(compile_after=2) if strategy == 'cached' else strategy
    want_outs, want_grads = outputs_and_gradients(forward, params, None, training)
    for _ in range(4 if strategy == 'cached' else 1):
        got_outs, got_grads = outputs_and_gradients(forward, params, chosen, training)
        for want, got in zip(want_outs, got_outs):
            np.testing.assert_allclose(got, want, rtol=rtol, atol=atol)
        for param, want, got in zip(params, want_grads, got_grads):
            np.testing.assert_allclose(got, want, rtol=rtol, atol=atol, err_msg=param.name)
    if strategy == 'cached':    # compiled for inference; replayed in training
        assert dyb.stats()['last']['strategy'] == ('cached' if training else 'cached-compiled')


@pytest.mark.parametrize('training', [False, True])
@pytest.mark.parametrize('strategy', ['depth', 'cached'])
def test_ragged_elements_read_hoisted_values_by_one_take(strategy, training, ragged_always,
                                                         monkeypatch):
    """The cell's ``f_x``, computed once per distinct token by the flush's
    run of the host part, reaches the elements of the children lists by
    one ``take`` along an index composed on the host (lower.compose_takes),
    in step programs and in a compiled plan; values and gradients equal
    per-sample execution."""
    monkeypatch.setattr(execute, 'HOIST_ROWS', 0)
    node = _tree_model_matches_per_sample(strategy, training, seed=9)
    programs = [program for sig in node.signatures() for pattern, program in
                (sig.programs if training else sig.inference_programs).items()
                if any(way and way[0] == 'ragged' for way in pattern)]
    assert programs and all(lower.INVERSE_SEGMENT in p.symbol.list_inputs() for p in programs)
    for program in programs:
        nodes = json.loads(program.symbol.tojson())['nodes']
        index_of = {i: nodes[node['inputs'][1][0]]['name'] for i, node in enumerate(nodes)
                    if node['op'] == 'take'}
        assert not any(index == lanes.SEGMENT and
                       index_of.get(nodes[i]['inputs'][0][0]) == lower.INVERSE
                       for i, index in index_of.items())


def test_compose_takes_keeps_an_inner_take_read_elsewhere():
    """``take(take(x, INVERSE), SEGMENT)`` becomes one take; an inner take
    that something else reads too stays as it was."""
    x = mx.sym.var('x')
    inner = mx.sym.take(x, mx.sym.var(lower.INVERSE), axis=0)
    alone = mx.sym.take(inner, mx.sym.var(lanes.SEGMENT), axis=0)
    composed = lower.compose_takes(alone)
    assert ops(composed) == ['take']
    assert composed.list_inputs() == ['x', lower.INVERSE_SEGMENT]
    shared = mx.sym.Group([alone, inner * 2])
    assert ops(lower.compose_takes(shared)) == ops(shared)



def test_tanh_by_sigmoid_keeps_values_gradients_and_inputs():
    """``2 * sigmoid(2 x) - 1`` for every ``Activation(tanh)``: the same
    values and gradients to float rounding, the same inputs in the same
    order (a program's feeds stay valid); a symbol without one is kept."""
    x, w = mx.sym.var('x'), mx.sym.var('w')
    hidden = mx.sym.Activation(mx.sym.FullyConnected(x, w, num_hidden=4, no_bias=True),
                               act_type='tanh')
    symbol = mx.sym.Group([mx.sym.Activation(hidden * x, act_type='tanh'),
                           mx.sym.Activation(hidden, act_type='sigmoid')])
    rewritten = lower.tanh_by_sigmoid(symbol)
    assert rewritten.list_inputs() == symbol.list_inputs()
    assert ops(rewritten).count('Activation') == 3 and 'tanh' not in rewritten.tojson()
    rng = np.random.RandomState(0)
    values = [mx.nd.array(rng.uniform(-6, 6, (50, 4))), mx.nd.array(rng.uniform(-1, 1, (4, 4)))]
    results = []
    for sym in (symbol, rewritten):
        for v in values:
            v.attach_grad()
        with autograd.record():
            outs = mx.nd.CachedOp(sym)(*values)
            loss = sum((o * (k + 1)).sum() for k, o in enumerate(outs))
        loss.backward()
        results.append([o.asnumpy() for o in outs] + [v.grad.asnumpy().copy() for v in values])
    for want, got in zip(*results):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    plain = mx.sym.Activation(x, act_type='relu')
    assert lower.tanh_by_sigmoid(plain) is plain


@pytest.mark.parametrize('training', [False, True])
@pytest.mark.parametrize('strategy', ['depth', 'cached'])
def test_steps_of_many_calls_compute_tanh_by_sigmoid(strategy, training, monkeypatch):
    """Steps of at least TANH_BY_SIGMOID_ROWS calls run their program's
    variant with ``tanh`` through ``sigmoid``, in step programs and in a
    compiled plan; values and gradients equal per-sample execution."""
    monkeypatch.setattr(lower, 'TANH_BY_SIGMOID_ROWS', {True: 4, False: 4})
    node = _tree_model_matches_per_sample(strategy, training, seed=4)
    programs = [program for sig in node.signatures() for program in
                (sig.programs if training else sig.inference_programs).values()]
    wide = [p._wide for p in programs if p._wide is not None and p._wide is not p]
    assert wide and all('tanh' not in p.symbol.tojson() for p in wide)
    assert any('tanh' in p.symbol.tojson() for p in programs)     # the originals keep it


@pytest.mark.parametrize('training', [False, True])
def test_large_steps_keep_tanh_where_the_rewrite_does_not_pay(training, monkeypatch):
    """Where this machine's probe found tanh through sigmoid slower (an
    AVX-512 EPYC: 2.3x), steps of many calls keep MXNet's tanh."""
    monkeypatch.setattr(lower, 'TANH_BY_SIGMOID_ROWS', {True: 4, False: 4})
    monkeypatch.setattr(lower, 'TANH_BY_SIGMOID_PAYS', {True: False, False: False})
    node = _tree_model_matches_per_sample('depth', training, seed=4)
    programs = [program for sig in node.signatures() for program in
                (sig.programs if training else sig.inference_programs).values()]
    assert programs and all(p._wide is None for p in programs)


def test_the_tanh_probe_measures_once_beside_the_callers_autograd(monkeypatch):
    """tanh_by_sigmoid_pays times both forms once per mode, in a thread of
    its own, where nothing records: called while the caller records (as a
    flush does), the caller's graph and gradients are untouched; threads
    asking at once share one probe; the answer is kept."""
    monkeypatch.setattr(lower, 'TANH_BY_SIGMOID_PAYS', {})
    calls = []
    timed = lower._time_tanh_forms

    def probe(training):
        calls.append((training, threading.current_thread().name, autograd.is_recording()))
        time.sleep(0.05)            # long enough for the other threads to arrive
        return timed(training)

    monkeypatch.setattr(lower, '_time_tanh_forms', probe)
    x = mx.nd.array([[0.5, -1.0]])
    x.attach_grad()
    with autograd.record():
        y = (x * x).sum()
        first = lower.tanh_by_sigmoid_pays(True)
        assert autograd.is_recording() and autograd.is_training()
        z = y * 3
    z.backward()
    np.testing.assert_allclose(x.grad.asnumpy(), [[3.0, -6.0]])
    assert lower.tanh_by_sigmoid_pays(True) is first and isinstance(first, bool)
    answers = []
    threads = [threading.Thread(target=lambda: answers.append(lower.tanh_by_sigmoid_pays(False)))
               for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(answers) == 4 and len(set(answers)) == 1
    assert calls == [(True, 'dynbatch-tanh-probe', False), (False, 'dynbatch-tanh-probe', False)]
    turns = timed(False)
    assert len(turns) == 7 and all(0 < t < 1 for turn in turns for t in turn)


@pytest.mark.parametrize('ratios,pays', [([0.5] * 7, True), ([0.5] * 6 + [1.2], True),
                                         ([0.5] * 5 + [1.2] * 2, False),
                                         ([0.95] * 7, False), ([0.85] * 4 + [0.99] * 3, True)])
def test_the_tanh_probe_wants_the_rewrite_to_win_nearly_every_turn(ratios, pays, monkeypatch):
    """A turn slowed by other threads' work on the engine may favour
    either form: the rewrite must win all but one turn, by 10% in the
    median turn."""
    monkeypatch.setattr(lower, 'TANH_BY_SIGMOID_PAYS', {})
    monkeypatch.setattr(lower, '_time_tanh_forms',
                        lambda training: [(1e-3, r * 1e-3) for r in ratios])
    assert lower.tanh_by_sigmoid_pays(True) is pays
    assert lower.TANH_BY_SIGMOID_PAYS == {True: pays}


def test_a_plan_learned_in_training_replays_in_inference(ragged_always):
    """A cached plan's recipes learned while training (their ragged
    layouts) replay in inference, with per-sample values."""
    node, head = make_tree_model(pad_lists=True)
    forward = pair_forward(node, head, random_pairs(np.random.RandomState(9), 8))
    params = list(node.collect_params().values()) + list(head.collect_params().values())
    plan = dyb.CachedPlan(compile_after=10)
    for _ in range(2):          # the miss, then the hit that learns the recipes
        outputs_and_gradients(forward, params, plan, training=True)
    want, _ = outputs_and_gradients(forward, params, None, training=False)
    got, _ = outputs_and_gradients(forward, params, plan, training=False)
    assert dyb.stats()['last']['strategy'] == 'cached'
    for w, g in zip(want, got):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)
    inference = [way[0] for sig in node.signatures() for pattern in sig.inference_programs
                 for way in pattern if way]
    assert 'ragged' in inference
