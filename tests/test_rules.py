"""Batching rules at their edges: ops whose axis arguments, randomness or
output shapes decide whether calls may be merged.  Each block's verdict is
checked, and so are its results and gradients against per-sample execution:
a block the rules wrongly accepted would differ."""
import json
import re
import warnings

import mxnet as mx
import numpy as np
import pytest
from mxnet import autograd, gluon

import gluon_dynbatch as dyb
from gluon_dynbatch import accel

from helpers import assert_same, register_custom_op, run_both


class Apply(gluon.HybridBlock):
    """``op(dense(x))`` then, when ``back`` is given, that applied too."""

    def __init__(self, op, back=None, width=6):
        super().__init__()
        self.op, self.back = op, back
        with self.name_scope():
            self.dense = gluon.nn.Dense(width, in_units=width, flatten=False)

    def hybrid_forward(self, F, x):
        y = self.op(F, self.dense(x))
        return self.back(F, y) if self.back else y


def _spd(F, h):
    """A positive definite (1, 3, 3) matrix made of ``h``'s rows."""
    return F.broadcast_add(F.batch_dot(h, h, transpose_b=True), F.eye(3).reshape((1, 3, 3)) * 3)


# (name, op, back, input shape, batch-safe?)
CASES = [
    ('sum exclude, batch axis reduced', lambda F, h: F.sum(h, axis=1, exclude=True,
                                                           keepdims=True), None, (1, 6), False),
    ('mean exclude, batch axis kept', lambda F, h: F.mean(h, axis=0, exclude=True,
                                                          keepdims=True), None, (1, 3, 6), True),
    ('max exclude, batch axis kept', lambda F, h: F.max(h, axis=(0, 2), exclude=True),
     None, (1, 3, 6), True),
    ('sum over axis 1', lambda F, h: F.sum(h, axis=1, keepdims=True), None, (1, 6), True),
    ('expand_dims before the batch axis', lambda F, h: F.expand_dims(h, axis=-3),
     lambda F, y: F.mean(y, axis=1), (1, 6), False),
    ('expand_dims after the last axis', lambda F, h: F.expand_dims(h, axis=2),
     lambda F, y: F.sum(y, axis=2), (1, 6), True),
    ('expand_dims at -1', lambda F, h: F.expand_dims(h, axis=-1),
     lambda F, y: F.sum(y, axis=2), (1, 6), True),
    ('stack before the batch axis', lambda F, h: F.stack(h, axis=-3),
     lambda F, y: F.mean(y, axis=1), (1, 6), False),
    ('stack on axis 1', lambda F, h: F.stack(h, h * 2, axis=1),
     lambda F, y: F.sum(y, axis=1), (1, 6), True),
    ('reshape that keeps the sample whole', lambda F, h: F.reshape(h, shape=(-1, 2, 3)),
     lambda F, y: F.sum(y, axis=2), (1, 6), True),
    # (the positions of a sample's own axis, shared: gluonnlp's TransformerEncoder)
    ('arange_like along axis 1', lambda F, h: F.broadcast_mul(
        h, F.contrib.arange_like(h, axis=1).reshape((1, 6))), None, (1, 6), True),
    ('arange_like along axis -1 of rank 3', lambda F, h: F.broadcast_add(
        h, F.contrib.arange_like(h, axis=-1, start=2.0, step=0.5)), None, (1, 3, 6), True),
    ('arange_like along the batch axis', lambda F, h: F.broadcast_mul(
        h, F.contrib.arange_like(h, axis=0).reshape((1, 1))), None, (1, 6), False),
    # (a sample of two rows between the reshapes: see FoldedHeads)
    ('reshape into rows and back', lambda F, h: F.reshape(h, shape=(-1, 3)),
     lambda F, y: F.reshape(y, shape=(-1, 6)), (1, 6), True),
    # slice (x[:, 1:4] in NDArray code) ran per sample for want of a rule (found by a user test)
    ('slice with axis 0 unset', lambda F, h: F.slice(h, begin=(None, 1), end=(None, 4)),
     None, (1, 6), True),
    ('slice from 0 to an unset end', lambda F, h: F.slice(h, begin=(0, 1, 0), end=(None, 3, 5),
                                                          step=(1, 1, 2)), None, (1, 4, 6), True),
    ('slice ending at 1 on the batch axis', lambda F, h: F.slice(h, begin=(0, 1), end=(1, 4)),
     None, (1, 6), False),
    ('slice stepping back on the batch axis', lambda F, h: F.slice(
        h, begin=(None, 1), end=(None, 4), step=(-1, 1)), None, (1, 6), False),
    # ops a user trial found without a rule (a refused case per op, where one exists)
    ('smooth_l1', lambda F, h: F.smooth_l1(h, scalar=2.0), None, (1, 3, 6), True),
    ('broadcast_axis of axis 1', lambda F, h: F.broadcast_axis(
        F.sum(h, axis=1, keepdims=True), axis=1, size=3), None, (1, 3, 6), True),
    ('broadcast_axis of the batch axis', lambda F, h: F.broadcast_axis(
        F.sum(h, axis=1, keepdims=True), axis=(1, 0), size=(3, 2)),
     lambda F, y: F.mean(y, axis=0, keepdims=True), (1, 3, 6), False),
    ('broadcast_to keeping axis 0', lambda F, h: F.broadcast_to(
        F.sum(h, axis=-2, keepdims=True), shape=(0, 3, 0)), None, (1, 3, 6), True),
    ('broadcast_to with axis 0 of 1', lambda F, h: F.broadcast_to(
        F.sum(h, axis=-2, keepdims=True), shape=(1, 3, 6)), None, (1, 3, 6), False),
    ('broadcast_like a batched rhs', lambda F, h: F.broadcast_like(
        F.sum(h, axis=-1, keepdims=True), h) + h, None, (1, 3, 6), True),
    ('broadcast_like of a shared lhs', lambda F, h: F.broadcast_like(
        F.sin(F.arange(6)).reshape((1, 1, 6)), h) * h, None, (1, 3, 6), True),
    ('broadcast_like on other axes', lambda F, h: F.broadcast_like(
        F.sum(h, axis=-1, keepdims=True), F.zeros((2, 5, 4)), lhs_axes=(-1,), rhs_axes=(-2,)),
     None, (1, 3, 6), True),
    ('broadcast_like of a shared lhs on axis 0', lambda F, h: F.broadcast_like(
        F.sin(F.arange(6)).reshape((1, 6)), h, lhs_axes=(0,), rhs_axes=(0,)) * F.sum(h, axis=1),
     None, (1, 3, 6), True),
    ('broadcast_like a shared rhs', lambda F, h: F.broadcast_like(h, F.zeros((1, 3, 6))),
     None, (1, 3, 6), False),
    ('broadcast_like of a shared lhs on axis 1', lambda F, h: F.concat(F.broadcast_like(
        F.sin(F.arange(6)).reshape((1, 1, 6)), h, lhs_axes=(1,), rhs_axes=(-2,)), h, dim=-1),
     None, (1, 3, 6), False),
    ('broadcast_like axis 1 like the batch axis', lambda F, h: F.broadcast_like(
        F.sum(h, axis=1, keepdims=True), h, lhs_axes=(1,), rhs_axes=(0,)),
     None, (1, 3, 6), False),
    ('tile of the last axes', lambda F, h: F.tile(h, reps=(2,)) + F.tile(h, reps=(1, 1, 2)),
     None, (1, 3, 6), True),
    ('tile of the batch axis', lambda F, h: F.tile(h, reps=(2, 1, 1)),
     lambda F, y: F.mean(y, axis=0, keepdims=True), (1, 3, 6), False),
    ('tile adding an axis', lambda F, h: F.tile(h, reps=(2, 1, 1, 1)),
     lambda F, y: F.sum(y, axis=0), (1, 3, 6), False),
    # found by the property test (test_rules_property.py): per sample MXNet's tile kernels see 5
    # axes, batched 6, and fail ('Too many reduction axes') at the flush
    ('tile of the three axes after the batch axis', lambda F, h: F.tile(h, reps=(2, 2, 2)),
     None, (1, 1, 2, 6), False),
    ('topk values along -1', lambda F, h: F.topk(h, axis=-1, k=2, ret_typ='value'),
     None, (1, 3, 6), True),
    ('topk indices along 1', lambda F, h: F.topk(h, axis=1, k=2) + h.slice_axis(
        axis=1, begin=0, end=2), None, (1, 3, 6), True),
    ('topk along the batch axis', lambda F, h: F.topk(h, axis=-3, k=1, ret_typ='value'),
     None, (1, 3, 6), False),
    ('topk of the flattened sample', lambda F, h: F.topk(h, axis=None, k=2, ret_typ='value'),
     lambda F, y: F.reshape(y, shape=(1, 2)), (1, 3, 6), False),
    ('sort and argsort along -2', lambda F, h: F.sort(h, axis=-2) * F.argsort(h, axis=1),
     None, (1, 3, 6), True),
    ('sort along the batch axis', lambda F, h: F.sort(h, axis=0), None, (1, 3, 6), False),
    ('argsort of the flattened sample', lambda F, h: F.argsort(h, axis=None),
     lambda F, y: F.reshape(y, shape=(1, 18)), (1, 3, 6), False),
    ('flip the last axes', lambda F, h: F.flip(h, axis=(1, 2)), None, (1, 3, 6), True),
    ('flip the batch axis', lambda F, h: F.flip(F.sum(h, axis=1), axis=(0, 1)),
     None, (1, 3, 6), False),
    ('swapaxes of the last axes', lambda F, h: F.swapaxes(h, dim1=-1, dim2=1),
     None, (1, 3, 6), True),
    ('swapaxes of the batch axis', lambda F, h: F.swapaxes(
        F.sum(h, axis=1, keepdims=True), dim1=0, dim2=-2),
     lambda F, y: F.sum(y, axis=1), (1, 3, 6), False),
    ('linalg_gemm2 of rank 2', lambda F, h: F.linalg.gemm2(
        h, F.sin(F.arange(24)).reshape((4, 6)), transpose_b=True, alpha=0.5), None, (1, 6), True),
    ('linalg_gemm2 of batched matrices', lambda F, h: F.linalg.gemm2(h, h, transpose_b=True),
     None, (1, 3, 6), True),
    ('linalg_gemm2 with rows on axis 0', lambda F, h: F.linalg.gemm2(
        h, F.sin(F.arange(36)).reshape((6, 3, 2)), axis=0), None, (1, 3, 6), True),
    ('linalg_gemm2 of batched and shared matrices', lambda F, h: F.linalg.gemm2(
        h, F.sin(F.arange(24)).reshape((1, 6, 4))), None, (1, 3, 6), False),
    ('linalg_gemm2 transposing a batched rank 2', lambda F, h: F.linalg.gemm2(
        h, F.sin(F.arange(4)).reshape((1, 4)), transpose_a=True),
     lambda F, y: F.sum(y, axis=0, keepdims=True), (1, 6), False),
    ('linalg_gemm2 of a batched rank 2 rhs', lambda F, h: F.linalg.gemm2(
        F.sin(F.arange(4)).reshape((4, 1)), h),
     lambda F, y: F.sum(y, axis=0, keepdims=True), (1, 6), False),
    # ops of attention over ragged lists a user trial found without a rule (gluonnlp's
    # DotProductAttentionCell scales by div_sqrt_dim; SequenceMask masks scores past a length)
    ('div_sqrt_dim', lambda F, h: F.contrib.div_sqrt_dim(h), None, (1, 3, 6), True),
    ('div_sqrt_dim of rank 1', lambda F, h: F.contrib.div_sqrt_dim(F.sum(h, axis=1)),
     lambda F, y: F.expand_dims(y, axis=1), (1, 6), False),
    # (lengths through BlockGrad: MXNet 1.9.1 leaves their gradient unwritten, NaN here)
    ('SequenceMask batch-major', lambda F, h: F.SequenceMask(
        h, F.BlockGrad(F.sum(h, axis=(1, 2)) * 0 + 2), use_sequence_length=True, value=-3.0,
        axis=1), None, (1, 3, 6), True),
    ('SequenceMask time-major', lambda F, h: F.SequenceMask(h), None, (1, 3, 6), False),
    # ops a third user trial found without a rule: cumulative probabilities of top-p
    # sampling, and nn.InstanceNorm's and nn.GroupNorm's normalisation of a sample's own axes
    ('cumsum along a row', lambda F, h: F.cumsum(F.softmax(h), axis=1), None, (1, 6), True),
    ('cumsum along axis 2', lambda F, h: F.cumsum(h, axis=2), None, (1, 3, 6), True),
    ('cumsum over the batch axis', lambda F, h: F.cumsum(h, axis=0), None, (1, 6), False),
    ('cumsum of the flattened tensor', lambda F, h: F.cumsum(h),
     lambda F, y: F.reshape(y, shape=(1, -1)), (1, 6), False),
    ('InstanceNorm', lambda F, h: F.InstanceNorm(h, F.ones((3,)) * 1.5, F.ones((3,)) * 0.2),
     None, (1, 3, 6), True),
    ('GroupNorm', lambda F, h: F.GroupNorm(h, F.ones((2,)) * 1.5, F.ones((2,)) * 0.2,
                                           num_groups=2), None, (1, 4, 6), True),
    # ops a fourth user trial found without a rule: element-wise ones, softmin, and the
    # mean and variance of a LayerNorm written by hand
    ('hard_sigmoid and element-wise ops', lambda F, h: F.hard_sigmoid(h) + F.degrees(h)
     + F.radians(h) + F.log2(h * h + 1) + F.log10(h * h + 1) + F.rcbrt(h * h + 1)
     + F.logical_not(h > 0) + F._internal._logical_xor_scalar(h > 0, scalar=1), None,
     (1, 3, 6), True),
    ('contrib straight-through ops', lambda F, h: F.contrib.gradientmultiplier(h, scalar=-0.5)
     + F.contrib.round_ste(h * 3) + F.contrib.sign_ste(h)
     + F.contrib.quadratic(h, a=1, b=2, c=3), None, (1, 3, 6), True),
    ('softmin along a row', lambda F, h: F.softmin(h, axis=-1), None, (1, 3, 6), True),
    ('softmin over the batch axis', lambda F, h: F.softmin(h, axis=0), None, (1, 3, 6), False),
    ('moments over axes 1 and 2', lambda F, h: F.broadcast_add(
        F.moments(h, axes=(1,), keepdims=True)[0], F.moments(h, axes=(2,), keepdims=True)[1]),
     None, (1, 3, 6), True),
    ('moments over the batch axis', lambda F, h: F.broadcast_mul(
        F.moments(h, axes=(0, 1), keepdims=True)[1], h), None, (1, 3, 6), False),
    # a text CNN over a sentence (NCW) and image-like ops, each sample's own
    ('Convolution and max pooling', lambda F, h: F.Pooling(F.Convolution(
        h, F.sin(F.arange(18)).reshape((3, 3, 2)), F.ones((3,)), kernel=(2,), num_filter=3),
        kernel=(2,), stride=(2,), pool_type='max'), None, (1, 3, 6), True),
    ('global average pooling', lambda F, h: F.Pooling(h, kernel=(1,), global_pool=True,
                                                      pool_type='avg'), None, (1, 3, 6), True),
    ('image ops', lambda F, h: F.LRN(F.pad(h.reshape((0, 3, 2, 3)), mode='edge', pad_width=(
        0, 0, 0, 0, 1, 1, 2, 2)), nsize=3) + F.contrib.AdaptiveAvgPooling2D(
        h.reshape((0, 3, 2, 3)), output_size=(4, 7)), None, (1, 3, 6), True),
    # indexing and linear algebra on each sample's own axes
    ('slice_like on axis 2', lambda F, h: F.slice_like(h, F.zeros((1, 2, 4)), axes=(2,)),
     None, (1, 3, 6), True),
    ('slice_like a batched tensor', lambda F, h: F.slice_like(h, F.slice_axis(
        h, axis=2, begin=0, end=3)), None, (1, 3, 6), True),
    ('slice_like a shared tensor', lambda F, h: F.slice_like(h, F.zeros((1, 2, 4))),
     None, (1, 3, 6), False),
    ('diag of axes 1 and 2', lambda F, h: F.diag(F.slice_axis(h, axis=2, begin=0, end=3),
                                                  axis1=1, axis2=-1), None, (1, 3, 6), True),
    ('diag of a rank 2 sample', lambda F, h: F.diag(h), lambda F, y: F.expand_dims(y, axis=1),
     (1, 6), False),
    # (axis1 left at its default 0: a (1, 3, 1) sample's diagonal is (1, 1), batched (1, N))
    ('diag of the default axes of a rank 3 sample', lambda F, h: F.diag(F.slice_axis(
        h, axis=2, begin=0, end=1)), None, (1, 3, 6), False),
    ('index_array of axes 1 and 2', lambda F, h: F.broadcast_mul(F.sum(F.cast(
        F.contrib.index_array(h, axes=(1, -1)), 'float32'), axis=-1), h), None, (1, 3, 6), True),
    ('index_array of every axis', lambda F, h: F.broadcast_mul(F.sum(F.cast(
        F.contrib.index_array(h), 'float32'), axis=-1), h), None, (1, 3, 6), False),
    ('linalg of matrices', lambda F, h: F.linalg.trsm(F.linalg.potrf(_spd(F, h)), h)
     + F.linalg.gemm(F.linalg.inverse(_spd(F, h)), h, h, beta=2)
     + F.broadcast_mul(F.linalg.slogdet(_spd(F, h))[1].reshape((0, 1, 1)), h), None,
     (1, 3, 6), True),
    ('linalg of vectors', lambda F, h: F.linalg.sumlogdiag(F.linalg.syrk(F.linalg.maketrian(
        h)) + F.linalg.makediag(F.ones_like(F.slice_axis(h, axis=1, begin=0, end=3)))
        ).reshape((0, 1)), None, (1, 6), True),
    ('linalg with a shared matrix', lambda F, h: F.linalg.trmm(F.ones((1, 3, 3)), h),
     None, (1, 3, 6), False),
    ('linalg_syrk of a rank 2 sample', lambda F, h: F.linalg.syrk(h),
     lambda F, y: F.sum(y, axis=0, keepdims=True), (1, 6), False),
    # split_v2 (axis 0 by default) and UpSampling of each sample's own image
    ('split_v2 along axis 2', lambda F, h: F.concat(*[F.split_v2(h, (2, 5), axis=2)[i]
                                                      for i in (2, 0, 1)], dim=2),
     None, (1, 3, 6), True),
    ('split_v2 into sections along -2, squeezed', lambda F, h: F.split_v2(
        h, 3, axis=-2, squeeze_axis=True)[1], None, (1, 3, 6), True),
    ('split_v2 along the batch axis', lambda F, h: F.split_v2(
        F.concat(h, h, dim=0), 2)[1], None, (1, 3, 6), False),
    ('UpSampling nearest of two images', lambda F, h: F.UpSampling(
        h.reshape((0, 3, 2, 3)), F.sin(h).reshape((0, 3, 2, 3)), scale=2,
        sample_type='nearest', num_args=2, multi_input_mode='sum').reshape((0, 3, -1)),
     None, (1, 3, 6), True),
    ('UpSampling nearest with a shared image', lambda F, h: F.UpSampling(
        h.reshape((0, 3, 2, 3)), F.ones((1, 3, 2, 3)), scale=2, sample_type='nearest',
        num_args=2).reshape((0, 3, -1)), None, (1, 3, 6), False),
    ('UpSampling bilinear', lambda F, h: F.UpSampling(
        h.reshape((0, 3, 2, 3)), F.sin(F.arange(48)).reshape((3, 1, 4, 4)), scale=2,
        sample_type='bilinear', num_filter=3).reshape((0, 3, -1)), None, (1, 3, 6), True),
    ('depth_to_space, space_to_depth, im2col', lambda F, h: F.space_to_depth(F.depth_to_space(
        h.reshape((0, 4, 2, 3)), block_size=2), block_size=2).reshape((0, 4, 6))
     + F.im2col(h.reshape((0, 4, 2, 3)), kernel=(1, 1)), None, (1, 4, 6), True),
]
WHY = {'linalg with a shared matrix': 'with a shared operand',
       'UpSampling nearest with a shared image': 'mixes batched and shared inputs'}
"""The reason an unsafe case must give, where another check would refuse
the block too (the tracer refuses batched inputs of leading size 2)."""


def _verdict(block):
    sigs = block.signatures()
    assert len(sigs) == 1
    return sigs[0].batch_safe, sigs[0].reason


@pytest.mark.parametrize('strategy', ['depth', 'agenda'])
@pytest.mark.parametrize('name,op,back,shape,safe', CASES, ids=[c[0] for c in CASES])
def test_axis_rules_decide_and_results_match(name, op, back, shape, safe, strategy):
    block = dyb.DynBatchBlock(Apply(op, back))
    block.initialize(mx.init.Uniform(0.5))
    rng = np.random.RandomState(3)
    xs = [mx.nd.array(rng.uniform(-1, 1, shape)) for _ in range(5)]
    assert_same(run_both(lambda: [block(x) for x in xs], [block], xs, strategy))
    batch_safe, reason = _verdict(block)
    assert batch_safe == safe, reason
    if not safe:
        assert WHY.get(name, 'batch axis') in reason, reason


