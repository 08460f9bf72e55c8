"""Property test of the batching rules of slice, broadcast_axis/axes,
broadcast_to, broadcast_like, tile, topk, sort, argsort, reverse/flip,
SwapAxis/swapaxes, linalg_gemm2, smooth_l1, diag, moments, softmin,
Pooling and BatchNorm, and of ops on a sample folded into several rows by
a reshape (:func:`draw_fold`): random ranks, shapes,
attributes and choices of batched and shared inputs.  Whatever the rules
decide, the block's results and gradients under ``dyb.batching('depth')``
must equal the per-sample ones: an accepted draw that moved or mixed the
batch axis would differ (or fail at the flush)."""
import os

import mxnet as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, note, reject, settings
from hypothesis import strategies as st
from mxnet import autograd, gluon

import gluon_dynbatch as dyb

from helpers import assert_same, run_both


class Prop(gluon.HybridBlock):
    """``op(F, *args)``, where a batched argument ``k`` is ``dense_k(x_k)``
    (of a per-sample input ``x_k`` of the argument's shape) and a shared
    one the parameter ``s_k`` of its shape (initialised as ``op.inits[k]``
    says, where it does), or for ``k`` in ``consts`` a constant; then
    ``back``, when given."""

    def __init__(self, op, args, consts=()):
        super().__init__()
        self.op, self.args, self.consts, self.back = op, args, consts, None
        with self.name_scope():
            for k, (batched, shape) in enumerate(args):
                if batched:
                    setattr(self, 'dense%d' % k, gluon.nn.Dense(
                        shape[-1], in_units=shape[-1], flatten=False))
                elif k not in consts:
                    setattr(self, 's%d' % k, self.params.get(
                        's%d' % k, shape=shape,
                        init=getattr(op, 'inits', {}).get(k, mx.init.Uniform(1.0))))

    def hybrid_forward(self, F, *xs, **params):
        xs, args = list(xs), []
        for k, (batched, shape) in enumerate(self.args):
            if batched:
                args.append(getattr(self, 'dense%d' % k)(xs.pop(0)))
            elif k in self.consts:
                args.append(F.sin(F.arange(int(np.prod(shape))) + k).reshape(shape))
            else:
                args.append(params['s%d' % k])
        y = self.op(F, *args)
        return self.back(F, y) if self.back else y


def _rows_back(F, y):
    """Back to one row per sample, for an op whose result has another
    leading size (the tracer then refuses the block)."""
    return F.sum(y, axis=0, keepdims=True)


# --- drawing ops: each returns (op, [(batched, per-sample shape), ...]) ---

def _call(fn, name, kwargs, reference=None):
    """``fn(F, *args)``, named for a failing example's note; ``reference``,
    where given, numpy's result of the op on one input (draws where MXNet's
    own per-sample result differs are skipped)."""
    fn.text, fn.reference = '%s(%s)' % (name, ', '.join(
        '%s=%r' % item for item in sorted(kwargs.items()))), reference
    return fn


def _shape(draw, rank=None, dims=st.integers(1, 3)):
    rank = draw(st.integers(2, 4)) if rank is None else rank
    return (1,) + tuple(draw(dims) for _ in range(rank - 1))


def _axis(draw, rank):
    """An axis in range, positive or negative."""
    return draw(st.integers(-rank, rank - 1))


def _axes_tuple(draw, rank, min_size=0, max_size=None):
    axes = draw(st.lists(st.integers(0, rank - 1), min_size=min_size,
                         max_size=rank if max_size is None else max_size, unique=True))
    return tuple(a - rank if draw(st.booleans()) else a for a in axes)


def draw_slice(draw):
    shape = _shape(draw, dims=st.integers(1, 4))
    n = draw(st.integers(1, len(shape)))           # bounds for the first n axes
    begin, end, step = [], [], []
    for dim in shape[:n]:
        bounds = st.one_of(st.none(), st.integers(-dim - 1, dim + 1))
        begin.append(draw(bounds))
        end.append(draw(bounds))
        step.append(draw(st.sampled_from([None, 1, 1, -1, 2])))
    kwargs = {'begin': tuple(begin), 'end': tuple(end)}
    if draw(st.booleans()):
        kwargs['step'] = tuple(step)
    return _call(lambda F, h: F.slice(h, **kwargs), 'slice', kwargs), [(True, shape)]


