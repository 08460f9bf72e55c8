"""Batched execution equals per-sample execution, forward and gradients."""
import json

import mxnet as mx
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from mxnet import autograd, gluon
from mxnet.gluon import nn

import gluon_dynbatch as dyb
from gluon_dynbatch.models import ChildSumTreeLSTMCell, Similarity, TreeLSTMNode

import test_accel
from helpers import (AcrossBatch, InputPlusState, TwoOutputs, assert_same, follow_engine,
                     random_tree, run_both, tree_from_parents)

STRATEGIES = ['depth', 'agenda', 'per-sample', 'cached', 'auto']


def make_tree_model(hidden=6, embed=5, vocab=40, pad_lists=None, sparse_grad=False):
    node = dyb.DynBatchBlock(TreeLSTMNode(vocab, embed, hidden, sparse_grad=sparse_grad),
                             pad_lists=pad_lists)
    head = dyb.DynBatchBlock(Similarity(4, 5, in_units=hidden))
    node.initialize(mx.init.Uniform(0.5))
    head.initialize(mx.init.Uniform(0.5))
    return node, head


def encode(node, tree, ids):
    children = [encode(node, c, ids) for c in tree.children]
    return node(ids[tree.idx:tree.idx + 1], [h for h, _ in children], [c for _, c in children])


def pair_forward(node, head, pairs):
    def forward():
        return [head(encode(node, a, ia)[0], encode(node, b, ib)[0]) for a, ia, b, ib in pairs]
    return forward


def random_pairs(rng, n, max_size=15, max_arity=8, vocab=40, id_dtype='float32'):
    pairs = []
    for _ in range(n):
        sizes = rng.randint(1, max_size + 1, size=2)
        ids = [rng.randint(vocab, size=(s,)).astype(id_dtype) for s in sizes]
        pairs.append((random_tree(rng, sizes[0], max_arity), ids[0],
                      random_tree(rng, sizes[1], max_arity), ids[1]))
    return pairs


@pytest.mark.parametrize('strategy', STRATEGIES)
@pytest.mark.parametrize('pad_lists', [True, False])
@pytest.mark.parametrize('hoist', [True, False])
def test_tree_lstm_random_pairs(strategy, pad_lists, hoist, monkeypatch):
    """Every strategy, node steps of every arity sharing one run of the
    embedding and ``i2h`` per flush (hoist) or each running its own."""
    set_hoisting(monkeypatch, hoist)
    node, head = make_tree_model(pad_lists=pad_lists)
    pairs = random_pairs(np.random.RandomState(3), 8)
    assert_same(run_both(pair_forward(node, head, pairs), [node, head], strategy=strategy))
    ways = {way[0] for sig in node.signatures() for p in sig.programs for way in p if way}
    # (a cached plan's miss runs as depth would; its hits replay a fixed layout)
    assert ('hoisted' in ways) == (hoist and strategy != 'per-sample')
    # gathered sources come in powers of two parts (few programs per signature)
    parts = {way[1] for sig in node.signatures() for p in sig.programs for way in p
             if way and way[0] in ('take', 'ragged')}
    assert all(n & (n - 1) == 0 for n in parts)


@pytest.mark.parametrize('strategy', STRATEGIES)
@pytest.mark.parametrize('pad_lists', [True, False])
@pytest.mark.parametrize('id_dtype', ['int32', 'int64', 'float64'])
def test_tree_lstm_with_token_ids_of_another_dtype(strategy, pad_lists, id_dtype, recorder):
    """Token ids in another dtype than the float32 states (int32 as a
    vocabulary gives them) batch like per sample, recorded in C or Python:
    a call's leaves may differ in dtype where its block takes them so."""
    node, head = make_tree_model(pad_lists=pad_lists)
    pairs = random_pairs(np.random.RandomState(3), 8, id_dtype=id_dtype)
    assert_same(run_both(pair_forward(node, head, pairs), [node, head], strategy=strategy))
    kinds = {sig.key[-2] for sig in node.signatures()}
    assert (np.dtype(id_dtype).type, np.float32, np.float32) in kinds
    if strategy != 'per-sample':
        assert any(sig.programs for sig in node.signatures())


