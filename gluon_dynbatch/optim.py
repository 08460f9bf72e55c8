"""AdaGrad with each parameter's update as one fused MXNet op.

Once batching has cut the forward and backward of a small minibatch to a few
milliseconds, the optimizer step is a large share of a training step.
MXNet 1.9.1's :class:`mxnet.optimizer.AdaGrad` updates a parameter with a
dense gradient by ~10 imperative ops, two of them through ``__setitem__``
(~0.1 ms of Python each), and a dense embedding gradient costs a pass of
each over the whole vocabulary.  Its row-sparse path is a single op,
``sparse.adagrad_update``, that touches only the gradient's rows.

:class:`FusedAdaGrad` sends every gradient down that path: a dense gradient
is cast to row-sparse first (one scan; its all-zero rows are dropped, and
AdaGrad leaves such rows unchanged anyway).  Weight decay, which that op
does not take, is one scaling of the weight before it.  The update is
AdaGrad's, to float rounding, and bit for bit when ``wd == 0``::

    grad = clip(grad * rescale_grad, clip_gradient)
    history += square(grad)
    weight -= lr * (grad / sqrt(history + eps) + wd * weight)

On the CPU, with the C extension built, a dense gradient skips even that:
``_adagrad.c`` does the same arithmetic in the same order over the rows the
cast would keep, as one operation pushed to MXNet's engine (so it runs in
order with the ops around it, off the Python thread under a threaded
engine).  MXNet's kernel takes a scalar square root per element (~4 ns
here); this loop's are vectorised, and the cast's pass and op are gone.
It reads the arrays' addresses only when no op is pending, so a Trainer
step waits once for the backward pass that writes the gradients (the
Python thread cannot run ahead of it into the next minibatch) and then
pushes every update: the Trainer hands :class:`FusedAdaGrad` a step's
updates together (``aggregate_num``).
:data:`KERNEL` says whether it is in use.

Use it by name: ``gluon.Trainer(params, 'fusedadagrad', {...})`` (importing
``gluon_dynbatch`` registers it).
"""
import ctypes
import os
import sys

import mxnet as mx
import numpy as np
from mxnet import nd
from mxnet.base import _LIB
from mxnet.ndarray.ndarray import _int64_enabled

__all__ = ['FusedAdaGrad', 'KERNEL']


def _load_kernel():
    """The ``_adagrad`` extension, given the addresses of the MXNet C
    functions it calls, or None (not built, or
    ``GLUON_DYNBATCH_PURE_PYTHON`` set): every update then takes
    ``sparse.adagrad_update``."""
    if os.environ.get('GLUON_DYNBATCH_PURE_PYTHON', '0') not in ('', '0'):
        return None
    try:
        from . import _adagrad  # pylint: disable=import-outside-toplevel
    except ImportError:
        return None
    wide = bool(_int64_enabled())
    names = ('MXEnginePushSyncND', 'MXNDArrayGetData', 'MXNDArrayWaitAll',
             'MXNDArrayGetShapeEx64' if wide else 'MXNDArrayGetShapeEx', 'MXNDArrayGetDType',
             'MXNDArrayGetStorageType', 'MXNDArrayGetContext')
    _adagrad.set_engine(*[ctypes.cast(getattr(_LIB, name), ctypes.c_void_p).value
                          for name in names], wide)
    return _adagrad


KERNEL = _load_kernel()
"""The C kernel module (``gluon_dynbatch._adagrad``) that updates dense
float32 CPU gradients, or None where it is not built or turned off; set it
to None to send every update through ``sparse.adagrad_update``."""


@mx.optimizer.register
class FusedAdaGrad(mx.optimizer.AdaGrad):
    """:class:`mxnet.optimizer.AdaGrad` with one fused op per update (see
    :mod:`gluon_dynbatch.optim`); same arguments, same states, registered as
    ``'fusedadagrad'``.  Weights that are not dense float32 take AdaGrad's
    own path."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        # MXNet's Updater then hands over a Trainer step's updates in one
        # call, and the kernel waits for the backward pass once for all
        self.aggregate_num = sys.maxsize

    def update_multi_precision(self, index, weight, grad, state):
        if not isinstance(index, (list, tuple)):
            super().update_multi_precision(index, weight, grad, state)
            return
        batch = []
        for i, w, g, s in zip(index, weight, grad, state):
            if KERNEL is not None and w.dtype == np.float32 and w.stype == 'default':
                batch.append((i, w, g, s) + self._lr_and_decay(i))
            else:       # AdaGrad's own path, or float16 with a float32 master copy
                super().update_multi_precision(i, w, g, s)
        if not batch:
            return
        pushed = KERNEL.update_many([self._kernel_args(w, g, s, lr, decay)
                                     for _, w, g, s, lr, decay in batch])
        for (_, w, g, s, lr, decay), done in zip(batch, pushed):
            if not done:
                self._update_by_op(w, g, s, lr, decay)

    def update(self, index, weight, grad, state):
        if weight.dtype != np.float32 or weight.stype != 'default':
            super().update(index, weight, grad, state)
            return
        lr, decay = self._lr_and_decay(index)
        kernel = KERNEL
        if kernel is None or not kernel.update(*self._kernel_args(weight, grad, state, lr,
                                                                   decay)):
            self._update_by_op(weight, grad, state, lr, decay)

    def _lr_and_decay(self, index):
        """Counts the update; its learning rate and weight decay factor."""
        self._update_count(index)
        lr = self._get_lr(index)
        # weight - lr*wd*weight, then the wd-free update subtracts lr*div
        return lr, 1.0 - lr * self._get_wd(index)

    def _kernel_args(self, weight, grad, state, lr, decay):
        return (weight.handle.value, grad.handle.value, state.handle.value, lr,
                self.float_stable_eps, self.rescale_grad,
                -1.0 if self.clip_gradient is None else self.clip_gradient, decay)

    def _update_by_op(self, weight, grad, state, lr, decay):
        """MXNet's row-sparse AdaGrad op, after the decay."""
        if decay != 1.0:
            weight *= decay
        if grad.stype != 'row_sparse':
            grad = grad.tostype('row_sparse')
        kwargs = {'epsilon': self.float_stable_eps, 'rescale_grad': self.rescale_grad}
        if self.clip_gradient is not None:
            kwargs['clip_gradient'] = self.clip_gradient
        nd.sparse.adagrad_update(weight, grad, state, out=weight, lr=lr, wd=0.0, **kwargs)