def draw_broadcast_axis(draw):
    shape = _shape(draw, dims=st.sampled_from([1, 1, 2, 3]))
    axes = _axes_tuple(draw, len(shape))
    sizes = tuple(draw(st.integers(1, 3)) for _ in axes)
    name = draw(st.sampled_from(['broadcast_axis', 'broadcast_axes']))
    if len(axes) == 1 and draw(st.booleans()):
        axes, sizes = axes[0], sizes[0]
    kwargs = {'axis': axes, 'size': sizes}
    return _call(lambda F, h: getattr(F, name)(h, **kwargs), name, kwargs), [(True, shape)]


def draw_broadcast_to(draw):
    shape = _shape(draw, dims=st.sampled_from([1, 1, 2, 3]))
    target = [draw(st.sampled_from([0, 1, 2]))]
    for dim in shape[1:]:
        target.append(draw(st.sampled_from([0, dim] + ([2, 3] if dim == 1 else []))))
    if draw(st.integers(0, 9)) == 0:          # of another rank (MXNet refuses)
        target = target[:-1] if draw(st.booleans()) else target + [2]
    target = tuple(target)
    return (_call(lambda F, h: F.broadcast_to(h, shape=target), 'broadcast_to',
                  {'shape': target}), [(True, shape)])


def draw_broadcast_like(draw):
    lhs_b, rhs_b = draw(st.sampled_from([(True, True), (True, False), (False, True)]))
    rank = draw(st.integers(2, 4))
    dims = st.sampled_from([1, 1, 2, 3])
    rhs = tuple(1 if rhs_b and i == 0 else draw(dims) for i in range(rank))
    kwargs = {}
    if draw(st.booleans()):         # like on every axis: lhs of the rank, 1 or rhs's dim
        lhs = tuple(1 if lhs_b and i == 0 else draw(st.sampled_from([1, dim]))
                    for i, dim in enumerate(rhs))
    else:
        lrank = draw(st.integers(2, 4))
        lhs = tuple(1 if lhs_b and i == 0 else draw(dims) for i in range(lrank))
        n = draw(st.integers(0, min(rank, lrank)))
        lhs_axes = _axes_tuple(draw, lrank, n, n)
        rhs_axes = _axes_tuple(draw, rank, n, n)
        lhs = tuple(1 if (i in lhs_axes or i - lrank in lhs_axes) and draw(st.booleans())
                    else dim for i, dim in enumerate(lhs))
        which = draw(st.sampled_from(['both', 'both', 'both', 'lhs', 'rhs']))
        if which != 'rhs':
            kwargs['lhs_axes'] = lhs_axes
        if which != 'lhs':
            kwargs['rhs_axes'] = rhs_axes
    return (_call(lambda F, a, b: F.broadcast_like(a, b, **kwargs), 'broadcast_like', kwargs),
            [(lhs_b, lhs), (rhs_b, rhs)])


def draw_tile(draw):
    shape = _shape(draw)
    reps = tuple(draw(st.lists(st.sampled_from([0, 1, 1, 2, 3]), max_size=len(shape) + 1)))
    # (MXNet's tile gives wrong values for some reps longer than the rank,
    # such as zeros for (2, 2, 2, 2) on (1, 1, 2): such draws are skipped)
    return (_call(lambda F, h: F.tile(h, reps=reps), 'tile', {'reps': reps},
                  lambda a: np.tile(a, reps)), [(True, shape)])


def draw_topk(draw):
    shape = _shape(draw, dims=st.integers(1, 4))
    axis = draw(st.sampled_from([None] + list(range(-len(shape), len(shape)))))
    kwargs = {'axis': axis, 'k': draw(st.integers(1, 3)), 'is_ascend': draw(st.booleans()),
              'ret_typ': draw(st.sampled_from(['value', 'indices', 'mask', 'both']))}

    def op(F, h):
        out = F.topk(h, **kwargs)
        return out[0] * out[1] if kwargs['ret_typ'] == 'both' else out
    return _call(op, 'topk', kwargs), [(True, shape)]


