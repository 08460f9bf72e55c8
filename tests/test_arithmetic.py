"""Arithmetic on lazy values (``h + x``, ``0.5 * h``, ``-h``...) between block
calls: recorded as calls and batched, with results and gradients equal to
the same NDArray code run per sample."""
import mxnet as mx
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from mxnet import gluon
from mxnet.gluon import nn

import gluon_dynbatch as dyb
from helpers import TanhDense, assert_same, random_tree, run_both

STRATEGIES = ['per-sample', 'depth', 'agenda', 'cached', 'auto']


def dense_pair():
    first, second = dyb.DynBatchBlock(TanhDense(4)), dyb.DynBatchBlock(TanhDense(4))
    first.initialize(mx.init.Xavier())
    second.initialize(mx.init.Xavier())
    return first, second


def every_operator(first, second, xs, bias, shift):
    """Every operator, with numbers, NDArrays (one of lower rank), host
    numbers of other types and other lazy values on either side; every
    value finite and away from tanh's saturation, where a wrong operand
    order would hide."""
    outs = []
    for i, x in enumerate(xs):
        h = first(x)
        g = second(h) * 0.5 + h            # a residual and a scale between calls
        out = -(g - 1.0) / 2.0 + g ** 2 + abs(g) + (2 - h) + 1 / (h * h + 1)
        out = out + 2 ** h + h / (g * g + 1) + (abs(g) + 0.5) ** h + bias
        out = out + shift[i:i + 1] * np.float32(i)
        out = out + (x - h) * (x / (g * g + 1)) + x ** h + bias * g   # NDArray first
        out = out + np.float32(0.25) * h - np.int64(3)
        out = out + h % 0.75 + 1.5 % (abs(g) + 0.5) + bias % (abs(h) + 1)   # '%', either side
        out = out + (g > 0) * g + (0 < h) - (h <= g) + (x >= h) * x + (shift[i:i + 1] < g)
        out = out + (h == h) * 2 + (h != 1) - (bias == bias) + (x != h)     # comparisons: 0/1
        total = 0
        for term in (h, g, out):
            total = total + term           # from a number (int.__add__ defers)
        outs.extend([total, second(total) + x])
    return outs


@pytest.mark.parametrize('strategy', STRATEGIES)
def test_every_operator_gives_per_sample_results_and_gradients(strategy):
    first, second = dense_pair()
    rng = np.random.RandomState(0)
    xs = [mx.nd.array(rng.uniform(0.2, 1, (1, 4))) for _ in range(7)]
    bias = mx.nd.array(rng.uniform(-1, 1, (4,)))         # rank 1: broadcast as per sample
    shift = mx.nd.array(rng.uniform(-1, 1, (7, 4)))
    results = run_both(lambda: every_operator(first, second, xs, bias, shift),
                       [first, second], inputs=xs + [bias, shift], strategy=strategy)
    assert_same(results)


def test_calls_with_different_numbers_share_a_step():
    """A number is a host argument, not part of the signature: ``h * k``
    for ten different ``k`` is one step, not ten."""
    first, _ = dense_pair()
    xs = [mx.nd.ones((1, 4)) * k for k in range(10)]
    dyb.reset_stats()
    with dyb.batching('depth'):
        outs = [first(x) * float(k) for k, x in enumerate(xs)]
        rows = dyb.concat_rows(outs).asnumpy()
    assert dyb.stats()['steps'] == 2                    # the dense, the multiply
    expected = np.concatenate([(first(x) * float(k)).asnumpy() for k, x in enumerate(xs)])
    np.testing.assert_allclose(rows, expected, rtol=1e-6)


def test_number_is_cast_to_the_values_dtype():
    first = dyb.DynBatchBlock(nn.Dense(3, in_units=3, dtype='float64'))
    first.initialize()
    x = mx.nd.ones((1, 3), dtype='float64')
    with dyb.batching():
        value = first(x) + 1e-12
    assert value.dtype == np.float64
    np.testing.assert_array_equal(value.asnumpy(), (first(x) + 1e-12).asnumpy())