class Noisy(gluon.HybridBlock):
    """Adds a random draw that reads no per-sample input, or drops out with
    the mask shared along ``axes``."""

    def __init__(self, kind, axes=()):
        super().__init__()
        self.kind, self.axes = kind, axes

    def hybrid_forward(self, F, x):
        if self.kind == 'noise':
            return F.broadcast_add(x, F.random.normal(shape=(1, 64)))
        return F.Dropout(x, p=0.5, axes=self.axes)


@pytest.mark.parametrize('kind,axes,shape,safe', [
    ('noise', (), (1, 64), False),
    ('dropout', (0,), (1, 64), False),
    ('dropout', (0, 2), (1, 64, 2), False),
    ('dropout', (1,), (1, 2, 64), True),
    ('dropout', (), (1, 64), True),
])
def test_every_sample_draws_its_own_random_numbers(kind, axes, shape, safe):
    """Per sample, each call draws its own noise or mask; merged into one
    step, a draw that no per-sample input decides (noise with a fixed
    shape, a dropout mask shared along the batch axis) would serve every
    sample.  Such blocks run per sample."""
    block = dyb.DynBatchBlock(Noisy(kind, axes))
    block.initialize()
    ones = [mx.nd.ones(shape) for _ in range(20)]
    with autograd.record():     # training mode: Dropout drops
        with dyb.batching('depth'):
            outs = [block(x) for x in ones]
        rows = [o.asnumpy().ravel() for o in outs]
    assert len({row.tobytes() for row in rows}) == len(rows)
    batch_safe, reason = _verdict(block)
    assert batch_safe == safe, reason
    if not safe:
        assert 'random' in reason or 'mask along the batch axis' in reason
    if kind == 'noise':     # (the advice: such a draw batches, see below)
        assert 'F.random.normal_like(x)' in reason, reason


class RankOne(gluon.HybridBlock):
    """``op`` on a per-sample input of shape ``(1,)``, a sample's one score
    (``dense(x)`` reshaped), where the batch axis is the input's only axis."""

    def __init__(self, op):
        super().__init__()
        self.op = op
        with self.name_scope():
            self.dense = gluon.nn.Dense(1, in_units=3)
            self.w = self.params.get('w', shape=(1, 1), init=mx.init.Uniform(1.0))

    def hybrid_forward(self, F, x, w):
        return self.op(F, self.dense(x).reshape((-1,)), w)


RANK_ONE = [
    # (name, op, batch-safe?): a softmax over a sample's only axis and a dot
    # or FullyConnected(flatten=False) reading it as features would, batched,
    # read the batch axis (across samples, silently; or fail at the flush).
    # (MXNet has no backward for SoftmaxActivation at rank 1: values only.)
    ('SoftmaxActivation', lambda F, s, w: F.SoftmaxActivation(s), False),
    ('dot', lambda F, s, w: F.dot(s, w.reshape((-1,))), False),
    ('FullyConnected flatten=False', lambda F, s, w: F.FullyConnected(
        s, w, no_bias=True, num_hidden=1, flatten=False), False),
    # row-wise at rank 1 too
    ('FullyConnected', lambda F, s, w: F.FullyConnected(s, w, no_bias=True, num_hidden=1),
     True),
    ('L2Normalization', lambda F, s, w: F.L2Normalization(s), True),
    ('Activation', lambda F, s, w: F.Activation(s, act_type='tanh'), True),
]


@pytest.mark.parametrize('name,op,safe', RANK_ONE, ids=[c[0] for c in RANK_ONE])
def test_rank_one_inputs_batch_only_where_rows_stay_rows(name, op, safe):
    """Found by a review: ``SoftmaxActivation`` of per-sample shape ``(1,)``
    gave, batched, a softmax across the samples (every per-sample output is
    1), with no warning; ``dot`` and ``FullyConnected(flatten=False)``
    passed the rules and then failed the flush with MXNet's shape error.
    They run per sample now, with the reason; the rest still batch."""
    block = dyb.DynBatchBlock(RankOne(op))
    block.initialize(mx.init.Uniform(1.0))
    rng = np.random.RandomState(5)
    xs = [mx.nd.array(rng.uniform(-2, 2, (1, 3))) for _ in range(4)]
    if name == 'SoftmaxActivation':
        expected = [block(x).asnumpy() for x in xs]
        with dyb.batching('depth'):
            outs = [block(x) for x in xs]
        for out, want in zip(outs, expected):
            np.testing.assert_allclose(out.asnumpy(), want, rtol=1e-6)
    else:
        assert_same(run_both(lambda: [block(x) for x in xs], [block], xs, 'depth'))
    batch_safe, reason = _verdict(block)
    assert batch_safe == safe, reason
    if not safe:
        assert 'only axis of a per-sample input of shape (1,)' in reason, reason


class TwoRows(gluon.HybridBlock):
    def hybrid_forward(self, F, x):
        return F.reshape(x * 2, shape=(-1, 3))


@pytest.mark.parametrize('accelerated', [True, False])
def test_error_output_without_a_batch_axis_of_one(accelerated):
    """A sample's result is one row: an output of another leading size
    could only be returned cut (it was, silently, before this error)."""
    block = dyb.DynBatchBlock(TwoRows())
    accel.enable(accelerated)
    try:
        with pytest.raises(dyb.InputError, match=r'tworows\d+ \(TwoRows\): output 0 has '
                                                 r'per-sample shape \(2, 3\).*leading batch axis'):
            with dyb.batching():
                block(mx.nd.ones((1, 6)))
    finally:
        accel.enable(True)
    np.testing.assert_array_equal(block(mx.nd.ones((1, 6))).asnumpy(), np.full((2, 3), 2.0))


class MaxOfChildren(gluon.HybridBlock):
    """Zero padding changes a max where every child is negative: a wrong
    pad_lists claim that inputs drawn from [-1, 1] may not reveal."""
    dynbatch_pad_lists = True

    def __init__(self):
        super().__init__()
        with self.name_scope():
            self.dense = gluon.nn.Dense(2, in_units=2)

    def hybrid_forward(self, F, x, children):
        if not children:
            return self.dense(x)
        return self.dense(x) + F.max(F.stack(*children, axis=1), axis=1)


def test_wrong_pad_lists_claim_on_a_max_is_caught():
    block = dyb.DynBatchBlock(MaxOfChildren())
    block.initialize()
    x, neg = mx.nd.array([[0.5, -0.5]]), mx.nd.array([[-3.0, -2.0]])
    with pytest.raises(dyb.InputError, match=r'declares pad_lists.*\[-2, -0.5\]'):
        with dyb.batching('depth'):
            block(x, [neg])
            block(x, [neg, neg * 2])


class AttendWithLength(gluon.HybridBlock):
    """Dot attention over a ragged list of keys, its softmax told the
    list's length: padding keys past it are masked, so neutral.  ``scale``
    computes the softmax's lengths as ``scale`` times the argument."""
    dynbatch_pad_lists = True

    def __init__(self, scale=1, mean_too=False, how='softmax'):
        super().__init__()
        self.scale, self.mean_too, self.how = scale, mean_too, how
        with self.name_scope():
            self.dense = gluon.nn.Dense(3, in_units=3)

    def hybrid_forward(self, F, length, q, keys):
        stacked = F.stack(*keys, axis=1)                                  # (1, T, 3)
        scores = F.batch_dot(stacked, self.dense(q).expand_dims(axis=2)).squeeze(axis=2)
        if self.how == 'softmax':
            w = F.softmax(scores, F.cast(length * self.scale, 'int32'), axis=-1,
                          use_length=True)
        elif self.how == 'SequenceMask':    # lengths of 0 are no real list's (uniform)
            w = F.softmax(F.SequenceMask(scores, length, use_sequence_length=True,
                                         value=-1e9, axis=1), axis=-1)
        else:       # no lengths: the padding keys take weight
            w = F.softmax(scores, axis=-1)
        out = F.batch_dot(w.expand_dims(axis=1), stacked).squeeze(axis=1)
        return out + F.mean(stacked, axis=1) if self.mean_too else out


def _attend_calls(block, keys):
    return [block(np.array([n], dtype=np.float32), keys[n - 1], keys[:n])
            for n in (2, 3, 3, 1)]


@pytest.mark.parametrize('how', ['softmax', 'SequenceMask'])
def test_pad_lists_with_a_softmax_told_the_lengths_runs_batched(how):
    """The padding check gave every argument random values, the length
    too: MXNet's softmax read and wrote past its axis (the process aborted
    in free(), found by a user trial with attention over ragged lists).
    The arguments lengths are computed from now take whole numbers within
    the axis, from 1, and the lists of 1, 2 and 3 keys run as one step.
    (SequenceMask ran per sample, for want of a rule.)"""
    block = dyb.DynBatchBlock(AttendWithLength(how=how))
    block.initialize(mx.init.Uniform(0.5))
    rng = np.random.RandomState(0)
    keys = [mx.nd.array(rng.uniform(-1, 1, (1, 3))) for _ in range(3)]
    dyb.reset_stats()
    assert_same(run_both(lambda: _attend_calls(block, keys), [block], keys))
    assert dyb.stats()['last']['batch_sizes'] == [4]


@pytest.mark.parametrize('how', ['plain', 'softmax'])
def test_pad_lists_refusal_of_a_softmax_without_lengths_says_to_give_them(how):
    """Attention over a ragged list whose softmax is told no lengths gives
    padding keys weight: the check refuses it, and the refusal offered only
    pad_lists=False (a user trial); it now names the softmax's lengths.  A
    block refused for another reason (a mean over the keys beside a
    softmax told its lengths) is not given that advice."""
    block = dyb.DynBatchBlock(AttendWithLength(how=how, mean_too=how == 'softmax'))
    block.initialize(mx.init.Uniform(0.5))
    keys = [mx.nd.ones((1, 3)) * k for k in range(3)]
    with pytest.raises(dyb.InputError, match=r'declares pad_lists.*changes its output 0') as err:
        with dyb.batching('depth'):
            _attend_calls(block, keys)
    advice = 'use_length=True), it leaves the padding out. Pass pad_lists=False'
    assert (advice in str(err.value)) == (how == 'plain'), str(err.value)


@pytest.mark.parametrize('scale, mean_too, match', [
    (2, False, r'cannot give its op softmax .* lengths within its axis of (\d): drawn as '
               r'whole numbers from 1 to \1, its arguments #0 gave lengths from'),
    (1, True, r'declares pad_lists.*changes its output 0')])
def test_pad_lists_with_lengths_still_checked(scale, mean_too, match):
    """Lengths computed otherwise than copied could still fall outside the
    axis: refused before MXNet runs them.  And a block that padding
    changes elsewhere is still caught."""
    block = dyb.DynBatchBlock(AttendWithLength(scale, mean_too))
    block.initialize(mx.init.Uniform(0.5))
    keys = [mx.nd.ones((1, 3)) * k for k in range(3)]
    with pytest.raises(dyb.InputError, match=match):
        with dyb.batching('depth'):
            _attend_calls(block, keys)


class BagOfIds(gluon.HybridBlock):
    """A bag of words over a ragged list of token ids: the sum of their
    embeddings, masked past the list's length (``masked``) or not (then a
    zero padding element is id 0, a real row, and the claim is false)."""
    dynbatch_pad_lists = True

    def __init__(self, masked):
        super().__init__()
        self.masked = masked
        with self.name_scope():
            self.embed = gluon.nn.Embedding(10, 3)

    def hybrid_forward(self, F, length, ids):
        rows = F.reshape(self.embed(F.stack(*ids, axis=1)), shape=(0, 0, -1))     # (1, K, 3)
        if self.masked:
            rows = F.SequenceMask(rows, length, use_sequence_length=True, axis=1)
        return F.sum(rows, axis=1)


def _bag_calls(block):
    return [block(np.array([n], np.float32), [np.array([k + 1.], np.float32) for k in range(n)])
            for n in (1, 3, 2)]


@pytest.mark.parametrize('masked', [False, True])
def test_pad_lists_refusal_of_ids_read_from_padding_says_to_mask_them(masked):
    """Zero padding of a list of token ids looks up row 0 of the table: a
    sum of embeddings looks neutral, yet the check refuses it, and the
    refusal said no more than pad_lists=False (a user trial's bag of
    words).  It now says that padding is id 0 and how to mask it; masked,
    the lists of 1 to 3 ids run as one step, as per sample."""
    block = dyb.DynBatchBlock(BagOfIds(masked))
    block.initialize(mx.init.Uniform(0.5))
    if masked:
        dyb.reset_stats()
        assert_same(run_both(lambda: _bag_calls(block), [block]))
        assert dyb.stats()['last']['batch_sizes'] == [3]
        return
    with pytest.raises(dyb.InputError, match=r'declares pad_lists.*changes its output 0') as err:
        with dyb.batching('depth'):
            _bag_calls(block)
    assert 'a zero padding element is id 0' in str(err.value), str(err.value)
    assert 'F.SequenceMask(rows, length' in str(err.value)


def test_pad_lists_refusal_without_ids_in_the_padding_gives_no_ids_advice():
    """A block refused for another reason (a mean over its keys) reads no
    ids from the padding, and is not told about ids."""
    block = dyb.DynBatchBlock(AttendWithLength(how='softmax', mean_too=True))
    block.initialize(mx.init.Uniform(0.5))
    keys = [mx.nd.ones((1, 3)) * k for k in range(3)]
    with pytest.raises(dyb.InputError, match=r'changes its output 0') as err:
        with dyb.batching('depth'):
            _attend_calls(block, keys)
    assert 'padding element is id 0' not in str(err.value)


class PointAt(gluon.HybridBlock):
    """A pointer network's loss: the probability of the target position
    under a softmax over a ragged list of scores, told its length (or not,
    ``lengths=False``: then padding takes probability, and the claim is
    false)."""
    dynbatch_pad_lists = True

    def __init__(self, lengths=True, mode='clip'):
        super().__init__()
        self.lengths, self.mode = lengths, mode
        with self.name_scope():
            self.dense = gluon.nn.Dense(1, in_units=3)

    def hybrid_forward(self, F, length, target, items):
        scores = F.concat(*[self.dense(item) for item in items], dim=1)     # (1, M)
        p = F.softmax(scores, length, axis=1, use_length=True) if self.lengths else \
            F.softmax(scores, axis=1)
        return F.log(F.pick(p, target, axis=1, mode=self.mode) + 1e-6)


def _point_calls(block, items):
    return [block(np.array([n], np.int32), np.array([n - 1 - k % n], np.float32), items[:n])
            for k, n in enumerate([1, 3, 2, 4, 4, 1])]


def test_pad_lists_pick_of_a_target_position_draws_valid_positions():
    """The padding check drew pick's positions from its ranges, past the
    shorter list, where pick clips to its last element but the padded list
    reads padding: a pointer network neutral for every valid target was
    refused (a user trial).  Positions are now drawn within the shorter list,
    and the calls of every length run as one step, as per sample."""
    block = dyb.DynBatchBlock(PointAt())
    block.initialize(mx.init.Uniform(0.5))
    items = [mx.nd.array(np.random.RandomState(k).uniform(-1, 1, (1, 3))) for k in range(4)]
    dyb.reset_stats()
    assert_same(run_both(lambda: _point_calls(block, items), [block], inputs=items))
    assert dyb.stats()['steps'] == 1


def test_pad_lists_pick_from_a_softmax_without_lengths_still_refused():
    """Valid positions do not hide padding that changes what is picked."""
    block = dyb.DynBatchBlock(PointAt(lengths=False))
    block.initialize(mx.init.Uniform(0.5))
    items = [mx.nd.ones((1, 3)) * k for k in range(4)]
    with pytest.raises(dyb.InputError, match=r'declares pad_lists.*changes its output 0'):
        with dyb.batching('depth'):
            _point_calls(block, items)


def test_pad_lists_pick_that_wraps_positions_is_refused():
    """With mode='wrap' a negative position is valid: per sample -1 picks
    the list's last element, padded a padding element's.  Such positions
    are drawn as any argument, negatives too, so the claim is refused (a
    review's case; drawn within the list, it passed)."""
    block = dyb.DynBatchBlock(PointAt(mode='wrap'))
    block.initialize(mx.init.Uniform(0.5))
    items = [mx.nd.ones((1, 3)) * k for k in range(4)]
    with pytest.raises(dyb.InputError, match=r'declares pad_lists.*changes its output 0'):
        with dyb.batching('depth'):
            _point_calls(block, items)


class AttendThenMax(gluon.HybridBlock):
    """Attention over ``keys``, its softmax told their length, plus a max
    over the list ``hs`` after it: padding ``hs`` with zeros changes the
    max of negative rows, so the claim is false."""
    dynbatch_pad_lists = True

    def __init__(self):
        super().__init__()
        with self.name_scope():
            self.dense = gluon.nn.Dense(3, in_units=3)

    def hybrid_forward(self, F, keys, length, hs):
        stacked = F.stack(*keys, axis=1)
        scores = F.batch_dot(stacked, self.dense(hs[0]).expand_dims(axis=2)).squeeze(axis=2)
        w = F.softmax(scores, F.cast(length, 'int32'), axis=-1, use_length=True)
        return F.batch_dot(w.expand_dims(axis=1), stacked).squeeze(axis=1) + \
            F.max(F.stack(*hs, axis=1), axis=1)


def test_pad_lists_lengths_drawn_for_the_arguments_they_are_computed_from():
    """A signature names its arguments by position, so padding ``keys``
    moves the name of every argument after it: the padded symbol's length
    argument was named as the shorter signature's ``hs[0]``, which was
    then drawn as whole numbers from 1, positive, and a max over ``hs``
    padded with zeros passed the check (batched, a call with negative
    ``hs`` silently returned the max with 0)."""
    block = dyb.DynBatchBlock(AttendThenMax())
    block.initialize(mx.init.Uniform(0.5))
    keys = [mx.nd.ones((1, 3)) * k for k in (1, 2)]
    neg = -mx.nd.ones((1, 3))
    with pytest.raises(dyb.InputError, match=r'attendthenmax\d+ declares pad_lists.*changes its '
                                             r'output 0'):
        with dyb.batching('depth'):
            for n in (1, 2):
                block(keys[:n], mx.nd.array([n]), [neg * k for k in range(1, n + 1)])


class KeysFirst(AttendWithLength):
    """:class:`AttendWithLength` with its list first and its length last."""

    def hybrid_forward(self, F, keys, q, length):      # pylint: disable=arguments-differ
        return super().hybrid_forward(F, length, q, keys)


@pytest.mark.parametrize('how', ['softmax', 'SequenceMask'])
def test_pad_lists_length_after_the_list_passes_the_check(how):
    """The length named after the padded list: its lengths, read under the
    shorter signature's name of that position (a key, or ``q``), fell
    outside the axis, and a neutral block was refused."""
    block = dyb.DynBatchBlock(KeysFirst(how=how))
    block.initialize(mx.init.Uniform(0.5))
    rng = np.random.RandomState(0)
    keys = [mx.nd.array(rng.uniform(-1, 1, (1, 3))) for _ in range(3)]
    dyb.reset_stats()
    assert_same(run_both(lambda: [block(keys[:n], keys[n - 1], np.array([n], dtype=np.float32))
                                  for n in (2, 3, 3, 1)], [block], keys))
    assert dyb.stats()['last']['batch_sizes'] == [4]


class ScaledLength(gluon.HybridBlock):
    """Attention whose softmax length is its argument times a parameter
    (3): called with a third of the list's length, per sample in bounds."""
    dynbatch_pad_lists = True

    def __init__(self):
        super().__init__()
        with self.name_scope():
            self.dense = gluon.nn.Dense(3, in_units=3)
            self.scale = self.params.get('scale', shape=(1,), init=mx.init.Constant(3),
                                         grad_req='null')

    def hybrid_forward(self, F, third, q, keys, scale):
        stacked = F.stack(*keys, axis=1)
        scores = F.batch_dot(stacked, self.dense(q).expand_dims(axis=2)).squeeze(axis=2)
        length = F.cast(F.broadcast_mul(third, scale), 'int32')
        w = F.softmax(scores, length, axis=-1, use_length=True)
        return F.batch_dot(w.expand_dims(axis=1), stacked).squeeze(axis=1)


def test_pad_lists_lengths_computed_with_a_parameter_are_checked():
    """Lengths computed from an argument and a parameter were not checked
    (the check ran only lengths of arguments alone): drawn from 1 to the
    axis and scaled by 3, they made MXNet's softmax write past its axis
    and the process abort (free(): invalid next size).  Now refused."""
    block = dyb.DynBatchBlock(ScaledLength())
    block.initialize()
    keys = [mx.nd.ones((1, 3)) * k for k in range(1, 7)]
    with pytest.raises(dyb.InputError, match=r'cannot give its op softmax .* lengths within its '
                                             r'axis of 3.* with its parameters'):
        with dyb.batching('depth'):
            for n in (3, 6):
                block(np.array([n / 3], dtype=np.float32), keys[0], keys[:n])


class SumOfTransformedChildren(gluon.HybridBlock):
    """Adds ``tanh(W h_k + b)`` per child: a zero child adds ``tanh(b)``,
    which is zero only while Gluon's initial zero bias lasts."""
    dynbatch_pad_lists = True

    def __init__(self):
        super().__init__()
        with self.name_scope():
            self.dense = gluon.nn.Dense(4, in_units=4)

    def hybrid_forward(self, F, x, children):
        if not children:
            return F.tanh(x)
        return x + F.add_n(*[F.tanh(self.dense(h)) for h in children])