def draw_sort(draw):
    shape = _shape(draw, dims=st.integers(1, 4))
    axis = draw(st.sampled_from([None] + list(range(-len(shape), len(shape)))))
    name, ascend = draw(st.sampled_from(['sort', 'argsort'])), draw(st.booleans())
    kwargs = {'axis': axis, 'is_ascend': ascend}
    return _call(lambda F, h: getattr(F, name)(h, **kwargs), name, kwargs), [(True, shape)]


def draw_reverse(draw):
    shape = _shape(draw)
    axes = _axes_tuple(draw, len(shape), 1)
    name = draw(st.sampled_from(['reverse', 'flip']))
    if len(axes) == 1 and draw(st.booleans()):
        axes = axes[0]
    return (_call(lambda F, h: getattr(F, name)(h, axis=axes), name, {'axis': axes}),
            [(True, shape)])


def draw_swapaxes(draw):
    shape = _shape(draw)
    kwargs = {key: _axis(draw, len(shape)) for key in ('dim1', 'dim2')
              if draw(st.integers(0, 4))}
    name = draw(st.sampled_from(['swapaxes', 'SwapAxis']))
    return _call(lambda F, h: getattr(F, name)(h, **kwargs), name, kwargs), [(True, shape)]


def draw_gemm2(draw):
    """Shapes that MXNet accepts (mostly): rows on ``axis``, columns on the
    last axis, equal sizes elsewhere; a batched operand's axis 0 of 1."""
    rank = draw(st.integers(2, 4))
    kwargs = {'transpose_a': draw(st.booleans()), 'transpose_b': draw(st.booleans()),
              'alpha': draw(st.sampled_from([1.0, 0.5]))}
    axis = -2
    if draw(st.booleans()):
        axis = kwargs['axis'] = _axis(draw, rank)
    a_b, b_b = draw(st.sampled_from([(True, True), (True, False), (False, True)]))
    rows = axis % rank
    dims = st.sampled_from([1, 1, 2, 3])
    sizes = {name: draw(dims) for name in ('m', 'k', 'n')}
    sizes.update({i: draw(dims) for i in range(rank)})

    def layout(first, second, transposed):
        names = [i for i in range(rank)]
        names[rows], names[-1] = (second, first) if transposed else (first, second)
        return names
    names_a = layout('m', 'k', kwargs['transpose_a'])
    names_b = layout('k', 'n', kwargs['transpose_b'])
    for batched, names in ((a_b, names_a), (b_b, names_b)):
        if batched:
            sizes[names[0]] = 1
    a, b = (tuple(sizes[x] for x in names) for names in (names_a, names_b))
    name = draw(st.sampled_from(['linalg.gemm2', 'linalg_gemm2']))

    def op(F, x, y):
        if name == 'linalg.gemm2':
            return F.linalg.gemm2(x, y, **kwargs)
        return F.linalg_gemm2(x, y, **kwargs)
    return _call(op, name, kwargs), [(a_b, a), (b_b, b)]


def draw_smooth_l1(draw):
    scalar = draw(st.sampled_from([0.5, 1.0, 2.0]))
    return (_call(lambda F, h: F.smooth_l1(h, scalar=scalar), 'smooth_l1', {'scalar': scalar}),
            [(True, _shape(draw))])


def draw_diag(draw):
    shape = _shape(draw)
    kwargs = {'k': draw(st.sampled_from([-1, 0, 1]))}
    if len(shape) > 2 and draw(st.booleans()):      # else MXNet's defaults, axes 0 and 1
        first = _axis(draw, len(shape))
        second = draw(st.sampled_from([a for a in range(-len(shape), len(shape))
                                       if a % len(shape) != first % len(shape)]))
        kwargs.update(axis1=first, axis2=second)
    return _call(lambda F, h: F.diag(h, **kwargs), 'diag', kwargs), [(True, shape)]


def draw_moments(draw):
    shape = _shape(draw)
    kwargs = {'axes': _axes_tuple(draw, len(shape), min_size=1),
              'keepdims': draw(st.booleans())}

    def op(F, h):
        mean, var = F.moments(h, **kwargs)
        return mean + var
    return _call(op, 'moments', kwargs), [(True, shape)]


def draw_softmin(draw):
    shape = _shape(draw)
    kwargs = {'axis': _axis(draw, len(shape)),
              'temperature': draw(st.sampled_from([None, 0.5, 2.0]))}
    return _call(lambda F, h: F.softmin(h, **kwargs), 'softmin', kwargs), [(True, shape)]


