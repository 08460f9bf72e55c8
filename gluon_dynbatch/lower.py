"""Lower one plan step to a compiled batched call.

A step runs a signature's per-sample symbol over N calls.  Each top-level
argument of the block arrives either *direct* (an array whose rows already
are the N calls in order, e.g. host token ids) or *gathered*: a source array
(the earlier batched outputs the rows come from, passed as separate inputs
and concatenated inside the program) plus an index array.  A list argument
of length K is gathered with one index into element-major ``(K, N, ...)``
rows (each element's rows together; ``(N, K, ...)`` with
``VECTORIZE_LISTS`` off) and cut into its K elements by one
``SliceChannel`` (a single op whose backward writes each gradient once,
unlike K slices); the block's per-element ops then run once over all
elements (:mod:`~gluon_dynbatch.lanes`).  A step whose calls have
lists of different lengths either pads them with zero rows or runs them
*ragged* (``'ragged'``: only the real elements, list after list, see
:func:`ragged_lists`).

The gathers and the block's ops compile into one CachedOp per (signature,
gather pattern), so a step costs one CachedOp call plus its index uploads,
whatever the arity.

Host rows repeat: a minibatch of 256 SICK pairs makes ~4,900 calls but has
~750 distinct token ids (repeated leaf calls are merged as they are
recorded, :func:`~gluon_dynbatch.block.repeat_key`; the internal nodes'
ids still repeat).  When a step's host rows hold many repeats, the step
runs on the distinct rows (``'unique'`` in its pattern) and the part of the
block that depends on host data alone (here the embedding and the ``i2h``
GEMM, ~75% of the model's FLOPs) runs once per distinct row; its results
reach the rest of the block through one ``take`` by the step's ``inverse``
index (:func:`share_host_part`).  Every batched op acts row-wise (the
batching rules check that), so a row's result depends on that row alone
and equal rows give equal results: the outputs are those of running every
row.  Stochastic ops (``Dropout``) are never shared.

Steps of different signatures often share that part (every Tree-LSTM node
step embeds its token and applies ``i2h``, whatever its arity):
:func:`split_host_part` cuts it out with a key, a flush runs it once for
all the steps with that key over their distinct rows together
(:class:`~gluon_dynbatch.execute.FlushHoist`), and each step program reads
its rows of the results by ``take`` (``'hoisted'``, :func:`hoisted_rest`).

When every output of a step depends on host data alone (a Tree-LSTM leaf:
its token and nothing else), the outputs can stay one row per distinct
host row (``'distinct'`` in the pattern): nodes with equal host rows then
share a row, and later steps gather from the small array (at SICK minibatch
256, 259 leaf rows instead of 2,543, in every step that reads a leaf,
before repeated leaf calls were merged as they are recorded).

A cached plan whose structure keeps coming back can go one level further:
:func:`flush_program` chains the step programs of the whole plan, their
gathers replayed from the plan's recipes, into one CachedOp.  A flush then
costs one call forward and one backward, and each parameter's gradient is
summed inside the graph instead of once per step.  Host parts run inside
it on each flush's distinct host rows (their number follows the data; the
row layout of every output does not).
"""
import atexit
import json
import threading
import time
import weakref

import mxnet as mx
import numpy as np

from .lanes import CUT, PADDED, SEGMENT, vectorize_lists
from .rules import NOT_FUNCTIONS, draws_random
from .trace import (EXACT, constant_shape, graph_readers, leaf_count, load_graph,
                    may_batch_on_axis_1, moved_entry, own_forms, symbol_json)

__all__ = ['make_cached_op', 'op_local', 'release_at_exit', 'ThreadCachedOp', 'StepProgram',
           'step_program', 'element_major',
           'FlushProgram', 'flush_program', 'share_host_part', 'host_part', 'embedding_reads',
           'read_tables',
           'HostSplit', 'host_split', 'split_host_part', 'hoisted_rest', 'ragged_lists',
           'compose_takes', 'tanh_by_sigmoid', 'tanh_by_sigmoid_pays', 'adds_by_broadcast',
           'indices_without_gradient',
           'INVERSE', 'INVERSE_SEGMENT']


_BUILT = threading.local()


def programs_built():
    """CachedOps this thread has made so far (each a first call's compile
    and memory plan; a thread makes its own, see :class:`ThreadCachedOp`):
    ``DYNBATCH_DEBUG`` and :func:`~gluon_dynbatch.stats` say how many a
    flush made, which is why a first flush of new shapes runs slower, and
    the cost model does not learn from such a flush's time."""
    return getattr(_BUILT, 'count', 0)


def _count_build():
    _BUILT.count = programs_built() + 1


def make_cached_op(symbol, flags=()):
    """``(CachedOp, symbol)``: a CachedOp of ``symbol``, or, where MXNet
    1.9.1 cannot build one, of ``symbol`` with its adds made
    ``broadcast_add`` (:func:`adds_by_broadcast`), and the symbol it runs.
    MXNet plans a CachedOp's backward as it builds it, even for inference,
    and fails ('control dep not found in graph') on a value read by 8 ops
    or more through a chain of ``elemwise_add`` (a node update ``s = s +
    xx * W h_k`` over 7 children); Gluon's ``hybridize()`` fails alike.

    Never inlined into autograd's graph (``inline_limit`` 0; MXNet's
    default inlines programs of 1 or 2 ops): backward of an inlined
    ``tanh(FullyConnected(x))`` whose output only a zero-gradient op read
    (a comparison, ``floor``, ``argmax``: their gradient is a
    ``zeros_like`` of the input) crashed MXNet 1.9.1, as it does for such
    a block hybridized per sample, while the ops run one by one do not."""
    flags = list(flags) + [('inline_limit', 0)]
    try:
        return mx.nd.CachedOp(symbol, flags), symbol
    except mx.base.MXNetError as err:
        if 'control dep not found' not in str(err):
            raise
    symbol = adds_by_broadcast(symbol)
    return mx.nd.CachedOp(symbol, flags), symbol


_OP_LOCALS = weakref.WeakSet()
"""Every ``threading.local`` that holds CachedOps (:func:`op_local`)."""


def op_local():
    """A ``threading.local`` to keep CachedOps in, whose exiting thread's
    ops :func:`release_at_exit` frees."""
    local = threading.local()
    _OP_LOCALS.add(local)
    return local


@atexit.register
def release_at_exit():
    """Free the exiting thread's CachedOps while MXNet and the Python
    objects their ops call back still stand (MXNet's own exit hook,
    registered when it was imported, runs after this one).  Left to
    interpreter teardown, a thread's locals go after modules are torn down:
    a compiled plan holding a ``Custom`` op crashed the process at exit
    (SIGSEGV in the op's state deleter, a user's trial) once its work was
    done.  A later call builds its op again."""
    for local in list(_OP_LOCALS):
        local.__dict__.clear()


