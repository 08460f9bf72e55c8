"""The recorded graph: one light :class:`Node` per block call, and the
:class:`LazyValue` results handed back to user code.

Nodes hold the call's traced signature, its flat argument leaves (lazy
values, NDArrays or host numpy arrays), its depth (1 + deepest pending
producer) and whether a later call of the flush reads it, all known while
recording so that depth grouping is one pass.
After execution a node knows the batched output arrays it landed in and its
row there; a lazy value reads its row from them.  Arithmetic on lazy values
records calls too (``block.lazy_operator``); NDArray's operators are wrapped
here so that ``ndarray + value`` reaches the value's ``__radd__``.
"""
import functools
import threading

import mxnet as mx

from .errors import InputError, LazyValueError, ScopeError
from .trace import regroup

__all__ = ['Node', 'LazyValue', 'lazy_results', 'shared_results', 'repeat_node', 'data_marked']

PENDING, DONE, FAILED = 0, 1, 2


class Node:
    """One recorded block call."""
    __slots__ = ('sig', 'leaves', 'depth', 'scope', 'pos', 'state', 'used', 'arrays', 'row')

    def __init__(self, sig, leaves, depth, scope, pos=0):
        self.sig = sig
        self.pos = pos       # position among the calls of its flush
        self.leaves = leaves  # flat arguments: a tuple from the C recorder, a list from Python's
        self.depth = depth
        self.scope = scope
        self.state = PENDING
        self.used = False    # read by a later call recorded while this one was pending
        self.arrays = None   # batched output NDArrays of the step that ran this node
        self.row = 0         # this node's row in them

    def producers(self):
        """Pending nodes whose outputs this node reads, each once."""
        return list({id(leaf._node): leaf._node for leaf in self.leaves
                     if type(leaf) is LazyValue and leaf._node.state == PENDING}.values())

    def __repr__(self):
        return 'Node(%s, depth=%d)' % (self.sig.block.name, self.depth)


def recorded():
    """A context in which autograd records, for the ops that cut a value
    out of its step's output (``.data``, ``concat_rows``): per sample the
    value is the output array itself, part of the autograd graph whenever
    its call was recorded, wherever it is read; cut out outside
    ``autograd.record()`` it had left the graph (no gradient).  MXNet
    records nothing for an op whose inputs were not recorded, so reading a
    value of an inference flush records nothing either."""
    return mx.autograd._RecordingStateScope(True, None)


# block.lazy_operator and block.operator_error, set there (block.py imports this module)
_LAZY_OPERATOR = [None, None]
OPERATOR_BLOCKS = {}    # operator name (or key) -> its block, made by block.lazy_operator


def _operator(name, op_name, reflected=False, unary=False):
    """LazyValue's method ``name`` applying MXNet operator ``op_name`` to
    the value (``unary``) or to the value and its other operand, in this
    order or ``reflected``.  It takes as many arguments as NDArray's does
    (``pow(v, 2, 5)`` raised an error of the operator's trace).  One or
    two lazy values go straight to the operator's block once it exists
    (half the time of :func:`~gluon_dynbatch.block.lazy_operator`, ~0.4 us
    against ~0.9); what that refuses is worded as there.  (Not by calling
    it again: an InputError may come from a flush the call started, once
    it was recorded, and a second call would record it twice and hide the
    error.)"""
    if unary:
        def method(self):
            if op_name in OPERATOR_BLOCKS:
                try:
                    return OPERATOR_BLOCKS[op_name](self)
                except InputError as error:    # pylint: disable=raise-missing-from
                    raise _LAZY_OPERATOR[1](op_name, (self,), error)
            return _LAZY_OPERATOR[0](op_name, self)
    elif reflected:
        def method(self, other):
            return _LAZY_OPERATOR[0](op_name, other, self)
    else:
        def method(self, other):
            if type(other) is LazyValue and op_name in OPERATOR_BLOCKS:
                try:
                    return OPERATOR_BLOCKS[op_name](self, other)
                except InputError as error:    # pylint: disable=raise-missing-from
                    raise _LAZY_OPERATOR[1](op_name, (self, other), error)
            return _LAZY_OPERATOR[0](op_name, self, other)
    method.__name__, method.__qualname__ = name, 'LazyValue.' + name
    return method