def test_wrong_pad_lists_claim_hidden_by_initial_parameters_is_caught():
    """At initialisation padding leaves the outputs alone (the bias is
    zero), but not their gradients, nor the outputs after a training step:
    the check also runs the traced symbols with random parameters (and
    writes none of the block's own).  Before, it passed, and batched
    training got wrong gradients and then wrong values, silently."""
    block = dyb.DynBatchBlock(SumOfTransformedChildren())
    block.initialize()
    before = {name: p.data().asnumpy() for name, p in block.collect_params().items()}
    rng = np.random.RandomState(0)
    xs = [mx.nd.array(rng.uniform(-1, 1, (1, 4))) for _ in range(4)]
    with pytest.raises(dyb.InputError, match=r'declares pad_lists.*random parameters'):
        with dyb.batching('depth'):
            leaves = [block(x, []) for x in xs[:3]]
            block(xs[3], leaves[:1])
            block(xs[3], leaves[1:3])
    for name, p in block.collect_params().items():
        np.testing.assert_array_equal(p.data().asnumpy(), before[name])


class ConcatOfChildren(gluon.HybridBlock):
    """Its output grows with the list: padding cannot be neutral."""
    dynbatch_pad_lists = True

    def hybrid_forward(self, F, x, hs):
        return F.concat(x, *hs, dim=1)


class GatedChildren(gluon.HybridBlock):
    """A zero child adds ``relu(x - 3)``: nothing for the inputs the
    narrower ranges draw, something past 3."""
    dynbatch_pad_lists = True

    def hybrid_forward(self, F, x, hs):
        for h in hs:
            x = x + F.relu(h + x - 3)
        return x


class MessagesFirst(gluon.HybridBlock):
    """A zero child sends a zero message, but the messages, one per child,
    come first: padded, they move the sum after them (found by a review:
    the error blamed the values; returning the sum first passes)."""
    dynbatch_pad_lists = True

    def hybrid_forward(self, F, x, hs):
        msgs = [F.relu(h) for h in hs]
        return msgs, F.tanh(x + F.add_n(*msgs))


class MessagesLastNotNeutral(gluon.HybridBlock):
    """Its list output comes last, but a zero child's message is
    relu(bias): the values fail, and the error must not blame the order."""
    dynbatch_pad_lists = True

    def __init__(self):
        super().__init__()
        with self.name_scope():
            self.dense = gluon.nn.Dense(4, in_units=4)

    def hybrid_forward(self, F, x, hs):
        msgs = [F.relu(self.dense(h)) for h in hs]
        return F.tanh(x + F.add_n(*msgs)), msgs


@pytest.mark.parametrize('block_class,match', [
    (MessagesLastNotNeutral, r'zeros \(argument #1 from 1 to 2 arrays\) changes its output 0 '
                             r'\(inputs drawn from \[-1, 1\], random parameters\)\. Pass'),
    (ConcatOfChildren, r'declares pad_lists.*changes the shape of its output 0 from \(1, 8\) '
                       r'to \(1, 12\)'),
    (GatedChildren, r'declares pad_lists.*changes its output 0 \(inputs drawn from \[-8, 8\]'
                    r'[^(]*\)\. Pass'),
    (MessagesFirst, r'it returns 2 arrays for the shorter lists and 3 padded.*return such '
                    r'lists last'),
])
@pytest.mark.parametrize('hybridized', [False, True])
def test_wrong_pad_lists_claims_found_by_a_review_are_caught(block_class, match, hybridized):
    """A block whose output shape follows the list length failed the check
    with numpy's broadcasting error; one that a zero row changes only for
    inputs past 3 passed it, and its batched results were wrong.  The same
    errors hybridized, where the check runs the traced symbols with the
    block's parameters (their flat outputs lost the list-output hint)."""
    block = dyb.DynBatchBlock(block_class())
    block.initialize()
    if hybridized:
        block.hybridize()
    x = mx.nd.full((1, 4), 5.0)
    kids = [mx.nd.full((1, 4), 1.0), mx.nd.full((1, 4), 2.0)]
    with pytest.raises(dyb.InputError, match=match):
        with dyb.batching('depth'):
            block(x, kids[:1])
            block(x, kids)


class UnbuildableChildren(gluon.HybridBlock):
    """Padding is neutral (a zero child adds nothing), but MXNet 1.9.1's
    CachedOp cannot build the traced symbol for lists of three or more
    ('control dep not found in graph'), though it runs the calls."""
    dynbatch_pad_lists = True

    def __init__(self):
        super().__init__()
        with self.name_scope():
            self.i2h = gluon.nn.Dense(4, in_units=4)
            self.h2h = gluon.nn.Dense(4, in_units=4, use_bias=False)

    def hybrid_forward(self, F, x, hs):
        f = self.i2h(x)
        if hs:
            t1 = [F.elemwise_div(F.elemwise_sub(f, self.h2h(h)) * h, F.sigmoid(h) + 1)
                  for h in hs]
            t2 = [F.elemwise_sub(h, f) * F.elemwise_mul(f, h) for h in hs]
            f = f + F.add_n(*t1) - F.add_n(*t2)
        return F.tanh(f)


@pytest.mark.parametrize('pad_lists', [True, False])
def test_a_block_mxnet_cannot_build_as_is_runs_padded_and_per_arity(pad_lists):
    """MXNet 1.9.1 cannot build this block's traced symbol as a CachedOp for
    three children or more ('control dep not found in graph'): the pad_lists
    check raised MXNet's error from inside, then an InputError; its
    programs are now built with broadcast adds (lower.make_cached_op), so it
    runs batched, padded or one group per arity, as per sample."""
    block = dyb.DynBatchBlock(UnbuildableChildren(), pad_lists=pad_lists)
    block.initialize()
    x = mx.nd.ones((1, 4))
    with dyb.batching('depth'):
        outs = [block(x, [x] * 2), block(x, [x] * 3)]
    for out, n in zip(outs, (2, 3)):
        np.testing.assert_allclose(out.asnumpy(), block(x, [x] * n).asnumpy(), rtol=1e-6)


class NormOfChildren(gluon.HybridBlock):
    """``x + sum_k |W h_k|``: a zero child adds nothing (|W 0| = 0), but
    the norm's gradient at 0 is 0/0."""
    dynbatch_pad_lists = True

    def __init__(self):
        super().__init__()
        with self.name_scope():
            self.w = gluon.nn.Dense(4, in_units=4, use_bias=False)

    def hybrid_forward(self, F, x, hs):
        for h in hs:
            x = F.broadcast_add(x, F.sqrt(F.sum(F.square(self.w(h)), axis=1, keepdims=True)))
        return x


def test_pad_lists_claim_that_changes_only_gradients_is_caught():
    """Padding leaves the outputs alone but makes the weight's gradient NaN
    (batched training got NaN gradients, silently, found by a fuzzer): the
    check also compares the traced symbols' gradients."""
    block = dyb.DynBatchBlock(NormOfChildren())
    block.initialize()
    xs = [mx.nd.array(np.random.RandomState(i).rand(1, 4)) for i in range(4)]
    with pytest.raises(dyb.InputError, match=r'declares pad_lists.*changes the gradient of '
                                             r'normofchildren\d+_dense\d+_weight'):
        with autograd.record():
            with dyb.batching('depth'):
                block(xs[0], [xs[1]])
                block(xs[2], [xs[1], xs[3]])


class PerPositionChildren(gluon.HybridBlock):
    """``act(W x + sum_k g(U_k h_k))``, one ``U_k`` per child position (as
    an N-ary Tree-LSTM has): a parameter that only longer lists read.
    ``g`` is the identity (padding is neutral) or a norm (a zero child adds
    0, but the norm's gradient at 0 is 0/0).  ``first`` names the layers so
    that ``W``'s parameters sort before or after the ``U_k``'s."""
    dynbatch_pad_lists = True

    def __init__(self, norm, first, children=2):
        super().__init__()
        self.norm = norm
        with self.name_scope():
            self.w = gluon.nn.Dense(4, in_units=4, prefix=first + 'w_')
            self.u = [gluon.nn.Dense(4, in_units=4, use_bias=False, prefix='u%d_' % k)
                      for k in range(children)]
            for u in self.u:
                self.register_child(u)

    def hybrid_forward(self, F, x, hs):
        s = self.w(x)
        for k, h in enumerate(hs):
            part = self.u[k](h)
            s = F.broadcast_add(s, F.norm(part, axis=1, keepdims=True)) if self.norm else s + part
        return F.tanh(s)


def _per_position_minibatch(block):
    xs = [mx.nd.array(np.random.RandomState(i).normal(size=(1, 4))) for i in range(4)]
    leaves = [block(x, []) for x in xs]
    return [block(xs[0], [leaves[0]]), block(xs[1], [leaves[1], leaves[2]])]


@pytest.mark.parametrize('first', ['a_', 'z_'])
def test_pad_lists_check_compares_gradients_by_name(first):
    """Found by a review: the check paired the gradients of the short and
    the padded symbol by position in two sorted lists, so a parameter only
    longer lists read shifted them: a neutral block was refused, naming an
    unrelated bias, or (U_1 sorting last) a NaN gradient was never compared
    and batched training returned it.  Now the neutral block batches with
    per-sample gradients, and the NaN one is refused, naming U_1."""
    block = dyb.DynBatchBlock(PerPositionChildren(norm=False, first=first))
    block.initialize(mx.init.Uniform(0.5))
    assert_same(run_both(lambda: _per_position_minibatch(block), [block]), rtol=1e-5, atol=1e-6)
    assert dyb.stats()['last']['batch_sizes'] == [4, 2]

    block = dyb.DynBatchBlock(PerPositionChildren(norm=True, first=first))
    block.initialize(mx.init.Uniform(0.5))
    with pytest.raises(dyb.InputError, match=r'declares pad_lists.*changes the gradient of '
                                             r'perpositionchildren\d+_u1_weight'):
        with autograd.record():
            with dyb.batching('depth'):
                _per_position_minibatch(block)


def _checked_lengths(monkeypatch):
    """Record the list lengths of every padding check from now on:
    ``[((short lengths), (padded lengths))]``."""
    from gluon_dynbatch import block as block_module
    seen, check = [], block_module.check_padding_is_neutral

    def lengths(sig):
        return tuple(len(item) for item in sig.fmt if item != 0)

    def recorded(dblock, short, padded):
        seen.append((lengths(short), lengths(padded)))
        return check(dblock, short, padded)
    monkeypatch.setattr(block_module, 'check_padding_is_neutral', recorded)
    return seen


class MeanSkipsLastZero(gluon.HybridBlock):
    """A mean over children that skips the last child where it is zero: one
    zero row of padding changes nothing, two do (found by a review of
    checks chained one element at a time, 1 -> 2 -> 3, which this passed;
    padding is checked from each length to the padded one directly)."""
    dynbatch_pad_lists = True

    def hybrid_forward(self, F, x, hs):
        total = F.add_n(*hs) if len(hs) > 1 else hs[0]
        last_is_zero = F.min(hs[-1] == 0, axis=1, keepdims=True)
        return F.tanh(x + F.broadcast_div(total, len(hs) - last_is_zero))


class PairsSpecial(gluon.HybridBlock):
    """Sums its children, but multiplies a pair: calls of 1 and 3 children
    pad neutrally, and no call has 2."""
    dynbatch_pad_lists = True

    def hybrid_forward(self, F, x, hs):
        if len(hs) == 2:
            return F.tanh(x + hs[0] * hs[1])
        return F.tanh(F.add_n(x, *hs))


def _one_and_three(block, xs):
    return [block(xs[0], [xs[1]]), block(xs[0], xs[2:5])]


def test_padding_is_checked_from_each_length_to_the_padded_one(monkeypatch):
    """A block that padding by one row leaves alone but padding by two
    changes is refused; one that differs only at a length no call has
    batches, matching per sample (checks chained through the lengths
    between refused it, naming a length the user never passed)."""
    xs = [mx.nd.array(np.random.RandomState(i).normal(size=(1, 4))) for i in range(5)]
    block = dyb.DynBatchBlock(MeanSkipsLastZero())
    with pytest.raises(dyb.InputError, match=r'zeros \(argument #1 from 1 to 3 arrays\) '
                                             r'changes its output 0'):
        with dyb.batching('depth'):
            _one_and_three(block, xs)

    seen = _checked_lengths(monkeypatch)
    block = dyb.DynBatchBlock(PairsSpecial())
    results = run_both(lambda: _one_and_three(block, xs), [block], inputs=xs)
    assert dyb.stats()['last']['batch_sizes'] == [2]
    assert seen == [((1,), (3,))]
    assert_same(results, rtol=1e-5, atol=1e-6)


class FrozenFromTwo(gluon.HybridBlock):
    """``tanh(W x + sum(hs))``, but from two children on ``W`` is read
    through ``BlockGrad``: padding leaves the values alone and zeroes ``W``'s
    gradient, which scales with ``x``."""
    dynbatch_pad_lists = True

    def __init__(self):
        super().__init__()
        with self.name_scope():
            self.w = self.params.get('w', shape=(4, 4))

    def hybrid_forward(self, F, x, hs, w):
        w = F.BlockGrad(w) if len(hs) >= 2 else w
        return F.tanh(F.add_n(F.FullyConnected(x, w, no_bias=True, num_hidden=4), *hs))


def test_gradient_check_draws_the_arguments_that_are_not_ids():
    """The gradient half of the check fed zeros to every argument but the
    list elements, in case one was an id, so a gradient that scales with
    ``x`` was compared at ``x = 0`` only: this block batched with a zero
    ``W`` gradient (found by a review).  Arguments read as ids stay zero: a
    Tree-LSTM node's tokens (a row-sparse gradient lookup refuses negative
    ones) still pass."""
    block = dyb.DynBatchBlock(FrozenFromTwo())
    block.initialize(mx.init.Uniform(0.5))
    xs = [mx.nd.array(np.random.RandomState(i).normal(size=(1, 4))) for i in range(5)]
    with pytest.raises(dyb.InputError, match=r'changes the gradient of frozenfromtwo\d+_w'):
        with autograd.record():
            with dyb.batching('depth'):
                _one_and_three(block, xs)

    from gluon_dynbatch.block import _id_inputs
    from gluon_dynbatch.models import TreeLSTMNode
    node = dyb.DynBatchBlock(TreeLSTMNode(50, 6, 4, sparse_grad=True))
    node.initialize()
    token = np.array([3.0], np.float32)
    with autograd.record():
        with dyb.batching('depth'):
            leaves = [node(token, [], []) for _ in range(3)]
            node(token, [leaves[0][0]], [leaves[0][1]])
            node(token, [h for h, _ in leaves], [c for _, c in leaves])
    (sig,) = [s for s in node.signatures() if len(s.fmt[1]) == 1]
    assert _id_inputs(sig.symbol) == {sig.data_names[0]}


class EmbeddedChildren(gluon.HybridBlock):
    """A node that looks its token up in a large table, as TreeLSTMNode
    does, and sums its children; ``tied`` also scores through the table."""
    dynbatch_pad_lists = True

    def __init__(self, vocab, tied=False):
        super().__init__()
        self.tied = tied
        with self.name_scope():
            self.embed = gluon.nn.Embedding(vocab, 4)
            self.dense = gluon.nn.Dense(4, in_units=4)

    def hybrid_forward(self, F, token, hs):
        h = self.dense(self.embed(token).reshape((1, 4)))
        for child in hs:
            h = h + child
        h = F.tanh(h)
        if self.tied:
            return h, F.FullyConnected(h, self.embed.weight.var(), no_bias=True,
                                       num_hidden=self.embed._kwargs['input_dim'])
        return h


def test_pad_lists_check_reads_small_tables():
    """The padding check runs the symbols with an Embedding table of
    CHECK_TABLE_ROWS rows where the table is read by Embedding alone
    (full tables made a check of a 100,000-word Tree-LSTM node take 2.6-5 s
    and 1 GB, drawn, copied and compared whole); a tied table keeps its
    size; and a minibatch over such a node still matches per sample."""
    from gluon_dynbatch.block import CHECK_TABLE_ROWS, _small_tables

    def tables(symbol):
        nodes = json.loads(symbol.tojson())['nodes']
        return sorted((n['attrs']['input_dim'], n['op']) for n in nodes if n['op'] == 'Embedding')

    for tied, rows in ((False, str(CHECK_TABLE_ROWS)), (True, '5000')):
        block = dyb.DynBatchBlock(EmbeddedChildren(5000, tied))
        block.initialize()
        token = np.array([7.0], np.float32)
        with dyb.batching('depth'):
            leaf = block(token, [])
            block(token, [leaf[0] if tied else leaf] * 2)
        (sig,) = [s for s in block.signatures() if s.fmt[1] == ()]
        assert tables(_small_tables(sig.symbol)) == [(rows, 'Embedding')]
        assert tables(sig.symbol) == [('5000', 'Embedding')]    # the programs' own: whole

    block = dyb.DynBatchBlock(EmbeddedChildren(50000))
    block.initialize(mx.init.Uniform(0.5))
    tokens = [np.array([k * 997.0], np.float32) for k in range(6)]

    def forward():
        leaves = [block(t, []) for t in tokens[:3]]
        return [block(tokens[3], leaves[:1]), block(tokens[4], leaves[1:]),
                block(tokens[5], [])]
    assert_same(run_both(forward, [block]), rtol=1e-5, atol=1e-6)


class Cell(gluon.HybridBlock):
    def __init__(self, width=4):
        super().__init__()
        with self.name_scope():
            self.dense = gluon.nn.Dense(width, in_units=width)

    def hybrid_forward(self, F, x, h):
        return F.tanh(self.dense(x) + h)


def test_cast_after_tracing_traces_anew():
    """``block.cast`` after calls at float32: calls at float64 then trace
    and run at float64 (MXNet's cached parameter variables kept the old
    dtype, and type inference failed)."""
    cell = dyb.DynBatchBlock(Cell())
    cell.initialize()
    x32 = mx.nd.array(np.random.RandomState(0).uniform(-1, 1, (1, 4)))
    with dyb.batching('depth'):
        first = cell(x32, x32)
    want32 = first.asnumpy()
    cell.cast('float64')
    x64 = x32.astype('float64')
    with dyb.batching('depth'):
        outs = [cell(x64, x64), cell(x64, x64 * 2)]
    assert outs[0].dtype == np.float64
    np.testing.assert_allclose(outs[0].asnumpy(), want32, rtol=1e-6)
    np.testing.assert_allclose(outs[1].asnumpy(), cell(x64, x64 * 2).asnumpy(), rtol=1e-12)


def test_draws_random_knows_the_samplers_and_not_the_densities():
    from gluon_dynbatch.rules import draws_random
    for name in ('_random_normal', 'random_uniform', '_sample_multinomial', '_shuffle',
                 'Dropout', '_npi_normal', '_contrib_dgl_csr_neighbor_uniform_sample'):
        assert draws_random(name), name
    for name in ('_random_pdf_normal', 'random_pdf_gamma', 'FullyConnected', 'LeakyReLU'):
        assert not draws_random(name), name
    assert draws_random('LeakyReLU', {'act_type': 'rrelu'})
    assert not draws_random('LeakyReLU', {'act_type': 'leaky'})


class Reparameterised(gluon.HybridBlock):
    """A VAE's sample ``mu + exp(lv / 2) e``, ``e`` drawn by ``how`` or, for
    the per-sample reference, given as a second argument; returns the
    sample and ``e``."""

    def __init__(self, how):
        super().__init__()
        self.how = how
        with self.name_scope():
            self.mu = gluon.nn.Dense(6, in_units=4)
            self.lv = gluon.nn.Dense(6, in_units=4)

    def hybrid_forward(self, F, x, *given):
        mu, lv = self.mu(x), self.lv(x)
        if given:
            e = given[0]
        elif self.how == 'normal_like':
            e = F.random.normal_like(mu)
        else:
            e = F.random.uniform_like(mu, low=-1, high=1)
        return mu + F.exp(lv / 2) * e, e


@pytest.mark.parametrize('strategy', ['depth', 'agenda', 'cached', 'auto'])
@pytest.mark.parametrize('how', ['normal_like', 'uniform_like'])
def test_draws_from_per_sample_inputs_batch(how, strategy):
    """Found by a user trial: a VAE's reparameterisation,
    ``F.random.normal_like(mu)``, had no rule and ran per sample.  It
    draws every element on its own, so a step's rows draw as its calls
    would: batched, each call gets draws of its own (equal host inputs
    too: such a block is no function of its inputs), and its results and
    gradients are those of the block run per sample with those draws."""
    block = dyb.DynBatchBlock(Reparameterised(how))
    block.initialize(mx.init.Uniform(0.5))
    rng = np.random.RandomState(4)
    xs = [rng.uniform(-1, 1, (1, 4)).astype(np.float32) for _ in range(7)]
    xs += [xs[0]] * 3
    weights = mx.nd.array(rng.uniform(-1, 1, (len(xs), 6)))
    with autograd.record():
        with dyb.batching(strategy):
            outs = [block(x) for x in xs]
        z = dyb.concat_rows([out[0] for out in outs])
        (z * weights).sum().backward()
    draws = dyb.concat_rows([out[1] for out in outs]).asnumpy()
    assert dyb.stats()['last']['batch_sizes'] == [len(xs)]
    assert len({row.tobytes() for row in draws}) == len(xs)
    got = z.asnumpy(), {k: p.grad().asnumpy().copy() for k, p in block.collect_params().items()}
    with autograd.record():
        z = mx.nd.concat(*[block(x, mx.nd.array(e[None]))[0] for x, e in zip(xs, draws)],
                         dim=0)
        (z * weights).sum().backward()
    np.testing.assert_allclose(got[0], z.asnumpy(), rtol=1e-5, atol=1e-6)
    for name, param in block.collect_params().items():
        np.testing.assert_allclose(got[1][name], param.grad().asnumpy(), rtol=1e-4, atol=1e-5,
                                   err_msg=name)


