"""Shared test helpers: random trees, and the batched-vs-per-sample check."""
import os
import subprocess
import sys

import mxnet as mx
import numpy as np
import pytest
from mxnet import autograd

import gluon_dynbatch as dyb


class DenseAddLists(mx.gluon.HybridBlock):
    """``dense(x)`` plus half of every array of its list argument, whose
    elements may be arrays or lists of arrays (a list of lists)."""

    def __init__(self):
        super().__init__()
        with self.name_scope():
            self.dense = mx.gluon.nn.Dense(3, in_units=3)

    def hybrid_forward(self, F, x, items):
        out = self.dense(x)
        for item in items:
            for y in (item if isinstance(item, (list, tuple)) else [item]):
                out = out + y * 0.5
        return out


class TanhDense(mx.gluon.HybridBlock):
    """``tanh(dense(x))``: the smallest trained block."""

    def __init__(self, width=4, **kwargs):
        super().__init__(**kwargs)
        with self.name_scope():
            self.dense = mx.gluon.nn.Dense(width, in_units=width)

    def hybrid_forward(self, F, x):
        return F.tanh(self.dense(x))


class TwoOutputs(mx.gluon.HybridBlock):
    """Two outputs from two inputs."""

    def __init__(self):
        super().__init__()
        with self.name_scope():
            self.dense = mx.gluon.nn.Dense(4, in_units=4)

    def hybrid_forward(self, F, x, y):
        z = self.dense(x) * y
        return F.tanh(z), F.relu(z) + x


class InputPlusState(mx.gluon.HybridBlock):
    """``tanh(x + W h)``: a per-sample input added to a trained term, as an
    RNN cell adds its input's projection."""

    def __init__(self, units):
        super().__init__()
        with self.name_scope():
            self.w = mx.gluon.nn.Dense(units, in_units=units, use_bias=False)

    def hybrid_forward(self, F, x, h):
        return F.Activation(x + self.w(h), act_type='tanh')


class AcrossBatch(mx.gluon.HybridBlock):
    """Normalises over axis 0: correct per sample, wrong if rows were merged."""
    def __init__(self):
        super().__init__()
        with self.name_scope():
            self.dense = mx.gluon.nn.Dense(3, in_units=3)

    def hybrid_forward(self, F, x):
        y = self.dense(x)
        return F.broadcast_sub(y, F.mean(y, axis=0, keepdims=True)) + y


class Gate:
    """A custom op that copies its input once ``OPEN`` (a
    ``threading.Event``) is set: it stays in flight under a threaded engine
    until the test lets it finish.  Use it as ``mx.nd.Custom(x,
    op_type=Gate.OP_TYPE)`` (registered below)."""
    OPEN = None
    OP_TYPE = 'dynbatch_test_gate'


def _copy_once_open(x):
    assert Gate.OPEN.wait(30)
    return x


def register_custom_op(op_type, forward):
    """Register ``op_type``: a custom op of one input, whose output of the
    same shape is ``forward(x)`` (x an NDArray; it may raise, when MXNet
    runs the op) and whose backward passes the gradient through.  Use it as
    ``F.Custom(x, op_type=op_type)``; returns ``op_type``."""
    class _Op(mx.operator.CustomOp):
        def forward(self, is_train, req, in_data, out_data, aux):
            self.assign(out_data[0], req[0], forward(in_data[0]))

        def backward(self, req, out_grad, in_data, out_data, in_grad, aux):
            self.assign(in_grad[0], req[0], out_grad[0])

    @mx.operator.register(op_type)
    class _Prop(mx.operator.CustomOpProp):       # pylint: disable=unused-variable
        def __init__(self):
            super().__init__(need_top_grad=True)

        def infer_shape(self, in_shape):
            return in_shape, [in_shape[0]], []

        def create_operator(self, ctx, shapes, dtypes):
            return _Op()

    return op_type


register_custom_op(Gate.OP_TYPE, _copy_once_open)