class LazyValue:
    """A block call's output that may not be computed yet.

    Its ``shape`` (per sample, leading axis 1), ``ndim``, ``size``, ``dtype``
    and ``context`` (or ``ctx``) are known at once (they are its signature's).  Reading
    ``.data`` or ``.asnumpy()`` inside a scope runs the pending calls first
    (batched) and recording then goes on.  Arithmetic (``+ - * / ** %``,
    unary ``-``, ``abs()``) and comparisons (``< <= > >= == !=``, giving
    0/1 values as NDArray's do) with numbers, NDArrays and other lazy
    values are recorded as calls too, and batched
    (:func:`~gluon_dynbatch.block.lazy_operator`); otherwise it is no
    NDArray: ``bool()``, indexing and NDArray methods raise a TypeError
    that says how to get one.
    Only the node and the output index are stored: one is made per output
    of every recorded call.
    """
    __slots__ = ('_node', '_index', '_data')

    def __init__(self, node, index):
        self._node = node
        self._index = index
        self._data = None

    @property
    def shape(self):
        """The per-sample shape (leading axis 1), known while pending."""
        return self._node.sig.out_shapes[self._index]

    @property
    def dtype(self):
        """The numpy dtype, known while pending."""
        return self._node.sig.out_dtypes[self._index]

    @property
    def context(self):
        """The MXNet context the value is computed on."""
        return self._node.sig.ctx

    @property
    def ctx(self):
        """Alias of :attr:`context`, as NDArray's (``zeros(..., ctx=h.ctx)``)."""
        return self.context

    @property
    def ndim(self):
        """``len(self.shape)``, as NDArray's."""
        return len(self.shape)

    @property
    def size(self):
        """The number of elements, as NDArray's."""
        size = 1
        for dim in self.shape:
            size *= dim
        return size

    @property
    def ready(self):
        """True once the value has been computed (and its scope has not
        failed since, see :meth:`asnumpy`)."""
        return self._node.state == DONE and self._node.scope.failure is None

    @property
    def data(self):
        """The value as an NDArray of shape ``self.shape`` (a row of the
        batched output, differentiable under ``autograd.record()``).  Treat
        it as read-only: it is a view of the batched output, shared with
        other calls' values (calls with equal host rows share one row)."""
        node = self._node
        if node.scope.failure is not None:
            raise LazyValueError(_RUN_FAILED % (node.sig.block.name, self.shape,
                                                node.scope.failure))
        if self._data is None:
            if node.state == PENDING:
                if node.scope.thread != threading.get_ident():
                    raise ScopeError(
                        'this output of block %s was recorded by another thread\'s batching() '
                        'scope, which has not run it yet: read it in that thread, or after '
                        'that scope has closed.' % node.sig.block.name)
                node.scope.flush_to_read()
            if node.state == FAILED:
                raise LazyValueError(
                    'this output of block %s (shape %s) was recorded in a batching() scope '
                    'that failed or was abandoned, so it was never computed. Re-run the '
                    'calls in a new scope.' % (node.sig.block.name, self.shape))
            array = node.arrays[self._index]
            with recorded():
                # a one-row output too is given as a view of its own (no
                # copy): marked a leaf (attach_grad), it is what later calls
                # read, while calls recorded before the mark still read the
                # output, whose gradient, as per sample, flows on (handed
                # the output itself, they read the leaf: their parameters'
                # gradients were lost, silently; found by a fuzzer)
                self._data = array.reshape(array.shape) if array.shape[0] == 1 else \
                    mx.nd.slice_axis(array, axis=0, begin=node.row, end=node.row + 1)
            if type(array) is not mx.nd.NDArray:    # (a training step's output)
                from .execute import rows_of
                rows_of((array,), self._data)
        return self._data

    def asnumpy(self):
        """The value as a numpy array.

        Under MXNet's threaded engine an operator that fails when the
        engine runs it (a custom op raising, say) fails the arrays computed
        from it, but MXNet raises its error once, at the first read, and
        then forgets it: the other values of a batched step, which share
        its arrays, and of the steps reading them, would read garbage.
        Which steps it reached is unknown, so when this read raises, every
        value of the scope fails from then on (:class:`LazyValueError`),
        those of its earlier flushes too, and none may be passed to a
        call.  (Under the ``NaiveEngine`` the failing flush raises and
        fails its own values.)"""
        data = self.data
        try:
            return data.asnumpy()
        except mx.base.MXNetError as error:
            # its text: the error's traceback would hold this frame, and so
            # the scope, in a cycle (recorded objects form none)
            self._node.scope.failure = str(error).strip().splitlines()[-1]
            raise

    # A lazy value is no NDArray: NDArray code meeting one (``v.sum()``,
    # ``v[0]``, ``np.asarray(v)``) says how to get one instead of failing
    # obscurely or making an object array.
    _HINT = ('a LazyValue (an output of %s recorded in a batching() scope) is not an '
             'NDArray: arithmetic (+ - * / ** %%, unary -, abs()) and comparisons on it are '
             'batched, but for anything else do it inside a wrapped block, or read value.data '
             'for one value or gluon_dynbatch.concat_rows(values) for many (one gather), '
             'which runs the pending calls now')

    def _hint(self):
        """:data:`_HINT` for this value, naming its maker: a block, or the
        operator written (``if h == 0:`` reads the value of ``h == 0``)."""
        block = self._node.sig.block
        symbol = getattr(block, 'dynbatch_symbol', None)
        return self._HINT % ('%s (block %s)' % (symbol, block.name) if symbol else
                             'block %s' % block.name)

    def __getattr__(self, name):
        if name.startswith('__'):       # protocol probes (copy, pickle, numpy)
            raise AttributeError(name)
        raise AttributeError("'LazyValue' object has no attribute %r: %s"
                             % (name, self._hint()))

    def __array__(self, *args, **kwargs):
        raise TypeError(self._hint())

    def __copy__(self):
        return self     # (a read-only view, as immutable objects copy)

    def __reduce_ex__(self, protocol):
        # (copy.deepcopy and pickle failed on the scope's thread-local state)
        raise TypeError('a LazyValue (an output of block %s) cannot be copied or pickled: it '
                        'is a view of its batched step\'s output. Copy or pickle its data '
                        '(value.data.copy(), value.asnumpy()).' % self._node.sig.block.name)

    def _not_an_ndarray(self, *args):
        raise TypeError(self._hint())

    # NDArray's arithmetic, by the operators NDArray code runs per sample
    # (``a + b`` is ``broadcast_add``, ``-a`` ``_mul_scalar(a, -1)``), as
    # recorded calls: written between block calls (a residual ``h + x``, a
    # scale ``0.5 * h``), it would otherwise need a block of its own or a
    # read of ``.data``, which runs the pending calls one sample at a time
    __add__ = _operator('__add__', 'broadcast_add')
    __radd__ = _operator('__radd__', 'broadcast_add', reflected=True)
    __sub__ = _operator('__sub__', 'broadcast_sub')
    __rsub__ = _operator('__rsub__', 'broadcast_sub', reflected=True)
    __mul__ = _operator('__mul__', 'broadcast_mul')
    __rmul__ = _operator('__rmul__', 'broadcast_mul', reflected=True)
    __truediv__ = _operator('__truediv__', 'broadcast_div')
    __rtruediv__ = _operator('__rtruediv__', 'broadcast_div', reflected=True)
    __pow__ = _operator('__pow__', 'broadcast_power')
    __rpow__ = _operator('__rpow__', 'broadcast_power', reflected=True)
    __mod__ = _operator('__mod__', 'broadcast_mod')
    __rmod__ = _operator('__rmod__', 'broadcast_mod', reflected=True)
    __neg__ = _operator('__neg__', 'negative', unary=True)
    __abs__ = _operator('__abs__', 'abs', unary=True)
    # comparisons give 0/1 arrays, as NDArray's do (``3 < v`` is ``v > 3``:
    # Python swaps a comparison, it has no reflected one), so that a mask
    # ``(v > 0) * v`` batches; ``if v > 0:`` still needs ``.data``, below
    __lt__ = _operator('__lt__', 'broadcast_lesser')
    __le__ = _operator('__le__', 'broadcast_lesser_equal')
    __gt__ = _operator('__gt__', 'broadcast_greater')
    __ge__ = _operator('__ge__', 'broadcast_greater_equal')
    __eq__ = _operator('__eq__', 'broadcast_equal')
    __ne__ = _operator('__ne__', 'broadcast_not_equal')
    __hash__ = object.__hash__      # (values are dict keys and set members by identity)
    __array_ufunc__ = None      # numpy's operators defer to ours (which refuse numpy arrays)
    # (``v += x`` rebinds ``v``: an NDArray's in-place add would also change
    # the array under its other names; quickstart.rst says so)
    __matmul__ = __rmatmul__ = __getitem__ = _not_an_ndarray
    # per-sample code reads the NDArray's value here (``if gate(x) > 0:``),
    # which a lazy value would answer by identity instead
    __bool__ = __len__ = __float__ = __int__ = __index__ = _not_an_ndarray

    def __repr__(self):
        state = 'failed' if self._node.scope.failure is not None else \
            ('pending', 'ready', 'failed')[self._node.state]
        return 'LazyValue(%s, shape=%s, %s)' % (self._node.sig.block.name, self.shape, state)


