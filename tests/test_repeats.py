"""Calls with equal host arguments share one node (``merge_repeats``).

A call of a block that is a function of its inputs, whose arguments are all
numpy arrays equal bit for bit to an earlier call's, records no node of its
own and gets the earlier call's results.  These tests check that results and
gradients still equal per-sample execution, that calls which must not share
(random draws, running statistics, other autograd states, host arguments
with other bits, arguments that are not all host data) do not, and that the
scope forgets its first calls where the user's code may have changed a
parameter.
"""
import mxnet as mx
import numpy as np
import pytest
from mxnet import autograd, gluon
from mxnet.gluon import nn

import gluon_dynbatch as dyb
from gluon_dynbatch import accel
from helpers import assert_same, register_custom_op, run_both
from test_equivalence import make_tree_model, pair_forward, random_pairs

STRATEGIES = ['per-sample', 'depth', 'agenda', 'cached', 'auto']


def calls_of(pairs):
    return sum(len(ids_a) + len(ids_b) + 1 for _, ids_a, _, ids_b in pairs)


@pytest.mark.parametrize('strategy', STRATEGIES)
@pytest.mark.parametrize('flush_every', [None, 5])
def test_tree_lstm_with_few_tokens_equals_per_sample(recorder, strategy, flush_every):
    """Three tokens: most leaves repeat one still pending.  Values and
    every gradient equal per-sample execution, and each repeat recorded no
    node."""
    node, head = make_tree_model(vocab=3)
    pairs = random_pairs(np.random.RandomState(11), 8, vocab=3)
    dyb.reset_stats()
    chosen = dyb.CachedPlan() if strategy == 'cached' else strategy
    assert_same(run_both(pair_forward(node, head, pairs), [node, head], strategy=chosen,
                         flush_every=flush_every))
    stats = dyb.stats()
    assert stats['nodes'] + stats['repeated_calls'] == calls_of(pairs)
    # leaves are the only calls with host arguments alone: at most one
    # node per token and flush
    leaves = sum(1 for a, _, b, _ in pairs for tree in (a, b) for t in _walk(tree)
                 if not t.children)
    assert stats['repeated_calls'] >= leaves - 3 * stats['flushes']
    assert stats['repeated_calls'] > 0


def _walk(tree):
    yield tree
    for child in tree.children:
        yield from _walk(child)


def test_off_records_a_node_per_call():
    node, head = make_tree_model(vocab=3)
    pairs = random_pairs(np.random.RandomState(11), 4, vocab=3)
    dyb.reset_stats()
    assert_same(run_both(pair_forward(node, head, pairs), [node, head],
                         merge_repeats=False))
    assert dyb.stats()['repeated_calls'] == 0
    assert dyb.stats()['nodes'] == calls_of(pairs)


def test_both_recorders_merge_the_same_calls():
    node, head = make_tree_model(vocab=4)
    pairs = random_pairs(np.random.RandomState(2), 6, vocab=4)
    counts = []
    for on in ([True, False] if accel.STATUS == 'C extension' else [False]):
        accel.enable(on)
        try:
            dyb.reset_stats()
            with dyb.batching('depth'):
                pair_forward(node, head, pairs)()
            counts.append((dyb.stats()['nodes'], dyb.stats()['repeated_calls']))
        finally:
            accel.enable(True)
    assert len(set(counts)) == 1 and counts[0][1] > 0


class Scaled(gluon.HybridBlock):
    """``dense(x) * 2``: a function of its input."""

    def __init__(self):
        super().__init__()
        with self.name_scope():
            self.dense = nn.Dense(3, in_units=2)

    def hybrid_forward(self, F, x):
        return self.dense(x) * 2


def scaled_block():
    block = dyb.DynBatchBlock(Scaled())
    block.initialize(mx.init.Uniform(0.5))
    return block


