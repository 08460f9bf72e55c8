"""Optional C fast paths for the work done once per recorded call.

Recording costs ~2.5 us a call in Python, and the per-node work of planning
and running a flush about as much again: together a third of a batched SICK
minibatch of 256.  ``_speedups.c`` does the common case of the hot
functions in C:

* :func:`record` - :meth:`~.block.BatchingScope.record`, called straight
  from a C ``DynBatchBlock.__call__`` (no Python frame per call; it finds
  the open scope in a C ``ScopeSlot``, see :func:`scope_holder`, reads
  the scope's slots directly, and reads MXNet's thread-local autograd
  flags in place where it can check that it reads them right, see
  :func:`_autograd_setters`, and an ``NDArray`` argument's shape, dtype
  and context through MXNet's C API, see :func:`_ndarray_readers`), which
  leaves counting the calls per group to :func:`count_groups`
  (:func:`~.plan.count_groups_py`), one pass at the flush;
* :func:`depth_groups` - :func:`~.plan.depth_groups_py` (depth grouping),
  and :func:`agenda_groups` - :func:`~.plan.agenda_groups_py` (the agenda's
  order);
* :func:`structure_key` - :func:`~.plan.structure_key_py` (cached plans hash
  every flush) as int32 words in bytes, and :class:`Tape`, which a scope
  holds to write those words as calls are recorded (and to sum the time
  recording takes), so that a flush has its structure key without a pass;
* :func:`gather_index` - where each row of a step's argument lives (the
  case of :func:`~.execute.collect` where every row is a lazy value's or
  an ``NDArray``'s (see :func:`_ndarray_readers`): the source arrays and each
  row's position in their concatenation, with the sources' rows counted
  through MXNet's C API), and :func:`gather_item` the same for a list
  argument read straight from the step's nodes (the common case of
  ``execute._gather_item``; for a ragged step, its lists' elements only);
* :func:`host_rows` - host rows (token ids) concatenated, and
  :func:`host_item` the same for one argument read straight from a step's
  nodes (``execute.host_item_rows``);
* :func:`finish_nodes` - :func:`~.execute.finish_nodes_py`;
* :func:`wrap_host` - ``mx.nd.from_numpy(array, zero_copy=True)``, which
  :func:`~.execute.to_device` calls under a threaded engine, its DLPack
  structures built in C (~18 us of ctypes an array in Python); when MXNet
  frees the array, often on the engine's worker, the numpy array is only
  queued, and the next call releases it (``from_numpy``'s deleter takes
  the GIL on the worker, which then waits while Python runs);
* :func:`push_marker` and :func:`marker_done` - an engine operation that
  only sets a flag once the arrays it reads are computed, and that flag:
  how a pipelined scope knows that the engine's worker has run the part it
  flushed before without waiting for it
  (:meth:`~.block.BatchingScope.pipeline`); there is no Python version,
  and without them such a scope flushes at fixed counts;
* :func:`memo_clear` - forgets the signatures ``record`` memoized, for a
  block that traces again (``DynBatchBlock._forget_traces``); the Python
  recorder keeps no memo.

``record``, ``agenda_groups``, ``gather_index``, ``gather_item``, ``host_rows``,
``host_item`` and ``wrap_host`` return None for anything but the common case
(``record`` before changing anything), and the caller then runs the Python
version, which stays the reference and the only place user errors are
raised.

The extension is built by ``pip install`` when a C compiler is present
(``setup.py`` marks it optional); without it everything runs in Python.
``GLUON_DYNBATCH_PURE_PYTHON=1`` turns it off; :data:`STATUS` says which
is in use and why.  An extension built from older sources (a checkout
updated without ``pip install -e .``) is not used: one that lacks a
function, or whose :data:`ABI` differs from this code's, leaves everything
to Python until it is rebuilt.
"""
import os

import mxnet as mx
import numpy as np

from .graph import LazyValue, Node, lazy_results
from .trace import _ZEROS

__all__ = ['record', 'count_groups', 'depth_groups', 'agenda_groups', 'structure_key', 'Tape',
           'gather_index', 'gather_item', 'host_rows', 'host_item', 'finish_nodes', 'wrap_host',
           'push_marker', 'marker_done', 'memo_clear', 'enable', 'STATUS']