def _deferring(ndarray_method, reflected):
    """``ndarray_method`` (NDArray's ``__add__``, say), except that a lazy
    value as the other operand gets its ``reflected`` method instead.
    NDArray's operators raise for any operand that is no number or NDArray
    rather than return NotImplemented, so ``total + h``, with ``total``
    an NDArray, would never reach ``h.__radd__``."""
    @functools.wraps(ndarray_method)
    def method(self, other):
        if type(other) is LazyValue:
            return getattr(other, reflected)(self)
        return ndarray_method(self, other)
    return method


def _not_in_place(ndarray_method):
    """``ndarray_method`` (NDArray's ``__iadd__``, say), refusing a lazy
    value with a message: the array cannot be written before the value is
    computed."""
    @functools.wraps(ndarray_method)
    def method(self, other):
        if type(other) is LazyValue:
            raise TypeError('in-place arithmetic of an NDArray with a LazyValue (an output of '
                            'block %s) is not supported: write total = total + value.'
                            % other._node.sig.block.name)
        return ndarray_method(self, other)
    return method


def _wrap_operators(cls):
    """Wrap the operators ``cls`` defines itself (the sparse arrays
    define some of their own, so ``csr * v`` needs its own wrapper) with
    :func:`_deferring` and :func:`_not_in_place`."""
    pairs = [('__add__', '__radd__'), ('__sub__', '__rsub__'), ('__mul__', '__rmul__'),
             ('__truediv__', '__rtruediv__'), ('__pow__', '__rpow__'), ('__mod__', '__rmod__'),
             ('__lt__', '__gt__'), ('__le__', '__ge__'), ('__eq__', '__eq__'),
             ('__ne__', '__ne__')]
    for own, other in dict(pairs + [(b, a) for a, b in pairs]).items():
        if own in vars(cls):
            setattr(cls, own, _deferring(vars(cls)[own], other))
    for name in ('__iadd__', '__isub__', '__imul__', '__itruediv__', '__ipow__', '__imod__'):
        if name in vars(cls):
            setattr(cls, name, _not_in_place(vars(cls)[name]))