class ThreadCachedOp:
    """A ``CachedOp`` of ``symbol`` per thread that calls it, made at its
    first call there (the building thread's at once).  Programs live on
    signatures, which every thread shares, and MXNet 1.9.1's CachedOp is
    not safe to call from two threads at once: eight threads making the
    first calls of one new CachedOp crashed (plain MXNet), and a
    ``static_alloc`` one keeps its buffers across calls, so two threads
    would compute in the same memory.  A thread's ops go when it ends."""
    __slots__ = ('symbol', 'flags', '_local')

    def __init__(self, symbol, flags=()):
        self.flags = list(flags)
        self._local = op_local()
        self._local.op, self.symbol = make_cached_op(symbol, self.flags)
        _count_build()

    def __call__(self, *args):
        try:
            op = self._local.op
        except AttributeError:
            op = self._local.op = make_cached_op(self.symbol, self.flags)[0]
            _count_build()
        return op(*args)


class StepProgram:
    """A compiled step: its ``symbol``, the ``cached_op`` and, for each of
    its inputs, where the value comes from: ``('src', (item, part))``,
    ``('idx', item)``, ``('inverse', None)`` (see :func:`share_host_part`),
    ``('table', Parameter)`` (see :func:`read_tables`), ``('hoisted',
    position)`` (see :func:`hoisted_rest`), ``('inverse_segment', None)``
    and ``('ragged', name)`` (a ragged step's indices, see
    :func:`ragged_lists`) or ``('param', Parameter)``.

    No program that autograd records keeps its buffers between calls
    (``static_alloc``): MXNet 1.9.1 computes wrong gradients there in two
    cases found so far (``elemwise_add`` with an operand that needs no
    gradient, apache/mxnet issue 20293; a weight read by ``linalg_gemm2``
    8 times or more; see :doc:`design`), for a few percent of training
    speed.  Inference gained nothing from it
    (1.00x / 1.02x) either.

    :meth:`for_rows` picks, by the step's number of calls, this program,
    its variant in the block's own operator forms (:func:`~.trace.own_forms`,
    for steps of a few rows) or its variant that computes ``tanh`` through
    ``sigmoid`` (:func:`tanh_by_sigmoid`), each built at first use; the
    last only for float32 off a GPU (``rewrite_tanh``), and where it was
    measured to pay (:func:`tanh_by_sigmoid_pays`): in float16 the rewrite
    errs by ~2.4e-4, and MKLDNN, whose ``tanh`` it avoids, runs neither
    float16 nor float64 nor on a GPU."""
    __slots__ = ('symbol', 'cached_op', 'feeds', 'training', 'rewrite_tanh', '_wide',
                 '_narrow')

    def __init__(self, symbol, feeds, training=False, rewrite_tanh=True):
        if training:
            symbol = indices_without_gradient(adds_by_broadcast(symbol))
        self.symbol = symbol
        self.cached_op = ThreadCachedOp(symbol)
        self.feeds = feeds
        self.training = training
        self.rewrite_tanh = rewrite_tanh
        self._wide = self._narrow = None

    def for_rows(self, calls):
        """This program; for a step of fewer than :data:`FAST_FORMS_ROWS`
        calls its variant in the block's own operator forms; for one of at
        least :data:`TANH_BY_SIGMOID_ROWS` calls, where that pays on this
        machine (:func:`tanh_by_sigmoid_pays`), its variant with ``tanh``
        computed through ``sigmoid`` (this one again where the variant
        would be the same, or would take other inputs)."""
        if calls < FAST_FORMS_ROWS[self.training]:
            if self._narrow is None:
                self._narrow = self._variant(own_forms(self.symbol))
            return self._narrow
        if calls < TANH_BY_SIGMOID_ROWS[self.training] or not self.rewrite_tanh or \
                not tanh_by_sigmoid_pays(self.training):
            return self
        if self._wide is None:
            self._wide = self._variant(tanh_by_sigmoid(self.symbol))
        return self._wide

    def _variant(self, symbol):
        """The program of ``symbol``, a rewrite of this one's (this one
        when the rewrite changed nothing or would take other inputs)."""
        if symbol is self.symbol or symbol.list_inputs() != self.symbol.list_inputs():
            return self
        return StepProgram(symbol, self.feeds, self.training, rewrite_tanh=False)


def step_program(sig, pattern):
    """The :class:`StepProgram` of ``sig`` under ``pattern`` (per top-level
    argument: None for an empty list, else ``(how, parts)``: ``how`` is
    ``'direct'``, ``'take'``, ``'unique'`` or ``'distinct'`` (host rows,
    distinct; outputs per call, or per distinct row: see
    :func:`share_host_part`) or ``'hoisted'`` (host rows whose part of the
    block ran for the whole flush: see :func:`split_host_part`), ``parts``
    the number of arrays whose concatenation is the source; host indices
    read through the flush's embedding tables add ``'table'``, see
    :func:`read_tables`), built once and cached on ``sig``.

    The per-element ops on list arguments run once over all elements
    (:mod:`~gluon_dynbatch.lanes`) in a form that depends on whether
    ``autograd`` is recording, so programs for training (``sig.programs``)
    and inference (``sig.inference_programs``) are kept apart."""
    training = mx.autograd.is_recording()
    programs = sig.programs if training else sig.inference_programs
    program = programs.get(pattern)
    if program is None:
        program = programs[pattern] = _build(sig, pattern, training)
    return program


VECTORIZE_LISTS = True
"""Whether the per-element ops on a list argument run once over all its
elements (:mod:`~gluon_dynbatch.lanes`).  Against per-element programs,
SICK child-sum Tree-LSTM, in-process A/B: inference 1.08x at minibatch 25
and 1.01-1.02x at 256; training 1.03-1.04x at 25 and 1.03-1.09x at 256
with dense embedding gradients, 1.08-1.10x at both with row-sparse ones.
It is read when a step program is built and when a step gathers its rows
(:func:`element_major`), so change it only before a block's first flush."""


def element_major(width):
    """Whether a list argument of ``width`` elements is gathered
    element-major, as ``(K, N, ...)`` rows, each element's rows together
    (see :mod:`~gluon_dynbatch.lanes`): its ``(N, K)`` index is then
    transposed on the host (:func:`~.execute.run_step`), which saved two
    ops per node step."""
    return VECTORIZE_LISTS and width > 1


def ragged_lists(sig):
    """Whether steps of ``sig`` (a padded signature) can run their lists
    ragged: every element of every list is read only by per-element ops
    that :func:`~.lanes.vectorize_lists` runs over all elements and sums,
    so calls with shorter lists need no padding elements at all (pattern
    ``'ragged'``).  Decided once per signature, from its symbol."""
    if sig.ragged is None:
        lists = [item for item, fmt in enumerate(sig.fmt)
                 if fmt != 0 and len(fmt) > 1 and set(fmt) == {0}]
        sig.ragged = False
        if lists and VECTORIZE_LISTS and sig.batch_safe and not sig.folded:
            pattern = tuple(None if fmt == () else ('ragged' if item in lists else 'direct', 1)
                            for item, fmt in enumerate(sig.fmt))
            symbol, lane_ndims = _gathered(sig, pattern)
            sig.ragged = len(lane_ndims) == len(lists) and vectorize_lists(
                symbol, lane_ndims, _lanes_dtype(sig), ragged=True) is not None
    return sig.ragged


