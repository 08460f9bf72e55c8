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
:func:`kernel_status` says whether it is in use.

Each job reads its arrays' addresses when the engine runs it, after the
backward pass that writes the gradient, so a Trainer step pushes the
updates and returns at once: the Python thread goes on into the next
minibatch (recording, planning, launching its forward) while the worker
finishes this one's backward pass and updates (:data:`IN_JOB_ADDRESSES`;
``_adagrad.c`` says why that is safe and what it checks).  Where those
checks fail, a step waits for every pending op first and reads the
addresses itself, which keeps the Python thread from running ahead.
The Trainer hands :class:`FusedAdaGrad` a step's updates together
(``aggregate_num``).

Use it by name: ``gluon.Trainer(params, 'fusedadagrad', {...})`` (importing
``gluon_dynbatch`` registers it).

Two places where MXNet's own AdaGrad is inconsistent and this one follows
its dense update for every gradient: with a row-sparse gradient (an
``Embedding(sparse_grad=True)``) MXNet refuses ``wd != 0``, while this one
decays every row of the weight each step, as dense AdaGrad does; and MXNet
reads ``clip_gradient=0`` as "no clipping" for row-sparse gradients only
(dense ones are clipped to zero), while this one clips to zero for both
(``None``, the default, is no clipping).  A negative ``clip_gradient``,
with which MXNet clips dense gradients to inverted bounds and row-sparse
ones not at all, is refused (see :class:`FusedAdaGrad`).
"""
import ctypes
import math
import numbers
import os
import sys

import mxnet as mx
import numpy as np
from mxnet import nd
from mxnet.base import _LIB
from mxnet.ndarray.ndarray import _int64_enabled

__all__ = ['FusedAdaGrad', 'KERNEL', 'kernel_status', 'IN_JOB_ADDRESSES', 'in_job_addresses']


def _load_kernel():
    """The ``_adagrad`` extension, given the addresses of the MXNet C
    functions it calls, or None (not built, or
    ``GLUON_DYNBATCH_PURE_PYTHON`` set): every update then takes
    ``sparse.adagrad_update``, and why (``_NO_KERNEL``)."""
    if os.environ.get('GLUON_DYNBATCH_PURE_PYTHON', '0') not in ('', '0'):
        _NO_KERNEL[0] = 'GLUON_DYNBATCH_PURE_PYTHON is set'
        return None
    try:
        from . import _adagrad  # pylint: disable=import-outside-toplevel
    except ImportError as err:
        _NO_KERNEL[0] = 'C kernel unavailable: %s' % err
        return None
    wide = bool(_int64_enabled())
    names = ('MXEnginePushSyncND', 'MXNDArrayGetData', 'MXNDArrayWaitAll',
             'MXNDArrayGetShapeEx64' if wide else 'MXNDArrayGetShapeEx', 'MXNDArrayGetDType',
             'MXNDArrayGetStorageType', 'MXNDArrayGetContext')
    _adagrad.set_engine(*[ctypes.cast(getattr(_LIB, name), ctypes.c_void_p).value
                          for name in names], wide)
    return _adagrad


_CHUNK_REORDER = '_ZN5mxnet7NDArray5Chunk15Reorder2DefaultEv'
"""``mxnet::NDArray::Chunk::Reorder2Default()``, what MXNet runs to bring an
array MKLDNN holds in a layout of its own back to the default one."""


def _accept_in_job(kernel):
    """Whether ``kernel`` may read addresses in its jobs (see
    ``_adagrad.c``): it checks the layout of MXNet's arrays on a probe."""
    if kernel is None:
        return False
    if mx.runtime.Features().is_enabled('MKLDNN'):
        reorder = getattr(_LIB, _CHUNK_REORDER, None)
        if reorder is None:
            return False
        reorder = ctypes.cast(reorder, ctypes.c_void_p).value
    else:
        reorder = 0
    probe = nd.arange(12, ctx=mx.cpu()).reshape((4, 3))
    row = probe[1:3]
    probe.wait_to_read()
    return bool(kernel.set_chunk_reader(
        ctypes.cast(_LIB.MXNDArrayDetach, ctypes.c_void_p).value,
        ctypes.cast(_LIB.MXNDArrayFree, ctypes.c_void_p).value,
        reorder, probe.handle.value, row.handle.value))


_NO_KERNEL = ['optim.KERNEL was set to None']
KERNEL = _load_kernel()
"""The C kernel module (``gluon_dynbatch._adagrad``) that updates dense
float32 CPU gradients, or None where it is not built or turned off; set it
to None to send every update through ``sparse.adagrad_update``.
:func:`kernel_status` says which, and why."""


