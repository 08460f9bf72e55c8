"""FusedAdaGrad updates exactly as MXNet's AdaGrad (bit for bit without
weight decay, to float rounding with it), through a gluon Trainer, with its
C kernel for dense CPU gradients and without it."""
import os
import subprocess
import sys

import mxnet as mx
import numpy as np
import pytest
from mxnet import autograd, gluon
from mxnet.gluon import nn

from gluon_dynbatch import optim    # importing the package registers 'fusedadagrad'
from gluon_dynbatch.execute import threaded_engine, to_device
from gluon_dynbatch.optim import FusedAdaGrad

from helpers import Gate

KERNEL = optim.KERNEL
needs_kernel = pytest.mark.skipif(KERNEL is None, reason='the _adagrad C extension is not built')


needs_in_job = pytest.mark.skipif(not optim.in_job_addresses(),
                                  reason='the kernel does not read addresses in its jobs here')


@pytest.fixture(params=['in-job', 'after-wait', 'ops'])
def way(request, monkeypatch):
    """Every test runs with dense CPU gradients updated by the C kernel,
    whose jobs read their arrays' addresses (the default) or which waits for
    every pending op and reads them first, and by MXNet's
    ``sparse.adagrad_update`` (the kernel turned off)."""
    if request.param != 'ops' and KERNEL is None:
        pytest.skip('the _adagrad C extension is not built')
    if request.param == 'in-job' and not optim.in_job_addresses():
        pytest.skip('the kernel does not read addresses in its jobs here')
    if request.param == 'after-wait':
        monkeypatch.setattr(optim, 'IN_JOB_ADDRESSES', False)
    if request.param == 'ops':
        monkeypatch.setattr(optim, 'KERNEL', None)
    return request.param


def _model(sparse_grad):
    # the same parameter names in every model: gluon.Trainer sorts a dict of
    # parameters by name (so the optimizer's state indices follow names),
    # and global names (dense9, dense10) order two models differently
    net = nn.HybridSequential(prefix='net_')
    with net.name_scope():
        net.add(nn.Embedding(50, 8, sparse_grad=sparse_grad),
                nn.Dense(6, in_units=8, flatten=False), nn.Dense(1, in_units=6, flatten=False))
    net.initialize(mx.init.Uniform(0.5))
    return net


def _train(optimizer, opts, sparse_grad, steps=4, embed_wd_mult=1.0):
    """Weights and AdaGrad histories after ``steps`` steps on fixed data;
    each step's tokens touch only some rows of the embedding (all-zero rows
    in a dense gradient)."""
    mx.random.seed(3)
    net = _model(sparse_grad)
    net[0].weight.wd_mult = embed_wd_mult
    trainer = gluon.Trainer(net.collect_params(), optimizer, dict(opts))
    rng = np.random.RandomState(5)
    for _ in range(steps):
        tokens = mx.nd.array(rng.randint(0, 12, size=(3, 4)))
        with autograd.record():
            loss = (net(tokens) ** 2).sum()
        loss.backward()
        trainer.step(3)
    weights = [p.data().asnumpy() for p in net.collect_params().values()]
    updater = trainer._updaters[0]  # pylint: disable=protected-access
    histories = {i: s.asnumpy() for i, s in updater.states.items()}
    return weights, histories


def _reference(weight, grad, lr=0.5, eps=1e-7):
    return weight - (grad / np.sqrt(grad * grad + np.float32(eps))) * np.float32(lr)


def _args(weight, grad, history, lr=0.5):
    """A kernel request: the three arrays' handles, then ``lr``, eps, no
    rescale, no clip, no weight decay."""
    return (weight.handle.value, grad.handle.value, history.handle.value, lr, 1e-7, 1.0, -1.0,
            1.0)