@pytest.mark.parametrize('strategy', ['depth', 'cached', 'auto'])
@pytest.mark.parametrize('flush_every', [1, 7, 40])
@pytest.mark.parametrize('accelerated', [True, False])
def test_pipelined_scopes_equal_per_sample(strategy, flush_every, accelerated):
    """A scope that runs what it holds every ``flush_every`` calls cuts
    trees and pairs anywhere (later flushes read earlier flushes' rows):
    values and gradients still equal per-sample, recorded in C or Python."""
    from gluon_dynbatch import accel
    if accelerated and accel.STATUS != 'C extension':
        pytest.skip(accel.STATUS)
    was_on = accel.record is not None
    accel.enable(accelerated)
    try:
        node, head = make_tree_model(pad_lists=True)
        pairs = random_pairs(np.random.RandomState(5), 6)
        dyb.reset_stats()
        assert_same(run_both(pair_forward(node, head, pairs), [node, head], strategy=strategy,
                             flush_every=flush_every))
        calls = sum(len(ids_a) + len(ids_b) + 1 for _, ids_a, _, ids_b in pairs)
        stats = dyb.stats()
        # (a leaf whose token a pending leaf has records no node, in C and
        # Python; with a flush per call none is pending)
        assert stats['nodes'] + stats['repeated_calls'] == calls
        assert (stats['repeated_calls'] > 0) == (flush_every > 1)
        assert stats['flushes'] == -(-stats['nodes'] // flush_every)
    finally:
        accel.enable(was_on)


@pytest.mark.parametrize('strategy', ['depth', 'cached', 'auto'])
@pytest.mark.parametrize('answers', [(True,), (False,), (False, False, True)])
def test_scopes_following_the_engine_equal_per_sample(monkeypatch, strategy, answers):
    """Inference in a scope that follows the engine (the default under a
    threaded engine) runs a part whenever the engine's worker is done with
    the last one, wherever that cuts trees and pairs: the values still
    equal per-sample execution, whatever the engine answers."""
    import itertools
    replies = itertools.cycle(answers)
    follow_engine(monkeypatch, first=7, check=3, most=20, marker_done=lambda marker: next(replies))
    node, head = make_tree_model(pad_lists=True)
    forward = pair_forward(node, head, random_pairs(np.random.RandomState(6), 6))
    expected = [out.asnumpy() for out in forward()]
    dyb.reset_stats()
    with dyb.batching(strategy) as scope:
        assert scope.follow_engine
        outs = forward()
    assert dyb.stats()['flushes'] > 2
    for got, want in zip(outs, expected):
        np.testing.assert_allclose(got.asnumpy(), want, rtol=1e-4, atol=1e-5)


class MeanOfChildren(gluon.HybridBlock):
    """Padding its list with zeros would change the mean: must be refused."""
    dynbatch_pad_lists = True

    def hybrid_forward(self, F, x, children):
        if not children:
            return x
        return x + F.add_n(*children) / len(children) if len(children) > 1 else x + children[0]


def test_wrong_pad_lists_claim_is_caught():
    block = dyb.DynBatchBlock(MeanOfChildren())
    x = mx.nd.ones((1, 2))
    with pytest.raises(dyb.InputError, match='pad_lists'):
        with dyb.batching():
            a = block(x, [x])
            b = block(x, [x])
            block(x, [a])
            block(x, [a, b])


class SqrtPlusSumOfChildren(gluon.HybridBlock):
    """Neutral to zero padding, but NaN where its input is negative (as on
    some of the random inputs that the padding check feeds it)."""
    dynbatch_pad_lists = True

    def hybrid_forward(self, F, x, children):
        return F.sqrt(x) + F.add_n(*children) if children else F.sqrt(x)


def test_pad_lists_check_takes_the_blocks_own_nans_as_equal():
    block = dyb.DynBatchBlock(SqrtPlusSumOfChildren())
    x = mx.nd.array([[4.0, -1.0] * 4])      # wide enough for negative random inputs
    with dyb.batching():
        a = block(x, [x])
        b = block(x, [x, x])
        c = block(x, [a, b, x])
    np.testing.assert_array_equal(a.asnumpy(), [[2 + 4, np.nan] * 4])
    np.testing.assert_array_equal(c.asnumpy(), [[2 + 6 + 10 + 4, np.nan] * 4])


@pytest.mark.parametrize('hoist', [True, False])
def test_tree_lstm_with_row_sparse_embedding_gradient(hoist, monkeypatch):
    set_hoisting(monkeypatch, hoist)
    node, head = make_tree_model(sparse_grad=True)
    pairs = random_pairs(np.random.RandomState(7), 6)
    assert node.block.embedding.weight.grad().stype == 'row_sparse'
    assert_same(run_both(pair_forward(node, head, pairs), [node, head]))
    assert ran_on_distinct_rows(node, ways=('hoisted',)) == hoist


def test_tree_lstm_with_frozen_embedding_hoisted(monkeypatch):
    """A frozen embedding in the shared host part: no gradient reaches it,
    the others equal per-sample."""
    set_hoisting(monkeypatch, True)
    node, head = make_tree_model()
    node.block.embedding.weight.grad_req = 'null'
    pairs = random_pairs(np.random.RandomState(8), 6)
    assert_same(run_both(pair_forward(node, head, pairs), [node, head]))
    assert ran_on_distinct_rows(node, ways=('hoisted',))


def test_tree_lstm_on_sick_trees():
    sick = pytest.importorskip('gluon_dynbatch.data.sick')
    try:
        data_dir = sick.find_sick_dir()
    except FileNotFoundError:
        pytest.skip('SICK data not found')
    pairs = sick.load_split(data_dir, 'dev', limit=12)
    vocab = sick.build_vocab([pairs])
    sick.index_pairs(pairs, vocab)
    node, head = make_tree_model(vocab=len(vocab))
    batch = [(p.a_tree, p.a_ids.astype('float32'), p.b_tree, p.b_ids.astype('float32'))
             for p in pairs]
    assert_same(run_both(pair_forward(node, head, batch), [node, head]))


@st.composite
def trees(draw):
    """Random trees: depth 1..15, arity 0..8."""
    depth = draw(st.integers(1, 15))
    spine = [0] + list(range(depth - 1))          # parent of node i on the spine
    parents = [-1] + spine[1:]
    levels = list(range(depth))
    extra = draw(st.integers(0, 25))
    arity = [0] * depth
    for i in range(1, depth):
        arity[parents[i]] += 1
    for _ in range(extra):
        candidates = [i for i in range(len(parents)) if levels[i] < depth - 1 and arity[i] < 8]
        if not candidates:
            break
        p = draw(st.sampled_from(candidates))
        parents.append(p)
        levels.append(levels[p] + 1)
        arity.append(0)
        arity[p] += 1
    return tree_from_parents(parents), len(parents)


@given(st.lists(trees(), min_size=1, max_size=4), st.sampled_from([None, 1, 3, 17]))
def test_tree_lstm_hypothesis_trees(tree_list, flush_every):
    cell = dyb.DynBatchBlock(ChildSumTreeLSTMCell(5, 4))
    cell.initialize(mx.init.Uniform(0.5))
    emb = mx.nd.random.uniform(-1, 1, shape=(max(n for _, n in tree_list), 4))

    def enc(tree):
        children = [enc(c) for c in tree.children]
        return cell(emb[tree.idx:tree.idx + 1], [h for h, _ in children],
                    [c for _, c in children])

    def forward():
        return [out for tree, _ in tree_list for out in enc(tree)]
    assert_same(run_both(forward, [cell], inputs=[emb], flush_every=flush_every))


@settings(max_examples=15, deadline=None)
@given(st.lists(trees(), min_size=1, max_size=4), st.sampled_from(['int32', 'uint8', 'float16']),
       st.sampled_from(['depth', 'agenda', 'auto']), st.booleans())
def test_tree_lstm_hypothesis_trees_with_ids_of_any_dtype(tree_list, id_dtype, strategy,
                                                           pad_lists):
    """TreeLSTMNode's token ids in a dtype of their own beside its float32
    states, on random trees: batched equals per sample."""
    node = dyb.DynBatchBlock(TreeLSTMNode(40, 5, 4), pad_lists=pad_lists)
    node.initialize(mx.init.Uniform(0.5))
    ids = np.random.RandomState(len(tree_list)).randint(40, size=(60,)).astype(id_dtype)

    def forward():
        return [out for tree, _ in tree_list for out in encode(node, tree, ids)]
    assert_same(run_both(forward, [node], strategy=strategy))


@pytest.mark.parametrize('strategy', STRATEGIES)
def test_lstm_chains_of_different_lengths(strategy):
    """gluon's own LSTMCell over ragged sequences, feeding a common head."""
    lstm = dyb.DynBatchBlock(gluon.rnn.LSTMCell(6, input_size=3))
    head = dyb.DynBatchBlock(nn.Dense(2, in_units=6))
    lstm.initialize(mx.init.Uniform(0.5))
    head.initialize(mx.init.Uniform(0.5))
    rng = np.random.RandomState(0)
    seqs = [mx.nd.array(rng.uniform(-1, 1, (n, 3))) for n in (1, 4, 7, 2, 9)]

    def forward():
        outs = []
        for seq in seqs:
            state = [mx.nd.zeros((1, 6)), mx.nd.zeros((1, 6))]
            for t in range(seq.shape[0]):
                out, state = lstm(seq[t:t + 1], state)
            outs.append(head(out))
        return outs
    assert_same(run_both(forward, [lstm, head], inputs=seqs, strategy=strategy))


@pytest.mark.parametrize('strategy', STRATEGIES)
def test_dag_shared_values_and_several_outputs(strategy):
    """One lazy value feeds several calls; a block returns two outputs."""
    block = dyb.DynBatchBlock(TwoOutputs())
    block.initialize(mx.init.Uniform(0.5))
    xs = [mx.nd.random.uniform(-1, 1, (1, 4)) for _ in range(3)]

    def forward():
        outs = []
        for x in xs:
            a, b = block(x, x)
            c, d = block(a, b)          # a and b each feed two calls
            e, f = block(a, c)
            g, h = block(d, e)
            outs += [f, g, h, b]
        return outs
    assert_same(run_both(forward, [block], inputs=xs, strategy=strategy))


def _input_chains(kind):
    """Chains of 2, 3, 4 and 2 calls ``h = cell(x, h)`` of an
    :class:`InputPlusState` cell from a zero start, with inputs that need
    no gradient: NDArrays without ``attach_grad`` (``kind`` 'ndarray') or
    host rows ('host'); returns the cell and the forward function."""
    block = dyb.DynBatchBlock(InputPlusState(4))
    block.initialize(mx.init.Uniform(0.5))
    rng = np.random.RandomState(2)
    rows = [[rng.uniform(-1, 1, (1, 4)).astype(np.float32) for _ in range(length)]
            for length in (2, 3, 4, 2)]
    start = np.zeros((1, 4), dtype=np.float32)
    if kind == 'ndarray':
        rows = [[mx.nd.array(x) for x in chain] for chain in rows]
        start = mx.nd.array(start)

    def forward():
        outs = []
        for chain in rows:
            h = start
            for x in chain:
                h = block(x, h)
                outs.append(h)
        return outs
    return block, forward


@pytest.mark.parametrize('strategy', STRATEGIES)
@pytest.mark.parametrize('kind', ['ndarray', 'host'])
def test_inputs_without_gradients_added_to_trained_values(strategy, kind):
    """``tanh(x + W h)`` in chains whose inputs need no gradient (see
    :func:`_input_chains`).  MXNet 1.9.1's programs with ``static_alloc``
    computed zero or garbage gradients for ``W`` there (see
    lower.adds_by_broadcast); every strategy must give the per-sample
    gradients, a cached plan on its miss, its hit and its replays."""
    block, forward = _input_chains(kind)
    chosen = dyb.CachedPlan(compile_after=2) if strategy == 'cached' else strategy
    for _ in range(3 if strategy == 'cached' else 1):
        assert_same(run_both(forward, [block], strategy=chosen))
    if strategy == 'cached' and kind == 'host':     # user NDArrays: no recipe
        assert dyb.stats()['last']['strategy'] == 'cached'     # never compiled in training


def test_plan_compiled_in_inference_replays_in_training_like_per_sample():
    """A cached plan compiled in inference replays its recipes in training,
    and one met only in training is never compiled (see
    test_unused_calls_leave_their_parameters_without_gradient)."""
    block, forward = _input_chains('host')
    plan = dyb.CachedPlan(compile_after=1)
    for _ in range(3):          # a miss, recipes learned, compiled
        with dyb.batching(plan):
            [value.data for value in forward()]
    assert dyb.stats()['last']['strategy'] == 'cached-compiled'
    assert_same(run_both(forward, [block], strategy=plan))
    assert dyb.stats()['last']['strategy'] == 'cached'
    trained = dyb.CachedPlan(compile_after=1)
    for _ in range(3):
        assert_same(run_both(forward, [block], strategy=trained))
    assert dyb.stats()['last']['strategy'] == 'cached'
    assert all(entry.program is None for entry in trained.cache.values())


@pytest.mark.parametrize('strategy', STRATEGIES)
def test_unused_calls_leave_their_parameters_without_gradient(strategy):
    """Calls recorded under ``autograd.record()`` whose values never reach
    the loss (a head computed for metrics, or used on some steps only): per
    sample their block's parameters get no gradient, and a Trainer with
    ``ignore_stale_grad`` leaves them alone.  Batched they must not get a
    (zero) one either: a whole flush compiled into one program gave every
    parameter it read a fresh zero gradient, so weight decay and momentum
    moved them, silently."""
    def make(prefix):
        block = dyb.DynBatchBlock(nn.Dense(3, in_units=3, prefix=prefix))
        block.initialize(mx.init.Uniform(0.5))
        return block
    enc, used, unused = make('enc_'), make('used_'), make('unused_')
    params = enc.collect_params()
    params.update(used.collect_params())
    params.update(unused.collect_params())
    trainer = gluon.Trainer(params, 'sgd', {'learning_rate': 0.1, 'wd': 0.1})
    before = params['unused_weight'].data().asnumpy()
    xs = [np.random.RandomState(i).rand(1, 3).astype('float32') for i in range(4)]
    chosen = dyb.CachedPlan(compile_after=1) if strategy == 'cached' else strategy
    for _ in range(4):          # the same structure: cached plans would compile
        with autograd.record():
            with dyb.batching(chosen):
                hs = [enc(x) for x in xs]
                outs = [used(h) for h in hs]
                for h in hs:
                    unused(h)
            loss = dyb.concat_rows(outs).sum()
        loss.backward()
        assert not params['unused_weight']._data[0]._fresh_grad
        trainer.step(len(xs), ignore_stale_grad=True)
    np.testing.assert_array_equal(params['unused_weight'].data().asnumpy(), before)


@pytest.mark.parametrize('strategy', STRATEGIES)
@given(ops=test_accel.programs)
@settings(max_examples=15, deadline=None)
def test_random_programs_train_like_per_sample(strategy, ops):
    """Random programs of the blocks test_accel draws from (a child-sum
    cell, two outputs, an LSTM cell, a per-sample block, nested lists, an
    input added to a trained term),
    whose inputs are NDArrays and host rows with no gradient: outputs and
    every parameter's gradient equal per-sample execution."""
    blocks = test_accel.Blocks()
    all_blocks = blocks.all()

    def forward():
        return [value for out in test_accel.run_program(blocks, ops) for value in out]
    chosen = dyb.CachedPlan() if strategy == 'cached' else strategy
    assert_same(run_both(forward, all_blocks, strategy=chosen))


class ScaledChildren(gluon.HybridBlock):
    """``x + sum_k x * tanh(W h_k)``: with no children, ``x`` itself."""

    def __init__(self):
        super().__init__()
        with self.name_scope():
            self.w = nn.Dense(4, in_units=4, use_bias=False)

    def hybrid_forward(self, F, x, hs):
        out = x
        for h in hs:
            out = out + F.tanh(self.w(h)) * x
        return out


@pytest.mark.parametrize('strategy', STRATEGIES)
def test_block_returning_an_argument_unchanged(strategy):
    """A call whose output is one of its arguments (a leaf returning ``x``)
    batches too: its traced graph had no op to run, and building its step
    program failed in MXNet's Symbol.Compose.  Values and the gradients of
    the parameters and of the inputs equal per-sample execution."""
    block = dyb.DynBatchBlock(ScaledChildren())
    block.initialize(mx.init.Uniform(0.5))
    xs = [mx.nd.random.uniform(-1, 1, (1, 4)) for _ in range(5)]

    def forward():
        leaves = [block(x, []) for x in xs[:3]]
        inner = block(xs[3], leaves[:2])
        return leaves + [inner, block(xs[4], [inner, leaves[2]])]
    assert_same(run_both(forward, [block], inputs=xs, strategy=strategy))


class IgnoresAnArgument(gluon.HybridBlock):
    """``tanh(W h)``, ignoring its first argument (a cell that a config
    tells to skip its input)."""

    def __init__(self):
        super().__init__()
        with self.name_scope():
            self.w = nn.Dense(4, in_units=4)

    def hybrid_forward(self, F, x, h):
        return F.tanh(self.w(h))


@pytest.mark.parametrize('strategy', STRATEGIES)
@pytest.mark.parametrize('host', [False, True])
def test_block_ignoring_an_argument(strategy, host):
    """An argument the block never reads is no input of its graph: tracing
    failed in MXNet's infer_shape on it.  Its rows are gathered and unread;
    values and gradients equal per-sample execution."""
    block = dyb.DynBatchBlock(IgnoresAnArgument())
    block.initialize(mx.init.Uniform(0.5))
    rng = np.random.RandomState(4)
    xs = [rng.uniform(-1, 1, (1, 4)).astype(np.float32) for _ in range(4)]
    if not host:
        xs = [mx.nd.array(x) for x in xs]
    start = mx.nd.array(rng.uniform(-1, 1, (1, 4)))

    def forward():
        h, outs = start, []
        for x in xs:
            h = block(x, h)
            outs.append(h)
        return outs + [block(xs[0], start)]
    assert_same(run_both(forward, [block], strategy=strategy))


def test_adds_by_broadcast_gives_static_programs_the_dynamic_gradients():
    """The rewrite behind the test above, on one program: with
    ``static_alloc`` and an input that needs no gradient added to a trained
    term, the gradient equals a dynamic CachedOp's once every
    ``elemwise_add`` is a ``broadcast_add``."""
    from gluon_dynbatch.lower import adds_by_broadcast
    x, w, y = mx.sym.var('x'), mx.sym.var('w'), mx.sym.var('y')
    symbol = mx.sym.Activation(y + mx.sym.FullyConnected(x, w, num_hidden=4, no_bias=True),
                               act_type='tanh')
    rng = np.random.RandomState(0)
    feed = {name: mx.nd.array(rng.uniform(-1, 1, (4, 4) if name == 'w' else (3, 4)))
            for name in symbol.list_inputs()}

    def w_grad(program, flags):
        feed['w'].attach_grad()
        op = mx.nd.CachedOp(program, flags)
        with mx.autograd.record():
            out = op(*[feed[name] for name in program.list_inputs()])
            loss = (out * out).sum()
        loss.backward()
        return feed['w'].grad.asnumpy().copy()
    rewritten = adds_by_broadcast(symbol)
    assert 'elemwise_add' not in rewritten.tojson() and 'broadcast_add' in rewritten.tojson()
    assert adds_by_broadcast(rewritten) is rewritten
    np.testing.assert_allclose(w_grad(rewritten, [('static_alloc', True)]),
                               w_grad(symbol, []), rtol=1e-5, atol=1e-6)


def test_mix_of_batch_safe_and_per_sample_blocks():
    safe = dyb.DynBatchBlock(nn.Dense(3, in_units=3))
    unsafe = dyb.DynBatchBlock(AcrossBatch())
    safe.initialize(mx.init.Uniform(0.5))
    unsafe.initialize(mx.init.Uniform(0.5))
    xs = [mx.nd.random.uniform(-1, 1, (1, 3)) for _ in range(4)]

    def forward():
        return [safe(unsafe(safe(x))) for x in xs]
    dyb.reset_stats()
    assert_same(run_both(forward, [safe, unsafe], inputs=xs))
    sig = unsafe.signatures()[0]
    assert not sig.batch_safe and 'mean' in sig.reason
    assert dyb.stats()['last']['per_sample_nodes'] == 4
    assert safe.signatures()[0].batch_safe


def test_numeric_gradient_of_batched_graph():
    """Finite differences (float64) agree with backward through the batched run."""
    cell = dyb.DynBatchBlock(ChildSumTreeLSTMCell(3, 2))
    cell.initialize(mx.init.Uniform(0.5))
    cell.cast('float64')
    x = mx.nd.random.uniform(-1, 1, (5, 2), dtype='float64')
    tree = tree_from_parents([-1, 0, 0, 1, 1])
    weights = mx.nd.array(np.random.RandomState(0).uniform(-1, 1, (1, 3)), dtype='float64')

    def loss_of(inputs):
        def enc(t):
            ch = [enc(c) for c in t.children]
            return cell(inputs[t.idx:t.idx + 1], [h for h, _ in ch], [c for _, c in ch])
        with dyb.batching():
            h, _ = enc(tree)
        return (h.data * weights).sum()

    x.attach_grad()
    with mx.autograd.record():
        loss = loss_of(x)
    loss.backward()
    analytic = x.grad.asnumpy()
    numeric = np.zeros_like(analytic)
    base = x.asnumpy()
    eps = 1e-6
    for idx in np.ndindex(base.shape):
        for sign in (1, -1):
            shifted = base.copy()
            shifted[idx] += sign * eps
            numeric[idx] += sign * loss_of(mx.nd.array(shifted, dtype='float64')).asscalar()
    numeric /= 2 * eps
    np.testing.assert_allclose(analytic, numeric, rtol=1e-5, atol=1e-8)


def set_hoisting(monkeypatch, on):
    """Steps share their host part's run (execute.FlushHoist) however few
    their rows, or never."""
    monkeypatch.setattr(dyb.execute, 'HOIST_ROWS', 0 if on else float('inf'))


def ran_on_distinct_rows(dblock, ways=('unique', 'hoisted')):
    """Whether a step of ``dblock`` ran on distinct host rows (lower.py):
    its own (``'unique'``) or its group's (``'hoisted'``, execute.FlushHoist)."""
    return any(way is not None and way[0] in ways
               for sig in dblock.signatures() for pattern in sig.programs for way in pattern)


class HostFeatures(gluon.HybridBlock):
    """Two host arguments (a token id, a float row) whose ops run on host
    data alone, then meet a device input; the first output is host-only."""

    def __init__(self):
        super().__init__()
        with self.name_scope():
            self.embed = nn.Embedding(5, 3)
            self.dense = nn.Dense(3, in_units=5)

    def hybrid_forward(self, F, token, feats, h):
        # reciprocal tells -0.0 from 0.0: rows must be told apart by their bits
        host = F.concat(self.embed(token), F.clip(F.reciprocal(feats), -1, 1), dim=1)
        return self.embed(token) * 2, F.Activation(self.dense(host), act_type='tanh') * h


@pytest.mark.parametrize('strategy', ['depth', 'agenda', 'cached', 'auto'])
@pytest.mark.parametrize('hoist', [True, False])
def test_repeated_host_rows_run_once_with_same_results(strategy, hoist, monkeypatch):
    """Steps whose host rows repeat run their host-only ops on the distinct
    rows (two host arguments keyed together, -0.0 apart from 0.0), once for
    both steps (FlushHoist) or each step on its own; results and gradients
    still equal per-sample execution."""
    set_hoisting(monkeypatch, hoist)
    block = dyb.DynBatchBlock(HostFeatures())
    block.initialize(mx.init.Uniform(0.5))
    rng = np.random.RandomState(0)
    feats = [np.array([[0.0, 1.0]], 'float32'), np.array([[-0.0, 1.0]], 'float32'),
             np.array([[2.0, -3.0]], 'float32')]
    calls = [(np.array([rng.randint(2)], 'float32'), feats[rng.randint(3)])
             for _ in range(40)]
    hs = [mx.nd.array(rng.uniform(-1, 1, (1, 3))) for _ in range(40)]

    def forward():
        outs = []
        for (token, feat), h in zip(calls, hs):
            a, b = block(token, feat, h)
            outs += [a, block(token, feat, b)[1]]
        return outs
    for _ in range(3 if strategy == 'cached' else 1):   # miss, replay, compile
        assert_same(run_both(forward, [block], inputs=hs, strategy=strategy))
    # a cached plan hoists too: in its miss, its replay and its compiled program
    assert ran_on_distinct_rows(block, ways=('hoisted',) if hoist else ('unique',))


class EmbedDropout(gluon.HybridBlock):
    def __init__(self):
        super().__init__()
        with self.name_scope():
            self.embed = nn.Embedding(3, 40)
            self.drop = nn.Dropout(0.5)

    def hybrid_forward(self, F, token):
        return self.drop(self.embed(token))


def test_equal_host_rows_do_not_share_a_dropout_mask():
    block = dyb.DynBatchBlock(EmbedDropout())
    block.initialize(mx.init.Uniform(0.5))
    token = np.array([1], 'float32')
    with mx.autograd.record():
        with dyb.batching('depth'):
            outs = [block(token) for _ in range(20)]
        rows = np.concatenate([o.data.asnumpy() for o in outs])
    assert ran_on_distinct_rows(block)      # the embedding ran once...
    assert len({row.tobytes() for row in rows}) == 20   # ...each row got its own mask
    with dyb.batching('depth'):             # not training: no dropout, all equal
        outs = [block(token) for _ in range(20)]
    expected = block.block(mx.nd.array(token)).asnumpy()
    for out in outs:
        np.testing.assert_allclose(out.data.asnumpy(), expected, rtol=1e-6)


class Lookups(gluon.HybridBlock):
    """Host ids read by two embeddings, and a host row read by an embedding
    and also as a number (so it must keep its values)."""

    def __init__(self):
        super().__init__()
        with self.name_scope():
            self.a = nn.Embedding(6, 3)
            self.b = nn.Embedding(6, 3)
            self.c = nn.Embedding(6, 3)

    def hybrid_forward(self, F, ids, other, h):
        mixed = F.broadcast_mul(self.c(other), F.expand_dims(other, axis=1))
        return F.Activation(self.a(ids) + self.b(ids) + mixed, act_type='tanh') * h


def lookup_calls(rng, count):
    """Arguments of ``count`` calls of :class:`Lookups`: two host id rows
    per call, and a user NDArray row each."""
    calls = [(np.array([rng.randint(6)], 'float32'), np.array([rng.randint(6)], 'float32'))
             for _ in range(count)]
    return calls, [mx.nd.array(rng.uniform(-1, 1, (1, 3))) for _ in range(count)]


@pytest.mark.parametrize('strategy', ['depth', 'cached', 'auto'])
def test_training_reads_embeddings_through_flush_tables(strategy):
    """In training, host ids read only by embeddings index a per-flush
    table of the rows read (one weight gradient per flush); ids also used
    as numbers do not.  Results and gradients equal per-sample."""
    block = dyb.DynBatchBlock(Lookups())
    block.initialize(mx.init.Uniform(0.5))
    calls, hs = lookup_calls(np.random.RandomState(2), 30)

    def forward():
        outs = [block(ids, other, h) for (ids, other), h in zip(calls, hs)]
        return outs + [block(ids, other, out) for (ids, other), out in zip(calls, outs)]
    for _ in range(3 if strategy == 'cached' else 1):   # miss, replay, compile
        assert_same(run_both(forward, [block], inputs=hs, strategy=strategy))
    patterns = [p for sig in block.signatures() for p in sig.programs]
    assert any(p[0][2:] == ('table',) for p in patterns)
    assert not any(p[1][2:] for p in patterns)


@pytest.mark.parametrize('strategy', ['depth', 'cached'])
def test_flush_tables_take_ids_of_two_dtypes_that_numpy_widens_beyond_mxnet(strategy):
    """Int8 ids in some calls and uint8 ids in others, beside float32
    rows: one flush's table reads them all, and numpy's unique of both was
    int16, which MXNet cannot hold (a KeyError uploading the table's ids;
    found by a review)."""
    block = dyb.DynBatchBlock(Lookups())
    block.initialize(mx.init.Uniform(0.5))
    rng = np.random.RandomState(5)
    calls = [(np.array([rng.randint(6)], 'int8' if n % 2 else 'uint8'),
              np.array([rng.randint(6)], 'float32')) for n in range(30)]
    hs = [mx.nd.array(rng.uniform(-1, 1, (1, 3))) for _ in range(30)]

    def forward():
        return [block(ids, other, h) for (ids, other), h in zip(calls, hs)]
    for _ in range(3 if strategy == 'cached' else 1):   # miss, replay, compile
        assert_same(run_both(forward, [block], inputs=hs, strategy=strategy))
    assert any(p[0][2:] == ('table',) for sig in block.signatures() for p in sig.programs)


class Project(gluon.HybridBlock):
    """No host data: its steps read no table."""

    def __init__(self):
        super().__init__()
        with self.name_scope():
            self.dense = nn.Dense(3, in_units=3)

    def hybrid_forward(self, F, h):
        return F.Activation(self.dense(h), act_type='tanh')


@pytest.mark.parametrize('strategy', ['depth', 'agenda', 'auto'])
def test_tables_when_the_first_step_reads_none(strategy):
    """The flush's tables know every id before any step runs: the first
    step here reads no ids, and when the tables were filled at the first
    step that did, the finished step had already dropped its arguments
    (a TypeError)."""
    project, lookups = dyb.DynBatchBlock(Project()), dyb.DynBatchBlock(Lookups())
    for block in (project, lookups):
        block.initialize(mx.init.Uniform(0.5))
    calls, hs = lookup_calls(np.random.RandomState(6), 12)

    def forward():
        return [lookups(ids, other, project(h)) for (ids, other), h in zip(calls, hs)]
    assert_same(run_both(forward, [project, lookups], inputs=hs, strategy=strategy))
    assert any(p[0][2:] == ('table',) for sig in lookups.signatures() for p in sig.programs)


def test_host_part_key_ignores_op_names_and_the_rest():
    """Two symbols whose ops on the host input match (op names aside) get
    one key whatever the rest; another weight gives another key; a host
    input read by the rest itself cannot be split."""
    from gluon_dynbatch.lower import hoisted_rest, split_host_part
    ids, w, v, h = (mx.sym.var(n) for n in ('ids', 'w', 'v', 'h'))

    def cell(weight, rest):
        hidden = mx.sym.FullyConnected(mx.sym.Embedding(ids, weight, input_dim=5, output_dim=4),
                                       num_hidden=3, no_bias=True, weight=v)
        return rest(hidden)
    first = cell(w, lambda x: x + h)
    one = split_host_part(first, ['ids'], {'w', 'v'})
    two = split_host_part(cell(w, lambda x: mx.sym.tanh(x * h) * h), ['ids'], {'w', 'v'})
    other = split_host_part(cell(mx.sym.var('w2'), lambda x: x + h), ['ids'], {'w2', 'v'})
    assert one.key == two.key != other.key
    assert sorted(one.symbol.list_inputs()) == ['ids', 'v', 'w']
    rest = hoisted_rest(first, one.boundary)
    assert sorted(rest.list_inputs()) == ['dynbatch_hoisted0', 'dynbatch_inverse', 'h']
    reads_ids = mx.sym.Embedding(ids, w, input_dim=5, output_dim=4) * h + ids
    assert split_host_part(reads_ids, ['ids'], {'w'}) is None


def test_host_part_ends_only_before_ops_that_may_batch_on_axis_1():
    """The host part hands its values on by a take along axis 0, so it ends
    before an op whose value may be batched on axis 1 (a stack on axis 0,
    time-major).  Ops of those names that keep the batch on axis 0 (gates
    split along axis 1, a transpose of the last axes) stay in it: cut by
    name, every split of gates computed from token ids left the part."""
    from gluon_dynbatch.lower import split_host_part
    ids, w, h = mx.sym.var('ids'), mx.sym.var('w'), mx.sym.var('h')
    table = mx.sym.Embedding(ids, w, input_dim=5, output_dim=4)

    def ops_of(split):
        return [node['op'] for node in json.loads(split.symbol.tojson())['nodes']]
    gates = mx.sym.split(table, num_outputs=2, axis=1)
    assert 'SliceChannel' in ops_of(split_host_part(gates[0] * h + gates[1], ['ids'], {'w'}))
    square = mx.sym.reshape(table, shape=(1, 2, 2))
    kept = split_host_part(mx.sym.transpose(square, axes=(0, 2, 1)) * h, ['ids'], {'w'})
    assert 'transpose' in ops_of(kept)
    steps = mx.sym.stack(table, table * 2, axis=0)
    cut = split_host_part(mx.sym.SequenceReverse(steps) * h, ['ids'], {'w'})
    assert 'stack' not in ops_of(cut)


def test_embedding_reads_finds_only_pure_lookups():
    from gluon_dynbatch.lower import embedding_reads
    ids, other, w = mx.sym.var('ids'), mx.sym.var('other'), mx.sym.var('w')
    sparse = mx.sym.var('s')
    out = mx.sym.Group([mx.sym.Embedding(ids, w, input_dim=6, output_dim=3),
                        mx.sym.Embedding(other, w, input_dim=6, output_dim=3) + other,
                        mx.sym.Embedding(mx.sym.var('rs'), sparse, input_dim=6, output_dim=3,
                                         sparse_grad=True)])
    assert embedding_reads(out, {'ids', 'other', 'rs'}, {'w', 's'}) == {'ids': ['w']}
    assert embedding_reads(out, {'ids'}, set()) == {}     # weight without gradient


class BagOfWords(gluon.HybridBlock):
    """A window of token ids per call: (1, 3) host rows."""

    def __init__(self):
        super().__init__()
        with self.name_scope():
            self.embed = nn.Embedding(7, 4)
            self.dense = nn.Dense(2, in_units=4)

    def hybrid_forward(self, F, window, h):
        return F.Activation(self.dense(F.sum(self.embed(window), axis=1)), act_type='tanh') * h


@pytest.mark.parametrize('hoist', [True, False])
@pytest.mark.parametrize('strategy', ['depth', 'auto'])
def test_windows_of_ids_share_rows_and_tables(strategy, hoist, monkeypatch):
    """Multi-column host rows: distinct windows keyed bit for bit, the two
    steps' host part run once for both (FlushHoist) or, without that, by
    each step on its distinct rows with, in training, every id of every
    window read through the flush's table."""
    set_hoisting(monkeypatch, hoist)
    block = dyb.DynBatchBlock(BagOfWords())
    block.initialize(mx.init.Uniform(0.5))
    rng = np.random.RandomState(4)
    windows = [rng.randint(7, size=(1, 3)).astype('float32') for _ in range(4)]
    calls = [windows[rng.randint(4)] for _ in range(30)]
    hs = [mx.nd.array(rng.uniform(-1, 1, (1, 2))) for _ in range(30)]

    def forward():
        outs = [block(w, h) for w, h in zip(calls, hs)]
        return outs + [block(w, out) for w, out in zip(calls, outs)]
    assert_same(run_both(forward, [block], inputs=hs, strategy=strategy))
    patterns = [p for sig in block.signatures() for p in sig.programs]
    if hoist:
        assert any(p[0] == ('hoisted', 1) for p in patterns)
    else:
        assert any(p[0][:1] == ('unique',) and p[0][2:] == ('table',) for p in patterns)


class SplitAndDense(gluon.HybridBlock):
    """Returns a multi-output op as it is: per sample ``F.split`` gives a
    list of NDArrays, traced one Symbol of two outputs."""

    def __init__(self, nested):
        super().__init__()
        self.nested = nested
        with self.name_scope():
            self.d = nn.Dense(4, in_units=3)
            self.e = nn.Dense(5, in_units=3)

    def hybrid_forward(self, F, x):
        parts = F.split(self.d(x), num_outputs=2, axis=1)
        return (parts, F.tanh(self.e(x))) if self.nested else parts


@pytest.mark.parametrize('nested', [False, True])
@pytest.mark.parametrize('strategy', ['depth', 'per-sample'])
def test_a_multi_output_op_returned_as_it_is(nested, strategy):
    """Batched, its outputs were counted as one: the second split part was
    lost and, nested, ``e(x)`` came back holding the second part (found by
    a review).  They now nest as per sample, values and gradients alike."""
    block = dyb.DynBatchBlock(SplitAndDense(nested))
    block.initialize(mx.init.Uniform(0.5))
    rng = np.random.RandomState(4)
    xs = [mx.nd.array(rng.uniform(-1, 1, (1, 3))) for _ in range(5)]

    def forward():
        outs = []
        for x in xs:
            out = block(x)
            parts, rest = (out[0], [out[1]]) if nested else (out, [])
            assert len(parts) == 2
            outs += list(parts) + rest
        return outs
    assert_same(run_both(forward, [block], inputs=xs, strategy=strategy))