ABI = 10
"""The interface of ``_speedups`` this code expects (its ``ABI``; 2:
``gather_item`` returns each list's length too; 3: ``gather_item`` gathers
a ragged step's elements only when asked: ``compact``; 4: ``record``
defers a call made under another autograd state than the scope's pending
calls, ``BatchingScope.mode``; 5: ``record`` answers a repeated call from
``BatchingScope.repeats``; 6: which holds the first call's results when
they are lazy values, :func:`~.graph.shared_results`; 7: a call that
returns an argument unchanged has Python build its results,
``TracedSignature.passthrough``; 8: ``record`` refuses a value of a scope
that failed, ``BatchingScope.failure``, and :func:`memo_clear`; 9: it
defers a call given a lazy value whose ``.data`` has a gradient attached,
which Python records as that array; 10: it records a call made outside
autograd under the signature's ``inference`` where it has one).  An extension
built from older sources still has every function, so its names alone
cannot tell."""

FUNCTIONS = ('record', 'count_groups', 'depth_groups', 'agenda_groups', 'structure_key', 'Tape',
             'gather_index', 'gather_item', 'host_rows', 'host_item', 'finish_nodes', 'wrap_host',
             'push_marker', 'marker_done', 'memo_clear')
record = count_groups = depth_groups = agenda_groups = structure_key = Tape = None
gather_index = gather_item = host_rows = host_item = finish_nodes = wrap_host = None
push_marker = marker_done = memo_clear = None
SETUP = ('configure', 'set_shape_reader', 'set_ndarray_readers', 'set_from_dlpack',
         'set_engine_push', 'set_autograd_state', 'set_autograd_flags', 'call_method',
         'ScopeSlot')
"""What the extension must have beyond :data:`FUNCTIONS`: how it is set up,
its ``__call__`` and its scope holder."""


def _load():
    if os.environ.get('GLUON_DYNBATCH_PURE_PYTHON', '0') not in ('', '0'):
        return 'pure Python (GLUON_DYNBATCH_PURE_PYTHON is set)'
    try:
        from . import _speedups  # pylint: disable=import-outside-toplevel
    except ImportError as err:
        return 'pure Python (C extension unavailable: %s)' % err
    # an extension built from older sources (a checkout updated without
    # pip install -e .) is checked before anything of it is called: what it
    # lacks, or takes in another form, must leave everything to Python, not
    # fail the import
    missing = [name for name in FUNCTIONS + SETUP if not hasattr(_speedups, name)]
    if missing:
        return 'pure Python (C extension out of date, lacks %s)' % ', '.join(missing)
    if getattr(_speedups, 'ABI', 1) != ABI:     # same names, results of another form
        return ('pure Python (C extension out of date: built for interface %d, this code '
                'needs %d; rebuild it: pip install -e .)' % (getattr(_speedups, 'ABI', 1), ABI))
    try:
        NUMPY_FIELDS[0] = _speedups.configure(
            LazyValue, Node, mx.nd.NDArray, np.ndarray, mx.current_context,
            mx.context.Context._default_ctx, lazy_results, _ZEROS,
            np.empty((2, 3, 5), np.float32))
        _speedups.set_shape_reader(*_shape_reader())
        _speedups.set_ndarray_readers(*_ndarray_readers())
        _speedups.set_from_dlpack(_from_dlpack())
        _speedups.set_engine_push(_c_function('MXEnginePushSyncND'))
        _speedups.set_autograd_state(_c_function('MXAutogradIsRecording'),
                                     _c_function('MXAutogradIsTraining'))
        _speedups.set_autograd_flags(*_autograd_setters())
    except TypeError as err:
        return 'pure Python (C extension out of date: %s; rebuild it: pip install -e .)' % err
    _LOADED.update({name: getattr(_speedups, name) for name in FUNCTIONS + ('call_method',)})
    _EXTRAS['ScopeSlot'] = _speedups.ScopeSlot
    enable(True)
    return 'C extension'