def test_equal_bits_share_other_bits_do_not(recorder):
    """Equal bytes in another contiguous array share; a strided view (not
    contiguous), -0.0 and 0.0, other values, and arguments that are not all
    numpy arrays do not."""
    block = scaled_block()
    x = np.array([[1.0, -2.0]], np.float32)
    wide = np.array([[1.0, 9.0, -2.0, 9.0]], np.float32)
    calls = [x, x.copy(), wide[:, ::2],             # equal bits: one node
             np.array([[-0.0, 1.0]], np.float32),   # -0.0 ...
             np.array([[0.0, 1.0]], np.float32),   # ... and 0.0 differ
             mx.nd.array(x), mx.nd.array(x)]        # NDArrays: a node each
    dyb.reset_stats()
    with dyb.batching('depth'):
        outs = [block(arg) for arg in calls]
    stats = dyb.stats()
    got = [o.asnumpy() for o in outs]
    want = [block.block(mx.nd.array(np.asarray(arg.asnumpy() if isinstance(arg, mx.nd.NDArray)
                                               else arg))).asnumpy() for arg in calls]
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-6)
    # the strided view is not contiguous: a node of its own, in C and Python
    assert stats['repeated_calls'] == 1
    assert stats['nodes'] == len(calls) - stats['repeated_calls']
    assert outs[0] is outs[1]               # the same lazy value, nothing allocated


class PairAndList(gluon.HybridBlock):
    """Returns a pair, or, when ``nested``, a list (mutable) and a value."""

    def __init__(self, nested, **kwargs):
        super().__init__(**kwargs)
        self.nested = nested
        with self.name_scope():
            self.dense = nn.Dense(3, in_units=2)

    def hybrid_forward(self, F, x):
        y = self.dense(x)
        return ([y, y * 2], y) if self.nested else (y, y * 2)


@pytest.mark.parametrize('nested', [False, True], ids=['pair', 'list'])
def test_merged_call_shares_immutable_results_only(recorder, nested):
    """A merged call gets the first call's pair of lazy values itself (a
    tuple cannot change); results nested in a list are made anew, so that
    changing one call's list leaves the other's alone."""
    block = dyb.DynBatchBlock(PairAndList(nested))
    block.initialize(mx.init.Uniform(0.5))
    x = np.array([[1.0, -2.0]], np.float32)
    with dyb.batching('depth'):
        first, second = block(x), block(x.copy())
        if nested:
            assert first[0] is not second[0]                 # two lists
            first[0][0] = None
            assert second[0][0] is not None
        else:
            assert first is second
        third = block(x)
    assert dyb.stats()['last']['repeated_calls'] == 2
    y = block.block.dense(mx.nd.array(x)).asnumpy()
    for got in (second, third):
        values = [*got[0], got[1]] if nested else list(got)
        for value, expected in zip(values, [y, 2 * y, y] if nested else [y, 2 * y]):
            np.testing.assert_allclose(value.asnumpy(), expected, rtol=1e-6)


class Noisy(gluon.HybridBlock):
    def hybrid_forward(self, F, x):
        return F.Dropout(x * 1, p=0.5)


class Normed(gluon.HybridBlock):
    def __init__(self):
        super().__init__()
        with self.name_scope():
            self.norm = nn.BatchNorm(in_channels=4)

    def hybrid_forward(self, F, x):
        return self.norm(x)


def test_random_draws_and_running_statistics_are_not_merged(recorder):
    """A block that draws random numbers (Dropout in training) or keeps
    running statistics (BatchNorm) is not a function of its inputs: equal
    calls each get a node, and each call its own draw."""
    noisy = dyb.DynBatchBlock(Noisy())
    normed = dyb.DynBatchBlock(Normed())
    normed.initialize()
    x = np.ones((1, 64), np.float32)
    y = np.ones((1, 4), np.float32)
    dyb.reset_stats()
    with autograd.train_mode():
        with dyb.batching('depth'):
            masks = [noisy(x) for _ in range(6)]
            normed_outs = [normed(y) for _ in range(3)]
        masks = [m.asnumpy() for m in masks]
        [o.asnumpy() for o in normed_outs]
    assert not any(sig.repeatable for sig in noisy.signatures())
    assert not normed.signatures()[0].repeatable
    assert dyb.stats()['repeated_calls'] == 0 and dyb.stats()['nodes'] == 9
    assert len({m.tobytes() for m in masks}) == 6