class Sampled(gluon.HybridBlock):
    """A decoder's next token drawn from ``softmax(dense(x))`` with its
    log-probability, and a sample of ``normal(dense(x), 1)``; for the
    per-sample reference, the token given, its log-probability picked."""

    def __init__(self):
        super().__init__()
        with self.name_scope():
            self.dense = gluon.nn.Dense(5, in_units=3)

    def hybrid_forward(self, F, x, *given):
        scores = self.dense(x)
        if given:
            return F.pick(F.log_softmax(scores), given[0])
        token, logp = F.random.multinomial(F.softmax(scores), get_prob=True)
        return F.cast(token, 'float32'), logp, F.random.normal(scores, F.ones_like(scores))


@pytest.mark.parametrize('strategy', ['depth', 'cached'])
def test_samplers_with_per_sample_parameters_batch(strategy):
    """``F.random.multinomial(p)`` and ``F.random.normal(mu, sigma)`` of
    per-sample distributions (``_sample_multinomial``, ``_sample_normal``)
    batch: one step, draws of their own per call, the log-probability and
    its gradient those of each call's own token."""
    block = dyb.DynBatchBlock(Sampled())
    block.initialize(mx.init.Uniform(1.0))
    rng = np.random.RandomState(6)
    xs = [mx.nd.array(rng.uniform(-2, 2, (1, 3))) for _ in range(40)]
    with autograd.record():
        with dyb.batching(strategy):
            outs = [block(x) for x in xs]
        logp = dyb.concat_rows([out[1] for out in outs])
        logp.sum().backward()
    assert dyb.stats()['last']['batch_sizes'] == [len(xs)]
    tokens = dyb.concat_rows([out[0] for out in outs]).asnumpy()
    assert len(set(tokens.tolist())) > 1
    noise = dyb.concat_rows([out[2] for out in outs]).asnumpy()
    assert len({row.tobytes() for row in noise}) == len(xs)
    got = logp.asnumpy(), block.block.dense.weight.grad().asnumpy().copy()
    with autograd.record():
        logp = mx.nd.concat(*[block(x, mx.nd.array([t])) for x, t in zip(xs, tokens)], dim=0)
        logp.sum().backward()
    np.testing.assert_allclose(got[0], logp.asnumpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got[1], block.block.dense.weight.grad().asnumpy(), rtol=1e-4,
                               atol=1e-5)


class NoisySum(gluon.HybridBlock):
    """``tanh(W x + sum_k h_k)`` with noise drawn for the sum (neutral
    padding) or for each child too (``per_child``: a padding child gets
    noise, not neutral)."""
    dynbatch_pad_lists = True

    def __init__(self, per_child=False):
        super().__init__()
        self.per_child = per_child
        with self.name_scope():
            self.dense = gluon.nn.Dense(4, in_units=4)

    def hybrid_forward(self, F, x, children):
        total = self.dense(x)
        for h in children:
            total = total + h + (0.1 * F.random.normal_like(h) if self.per_child else 0)
        return F.tanh(total) + 0.1 * F.random.normal_like(total)


def _noisy_minibatch(block, seed):
    mx.random.seed(seed)
    xs = [mx.nd.array(np.random.RandomState(8).uniform(-1, 1, (1, 4))) for _ in range(9)]
    with dyb.batching('depth'):
        outs = [block(xs[i], xs[:i % 3]) for i in range(9)]
    dyb.concat_rows(outs).wait_to_read()
    return mx.nd.random.uniform(shape=(5,)).asnumpy()


def test_pad_lists_check_of_a_block_that_draws_compares_like_draws():
    """Found by a user trial: the padding check ran the block with the
    shorter and the padded lists, each drawing its own noise, and so
    refused a block whose padding is neutral, blaming the padding.  Each
    run now starts from one seed; the user's generator is seeded after
    the check from a number drawn from it before, so seeds still give
    streams of their own.  Noise drawn for a padding child is refused,
    saying that the block draws."""
    after = []
    for seed in (1, 2, 1):
        block = dyb.DynBatchBlock(NoisySum())
        block.initialize()
        after.append(_noisy_minibatch(block, seed))
        assert dyb.stats()['last']['batch_sizes'] == [3, 6]
        assert dyb.stats()['last']['padding_checks'] == 1
    assert not np.array_equal(after[0], after[1])
    np.testing.assert_array_equal(after[0], after[2])
    block = dyb.DynBatchBlock(NoisySum(per_child=True))
    block.initialize()
    with pytest.raises(dyb.InputError, match='changes its output 0.*It draws random numbers'):
        _noisy_minibatch(block, 1)


class LengthSoftmax(gluon.HybridBlock):
    """A softmax over a row's first ``length`` entries: a constant length
    (shared by every call) or one computed from the row (per sample)."""

    def __init__(self, per_sample):
        super().__init__()
        self.per_sample = per_sample
        with self.name_scope():
            self.dense = gluon.nn.Dense(4, in_units=4)

    def hybrid_forward(self, F, x):
        if self.per_sample:
            length = F.cast(F.sum(x > 0, axis=1), 'int32') + 1
        else:
            length = F.cast(F.ones((1,)) * 2, 'int32')
        return F.softmax(self.dense(x), length, axis=-1, use_length=True)


@pytest.mark.parametrize('per_sample', [False, True])
def test_softmax_with_a_shared_length_runs_per_sample(per_sample):
    """``softmax(x, length, use_length=True)`` reads one length per row: a
    shared ``(1,)`` length keeps its shape while the rows grow, so such a
    block runs per sample (MXNet raised at the flush before, found by a
    review); a length computed per sample batches.  Values equal per
    sample."""
    block = dyb.DynBatchBlock(LengthSoftmax(per_sample))
    block.initialize(mx.init.Uniform(0.5))
    rng = np.random.RandomState(1)
    xs = [mx.nd.array(rng.uniform(-1, 1, (1, 4))) for _ in range(5)]
    assert_same(run_both(lambda: [block(x) for x in xs], [block], xs, 'depth'))
    batch_safe, reason = _verdict(block)
    assert batch_safe == per_sample, reason
    if not per_sample:
        assert 'softmax with use_length reads one length per row, but its lengths are shared' \
            in reason and 'pass them to the call' in reason, reason


class Reshaped(gluon.HybridBlock):
    """An RNTN's bilinear term ``[a;b]^T V [a;b]`` through ``batch_dot``,
    its reshapes written with the leading 1 of per-sample code, ``(1, ...)``,
    or with ``0`` (keep)."""

    def __init__(self, lead):
        super().__init__()
        self.lead = lead
        with self.name_scope():
            self.v = self.params.get('v', shape=(4, 4 * 2), init=mx.init.Uniform(0.5))

    def hybrid_forward(self, F, x, v):
        t = F.reshape(F.dot(x, v), shape=(self.lead, 2, 4))
        return F.reshape(F.batch_dot(t, F.expand_dims(x, axis=2)), shape=(self.lead, 2))


@pytest.mark.parametrize('lead', [1, 0])
def test_reshape_to_a_leading_1_batches(lead):
    """Per-sample code has a leading axis of 1 and writes it into its
    reshapes; batched, a 1 there would fold the rows of every sample into
    one, so such a block ran per sample (a user trial's RNTN).  A leading 1
    of a one-row value is made 0 (keep) when traced, which per sample is the
    same: one step, and per-sample values and gradients."""
    block = dyb.DynBatchBlock(Reshaped(lead))
    block.initialize()
    rng = np.random.RandomState(2)
    xs = [mx.nd.array(rng.uniform(-1, 1, (1, 4))) for _ in range(5)]
    assert_same(run_both(lambda: [block(x) for x in xs], [block], xs, 'depth'))
    batch_safe, reason = _verdict(block)
    assert batch_safe, reason
    assert dyb.stats()['last']['batch_sizes'] == [5]


class FoldedHeads(gluon.HybridBlock):
    """Two heads folded into axis 0 by a reverse reshape, as gluonnlp's
    MultiHeadAttentionCell folds them, a row-wise op on the sample's two
    rows, and back to one row."""

    def hybrid_forward(self, F, x):
        heads = F.reshape(F.reshape(x, shape=(0, 2, 3)), shape=(-1, 0), reverse=True)
        return F.reshape(F.tanh(heads), shape=(-1, 6))


def test_reverse_reshape_folding_heads_into_rows_batches():
    """A reshape with reverse=True folding two heads into axis 0 gives a
    sample two rows: it ran per sample (a user trial's transformer
    encoder).  Its target is written out from the left, ``(-1, 3)``, which
    batched keeps each sample's rows together: one step, and per-sample
    values and gradients."""
    block = dyb.DynBatchBlock(FoldedHeads())
    rng = np.random.RandomState(5)
    xs = [mx.nd.array(rng.uniform(-1, 1, (1, 6))) for _ in range(3)]
    assert_same(run_both(lambda: [block(x) for x in xs], [block], xs, 'depth'))
    batch_safe, reason = _verdict(block)
    assert batch_safe, reason
    assert block.signatures()[0].folded
    assert dyb.stats()['last']['batch_sizes'] == [3]


class Transformer(gluon.HybridBlock):
    """gluonnlp's transformer encoder layer over a sample's tokens, with a
    mask of its valid length, read out by a mean; returns the attention
    weights (a sample's heads, (1, heads, T, T)) too."""

    def __init__(self, dropout=0.0):
        super().__init__()
        import gluonnlp     # pylint: disable=import-outside-toplevel
        with self.name_scope():
            self.cell = gluonnlp.model.transformer.TransformerEncoderCell(
                units=8, hidden_size=16, num_heads=4, dropout=dropout, output_attention=True)
            self.out = gluon.nn.Dense(2, flatten=False)

    def hybrid_forward(self, F, x, mask):
        h, (att,) = self.cell(x, mask)
        return self.out(F.mean(h, axis=1)), att


@pytest.mark.parametrize('strategy', ['depth', 'agenda', 'cached'])
def test_gluonnlp_transformer_encoder_batches(strategy):
    """gluonnlp's multi-head attention folds its heads into axis 0 (a sample
    of one row becomes one of 4 rows) and back, and ran per sample.  Now
    calls of one length batch, masked to their own lengths: one step per
    sequence length, per-sample values and gradients."""
    block = dyb.DynBatchBlock(Transformer())
    block.initialize(mx.init.Xavier())
    rng = np.random.RandomState(6)
    xs, masks = [], []
    for k in range(10):
        steps = (5, 7)[k % 2]
        mask = np.zeros((1, steps, steps), np.float32)
        mask[:, :, :rng.randint(1, steps + 1)] = 1
        xs.append(mx.nd.array(rng.uniform(-1, 1, (1, steps, 8))))
        masks.append(mx.nd.array(mask))
    assert_same(run_both(lambda: [out for x, m in zip(xs, masks) for out in block(x, m)],
                         [block], xs, strategy))
    assert [sig.batch_safe for sig in block.signatures()] == [True, True]
    assert sorted(dyb.stats()['last']['batch_sizes']) == [5, 5]


class Encoder(gluon.HybridBlock):
    """gluonnlp's two-layer transformer encoder (positional encoding, masks
    of each sample's valid length) read out by a mean."""

    def __init__(self):
        super().__init__()
        import gluonnlp     # pylint: disable=import-outside-toplevel
        with self.name_scope():
            self.encoder = gluonnlp.model.transformer.TransformerEncoder(
                num_layers=2, units=8, hidden_size=16, num_heads=2, max_length=20, dropout=0.0)

    def hybrid_forward(self, F, x, valid_length):
        out, _ = self.encoder(x, valid_length=valid_length)
        return F.mean(out, axis=1)


@pytest.mark.parametrize('strategy', ['depth', 'agenda', 'cached'])
def test_gluonnlp_transformer_encoder_with_valid_lengths_batches(strategy):
    """It counts its steps with ``arange_like(x, axis=1)``, which was taken
    for a batched value and ran the block per sample; the count is the same
    for every sample (shared).  One step, each sample masked to its own
    valid length: per-sample values and gradients."""
    block = dyb.DynBatchBlock(Encoder())
    block.initialize(mx.init.Xavier())
    rng = np.random.RandomState(9)
    xs = [mx.nd.array(rng.uniform(-1, 1, (1, 6, 8))) for _ in range(5)]
    lengths = [mx.nd.array([k + 2]) for k in range(5)]
    assert_same(run_both(lambda: [block(x, n) for x, n in zip(xs, lengths)], [block], xs,
                         strategy))
    assert [sig.batch_safe for sig in block.signatures()] == [True]
    assert dyb.stats()['last']['batch_sizes'] == [5]


class FoldedTokens(gluon.HybridBlock):
    """Attention of two heads from a float argument's queries to a sample's
    4 token embeddings, folded into rows as gluonnlp folds them: the keys,
    of two rows per call, are a function of the host token ids alone."""

    def __init__(self):
        super().__init__()
        with self.name_scope():
            self.embed = gluon.nn.Embedding(5, 6)
            self.dense = gluon.nn.Dense(24)

    def hybrid_forward(self, F, ids, x):
        def fold(rows):     # (1, 4, 6) -> (2, 4, 3)
            heads = F.transpose(rows.reshape((0, 4, 2, 3)), axes=(0, 2, 1, 3))
            return heads.reshape((-1, 0, 0), reverse=True)
        keys = F.tanh(fold(self.embed(ids)))
        att = F.softmax(F.batch_dot(fold(self.dense(x).reshape((0, 4, 6))), keys,
                                    transpose_b=True))
        mixed = F.batch_dot(att, keys).reshape((-4, -1, 2, 0, 0))
        return F.transpose(mixed, axes=(0, 2, 1, 3)).reshape((0, -1))


@pytest.mark.parametrize('strategy', ['depth', 'agenda', 'cached'])
def test_folded_rows_of_host_data_batch_without_sharing_distinct_rows(strategy):
    """A folded signature's host part is not run on distinct host rows nor
    hoisted: its values have two rows per call, which a take of one row per
    call would hand on cut (16 calls of 3 distinct token rows, so both
    would run for a signature of one row per call)."""
    block = dyb.DynBatchBlock(FoldedTokens())
    block.initialize(mx.init.Uniform(0.5))
    rng = np.random.RandomState(7)
    tokens = [rng.randint(0, 5, (1, 4)).astype(np.int32) for _ in range(3)]
    ids = [tokens[k % 3] for k in range(16)]
    xs = [mx.nd.array(rng.uniform(-1, 1, (1, 3))) for _ in range(16)]
    for _ in range(2):      # (a cached plan replays the second flush)
        assert_same(run_both(lambda: [block(i, x) for i, x in zip(ids, xs)], [block], xs,
                             strategy))
        assert dyb.stats()['last']['batch_sizes'] == [16]
    assert block.signatures()[0].folded


class FoldedList(gluon.HybridBlock):
    """Each element of a list, folded into two rows as is the sample's
    ``x``, meets those rows in a row-wise product."""

    def __init__(self):
        super().__init__()
        with self.name_scope():
            self.dense = gluon.nn.Dense(6, flatten=False)

    def hybrid_forward(self, F, x, items):
        shared = F.reshape(self.dense(x), shape=(2, 3))
        return F.add_n(*[F.reshape(F.tanh(F.reshape(item, shape=(-1, 3)) * shared),
                                   shape=(1, 6)) for item in items])


@pytest.mark.parametrize('strategy', ['depth', 'cached'])
def test_folded_rows_read_by_every_element_of_a_list(strategy):
    """A folded signature's lists are cut into their elements, without the
    lanes pass (written for one row per call): one step, per-sample values
    and gradients."""
    block = dyb.DynBatchBlock(FoldedList())
    block.initialize(mx.init.Uniform(0.5))
    rng = np.random.RandomState(8)
    xs = [mx.nd.array(rng.uniform(-1, 1, (1, 6))) for _ in range(6)]
    items = [[mx.nd.array(rng.uniform(-1, 1, (1, 6))) for _ in range(3)] for _ in range(6)]
    flat = xs + [item for some in items for item in some]
    for _ in range(2):
        assert_same(run_both(lambda: [block(x, some) for x, some in zip(xs, items)], [block],
                             flat, strategy))
        assert dyb.stats()['last']['batch_sizes'] == [6]
    assert block.signatures()[0].folded


class LikeFolded(gluon.HybridBlock):
    """A sample's one row broadcast like its two folded rows along axis 1,
    and cut like them along axis 1: both read only the folded value's
    sizes on axis 1, never its rows."""

    def hybrid_forward(self, F, x):
        rows = F.reshape(x, shape=(-1, 3))                                  # (2, 3)
        first = F.slice_axis(x, axis=1, begin=0, end=1)                     # (1, 1)
        wide = F.broadcast_like(first, rows, lhs_axes=(1,), rhs_axes=(1,))  # (1, 3)
        cut = F.slice_like(x, rows, axes=(1,))                              # (1, 3)
        return F.concat(wide * cut, F.reshape(F.tanh(rows), shape=(1, 6)), dim=1)


@pytest.mark.parametrize('strategy', ['depth', 'cached'])
def test_like_ops_reading_only_sizes_of_folded_rows_batch(strategy):
    """``broadcast_like`` and ``slice_like`` naming axes without axis 0 read
    the second input's sizes there, not its rows: a sample's one row
    broadcast like its folded rows ran per sample ("reads batched inputs of
    1 and 2 rows per sample", a user trial's softmax lengths broadcast like
    the heads' scores).  One step, per-sample values and gradients."""
    block = dyb.DynBatchBlock(LikeFolded())
    rng = np.random.RandomState(4)
    xs = [mx.nd.array(rng.uniform(-1, 1, (1, 6))) for _ in range(3)]
    assert_same(run_both(lambda: [block(x) for x in xs], [block], xs, strategy))
    batch_safe, reason = _verdict(block)
    assert batch_safe, reason
    assert block.signatures()[0].folded
    assert dyb.stats()['last']['batch_sizes'] == [3]


TWICE_ROWS = register_custom_op('test_rules_twice_rows', lambda a: a * 2)
MIXED_ROWS = [
    # (name, per-sample op on a sample x of shape (1, 6), reason)
    ('broadcast of two rows and one', lambda F, x: F.reshape(F.broadcast_add(
        F.reshape(x, shape=(-1, 3)), F.slice_axis(x, axis=1, begin=0, end=3)), shape=(-1, 6)),
     'reads batched inputs of 1 and 2 rows per sample'),
    ('broadcast_like of one row like two on axis 0', lambda F, x: F.reshape(
        F.broadcast_like(F.slice_axis(x, axis=1, begin=0, end=3), F.reshape(x, shape=(-1, 3)),
                         lhs_axes=(0,), rhs_axes=(0,)), shape=(-1, 6)),
     'reads batched inputs of 1 and 2 rows per sample'),
    ('swapaxes of two rows', lambda F, x: F.reshape(F.swapaxes(
        F.reshape(x, shape=(-1, 3)), dim1=0, dim2=1), shape=(-1, 6)),
     'sees a batched input of shape (2, 3)'),
    ('a custom op with a rule of the user\'s', lambda F, x: F.reshape(F.Custom(
        F.reshape(x, shape=(-1, 3)), op_type=TWICE_ROWS),
        shape=(-1, 6)), 'has a batching rule of the user\'s, written for one row per sample'),
]


@pytest.mark.parametrize('name,op,why', MIXED_ROWS, ids=[c[0] for c in MIXED_ROWS])
def test_ops_that_cannot_read_folded_rows_run_per_sample(name, op, why, monkeypatch):
    """Batched, a sample folded into two rows pairs with another's rows only
    in ops whose batched inputs all have two rows, and whose rule was read
    for it (a builtin): a broadcast of a sample's two rows with its one row
    would pair the rows of other samples (MXNet refuses the shapes), a
    swap moves them, and a user's rule speaks of one row.  They run per
    sample, with the reason."""
    from gluon_dynbatch import rules
    monkeypatch.setattr(rules, 'RULES', dict(rules.RULES))
    monkeypatch.setattr('gluon_dynbatch.trace.batching_rule', rules.RULES.get)
    dyb.register_batching_rule('Custom')(lambda view: None)      # acts on each row alone
    block = dyb.DynBatchBlock(Apply(op))
    block.initialize(mx.init.Uniform(0.5))
    rng = np.random.RandomState(5)
    xs = [mx.nd.array(rng.uniform(-1, 1, (1, 6))) for _ in range(3)]
    with warnings.catch_warnings():
        warnings.simplefilter('ignore', dyb.PerSampleWarning)
        assert_same(run_both(lambda: [block(x) for x in xs], [block], xs, 'depth'))
    batch_safe, reason = _verdict(block)
    assert not batch_safe
    assert why in reason, reason