def _shape_reader():
    """The address of MXNet's C function that reads an array's shape, and
    whether it is the 64-bit one (MXNet built with large tensors), for the
    gathers to count rows without ``NDArray.shape``'s Python."""
    # pylint: disable=import-outside-toplevel
    import ctypes
    from mxnet.base import _LIB
    from mxnet.ndarray.ndarray import _int64_enabled
    wide = bool(_int64_enabled())
    function = _LIB.MXNDArrayGetShapeEx64 if wide else _LIB.MXNDArrayGetShapeEx
    return ctypes.cast(function, ctypes.c_void_p).value, wide


def _ndarray_readers():
    """``_speedups.set_ndarray_readers``' arguments: the addresses of the C
    functions ``NDArray.dtype`` and ``.context`` call, the table that maps
    MXNet's dtype ids to what ``.dtype`` returns, the ``Context`` class, and
    this package's ``NDArray`` subclasses, which inherit those properties
    and ``.shape`` (the recorder reads them for such arrays as for an
    ``NDArray``)."""
    # pylint: disable=import-outside-toplevel
    from mxnet.ndarray.ndarray import _DTYPE_MX_TO_NP
    from .execute import FreedRows, GradFree, OutputRows, RecordedOutput
    return (_c_function('MXNDArrayGetDType'), _c_function('MXNDArrayGetContext'),
            _DTYPE_MX_TO_NP, mx.context.Context,
            (GradFree, RecordedOutput, OutputRows, FreedRows))


def _from_dlpack():
    """The address of MXNet's ``MXNDArrayFromDLPackEx`` (for
    :func:`wrap_host`), or None where this MXNet lacks it."""
    return _c_function('MXNDArrayFromDLPackEx')


def _autograd_setters():
    """``_speedups.set_autograd_flags``'s arguments: the path of the MXNet
    library Python loaded, where the recorder finds MXNet's autograd flags
    to read them in place, and the addresses of the C functions that set
    them, with which it checks that it reads them right."""
    from mxnet.base import _LIB  # pylint: disable=import-outside-toplevel
    path = getattr(_LIB, '_name', None)
    return (path if isinstance(path, str) else None,
            _c_function('MXAutogradSetIsRecording'), _c_function('MXAutogradSetIsTraining'))


def _c_function(name):
    """The address of MXNet's C function ``name``, or None where this MXNet
    lacks it."""
    # pylint: disable=import-outside-toplevel
    import ctypes
    from mxnet.base import _LIB
    function = getattr(_LIB, name, None)
    return None if function is None else ctypes.cast(function, ctypes.c_void_p).value


_LOADED = {}
_EXTRAS = {}        # what the extension offers beyond FUNCTIONS, used whether enabled or not
NUMPY_FIELDS = [False]
"""Whether the recorder reads numpy arrays' shape and dtype from the array
structure (checked on a probe array) instead of through attributes."""
_CALL = {}      # the block class, its Python __call__ and its C __call__


def scope_holder():
    """Where each thread's open scope is kept (``.scope``): the C
    ``ScopeSlot`` when the extension is built (the C ``__call__`` reads it
    without an attribute lookup), else a ``threading.local()``."""
    if 'ScopeSlot' in _EXTRAS:
        return _EXTRAS['ScopeSlot']()
    import threading  # pylint: disable=import-outside-toplevel
    return threading.local()


def attach_call(cls, local, scope_cls):
    """Give ``cls`` (DynBatchBlock) the C ``__call__`` while the C versions
    are enabled: it reads the open scope (a ``scope_cls``, whose slots it
    reads directly) from ``local`` and records, and runs the Python
    ``__call__`` for anything it defers."""
    python_call = cls.__dict__['__call__']
    _CALL.update(cls=cls, python=python_call)
    if 'call_method' in _LOADED:
        _CALL['c'] = _LOADED['call_method'](
            cls, local, lambda dblock, args, **kwargs: python_call(dblock, *args, **kwargs),
            scope_cls)
    enable(record is not None)


def enable(on=True):
    """Use the C versions (when built) or not; returns whether they are now
    in use.  Tests run both; ``benchmarks/`` can measure both."""
    globals().update({name: _LOADED.get(name) if on else None for name in FUNCTIONS})
    if _CALL:
        setattr(_CALL['cls'], '__call__', _CALL['c'] if on and 'c' in _CALL else _CALL['python'])
    return bool(on and _LOADED)


STATUS = _load()
"""``'C extension'`` or ``'pure Python (why)'``."""