def test_running_statistics_read_in_inference_are_merged(recorder):
    """In inference (outside autograd) BatchNorm reads its running
    statistics as it reads parameters: equal calls share a node there, and
    give the per-sample values."""
    normed = dyb.DynBatchBlock(Normed())
    normed.initialize()
    normed.norm.running_mean.set_data(mx.nd.array([0.1, -0.2, 0.3, 0.4]))
    xs = [np.full((1, 4), value, np.float32) for value in (1.0, 2.0, 1.0, 1.0)]
    dyb.reset_stats()
    with dyb.batching('depth'):
        outs = [normed(x) for x in xs]
    assert dyb.stats()['repeated_calls'] == 2 and dyb.stats()['nodes'] == 2
    for out, x in zip(outs, xs):
        np.testing.assert_allclose(out.asnumpy(), normed.block(mx.nd.array(x)).asnumpy(),
                                   rtol=1e-6)
    assert normed.signatures()[0].inference.repeatable


def test_only_pending_calls_are_shared(recorder):
    """A repeat of a call that ran already (here in a part the scope ran by
    itself, then read) runs anew: the user's code may have changed a
    parameter since, and this call must see the new weights."""
    block = scaled_block()
    x = np.array([[0.5, 1.5]], np.float32)
    weight = block.block.dense.weight
    with dyb.batching('depth', flush_every=2) as scope:
        first = block(x)
        again = block(x)
        assert again._node is first._node and scope.repeated == 1
        block(np.array([[3.0, 4.0]], np.float32))   # the scope runs its part
        assert first.ready
        before = first.asnumpy()
        weight.set_data(weight.data() * 3)
        after = block(x)
        assert after._node is not first._node
    np.testing.assert_allclose(again.asnumpy(), before)
    np.testing.assert_allclose(after.asnumpy(), block.block(mx.nd.array(x)).asnumpy(),
                               rtol=1e-6)
    assert not np.allclose(after.asnumpy(), before)


def test_calls_under_another_autograd_state_do_not_share(recorder):
    """A call made inside ``autograd.pause()`` in a recording scope gets a
    node of its own, and the recorded one still trains."""
    block = scaled_block()
    x = np.array([[0.5, 1.5]], np.float32)
    with autograd.record():
        with dyb.batching('depth'):
            trained = block(x)
            with autograd.pause():
                paused = block(x)
            again = block(x)
        loss = (trained.data * 2).sum() + (again.data * 3).sum()
    assert paused._node is not trained._node
    loss.backward()
    grad = block.block.dense.weight.grad().asnumpy().copy()
    with autograd.record():
        ref = (block.block(mx.nd.array(x)) * 5).sum()
    ref.backward()
    np.testing.assert_allclose(grad, block.block.dense.weight.grad().asnumpy(), rtol=1e-5)


def test_mixed_host_and_lazy_arguments_are_not_merged(recorder):
    """Only calls whose arguments are all host arrays merge: a call that
    reads another call's value runs once per call (its input is computed)."""
    node, _ = make_tree_model(vocab=2)
    ids = np.zeros((1,), np.float32)
    dyb.reset_stats()
    with dyb.batching('depth'):
        leaf = node(ids, [], [])
        parents = [node(ids, [leaf[0]], [leaf[1]]) for _ in range(3)]
        node(ids, [], [])
    [p[0].asnumpy() for p in parents]
    assert dyb.stats()['repeated_calls'] == 1 and dyb.stats()['nodes'] == 4


def test_equal_bytes_in_another_byte_order_are_not_merged(recorder):
    """A big-endian view of an array holds its bytes but other values; the
    signature names the dtype's type (float32) either way.  (Found by a
    review: it shared the little-endian call's result.)"""
    block = scaled_block()
    little = np.array([[1.0, 2.0]], '<f4')
    big = little.view(little.dtype.newbyteorder())
    dyb.reset_stats()
    with dyb.batching('depth'):
        outs = [block(little), block(big), block(big.copy())]
    for out, arg in zip(outs, (little, big, big)):
        np.testing.assert_allclose(out.asnumpy(), block.block(mx.nd.array(arg)).asnumpy(),
                                   rtol=1e-6)
    assert dyb.stats()['repeated_calls'] == 0