class ReshapedRows(gluon.HybridBlock):
    """A (2, 3) parameter reshaped to one row, ``(1, 6)``, and added to the
    sample: a leading 1 that does not keep the rows it reshapes."""

    def __init__(self):
        super().__init__()
        with self.name_scope():
            self.table = self.params.get('table', shape=(2, 3))

    def hybrid_forward(self, F, x, table):
        return F.broadcast_add(x, F.reshape(table, shape=(1, 6)))


def test_reshape_of_several_rows_to_one_keeps_its_1():
    """A parameter's two rows folded into one: the target is written out as
    ``(-1, 6)``, one row of the shared value still (``0``, keep, would
    fail), and the block batches with per-sample values and gradients."""
    block = dyb.DynBatchBlock(ReshapedRows())
    block.initialize(mx.init.Uniform(0.5))
    rng = np.random.RandomState(3)
    xs = [mx.nd.array(rng.uniform(-1, 1, (1, 6))) for _ in range(3)]
    assert_same(run_both(lambda: [block(x) for x in xs], [block], xs, 'depth'))
    batch_safe, reason = _verdict(block)
    assert batch_safe, reason
    assert '"shape": "(-1, 6)"' in block.signatures()[0].symbol.tojson()


class Normed(gluon.HybridBlock):
    """``nn.BatchNorm(**kwargs)`` of ``dense(x)`` (3 channels unless told)."""

    def __init__(self, **kwargs):
        super().__init__()
        with self.name_scope():
            self.dense = gluon.nn.Dense(6, in_units=6, flatten=False)
            self.norm = gluon.nn.BatchNorm(**dict({'in_channels': 3}, **kwargs))

    def hybrid_forward(self, F, x):
        return self.norm(self.dense(x))


def _normed_calls(count=4, **kwargs):
    """A DynBatchBlock of :class:`Normed` with running statistics of its
    own, and ``count`` per-sample inputs (1, 3, 6)."""
    net = Normed(**kwargs)
    net.initialize(mx.init.Uniform(0.5))
    net.norm.running_mean.set_data(mx.nd.array([0.1, -0.2, 0.3]))
    net.norm.running_var.set_data(mx.nd.array([1.5, 2.0, 0.5]))
    rng = np.random.RandomState(3)
    return dyb.DynBatchBlock(net), [mx.nd.array(rng.uniform(-1, 1, (1, 3, 6)))
                                    for _ in range(count)]


@pytest.mark.parametrize('global_stats', [True, False])
def test_batch_norm_batches_in_training_with_global_statistics_only(global_stats):
    """In training BatchNorm normalises by the batch's statistics: a step's
    would mix every sample's rows, so it runs per sample, told to use
    ``use_global_stats=True``; with it, a sample's rows are normalised by
    the running statistics alone, and batch (a user trial found no rule)."""
    block, xs = _normed_calls(use_global_stats=global_stats)
    assert_same(run_both(lambda: [block(x) for x in xs], [block], xs))
    sig = block.signatures()[0]
    assert sig.batch_safe == global_stats, sig.reason
    assert (sig.inference is None) == global_stats
    if not global_stats:
        assert 'BatchNorm normalises over the batch axis in training' in sig.reason
        assert 'use_global_stats=True' in sig.reason
        assert dyb.stats()['last']['batch_sizes'] == [1] * len(xs)


@pytest.mark.parametrize('strategy', ['depth', 'agenda', 'cached'])
def test_batch_norm_batches_in_inference(recorder, strategy):
    """In inference (outside autograd) BatchNorm normalises each row by the
    running statistics, so there its calls batch; under autograd they run
    per sample.  The signature has one of its own for inference, which
    recording picks by the autograd state.  The values equal per-sample
    ones, the running statistics stay as they were, and no warning says
    it runs per sample.  (It ran per sample in every mode.)"""
    block, xs = _normed_calls()
    stats = [p.data().asnumpy() for p in (block.norm.running_mean, block.norm.running_var)]
    want = [block.block(x).asnumpy() for x in xs]
    for _ in range(2):      # (a cached plan is reused the second time)
        with warnings.catch_warnings():
            warnings.simplefilter('error', dyb.PerSampleWarning)
            with dyb.batching(strategy):
                got = [block(x) for x in xs]
        assert dyb.stats()['last']['batch_sizes'] == [len(xs)]
        for value, expected in zip(got, want):
            np.testing.assert_allclose(value.asnumpy(), expected, rtol=1e-5, atol=1e-6)
    with autograd.predict_mode():   # (the default, said)
        with dyb.batching(strategy):
            got = [block(x) for x in xs]
        assert dyb.stats()['last']['batch_sizes'] == [len(xs)]
    for param, before in zip((block.norm.running_mean, block.norm.running_var), stats):
        np.testing.assert_array_equal(param.data().asnumpy(), before)
    primary = block.signatures()[0]
    assert not primary.batch_safe and primary.inference.batch_safe
    assert block.signatures() == [primary, primary.inference]


def test_batch_norm_under_record_outside_training_runs_per_sample(recorder):
    """Under ``autograd.record(train_mode=False)`` BatchNorm's forward reads
    the running statistics, but its backward runs in training (as
    ``backward()`` does unless told) and takes the batch's: batched, a
    sample's gradients were the whole step's.  There it runs per sample."""
    block, xs = _normed_calls()
    assert_same(run_both(lambda: [block(x) for x in xs], [block], xs, train_mode=False))
    assert dyb.stats()['last']['batch_sizes'] == [1] * len(xs)