def _lanes_dtype(sig):
    """The dtype of the list arguments of ``sig``, whose lanes
    :func:`~.lanes.vectorize_lists` runs at once; None (run each lane
    apart) where two lists differ in dtype."""
    dtypes = {sig.item_dtype(item) for item, fmt in enumerate(sig.fmt) if fmt != 0 and fmt}
    return dtypes.pop() if len(dtypes) == 1 else None


def _gathered(sig, pattern):
    """The symbol of ``sig`` reading its arguments as ``pattern`` says
    (sources, gathers and cuts; see :func:`step_program`), and the lane
    axes of each cut (see :func:`~.lanes.vectorize_lists`)."""
    replace, lane_ndims = {}, {}
    names = iter(sig.data_names)
    for item, (fmt, way) in enumerate(zip(sig.fmt, pattern)):
        width = leaf_count(fmt)     # a nested list is cut into its flat leaves
        if width == 0:
            continue
        how, count = way[:2]
        parts = [mx.sym.var('src%d_%d' % (item, part)) for part in range(count)]
        rows = parts[0] if count == 1 else mx.sym.concat(*parts, dim=0)
        lanes = how == 'ragged' or (how == 'take' and element_major(width))
        if how in ('take', 'ragged'):
            rows = mx.sym.take(rows, mx.sym.var('idx%d' % item))
        if fmt == 0:
            replace[next(names)] = rows
        elif width == 1:
            replace[next(names)] = mx.sym.squeeze(rows, axis=1) if how == 'take' else rows
        else:
            # (lanes are written for one row per call: a folded signature
            # goes without, see TracedSignature.folded)
            cut = '%s%d' % (CUT, item) if lanes and not sig.folded else None
            parts = mx.sym.SliceChannel(rows, num_outputs=width, axis=0 if lanes else 1,
                                        squeeze_axis=True, name=cut)
            shapes = {sig.item_shape(item, k) for k in range(width)}
            if cut and len(shapes) == 1:
                lane_ndims[cut] = len(shapes.pop())
            for j in range(width):
                replace[next(names)] = parts[j]
    inputs = set(sig.symbol.list_inputs())      # an ignored argument is none of them
    return sig.symbol(**{name: rows for name, rows in replace.items() if name in inputs}), \
        lane_ndims


def _build(sig, pattern, training):
    symbol, lane_ndims = _gathered(sig, pattern)
    params = {p.name: p for _, p in sig.param_slots}
    tables = {'src%d_0' % item for item, way in enumerate(pattern)
              if way is not None and way[2:] == ('table',)}
    if tables:
        symbol = read_tables(symbol, tables)
    unique = {'src%d_0' % item: way[0] for item, way in enumerate(pattern)
              if way is not None and way[0] in ('unique', 'distinct')}
    if unique:
        shared = set(params) | {name for name in symbol.list_inputs()
                                if name.startswith(TABLE)}
        symbol = share_host_part(symbol, set(unique), shared,
                                 expand_outputs='unique' in unique.values())
    hoisted = tuple(item for item, way in enumerate(pattern)
                    if way is not None and way[0] == 'hoisted')
    if hoisted:
        symbol = hoisted_rest(symbol, host_split(sig, hoisted).boundary)
    if lane_ndims:
        ragged = any(way is not None and way[0] == 'ragged' for way in pattern)
        vectorized = vectorize_lists(symbol, lane_ndims, _lanes_dtype(sig), training, ragged)
        if vectorized is None:
            raise RuntimeError('gluon_dynbatch: %s cannot run its lists ragged '
                               '(please report this)' % sig.describe())
        symbol = compose_takes(vectorized) if ragged else vectorized
    feeds = []
    for name in symbol.list_inputs():
        if name in params:
            feeds.append(('param', params[name]))
        elif name == INVERSE:
            feeds.append(('inverse', None))
        elif name == INVERSE_SEGMENT:
            feeds.append(('inverse_segment', None))
        elif name.startswith(TABLE):
            feeds.append(('table', params[name[len(TABLE):]]))
        elif name.startswith(HOISTED):
            feeds.append(('hoisted', int(name[len(HOISTED):])))
        elif name in (SEGMENT, PADDED):
            feeds.append(('ragged', name))
        elif name.startswith('src'):
            feeds.append(('src', tuple(int(n) for n in name[3:].split('_'))))
        else:
            feeds.append(('idx', int(name[3:])))
    return StepProgram(symbol, feeds, training,
                       rewrite_tanh=sig.dtype is not None and np.dtype(sig.dtype) == np.float32 and
                       sig.ctx.device_type != 'gpu')


INVERSE = 'dynbatch_inverse'
"""The input of a step program that runs on distinct host rows: for each
row of the step, its distinct row (int32)."""

INVERSE_SEGMENT = 'dynbatch_inverse_segment'
"""The input that replaces :data:`INVERSE` taken along
:data:`~.lanes.SEGMENT` (see :func:`compose_takes`): for each element of a
ragged step's lists, the distinct host row of its list (int32)."""


FAST_FORMS_ROWS = {True: 16, False: 4}
"""Steps of fewer calls than this (in training, in inference) run their
block in its own operator forms (:func:`~.trace.own_forms`), not the fast
forms of :func:`~.trace.fast_forms`: with one thread, forward and backward,
``sigmoid`` cost less than ``Activation`` up to ~20 rows, ``tanh`` and a
split into four up to ~8 (at 2 rows: 31 / 32 / 62 us against 38 / 38 /
78); forward alone, they cost the same at 2 rows and more from 4 on."""

TANH_BY_SIGMOID_ROWS = {True: 128, False: 512}
"""Steps of at least this many calls (in training, in inference) compute
``tanh`` as ``2 * sigmoid(2 x) - 1`` (:func:`tanh_by_sigmoid`), on a CPU
where that was measured to pay (:func:`tanh_by_sigmoid_pays`).  The
rewrite adds three ops; an inference step's ops are launched by the
calling thread, which small inference minibatches keep busy, so inference
asks for more rows: at 128 for both, ``auto`` ran 0.96-0.98x at
inference minibatch 25 (three in-process A/B runs), 1.02-1.05x at
training 25 and 1.06-1.09x at training 256 (on a machine where the
rewrite paid)."""

TANH_PROBE_WIDTH = 150
"""Row width of :func:`tanh_by_sigmoid_pays`'s probe (the Tree-LSTM's)."""

TANH_BY_SIGMOID_PAYS = {}
"""Per mode (``True``: training, ``False``: inference), whether computing
``tanh`` through ``sigmoid`` pays on this machine: filled by
:func:`tanh_by_sigmoid_pays` at first need.  Set an entry to skip its
probe: ``True`` makes steps of :data:`TANH_BY_SIGMOID_ROWS` calls or more
take the rewrite, ``False`` keeps MXNet's ``tanh`` (as does an infinite
:data:`TANH_BY_SIGMOID_ROWS`)."""