def test_large_host_arguments_are_not_merged(recorder):
    """Keys copy the arguments' bytes until the flush: above REPEAT_BYTES
    (256 images of 3 x 224 x 224 floats held 154 MB) calls are not merged."""
    from gluon_dynbatch.block import REPEAT_BYTES
    block = dyb.DynBatchBlock(nn.Dense(2, in_units=REPEAT_BYTES // 4 + 1))
    small = dyb.DynBatchBlock(nn.Dense(2, in_units=REPEAT_BYTES // 4))
    block.initialize()
    small.initialize()
    big_x = np.ones((1, REPEAT_BYTES // 4 + 1), np.float32)
    small_x = np.ones((1, REPEAT_BYTES // 4), np.float32)
    dyb.reset_stats()
    with dyb.batching('depth'):
        for _ in range(3):
            block(big_x)
            small(small_x)
    assert dyb.stats()['repeated_calls'] == 2 and dyb.stats()['nodes'] == 4


NOISE = register_custom_op('dynbatch_test_rowwise_noise',
                           lambda x: mx.nd.array(x.asnumpy() + np.random.randn(*x.shape)))
"""A custom op adding its own noise to each row (no function of its input)."""


class Noisier(gluon.HybridBlock):
    def hybrid_forward(self, F, x):
        return F.Custom(x * 1, op_type=NOISE)


class HardSigmoid(gluon.HybridBlock):
    def hybrid_forward(self, F, x):
        return F.hard_sigmoid(x * 1)


def test_user_rules_merge_only_when_they_say_so(recorder, monkeypatch):
    """A user's rule claims the op is row-wise, not that it is a function
    of its inputs: a row-wise custom op that draws noise gets a draw per
    call (found by a review: two calls shared one), even when the rule for
    ``Custom`` says ``function_of_inputs=True`` (it covers every custom
    op); ``hard_sigmoid``'s rule says so, and its calls merge."""
    from gluon_dynbatch import rules
    monkeypatch.setattr(rules, 'RULES', dict(rules.RULES))
    monkeypatch.setattr(rules, 'NOT_FUNCTIONS', set(rules.NOT_FUNCTIONS))
    monkeypatch.setattr('gluon_dynbatch.trace.NOT_FUNCTIONS', rules.NOT_FUNCTIONS)
    monkeypatch.setattr('gluon_dynbatch.trace.batching_rule', rules.RULES.get)
    del rules.RULES['hard_sigmoid']         # (builtin now: registering it again would warn)
    # (one rule covers every custom op, so it cannot vouch for them all)
    dyb.register_batching_rule('Custom', function_of_inputs=True)(lambda op: None)
    dyb.register_batching_rule('hard_sigmoid', function_of_inputs=True)(lambda op: None)
    noisy = dyb.DynBatchBlock(Noisier())
    hard = dyb.DynBatchBlock(HardSigmoid())
    x = np.zeros((1, 3), np.float32)
    dyb.reset_stats()
    with dyb.batching('depth'):
        draws = [noisy(x) for _ in range(3)]
        clipped = [hard(x) for _ in range(3)]
    assert len({d.asnumpy().tobytes() for d in draws}) == 3
    assert [sig.repeatable for sig in noisy.signatures()] == [False]
    assert [sig.repeatable for sig in hard.signatures()] == [True]
    assert dyb.stats()['repeated_calls'] == 2
    np.testing.assert_allclose(clipped[2].asnumpy(), 0.5)


def test_an_ignored_empty_host_argument_runs(recorder):
    """A (1, 0) host argument the block ignores: its rows concatenate to
    no bytes, which the C path then could not shape (found by a review)."""
    block = dyb.DynBatchBlock(IgnoresSecond())
    block.initialize()
    x = np.array([[1.0, 2.0, 3.0]], np.float32)
    with dyb.batching('depth', merge_repeats=False):
        outs = [block(x.copy(), np.zeros((1, 0), np.float32)) for _ in range(3)]
    want = block.block.dense(mx.nd.array(x)).asnumpy()
    for out in outs:
        np.testing.assert_allclose(out.asnumpy(), want, rtol=1e-6)


class IgnoresSecond(gluon.HybridBlock):
    def __init__(self):
        super().__init__()
        with self.name_scope():
            self.dense = nn.Dense(3, in_units=3)

    def hybrid_forward(self, F, x, unused):
        return self.dense(x)


class SumOfTwo(gluon.HybridBlock):
    def __init__(self):
        super().__init__()
        with self.name_scope():
            self.dense = nn.Dense(2, in_units=4)

    def hybrid_forward(self, F, x, y):
        return F.broadcast_add(self.dense(x), F.sum(y, axis=1, keepdims=True))


@pytest.mark.parametrize('engine_wraps', [True, False])
def test_host_arguments_in_the_other_byte_order_arrive_as_values(recorder, engine_wraps,
                                                                 monkeypatch):
    """Steps send their host rows to MXNet as bytes (wrapped under a
    threaded engine, copied otherwise); '>f4' rows arrived as little-endian
    garbage (found by a review, older than merging)."""
    from gluon_dynbatch import execute
    monkeypatch.setattr(execute, 'threaded_engine', lambda: engine_wraps)
    block = dyb.DynBatchBlock(SumOfTwo())
    block.initialize(mx.init.Uniform(0.5))
    base = np.arange(8, dtype=np.float32).reshape(2, 4)
    args = [(base[i % 2:i % 2 + 1].astype('>f4'), base[:1].astype('>f4')) for i in range(4)]
    with dyb.batching('depth'):
        outs = [block(x, y) for x, y in args]
    for out, (x, y) in zip(outs, args):
        want = block.block(mx.nd.array(x.astype(np.float32)), mx.nd.array(y.astype(np.float32)))
        np.testing.assert_allclose(out.asnumpy(), want.asnumpy(), rtol=1e-6)


def test_stats_count_the_merged_calls_of_flushes_that_ran(recorder, monkeypatch):
    """Per flush, ``stats()['last']`` and the ``DYNBATCH_DEBUG`` line say
    how many calls merged; a flush that fails counts neither its nodes nor
    its merged calls (it had counted the merged ones)."""
    import gluon_dynbatch.block as block_module
    block = scaled_block()
    x = np.ones((1, 2), np.float32)
    dyb.reset_stats()
    with dyb.batching('depth'):
        [block(x) for _ in range(4)]
    assert dyb.stats()['last']['repeated_calls'] == 3
    assert dyb.stats()['nodes'] + dyb.stats()['repeated_calls'] == 4

    def fail(*args, **kwargs):
        raise RuntimeError('the step failed')
    monkeypatch.setattr(block_module, 'run_plan', fail)
    dyb.reset_stats()
    with pytest.raises(RuntimeError):
        with dyb.batching('depth'):
            [block(x) for _ in range(4)]
    assert dyb.stats()['nodes'] == 0 and dyb.stats()['repeated_calls'] == 0


def test_the_debug_line_shows_merged_calls(recorder, monkeypatch, capsys):
    monkeypatch.setenv('DYNBATCH_DEBUG', '1')
    block = scaled_block()
    x = np.ones((1, 2), np.float32)
    with dyb.batching('depth'):
        [block(x) for _ in range(3)]
    assert '[dynbatch] flush: 1 nodes (+2 merged calls) -> 1 steps' in capsys.readouterr().err


class NoisyEmbedding(gluon.HybridBlock):
    """A custom op (one draw per element) over a token's embedding: the
    host part of the block ends at the custom op."""

    def __init__(self):
        super().__init__()
        with self.name_scope():
            self.embed = gluon.nn.Embedding(10, 3)

    def hybrid_forward(self, F, token):
        return F.Custom(self.embed(token), op_type=NOISE)


@pytest.mark.parametrize('hoist', [False, True])
def test_equal_host_rows_do_not_share_a_custom_ops_run(recorder, hoist, monkeypatch):
    """Equal tokens neither merge (the signature is not repeatable) nor
    share one run of a custom op in a step that runs its host part on the
    distinct rows (``execute.SHARE_ROWS``) or hoists it for the flush
    (``HOIST_ROWS``): the op may draw, as this one does (found by a
    review: 16 equal tokens got 1 draw)."""
    from gluon_dynbatch import execute, rules
    monkeypatch.setattr(execute, 'HOIST_ROWS', 0 if hoist else 10 ** 9)
    monkeypatch.setattr(rules, 'RULES', dict(rules.RULES))
    monkeypatch.setattr('gluon_dynbatch.trace.batching_rule', rules.RULES.get)
    dyb.register_batching_rule('Custom')(lambda op: None)   # acts on each row alone
    block = dyb.DynBatchBlock(NoisyEmbedding())
    block.initialize()
    token = np.array([3.0], np.float32)
    with dyb.batching('depth'):
        draws = [block(token) for _ in range(16)]
    assert len({d.asnumpy().tobytes() for d in draws}) == 16