def test_batch_norm_in_and_out_of_autograd_in_one_scope(recorder):
    """Calls of one signature recorded in training, then in inference, then
    in training again, in one scope: each part runs under its own state (a
    change of state runs the pending calls), the one in inference batched.
    Per sample, the calls in training move the running statistics, which
    the later calls read: so they do batched."""
    block, xs = _normed_calls(6)
    parts = ((True, xs[:2]), (False, xs[2:4]), (True, xs[4:]))

    def run(wrapped):
        outs = []
        for train, part in parts:
            if train:
                with autograd.record():
                    outs += [wrapped(x) for x in part]
            else:
                outs += [wrapped(x) for x in part]
        return outs
    want = [value.asnumpy() for value in run(block.block)]
    mean = block.norm.running_mean.data().asnumpy()
    block.norm.running_mean.set_data(mx.nd.array([0.1, -0.2, 0.3]))
    block.norm.running_var.set_data(mx.nd.array([1.5, 2.0, 0.5]))
    dyb.reset_stats()
    with dyb.batching('depth'):
        got = run(block)
    for value, expected in zip(got, want):
        np.testing.assert_allclose(value.asnumpy(), expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(block.norm.running_mean.data().asnumpy(), mean, rtol=1e-6)
    assert dyb.stats()['flushes'] == 3
    assert dyb.stats()['last']['batch_sizes'] == [1, 1]


def test_batch_norm_traced_in_inference_warns_when_trained(recorder):
    """A wrapper first traced in inference, where BatchNorm batches, gives no
    warning there; its first calls under autograd, which run per sample,
    do (once), as its first trace would have under autograd."""
    block, xs = _normed_calls()
    with warnings.catch_warnings():
        warnings.simplefilter('error', dyb.PerSampleWarning)
        with dyb.batching():
            [block(x) for x in xs]
    for first in (True, False):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter('always')
            with autograd.record(), dyb.batching():
                [block(x) for x in xs]
        said = [w for w in caught if issubclass(w.category, dyb.PerSampleWarning)]
        assert len(said) == (1 if first else 0), [str(w.message) for w in said]
        if first:
            assert 'BatchNorm normalises over the batch axis in training' in \
                str(said[0].message)
    assert dyb.stats()['last']['batch_sizes'] == [1] * len(xs)


class MaskedNormedBag(gluon.HybridBlock):
    """``BatchNorm`` over each element of a list, masked past the list's
    ``length`` and summed: zero padding leaves its values alone, and (in
    training, where the statistics take the padding rows) not its
    gradients."""

    def __init__(self):
        super().__init__()
        with self.name_scope():
            self.norm = gluon.nn.BatchNorm(axis=-1, in_channels=3)

    def hybrid_forward(self, F, length, elems):
        rows = self.norm(F.stack(*elems, axis=1))
        return F.sum(F.SequenceMask(rows, length, use_sequence_length=True, axis=1), axis=1)


def test_batch_norm_pads_lists_in_inference_by_its_values(recorder):
    """Found by a fuzzer: with ``pad_lists`` the inference signature's
    padding check compared gradients too, under a backward that runs
    BatchNorm in training, where the padding rows enter the statistics:
    it refused (InputError) a block whose calls, taking no gradient there,
    pad neutrally, and that ran per sample before they batched.  Outside
    autograd they pad and batch; under autograd they run per sample."""
    net = MaskedNormedBag()
    net.initialize(mx.init.Uniform(0.5))
    net.norm.running_mean.set_data(mx.nd.array([0.1, -0.2, 0.3]))
    net.norm.running_var.set_data(mx.nd.array([1.5, 2.0, 0.5]))
    rng = np.random.RandomState(0)
    calls = [(mx.nd.array([k]), [mx.nd.array(rng.uniform(-1, 1, (1, 3))) for _ in range(k)])
             for k in (1, 2, 3, 2)]
    want = [net(length, elems).asnumpy() for length, elems in calls]
    block = dyb.DynBatchBlock(net, pad_lists=True)
    with dyb.batching('depth'):
        got = [block(length, elems) for length, elems in calls]
    assert dyb.stats()['last']['batch_sizes'] == [len(calls)]
    for value, expected in zip(got, want):
        np.testing.assert_allclose(value.asnumpy(), expected, rtol=1e-5, atol=1e-6)
    lengths = [length for length, _ in calls]
    assert_same(run_both(lambda: [block(length, elems) for length, elems in calls], [block],
                         lengths))
    assert dyb.stats()['last']['batch_sizes'] == [1] * len(calls)


@pytest.mark.parametrize('axis', [0, -3])
def test_batch_norm_over_channels_of_the_batch_axis_runs_per_sample(axis):
    """Found by a fuzzer: BatchNorm with ``axis=0`` (a sample's one channel)
    batched read N channels' statistics where there is one, and gave
    wrong values without an error; it runs per sample, saying why."""
    net = Normed(axis=axis, in_channels=1, use_global_stats=True, scale=True)
    net.initialize(mx.init.Uniform(0.5))
    net.norm.running_var.set_data(mx.nd.array([1.5]))
    block = dyb.DynBatchBlock(net)
    rng = np.random.RandomState(3)
    xs = [mx.nd.array(rng.uniform(-1, 1, (1, 3, 6))) for _ in range(4)]
    assert_same(run_both(lambda: [block(x) for x in xs], [block], xs))
    batch_safe, reason = _verdict(block)
    assert not batch_safe
    assert 'channel axis the batch axis' in reason, reason


class TwoInputs(gluon.HybridBlock):
    """``op(F, dense(x), y)``: ``y`` a per-sample label or index."""

    def __init__(self, op):
        super().__init__()
        self.op = op
        with self.name_scope():
            self.dense = gluon.nn.Dense(4, in_units=4, flatten=False)

    def hybrid_forward(self, F, x, y):
        return self.op(F, self.dense(x), y)


# (op, refused form, the form its reason advises or None): a user trial met
# them with 'has no batching rule' and the advice to register a rule, wrong
# for each
UNBATCHABLE_CASES = [
    ('softmax_cross_entropy', lambda F, h, y: F.softmax_cross_entropy(h, y),
     lambda F, h, y: -F.pick(F.log_softmax(h), y, axis=-1, keepdims=True)),
    ('gather_nd', lambda F, h, y: F.broadcast_add(F.gather_nd(h, F.zeros((1, 1))),
                                                  F.expand_dims(y, axis=1)), None),
    ('SequenceReverse', lambda F, h, y: F.broadcast_add(F.SequenceReverse(
        h.reshape((0, 2, 2))).reshape((0, 4)), F.expand_dims(y, axis=1)), None),
    ('_contrib_arange_like', lambda F, h, y: F.broadcast_mul(
        h, F.contrib.arange_like(h).reshape((1, 4))),
     lambda F, h, y: h * (F.cumsum(F.ones_like(h), axis=1) - 1)),
]


@pytest.mark.parametrize('op_name,refused,advised', UNBATCHABLE_CASES,
                         ids=[c[0] for c in UNBATCHABLE_CASES])
def test_unbatchable_ops_say_why_and_what_to_write(op_name, refused, advised):
    """Each runs per sample with its own reason (which names what to write
    instead) and no advice to register a rule; the advised form batches
    and gives the refused form's per-sample values."""
    from gluon_dynbatch.rules import UNBATCHABLE
    rng = np.random.RandomState(2)
    xs = [mx.nd.array(rng.uniform(-1, 1, (1, 4))) for _ in range(4)]
    ys = [mx.nd.array([k % 4]) for k in range(4)]
    block = dyb.DynBatchBlock(TwoInputs(refused))
    block.initialize(mx.init.Uniform(0.5))
    with pytest.warns(dyb.PerSampleWarning) as caught:
        assert_same(run_both(lambda: [block(x, y) for x, y in zip(xs, ys)], [block], xs))
    batch_safe, reason = _verdict(block)
    assert not batch_safe and reason.startswith('op %s (' % op_name), reason
    assert UNBATCHABLE[op_name] in reason, reason
    assert 'register a rule' not in str(caught[0].message)
    if advised is not None:
        want = [block(x, y).asnumpy().ravel() for x, y in zip(xs, ys)]
        other = dyb.DynBatchBlock(TwoInputs(advised))
        other.initialize()
        for mine, theirs in zip(other.block.dense.params.values(),
                                block.block.dense.params.values()):
            mine.set_data(theirs.data())
        dyb.reset_stats()
        with dyb.batching('depth'):
            outs = [other(x, y) for x, y in zip(xs, ys)]
        assert dyb.stats()['last']['batch_sizes'] == [4]
        for out, row in zip(outs, want):
            np.testing.assert_allclose(out.asnumpy().ravel(), row, rtol=1e-5, atol=1e-6)


def _last_outputs(cell, seqs):
    """The plain loop of a wrapped Gluon RNN cell over sequences: each
    sequence's last output."""
    def forward():
        outs = []
        for seq in seqs:
            states = cell.block.begin_state(batch_size=1)
            for x in seq:
                out, states = cell(x, states)
            outs.append(out)
        return outs
    return forward


@pytest.mark.parametrize('strategy', ['depth', 'agenda', 'auto'])
@pytest.mark.parametrize('cell_type', ['LSTMCell', 'GRUCell', 'RNNCell'])
def test_gluons_own_rnn_cells_batch(cell_type, strategy):
    """Gluon's LSTMCell and GRUCell cut their gates with ``SliceChannel``,
    whose axis is 1 unless given: taken for every axis, they ran per
    sample (found by a review).  Sequences of lengths 1-6 through each
    cell: the steps batch, and values and gradients (inputs' too) equal
    per-sample execution."""
    cell = dyb.DynBatchBlock(getattr(gluon.rnn, cell_type)(8, input_size=4))
    cell.initialize(mx.init.Uniform(0.5))
    rng = np.random.RandomState(2)
    seqs = [[mx.nd.array(rng.uniform(-1, 1, (1, 4))) for _ in range(rng.randint(1, 7))]
            for _ in range(6)]
    assert_same(run_both(_last_outputs(cell, seqs), [cell], [x for seq in seqs for x in seq],
                         strategy))
    assert all(sig.batch_safe for sig in cell.signatures()), \
        [sig.reason for sig in cell.signatures()]
    assert dyb.stats()['last']['steps'] <= max(len(seq) for seq in seqs)


def _ops(sig):
    return {node['op'] for node in json.loads(sig.symbol.tojson())['nodes']}


@pytest.mark.parametrize('cell_type,activation', [('LSTMCell', None), ('GRUCell', None),
                                                  ('RNNCell', 'tanh'), ('RNNCell', 'softsign')])
def test_gluons_own_rnn_cells_run_in_fast_forms(cell_type, activation):
    """Gluon's cells cut their gates by ``SliceChannel`` and apply
    ``sigmoid`` / ``tanh`` / ``softsign`` ops, which MXNet 1.9.1 runs
    ~8-35x slower than ``slice_axis`` and ``Activation`` on a step's rows:
    the traced form uses the fast ones (trace.fast_forms), and a
    sequence's values and gradients in training over 130 calls a step
    (where tanh_by_sigmoid applies to a block's own Activation) equal
    per-sample execution."""
    make = getattr(gluon.rnn, cell_type)
    cell = dyb.DynBatchBlock(make(6, input_size=3, **({'activation': activation}
                                                      if activation else {})))
    cell.initialize(mx.init.Uniform(0.5))
    rng = np.random.RandomState(5)
    xs = [[mx.nd.array(rng.uniform(-1, 1, (1, 3))) for _ in range(3)] for _ in range(130)]
    assert_same(run_both(_last_outputs(cell, xs), [cell], [x for seq in xs for x in seq],
                         'depth'))
    assert dyb.stats()['last']['batch_sizes'][0] == 130
    for sig in cell.signatures():
        assert sig.batch_safe, sig.reason
        ops = _ops(sig)
        assert not ops & {'SliceChannel', 'sigmoid', 'tanh', 'softsign'}, ops
        assert 'Activation' in ops


class Splits(gluon.HybridBlock):
    """Splits of every kind ``fast_forms`` meets: squeezed, along a
    negative axis, with an output nobody reads, one returned as it is, and
    one whose output feeds ``zeros_like`` (left a ``SliceChannel``)."""

    def __init__(self):
        super().__init__()
        with self.name_scope():
            self.dense = gluon.nn.Dense(12, in_units=4, flatten=False)

    def hybrid_forward(self, F, x):
        h = self.dense(x)                                       # (1, 2, 12)
        a, b, _ = F.split(h, num_outputs=3, axis=-1)            # (1, 2, 4) each, one unread
        c, d = F.split(h, num_outputs=2, axis=1, squeeze_axis=True)  # (1, 12) each
        e, f = F.split(F.tanh(h), num_outputs=2, axis=2)
        g = F.zeros_like(e) + f
        return [F.sigmoid(a) * b, F.relu(c - d), g], F.split(h, num_outputs=2, axis=2)[1]


@pytest.fixture
def programs_run(monkeypatch):
    """(calls, ops of the program run) of every step run."""
    from gluon_dynbatch import lower
    seen, for_rows = [], lower.StepProgram.for_rows

    def recording(program, calls):
        chosen = for_rows(program, calls)
        seen.append((calls, {node['op'] for node in json.loads(chosen.symbol.tojson())['nodes']}))
        return chosen
    monkeypatch.setattr(lower.StepProgram, 'for_rows', recording)
    return seen


@pytest.mark.parametrize('calls', [5, 20])
def test_split_forms_keep_values_and_gradients(calls, programs_run):
    """In training, steps of 5 calls run the block's own forms
    (trace.own_forms, below FAST_FORMS_ROWS), steps of 20 the fast ones."""
    block = dyb.DynBatchBlock(Splits())
    block.initialize(mx.init.Uniform(0.5))
    rng = np.random.RandomState(6)
    xs = [mx.nd.array(rng.uniform(-1, 1, (1, 2, 4))) for _ in range(calls)]

    def forward():
        outs = []
        for x in xs:
            inner, last = block(x)
            outs.extend(inner + [last])
        return outs
    for strategy in ('depth', 'per-sample'):
        assert_same(run_both(forward, [block], xs, strategy))
    (sig,) = block.signatures()
    assert sig.batch_safe, sig.reason
    nodes = json.loads(sig.symbol.tojson())['nodes']
    kept = [node for node in nodes if node['op'] == 'SliceChannel']
    assert len(kept) == 1 and any(n['op'] == 'zeros_like' for n in nodes), kept
    assert sum(node['op'] == 'slice_axis' for node in nodes) == 2 + 2 + 1
    assert sum(node['op'] == 'squeeze' for node in nodes) == 2
    assert calls in {rows for rows, _ in programs_run}
    for rows, ops in programs_run:      # per-sample runs steps of one call
        assert ('slice_axis' in ops) == (rows >= 16) and ('sigmoid' in ops) == (rows < 16), ops


class IntActivations(gluon.HybridBlock):
    def __init__(self):
        super().__init__()
        with self.name_scope():
            self.emb = gluon.nn.Embedding(10, 4)

    def hybrid_forward(self, F, idx):
        return self.emb(F.relu(idx)), F.sigmoid(idx * 3)


class ReluTanh(gluon.HybridBlock):
    def hybrid_forward(self, F, x):
        return F.relu(x) * 2 + F.tanh(x)


def test_fast_forms_keep_what_the_ops_did():
    """Found by a review of fast_forms: Activation refuses integers (an
    int32 id clamped by relu failed at the flush), MKLDNN's relu makes a
    NaN 0 (a diverging model's NaN loss came out finite), and a tanh made
    an Activation was then computed through sigmoid in large steps
    (tanh(1e-8) came out 0).  Integer and relu ops stay as they are, and
    a rewritten tanh keeps its values in a step of 600 calls."""
    block = dyb.DynBatchBlock(IntActivations())
    block.initialize()
    ids = [mx.nd.array([[k - 2]], dtype='int32') for k in range(4)]
    want = [out.asnumpy() for i in ids for out in block(i)]
    with dyb.batching('depth'):
        outs = [out for i in ids for out in block(i)]
    for got, expected in zip(outs, want):
        np.testing.assert_array_equal(got.asnumpy(), expected)

    block = dyb.DynBatchBlock(ReluTanh())
    xs = [mx.nd.array([[np.nan, 1.0, -1.0, 1e-8, 1e-6, 1e-4, 0.5]]) for _ in range(3)]
    xs += [mx.nd.array(np.random.RandomState(k).uniform(-1e-3, 1e-3, (1, 7)))
           for k in range(600)]
    results = run_both(lambda: [block(x) for x in xs], [block], xs, 'depth')
    assert dyb.stats()['last']['batch_sizes'] == [603]
    assert np.isnan(results[1][0][0][0, 0]) and np.isnan(results[1][2][0][0, 0])
    assert_same(results, rtol=1e-6, atol=0)
    (sig,) = block.signatures()
    assert {'relu', 'Activation'} <= _ops(sig) and 'tanh' not in _ops(sig)


class Concats(gluon.HybridBlock):
    """Concatenations along axes named from the back, which ``fast_forms``
    names from the front: of rows, and of (1, 2, 6) arrays."""

    def __init__(self):
        super().__init__()
        with self.name_scope():
            self.dense = gluon.nn.Dense(12, in_units=4, flatten=False)

    def hybrid_forward(self, F, x, y):
        h = self.dense(x)                                           # (1, 2, 12)
        rows = F.concat(F.sum(h, axis=1), y, dim=-1)                # (1, 12 + 3)
        wide = F.concat(h, F.tanh(h), dim=-2)                       # (1, 4, 12)
        wider = F.concat(h, h * 2, dim=-1)                          # (1, 2, 24)
        return rows, wide, wider


@pytest.mark.parametrize('calls', [5, 20])
def test_concat_forms_keep_values_and_gradients(calls):
    block = dyb.DynBatchBlock(Concats())
    block.initialize(mx.init.Uniform(0.5))
    rng = np.random.RandomState(7)
    xs = [mx.nd.array(rng.uniform(-1, 1, (1, 2, 4))) for _ in range(calls)]
    ys = [mx.nd.array(rng.uniform(-1, 1, (1, 3))) for _ in range(calls)]

    def forward():
        return [out for x, y in zip(xs, ys) for out in block(x, y)]
    for strategy in ('depth', 'per-sample'):
        assert_same(run_both(forward, [block], xs + ys, strategy))
    (sig,) = block.signatures()
    assert sig.batch_safe, sig.reason
    concats = [node for node in json.loads(sig.symbol.tojson())['nodes']
               if node['op'] == 'Concat']
    assert [node['attrs']['dim'] for node in concats] == ['1', '1', '2'], concats


class EmbeddingBesideRows(gluon.HybridBlock):
    """Concatenates an embedding of host ids (run once per distinct row)
    with a batched value along the last axis of rank 3 (found by a review:
    a rewrite of that concat into 2-d rows failed every flush)."""

    def __init__(self):
        super().__init__()
        with self.name_scope():
            self.emb = gluon.nn.Embedding(10, 4)

    def hybrid_forward(self, F, ids, h):
        return F.concat(self.emb(ids), h, dim=-1)


@pytest.mark.parametrize('strategy', ['depth', 'auto'])
def test_concat_of_host_rows_and_batched_rows(strategy):
    block = dyb.DynBatchBlock(EmbeddingBesideRows())
    block.initialize()
    ids = [np.array([[k % 2, 1, 2]], np.float32) for k in range(40)]
    hs = [mx.nd.full((1, 3, 5), k) for k in range(40)]
    want = [block(mx.nd.array(i), h).asnumpy() for i, h in zip(ids, hs)]
    for _ in range(2):
        with dyb.batching(strategy):
            outs = [block(i, h) for i, h in zip(ids, hs)]
        for got, expected in zip(outs, want):
            np.testing.assert_array_equal(got.asnumpy(), expected)


@pytest.mark.parametrize('make', [lambda: Splits(), lambda: gluon.rnn.LSTMCell(6, input_size=3),
                                  lambda: gluon.rnn.GRUCell(6, input_size=3)])
def test_own_forms_undo_fast_forms(make):
    """trace.own_forms, which steps of a few rows run, puts back the ops
    the block wrote (the same ops, inputs in the same order)."""
    from gluon_dynbatch import trace
    block = make()
    block.initialize()
    states = block.begin_state(batch_size=1) if hasattr(block, 'begin_state') else None
    args = [mx.sym.var('x')] + ([[mx.sym.var('s%d' % i) for i in range(len(states))]]
                                if states else [])
    out = block(*args)
    own = trace.unique_op_names(mx.sym.Group([o for o in _flat(out)]))
    shapes = {'x': (1, 3) if states else (1, 2, 4)}
    shapes.update({'s%d' % i: (1, 6) for i in range(len(states or []))})
    types = {name: np.float32 for name in shapes}
    fast = trace.fast_forms(own, shapes, types)

    def ops(symbol):
        return sorted(node['op'] for node in json.loads(symbol.tojson())['nodes'])
    assert ops(fast) != ops(own)
    back = trace.own_forms(fast)
    assert ops(back) == ops(own)
    assert back.list_inputs() == own.list_inputs()


def _flat(out):
    if isinstance(out, (list, tuple)):
        return [leaf for item in out for leaf in _flat(item)]
    return [out[i] for i in range(len(out.list_outputs()))]


class SplitSigmoid(gluon.HybridBlock):
    def hybrid_forward(self, F, x):
        a, b = F.split(x, num_outputs=2, axis=2)
        return F.sigmoid(a) * b


@pytest.mark.parametrize('calls', [2, 6])
def test_split_of_a_block_named_with_a_semicolon(calls):
    """A block's prefix is the user's: one holding a ';' broke the parse of
    the split's marks when a small step ran the block's own forms (found by
    a review: ValueError at the flush)."""
    block = dyb.DynBatchBlock(SplitSigmoid(prefix='enc;v2_'))
    xs = [mx.nd.array(np.random.RandomState(k).rand(1, 2, 4)) for k in range(calls)]
    want = [block(x).asnumpy() for x in xs]
    with dyb.batching('depth'):
        outs = [block(x) for x in xs]
    for got, expected in zip(outs, want):
        np.testing.assert_allclose(got.asnumpy(), expected, rtol=1e-6)
    from gluon_dynbatch import trace
    (sig,) = block.signatures()
    assert 'SliceChannel' in {node['op'] for node in
                              json.loads(trace.own_forms(sig.symbol).tojson())['nodes']}


class SplitRows(gluon.HybridBlock):
    def hybrid_forward(self, F, x):
        return F.split(x, num_outputs=1, axis=0) * 2


def test_split_along_the_batch_axis_stays_and_runs_per_sample():
    block = dyb.DynBatchBlock(SplitRows())
    xs = [mx.nd.array(np.full((1, 3), k, np.float32)) for k in range(3)]
    with dyb.batching('depth'):
        outs = [block(x) for x in xs]
    for x, out in zip(xs, outs):
        np.testing.assert_array_equal(out.asnumpy(), x.asnumpy() * 2)
    batch_safe, reason = _verdict(block)
    assert not batch_safe and 'SliceChannel' in reason, reason
    assert 'SliceChannel' in _ops(block.signatures()[0])


@pytest.mark.parametrize('strategy', ['depth', 'auto'])
@pytest.mark.parametrize('loss', ['L2Loss', 'L1Loss', 'SigmoidBinaryCrossEntropyLoss'])
def test_gluons_losses_batch(loss, strategy):
    """Gluon's losses reshape the label like the prediction
    (``reshape_like``), which had no rule: a loss wrapped as a block ran
    per sample.  Both batched, it batches; values and gradients (inputs'
    too) equal per-sample execution; a label shared by every call (a
    parameter of shape (1, 3)) still runs per sample."""
    block = dyb.DynBatchBlock(getattr(gluon.loss, loss)())
    rng = np.random.RandomState(3)
    preds = [mx.nd.array(rng.uniform(-1, 1, (1, 3))) for _ in range(5)]
    labels = [mx.nd.array(rng.uniform(0, 1, (1, 3))) for _ in range(5)]
    assert_same(run_both(lambda: [block(p, l) for p, l in zip(preds, labels)], [block],
                         preds + labels, strategy))
    assert all(sig.batch_safe for sig in block.signatures()), \
        [sig.reason for sig in block.signatures()]


class SharedLabelLoss(gluon.HybridBlock):
    def __init__(self):
        super().__init__()
        with self.name_scope():
            self.label = self.params.get('label', shape=(1, 3), init=mx.init.One())

    def hybrid_forward(self, F, pred, label):  # pylint: disable=arguments-differ
        return F.square(pred - F.reshape_like(label, pred))


def test_reshape_like_of_a_shared_input_runs_per_sample():
    block = dyb.DynBatchBlock(SharedLabelLoss())
    block.initialize()
    preds = [mx.nd.array(np.full((1, 3), k, np.float32)) for k in range(3)]
    assert_same(run_both(lambda: [block(p) for p in preds], [block], preds, 'depth'))
    batch_safe, reason = _verdict(block)
    assert not batch_safe and 'mixes batched and shared' in reason, reason


class PickSharedLabel(gluon.HybridBlock):
    """A per-sample ``(1, 4)`` score picked at a label shared by every
    sample, ``(1,)``."""

    def __init__(self):
        super().__init__()
        with self.name_scope():
            self.label = self.params.get('label', shape=(1,), init=mx.init.One(),
                                         grad_req='null')

    def hybrid_forward(self, F, scores, label):  # pylint: disable=arguments-differ
        return F.reshape(F.pick(scores, label), shape=(1, 1))


def test_pick_at_a_shared_label_runs_per_sample_naming_the_shapes():
    """Its reason said the inputs were 'of equal shape', which (1, 4) and
    (1,) are not (a user trial); it names them now."""
    block = dyb.DynBatchBlock(PickSharedLabel())
    block.initialize()
    xs = [mx.nd.array(np.arange(4, dtype=np.float32).reshape(1, 4) * k) for k in range(3)]
    assert_same(run_both(lambda: [block(x) for x in xs], [block], xs, 'depth'))
    batch_safe, reason = _verdict(block)
    assert not batch_safe
    assert 'pick mixes batched and shared inputs (shapes batched (1, 4), shared (1,))' \
        in reason, reason


class PlusSharedRow(gluon.HybridBlock):
    def __init__(self):
        super().__init__()
        with self.name_scope():
            self.v = self.params.get('v', shape=(1, 3), init=mx.init.Uniform(1.0))

    def hybrid_forward(self, F, x, v):  # pylint: disable=arguments-differ
        return x + v


def test_elementwise_op_of_a_shared_row_says_to_broadcast():
    block = dyb.DynBatchBlock(PlusSharedRow())
    block.initialize()
    xs = [mx.nd.array(np.full((1, 3), k, np.float32)) for k in range(3)]
    assert_same(run_both(lambda: [block(x) for x in xs], [block], xs, 'depth'))
    batch_safe, reason = _verdict(block)
    assert not batch_safe and 'mixes batched and shared' in reason, reason
    assert 'F.broadcast_add' in reason, reason


class Relu(gluon.HybridBlock):
    def hybrid_forward(self, F, x):
        return F.relu(x)


class SameChildTwice(gluon.HybridBlock):
    """Calls one child block twice: Gluon names both calls' ops alike.  The
    first ``sum`` (on a ``(1, 4)`` input) acts on the batch axis."""

    def __init__(self):
        super().__init__()
        with self.name_scope():
            self.act = Relu()

    def hybrid_forward(self, F, x, y):
        rows = F.sum(self.act(x), axis=-2, keepdims=True)
        return F.broadcast_add(x, rows) + F.sum(self.act(y), axis=-2)


def test_a_child_called_twice_is_judged_by_each_calls_shapes():
    """The batch-safety check found an op's input shape by the op's name;
    a child block called twice has its ops named alike, so the first
    call's ``sum`` was judged by the second's ``(1, 3, 4)`` input, the
    block taken for batch-safe and its batched values wrong (found by a
    fuzzer).  Ops now get names of their own when traced."""
    block = dyb.DynBatchBlock(SameChildTwice())
    block.initialize()
    rng = np.random.RandomState(0)
    calls = [(mx.nd.array(rng.rand(1, 4)), mx.nd.array(rng.rand(1, 3, 4))) for _ in range(5)]
    assert_same(run_both(lambda: [block(x, y) for x, y in calls], [block],
                         [a for call in calls for a in call], 'depth'))
    batch_safe, reason = _verdict(block)
    assert not batch_safe and 'sum acts on the batch axis' in reason, reason


class DropSum(gluon.HybridBlock):
    """``tanh(dense(x) + dropout(sum_k h_k))``: padding-neutral."""
    dynbatch_pad_lists = True

    def __init__(self):
        super().__init__()
        with self.name_scope():
            self.dense = gluon.nn.Dense(4, in_units=4)
            self.drop = gluon.nn.Dropout(0.5)

    def hybrid_forward(self, F, x, hs):
        if not hs:
            return F.tanh(self.dense(x))
        return F.tanh(self.dense(x) + self.drop(F.add_n(*hs) if len(hs) > 1 else hs[0]))


@pytest.mark.parametrize('kind', ['dropout', 'float64 tree-lstm'])
def test_pad_lists_gradient_check_passes_legitimate_blocks(kind):
    """The gradient comparison of the pad_lists check ran in training mode,
    so Dropout drew other masks for the two runs and refused a legitimate
    block; and MXNet cannot run the Tree-LSTM cell's backward there in
    float64, which failed the flush (found by a review): the comparison
    runs in predict mode and is skipped where MXNet cannot run it."""
    from gluon_dynbatch.models import ChildSumTreeLSTMCell
    if kind == 'dropout':
        block = dyb.DynBatchBlock(DropSum())
        block.initialize()
        dtype = 'float32'
    else:
        block = dyb.DynBatchBlock(ChildSumTreeLSTMCell(4, 4))
        block.initialize()
        block.cast('float64')
        dtype = 'float64'
    xs = [mx.nd.array(np.random.RandomState(i).rand(1, 4), dtype=dtype) for i in range(4)]

    def forward():
        if kind == 'dropout':
            a, c = block(xs[0], []), block(xs[1], [])
            return [block(xs[2], [a]), block(xs[3], [a, c])]
        a, c = block(xs[0], [], []), block(xs[1], [], [])
        return [block(xs[2], [a[0]], [a[1]])[0], block(xs[3], [a[0], c[0]], [a[1], c[1]])[0]]
    want = [o.asnumpy() for o in forward()]
    with dyb.batching('depth'):
        outs = forward()
    for got, expected in zip(outs, want):
        np.testing.assert_allclose(got.asnumpy(), expected, rtol=1e-5, atol=1e-6)


def test_padding_check_tolerance_scales_with_the_outputs():
    """Float rounding of large terms stays in an element that cancels to
    near zero: the numbers of a Tree-LSTM cell's ``c`` whose check failed
    with the block's own parameters under an absolute tolerance (the SICK
    example with an 8-d GloVe file stopped with a false pad_lists error).
    A real change, small against the largest output, still fails."""
    from gluon_dynbatch.block import _close
    a = np.array([[14.9, -0.030570239]], dtype=np.float32)
    assert _close(a, np.array([[14.9, -0.0305717]], dtype=np.float32))
    assert not _close(a, np.array([[14.9, -0.0302]], dtype=np.float32))
    assert not _close(a, np.array([[14.95, -0.030570239]], dtype=np.float32))


def test_padding_check_tolerance_answers_as_allclose_does():
    """``_close`` takes a shorter path for finite float arrays of one
    shape: it answers as the ``np.allclose`` it was written with, for
    equal and near values, NaNs and infinities, mixed dtypes and shapes,
    and leaves its arguments as they were; float16 values (either side)
    within FLOAT16_CLOSE when not wide."""
    from gluon_dynbatch.block import FLOAT16_CLOSE, _close

    def reference(a, b, wide):
        scale = 1e-9 if wide else FLOAT16_CLOSE if np.float16 in (a.dtype, b.dtype) else 1e-5
        atol = scale * np.nanmax(np.abs(a), initial=0.1)
        return np.allclose(a, b, rtol=scale, atol=atol, equal_nan=True)
    rng = np.random.RandomState(3)
    kinds = [np.float32, np.float64, np.float16]
    answers = set()
    for trial in range(3000):
        shape = [(1, 5), (3,), (0, 4), (2, 3, 2), (), (7,)][rng.randint(6)]
        a = (rng.uniform(-1, 1, shape) * 10 ** rng.uniform(-8, 6)).astype(kinds[trial % 3])
        near = rng.choice([0, 1e-10, 1e-9, 3e-9, 1e-7, 1e-6, 1e-5, 3e-5, 1e-3])
        b = a.astype(np.float64) * (1 + near * rng.uniform(-1, 1, shape)) \
            + near * rng.uniform(-1, 1, shape) * rng.choice([0, 0.1, 1])
        b = b.astype(kinds[rng.randint(3)] if trial % 7 == 0 else a.dtype)
        if rng.rand() < 0.1 and a.size:
            a.flat[0] = rng.choice([np.nan, np.inf, -np.inf])
        if rng.rand() < 0.1 and b.size:
            b.flat[-1] = rng.choice([np.nan, np.inf, -np.inf])
        if rng.rand() < 0.03:
            b = b.astype(np.int32)
        if rng.rand() < 0.03 and b.ndim:
            b = b[..., :1]
        before = a.copy(), b.copy()
        for wide in (False, True):
            with np.errstate(all='ignore'):
                want = reference(a, b, wide)
                assert _close(a, b, wide) == want, (a, b, wide)
            answers.add(want)
        np.testing.assert_array_equal(a, before[0])
        np.testing.assert_array_equal(b, before[1])
    assert answers == {True, False}


class MeanBesideLarge(gluon.HybridBlock):
    """``concat(1e6 (W x + sum_k h_k), mean_k h_k)``: with ``mean`` the
    pad_lists claim is false (a zero child changes the mean), with a sum
    it holds.  One output holds both parts, so a tolerance scaled to its
    largest value (~1e6) would not see the mean change.  With ``cast``
    the large part goes through a cast to float32 (nothing, in float32)."""
    dynbatch_pad_lists = True

    def __init__(self, mean, cast=False):
        super().__init__()
        self.mean, self.cast = mean, cast
        with self.name_scope():
            self.d = gluon.nn.Dense(4, in_units=4)

    def hybrid_forward(self, F, x, hs):
        total = F.add_n(*hs) if len(hs) > 1 else hs[0]
        small = total / len(hs) if self.mean else total
        large = (self.d(x) + total) * 1e6
        return F.concat(F.cast(large, 'float32') if self.cast else large, small, dim=1)


@pytest.mark.parametrize('mean', [True, False])
@pytest.mark.parametrize('cast', [False, True])
def test_padding_check_sees_small_values_beside_large_ones(mean, cast, capsys):
    """A false claim whose change hides beside a value of 1e6 in the same
    output (found by a fuzzer: batched results silently wrong) is refused,
    since the check runs the symbols in float64, a cast to float32 made a
    cast to float64 there (a second fuzzer found it kept the check in
    float32, and MXNet printing its type inference's failure); the same
    block with a sum passes and batches to the per-sample values."""
    block = dyb.DynBatchBlock(MeanBesideLarge(mean, cast))
    block.initialize(mx.init.Uniform(0.5))
    rng = np.random.RandomState(0)
    x = [mx.nd.array(rng.uniform(-1, 1, (1, 4))) for _ in range(3)]
    h = [mx.nd.array(rng.uniform(-1, 1, (1, 4))) for _ in range(4)]
    calls = [(x[0], h[:1]), (x[1], h[1:3]), (x[2], h[1:])]
    if mean:
        with pytest.raises(dyb.InputError, match=r'declares pad_lists.*changes its output 0 '
                                                 r'\(.*random parameters\)'):
            with dyb.batching('depth'):
                for a, hs in calls:
                    block(a, hs)
    else:
        want = [block(a, hs).asnumpy() for a, hs in calls]
        with dyb.batching('depth'):
            outs = [block(a, hs) for a, hs in calls]
        for got, expected in zip(outs, want):
            np.testing.assert_allclose(got.asnumpy(), expected, rtol=1e-5)
    assert 'infer_type' not in capsys.readouterr().out


@pytest.mark.parametrize('id_dtype', [np.float32, np.int32])
def test_padding_check_compares_gradients_in_float64(monkeypatch, id_dtype):
    """The check's gradients of a Tree-LSTM node (row-sparse embedding
    gradients too) come from float64 runs: MXNet 1.9.1's
    ``attach_grad(stype=...)`` made float32 gradient buffers, every float64
    backward failed, and the gradients fell back to float32 unseen.  With
    int32 token ids beside the float32 states too: the ids stay integers,
    the rest runs in float64 (calls of two dtypes ran in float32 alone)."""
    from gluon_dynbatch import block as block_module
    from gluon_dynbatch.models import TreeLSTMNode
    compared, close = [], block_module._close

    def recorded(a, b, wide=False):
        compared.append((a.dtype, wide))
        return close(a, b, wide)
    monkeypatch.setattr(block_module, '_close', recorded)
    for sparse in (False, True):
        node = dyb.DynBatchBlock(TreeLSTMNode(20, 6, 5, sparse_grad=sparse))
        node.initialize()
        ids = np.array([1], dtype=id_dtype)
        del compared[:]
        with dyb.batching('depth'):
            leaf = node(ids, [], [])
            node(ids, [leaf[0]], [leaf[1]])
            node(ids, [leaf[0], leaf[0]], [leaf[1], leaf[1]])
        wide = [dtype for dtype, is_wide in compared if is_wide]
        assert wide and all(dtype == np.float64 for dtype in wide)
        # outputs (2 a range) and gradients (parameters and list elements)
        assert len(wide) > 2 * len(block_module.PADDING_CHECK_RANGES)


class _PReLUOfArgument(gluon.HybridBlock):
    def hybrid_forward(self, F, x, slope):
        return F.LeakyReLU(x, slope, act_type='prelu')


def test_a_prelu_of_a_per_sample_slope_is_refused_in_its_own_terms():
    """The refusal named the ops prelu is computed from (``broadcast_mul``,
    ``reshape``), which the user never wrote (found by a fuzzer)."""
    block = dyb.DynBatchBlock(_PReLUOfArgument())
    with pytest.warns(dyb.PerSampleWarning, match=r"LeakyReLU \(.*act_type='prelu'\) reads a "
                                                  r"per-sample slope"):
        with dyb.batching('depth'):
            outs = [block(-mx.nd.ones((1, 4)), mx.nd.array([0.1 * k])) for k in range(3)]
    for k, out in enumerate(outs):
        np.testing.assert_allclose(out.asnumpy(), np.full((1, 4), -0.1 * k), rtol=1e-6)


def test_a_prelu_of_a_per_sample_slope_over_channels_batches():
    """Of a sample of rank 3, prelu's slope is reshaped to (1, -1, 1) to
    run along axis 1; a per-sample slope of one value, (1,), keeps its row
    there (the reshape's leading 1 made 0, see reshapes_keeping_rows), so
    the calls batch, each with its own slope: per-sample values and
    gradients, the slopes' too."""
    block = dyb.DynBatchBlock(_PReLUOfArgument())
    rng = np.random.RandomState(4)
    xs = [mx.nd.array(rng.uniform(-1, 1, (1, 2, 4))) for _ in range(3)]
    slopes = [mx.nd.array([0.1 * (k + 1)]) for k in range(3)]
    assert_same(run_both(lambda: [block(x, s) for x, s in zip(xs, slopes)], [block],
                         xs + slopes))
    assert dyb.stats()['last']['batch_sizes'] == [3]


def _safe(op):
    return None


@pytest.mark.parametrize('call, error, message', [
    (lambda: dyb.register_batching_rule(_safe), TypeError,
     r"takes operator names and returns the decorator.*got the function _safe"),
    (lambda: dyb.register_batching_rule('softmin', _safe), TypeError,
     r"takes operator names and returns the decorator"),
    (lambda: dyb.register_batching_rule(), TypeError, r'needs at least one operator name'),
    (lambda: dyb.register_batching_rule(3), TypeError, r'operator names are strings; got 3'),
    (lambda: dyb.register_batching_rule('hardsigmoid')(_safe), ValueError,
     r"'hardsigmoid' is no MXNet operator; did you mean 'hard_sigmoid'"),
    (lambda: dyb.register_batching_rule('hard_sigmoid')(42), TypeError,
     r"decorates a function rule\(op\) -> None \| str; got 42"),
])
def test_error_register_batching_rule_misuse(call, error, message, monkeypatch):
    """Found by a review: each of these registered nothing (or a misspelt
    name, or a rule that failed at trace), silently; the user saw the block
    run per sample for want of a rule."""
    from gluon_dynbatch import rules
    monkeypatch.setattr(rules, 'RULES', dict(rules.RULES))
    before = dict(rules.RULES)
    with pytest.raises(error, match=message):
        call()
    assert rules.RULES == before


class HardSigmoid(gluon.HybridBlock):
    def hybrid_forward(self, F, x):
        return F.hard_sigmoid(x)


@pytest.mark.parametrize('verdict', [True, False, 0, '', '  '])
def test_error_a_rule_returning_neither_none_nor_a_reason(verdict, monkeypatch):
    """A rule returning True became the reason 'True'; False, meant as
    'not safe', read as safe (found by a review); so did an empty reason
    (a user's trial)."""
    from gluon_dynbatch import rules
    monkeypatch.setattr(rules, 'RULES', dict(rules.RULES))
    monkeypatch.setattr('gluon_dynbatch.trace.batching_rule', rules.RULES.get)
    del rules.RULES['hard_sigmoid']         # (builtin now: registering it again would warn)
    dyb.register_batching_rule('hard_sigmoid')(lambda op: verdict)
    block = dyb.DynBatchBlock(HardSigmoid())
    with pytest.raises(dyb.InputError, match=r'the batching rule <lambda> for op hard_sigmoid '
                       r'returned %s: a rule returns None' % re.escape(repr(verdict))):
        with dyb.batching():
            block(mx.nd.ones((1, 4)))


class Readout(gluon.HybridBlock):
    """A dense layer over the mean of a list of states, joined on ``axis``."""

    def __init__(self, axis):
        super().__init__()
        self.axis = axis
        with self.name_scope():
            self.dense = gluon.nn.Dense(3, in_units=4)

    def hybrid_forward(self, F, hs):
        return self.dense(F.mean(F.stack(*hs, axis=self.axis), axis=self.axis))


def test_a_readout_stacked_on_axis_0_is_told_the_form_that_batches():
    """A readout that stacks per-sample states on axis 0 runs per sample;
    its reason (in the PerSampleWarning) names the form that batches,
    stacking on axis 1 (found by a user trial), and that form batches with
    per-sample results and gradients."""
    rng = np.random.RandomState(0)
    states = [mx.nd.array(rng.rand(1, 4)) for _ in range(12)]
    calls = [states[i:i + 3] for i in range(0, 12, 3)]
    for axis, safe in ((0, False), (1, True)):
        block = dyb.DynBatchBlock(Readout(axis))
        block.initialize(mx.init.Uniform(0.5))
        assert_same(run_both(lambda: [block(hs) for hs in calls], [block], states, 'depth'))
        batch_safe, reason = _verdict(block)
        assert batch_safe == safe, reason
        if not safe:
            assert 'rows stacked on axis 0' in reason      # time-major, for SequenceReverse
            assert 'to join per-sample rows' in reason
            assert 'F.mean(F.stack(*hs, axis=1), axis=1)' in reason
    assert dyb.stats()['last']['batch_sizes'] == [4]


class PerHeadLength(gluon.HybridBlock):
    """Two heads folded into axis 0, each scaled by the sample's length
    repeated per head: by ``F.repeat`` on axis 0 (``how='repeat'``), or by
    the form the refusal of that names."""

    def __init__(self, how):
        super().__init__()
        self.how = how
        with self.name_scope():
            self.dense = gluon.nn.Dense(4, in_units=4)

    def hybrid_forward(self, F, x, length):
        heads = self.dense(x).reshape((-1, 2, 2)).reshape((-3, 0))       # (2, 2) a sample
        if self.how == 'repeat':
            per_head = F.repeat(length, repeats=2, axis=0)
        else:
            per_head = F.broadcast_axis(F.expand_dims(length, axis=1), axis=1,
                                        size=2).reshape((-3, -2))
        return F.broadcast_mul(heads, per_head.reshape((-1, 1))).reshape((1, -1))


def test_a_repeat_on_axis_0_is_told_the_form_that_batches():
    """``repeat`` along axis 0 gives a sample more rows and runs per sample;
    its reason names a form that batches (a user trial's per-head lengths),
    and that form batches, matching per sample."""
    rng = np.random.RandomState(1)
    xs = [mx.nd.array(rng.rand(1, 4)) for _ in range(5)]
    lengths = [mx.nd.array([n + 1.0]) for n in range(5)]
    for how, safe in (('repeat', False), ('advised', True)):
        block = dyb.DynBatchBlock(PerHeadLength(how))
        block.initialize(mx.init.Uniform(0.5))
        assert_same(run_both(lambda: [block(x, n) for x, n in zip(xs, lengths)], [block],
                             xs + lengths, 'depth'))
        batch_safe, reason = _verdict(block)
        assert batch_safe == safe, reason
        if not safe:
            assert 'repeat acts on the batch axis (axis=0)' in reason
            assert 'F.broadcast_axis(F.expand_dims(x, axis=1), axis=1, size=n)' \
                '.reshape((-3, -2))' in reason
    assert dyb.stats()['last']['batch_sizes'] == [5]


class FusedEncoder(gluon.HybridBlock):
    """A sentence encoder on one of Gluon's fused recurrent layers (MXNet's
    ``RNN`` op, batch on axis 1) in ``layout='NTC'``: its outputs averaged
    over time, then a dense layer; with ``states``, it also takes its begin
    states per sample ((1, L*D, H), swapped to the layer's (L*D, 1, H))."""

    def __init__(self, mode, bidirectional=False, layers=1, states=False, dropout=0):
        super().__init__()
        self.mode, self.states = mode, states
        with self.name_scope():
            make = {'lstm': gluon.rnn.LSTM, 'gru': gluon.rnn.GRU, 'rnn_tanh': gluon.rnn.RNN}[mode]
            self.rnn = make(6, num_layers=layers, layout='NTC', input_size=3,
                            bidirectional=bidirectional, dropout=dropout)
            self.out = gluon.nn.Dense(4, in_units=12 if bidirectional else 6)

    def hybrid_forward(self, F, x, *states):
        if self.states:
            out, _ = self.rnn(x, [F.swapaxes(s, 0, 1) for s in states])
        else:
            out = self.rnn(x)
        return F.tanh(self.out(F.mean(out, axis=1)))


@pytest.mark.parametrize('strategy', ['depth', 'auto'])
@pytest.mark.parametrize('mode,bidirectional,layers', [
    ('lstm', False, 1), ('lstm', True, 2), ('gru', False, 2), ('gru', True, 1),
    ('rnn_tanh', False, 1)])
def test_gluons_fused_rnn_layers_batch(mode, bidirectional, layers, strategy):
    """Gluon's fused layers (``rnn.LSTM``, ``GRU``, ``RNN``) run MXNet's
    ``RNN`` op, which takes the batch on axis 1: a ``layout='NTC'`` layer
    swaps a sample's axes 0 and 1 around it, and that swap made every such
    block run per sample.  Sentences of 2 to 4 tokens: the calls of one
    length run as one step, and values and gradients (inputs' too) equal
    per-sample execution."""
    enc = dyb.DynBatchBlock(FusedEncoder(mode, bidirectional, layers))
    enc.initialize(mx.init.Uniform(0.5))
    rng = np.random.RandomState(3)
    xs = [mx.nd.array(rng.uniform(-1, 1, (1, length, 3))) for length in [2, 3, 2, 4, 3, 2, 4]]
    assert_same(run_both(lambda: [enc(x) for x in xs], [enc], xs, strategy))
    assert all(sig.batch_safe for sig in enc.signatures()), \
        [sig.reason for sig in enc.signatures()]
    assert sorted(dyb.stats()['last']['batch_sizes']) == [2, 2, 3]


def _sequences_with_states(seed, mode, state_shape):
    """Five calls' arguments, a (1, 3, 3) sequence and its begin states of
    ``state_shape`` (two for an LSTM, one otherwise), and all of them flat."""
    rng = np.random.RandomState(seed)
    count = 2 if mode == 'lstm' else 1
    args = [[mx.nd.array(rng.uniform(-1, 1, (1, 3, 3)))] +
            [mx.nd.array(rng.uniform(-1, 1, state_shape)) for _ in range(count)]
            for _ in range(5)]
    return args, [x for call in args for x in call]


@pytest.mark.parametrize('mode', ['lstm', 'gru'])
def test_fused_rnn_layer_with_begin_states_per_sample(mode):
    """Begin states given per sample, (1, L*D, H) each and swapped to the
    layer's (L*D, 1, H): batched on axis 1 beside the data."""
    enc = dyb.DynBatchBlock(FusedEncoder(mode, bidirectional=True, states=True))
    enc.initialize(mx.init.Uniform(0.5))
    args, inputs = _sequences_with_states(4, mode, (1, 2, 6))
    assert_same(run_both(lambda: [enc(*call) for call in args], [enc], inputs))
    assert dyb.stats()['last']['batch_sizes'] == [5]


class TimeMajorMisuse(gluon.HybridBlock):
    """Reads a value batched on axis 1 by an op other than RNN (``how``),
    or returns one."""

    def __init__(self, how):
        super().__init__()
        self.how = how
        with self.name_scope():
            self.rnn = gluon.rnn.GRU(5, layout='NTC', input_size=3)

    def hybrid_forward(self, F, x):
        if self.how == 'returns time-major':
            return F.swapaxes(x, 0, 1)
        if self.how == 'sums time-major':
            return F.sum(F.swapaxes(x, 0, 1), axis=0)
        if self.how == 'fixed begin state':    # batch 1 fixed: batched, other rows than N
            return self.rnn(x, F.zeros((1, 1, 5)))[0]
        return self.rnn(x)


@pytest.mark.parametrize('how,reason', [
    ('returns time-major', r'an output .* has its batch on axis 1'),
    ('sums time-major', r'op sum reads a value whose batch axis is 1'),
    ('fixed begin state', r'RNN takes its state shared')])
def test_values_batched_on_axis_1_are_refused_elsewhere(how, reason):
    """Outside swapaxes and RNN no rule knows a batch on axis 1: such
    blocks run per sample, saying why, and still give per-sample values
    (an output of shape (1, 1, 3) batched on axis 1: one of (4, 1, 3) is
    refused as every output without a leading axis of 1)."""
    block = dyb.DynBatchBlock(TimeMajorMisuse(how))
    block.initialize()
    steps = 1 if how == 'returns time-major' else 4
    xs = [mx.nd.random.uniform(shape=(1, steps, 3)) for _ in range(3)]
    want = [block.block(x).asnumpy() for x in xs]
    with pytest.warns(dyb.PerSampleWarning, match=reason):
        with dyb.batching('depth'):
            outs = [block(x) for x in xs]
    for out, expected in zip(outs, want):
        np.testing.assert_allclose(out.asnumpy(), expected, rtol=1e-5, atol=1e-6)


def test_rnn_dropout_draws_random_numbers():
    """A fused layer of two layers with dropout between them draws random
    numbers in training: its calls are never merged as repeats of equal
    arguments."""
    from gluon_dynbatch.trace import is_function_of_inputs
    block = dyb.DynBatchBlock(FusedEncoder('lstm', layers=2, dropout=0.5))
    block.initialize()
    plain = dyb.DynBatchBlock(FusedEncoder('lstm', layers=2))
    plain.initialize()
    x = mx.nd.ones((1, 2, 3))
    with dyb.batching('depth'):
        block(x), plain(x)
    assert [is_function_of_inputs(sig.symbol) for sig in block.signatures()] == [False]
    assert [is_function_of_inputs(sig.symbol) for sig in plain.signatures()] == [True]


class LengthsEncoder(gluon.HybridBlock):
    """A fused LSTM over a padded sequence with its length
    (``use_sequence_length``), as int32 beside the float32 data."""

    def __init__(self):
        super().__init__()
        with self.name_scope():
            self.rnn = gluon.rnn.LSTM(6, layout='NTC', input_size=3, use_sequence_length=True)

    def hybrid_forward(self, F, x, length):
        return F.sum(self.rnn(x, sequence_length=length), axis=1)


def test_fused_rnn_layer_with_a_length_per_sample():
    """Sequences padded to one length, each with its own length (int32,
    shape (1,)): one step for all, values and gradients as per sample."""
    enc = dyb.DynBatchBlock(LengthsEncoder())
    enc.initialize(mx.init.Uniform(0.5))
    rng = np.random.RandomState(0)
    xs = [mx.nd.array(rng.uniform(-1, 1, (1, 5, 3))) for _ in range(4)]
    lengths = [mx.nd.array([n], dtype='int32') for n in (5, 2, 3, 1)]
    assert_same(run_both(lambda: [enc(x, n) for x, n in zip(xs, lengths)], [enc], xs))
    assert [sig.batch_safe for sig in enc.signatures()] == [True]
    assert dyb.stats()['last']['batch_sizes'] == [4]


class AnyFused(gluon.HybridBlock):
    """A fused layer of any kind over a (1, T, 3) sequence, then a dense
    layer on its outputs at every position; with ``lengths``, a length per
    sample (``use_sequence_length``)."""

    def __init__(self, mode, hidden, layers, bidirectional, lengths):
        super().__init__()
        self.lengths = lengths
        with self.name_scope():
            if mode.startswith('rnn_'):
                self.rnn = gluon.rnn.RNN(hidden, num_layers=layers, activation=mode[4:],
                                         layout='NTC', input_size=3,
                                         bidirectional=bidirectional,
                                         use_sequence_length=lengths)
            else:
                self.rnn = {'lstm': gluon.rnn.LSTM, 'gru': gluon.rnn.GRU}[mode](
                    hidden, num_layers=layers, layout='NTC', input_size=3,
                    bidirectional=bidirectional, use_sequence_length=lengths)
            self.out = gluon.nn.Dense(2, flatten=False,
                                      in_units=hidden * (2 if bidirectional else 1))

    def hybrid_forward(self, F, x, *length):
        out = self.rnn(x, sequence_length=length[0]) if self.lengths else self.rnn(x)
        return self.out(out)


def test_fused_rnn_layers_batch_on_random_configurations():
    """Random fused layers (LSTM, GRU, relu and tanh RNN; 1-2 layers, one
    or two directions, with or without a length per sample) over random
    sequences of 1-4 steps: values and gradients (inputs' too) equal
    per-sample execution, and calls of one length share a step."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    @settings(max_examples=12, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(st.sampled_from(['lstm', 'gru', 'rnn_relu', 'rnn_tanh']), st.integers(1, 5),
           st.integers(1, 2), st.booleans(), st.booleans(),
           st.lists(st.integers(1, 4), min_size=1, max_size=6), st.integers(0, 2 ** 16))
    def check(mode, hidden, layers, bidirectional, lengths, steps, seed):
        lengths = lengths and mode == 'lstm'    # (see the test below)
        block = dyb.DynBatchBlock(AnyFused(mode, hidden, layers, bidirectional, lengths))
        block.initialize(mx.init.Uniform(0.5))
        rng = np.random.RandomState(seed)
        if lengths:     # padded to the longest, each with its own length
            longest = max(steps)
            calls = [[mx.nd.array(rng.uniform(-1, 1, (1, longest, 3))),
                      mx.nd.array([n], dtype='int32')] for n in steps]
        else:
            calls = [[mx.nd.array(rng.uniform(-1, 1, (1, n, 3)))] for n in steps]
        xs = [call[0] for call in calls]
        assert_same(run_both(lambda: [block(*call) for call in calls], [block], xs))
        assert all(sig.batch_safe for sig in block.signatures())
        assert len(dyb.stats()['last']['batch_sizes']) == len(block.signatures())

    check()


@pytest.mark.parametrize('mode', ['gru', 'rnn_tanh'])
def test_fused_gru_with_lengths_fails_to_trace_naming_gluons_limit(mode):
    """Gluon 1.9.1's fused GRU and RNN layers with ``use_sequence_length``
    fail hybridized ('Keyword argument name state_cell not found'), so
    traced too, though they run eagerly: the error says so, not that the
    same call fails outside a scope."""
    block = dyb.DynBatchBlock(AnyFused(mode, 2, 1, False, True))
    block.initialize()
    x, length = mx.nd.ones((1, 3, 3)), mx.nd.array([2], dtype='int32')
    assert block(x, length).shape == (1, 3, 2)      # outside a scope: eager Gluon
    with pytest.raises(dyb.InputError, match=r'fused GRU and RNN layers with '
                                             r'use_sequence_length=True run eagerly only'):
        with dyb.batching('depth'):
            block(x, length)


class TimeMajorSequences(gluon.HybridBlock):
    """A (1, T, C) sequence swapped time-major, reversed by its length
    (``SequenceReverse``) or masked past it (``SequenceMask``), swapped
    back, then a dense layer at every step."""

    def __init__(self, op):
        super().__init__()
        self.op = op
        with self.name_scope():
            self.dense = gluon.nn.Dense(4, in_units=3, flatten=False)

    def hybrid_forward(self, F, x, length):
        steps = F.swapaxes(self.dense(x), 0, 1)
        if self.op == 'SequenceReverse':
            steps = F.SequenceReverse(steps, length, use_sequence_length=True)
        else:
            steps = F.SequenceMask(steps, length, use_sequence_length=True, value=-2)
        return F.tanh(F.swapaxes(steps, 0, 1))


@pytest.mark.parametrize('op', ['SequenceReverse', 'SequenceMask'])
def test_time_major_sequence_ops_batch_with_lengths(op):
    """``SequenceReverse`` (whose one time axis is axis 0) and the
    time-major ``SequenceMask`` take a batch on axis 1 after swapaxes: one
    step for all calls, values and gradients as per sample."""
    block = dyb.DynBatchBlock(TimeMajorSequences(op))
    block.initialize(mx.init.Uniform(0.5))
    rng = np.random.RandomState(6)
    xs = [mx.nd.array(rng.uniform(-1, 1, (1, 5, 3))) for _ in range(4)]
    lengths = [mx.nd.array([n]) for n in (5, 1, 3, 2)]
    assert_same(run_both(lambda: [block(x, n) for x, n in zip(xs, lengths)], [block], xs))
    assert [sig.batch_safe for sig in block.signatures()] == [True]
    assert dyb.stats()['last']['batch_sizes'] == [4]


class TokenEncoder(gluon.HybridBlock):
    """Token ids (host data, (1, 3) float32) embedded and read by a fused
    layer in ``layout='NTC'``: with ``states``, a GRU from a begin state
    per sample ((1, 1, 4), swapped to the layer's (1, 1, 4)); else a
    two-layer LSTM with dropout between its layers."""

    def __init__(self, states):
        super().__init__()
        self.states = states
        with self.name_scope():
            self.emb = gluon.nn.Embedding(10, 3)
            self.rnn = gluon.rnn.GRU(4, layout='NTC', input_size=3) if states else \
                gluon.rnn.LSTM(4, num_layers=2, dropout=0.3, layout='NTC', input_size=3)

    def hybrid_forward(self, F, ids, *state):
        if self.states:
            return self.rnn(self.emb(ids), F.swapaxes(state[0], 0, 1))[0]
        return F.mean(self.rnn(self.emb(ids)), axis=1)


@pytest.mark.parametrize('strategy', ['depth', 'cached'])
@pytest.mark.parametrize('states', [True, False])
def test_host_part_ends_before_a_value_batched_on_axis_1(states, strategy):
    """Steps whose host rows (token ids) repeat run the ops on host data
    alone once per distinct row, and hand their values to the rest by a
    ``take`` along axis 0.  A fused layer's swapped input, batched on axis
    1, read by an RNN that takes a begin state per sample or draws random
    numbers (dropout, even in inference), was such a value: the take cut
    rows of time steps, and the flush failed in MXNet (found by a
    review).  The part now ends before the swap."""
    block = dyb.DynBatchBlock(TokenEncoder(states))
    block.initialize(mx.init.Uniform(0.5))
    rng = np.random.RandomState(7)
    rows = [np.array([[1, 2, 3]], 'float32'), np.array([[4, 5, 6]], 'float32')]
    ids = [rows[i % 2] for i in range(12)]
    if states:
        hs = [mx.nd.array(rng.uniform(-1, 1, (1, 1, 4))) for _ in ids]
        assert_same(run_both(lambda: [block(i, h) for i, h in zip(ids, hs)], [block], hs,
                             strategy))
    else:       # (dropout draws in training: compared in inference)
        want = [block.block(mx.nd.array(i)).asnumpy() for i in ids]
        for _ in range(2):
            with dyb.batching(strategy):
                outs = [block(i) for i in ids]
            for out, expected in zip(outs, want):
                np.testing.assert_allclose(out.asnumpy(), expected, rtol=1e-5, atol=1e-6)
    assert [sig.batch_safe for sig in block.signatures()] == [True]


class OpenStateReadTwice(gluon.HybridBlock):
    """A GRU from a begin state of ones whose batch dimension is left open
    ((1, 0, 4), as a fused layer's default zeros), scaled by the sum of
    that state: per sample 4, batched N x 4."""

    def __init__(self):
        super().__init__()
        with self.name_scope():
            self.rnn = gluon.rnn.GRU(4, layout='NTC', input_size=3)

    def hybrid_forward(self, F, x):
        state = F.ones((1, 0, 4))
        return F.broadcast_mul(self.rnn(x, state)[0], F.sum(state))


def test_open_begin_state_read_by_another_op_runs_per_sample():
    """An RNN's begin state of an open batch dimension batches when RNN
    ops alone read it; another reader would see every sample's rows of it
    batched (the sum above gave N times the per-sample outputs, found by a
    review): such a block runs per sample, saying why."""
    inner = OpenStateReadTwice()
    inner.initialize(mx.init.Uniform(0.5))
    inner.hybridize()       # (an open shape runs symbolically only)
    block = dyb.DynBatchBlock(inner)
    rng = np.random.RandomState(8)
    xs = [mx.nd.array(rng.uniform(-1, 1, (1, 2, 3))) for _ in range(4)]
    with pytest.warns(dyb.PerSampleWarning, match='begin state of an open batch dimension'):
        assert_same(run_both(lambda: [block(x) for x in xs], [block], xs))
    assert [sig.batch_safe for sig in block.signatures()] == [False]


class FinalStates(gluon.HybridBlock):
    """A fused layer from begin states per sample ((1, L*D, H) each,
    swapped to the layer's (L*D, 1, H)), returning its outputs and its
    final states swapped back to (1, L*D, H)."""

    def __init__(self, mode):
        super().__init__()
        with self.name_scope():
            make = {'lstm': gluon.rnn.LSTM, 'gru': gluon.rnn.GRU}[mode]
            self.rnn = make(3, num_layers=2, layout='NTC', input_size=3, bidirectional=True)

    def hybrid_forward(self, F, x, *states):
        out, final = self.rnn(x, [F.swapaxes(s, 0, 1) for s in states])
        return [out] + [F.swapaxes(s, 0, 1) for s in final]


@pytest.mark.parametrize('mode', ['lstm', 'gru'])
def test_fused_layer_final_states_swapped_back_batch(mode):
    """A fused layer's final states (RNN's ``state_output`` and
    ``statecell_output``) are batched on axis 1 and batch swapped back.
    The tracer found no shape for them (it looked them up as
    ``output1``/``output2``), so the block ran per sample, saying that a
    swapaxes back to axis 0 was not one (found by a review)."""
    block = dyb.DynBatchBlock(FinalStates(mode))
    block.initialize(mx.init.Uniform(0.5))
    args, inputs = _sequences_with_states(9, mode, (1, 4, 3))
    assert_same(run_both(lambda: [out for call in args for out in block(*call)], [block],
                         inputs))
    assert [sig.batch_safe for sig in block.signatures()] == [True], \
        [sig.reason for sig in block.signatures()]
    assert dyb.stats()['last']['batch_sizes'] == [5]


class BidirectionalUnroll(gluon.HybridBlock):
    """Gluon's BidirectionalCell unrolled over a (1, 5, 3) sentence, its
    begin states passed per sample; with lengths it reverses the steps by
    ``SequenceReverse`` of a ``stack`` on axis 0, then ``split`` back."""

    def __init__(self, lengths):
        super().__init__()
        self.lengths = lengths
        with self.name_scope():
            self.bi = gluon.rnn.BidirectionalCell(gluon.rnn.LSTMCell(4, input_size=3),
                                                  gluon.rnn.GRUCell(4, input_size=3))

    def hybrid_forward(self, F, x, length, h):
        outs, _ = self.bi.unroll(5, x, begin_state=[h, h, h], layout='NTC',
                                 merge_outputs=True,
                                 valid_length=length if self.lengths else None)
        return outs


@pytest.mark.parametrize('lengths', [False, True])
def test_bidirectional_cell_unrolled_with_lengths_batches(lengths):
    """A user trial found BidirectionalCell.unroll with valid_length run per
    sample: Gluon stacks the steps on axis 0 (time-major, the batch moved to
    axis 1) for SequenceReverse and splits them back, and stack refused
    axis 0.  Such a stack and split now move the batch to axis 1 and back:
    one step, per-sample values and gradients (masked steps included)."""
    block = dyb.DynBatchBlock(BidirectionalUnroll(lengths))
    block.initialize(mx.init.Uniform(0.5))
    rng = np.random.RandomState(3)
    xs = [mx.nd.array(rng.uniform(-1, 1, (1, 5, 3))) for _ in range(4)]
    ns = [mx.nd.array([n]) for n in (5, 1, 3, 2)]
    h = mx.nd.zeros((1, 4))
    assert_same(run_both(lambda: [block(x, n, h) for x, n in zip(xs, ns)], [block], xs))
    assert [sig.batch_safe for sig in block.signatures()] == [True]
    assert dyb.stats()['last']['batch_sizes'] == [4]


class TimeMajorTranspose(gluon.HybridBlock):
    """A (1, T, 3) sample made time-major by ``how`` and made back into
    (1, 4, T) channels-first by a transpose, as gluonnlp's
    ConvolutionalEncoder reads its TNC input, then convolved."""

    def __init__(self, how):
        super().__init__()
        self.how = how
        with self.name_scope():
            self.conv = gluon.nn.Conv1D(4, 2, in_channels=3)

    def hybrid_forward(self, F, x):
        tnc = F.swapaxes(x, 0, 1) if self.how == 'swapaxes' else \
            F.transpose(x, axes=(1, 0, 2))
        return F.max(self.conv(F.transpose(tnc, axes=(1, 2, 0))), axis=2)


@pytest.mark.parametrize('how', ['swapaxes', 'transpose'])
def test_transpose_moves_a_batch_between_axes_0_and_1(how):
    """gluonnlp's ConvolutionalEncoder takes TNC input and transposes it to
    NCT, which ran per sample ('transpose reads a value whose batch axis is
    1').  A transpose that puts the batch axis first or second moves it
    there: one step, per-sample values and gradients."""
    block = dyb.DynBatchBlock(TimeMajorTranspose(how))
    block.initialize(mx.init.Uniform(0.5))
    rng = np.random.RandomState(4)
    xs = [mx.nd.array(rng.uniform(-1, 1, (1, 5, 3))) for _ in range(3)]
    assert_same(run_both(lambda: [block(x) for x in xs], [block], xs))
    assert [sig.batch_safe for sig in block.signatures()] == [True]


class StackedTimeMajorMisuse(gluon.HybridBlock):
    """Rows stacked on axis 0 (time-major), then read across time."""

    def hybrid_forward(self, F, x, y):    # pylint: disable=arguments-differ
        steps = F.stack(x, y, axis=0)                 # (2, 1, 3)
        return F.transpose(F.sum(steps, axis=0, keepdims=True), axes=(1, 0, 2))


def test_stack_on_axis_0_is_refused_where_read_across_time():
    """The batch that ``stack`` on axis 0 moves to axis 1 is still refused
    by any op that no rule lets read it (a sum over the steps): per sample,
    with the reason, and per-sample values."""
    block = dyb.DynBatchBlock(StackedTimeMajorMisuse())
    xs = [mx.nd.random.uniform(shape=(1, 3)) for _ in range(3)]
    want = [block.block(x, 2 * x).asnumpy() for x in xs]
    with pytest.warns(dyb.PerSampleWarning,
                      match=r'op sum reads per-sample rows stacked on axis 0'):
        with dyb.batching('depth'):
            outs = [block(x, 2 * x) for x in xs]
    for out, expected in zip(outs, want):
        np.testing.assert_allclose(out.asnumpy(), expected, rtol=1e-6)


class DefaultStates(gluon.HybridBlock):
    """A cell (``kind``) unrolled over a (1, 4, 3) sentence with its
    default begin states, zeros whose rows are left open, ``(0, 5)``."""

    def __init__(self, kind, lengths=False):
        super().__init__()
        self.kind, self.lengths = kind, lengths
        with self.name_scope():
            if kind == 'bidirectional':
                self.cell = gluon.rnn.BidirectionalCell(gluon.rnn.LSTMCell(5, input_size=3),
                                                        gluon.rnn.GRUCell(5, input_size=3))
            elif kind == 'stacked':
                self.cell = gluon.rnn.HybridSequentialRNNCell()
                with self.cell.name_scope():
                    self.cell.add(gluon.rnn.LSTMCell(5, input_size=3))
                    self.cell.add(gluon.rnn.RNNCell(5, input_size=5, activation='tanh'))
            else:
                self.cell = getattr(gluon.rnn, kind)(5, input_size=3)

    def hybrid_forward(self, F, x, length):
        outs, states = self.cell.unroll(4, x, layout='NTC', merge_outputs=True,
                                        valid_length=length if self.lengths else None)
        # (with lengths the final states are SequenceLast's, which has no rule)
        return [outs] + ([] if self.lengths else list(states))


@pytest.mark.parametrize('kind,lengths', [('LSTMCell', False), ('GRUCell', False),
                                          ('RNNCell', False), ('stacked', False),
                                          ('bidirectional', False), ('LSTMCell', True),
                                          ('bidirectional', True)])
def test_cells_unrolled_from_their_default_states_batch(kind, lengths):
    """A user trial found ``cell.unroll(T, x)`` without begin states run per
    sample: Gluon's default states are zeros of open rows, (0, H), which
    were taken for shared, so the first step's h2h "mixed batched and
    shared inputs".  Such zeros take one row per sample: one step, and the
    values and gradients of per-sample execution (final states too)."""
    block = dyb.DynBatchBlock(DefaultStates(kind, lengths))
    block.initialize(mx.init.Uniform(0.5))
    rng = np.random.RandomState(5)
    xs = [mx.nd.array(rng.uniform(-1, 1, (1, 4, 3))) for _ in range(4)]
    ns = [mx.nd.array([n]) for n in (4, 1, 3, 2)]

    def forward():
        return [out for x, n in zip(xs, ns) for out in block(x, n)]
    assert_same(run_both(forward, [block], xs))
    assert [sig.batch_safe for sig in block.signatures()] == [True], \
        [sig.reason for sig in block.signatures()]
    assert dyb.stats()['last']['batch_sizes'] == [4]


class OpenRows(gluon.HybridBlock):
    """Constants of open rows, ``(0, 3)`` (``F.zeros``, ``F.ones``), that
    MXNet infers only in a symbol (the block is hybridized): rows inferred
    from a (1, 3) parameter (``'parameter'``: one row whatever the batch),
    or from the per-sample input while a sum over every axis reads them
    too (``'sum'``: per sample 3, batched it would grow with the rows)."""

    def __init__(self, how):
        super().__init__()
        self.how = how
        with self.name_scope():
            self.bias = self.params.get('bias', shape=(1, 3))

    def hybrid_forward(self, F, x, bias):
        if self.how == 'parameter':
            return F.broadcast_add(x, F.zeros(shape=(0, 3)) + bias)
        ones = F.ones(shape=(0, 3))
        return F.broadcast_mul(x, F.sum(ones)) + ones * x


@pytest.mark.parametrize('how,safe', [('parameter', True), ('sum', False)])
def test_open_rows_count_as_batched_where_they_follow_the_batch(how, safe):
    """Constants of open rows count as batched only where MXNet gives them
    the batch's rows (inferred again for two samples): rows inferred from a
    parameter keep one (shared, and the block batches); rows inferred from
    the per-sample input make a sum over every axis of them a sum over the
    batch axis, which its rule refuses (batched, it would grow with the
    rows).  Per-sample values either way."""
    batch_safe, reason = _open_rows_verdict(OpenRows(how))
    assert batch_safe == safe, reason
    if not safe:
        assert 'sum' in reason, reason


def _open_rows_verdict(inner):
    """The verdict on hybridized ``inner``, after checking per-sample values
    and gradients on three calls."""
    block = dyb.DynBatchBlock(inner)
    block.initialize(mx.init.Uniform(0.5))
    block.hybridize()
    rng = np.random.RandomState(6)
    xs = [mx.nd.array(rng.uniform(-1, 1, (1, 3))) for _ in range(3)]
    assert_same(run_both(lambda: [block(x) for x in xs], [block], xs))
    return _verdict(block)


class OpenRowsOfTwo(gluon.HybridBlock):
    """``zeros(shape=(0, 3))`` whose rows a parameter of ``rows`` rows gives,
    summed over those rows: a value shared by every sample."""

    def __init__(self, rows):
        super().__init__()
        with self.name_scope():
            self.w = self.params.get('w', shape=(rows, 3))

    def hybrid_forward(self, F, x, w):
        return F.broadcast_add(x, F.sum(F.zeros(shape=(0, 3)) + w, axis=0, keepdims=True))


@pytest.mark.parametrize('rows', [1, 2, 3])
def test_open_rows_of_a_parameter_of_two_rows_stay_shared(rows):
    """Constants of open rows counted as batched where inferred again for
    two samples they had two rows; rows from a (2, 3) parameter have two
    either way, so the block ran per sample ('elemwise_add sees a batched
    input of shape (2, 3)'), as those of (1, 3) or (3, 3) did not.  One
    row per sample is asked too: every row count batches, with per-sample
    values and gradients."""
    assert _open_rows_verdict(OpenRowsOfTwo(rows)) == (True, '')


class OpenRowsOnHostAndDevice(gluon.HybridBlock):
    """One ``zeros(shape=(0, 3))`` added to an embedding of host token ids
    and to a device input."""

    def __init__(self):
        super().__init__()
        with self.name_scope():
            self.embed = gluon.nn.Embedding(5, 3)

    def hybrid_forward(self, F, ids, x):
        zeros = F.zeros(shape=(0, 3))
        return F.tanh(self.embed(ids) + zeros) * 2, x + zeros


@pytest.mark.parametrize('strategy', ['depth', 'agenda', 'auto'])
def test_open_rows_read_on_host_rows_and_the_batch(strategy):
    """A constant of open rows read by an op on host token ids alone and by
    one on a device input: with repeated ids (12 calls, 2 ids) lower's host
    part ran on the distinct ids, and the one zeros node had to take 2 rows
    there and 12 for the device input (MXNet failed, 'expected [12,3], got
    [2,3]').  Such a node now ends the host part: per-sample values and
    gradients."""
    block = dyb.DynBatchBlock(OpenRowsOnHostAndDevice())
    block.initialize(mx.init.Uniform(0.5))
    block.hybridize()
    rng = np.random.RandomState(8)
    ids = [np.array([k % 2], np.float32) for k in range(12)]
    xs = [mx.nd.array(rng.uniform(-1, 1, (1, 3))) for _ in range(12)]
    assert_same(run_both(lambda: [out for i, x in zip(ids, xs) for out in block(i, x)],
                         [block], xs, strategy=strategy))
    assert _verdict(block) == (True, '')


class PickBest(gluon.HybridBlock):
    """The best score of a ragged list, read by ``pick`` at its ``argmax``:
    padding with zeros changes it wherever every real score is negative."""
    dynbatch_pad_lists = True

    def hybrid_forward(self, F, items):
        scores = F.concat(*[F.sum(item, axis=1, keepdims=True) for item in items], dim=1)
        return F.pick(scores, F.argmax(scores, axis=1), axis=1)


class MaskedMinAndPoint(gluon.HybridBlock):
    """A target position's score plus the ``min`` over the list masked past
    its length (to 0): padding changes the min where the length is the
    whole list and every score is positive."""
    dynbatch_pad_lists = True

    def hybrid_forward(self, F, length, target, items):
        scores = F.concat(*[F.sum(item, axis=1, keepdims=True) for item in items], dim=1)
        masked = F.SequenceMask(scores, length, use_sequence_length=True, axis=1)
        return F.pick(scores, target, axis=1) + F.min(masked, axis=1)


@pytest.mark.parametrize('which', ['argmax', 'whole list'])
def test_pad_lists_positions_drawn_keep_the_check_whole(which):
    """Drawing pick's positions as whole numbers must not weaken the rest of
    the check (a fuzzer's cases, both batched wrong values): the list's
    scores, under pick through ``argmax``, were drawn as whole numbers from 0,
    never negative, so a pick at the argmax passed; and one range for
    lengths and positions, the least of their largest values, never drew the
    whole list's length (nor any, 0, beside a list of 1), so a min over a
    list masked past its length passed.  Both are now refused."""
    block = dyb.DynBatchBlock(PickBest() if which == 'argmax' else MaskedMinAndPoint())
    block.initialize()
    rng = np.random.RandomState(0)
    low = -2 if which == 'argmax' else 0.5
    lists = [[mx.nd.array(rng.uniform(low, low + 1, (1, 3))) for _ in range(n)]
             for n in (1, 3, 2, 4)]
    with pytest.raises(dyb.InputError, match=r'declares pad_lists.*changes its output 0'):
        with dyb.batching('depth'):
            for items in lists:
                n = np.array([len(items)], np.float32)
                block(items) if which == 'argmax' else block(n, n - 1, items)


class MaskedMaxOfProducts(gluon.HybridBlock):
    """The ``max`` over a list of ``item * x`` masked past its length (to 0):
    padding changes it where the length is the whole list and every product
    of a column is negative."""
    dynbatch_pad_lists = True

    def hybrid_forward(self, F, x, length, items):
        products = F.stack(*[item * x for item in items], axis=1)
        masked = F.SequenceMask(products, F.cast(length, 'int32'), use_sequence_length=True,
                                axis=1, value=0)
        return F.max(masked, axis=1) + x


def test_pad_lists_whole_lengths_keep_the_random_draws():
    """Lengths drawn at their largest in three ranges must not change what
    the random range draws: skipped there, the random range's lengths were
    other than before those ranges came, and this block over lists of 3 and
    4 (width 4), refused before, passed the check and batched wrong values
    (a fuzzer's case).  Drawn and set aside, the check refuses every pair of
    list lengths it refused before, and more."""
    block = dyb.DynBatchBlock(MaskedMaxOfProducts())
    block.initialize()
    rng = np.random.RandomState(0)
    x = mx.nd.array(rng.uniform(-1, 1, (1, 4)))
    with pytest.raises(dyb.InputError, match=r'declares pad_lists.*changes its output 0'):
        with dyb.batching('depth'):
            for n in (3, 4):
                block(x, mx.nd.array([n]), [mx.nd.array(rng.uniform(-1, 1, (1, 4)))
                                           for _ in range(n)])