_PROBE_LOCK = threading.Lock()     # one probe at a time: concurrent ones skew each other


def tanh_by_sigmoid_pays(training):
    """Whether :func:`tanh_by_sigmoid` made a step of
    :data:`TANH_BY_SIGMOID_ROWS` rows faster on this machine (its forward,
    and in training its backward too): measured once per process and mode,
    at the first step that large, in ~5-20 ms, and kept in
    :data:`TANH_BY_SIGMOID_PAYS`.

    Why measure: MKLDNN's ``tanh`` against its ``sigmoid`` depends on the
    processor.  Where the rewrite was written, ``tanh`` cost ~2.6x
    ``sigmoid`` and the rewrite won; on a later machine (AMD EPYC, family
    25, AVX-512), at 512 x 150 in a CachedOp, ``tanh`` cost 1.15x
    ``sigmoid`` and the rewrite lost 2.3x in inference and training alike.
    The probe runs in a thread of its own, so that it neither joins nor
    disturbs the caller's ``autograd.record()``, and one thread at a time
    (threads reaching it together wait for the first one's answer).  A
    wrong "pays" costs more than a wrong "does not", and other threads'
    work queued on the engine delays whichever form it lands behind, so
    the rewrite must win in all but one of seven turns (the two forms
    timed back to back in each, in alternating order) and by 10% in the
    median turn.  The flush that probes counts as one that built a program
    (:func:`programs_built`): the cost model does not learn from its time."""
    pays = TANH_BY_SIGMOID_PAYS.get(training)
    if pays is not None:
        return pays
    with _PROBE_LOCK:
        pays = TANH_BY_SIGMOID_PAYS.get(training)
        if pays is None:
            found = []

            def probe():
                try:
                    found.append(_time_tanh_forms(training))
                except mx.base.MXNetError:      # no answer keeps MXNet's tanh
                    pass
            thread = threading.Thread(target=probe, name='dynbatch-tanh-probe')
            thread.start()
            thread.join()
            _count_build()
            ratios = sorted(rewritten / plain for plain, rewritten in found[0]) \
                if found else [float('inf')]
            pays = sum(r < 1 for r in ratios) >= len(ratios) - 1 and \
                ratios[len(ratios) // 2] < 0.9
            TANH_BY_SIGMOID_PAYS[training] = pays
    return pays


def _time_tanh_forms(training, turns=7):
    """Seconds of a ``tanh`` step of :data:`TANH_BY_SIGMOID_ROWS` rows as
    MXNet's op and rewritten, ``[(plain, rewritten)]`` per turn (after one
    that warms up)."""
    x = mx.sym.var('x')
    plain = mx.sym.Activation(x, act_type='tanh')
    ops = [mx.nd.CachedOp(plain), mx.nd.CachedOp(tanh_by_sigmoid(plain))]
    rows = max(TANH_BY_SIGMOID_ROWS[training], 1)
    data = mx.nd.array(np.random.RandomState(0).uniform(-3, 3, (rows, TANH_PROBE_WIDTH)))
    data.attach_grad()

    def seconds(op):
        start = time.perf_counter()
        if training:
            with mx.autograd.record():
                out = op(data)
            out.backward()
            data.grad.wait_to_read()
        else:
            op(data).wait_to_read()
        return time.perf_counter() - start

    for op in ops:
        seconds(op)
    times = []
    for turn in range(turns):
        first, second = ops if turn % 2 == 0 else ops[::-1]
        a, b = seconds(first), seconds(second)
        times.append((a, b) if turn % 2 == 0 else (b, a))
    return times


def tanh_by_sigmoid(symbol):
    """``symbol`` with every ``Activation(act_type='tanh')`` computed as
    ``2 * sigmoid(2 x) - 1`` (the same value to ~2e-7 absolute, not relative:
    ``tanh(1e-8)`` comes out 0), or ``symbol``
    itself when it has none.  Not those :func:`~.trace.fast_forms` made of
    a ``tanh`` op (marked :data:`~.trace.EXACT`), whose values per sample
    were MXNet's ``tanh``.

    Where it was written, MKLDNN's ``tanh`` in MXNet 1.9.1 cost ~2.6x its
    ``sigmoid`` per element (not everywhere: :func:`tanh_by_sigmoid_pays`
    measures it): on 2,500 x 150 floats, one thread, the rewrite ran the forward
    in 1.44 ms instead of 2.58 and forward + backward in 4.4 ms instead of
    7.0; at 50 rows, where each op's fixed cost rules, it lost 5% (0.41
    against 0.39 ms), hence :data:`TANH_BY_SIGMOID_ROWS`.  The input list
    is unchanged, so the program's feeds are too."""
    graph = json.loads(symbol_json(symbol))
    nodes = graph['nodes']

    def is_tanh(node):
        attrs = node.get('attrs', {})
        return node['op'] == 'Activation' and attrs.get('act_type') == 'tanh' and \
            EXACT not in attrs

    if not any(is_tanh(node) for node in nodes):
        return symbol
    out, moved = [], {}
    for old, node in enumerate(nodes):
        node = dict(node)
        node['inputs'] = [moved_entry(entry, moved) for entry in node['inputs']]
        if is_tanh(node):
            name = node['name']
            out.append({'op': '_mul_scalar', 'name': name + '_x2', 'attrs': {'scalar': '2'},
                        'inputs': node['inputs']})
            out.append({'op': 'Activation', 'name': name + '_sig',
                        'attrs': {'act_type': 'sigmoid'}, 'inputs': [[len(out) - 1, 0, 0]]})
            out.append({'op': '_mul_scalar', 'name': name + '_y2', 'attrs': {'scalar': '2'},
                        'inputs': [[len(out) - 1, 0, 0]]})
            out.append({'op': '_plus_scalar', 'name': name, 'attrs': {'scalar': '-1'},
                        'inputs': [[len(out) - 1, 0, 0]]})
        else:
            out.append(node)
        moved[old] = len(out) - 1
    return load_graph(graph, out, [moved_entry(entry, moved) for entry in graph['heads']])


def adds_by_broadcast(symbol):
    """``symbol`` with every ``elemwise_add`` made a ``broadcast_add`` (the
    same values for operands of one shape), or ``symbol`` itself when it
    has none.  Programs that autograd records (step programs for training)
    get this.

    MXNet 1.9.1 fails otherwise (apache/mxnet issue 20293): the gradient
    of ``elemwise_add`` is one array cloned to both operands, and when an
    operand reached from the program's inputs needs no gradient (a user's
    NDArray, host rows, a frozen parameter), a backward with
    ``static_alloc`` drops or misroutes the other's (a block computing
    ``tanh(x + W h)`` with ``x`` such an input got zero or garbage
    gradients for ``W``) and one without fails MXNet's storage-type check.
    ``broadcast_add`` computes its gradients itself and runs correctly; so
    did ``add_n``, ``elemwise_sub``, ``elemwise_mul``,
    ``Concat`` and ``dot``, and ``elemwise_add`` of two values computed in
    the program (only an input as operand went wrong)."""
    graph = json.loads(symbol_json(symbol))
    nodes = graph['nodes']
    if not any(node['op'] == 'elemwise_add' for node in nodes):
        return symbol
    # an add whose operand comes from a constant of a shape left open (an
    # RNN's default begin state, ``zeros(shape=(0, H))``, through its h2h
    # layer) keeps elemwise_add: only it tells that 0 dimension from the
    # other operand, which broadcast_add cannot
    for node, opened in zip(nodes, _open_shaped(nodes)):    # (``a + b``, ``_plus`` and ``_Plus``
        if node['op'] == 'elemwise_add' and not opened:    # are saved as elemwise_add)
            node['op'] = 'broadcast_add'    # neither has parameters: attributes stay
    return load_graph(graph, nodes, graph['heads'])


INDEXED_OPS = ('Embedding', '_contrib_SparseEmbedding')
"""Ops that refuse a gradient for their indices (input 0)."""


def indices_without_gradient(symbol):
    """``symbol`` with every :data:`INDEXED_OPS` op reading its indices
    through ``BlockGrad``, or ``symbol`` itself when it has none.
    Programs that autograd records get this.

    Per sample, MXNet records an op only when an input carries a gradient,
    so indices computed from host data alone (an RNN step's next position,
    ``pos + 1`` of a numpy ``pos``) stay outside autograd's graph, and
    ``Embedding``, which refuses a gradient for its indices, reads them
    fine.  Batched, such indices may be rows of a step output that
    autograd recorded (the step also read parameters, or other rows of it
    carry gradients), and backward failed ('Embedding layer doesn't
    support calculate data gradient').  Indices have no gradient to lose."""
    graph = json.loads(symbol_json(symbol))
    nodes = graph['nodes']
    blocked = ('BlockGrad', 'stop_gradient')
    if not any(node['op'] in INDEXED_OPS and nodes[node['inputs'][0][0]]['op'] not in blocked
               for node in nodes):
        return symbol
    out, moved = [], {}
    for old, node in enumerate(nodes):
        inputs = [moved_entry(entry, moved) for entry in node['inputs']]
        if node['op'] in INDEXED_OPS and nodes[node['inputs'][0][0]]['op'] not in blocked:
            out.append({'op': 'BlockGrad', 'name': node['name'] + '_indices', 'attrs': {},
                        'inputs': [inputs[0]]})
            inputs[0] = [len(out) - 1, 0, 0]
        out.append(dict(node, inputs=inputs))
        moved[old] = len(out) - 1
    return load_graph(graph, out, [moved_entry(entry, moved) for entry in graph['heads']])


def compose_takes(symbol):
    """``symbol`` with every ``take`` along :data:`~.lanes.SEGMENT` of a
    ``take`` by :data:`INVERSE` that nothing else reads made one ``take``
    by :data:`INVERSE_SEGMENT`, an index composed on the host.

    A value of a ragged step's host part that every element of a list
    reads (the Tree-LSTM's ``f_x``) is first expanded from the distinct
    host rows to one row per call, then to one per element: two gathers,
    and two in backward, where one does."""
    graph = json.loads(symbol_json(symbol))
    nodes = graph['nodes']
    readers = graph_readers(nodes, graph['heads'])

    def is_take_along(node, index):
        return node['op'] == 'take' and len(node['inputs']) == 2 and \
            node.get('attrs', {}).get('axis', '0') == '0' and \
            node.get('attrs', {}).get('mode', 'clip') == 'clip' and \
            nodes[node['inputs'][1][0]]['op'] == 'null' and \
            nodes[node['inputs'][1][0]]['name'] == index

    composed = {}       # outer take -> the inner take it reads
    for i, node in enumerate(nodes):
        if is_take_along(node, SEGMENT):
            inner = node['inputs'][0][0]
            if is_take_along(nodes[inner], INVERSE) and len(readers[inner]) == 1:
                composed[i] = inner
    if not composed:
        return symbol
    skipped = set(composed.values())
    out, moved = [], {}
    for old, node in enumerate(nodes):
        if old in skipped:
            continue
        if old in composed:
            source = moved_entry(nodes[composed[old]]['inputs'][0], moved)
            moved[old] = _take_along(out, moved, source, node['name'], INVERSE_SEGMENT)
            continue
        node = dict(node)
        node['inputs'] = [moved_entry(entry, moved) for entry in node['inputs']]
        moved[old] = len(out)
        out.append(node)
    return load_graph(graph, out, [moved_entry(entry, moved) for entry in graph['heads']])


def _host_kinds(nodes, heads, host, shared):
    """Per node of a symbol's JSON (with ``heads``): ``'host'`` (a function
    of the ``host`` inputs, and maybe of ``shared`` ones), ``'shared'`` (of
    ``shared`` inputs alone) or ``'other'``.  An op that may give other
    outputs for equal inputs is ``'other'``: one that draws random numbers
    (:func:`~.rules.draws_random`), a custom op or one whose rule the user
    registered without ``function_of_inputs=True``
    (:data:`~.rules.NOT_FUNCTIONS`); equal rows must not share one run of
    it.  So is an op that may batch on axis 1
    (:func:`~.trace.may_batch_on_axis_1`) whose value an ``'other'`` op or
    an output reads: the host part hands its values on by a ``take`` along
    axis 0, and such a value may have its batch on axis 1 (a fused layer's
    swapped input, read by an ``RNN`` that draws random numbers or takes
    begin states per sample); the part then ends before it."""
    cut = set()
    while True:
        kinds = []
        for number, node in enumerate(nodes):
            if node['op'] == 'null':
                name = node['name']
                kinds.append('host' if name in host else 'shared' if name in shared else
                             'other')
                continue
            below = {kinds[entry[0]] for entry in node['inputs']}
            if 'other' in below or number in cut or node['op'] in NOT_FUNCTIONS or \
                    draws_random(node['op'], node.get('attrs')):
                kinds.append('other')
            else:
                kinds.append('host' if 'host' in below else 'shared')
        handed = [entry[0] for node, kind in zip(nodes, kinds) if kind == 'other'
                  for entry in node['inputs']] + [entry[0] for entry in heads]
        more = {old for old in handed
                if kinds[old] == 'host' and may_batch_on_axis_1(nodes[old])}
        more |= _open_shared_of_both(nodes, kinds, handed)
        if not more:
            return kinds
        cut |= more


def _open_shaped(nodes, among=None):
    """Per node of a symbol's JSON, whether its value has a shape left open
    for MXNet to infer: a constant with a 0 in its shape
    (:func:`~.trace.constant_shape`), or an op reading such a value; only
    the nodes that ``among`` (per node, default all) admits count."""
    opened = []
    for number, node in enumerate(nodes):
        shape = constant_shape(node)
        opened.append((among is None or among[number]) and (
            (shape is not None and 0 in shape) or
            any(opened[entry[0]] for entry in node['inputs'])))
    return opened


def _open_shared_of_both(nodes, kinds, handed):
    """The ``'shared'`` nodes of a shape left open (a constant of open
    rows, ``zeros(shape=(0, H))``, a cell's default begin state, or a value
    computed from one) that a ``'host'`` op reads and that is ``handed``
    (read by an ``'other'`` op or an output) too: one node, whose rows MXNet
    infers from its readers, would need the distinct host rows' count for
    the one and the batch's for the other (MXNet failed, 'expected [12,3],
    got [2,3]').  Cut, the host ops that read it leave the part."""
    open_shape = _open_shaped(nodes, [kind == 'shared' for kind in kinds])
    by_host = {entry[0] for node, kind in zip(nodes, kinds) if kind == 'host'
               for entry in node['inputs']}
    return {old for old in handed if open_shape[old] and old in by_host}


def host_part(symbol, host, shared):
    """``(has_ops, outputs_host)``: whether any op of ``symbol`` is a
    function of the inputs named ``host`` (and of the ``shared`` ones)
    alone (only then does running a step on distinct host rows save work),
    and whether every output is."""
    graph = json.loads(symbol_json(symbol))
    nodes = graph['nodes']
    kinds = _host_kinds(nodes, graph['heads'], host, shared)
    return (any(kind == 'host' and node['op'] != 'null' for kind, node in zip(kinds, nodes)),
            all(kinds[head[0]] == 'host' for head in graph['heads']))


TABLE = 'dynbatch_table:'
"""Prefix of the inputs that replace an embedding weight read by host
indices (see :func:`read_tables`)."""


def embedding_reads(symbol, host, params):
    """``{host input: [weight names]}`` for the inputs named ``host`` that
    are read only as the indices of ``Embedding`` ops with dense gradients
    whose weights are named in ``params``: such an input can carry
    positions in a table of the rows the flush reads instead
    (:func:`read_tables`)."""
    nodes = json.loads(symbol_json(symbol))['nodes']
    index = {node['name']: i for i, node in enumerate(nodes) if node['op'] == 'null'}
    reads = {name: [] for name in host if name in index}
    for node in nodes:
        for slot, entry in enumerate(node['inputs']):
            name = nodes[entry[0]]['name'] if nodes[entry[0]]['op'] == 'null' else None
            if name not in reads or reads[name] is None:
                continue
            weight = nodes[node['inputs'][1][0]] if len(node['inputs']) > 1 else None
            if node['op'] == 'Embedding' and slot == 0 and weight['op'] == 'null' and \
                    weight['name'] in params and \
                    node.get('attrs', {}).get('sparse_grad', 'False') in ('False', 'false', '0'):
                reads[name].append(weight['name'])
            else:
                reads[name] = None
    return {name: weights for name, weights in reads.items() if weights}


def read_tables(symbol, host):
    """``symbol`` with every ``Embedding`` whose indices are an input named
    in ``host`` turned into a ``take`` from a new input ``TABLE + weight
    name``: the rows of the weight that the flush reads, gathered once per
    flush (so a training step writes one dense weight gradient per flush,
    not one per step), with the host input carrying positions in it."""
    graph = json.loads(symbol_json(symbol))
    nodes = graph['nodes']
    out, moved, tables = [], {}, {}
    for old, node in enumerate(nodes):
        node = dict(node)
        data = node['inputs'][0] if node['inputs'] else None
        if node['op'] == 'Embedding' and nodes[data[0]]['op'] == 'null' and \
                nodes[data[0]]['name'] in host:
            name = TABLE + nodes[node['inputs'][1][0]]['name']
            if name not in tables:
                tables[name] = len(out)
                out.append({'op': 'null', 'name': name, 'inputs': []})
            node.update(op='take', attrs={'axis': '0', 'mode': 'clip'},
                        inputs=[[tables[name], 0, 0], moved_entry(data, moved)])
        else:
            node['inputs'] = [moved_entry(e, moved) for e in node['inputs']]
        moved[old] = len(out)
        out.append(node)
    return load_graph(graph, out, [moved_entry(e, moved) for e in graph['heads']])


def share_host_part(symbol, host, shared, expand_outputs=True):
    """``symbol`` rewritten to take the inputs named ``host`` as distinct
    rows: the ops that depend on them (and on ``shared`` inputs) alone run
    on those rows, and every value they hand to the rest of the graph (or
    to the outputs, unless not ``expand_outputs``) is expanded back to one
    row per call by a ``take`` with the new input :data:`INVERSE`.
    Row-wise ops make this exact: row ``i`` of the expansion is what row
    ``i`` would have computed."""
    graph = json.loads(symbol_json(symbol))
    nodes = graph['nodes']
    kinds = _host_kinds(nodes, graph['heads'], host, shared)
    out, moved, expanded = [], {}, {}

    def expand(entry):
        """The new entry for old ``entry``, read by an 'other' op."""
        old, index = entry[0], entry[1]
        if kinds[old] != 'host':
            return [moved[old], index, 0]
        key = (old, index)
        if key not in expanded:
            expanded[key] = _take_along(out, moved, [moved[old], index, 0],
                                        'dynbatch_expand%d' % (len(expanded) + 1))
        return [expanded[key], 0, 0]

    for old, node in enumerate(nodes):
        node = dict(node)
        if kinds[old] == 'other':
            node['inputs'] = [expand(entry) for entry in node['inputs']]
        else:
            node['inputs'] = [moved_entry(e, moved) for e in node['inputs']]
        moved[old] = len(out)
        out.append(node)
    return load_graph(graph, out, [expand(entry) if expand_outputs else moved_entry(entry, moved)
                              for entry in graph['heads']])


class HostSplit:
    """The host part of a symbol cut out as its own program (see
    :func:`split_host_part`): ``symbol`` computes the ``boundary`` values
    (``(op name, output)`` in ``symbol``'s output order) from the host
    inputs and parameters; ``key`` is equal for two splits exactly when their
    symbols compute the same values from the same parameters (op names
    aside), so one run serves the steps of both.  :func:`host_split` adds
    the ``cached_op`` and its ``feeds`` (``('host', position among the
    host inputs)`` or ``('param', Parameter)``)."""
    __slots__ = ('key', 'symbol', 'boundary', 'cached_op', 'feeds')

    def __init__(self, key, symbol, boundary):
        self.key, self.symbol, self.boundary = key, symbol, boundary
        self.cached_op = self.feeds = None


HOISTED = 'dynbatch_hoisted'
"""Prefix of the inputs that bring a step program the values of its host
part, computed once per flush (see :func:`split_host_part`)."""


def host_split(sig, items):
    """The :class:`HostSplit` of ``sig`` for its host arguments ``items``
    (top-level argument numbers), or None; made once per signature."""
    items = tuple(items)
    found = sig.host_splits.get(items, False)
    if found is False and sig.folded:
        # (its host part may hand on values of several rows per call, which
        # a take of one row per call cannot: see TracedSignature.folded)
        found = sig.host_splits[items] = None
    if found is False:
        names = [sig.data_names[sig.item_pos(item)] for item in items]
        params = {p.name: p for _, p in sig.param_slots}
        found = sig.host_splits[items] = split_host_part(sig.symbol, names, set(params))
        if found is not None:
            found.cached_op = ThreadCachedOp(found.symbol)
            found.feeds = [('host', names.index(name)) if name in names else
                           ('param', params[name]) for name in found.symbol.list_inputs()]
            # the same parameters by identity: two blocks may name theirs alike
            found.key = (found.key, tuple(id(what) for kind, what in found.feeds
                                          if kind == 'param'))
    return found


def split_host_part(symbol, host, shared):
    """A :class:`HostSplit` of the ops of ``symbol`` that depend on the
    inputs named in ``host`` (a sequence) and on ``shared`` ones alone, or
    None when there are none, or when a host input itself (not an op on it)
    is read by the rest.

    A flush runs that part once over the distinct host rows of all the
    steps whose splits have the same key (at SICK minibatch 256, the
    embedding and ``i2h`` GEMM of 510 distinct tokens instead of 930 rows
    summed over the steps that each deduplicated their own), and each step
    program reads the values by ``take`` (:func:`hoisted_rest`)."""
    host = list(host)
    graph = json.loads(symbol_json(symbol))
    nodes = graph['nodes']
    kinds = _host_kinds(nodes, graph['heads'], set(host), shared)
    boundary = []
    for node in [n for n, kind in zip(nodes, kinds) if kind == 'other'] + \
            [{'inputs': graph['heads']}]:
        for entry in node['inputs']:
            if kinds[entry[0]] == 'host' and (entry[0], entry[1]) not in boundary:
                boundary.append((entry[0], entry[1]))
    if not boundary or any(nodes[old]['op'] == 'null' for old, _ in boundary):
        return None
    keep, stack = set(), [old for old, _ in boundary]
    while stack:
        old = stack.pop()
        if old not in keep:
            keep.add(old)
            stack += [entry[0] for entry in nodes[old]['inputs']]
    out, moved, canonical = [], {}, []
    for old, node in enumerate(nodes):
        if old not in keep:
            continue
        node = dict(node, inputs=[moved_entry(e, moved) for e in node['inputs']])
        moved[old] = len(out)
        out.append(node)
        name = None if node['op'] != 'null' else \
            'host%d' % host.index(node['name']) if node['name'] in host else node['name']
        canonical.append((node['op'], name, sorted(node.get('attrs', {}).items()),
                          node['inputs']))
    heads = [[moved[old], index, 0] for old, index in boundary]
    key = json.dumps([canonical, heads])
    return HostSplit(key, load_graph(graph, out, heads),
                     [(nodes[old]['name'], index) for old, index in boundary])


def hoisted_rest(symbol, boundary):
    """``symbol`` with each value of ``boundary`` (``(op name, output)``,
    see :class:`HostSplit`) read from input ``HOISTED + position``, taken by
    :data:`INVERSE`: the ops that made those values are gone."""
    graph = json.loads(symbol_json(symbol))
    nodes = graph['nodes']
    named = {}
    for old, node in enumerate(nodes):
        if node['op'] != 'null':
            named.setdefault(node['name'], []).append(old)
    wanted = {}
    for position, (name, index) in enumerate(boundary):
        if len(named.get(name, ())) != 1:
            raise RuntimeError('gluon_dynbatch: op %r of a step program is not found once '
                               '(please report this)' % name)
        wanted[(named[name][0], index)] = position
    out, moved, taken = [], {}, {}

    def entry_for(entry):
        position = wanted.get((entry[0], entry[1]))
        if position is None:
            return moved_entry(entry, moved)
        if position not in taken:
            out.append({'op': 'null', 'name': HOISTED + str(position), 'inputs': []})
            taken[position] = _take_along(out, moved, [len(out) - 1, 0, 0],
                                          'dynbatch_hoist%d' % position)
        return [taken[position], 0, 0]

    for old, node in enumerate(nodes):
        node = dict(node)
        node['inputs'] = [entry_for(entry) for entry in node['inputs']]
        moved[old] = len(out)
        out.append(node)
    return load_graph(graph, out, [entry_for(entry) for entry in graph['heads']])


def _take_along(out, moved, source, name, index=INVERSE):
    """Append to the JSON nodes ``out`` a ``take`` of entry ``source`` by
    the input named ``index`` (added to ``out`` at first use, its position
    kept in ``moved``); return the take's position."""
    if index not in moved:
        moved[index] = len(out)
        out.append({'op': 'null', 'name': index, 'inputs': []})
    out.append({'op': 'take', 'name': name, 'attrs': {'axis': '0', 'mode': 'clip'},
                'inputs': [source, [moved[index], 0, 0]]})
    return len(out) - 1


class FlushProgram:
    """A whole plan compiled into one CachedOp: ``feeds`` says per input
    whether it is a parameter (a weak reference to it), a constant (a
    recorded gather index or a zero row), host rows to read from the flush
    (``('host', (step, item))``), a hoisted group's distinct host rows
    (``('hoist_rows', (group, k))``) or its inverse (``('hoist_inverse',
    group)``); ``out_counts`` says how many
    of the outputs belong to each step, ``hoists`` per hoisted group its
    members ``(step, host items, rows)``.  Only for inference: see
    :class:`~.plan.CachedPlan`."""
    __slots__ = ('cached_op', 'feeds', 'out_counts', 'hoists', 'ctx')

    def __init__(self, symbol, feeds, out_counts, hoists, ctx):
        # A structure fixes every shape but a hoisted group's number of
        # distinct rows, so without hoisting memory is planned once
        # (static_shape; ~10% faster at SICK minibatch 25).  Outputs are
        # still fresh arrays on every call (tests/test_cost.py checks it).
        flags = [('static_alloc', True)] + ([] if hoists else [('static_shape', True)])
        self.cached_op = ThreadCachedOp(symbol, flags)
        self.feeds = feeds
        self.out_counts = out_counts
        self.hoists = hoists
        self.ctx = ctx


def flush_program(steps, recipes, hoists=()):
    """One :class:`FlushProgram` for ``steps`` whose every argument has a
    replayable recipe (see :func:`~.execute.run_step`), or None when one
    has not (it reads user NDArrays or an earlier flush) or the steps span
    several contexts.  Called outside ``autograd.record()`` only.
    ``hoists`` (see :func:`~.execute.flush_hoists`) are groups of steps
    whose host part runs once, inside the program, over the distinct host
    rows of all its members."""
    if len({step.sig.ctx for step in steps}) != 1 or \
            any(recipe is None or None in recipe for recipe in recipes):
        return None
    inputs = _ProgramInputs(steps[0].sig.ctx)
    hoisted = _hoisted_parts(hoists, inputs)
    outputs = []    # per step, its output symbols
    for number, (step, recipe) in enumerate(zip(steps, recipes)):
        symbol = _step_symbol(steps, number, recipe, hoisted.get(number), outputs, inputs)
        outputs.append([symbol[i] for i in range(len(symbol.list_outputs()))])
    group = mx.sym.Group([out for outs in outputs for out in outs])
    # parameters by weak reference: a program kept by a plan cache must not
    # keep a dropped model's parameters alive (its plan, whose signatures
    # are gone, is never run again: see CachedPlan)
    feeds = [('param', weakref.ref(inputs.params[name])) if name in inputs.params
             else inputs.spec[name] for name in group.list_inputs()]
    return FlushProgram(group, feeds, [len(outs) for outs in outputs],
                        [members for _, members in hoists], inputs.ctx)


class _ProgramInputs:
    """The inputs of a flush program being built: ``spec``, what feeds
    each variable by name (see :class:`FlushProgram`), and ``params``, the
    Parameter each parameter variable reads."""

    def __init__(self, ctx):
        self.ctx, self.spec, self.params = ctx, {}, {}

    def var(self, name, feed):
        """A variable ``name`` fed by ``feed``."""
        self.spec[name] = feed
        return mx.sym.var(name)

    def param_var(self, param):
        """The program's input for ``param``, one per Parameter object:
        its own variable, unless an equally named parameter of another
        block took that name."""
        name, number = param.name, 0
        while self.params.setdefault(name, param) is not param:
            number += 1
            name = '%s_dynbatch%d' % (param.name, number)
        return param.var() if name == param.name else \
            mx.sym.var(name, shape=param.shape, dtype=param.dtype)


def _hoisted_parts(hoists, inputs):
    """Step number -> (its host items, the values of its group's host part
    over the group's distinct rows, the step's rows of their inverse
    index), for the steps of ``hoists``."""
    hoisted = {}
    for group, (split, members) in enumerate(hoists):
        bind = {}
        for name, (kind, what) in zip(split.symbol.list_inputs(), split.feeds):
            bind[name] = inputs.var('hoist%d_%d' % (group, what), ('hoist_rows', (group, what))) \
                if kind == 'host' else inputs.param_var(what)
        values = split.symbol(**bind)
        inverse = inputs.var('hoist%d_inverse' % group, ('hoist_inverse', group))
        start = 0
        for number, items, rows in members:
            hoisted[number] = (items, values, mx.sym.slice_axis(
                inverse, axis=0, begin=start, end=start + rows))
            start += rows
    return hoisted


def _step_symbol(steps, number, recipe, hoisted, outputs, inputs):
    """Step ``number``'s program, its inputs bound to the program's: its
    recipe's sources (earlier steps' ``outputs``, host rows, zero rows,
    gather indices), its hoisted part's values and its parameters."""
    step = steps[number]
    sig = step.sig
    items, values, inverse = hoisted or ((), None, None)
    pattern = tuple(None if how == 'empty' else ('hoisted', 1) if item in items else
                    ('direct' if how == 'host' or how[1] is None else
                     'ragged' if len(how) > 2 else 'take', 1)
                    for item, how in enumerate(recipe))
    program = step_program(sig, pattern).for_rows(len(step.nodes)).symbol
    wanted = set(program.list_inputs())
    bind = {}
    for how in recipe:
        if how not in ('empty', 'host') and len(how) > 2:   # ragged lists' inputs
            for name in (SEGMENT, PADDED):
                if name in wanted or name == SEGMENT and INVERSE_SEGMENT in wanted:
                    bind[name] = inputs.var('%s_s%d' % (name, number), ('const', how[2][name]))
            break
    if items:
        bind[INVERSE] = inverse
        if INVERSE_SEGMENT in wanted:
            bind[INVERSE_SEGMENT] = mx.sym.take(inverse, bind[SEGMENT], axis=0)
        for position in range(len(values.list_outputs())):
            bind[HOISTED + str(position)] = values[position]
    for item, how in enumerate(recipe):
        if how != 'empty' and item not in items:
            bind.update(_item_inputs(steps, number, item, how, outputs, inputs))
    for _, param in sig.param_slots:   # one input per parameter, shared by all steps
        bind[param.name] = inputs.param_var(param)
    return program(**{name: value for name, value in bind.items() if name in wanted})


def _item_inputs(steps, number, item, how, outputs, inputs):
    """The program inputs of argument ``item`` of step ``number``, read as
    its recipe says (``how``): its host rows, or its sources (earlier
    steps' outputs and zero rows, narrowed and concatenated) and their
    gather index."""
    name = 's%d_%d' % (number, item)
    if how == 'host':
        return {'src%d_0' % item: inputs.var('host_' + name, ('host', (number, item)))}
    sig = steps[number].sig
    parts, index = how[:2]
    sources, sizes = [], []
    for step_number, out in parts:
        if step_number < 0:   # padding: a zero row
            sources.append(inputs.var('zero_' + name, ('const', mx.nd.zeros(
                sig.item_shape(item), ctx=inputs.ctx, dtype=sig.item_dtype(item)))))
            sizes.append(1)
        else:
            sources.append(outputs[step_number][out])
            sizes.append(len(steps[step_number].nodes))
    if index is not None and len(sources) > 1:
        sources, index = _narrow(sources, sizes, index, name, inputs.spec)
    bind = {'src%d_0' % item: sources[0] if len(sources) == 1 else
            mx.sym.concat(*sources, dim=0)}
    if index is not None:
        bind['idx%d' % item] = inputs.var('idx_' + name, ('const', index))
    return bind


NARROW_ROWS = 32
"""A gathered argument's source is cut down to the rows read from it when
that leaves out at least this many rows and half of its rows."""


def _narrow(sources, sizes, index, name, spec):
    """``(sources, index)`` for gathering ``index`` (a device array of
    positions in the concatenation of ``sources``, of ``sizes`` rows each)
    that copies less: a source read for few of its rows is replaced by a
    ``take`` of those rows (constant ``'narrow_' + name + part``, added to
    ``spec``), and a source read for none is dropped.  In a compiled SICK
    plan every node step reads children from the leaf step's output (~2,500
    rows at minibatch 256), and concatenating all of it for every gather
    copied ~90 MB a flush."""
    flat = index.asnumpy().ravel()
    starts = np.concatenate([[0], np.cumsum(sizes)])
    part_of = np.searchsorted(starts, flat, side='right') - 1
    narrowed, positions, start = [], np.empty_like(flat), 0
    for part, (source, size) in enumerate(zip(sources, sizes)):
        read = part_of == part
        if not read.any():
            continue
        local = flat[read] - starts[part]
        rows, where = np.unique(local, return_inverse=True)
        if size - len(rows) >= NARROW_ROWS and 2 * len(rows) <= size:
            key = 'narrow_%s_%d' % (name, part)
            spec[key] = ('const', mx.nd.array(rows, ctx=index.context, dtype='int32'))
            narrowed.append(mx.sym.take(source, mx.sym.var(key)))
            positions[read] = start + where
            start += len(rows)
        else:
            narrowed.append(source)
            positions[read] = start + local
            start += size
    return narrowed, mx.nd.array(positions.reshape(index.shape), ctx=index.context,
                                 dtype=index.dtype)