@pytest.mark.parametrize('sparse_grad', [False, True])
def test_every_update_is_the_fused_op(sparse_grad, way, monkeypatch):
    """No update falls back to AdaGrad's own (multi-op) path; with the
    kernel, only row-sparse gradients (the embedding's, with
    ``sparse_grad``) reach ``sparse.adagrad_update``."""
    def refuse(*_):
        raise AssertionError('AdaGrad.update called')
    monkeypatch.setattr(mx.optimizer.AdaGrad, 'update', refuse)
    storages = []
    mxnet_op = mx.nd.sparse.adagrad_update

    def counted(weight, grad, *args, **kwargs):
        storages.append(grad.stype)
        return mxnet_op(weight, grad, *args, **kwargs)
    monkeypatch.setattr(mx.nd.sparse, 'adagrad_update', counted)
    _train('fusedadagrad', {'learning_rate': 0.1, 'wd': 0.01}, sparse_grad)
    if way != 'ops':
        assert storages == ['row_sparse'] * (4 if sparse_grad else 0)
    else:
        assert len(storages) == 4 * 5       # steps x parameters


def test_kernel_status_says_which_update_runs_and_why(monkeypatch):
    """``kernel_status()`` names the C kernel while it is in use, else
    MXNet's update and why: ``optim.KERNEL`` set to None, or (in a process
    with ``GLUON_DYNBATCH_PURE_PYTHON`` set) the kernel turned off."""
    assert (optim.kernel_status() == 'C kernel') == (KERNEL is not None)
    monkeypatch.setattr(optim, 'KERNEL', None)
    if KERNEL is not None:
        assert optim.kernel_status() == ("MXNet's sparse.adagrad_update "
                                         "(optim.KERNEL was set to None)")
    env = dict(os.environ, GLUON_DYNBATCH_PURE_PYTHON='1')
    out = subprocess.run([sys.executable, '-c', 'import gluon_dynbatch.optim as o; '
                          'print(o.KERNEL is None, o.kernel_status())'],
                         env=env, capture_output=True, text=True, check=True).stdout
    assert out.strip() == ("True MXNet's sparse.adagrad_update "
                           "(GLUON_DYNBATCH_PURE_PYTHON is set)")


@needs_kernel
def test_kernel_refuses_what_it_cannot_update():
    """Mismatched shapes, row-sparse gradients and other dtypes are left to
    MXNet's path (the kernel says so, and pushes nothing)."""
    weight, history = mx.nd.ones((4, 3)), mx.nd.zeros((4, 3))
    before = weight.asnumpy()
    cases = [mx.nd.ones((3, 4)), mx.nd.ones((4, 3)).tostype('row_sparse'),
             mx.nd.ones((4, 3), dtype='float64')]
    for grad in cases:
        assert KERNEL.update_many([_args(weight, grad, history, 0.1)]) == [False]
    grad, history16 = mx.nd.ones((4, 3)), mx.nd.zeros((4, 3), dtype='float16')
    assert KERNEL.update_many([_args(weight, grad, history16, 0.1)]) == [False]
    np.testing.assert_array_equal(weight.asnumpy(), before)
    np.testing.assert_array_equal(history.asnumpy(), 0)


@needs_kernel
def test_kernel_waits_for_the_gradient_and_is_waited_for():
    """Pushed to MXNet's engine: it runs after the op that writes the
    gradient, and a read of the weight right after it sees the update."""
    weight, history = mx.nd.ones((64, 32)), mx.nd.zeros((64, 32))
    grad = mx.nd.zeros((64, 32))
    source = mx.nd.random.uniform(shape=(64, 2048))
    mx.nd.dot(source, mx.nd.ones((2048, 32)), out=grad)     # in flight under a threaded engine
    assert KERNEL.update_many([_args(weight, grad, history)]) == [True]
    g = grad.asnumpy()
    np.testing.assert_array_equal(history.asnumpy(), g * g)
    np.testing.assert_array_equal(weight.asnumpy(), _reference(np.float32(1), g))


@pytest.mark.parametrize('sparse_grad', [False, True])
@pytest.mark.parametrize('opts', [{'learning_rate': 0.1},
                                  {'learning_rate': 0.3, 'clip_gradient': 0.05},
                                  {'learning_rate': 0.1, 'eps': 1e-3}])
def test_same_bits_as_adagrad_without_weight_decay(sparse_grad, opts, way):
    ours = _train('fusedadagrad', opts, sparse_grad)
    theirs = _train('adagrad', opts, sparse_grad)
    for i, weight in enumerate(theirs[0]):
        np.testing.assert_array_equal(ours[0][i], weight, err_msg='parameter %d' % i)
    for index in theirs[1]:
        np.testing.assert_array_equal(ours[1][index], theirs[1][index])