def follow_engine(monkeypatch, first, check, most, marker_done, next_=None, tail=0):
    """Make scopes that open now follow the engine (as under a threaded
    engine with the C extension), with small PIPELINE_FIRST / NEXT (by
    default ``first``) / CHECK / CALLS / TAIL (by default 0: parts run
    whatever size this thread's last scope had, which starts unknown), and
    ``marker_done(marker)`` saying whether the engine has run the last part;
    skips the test without the extension's markers."""
    import threading
    from gluon_dynbatch import accel, block
    if accel.push_marker is None:
        pytest.skip(accel.STATUS)
    monkeypatch.setattr(block, '_SIZES', threading.local())
    monkeypatch.setattr(block, 'PIPELINE_TAIL', tail)
    monkeypatch.setattr(block, 'threaded_engine', lambda: True)
    monkeypatch.setattr(block, 'PIPELINE_FIRST', first)
    monkeypatch.setattr(block, 'PIPELINE_NEXT', first if next_ is None else next_)
    monkeypatch.setattr(block, 'PIPELINE_CHECK', check)
    monkeypatch.setattr(block, 'PIPELINE_CALLS', most)
    monkeypatch.setattr(accel, 'marker_done', marker_done)


class Tree:
    __slots__ = ('idx', 'children')

    def __init__(self, idx, children=None):
        self.idx = idx
        self.children = children or []


def random_tree(rng, size, max_arity=8):
    """A random tree of ``size`` nodes with at most ``max_arity`` children."""
    nodes = [Tree(0)]
    for i in range(1, size):
        candidates = [n for n in nodes if len(n.children) < max_arity]
        child = Tree(i)
        candidates[rng.randint(len(candidates))].children.append(child)
        nodes.append(child)
    return nodes[0]


def tree_from_parents(parents):
    """Tree from 0-based parent indices (-1 = root), nodes numbered 0..n-1."""
    nodes = [Tree(i) for i in range(len(parents))]
    root = None
    for i, p in enumerate(parents):
        if p < 0:
            root = nodes[i]
        else:
            nodes[p].children.append(nodes[i])
    return root


def param_grads(*blocks):
    out = {}
    for block in blocks:
        for name, param in block.collect_params().items():
            if param.grad_req != 'null':
                out[name] = param.grad().asnumpy().copy()
    return out


def run_both(forward, blocks, inputs=(), strategy='depth', flush_every='auto',
             merge_repeats=True, train_mode=True):
    """Run ``forward(batched)`` per sample and batched under autograd
    (``autograd.record(train_mode)``).

    ``forward`` returns a list of output NDArrays (batched: ``.data`` of lazy
    values is taken here).  Returns ``[(outputs, grads, input_grads)]`` for the
    per-sample run and the batched run, with a fixed random weighting of the
    outputs as the loss so that every output row matters."""
    results = []
    for batched in (False, True):
        for x in inputs:
            x.attach_grad()
        with autograd.record(train_mode):
            if batched:
                with dyb.batching(strategy, flush_every=flush_every,
                                  merge_repeats=merge_repeats):
                    outs = forward()
                outs = [o.data if isinstance(o, dyb.LazyValue) else o for o in outs]
            else:
                outs = forward()
            rng = np.random.RandomState(1)
            loss = sum((o * mx.nd.array(rng.uniform(-1, 1, o.shape))).sum() for o in outs)
        loss.backward()
        results.append(([o.asnumpy() for o in outs], param_grads(*blocks),
                        [x.grad.asnumpy().copy() for x in inputs]))
    return results


def assert_same(results, rtol=1e-4, atol=1e-5):
    (out_a, grad_a, in_a), (out_b, grad_b, in_b) = results
    assert len(out_a) == len(out_b)
    for a, b in zip(out_a, out_b):
        np.testing.assert_allclose(b, a, rtol=rtol, atol=atol)
    assert grad_a.keys() == grad_b.keys()
    for name in grad_a:
        np.testing.assert_allclose(grad_b[name], grad_a[name], rtol=rtol, atol=atol,
                                   err_msg=name)
    for a, b in zip(in_a, in_b):
        np.testing.assert_allclose(b, a, rtol=rtol, atol=atol)


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_benchmark(script, *args):
    """Run ``benchmarks/<script>`` with ``args`` in a fresh interpreter (so it
    sets MXNet's engine and threads itself); assert it succeeded and return
    the finished process."""
    proc = subprocess.run([sys.executable, os.path.join(ROOT, 'benchmarks', script)]
                          + [str(a) for a in args],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, '%s failed:\n%s\n%s' % (script, proc.stdout[-4000:],
                                                        proc.stderr[-4000:])
    return proc


def sick_available():
    """True when the SICK data can be found (for skipif marks)."""
    from gluon_dynbatch.data.sick import find_sick_dir
    try:
        find_sick_dir()
    except FileNotFoundError:
        return False
    return True


needs_sick = pytest.mark.skipif(not sick_available(), reason='SICK data not found (see '
                                'gluon_dynbatch.data.sick.find_sick_dir)')
"""Mark for tests that read the SICK data."""