class TreeCell(gluon.HybridBlock):
    """``tanh(W [x, s])`` of a token's vector and the sum of its children's
    states, which the caller adds up outside the block."""

    def __init__(self):
        super().__init__()
        with self.name_scope():
            self.embed = nn.Embedding(20, 4)
            self.dense = nn.Dense(4, in_units=8)

    def hybrid_forward(self, F, token, child_sum):
        return F.tanh(self.dense(F.concat(self.embed(token), child_sum, dim=1)))


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 10 ** 6), strategy=st.sampled_from(STRATEGIES))
def test_random_trees_summed_outside_the_block(seed, strategy):
    """A recursive net whose child sums and readout are arithmetic between
    calls, on random trees: per-sample results and gradients."""
    rng = np.random.RandomState(seed)
    cell = dyb.DynBatchBlock(TreeCell())
    cell.initialize(mx.init.Xavier(), force_reinit=True)
    trees = [random_tree(rng, int(rng.randint(1, 12)), max_arity=3) for _ in range(3)]
    zero = mx.nd.zeros((1, 4))

    def encode(tree):
        total = zero
        for child in tree.children:
            total = total + encode(child)
        token = np.array([tree.idx % 20], dtype=np.float32)
        return cell(token, total * 0.5)

    def forward():
        return [encode(tree) * 2.0 - 1 for tree in trees]

    assert_same(run_both(forward, [cell], strategy=strategy))


def test_outside_a_scope_it_is_ndarray_arithmetic():
    first, _ = dense_pair()
    x = mx.nd.ones((1, 4))
    with dyb.batching():
        value = first(x)
    for _ in range(2):      # the second time, the operators' blocks exist (a faster path)
        out = -(value * 3 - 1) * value + abs(value)
        assert isinstance(out, mx.nd.NDArray)
        expected = -(first(x) * 3 - 1) * first(x) + abs(first(x))
        np.testing.assert_allclose(out.asnumpy(), expected.asnumpy(), rtol=1e-6)


def test_other_operands_and_operators_are_refused():
    first, _ = dense_pair()
    with dyb.batching():
        value = first(mx.nd.ones((1, 4)))
        for attempt in (lambda: value + np.ones((1, 4)), lambda: np.ones((1, 4)) + value):
            with pytest.raises(TypeError, match=r'dense\d+.*numpy array of shape \(1, 4\)'):
                attempt()
        with pytest.raises(TypeError, match='unsupported operand'):
            value + 'a'                     # pylint: disable=expression-not-assigned
        total = mx.nd.zeros((1, 4))
        with pytest.raises(TypeError, match=r'in-place.*tanhdense\d+.*total = total \+ value'):
            total += value
        assert (total.asnumpy() == 0).all()
        for attempt in (lambda: bool(value > 1), lambda: value[0], lambda: value @ value):
            with pytest.raises(TypeError,
                               match=r'arithmetic.*comparisons.*are batched.*value\.data'):
                attempt()
        with pytest.raises(dyb.InputError, match=r'\+ of .*\(3, 4\).*leading axis of 3'):
            value + mx.nd.ones((3, 4))      # pylint: disable=expression-not-assigned


def _apply(op, a, b, k):
    """One step of a random program: arithmetic that stays finite.  Each
    operand of a comparison feeds a differentiable op too: MXNet 1.9.1
    crashes in backward, per sample, where the output of ``tanh`` or
    ``relu`` of a ``FullyConnected`` is read by zero-gradient ops alone."""
    return {'add': lambda: a + b, 'sub': lambda: b - a, 'mul': lambda: a * b,
            'div': lambda: a / (b * b + 1), 'rdiv': lambda: k / (a * a + 1),
            'neg': lambda: -a, 'abs': lambda: abs(a), 'scale': lambda: k * a - k,
            'pow': lambda: (abs(a) + 0.5) ** k, 'rpow': lambda: 1.5 ** b,
            'mod': lambda: a % 0.75 - k % (abs(b) + 0.5),
            'mask': lambda: (a > b) * (a + b) + (k <= b) * b - (a != a) * a}[op]()


@settings(max_examples=25, deadline=None)
@given(program=st.lists(st.tuples(st.sampled_from(['add', 'sub', 'mul', 'div', 'rdiv', 'neg',
                                                   'abs', 'scale', 'pow', 'rpow', 'mod', 'mask',
                                                   'call']),
                                   st.integers(0, 10 ** 6), st.integers(0, 10 ** 6),
                                   st.sampled_from([-2, 0.5, 1, 3.0])),
                         min_size=1, max_size=12),
       samples=st.integers(1, 5), strategy=st.sampled_from(STRATEGIES))