def kernel_status():
    """``'C kernel'`` when :data:`KERNEL` updates dense float32 CPU
    gradients, else ``"MXNet's sparse.adagrad_update (why)"``: what
    :data:`gluon_dynbatch.accel.STATUS` says for the recorder."""
    if KERNEL is not None:
        return 'C kernel'
    return "MXNet's sparse.adagrad_update (%s)" % _NO_KERNEL[0]


IN_JOB_ADDRESSES = None
"""Whether :data:`KERNEL`'s jobs read their arrays' addresses when they
run, so that a Trainer step does not wait for the backward pass (see the
module docstring): None until the first update checks it (not at import,
which would start MXNet's engine before the user's settings); set it to
False to wait as before."""


def in_job_addresses():
    """:data:`IN_JOB_ADDRESSES`, checked now if it is still None."""
    global IN_JOB_ADDRESSES  # pylint: disable=global-statement
    if IN_JOB_ADDRESSES is None:
        IN_JOB_ADDRESSES = _accept_in_job(KERNEL)
    return IN_JOB_ADDRESSES


def _push(kernel, requests):
    """Push ``requests`` (``_kernel_args`` tuples) to ``kernel``; whether
    each was pushed.  Raises if an earlier update could not run (its job
    found no address: it left the arrays unchanged), and, when the kernel
    waits for the ops before, MXNet's error if one of them failed."""
    if in_job_addresses():
        failed = kernel.failed_jobs()
        if failed:
            raise RuntimeError(
                'FusedAdaGrad: %d earlier update(s) could not read their arrays when they ran '
                'and left the weights unchanged. Set gluon_dynbatch.optim.IN_JOB_ADDRESSES = '
                'False and report this, with your MXNet build.' % failed)
        return kernel.update_many_async(requests)
    pushed = kernel.update_many(requests)
    if pushed is None:      # an op before failed; MXNet's wait has cleared the error
        raise mx.base.get_last_ffi_error()
    return pushed


def _check_number(name, value, what, least=None, finite=True, none=None):
    """A ValueError naming ``name`` and ``value`` (and saying to give
    ``what``) unless ``value`` is a real number, not a bool nor NaN, >=
    ``least`` if given and finite if ``finite``; or None where ``none``
    says what None means."""
    if value is None and none:
        return
    if not isinstance(value, numbers.Real) or isinstance(value, bool) or math.isnan(value) or \
            (least is not None and value < least) or (finite and math.isinf(value)):
        raise ValueError('FusedAdaGrad: %s=%r; give %s%s' % (
            name, value, what, ', or None (%s)' % none if none else ''))


@mx.optimizer.register
class FusedAdaGrad(mx.optimizer.AdaGrad):
    """:class:`mxnet.optimizer.AdaGrad` with one fused op per update (see
    :mod:`gluon_dynbatch.optim`); same arguments, same states, registered as
    ``'fusedadagrad'``.  Weights that are not dense float32 take AdaGrad's
    own path.

    The numeric arguments are checked when it is made, a ValueError naming
    the bad one: ``learning_rate``, ``wd`` and ``rescale_grad`` finite
    numbers (``learning_rate`` may be None, as for AdaGrad), ``eps`` a
    finite number >= 0 (a negative one takes the square root of a negative
    history, NaN weights), and ``clip_gradient`` a number >= 0 or None (no
    clipping).  A negative ``clip_gradient`` is refused: the C kernel reads
    it as "no clipping", while MXNet's AdaGrad clips dense gradients to
    inverted bounds with it (and row-sparse ones not at all); a string or
    NaN failed at the first update, or was taken as "no clipping"."""

    def __init__(self, eps=1e-7, **kwargs):     # AdaGrad's signature: eps may come first
        _check_number('eps', eps, "a finite number >= 0 (the history's initial value, under "
                                  "a square root)", least=0)
        _check_number('clip_gradient', kwargs.get('clip_gradient'),
                      "a bound >= 0 on each gradient element's magnitude", least=0, finite=False,
                      none='no clipping')
        _check_number('learning_rate', kwargs.get('learning_rate'), 'a finite number',
                      none="the default, or the lr_scheduler's")
        for name in ('wd', 'rescale_grad'):
            if name in kwargs:
                _check_number(name, kwargs[name], 'a finite number')
        super().__init__(eps=eps, **kwargs)
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
        pushed = _push(KERNEL, [self._kernel_args(w, g, s, lr, decay)
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
        if kernel is None or not _push(kernel, [self._kernel_args(weight, grad, state, lr,
                                                                  decay)])[0]:
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