@pytest.mark.parametrize('sparse_grad', [False, True])
def test_weight_decay_decays_every_row_as_dense_adagrad_does(sparse_grad, way):
    """MXNet's AdaGrad decays every weight (dense gradients; it refuses
    wd != 0 with a row-sparse one); ours too, rows without a gradient
    included (it scales the weight before the update), whatever the
    gradient's storage."""
    opts = {'learning_rate': 0.1, 'wd': 0.05}
    ours = _train('fusedadagrad', opts, sparse_grad)
    theirs = _train('adagrad', opts, sparse_grad=False)
    for i, weight in enumerate(theirs[0]):
        np.testing.assert_allclose(ours[0][i], weight, rtol=1e-6, atol=1e-7,
                                   err_msg='parameter %d' % i)
    for index in theirs[1]:
        np.testing.assert_allclose(ours[1][index], theirs[1][index], rtol=1e-5)


def test_the_update_really_moves_the_weights(way):
    before = _train('fusedadagrad', {'learning_rate': 0.1}, sparse_grad=False, steps=0)[0]
    after = _train('fusedadagrad', {'learning_rate': 0.1}, sparse_grad=False)[0]
    for i, weight in enumerate(before):
        assert not np.array_equal(weight, after[i]), 'parameter %d' % i


@needs_kernel
def test_kernel_updates_the_rows_a_row_sparse_cast_keeps():
    """Rows of zeros and of negative zeros are left alone, rows with a NaN
    are updated (to NaN), exactly as after ``tostype('row_sparse')``."""
    grad = np.array([[0, 0, 0], [-0.0, 0, -0.0], [0, np.nan, 0], [0, 0, 2], [1, -1, 3]],
                    dtype=np.float32)
    results = []
    for kernel in (KERNEL, None):
        weight, history = mx.nd.array(np.arange(15).reshape(5, 3)), mx.nd.ones((5, 3))
        optimizer = FusedAdaGrad(learning_rate=0.1)
        saved = optim.KERNEL
        optim.KERNEL = kernel
        try:
            optimizer.update(0, weight, mx.nd.array(grad), history)
        finally:
            optim.KERNEL = saved
        results.append((weight.asnumpy(), history.asnumpy()))
    (w_kernel, h_kernel), (w_ops, h_ops) = results
    np.testing.assert_array_equal(w_kernel, w_ops)
    np.testing.assert_array_equal(h_kernel, h_ops)
    start = np.arange(15, dtype=np.float32).reshape(5, 3)
    np.testing.assert_array_equal(w_kernel[:2], start[:2])
    np.testing.assert_array_equal(h_kernel[:2], 1)
    assert np.isnan(w_kernel[2]).any()
    assert (w_kernel[3:] != start[3:]).any(axis=1).all()



@needs_kernel
@pytest.mark.skipif(not threaded_engine(), reason='ops run at once under the NaiveEngine')
@pytest.mark.parametrize('in_job', [False, True])
def test_kernel_updates_a_history_whose_zeros_op_is_in_flight(in_job):
    """A Trainer's first step makes AdaGrad's history with ``zeros``, whose
    memory MXNet allocates when the op runs; an address read from Python
    while it runs was another buffer in ~14% of 20,000 tries (both threads
    allocated), and an update there read garbage (NaN weights in loaded
    SICK training runs).  ``update_many`` waits for the ops on its arrays
    first; ``update_many_async``'s job reads the address once ``zeros``
    has run."""
    if in_job and not optim.in_job_addresses():
        pytest.skip('the kernel does not read addresses in its jobs here')
    push = KERNEL.update_many_async if in_job else KERNEL.update_many
    grad = mx.nd.array(np.linspace(-1, 1, 300 * 60, dtype=np.float32).reshape(300, 60))
    g = grad.asnumpy()
    for _ in range(300):
        weight = mx.nd.ones((300, 60))
        history = mx.nd.zeros((300, 60))              # in flight
        assert push([_args(weight, grad, history)]) == [True]
        np.testing.assert_array_equal(history.asnumpy(), g * g)
        np.testing.assert_array_equal(weight.asnumpy(), _reference(np.float32(1), g))
    assert KERNEL.failed_jobs() == 0