def test_random_programs_of_calls_and_arithmetic(program, samples, strategy):
    """Random programs mixing block calls, arithmetic on their values,
    numbers and NDArray inputs, per sample: equal results and gradients."""
    first, _ = dense_pair()
    rng = np.random.RandomState(len(program))
    xs = [mx.nd.array(rng.uniform(-1, 1, (1, 4))) for _ in range(samples)]

    def forward():
        outs = []
        for x in xs:
            values = [x, first(x)]
            for op, i, j, k in program:
                a, b = values[i % len(values)], values[j % len(values)]
                values.append(first(a) if op == 'call' else _apply(op, a, b, k))
            outs.append(values[-1] if values[-1] is not x else first(x))
        return outs

    assert_same(run_both(forward, [first], inputs=xs, strategy=strategy), rtol=1e-4, atol=1e-5)


class Copy(gluon.HybridBlock):
    """Its argument, computed (an argument returned unchanged is no lazy value)."""

    def hybrid_forward(self, F, x):
        return F.identity(x)


@pytest.mark.parametrize('dtype, number', [('float16', 1 + 2 ** -11 + 2 ** -30),
                                           ('float16', 2049.0001), ('int64', 2 ** 62 + 1),
                                           ('float32', np.True_)])
def test_numbers_are_cast_as_ndarray_scalar_operators_cast_them(dtype, number):
    """NDArray's ``x + k`` makes ``k`` a double and casts that to the
    dtype, float16 through float32: numpy's direct cast of the number gave
    2050 for 2049.0001 in float16 where NDArray has 2048 (and 1.001 for
    1 + 2 ** -11 + 2 ** -30, NDArray 1.0), and kept 2 ** 62 + 1 in int64,
    which NDArray rounds to 2 ** 62.  ``np.bool_``, a number to NDArray,
    was refused.  (Found by a review.)"""
    block = dyb.DynBatchBlock(Copy())
    x = mx.nd.array([[1, -2, 3, 0]], dtype=dtype)
    ops = [lambda a: a + number, lambda a: number - a, lambda a: a * number]
    with dyb.batching():
        values = [op(block(x)) for op in ops]
    for op, value in zip(ops, values):
        expected = op(x).asnumpy()
        assert value.dtype == expected.dtype
        np.testing.assert_array_equal(value.asnumpy(), expected)


@pytest.mark.parametrize('strategy', ['depth', 'per-sample'])
@pytest.mark.parametrize('dtype', ['int32', 'int64', 'int8', 'uint8'])
def test_a_number_over_an_integer_value_is_ndarrays_division_and_zero_does_not_kill(dtype,
                                                                                       strategy):
    """``k / v`` for a lazy value ``v`` of integer dtype is NDArray's
    ``_rdiv_scalar`` per sample: ``k`` cast to the dtype, the quotient
    computed in float32 and cast back, so that a zero in ``v`` gives what
    a float32 infinity casts to.  Recorded as integer ``broadcast_div``, a
    zero killed the process (SIGFPE; found by a fuzzer).  Numbers that
    differ still share a step, and a value of a closed scope divides as
    NDArray does too."""
    info = np.iinfo(dtype)
    rows = [np.array([[0, 1, 3, info.max, info.min, 7]], dtype),
            np.array([[2, 0, 0, 5, 9, 1]], dtype)]
    numbers = [2, 2.5, -7, 0, 300, 1073741825, 1e300, np.int64(-3), True]
    block = dyb.DynBatchBlock(Copy())
    dyb.reset_stats()
    with dyb.batching(strategy):
        values = [k / block(row) for row in rows for k in numbers]
        got = [value.asnumpy() for value in values]
    if strategy == 'depth':
        assert dyb.stats()['steps'] == 2                 # the copies, the divisions
    expected = [(k / mx.nd.array(row, dtype=dtype)).asnumpy() for row in rows for k in numbers]
    for mine, theirs in zip(got, expected):
        assert mine.dtype == theirs.dtype
        np.testing.assert_array_equal(mine, theirs)
    closed = values[0]
    np.testing.assert_array_equal((5 / closed).asnumpy(),
                                  (5 / mx.nd.array(got[0], dtype=dtype)).asnumpy())