def draw_pooling(draw):
    """Always a sample's own rows (accepted whatever the attributes)."""
    shape = _shape(draw, rank=draw(st.sampled_from([3, 4])), dims=st.integers(1, 4))
    spatial = len(shape) - 2
    kwargs = {'kernel': tuple(draw(st.integers(1, 2)) for _ in range(spatial)),
              'pool_type': draw(st.sampled_from(['max', 'avg', 'sum'])),
              'global_pool': draw(st.booleans()),
              'pooling_convention': draw(st.sampled_from(['valid', 'full']))}
    if draw(st.booleans()):
        kwargs['stride'] = tuple(draw(st.integers(1, 2)) for _ in range(spatial))
    return _call(lambda F, h: F.Pooling(h, **kwargs), 'Pooling', kwargs), [(True, shape)]


def draw_batch_norm(draw):
    """Batched only with global statistics over a channel axis other
    than the batch axis; its gamma and beta are parameters or constants."""
    shape = _shape(draw, rank=draw(st.sampled_from([2, 3, 4])))
    axis = _axis(draw, len(shape))
    channels = (shape[axis],)
    kwargs = {'axis': axis, 'use_global_stats': draw(st.booleans()),
              'fix_gamma': draw(st.booleans()), 'eps': 1e-3}

    def op(F, h, gamma, beta, mean, var):
        return F.BatchNorm(h, gamma, beta, mean, var, **kwargs)
    op = _call(op, 'BatchNorm', kwargs)
    # (the running statistics are parameters, never constants: BatchNorm
    # writes them in training, and MXNet's trace refuses any other input)
    op.inits = {3: mx.init.Uniform(1.0), 4: mx.init.Constant(0.7)}
    return op, [(True, shape)] + [(False, channels)] * 4


FOLDED_OPS = ('tanh', 'softmax', 'sum', 'transpose', 'swapaxes', 'batch_dot', 'mul')
"""What :func:`draw_fold` applies to a sample folded into rows."""
SECOND = ('folded', 'one row', 'shared row', 'shared rows', 'shared last axis')
"""The second operand of its ``mul``: batched and folded alike, batched of
one row, a shared (1, ...) parameter, a shared one of the folded rows, or
of the last axis alone."""


def draw_fold(draw):
    """A sample of one row, (1, n), folded into ``rows`` rows by a reshape
    (written ``(rows, ...)`` as per-sample code writes it, ``(-1, ...)``, or
    read from the right, as gluonnlp writes it), an op on the rows, and
    back to one row, ``(1, -1)``."""
    rows = draw(st.integers(2, 3))
    rest = tuple(draw(st.integers(1, 3)) for _ in range(draw(st.integers(1, 2))))
    size = rows * int(np.prod(rest))
    how = draw(st.sampled_from(['rows', '-1', 'reverse']))
    name = draw(st.sampled_from(FOLDED_OPS))
    second = draw(st.sampled_from(SECOND)) if name == 'mul' else None

    def fold(F, h):
        if how == 'reverse':
            return F.reshape(F.reshape(h, shape=(0, rows) + rest), shape=(-1,) + (0,) * len(rest),
                             reverse=True)
        return F.reshape(h, shape=((rows,) if how == 'rows' else (-1,)) + rest)

    def op(F, h, *more):
        y = fold(F, h)
        if name == 'tanh':
            y = F.tanh(y)
        elif name == 'softmax':
            y = F.softmax(y, axis=-1)
        elif name == 'sum':
            y = F.broadcast_mul(F.sum(y, axis=-1, keepdims=True), y)
        elif name == 'transpose':
            y = F.transpose(y, axes=(0,) + tuple(range(len(rest), 0, -1)))
        elif name == 'swapaxes':
            y = F.swapaxes(y, 0, len(rest))
        elif name == 'batch_dot':
            y = F.batch_dot(y, y, transpose_b=True) if len(rest) == 2 else y * y
        else:
            other = fold(F, more[0]) if second == 'folded' else more[0]
            y = F.broadcast_mul(y, other)
        return F.reshape(y, shape=(1, -1))

    shapes = {'folded': (True, (1, size)), 'one row': (True, (1,) + rest),
              'shared row': (False, (1,) + rest), 'shared rows': (False, (rows,) + rest),
              'shared last axis': (False, rest[-1:])}
    return (_call(op, 'fold', {'rows': rows, 'rest': rest, 'how': how, 'op': name,
                               'second': second}),
            [(True, (1, size))] + ([shapes[second]] if second else []))