@needs_kernel
@pytest.mark.skipif(not threaded_engine(), reason='ops run at once under the NaiveEngine')
def test_kernel_reads_addresses_only_once_no_op_on_the_arrays_is_in_flight():
    """Seen from the host: a gradient that an in-flight ``dot`` writes into
    memory numpy owns holds the result as soon as the update is pushed."""
    host = np.zeros((256, 32), np.float32)
    grad = to_device(host, mx.cpu())      # over ``host``'s memory: no copy
    weight, history = mx.nd.ones((256, 32)), mx.nd.zeros((256, 32))
    source = mx.nd.random.uniform(shape=(256, 8192))
    mx.nd.dot(source, mx.nd.ones((8192, 32)), out=grad)     # in flight
    assert KERNEL.update_many([_args(weight, grad, history)]) == [True]
    assert (host > 1000).all(), 'the update was pushed before the dot writing its gradient ran'
    np.testing.assert_array_equal(history.asnumpy(), host * host)


@needs_kernel
@pytest.mark.parametrize('in_job', [True, False])
def test_a_trainer_step_pushes_its_dense_updates_in_one_call(in_job, monkeypatch):
    """The Updater hands FusedAdaGrad a step's updates together, and they
    reach the kernel in one call: ``update_many_async`` (no wait) or
    ``update_many`` (one wait for the backward pass); what the kernel
    refuses (a row-sparse gradient) takes MXNet's op, and the result is
    still AdaGrad's."""
    if in_job and not optim.in_job_addresses():
        pytest.skip('the kernel does not read addresses in its jobs here')
    calls = []

    class Spy:
        failed_jobs = staticmethod(KERNEL.failed_jobs)

        @staticmethod
        def update_many(requests):
            pushed = KERNEL.update_many(requests)
            calls.append(('update_many', len(requests), sum(pushed)))
            return pushed

        @staticmethod
        def update_many_async(requests):
            pushed = KERNEL.update_many_async(requests)
            calls.append(('update_many_async', len(requests), sum(pushed)))
            return pushed
    monkeypatch.setattr(optim, 'KERNEL', Spy)
    monkeypatch.setattr(optim, 'IN_JOB_ADDRESSES', in_job)
    ours = _train('fusedadagrad', {'learning_rate': 0.1}, sparse_grad=True, steps=3)
    assert calls == [('update_many_async' if in_job else 'update_many', 5, 4)] * 3
    theirs = _train('adagrad', {'learning_rate': 0.1}, sparse_grad=True, steps=3)
    for i, weight in enumerate(theirs[0]):
        np.testing.assert_array_equal(ours[0][i], weight, err_msg='parameter %d' % i)


@needs_kernel
def test_update_many_says_which_it_pushed():
    weight, history = mx.nd.ones((4, 3)), mx.nd.zeros((4, 3))
    good, wrong_shape = mx.nd.ones((4, 3)), mx.nd.ones((3, 4))
    args = (0.5, 1e-7, 1.0, -1.0, 1.0)
    assert KERNEL.update_many([]) == []
    assert KERNEL.update_many([
        (weight.handle.value, wrong_shape.handle.value, history.handle.value) + args,
        (weight.handle.value, good.handle.value, history.handle.value) + args]) == [False, True]
    np.testing.assert_array_equal(history.asnumpy(), 1)
    with pytest.raises(TypeError):
        KERNEL.update_many([(weight.handle.value,)])


# -------------------------------------------------------- addresses in the job

@needs_in_job
@pytest.mark.skipif(not threaded_engine(), reason='ops run at once under the NaiveEngine')
def test_in_job_update_does_not_wait_for_the_gradient():
    """Pushing returns while the op that writes the gradient is still in
    flight; the update then runs after it, on its values."""
    import threading
    Gate.OPEN = threading.Event()
    g = np.random.RandomState(1).randn(32, 16).astype(np.float32)
    weight, history = mx.nd.ones((32, 16)), mx.nd.zeros((32, 16))
    grad = mx.nd.Custom(mx.nd.array(g), op_type=Gate.OP_TYPE)
    try:
        assert KERNEL.update_many_async([_args(weight, grad, history)]) == [True]
        assert not Gate.OPEN.is_set()      # returned with the gradient's op blocked
    finally:
        Gate.OPEN.set()
    np.testing.assert_array_equal(history.asnumpy(), g * g)
    np.testing.assert_array_equal(weight.asnumpy(), _reference(np.float32(1), g))