def test_refused_arithmetic_says_what_was_written_and_what_to_do():
    """An operand the operator's call refused was reported as an argument
    of the internal block ``lazy_broadcast_add`` with a block call's advice
    (``x[i:i+1]``, cast inside the block, and for an mxnet.numpy array
    "dtype float32 but earlier arguments have float32"); ``pow(v, 2, 5)``
    failed in the operator's trace.  (Found by a review.)"""
    first, _ = dense_pair()
    with dyb.batching():
        value = first(mx.nd.ones((1, 4)))
        with pytest.raises(dyb.InputError, match=r'^- of an NDArray \(shape \(2, 4\), float32\) '
                           r'and a LazyValue of block tanhdense\d+ \(shape \(1, 4\), float32\): '
                           r'per sample .* leading axis of 2 .* inside a wrapped block'):
            mx.nd.ones((2, 4)) - value      # pylint: disable=expression-not-assigned
        with pytest.raises(dyb.InputError, match=r'^\* of .*float64.*one dtype.*astype'):
            value * mx.nd.ones((4,), dtype='float64')   # pylint: disable=expression-not-assigned
        with pytest.raises(dyb.InputError, match=r'^\+ of .*as_nd_ndarray'):
            value + mx.np.ones((1, 4))      # pylint: disable=expression-not-assigned
        wide = dyb.DynBatchBlock(nn.Dense(4, in_units=4, dtype='float64'))
        wide.initialize()
        other = wide(mx.nd.ones((1, 4), dtype='float64'))
        for _ in range(2):          # the second time, the operator's block exists
            with pytest.raises(dyb.InputError, match=r'^\* of .*float32.*float64.*one dtype'):
                value * other       # pylint: disable=pointless-statement
        with pytest.raises(TypeError, match=r'LazyValue.__pow__\(\) takes 2 positional'):
            pow(value, 2, 5)
        np.testing.assert_allclose((value * 2).asnumpy(), value.asnumpy() * 2)


@pytest.mark.parametrize('made', [False, True])
def test_an_error_of_the_flush_an_operator_starts_is_raised_there(made):
    """Found by a review: once the operator's block existed, an InputError
    of the pipelined flush that ``h + g`` started (a block cast under a
    pending call) was taken for a refusal of the operands: the call was
    recorded again and returned a value, the error lost.  It is raised by
    ``h + g``, as the first time, and the call is recorded once."""
    first, second = dense_pair()
    x = mx.nd.ones((1, 4))
    if made:
        with dyb.batching():
            first(x) + first(x)     # pylint: disable=expression-not-assigned
    with dyb.batching('depth', flush_every=2):
        h, g = first(x), first(x)
        h.data      # pylint: disable=pointless-statement
        pending = second(x)
        second.block.cast('float64')
        with pytest.raises(dyb.InputError, match='parameters changed after they were traced'):
            h + g       # pylint: disable=pointless-statement
        assert not dyb.current_scope().pending
        with pytest.raises(dyb.LazyValueError):
            pending.data    # pylint: disable=pointless-statement


def test_sparse_ndarrays_on_either_side():
    """A CSR or row-sparse NDArray defines its own ``+ - *``, which raised
    MXNet's error for a lazy value on the right (``csr * v``) instead of
    deferring to the value's reflected operator, as a dense NDArray does."""
    first, _ = dense_pair()
    rng = np.random.RandomState(1)
    xs = [mx.nd.array(rng.uniform(-1, 1, (1, 4))) for _ in range(3)]
    dense = mx.nd.array([[0, 1.5, 0, -2]])
    sparse = [dense.tostype('csr'), dense.tostype('row_sparse')]

    def forward():
        return [s * h + s - h + (h - s) * (s + h) for s in sparse for h in map(first, xs)]

    assert_same(run_both(forward, [first], inputs=xs))
    with dyb.batching():
        value = first(xs[0])
        for array in sparse:
            with pytest.raises(TypeError, match=r'in-place.*total = total \+ value'):
                array += value


def test_number_rows_are_shared_read_only_but_not_for_nan_or_zero():
    """A number's host row is made once per number, dtype and rank and
    shared (read-only); a NaN, which no key finds again, grew the cache by
    a row a use, and a zero's key would lose its sign (-0.0 == 0.0)."""
    from gluon_dynbatch import block as block_module
    first, _ = dense_pair()
    x = mx.nd.ones((1, 4))
    with dyb.batching():
        value = first(x)
        rows = block_module._NUMBER_ROWS
        [value * 2.5 for _ in range(3)]     # pylint: disable=expression-not-assigned
        size = len(rows)
        shared = [row for key, row in rows.items() if key[0] == 2.5 and key[2] == value.dtype]
        assert len(shared) == 1 and not shared[0].flags.writeable
        outs = [value * float('nan') for _ in range(5)] + [value * -0.0, value * 0.0]
        assert len(rows) == size
        got = dyb.concat_rows(outs).asnumpy()
    assert np.isnan(got[:5]).all()
    expected = np.concatenate([(first(x) * -0.0).asnumpy(), (first(x) * 0.0).asnumpy()])
    np.testing.assert_array_equal(np.signbit(got[5:]), np.signbit(expected))