OPS = {'slice': draw_slice, 'broadcast_axis': draw_broadcast_axis,
       'broadcast_to': draw_broadcast_to, 'broadcast_like': draw_broadcast_like,
       'tile': draw_tile, 'topk': draw_topk, 'sort': draw_sort, 'reverse': draw_reverse,
       'swapaxes': draw_swapaxes, 'linalg_gemm2': draw_gemm2, 'smooth_l1': draw_smooth_l1,
       'diag': draw_diag, 'moments': draw_moments, 'softmin': draw_softmin,
       'Pooling': draw_pooling, 'BatchNorm': draw_batch_norm, 'fold': draw_fold}
ALWAYS_BATCHED = {'smooth_l1', 'Pooling'}
"""Row-wise ops, accepted on every draw."""


def _inputs(args, seed):
    rng = np.random.RandomState(seed)
    return [mx.nd.array(rng.uniform(-1, 1, shape)) for batched, shape in args if batched]


def _per_sample_output(op, block, args):
    """The output shape of one call run imperatively, with its backward;
    None when MXNet refuses the op per sample, its result is empty, or it
    differs from ``op.reference``."""
    xs = _inputs(args, 0)
    try:
        with autograd.record():
            out = block(*xs)
        out.backward()
        if op.reference is not None:
            got = op(mx.nd, xs[0]).asnumpy()
            want = op.reference(xs[0].asnumpy())
            if got.shape != want.shape or not np.allclose(got, want):
                return None
        mx.nd.waitall()
    except mx.MXNetError:
        return None
    return out.shape if out.size else None


EXAMPLES = int(os.environ.get('RULES_PROPERTY_EXAMPLES', '40'))
"""Draws per op (raise it to search further; CI keeps the default)."""


@pytest.mark.parametrize('name', sorted(OPS))
def test_rules_agree_with_per_sample_execution(name):
    """Batched under 'depth' or refused (then run per sample), four calls
    give the per-sample results and gradients; each op is both accepted
    and refused among the draws (:data:`ALWAYS_BATCHED`'s always accepted).
    A signature refused under autograd that batches in inference gives the
    per-sample values there too."""
    verdicts = {True: 0, False: 0}

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(st.data())
    def check(data):
        op, args = data.draw(st.composite(lambda draw: OPS[name](draw))())
        consts = {k for k, (batched, _) in enumerate(args)
                  if not batched and k not in getattr(op, 'inits', {}) and
                  data.draw(st.booleans())}
        note('%s of %s' % (op.text, ', '.join(
            '%s %s' % ('batched' if b else 'constant' if k in consts else 'parameter', s)
            for k, (b, s) in enumerate(args))))
        block = Prop(op, args, consts)
        block.initialize(mx.init.Uniform(0.5))
        shape = _per_sample_output(op, block, args)
        if shape is None:
            reject()
        if not shape or shape[0] != 1:
            block.back = _rows_back
        wrapper = dyb.DynBatchBlock(block)
        calls = [_inputs(args, seed) for seed in range(1, 5)]
        flat = [x for xs in calls for x in xs]
        assert_same(run_both(lambda: [wrapper(*xs) for xs in calls], [wrapper], flat, 'depth'))
        sigs = wrapper.signatures()
        assert len(sigs) == 1 + (sigs[0].inference is not None)
        verdicts[sigs[0].batch_safe] += 1
        if sigs[0].inference is not None:   # (BatchNorm: batched in inference alone)
            with dyb.batching('depth'):
                got = [wrapper(*xs) for xs in calls]
            assert dyb.stats()['last']['batch_sizes'] == [len(calls)]
            for value, xs in zip(got, calls):
                np.testing.assert_allclose(value.asnumpy(), block(*xs).asnumpy(),
                                           rtol=1e-5, atol=1e-6)

    check()
    assert verdicts[True] and (verdicts[False] or name in ALWAYS_BATCHED), verdicts