def _mkldnn_layout(array):
    """Whether MKLDNN holds ``array`` in a layout of its own (MXNet then
    refuses to hand out its default-layout data)."""
    mx.nd.waitall()
    try:
        array.to_dlpack_for_read()
    except mx.base.MXNetError:
        return True
    return False


@needs_in_job
@pytest.mark.skipif(not mx.runtime.Features().is_enabled('MKLDNN'),
                    reason='MXNet built without MKLDNN')
def test_in_job_update_of_a_weight_an_inference_convolution_reordered():
    """An inference Convolution leaves its weight in MKLDNN's layout; the
    job brings it back to the default one before it updates it (reading
    its address the usual way would wait inside the job for ever)."""
    conv = nn.Conv2D(16, 3, in_channels=16)
    conv.initialize(mx.init.Uniform(0.5))
    conv(mx.nd.ones((2, 16, 8, 8)))
    weight = conv.weight.data()
    assert _mkldnn_layout(weight), 'this MXNet no longer reorders the weight: test moot'
    w = weight.asnumpy()
    g = np.random.RandomState(2).randn(*w.shape).astype(np.float32)
    grad, history = mx.nd.array(g), mx.nd.zeros(w.shape)
    assert KERNEL.update_many_async([_args(weight, grad, history)]) == [True]
    np.testing.assert_array_equal(weight.asnumpy(), _reference(w, g))
    assert not _mkldnn_layout(weight)
    assert KERNEL.failed_jobs() == 0


@needs_in_job
def test_in_job_update_outlives_the_handles_it_was_given():
    """The arrays Python passed may be gone before the job runs: it holds
    handles of its own, and the update lands in their memory."""
    weight, history = mx.nd.ones((256, 32)), mx.nd.zeros((256, 32))
    view = weight.reshape((32, 256))        # the same memory, another handle
    source, ones = mx.nd.random.uniform(shape=(256, 4096)), mx.nd.ones((4096, 32))
    grad = mx.nd.dot(source, ones)          # in flight under a threaded engine
    assert KERNEL.update_many_async([_args(weight, grad, history)]) == [True]
    del weight, grad, history
    mx.nd.waitall()
    g = source.asnumpy().sum(axis=1, keepdims=True) * np.ones((1, 32), np.float32)
    np.testing.assert_allclose(view.asnumpy().reshape(256, 32), _reference(np.float32(1), g),
                               rtol=1e-6)


def _train_conv(optimizer, rounds=3):
    """Weights after rounds of (train step, inference pass): the inference
    Convolution reorders its weight, the next training step undoes it."""
    mx.random.seed(4)
    net = nn.HybridSequential()
    net.add(nn.Conv2D(8, 3, in_channels=4), nn.Dense(3))
    net.initialize(mx.init.Uniform(0.5))
    trainer = gluon.Trainer(net.collect_params(), optimizer, {'learning_rate': 0.1})
    rng = np.random.RandomState(6)
    for _ in range(rounds):
        x = mx.nd.array(rng.randn(2, 4, 6, 6))
        with autograd.record():
            loss = (net(x) ** 2).sum()
        loss.backward()
        trainer.step(2)
        net(mx.nd.array(rng.randn(2, 4, 6, 6)))            # inference, nothing waits
    # The last inference Convolution, queued, reorders its weight to MKLDNN's
    # layout when it runs; asnumpy() waits for writes, not for such a read,
    # and raced it in MXNet itself ("We can't generate TBlob for MKLDNN
    # data", whatever the optimizer; seen once in a full run).
    mx.nd.waitall()
    return [p.data().asnumpy() for p in net.collect_params().values()]