for _cls in (mx.nd.NDArray, mx.nd.sparse.BaseSparseNDArray, mx.nd.sparse.CSRNDArray,
             mx.nd.sparse.RowSparseNDArray):
    _wrap_operators(_cls)


_RUN_FAILED = (
    'this output of block %s (shape %s) comes from a batching() scope where an operator failed '
    'when MXNet ran it (%s). MXNet raised that error once, at the first read of a value '
    'computed from it, and then forgot it, so no value of the scope can be trusted: every '
    'one now fails. Per sample only the failing call, and the calls reading it, would fail: '
    'to find it, run the scope with strategy=\'per-sample\' under '
    'MXNET_ENGINE_TYPE=NaiveEngine.')
"""The error of a value whose scope failed at run time (LazyValue.asnumpy)."""


def data_marked(value):
    """Whether lazy value ``value``'s ``.data`` was read and then given a
    gradient (``attach_grad``): per sample that array is a leaf of its own,
    so later calls and ``concat_rows`` read it instead of the step's rows,
    whose gradient would flow past the mark (found by a fuzzer; the C
    recorder's ``data_marked`` hands such calls to Python)."""
    return value._data is not None and value._data.grad is not None


_PAIR = (0, 0)


def lazy_results(node):
    """What a recorded call returns: the lazy values of ``node``, nested as
    its signature's outputs, except that an output returning an NDArray or
    lazy-value argument unchanged is that argument (the C recorder builds
    one output and pairs itself, and calls this for the rest)."""
    sig = node.sig
    out_fmt = sig.out_fmt
    if not sig.passthrough:
        if out_fmt == 0:
            return LazyValue(node, 0)
        if out_fmt == _PAIR:
            return (LazyValue(node, 0), LazyValue(node, 1))
    outputs = [LazyValue(node, i) for i in range(len(sig.out_shapes))]
    # an argument returned unchanged is that argument, as per sample: a
    # copy made by the step would be out of the autograd graph when the
    # step ran unrecorded (an inference scope, autograd.pause()), and the
    # argument's gradient lost (found by a fuzzer)
    for number, leaf in sig.passthrough.items():
        arg = node.leaves[leaf]
        if type(arg) is LazyValue or isinstance(arg, mx.nd.NDArray):
            outputs[number] = arg
    if out_fmt == 0:
        return outputs[0]
    return tuple(regroup(out_fmt, outputs)[0])


def shared_results(node, result):
    """What :attr:`BatchingScope.repeats <.block.BatchingScope>` keeps of a
    call for later equal calls: its results themselves when they are one
    lazy value or a pair of them (immutable, so a later call may get the
    very same objects, and nothing is allocated for it), else its node (a
    nesting with lists, which the user could change, is made anew)."""
    out_fmt = node.sig.out_fmt
    return result if (out_fmt == 0 or out_fmt == _PAIR) and not node.sig.passthrough else node


def repeat_node(first):
    """The node of what :func:`shared_results` kept."""
    if type(first) is Node:
        return first
    if type(first) is tuple:
        first = first[0]
    return first._node