@pytest.mark.skipif(KERNEL is None, reason='the _adagrad C extension is not built')
def test_training_with_inference_in_between_is_adagrads(way):
    """Steps that nothing waits for, interleaved with inference passes
    that change the Convolution weight's layout, give AdaGrad's weights."""
    ours, theirs = _train_conv('fusedadagrad'), _train_conv('adagrad')
    for i, weight in enumerate(theirs):
        np.testing.assert_allclose(ours[i], weight, rtol=1e-6, atol=1e-7,
                                   err_msg='parameter %d' % i)
    if way != 'ops':
        assert KERNEL.failed_jobs() == 0


def test_an_op_that_failed_before_the_step_is_reported(way):
    """An op of the forward pass that fails when it runs (an index out of
    range) raises MXNet's error, at the step or at the next read, whichever
    way the update runs (under the NaiveEngine, at the op itself).  Waiting
    for it in the kernel had swallowed it: the step fell back to the op,
    and nothing was ever raised."""
    net = nn.Dense(3, in_units=4)
    net.initialize()
    trainer = gluon.Trainer(net.collect_params(), 'fusedadagrad', {'learning_rate': 0.1})
    with pytest.raises(mx.base.MXNetError, match='out of bound'):
        with autograd.record():
            rows = mx.nd.take(net(mx.nd.ones((2, 4))), mx.nd.array([7]), axis=0, mode='raise')
            loss = (rows * rows).sum()
        loss.backward()
        trainer.step(2)
        net.weight.data().asnumpy()


def test_takes_adagrads_arguments_as_adagrad_does():
    """``eps`` may come first, as in ``mx.optimizer.AdaGrad(eps)`` (a
    TypeError before, found by a review)."""
    opt = optim.FusedAdaGrad(1e-6, learning_rate=0.1)
    assert opt.float_stable_eps == 1e-6 and opt.lr == 0.1
    assert optim.FusedAdaGrad().float_stable_eps == mx.optimizer.AdaGrad().float_stable_eps


@pytest.mark.parametrize('opts,match', [
    ({'clip_gradient': -1}, r"clip_gradient=-1; give a bound >= 0 on each gradient element's "
                            r"magnitude, or None \(no clipping\)"),
    ({'clip_gradient': float('nan')}, 'clip_gradient=nan'),
    ({'clip_gradient': '0.1'}, "clip_gradient='0.1'"),
    ({'eps': 'x'}, r"eps='x'; give a finite number >= 0 \(the history's initial value"),
    ({'eps': -1e-7}, 'eps=-1e-07'),
    ({'eps': float('inf')}, 'eps=inf'),
    ({'learning_rate': '0.1'}, r"learning_rate='0.1'; give a finite number, or None"),
    ({'learning_rate': float('nan')}, 'learning_rate=nan'),
    ({'wd': None}, 'wd=None; give a finite number'),
    ({'rescale_grad': True}, 'rescale_grad=True')])
def test_error_hyperparameters_named_when_made(opts, match):
    """``clip_gradient=-1`` meant "no clipping" to the C kernel (its own
    "off") where MXNet's AdaGrad clips to inverted bounds; ``eps='x'``
    failed at the first update with a raw ctypes TypeError (found by a
    review).  Refused when the optimizer is made, by a Trainer too."""
    with pytest.raises(ValueError, match='FusedAdaGrad: ' + match):
        FusedAdaGrad(**opts)
    with pytest.raises(ValueError, match='FusedAdaGrad: ' + match):
        gluon.Trainer(_model(False).collect_params(), 'fusedadagrad', opts)


@pytest.mark.parametrize('opts', [{'learning_rate': -0.1, 'clip_gradient': float('inf')},
                                  {'learning_rate': np.float32(0.2), 'eps': 0.001,
                                   'clip_gradient': np.float64(0.05)},
                                  {'learning_rate': 1, 'clip_gradient': 0, 'wd': 0}])
def test_what_adagrad_takes_sensibly_still_updates_as_adagrad(opts, way):
    """The values the checks let through (numpy scalars, ints, a negative
    learning rate, clipping at 0 or infinity) update as MXNet's AdaGrad
    does, to the bit."""
    ours = _train('fusedadagrad', opts, sparse_grad=False)
    theirs = _train('adagrad', opts, sparse_grad=False)
    for i, weight in enumerate(theirs[0]):
        np.testing.assert_array_equal(ours[0][i], weight, err_msg='parameter %d' % i)
