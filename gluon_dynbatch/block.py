"""The user-facing pieces: :class:`DynBatchBlock` and the :func:`~gluon_dynbatch.batching`
scope.

Inside a scope, calling a wrapped block records one :class:`~.graph.Node`
and returns lazy results; nothing is computed.  The scope runs what was
recorded, batched, when it exits or when a lazy value is read.  Outside any
scope a wrapped block is just the block it wraps.
"""
import ast
import collections
import functools
import gc
import itertools
import json
import numbers
import operator
import struct
import sys
import threading
import time
import warnings
import weakref
from contextlib import contextmanager

import mxnet as mx
import numpy as np
from mxnet import autograd
from mxnet.gluon import Block
from mxnet.ndarray.ndarray import _DTYPE_NP_TO_MX

from . import accel, debug
from .errors import (InputError, ManySignaturesWarning, PerSampleWarning, ScopeError, user_line,
                     user_stacklevel)
from .execute import (changed_parameters_error, collect, pad_leaves, rows_of, run_plan,
                      threaded_engine, to_device)
from .graph import (_LAZY_OPERATOR, DONE, FAILED, OPERATOR_BLOCKS, PENDING, LazyValue, Node,
                    data_marked, lazy_results, recorded, repeat_node, shared_results)
from .lower import INDEXED_OPS, make_cached_op, op_local, programs_built, ragged_lists
from .plan import SETUP, STRATEGIES, Strategy, check_plan, summarize
from .rules import draws_random
from .trace import (blocks_of, common_dtype, error_line, flatten, graph_readers, inputs_below,
                    leaf_count, load_graph, regroup, symbol_json, trace_signature)

__all__ = ['DynBatchBlock', 'batching', 'concat_rows', 'current_scope', 'private_scope',
           'lazy_operator']

NDArray = mx.nd.NDArray
_LOCAL = accel.scope_holder()     # .scope: this thread's open scope
_SIG_IDS = itertools.count()
_TRACING = threading.RLock()    # see DynBatchBlock._trace
TIMED_EVERY = 64
"""Under a threaded engine a step's host-clock time is only its launch, so
a strategy that learns (``auto``) has any flush whose measurement it still
lacks, and one of its flushes in this many after, wait for each step to
finish, to get real step times (:meth:`~.plan.Strategy.wants_step_times`);
the others overlap Python with the ops and report none."""
_clock = time.perf_counter     # bound once: record() runs per call
PIPELINE_CALLS = 6144
"""The most calls a pipelined scope (``batching(flush_every='auto')``,
inference under the threaded engine) records before it runs them: enough
that each part still batches well, few enough that a large minibatch splits
into parts whose operators run on the engine's worker while Python records
the next part (``benchmarks/bench_pipeline.py``)."""
PIPELINE_FIRST = 1536
"""Calls after which such a scope runs its first part, so that the engine's
worker does not wait for Python to record a whole minibatch (it waits
while these are recorded).  Against 2,048: 1.01-1.05x at SICK inference
256, 1.04-1.09x at 512, 1.06-1.08x at 128 and 0.98-1.02x at 1,024
(``benchmarks/ab_revision.py``, 15 repeats, in three runs; two at 512);
1,024 ran 0.86x at 256 (more, smaller parts).  Against 1,536 at
inference 256, later, in one process (40 rounds): 1,024, 768 and 512 ran
0.985x, 0.909x and 0.897x."""
PIPELINE_NEXT = 2048
"""Calls after which such a scope runs its next part if the engine's worker
has run most of the part before (see :meth:`BatchingScope.pipeline`); a
SICK minibatch of 256 pairs (~5,000 calls made, ~2,900 recorded: calls
that repeat a pending one are not, see :func:`repeat_key`) then runs as
two parts.  Parts of 1,024 or 1,536 calls ran 0.86x at inference 256: each
part runs a step per depth, so more parts make more, smaller steps."""
PIPELINE_CHECK = 256
"""While the worker still runs the last part, such a scope looks again
every this many calls."""
PIPELINE_TAIL = 1024
"""Such a scope runs no part that would leave fewer than this many calls
to record, by the size of this thread's last such scope when the one
before it had about as many (minibatches of one size come back; see
``_expected_size``), nor one within this many calls past that size (after
which the scope is longer than predicted and runs parts again): a last
part of a few hundred calls still runs a step per depth, and measured
0.92-0.95x one flush at SICK inference 128 and 192, where the first part
fell just short of the whole minibatch; with a last part of ~700 calls
pipelining was even, with ~1,400 1.13x (``benchmarks/bench_pipeline.py``;
with this rule 0.98-1.03x at 128 and 192 in two runs with both side by
side, 60-80 minibatches a setting)."""
# .last: calls of this thread's two last scopes that followed the engine
_SIZES = threading.local()


def _expected_size():
    """The calls this thread's next scope that follows the engine will
    likely record: its last such scope's, when the one before it had about
    as many (within :data:`PIPELINE_TAIL`), else None (unknown: a
    minibatch of another size, such as the remainder of an evaluation
    pass, or two models taking turns)."""
    before, last = getattr(_SIZES, 'last', (None, None))
    if last is None or before is None or abs(last - before) >= PIPELINE_TAIL:
        return None
    return last


def autograd_mode():
    """The autograd state a call is recorded under, as ``2 * recording +
    training``.  A scope runs its pending calls under theirs, and runs them
    before recording a call under another (a call made inside
    ``autograd.pause()`` in a scope opened under ``autograd.record()`` gets
    no gradient, one made inside ``record()`` in a scope that closes outside
    it does), as per-sample execution would."""
    return 2 * autograd.is_recording() + autograd.is_training()


def current_scope():
    """The open :class:`BatchingScope` of this thread, or None."""
    return getattr(_LOCAL, 'scope', None)


def _run_pending_here():
    """Run the calls pending in this thread's scope, if one is open: before
    what changes how they would run (a cast, forgetting signatures)."""
    scope = getattr(_LOCAL, 'scope', None)
    if scope is not None:
        scope.flush()


MANY_SIGNATURES = 1000
"""Signatures a wrapper traces before it warns, once until
:meth:`DynBatchBlock.forget_signatures`
(:class:`~gluon_dynbatch.ManySignaturesWarning`): a block over arguments
of ever new shapes grew ~0.1 MB a signature (a small block, 1,500 shapes:
+156 MB), with no bound.  The SICK Tree-LSTM traces a few dozen."""

READ_FLUSHES = 32
"""Flushes that reads of pending values ran in one scope before a scope
whose steps held fewer than two calls each on average warns, once a
reading line (see :meth:`BatchingScope.flush_to_read`)."""

_READS_WARNED = set()
"""The user's lines, ``(file, line)``, whose reads the process has warned
about (see :meth:`BatchingScope.flush_to_read`)."""


def _warn_reads(reads):
    where = user_line()
    if where in _READS_WARNED:
        return
    _READS_WARNED.add(where)
    warnings.warn(PerSampleWarning(
        'values read inside a batching() scope ran %d flushes of the calls pending, whose steps '
        'held %.1f calls each on average: correct, but about one call at a time. A read runs '
        'what was recorded before it, so a loop that reads a sample\'s values before it starts '
        'the next sample batches nothing. Advance every sample by a call, then read all their '
        'values (lock-step: docs/performance.rst, "Branch on values in lock-step"), or read '
        'them after the scope; a single sample\'s loop that must read after every call cannot '
        'batch, and runs faster outside a scope.' % (reads[0], reads[1] / reads[2])),
        stacklevel=user_stacklevel())


class BatchingScope:
    """Holds the calls recorded since the last flush, and runs them.

    A *pipelined* scope (see :func:`~gluon_dynbatch.batching`) runs what
    it holds while recording goes on: every ``flush_every`` calls, or, one
    that follows the engine, whenever the engine's worker is done with the
    part before (:meth:`pipeline`).

    Its fields are ``__slots__``: the C recorder reads ``tape``,
    ``pending``, ``flush_at``, ``mode``, ``repeats`` and ``repeated`` at
    every call, straight from the slots."""
    __slots__ = ('strategy', 'pending', 'record_s', 'groups', 'used', 'unsafe', 'tape',
                 'flush_at', 'flush_every', 'follow_engine', 'marker', 'mode', 'thread',
                 'repeats', 'repeated', 'flushed', 'expected', 'failure', 'reads', 'reads_warned')

    def __init__(self, strategy, flush_every=None, follow_engine=False, merge_repeats=True):
        self.strategy = strategy
        self.flush_every = flush_every or sys.maxsize
        self.follow_engine = follow_engine
        # calls pending when the recorder calls pipeline()
        self.flush_at = PIPELINE_FIRST if follow_engine else self.flush_every
        self.marker = None   # follow_engine: set by the engine once it ran most of the last part
        self.flushed = 0     # calls run so far
        # follow_engine: the calls this scope will likely record (see PIPELINE_TAIL)
        self.expected = _expected_size() if follow_engine else None
        # the message of the MXNetError that reading one of this scope's
        # values raised (see LazyValue.asnumpy): every value of it then fails
        self.failure = None
        self.reads = [0, 0, 0]  # flushes a read ran, and their calls and steps
        self.reads_warned = False   # whether they were warned about (flush_to_read)
        self.pending = []
        self.record_s = 0.0
        self.groups = {}     # (depth, family) -> calls
        self.used = {}       # (depth, family) -> calls read by later calls of the flush
        self.unsafe = 0      # calls that must run alone
        # the C recorder's structure key and time (accel.Tape); None in pure Python
        self.tape = accel.Tape() if accel.Tape else None
        self.mode = None     # autograd_mode() of the pending calls (of the last ones when none)
        self.thread = threading.get_ident()     # only this thread may run it (LazyValue.data)
        # repeat_key() -> the first such call's shared_results(); None: off
        self.repeats = {} if merge_repeats else None
        self.repeated = 0    # calls since the last flush that reused a node of repeats

    def record(self, dblock, args):
        """Record one call of ``dblock``; return its lazy result(s).

        A call of a :attr:`~.trace.TracedSignature.repeatable` signature
        whose arguments are all host (numpy) arrays is a function of their
        bytes and of the parameters, which pending calls read when they run
        (together): a later such call with equal bytes, recorded while the
        first one is pending, records no node and gets the first one's
        results, as common-subexpression elimination would: the very same
        lazy values when the call returns one or a pair of them (see
        :func:`~.graph.shared_results`), else new ones of the same node.
        A SICK minibatch of 256 pairs has ~2,500 leaf calls and ~300
        distinct leaf tokens.  A call that ran already is
        not reused: the user's code may have changed a parameter since
        (without any sign MXNet would give).

        This is the reference version; the C extension's recorder
        (:mod:`~gluon_dynbatch.accel`) does the same in C for the common
        case, and defers to this one for everything else (including every
        error)."""
        mode = autograd_mode()
        if mode != self.mode:
            if self.pending:
                self.flush()
            self.mode = mode
            if self.repeats:
                self.repeats = {}
        start = _clock()
        leaves = []
        fmt = flatten(args, leaves)
        key, ctx, depth = _signature_key(dblock, fmt, leaves, self)
        sig = dblock._signatures.get(key)
        if sig is None:
            sig = dblock._trace(key, fmt, ctx)
        if sig.inference is not None and mode == 0:
            sig = sig.inference
        repeat = None
        if sig.repeatable and self.repeats is not None:
            repeat = repeat_key(sig, leaves)
        if repeat is not None:
            first = self.repeats.get(repeat)
            if first is not None and repeat_node(first).state == PENDING:
                self.repeated += 1
                result = lazy_results(first) if type(first) is Node else first
                self.record_s += _clock() - start
                return result
        node = Node(sig, leaves, depth, self, len(self.pending))
        if sig.batch_safe:
            group = (depth, sig.group_key)
            groups = self.groups
            groups[group] = groups.get(group, 0) + 1
        else:
            self.unsafe += 1
        self.pending.append(node)
        if self.tape is not None:
            self.tape.add(node)
        result = lazy_results(node)
        if repeat is not None:
            self.repeats[repeat] = shared_results(node, result)
        self.record_s += _clock() - start
        if len(self.pending) >= self.flush_at:
            self.pipeline()
        return result

    def take(self, repeated=0):
        """``(nodes, summary)``: the pending calls, which the scope forgets,
        and their :func:`~.plan.summarize` summary, whose ``'structure'`` is
        their structure key when the tape wrote it (else None), and whose
        ``'record_s'`` and ``'recorded'`` are the seconds spent recording
        them (the scope's clock starts again) and the calls recorded (with
        the ``repeated`` ones that merged into a pending call)."""
        nodes, self.pending = self.pending, []
        structure = None
        if self.tape is not None:
            structure, seconds, written = self.tape.take()
            self.record_s += seconds
            if written != len(nodes):       # e.g. recorded while the C recorder was off
                structure = None
        # what depth grouping will make: the C recorder leaves the counting
        # to one pass here (part of recording's time), the Python one counts
        # as it goes
        counted = _clock()
        summary = summarize(nodes, None if accel.count_groups else
                            (self.groups, self.used, self.unsafe))
        summary['structure'] = structure
        self.record_s += _clock() - counted
        summary['record_s'], summary['recorded'] = self.record_s, len(nodes) + repeated
        self.record_s = 0.0
        self.groups, self.used, self.unsafe = {}, {}, 0
        return nodes, summary

    def pipeline(self):
        """Called by the recorder once ``flush_at`` calls are pending: run
        them, unless the scope follows the engine, the engine's worker is
        still running the part flushed before and fewer than
        :data:`PIPELINE_CALLS` are pending.  Then it records on and looks
        again :data:`PIPELINE_CHECK` calls later: running a part costs the
        worker less per call the more calls it batches, and the worker is
        busy anyway.  (MXNet cannot say whether an array is ready without
        waiting for it, so the flush pushes a *marker*, an engine operation
        that only sets a flag (``accel.push_marker``), behind the step by
        which all but :data:`PIPELINE_LEAD` of its calls are launched.)
        Nor does it run one that would leave fewer than
        :data:`PIPELINE_TAIL` calls of the size this thread's scopes had
        (``expected``): it records on into one last part, looking again
        every :data:`PIPELINE_TAIL` calls should this scope be longer."""
        done = accel.marker_done
        if self.marker is not None and done is not None and \
                len(self.pending) < self.flush_every and not done(self.marker):
            self.flush_at = min(len(self.pending) + PIPELINE_CHECK, self.flush_every)
            return
        if self.expected is not None and len(self.pending) < self.flush_every:
            left = self.expected - self.flushed - len(self.pending)
            if -PIPELINE_TAIL < left < PIPELINE_TAIL:
                # near the end this thread's scopes had: record on into one
                # last part (and look again, should this scope be longer)
                self.flush_at = min(len(self.pending) + PIPELINE_TAIL, self.flush_every)
                return
        self.flush()

    def close(self):
        """Run what is pending as the scope exits normally, and note its
        size for the next scope of this thread (:data:`PIPELINE_TAIL`)."""
        self.flush()
        if self.follow_engine:
            _SIZES.last = getattr(_SIZES, 'last', (None, None))[1], self.flushed

    def flush(self):
        """Plan and run every pending call, under the autograd state they
        were recorded under (see :func:`autograd_mode`).  Later calls no
        longer share these calls' nodes (see :meth:`record`).  Returns the
        number of calls and of steps run (None when nothing was pending)."""
        if self.repeats:
            self.repeats = {}
        if not self.pending:    # (a call merges only with a pending one)
            return None
        if self.mode is not None and self.mode != autograd_mode():
            recording, training = divmod(self.mode, 2)
            with autograd._RecordingStateScope(bool(recording), bool(training)):
                return self._flush()
        return self._flush()

    def flush_to_read(self):
        """:meth:`flush`, for a read of a pending value (``value.data``).
        A loop that reads each sample's values before it starts the next
        sample batches nothing: after :data:`READ_FLUSHES` such flushes in
        a scope whose steps held fewer than two calls on average, the scope
        warns, once for each line of user code that reads so (two user
        trials' greedy decoders ran so, ~1 call a step, slower than plain
        Gluon, with no sign why; a third's second model, reading at another
        line, got no warning while it was given once a process)."""
        ran = self.flush()
        if ran is None or self.reads_warned:
            return
        reads = self.reads
        reads[0] += 1
        reads[1] += ran[0]
        reads[2] += ran[1]
        if reads[0] >= READ_FLUSHES and reads[1] < 2 * reads[2]:
            self.reads_warned = True
            _warn_reads(reads)

    def _flush(self):
        nodes = self.pending        # failed, not left pending, if take() is interrupted
        self.flushed += len(nodes)
        repeated, self.repeated = self.repeated, 0
        try:
            nodes, summary = self.take(repeated)
            record_ms = summary['record_s'] * 1e3
            built, (checks, check_s) = programs_built(), padding_checks()
            start = time.perf_counter()
            plan = self.strategy.plan(nodes, summary)
            check_plan(plan, nodes, self.strategy)
            if _UNWARNED and self.mode:
                _warn_under_autograd(plan)
            planned = time.perf_counter()
            timed = not threaded_engine() or self.strategy.wants_step_times(TIMED_EVERY)
            mark = _Mark(plan) if self.follow_engine else None
            step_seconds = run_plan(plan, wait=timed and threaded_engine(), after_step=mark)
            done = time.perf_counter()
        except BaseException:
            _fail(nodes)
            raise
        self.strategy.observe(plan, step_seconds if timed else None, planned - start, nodes)
        if self.follow_engine:
            self.flush_at = PIPELINE_NEXT
            self.marker = mark.marker
        compile_s = self.strategy.last_compile_s
        checks_now, check_s_now = padding_checks()
        debug.record_flush(plan, record_ms, (planned - start - compile_s) * 1e3,
                           (done - planned) * 1e3, getattr(self.strategy, 'last', None),
                           compile_ms=compile_s * 1e3, repeated=repeated,
                           built=programs_built() - built,
                           checks=(checks_now - checks, (check_s_now - check_s) * 1e3))
        return len(nodes), len(plan.steps)

    def abandon(self):
        """Drop what was recorded: its lazy values will raise when read."""
        _fail(self.pending)
        self.pending = []
        self.repeated = 0
        if self.repeats:
            self.repeats = {}
        self.groups, self.used, self.unsafe = {}, {}, 0
        if self.tape is not None:
            self.tape.take()


PIPELINE_LEAD = 0.15
"""A pipelined part's marker goes behind the step by which all but this
share of the part's calls are launched, not behind its last step: the
worker then still has the part's last steps to run while Python plans and
launches the next part, instead of waiting for it (~1 ms a SICK minibatch
of 256; 1.05-1.06x at inference 256 and 1,024, ``docs/performance.rst``)."""


class _Mark:
    """Pushes a pipelined part's marker (:func:`_push_marker`) right after
    the step it belongs behind is launched (the engine's worker runs its
    queue in order, so a marker pushed later would wait for every step
    launched before it); ``marker`` is then set."""
    __slots__ = ('at', 'marker')

    def __init__(self, plan):
        sizes = [len(step.nodes) for step in plan.steps]
        goal, done = (1 - PIPELINE_LEAD) * sum(sizes), 0
        self.at = len(sizes) - 1
        for number, size in enumerate(sizes):
            done += size
            if done >= goal:
                self.at = number
                break
        self.marker = None

    def __call__(self, number, step):
        if number == self.at:
            self.marker = _push_marker(step.nodes[-1])


def _push_marker(node):
    """A marker (``accel.push_marker``) that the engine sets once the
    outputs of ``node``'s step are computed, or None."""
    push = accel.push_marker
    ctx = node.sig.ctx
    if push is None or not node.arrays:
        return None
    return push([array.handle.value for array in node.arrays], ctx.device_typeid,
                ctx.device_id)


def _fail(nodes):
    for node in nodes:
        if node.state == PENDING:
            node.state = FAILED


@contextmanager
def batching(strategy='auto', flush_every='auto', merge_repeats=True):
    """Record wrapped-block calls in this scope and run them batched.

    Parameters
    ----------
    strategy : str or Strategy
        How to group calls: ``'auto'`` (default: the cost model picks per
        flush), or pin one of ``'depth'``, ``'agenda'``, ``'cached'``,
        ``'per-sample'`` (see :mod:`gluon_dynbatch.plan`, :mod:`gluon_dynbatch.cost`).
    flush_every : int, None or 'auto'
        Run what was recorded every this many calls, so that MXNet's engine
        thread computes one part while Python records the next (a
        *pipelined* scope; results and gradients are the same, only when
        the operators run changes).  ``'auto'`` (default): when the scope
        opens outside ``autograd.record()`` under MXNet's threaded engine,
        follow the engine: run the first
        :data:`~gluon_dynbatch.block.PIPELINE_FIRST` calls, then what was
        recorded once :data:`~gluon_dynbatch.block.PIPELINE_NEXT` calls are
        pending and the engine's worker has run most of the part before,
        and at the latest every :data:`~gluon_dynbatch.block.PIPELINE_CALLS`
        calls, but no part that would leave a last one of fewer than
        :data:`~gluon_dynbatch.block.PIPELINE_TAIL` calls by the size of the
        thread's last such scopes (without the C extension, which pushes the
        markers that tell: every :data:`~gluon_dynbatch.block.PIPELINE_CALLS`
        calls);
        otherwise never: the NaiveEngine runs operators in the calling thread, so
        smaller flushes would only batch less, and in training the backward
        pass, which cannot start before the last flush, runs more and
        smaller steps.  None or 0: flush only when a value is read or the
        scope exits.
    merge_repeats : bool
        A call of a block that is a function of its inputs (no random
        draws, no running statistics, no custom op), whose arguments are
        all numpy arrays equal bit for bit to those of a call still pending
        (not yet run), shares that call's node and results (default True;
        see :meth:`~gluon_dynbatch.block.BatchingScope.record`).  Only small
        arguments are compared: C-contiguous, in the machine's byte order,
        at most :data:`~gluon_dynbatch.block.REPEAT_BYTES` bytes in all (a
        token id is 4).  On a SICK
        minibatch of 256 pairs, ~2,200 of ~2,500 leaf calls repeat a
        token.  Turn it off when the
        same graph structure comes back with other data and a cached plan
        should serve it (``'cached'``, ``'auto'``): which calls repeat
        depends on the data, so with merging the structure does too.

    Notes
    -----
    One scope per minibatch.  On normal exit everything recorded is run; if
    the body raises, what was recorded is dropped (its lazy values raise
    :class:`~.errors.LazyValueError` when read) and the next scope starts
    clean.  A generator closed at a ``yield`` inside the scope (a loop
    over it broke off) is no failure: what was recorded is run, so the
    values it handed out can be read, as per sample.  Scopes do not nest.
    Python's cyclic garbage collector is paused inside a scope (reference
    counting still frees memory as usual).
    """
    if current_scope() is not None:
        raise ScopeError('batching() scopes do not nest: a scope is already open in this '
                         'thread. Close it first, or record everything in the outer scope.')
    if mx.util.is_np_array():
        raise ScopeError("batching() does not support MXNet's numpy interface (npx.set_np() "
                         'is active): blocks are traced and batched with the legacy NDArray and '
                         'Symbol API. Call mx.npx.reset_np() first, or run the blocks without a '
                         'scope; blocks written with F.np / F.npx, or made under set_np(), need '
                         'the numpy interface and cannot be batched: write them with the legacy '
                         'F operators.')
    if isinstance(strategy, str):
        if strategy not in STRATEGIES:
            raise ScopeError('unknown strategy %r; choose one of %s'
                             % (strategy, sorted(STRATEGIES)))
        strategy = STRATEGIES[strategy]
    elif not isinstance(strategy, Strategy):
        raise ScopeError('strategy=%r: give the name of one of %s or a gluon_dynbatch.Strategy '
                         '(a subclass implementing plan())' % (strategy, sorted(STRATEGIES)))
    follow_engine = False
    if isinstance(flush_every, str) and flush_every == 'auto':
        pipelined = threaded_engine() and not autograd.is_recording()
        flush_every = PIPELINE_CALLS if pipelined else None
        follow_engine = pipelined and accel.push_marker is not None
    elif flush_every is not None and (not isinstance(flush_every, numbers.Integral) or
                                      isinstance(flush_every, bool) or flush_every < 0):
        raise ScopeError("flush_every=%r: give a number of calls, None or 0 (flush only when "
                         "a value is read or the scope exits) or 'auto'." % (flush_every,))
    elif flush_every is not None:
        flush_every = int(flush_every)      # numpy integers too; the C recorder reads an int
    if not _is_flag(merge_repeats):
        raise ScopeError('merge_repeats=%r: give True or False (or 1 or 0).'
                         % (merge_repeats,))
    _forget_stale_traces()
    strategy.prepare()
    scope = BatchingScope(strategy, flush_every, follow_engine, bool(merge_repeats))
    try:
        # inside the try: an interrupt (Ctrl-C) landing between these lines
        # must not leave the scope installed for good
        _LOCAL.scope = scope
        _pause_collector()
        yield scope
    except GeneratorExit:
        # the user's generator was closed at a yield inside the scope (a
        # loop over it broke off): no failure, and per sample the values it
        # handed out exist, so run them (found by a fuzzer); but not while
        # Python shuts down (a generator left suspended), with MXNet going
        if sys.is_finalizing():
            scope.abandon()
        else:
            scope.close()
        raise
    except BaseException:
        scope.abandon()
        raise
    else:
        scope.close()
    finally:
        _LOCAL.scope = None
        _resume_collector()


SYMBOL_ADVICE = (' A Symbol reaches a wrapper called inside another block\'s hybrid_forward '
                 'while that block is traced: call the wrapped block itself there '
                 '(wrapper.block, made a child block of the outer one), and wrap only the '
                 'outer block.')
"""Appended to the error for a Symbol among a call's arguments while a block
is traced (found by a fuzzer)."""


SYMBOL_FROM_CALLER_ADVICE = (
    ' No block is being traced, so the caller made it: the begin_state() of Gluon\'s '
    'modifier cells (ResidualCell, ZoneoutCell) makes '
    'Symbols unless given func=mx.nd.zeros; pass NDArrays.')
"""Appended to the error for a Symbol among a call's arguments made outside
any trace (found by a user test: ``ResidualCell.begin_state()`` defaults to
``mx.sym.zeros``, and the error blamed a wrapper called inside a traced
block)."""


def _symbol_advice():
    """The advice for a Symbol argument: from inside a trace, or from the caller."""
    is_owned = getattr(_TRACING, '_is_owned', None)
    return SYMBOL_ADVICE if is_owned is None or is_owned() else SYMBOL_FROM_CALLER_ADVICE


CONSTANT_ADVICE = (' Gluon passes None and numbers through outside a scope, but a '
                   'batched step cannot: make such a constant part of the block (an '
                   'attribute, or one wrapper block per value), or pass it as a (1, ...) '
                   'array.')
"""Appended to the error for a ``None`` or a number (Python's or numpy's)
among a call's arguments (see :doc:`quickstart`, "What a wrapped call
takes")."""


# Recording makes many small objects; the cyclic collector would walk every
# live object of the process (datasets included) again and again, which
# measured up to 7x the recording cost itself.  Recorded nodes form no
# cycles, so collection waits until the last open scope, of any thread,
# closes (the collector is one for the process).
_COLLECTOR = {'scopes': 0, 'was_enabled': False}
_COLLECTOR_LOCK = threading.Lock()


_TRACED = weakref.WeakSet()
"""The DynBatchBlocks holding traced signatures (see :func:`_forget_stale_traces`)."""
_UNWARNED = weakref.WeakSet()
"""Wrappers first traced in inference whose signatures batch there and run
per sample under autograd (``BatchNorm``'s, see
:attr:`~.trace.TracedSignature.inference`): the first flush under
autograd that runs one of them warns (:func:`_warn_under_autograd`)."""


def _warn_under_autograd(plan):
    for step in plan.steps:
        dblock = getattr(step.sig, 'dblock', None)
        if dblock in _UNWARNED and not step.sig.batch_safe:
            dblock.warn_per_sample(step.sig)


def _is_flag(value):
    """Whether ``value`` is True or False (numpy's too, or 1 or 0): a flag
    given as a string such as 'no' would otherwise be taken as true."""
    return isinstance(value, (bool, np.bool_)) or \
        (isinstance(value, numbers.Integral) and value in (0, 1))


def _forget_stale_traces():
    """Run as a scope opens: a wrapped block traces again where what its
    signatures were traced under changed since (found by fuzzers).  A change
    made while a scope is open is seen at the next.

    * One of its child blocks was replaced (``net.proj = nn.Dense(...)``):
      its signatures had the old child's symbol and parameters, and batched
      calls ran the old child where per-sample calls, eager or hybridized
      (Gluon clears a block's cached graph when a child is assigned), run
      the new one.
    * A parameter with a row-sparse gradient got ``grad_req='add'``, which
      the trace refuses (:func:`~gluon_dynbatch.trace.trace_signature`):
      signatures traced before ran on, the gradient overwritten instead of
      added (or MXNet's raw error), until a new signature was traced and
      refused mid-training.  Tracing again refuses it at the first call.

    It runs at every scope, so the blocks are compared by identity in C
    (``map(operator.is_, ...)``, no generator frame) and parameters are
    read only where a wrapper has row-sparse ones: ~3.9 us a scope of two
    wrappers of 6 and 3 blocks (1.5 of them listing the wrappers), against
    ~5.0 us with a generator for each test."""
    for dblock in list(_TRACED):
        traced = dblock._traced_blocks      # pylint: disable=protected-access
        if traced is None:
            continue
        now = blocks_of(dblock.block)
        sparse = dblock._sparse_params      # pylint: disable=protected-access
        if len(now) != len(traced) or not all(map(operator.is_, now, traced)) or \
                sparse and any(param.grad_req == 'add' for param in sparse):
            dblock._forget_traces()         # pylint: disable=protected-access


def _pause_collector():
    with _COLLECTOR_LOCK:
        if _COLLECTOR['scopes'] == 0:
            _COLLECTOR['was_enabled'] = gc.isenabled()
            gc.disable()
        _COLLECTOR['scopes'] += 1


def _resume_collector():
    with _COLLECTOR_LOCK:
        if _COLLECTOR['scopes'] == 0:   # interrupted before it paused
            return
        _COLLECTOR['scopes'] -= 1
        if _COLLECTOR['scopes'] == 0 and _COLLECTOR['was_enabled']:
            gc.enable()


@contextmanager
def private_scope(strategy):
    """A scope that may open while another is open (the cost model's probe
    runs in the middle of a user's flush); the user's scope is restored."""
    outer = current_scope()
    scope = BatchingScope(STRATEGIES[strategy] if isinstance(strategy, str) else strategy,
                          merge_repeats=False)     # a node per call: probes count them
    try:
        _LOCAL.scope = scope
        yield scope
    finally:
        scope.abandon()
        _LOCAL.scope = outer


def _per_sample_advice(reason):
    """What a user can do about a block that runs per sample for
    ``reason`` (``check_batch_safe``'s), as a sentence or ''."""
    if 'has no batching rule' in reason:
        return ('If that op acts on each row alone, register a rule '
                '(gluon_dynbatch.register_batching_rule); not for an op that mixes rows, '
                'as BatchNorm does in training. ')
    if reason.startswith('an output does not depend'):
        return ('An output computed from parameters or constants alone is the same for '
                'every sample: compute it outside the block (or in a block of its own, '
                'called once). ')
    return ''


def concat_rows(values):
    """The values (per-sample lazy values or NDArrays of one shape, leading
    axis 1) as one ``(N, ...)`` NDArray, in order.

    It equals ``mx.nd.concat(*[v.data for v in values], dim=0)`` but costs
    one gather (none when the values are, in order, all the rows of one
    batched step, e.g. one loss head per sample) instead of N row slices and
    a concat: at minibatch 256 those slices cost more than some whole steps.
    Pending values are computed first; the result is differentiable under
    ``autograd.record()``.  Like ``.data``, it stays in the values' autograd
    graph wherever it is read (per sample the values are the recorded
    arrays themselves), under ``autograd.pause()`` too, where a ``concat``
    would leave the graph: call ``.detach()`` on it there.  Treat it as
    read-only: when the values are all
    the rows of one step it *is* that step's output, which their ``.data``
    reads (copy it before writing into it in place).
    """
    if type(values) is LazyValue or isinstance(values, NDArray):
        raise InputError('concat_rows() takes a list of values, one per sample; got one %s '
                         '(concat_rows([value]), or value.data).' % type(values).__name__)
    try:
        values = list(values)
    except TypeError:
        raise InputError('concat_rows() takes a list of values, one per sample; got %s.'
                         % type(values).__name__) from None
    if not values:
        raise InputError('concat_rows() needs at least one value.')
    for i, value in enumerate(values):
        if type(value) is not LazyValue and not isinstance(value, NDArray):
            hint = (' (a call\'s several outputs?): pass one output per call, e.g. '
                    '[out for out, _ in results]' if isinstance(value, (tuple, list)) else '.')
            raise InputError('concat_rows(): value %d is a %s; expected lazy values or '
                             'NDArrays%s' % (i, type(value).__name__, hint))
    shape, dtype = values[0].shape, values[0].dtype
    marked = False
    for i, value in enumerate(values):
        if type(value) is LazyValue and (value._node.state != DONE or
                                         value._node.scope.failure is not None):
            value.data          # runs what is pending (raises for a failed scope)
        if type(value) is LazyValue and data_marked(value):
            marked = True       # that array, as per sample
        if value.shape[:1] != (1,):
            raise InputError('concat_rows(): value %d has shape %s; each value must be one '
                             'sample (leading axis 1).' % (i, value.shape))
        if value.shape != shape:
            raise InputError('concat_rows(): value %d has shape %s but value 0 has %s; the '
                             'values must share one shape.' % (i, value.shape, shape))
        if value.dtype != dtype:
            raise InputError('concat_rows(): value %d has dtype %s but value 0 has %s; the '
                             'values must share one dtype (cast one: v.data.astype(...)).'
                             % (i, np.dtype(value.dtype).name, np.dtype(dtype).name))
    if marked:
        arrays = [value.data if type(value) is LazyValue else value for value in values]
        with recorded():
            return rows_of(arrays, mx.nd.concat(*arrays, dim=0))
    ctx = values[0].context
    parts, index, _ = collect(values, ctx)
    with recorded():            # (see graph.recorded)
        source = parts[0] if len(parts) == 1 else mx.nd.concat(*parts, dim=0)
        if index is not None:
            source = mx.nd.take(source, to_device(np.asarray(index, dtype='int32'), ctx))
    return source if source is parts[0] else rows_of(parts, source)


class _Operator(mx.gluon.HybridBlock):
    """One MXNet operator of the block's arguments: what arithmetic on a
    lazy value records (:func:`lazy_operator`)."""

    def __init__(self, op_name):
        super().__init__(prefix='lazy_%s_' % op_name)
        self.op_name = op_name
        self.dynbatch_symbol = 'the operator %s' % _SYMBOLS[op_name]   # (LazyValue's hints)

    def hybrid_forward(self, F, *args):  # pylint: disable=arguments-differ
        return getattr(F, self.op_name)(*args)


class _NumberOverInteger(mx.gluon.HybridBlock):
    """``number / v`` for a lazy value ``v`` of integer dtype ``dtype``,
    computed as NDArray's ``_rdiv_scalar`` computes it per sample: the
    number (a row of the dtype, :func:`_number_row`) and ``v`` made
    float32, divided, and the quotient cast back.  ``broadcast_div`` of
    integers would trap a zero in ``v`` and kill the process (SIGFPE),
    where per sample that quotient is what a float32 infinity casts to."""

    def __init__(self, dtype):
        super().__init__(prefix='lazy_rdiv_%s_' % np.dtype(dtype).name)
        self.dtype = np.dtype(dtype).name
        self.dynbatch_symbol = 'the operator /'     # (LazyValue's hints)

    def hybrid_forward(self, F, number, x):  # pylint: disable=arguments-differ
        return F.cast(F.broadcast_div(F.cast(number, 'float32'), F.cast(x, 'float32')),
                      dtype=self.dtype)


_OPERATORS_LOCK = threading.Lock()     # held to make a block of graph.OPERATOR_BLOCKS
_NUMBERS = (numbers.Real, np.bool_)     # NDArray's numeric_types take np.bool_ too


def lazy_operator(op_name, *operands):
    """MXNet operator ``op_name`` of ``operands``, one at least a lazy value:
    what NDArray arithmetic runs per sample (``a + b`` is ``broadcast_add``
    of the two, or of ``a`` and a number), recorded as a call of a block of
    that one op, so that arithmetic written between block calls batches as
    the calls do.

    * A number becomes a host array of the lazy value's dtype and rank,
      every axis 1, so that calls with different numbers share a step; cast
      to that dtype as NDArray's scalar operators cast it: made a double
      (an int above 2 ** 53 rounds), then cast (float16 through float32,
      which can round a number near a tie otherwise than numpy's direct
      cast).
    * An NDArray is an argument of the call, with leading axes of 1 added
      where its rank is lower (as broadcasting adds them per sample); one
      of equal rank must be one sample's (leading axis 1).
    * A numpy array is refused with a TypeError, as NDArray refuses it;
      anything else gives ``NotImplemented`` (Python's TypeError).

    A number divided by a lazy value of integer dtype runs as NDArray's
    ``_rdiv_scalar`` does (:class:`_NumberOverInteger`).

    Outside a scope (a value of a closed one) it runs the operator on
    ``.data`` at once, as a wrapped block's call runs the block there."""
    lazy = operands[0] if type(operands[0]) is LazyValue else operands[-1]
    args = []
    for x in operands:
        if type(x) is LazyValue:
            pass
        elif isinstance(x, NDArray):
            if x.ndim < lazy.ndim:
                x = x.reshape((1,) * (lazy.ndim - x.ndim) + x.shape)
        elif type(x) is float or type(x) is int or isinstance(x, _NUMBERS):
            x = _number_row(x, lazy)
        elif isinstance(x, np.ndarray):
            raise TypeError('arithmetic on a LazyValue (an output of block %s) takes numbers, '
                            'NDArrays and lazy values, as NDArray\'s does; got a numpy array of '
                            'shape %s: make it an NDArray (mx.nd.array(x)), or pass it to a '
                            'wrapped block as a host argument.'
                            % (lazy._node.sig.block.name, x.shape))
        else:
            return NotImplemented
        args.append(x)
    key = op_name
    if op_name == 'broadcast_div' and type(args[0]) is np.ndarray and \
            np.issubdtype(lazy.dtype, np.integer):
        key = ('rdiv', np.dtype(lazy.dtype).name)     # a number over an integer value
    elif current_scope() is None:
        return getattr(mx.nd, op_name)(*_materialize(args))
    block = OPERATOR_BLOCKS.get(key)
    if block is None:
        with _OPERATORS_LOCK:
            if key not in OPERATOR_BLOCKS:
                OPERATOR_BLOCKS[key] = DynBatchBlock(
                    _Operator(op_name) if key is op_name else _NumberOverInteger(key[1]))
            block = OPERATOR_BLOCKS[key]
    try:
        return block(*args)
    except InputError as error:
        raise operator_error(op_name, operands, error)  # pylint: disable=raise-missing-from


def operator_error(op_name, operands, error):
    """The error to raise for InputError ``error`` of the call that
    arithmetic ``op_name`` of ``operands`` recorded: worded by what the
    user wrote where :func:`_operator_advice` knows what to do, else
    ``error`` itself (one raised by a flush that the call started)."""
    lazy = operands[0] if type(operands[0]) is LazyValue else operands[-1]
    advice = _operator_advice(operands, lazy)
    if advice is None:
        return error
    worded = InputError('%s of %s: %s' % (_SYMBOLS[op_name], ' and '.join(
        _operand_text(x) for x in operands), advice))
    worded.__cause__ = error
    return worded


_NUMBER_ROWS = {}   # (number, its type, dtype, rank) -> its read-only host row
_NUMBER_ROWS_MAX = 4096


def _number_row(x, lazy):
    """Number ``x`` as a host argument of ``lazy``'s dtype and rank, every
    axis 1, cast as NDArray's scalar operators cast it: a double, then the
    dtype, which for float16 rounds through float32 (mshadow's half_t).
    Rows are shared, read-only, per number (a row cost ~0.8 us to make; a
    flush reads its bytes), except zeros, whose sign a key would lose, and
    NaNs, which no key finds again."""
    key = (x, type(x), lazy.dtype, lazy.ndim)
    cached = x and x == x
    row = _NUMBER_ROWS.get(key) if cached else None
    if row is None:
        row = np.empty((1,) * key[3], key[2])    # (np.full: 3x the time)
        row.fill(float(x) if row.dtype != np.float16 else np.float32(float(x)))
        row.flags.writeable = False
        if cached:
            if len(_NUMBER_ROWS) >= _NUMBER_ROWS_MAX:
                _NUMBER_ROWS.clear()
            _NUMBER_ROWS[key] = row
    return row


_SYMBOLS = {'broadcast_add': '+', 'broadcast_sub': '-', 'broadcast_mul': '*',
            'broadcast_div': '/', 'broadcast_power': '**', 'broadcast_mod': '%',
            'negative': 'unary -', 'abs': 'abs()', 'broadcast_lesser': '<',
            'broadcast_lesser_equal': '<=', 'broadcast_greater': '>',
            'broadcast_greater_equal': '>=', 'broadcast_equal': '==',
            'broadcast_not_equal': '!='}


def _operand_text(x):
    if type(x) is LazyValue:
        return 'a LazyValue of block %s (shape %s, %s)' % (
            x._node.sig.block.name, x.shape, np.dtype(x.dtype).name)
    if isinstance(x, NDArray):
        return 'an NDArray (shape %s, %s)' % (x.shape, np.dtype(x.dtype).name)
    return repr(x)


def _operator_advice(operands, lazy):
    """What to do about arithmetic on ``lazy`` that its operator's call
    refused (called only then, to word the error by what the user wrote
    rather than by the internal block's arguments), or None."""
    arrays = [x for x in operands if type(x) is LazyValue or isinstance(x, NDArray)]
    if any(isinstance(x, mx.np.ndarray) for x in arrays):
        return ('an mxnet.numpy array takes no part in NDArray arithmetic (per sample MXNet '
                'refuses it too): make it an NDArray with x.as_nd_ndarray().')
    dtypes = {np.dtype(x.dtype) for x in arrays}
    if len(dtypes) > 1:
        return ('NDArray arithmetic takes operands of one dtype (per sample MXNet refuses '
                'others too): cast one, an NDArray with x.astype(%r), a value in its block.'
                % np.dtype(lazy.dtype).name)
    for x in arrays:
        if type(x) is not LazyValue and x.ndim >= lazy.ndim and x.shape[0] != 1:
            return ('per sample the NDArray\'s leading axis of %d would broadcast the '
                    'sample, but in a batched step that axis holds the samples: an NDArray '
                    'operand must have a lower rank than the value, or a leading axis of 1. '
                    'Do it inside a wrapped block (on one sample), or on value.data, which '
                    'runs the pending calls now.' % x.shape[0])
    return None


_LAZY_OPERATOR[0], _LAZY_OPERATOR[1] = lazy_operator, operator_error


def repeat_key(sig, leaves):
    """What makes a call of ``sig`` on ``leaves`` equal to another (see
    :meth:`BatchingScope.record`): its signature's id (which fixes the
    block, the arguments' nesting, shapes, dtype and context) and the
    leaves' bytes, as the C recorder writes it (bit for bit: -0.0 and 0.0
    differ).  None unless every leaf is a C-contiguous numpy array in the
    machine's byte order (the signature names the dtype's type, not its
    byte order) and they hold at most :data:`REPEAT_BYTES` bytes."""
    size = 0
    for leaf in leaves:
        if type(leaf) is not np.ndarray or not leaf.flags.c_contiguous or \
                not leaf.dtype.isnative:
            return None
        size += leaf.nbytes
    if size > REPEAT_BYTES:
        return None
    return _SIG_ID_BYTES.pack(sig.sig_id) + b''.join(leaf.tobytes() for leaf in leaves)


_SIG_ID_BYTES = struct.Struct('<q')
REPEAT_BYTES = 256
"""Calls whose host arguments hold more bytes are not merged (see
:meth:`BatchingScope.record`): each key holds a copy of them until the
flush (a token id is 4 bytes; 256 images of 3 x 224 x 224 floats held
154 MB), and large inputs rarely repeat."""


_MXNET_DTYPE_NAMES = {np.dtype(dtype).name for dtype in _DTYPE_NP_TO_MX}


def _signature_key(dblock, fmt, leaves, scope):
    """(signature key, context, depth) of a call recorded in ``scope``;
    checks the leaves and marks the pending nodes they come from as used.
    A lazy value whose ``.data`` the user marked (:func:`~.graph.data_marked`)
    is replaced in ``leaves`` by that array.

    This runs once per recorded call, so it compares contexts and dtypes by
    identity first, reads a lazy value's (shape, dtype, context) as one
    tuple of its signature, and reads NDArray properties (C calls) only for
    NDArrays.  The key ends with the leaves' dtype and the context: one
    dtype where all leaves share it, else the tuple of every leaf's (token
    ids in int32 beside float32 states), which the C recorder writes alike.
    """
    key = [fmt]
    ctx = dtype = dtypes = None     # dtypes: every leaf's, once two differ
    depth = 0
    for number, leaf in enumerate(leaves):
        kind = type(leaf)
        if kind is LazyValue and leaf._data is not None and data_marked(leaf):
            leaf = leaves[number] = leaf._data      # the marked array, as per sample
            kind = type(leaf)
        if kind is LazyValue:
            node = leaf._node
            shape, leaf_dtype, leaf_ctx = node.sig.out_info[leaf._index]
            if node.state != DONE:
                if node.state == FAILED:
                    leaf.data  # raises LazyValueError with the details
                if node.scope is not scope:
                    raise ScopeError(
                        'block %s, argument %s: a value of block %s that another thread\'s '
                        'batching() scope recorded and has not run yet. Read it (.data) in '
                        'that thread, or let its scope close, before passing it on.'
                        % (dblock.block.name, _leaf_path(fmt, _position(leaves, leaf)),
                           node.sig.block.name))
                if node.depth >= depth:
                    depth = node.depth + 1
                if not node.used:
                    _mark_used(node)
            elif node.scope.failure is not None:
                leaf.data   # its scope failed at run time: raises LazyValueError
        elif kind is np.ndarray:
            shape, leaf_dtype, leaf_ctx = leaf.shape, leaf.dtype.type, None
        elif isinstance(leaf, NDArray):
            shape, leaf_dtype, leaf_ctx = leaf.shape, leaf.dtype, leaf.context
            if type(leaf_dtype) is not type:    # (an mxnet.numpy array's: a dtype object)
                raise InputError('block %s, argument %s is an mxnet.numpy array; a wrapped '
                                 'block records NDArray calls: make it an NDArray with '
                                 'x.as_nd_ndarray().'
                                 % (dblock.block.name, _leaf_path(fmt, _position(leaves, leaf))))
            if leaf_dtype is np.bool_:
                raise InputError('block %s, argument %s is a bool NDArray, which MXNet 1.9.1 '
                                 'cannot gather into a batched step (its concat and slices '
                                 'take no bool): pass it as uint8 or float32 '
                                 '(x.astype(\'uint8\')), or as a numpy bool array.'
                                 % (dblock.block.name, _leaf_path(fmt, _position(leaves, leaf))))
        else:
            raise InputError('block %s, argument %s: got %s, expected an NDArray, a lazy '
                             'value or a numpy array (per-sample, leading axis of 1).%s'
                             % (dblock.block.name, _leaf_path(fmt, _position(leaves, leaf)),
                                type(leaf).__name__, CONSTANT_ADVICE
                                if leaf is None or isinstance(leaf, (numbers.Number, np.generic))
                                else _symbol_advice() if isinstance(leaf, mx.sym.Symbol) else ''))
        if leaf_ctx is not ctx and leaf_ctx is not None:
            if ctx is None:
                ctx = leaf_ctx
            elif leaf_ctx != ctx:
                raise InputError('block %s, argument %s is on %s but earlier arguments are on '
                                 '%s; move all arguments of a call to one context.'
                                 % (dblock.block.name, _leaf_path(fmt, _position(leaves, leaf)),
                                    leaf_ctx, ctx))
        if leaf_dtype is not dtype:
            if dtype is not None and dtypes is None:
                dtypes = [dtype] * (len(key) - 1)
            dtype = leaf_dtype
        if dtypes is not None:
            dtypes.append(leaf_dtype)
        key.append(shape)
    key.append(dtype if dtypes is None else tuple(dtypes))
    if ctx is None:
        ctx = mx.current_context()
    key.append((ctx.device_typeid, ctx.device_id))   # hashed in C, unlike a Context
    return tuple(key), ctx, depth


def _mark_used(node):
    """``node`` (pending) is read by a later call of its flush: depth
    grouping must not delay it (see :func:`~.plan.merge_sinks`)."""
    node.used = True
    if node.sig.batch_safe:
        group = (node.depth, node.sig.group_key)
        used = node.scope.used
        used[group] = used.get(group, 0) + 1


def _position(leaves, leaf):
    """Index of ``leaf`` (by identity) in ``leaves``, for error messages."""
    return next(i for i, x in enumerate(leaves) if x is leaf)


def _few(items, most=4):
    """``items`` for a message: the first ``most``, then how many more."""
    text = ', '.join(str(item) for item in items[:most])
    return text + (', ... (%d more)' % (len(items) - most) if len(items) > most else '')


def _leaf_path(fmt, index):
    """Human name of flat leaf ``index`` in nesting ``fmt``, e.g. ``#2[1]``."""
    counter = itertools.count()
    def walk(items, prefix):
        for i, item in enumerate(items):
            name = '%s[%d]' % (prefix, i) if prefix else '#%d' % i
            if item == 0:
                if next(counter) == index:
                    return name
            else:
                found = walk(item, name)
                if found:
                    return found
        return None
    return walk(fmt, '') or '#%d' % index


_CHECKS = threading.local()


def padding_checks():
    """``(count, seconds)`` of the padding checks this thread has run: a
    flush that ran some says so (``stats()``, ``DYNBATCH_DEBUG``), a
    one-time cost of new list lengths that its analysis time includes."""
    return getattr(_CHECKS, 'count', 0), getattr(_CHECKS, 'seconds', 0.0)


PADDING_CHECK_RANGES = ((-1.0, 1.0), (-2.0, -0.5), (0.5, 2.0), (-8.0, 8.0))
"""The ranges of the random inputs :func:`check_padding_is_neutral` tries:
a mixed draw, and all negative and all positive ones, since a zero row
changes a max over a list only where every element is negative, and a
min only where every element is positive; then a wider one, for blocks
that a zero row changes only past a threshold (``relu(h + x - 3)``).  A
test on random inputs, not a proof: a block that padding changes only for
inputs outside these ranges passes it."""


CHECK_SEED = 20240101
"""The seed MXNet's generator gets before each run of the padding check of
a block that draws random numbers (see :func:`_same_draws`)."""


def _draws(sig):
    """Whether an op of ``sig``'s traced symbol draws random numbers
    (:func:`~.rules.draws_random`) outside training, where the padding
    check runs (a ``Dropout`` draws there only with ``mode='always'``).
    Kept on the signature: every check of it asked, reading its JSON."""
    known = sig.__dict__.get('padding_check_draws')
    if known is not None:
        return known
    draws = False
    for node in json.loads(symbol_json(sig.symbol))['nodes']:
        op, attrs = node['op'], node.get('attrs', {})
        if op == 'LeakyReLU' or (op in ('Dropout', '_npx_dropout') and
                                 attrs.get('mode', 'training') == 'training'):
            continue
        if op != 'null' and draws_random(op, attrs):
            draws = True
            break
    sig.__dict__['padding_check_draws'] = draws
    return draws


@contextmanager
def _same_draws(sig, padded):
    """For the padding check of a block that draws random numbers (a
    sampler's noise on its output, ``F.random.normal_like(h)``): each run
    of the block starts from one seed (:func:`_seed_draws`), so the runs
    with the shorter and the padded lists draw alike where the draws'
    shapes are the same; unseeded, every draw differed and the check
    refused such a block, blaming the padding.  Afterwards MXNet's
    generator on the context is seeded from a number drawn from it
    before, so that a user's seeds still give streams of their own.  (A
    seed takes ~2.6 ms on a 2-core VM, ~30 of them a check.)"""
    if not (_draws(sig) or _draws(padded)):
        yield False
        return
    with mx.autograd.pause():
        resume = int(mx.nd.random.randint(0, 2 ** 31 - 1, shape=(1,), ctx=sig.ctx).asscalar())
    _CHECKS.seed_ctx = sig.ctx
    try:
        yield True
    finally:
        _CHECKS.seed_ctx = None
        mx.random.seed(resume, ctx=sig.ctx)


def _seed_draws():
    """Seed MXNet's generator with :data:`CHECK_SEED` before a run of the
    padding check, where :func:`_same_draws` asks for it."""
    ctx = getattr(_CHECKS, 'seed_ctx', None)
    if ctx is not None:
        mx.random.seed(CHECK_SEED, ctx=ctx)


def check_padding_is_neutral(dblock, sig, padded):
    """Run the block on random inputs with the lists of ``sig`` and padded
    with zeros to ``padded``, for each range of
    :data:`PADDING_CHECK_RANGES`, as its traced symbols (what batched steps
    run): once with its parameters as they stand, and once with random
    values for every parameter, in float64 where MXNet can (see
    :func:`_close`); raise
    unless the outputs agree, and, for the symbols, the gradients of the
    parameters and of the real list elements for one random head gradient
    (a zero row may leave the values alone and still make a gradient NaN:
    the norm of a child's ``W h`` is 0 there, its gradient 0/0), but for an
    inference signature's (:attr:`~.trace.TracedSignature.in_inference`),
    whose calls take none.  The
    parameters as they stand can hide a block that padding changes: Gluon
    starts biases at zero, and ``tanh(W 0 + b)`` is zero only while ``b``
    is (its gradient, and after a step its output, would differ,
    silently).  The block's own parameters are never written (another
    thread may be running them).  A block that draws random numbers
    draws alike in the runs compared (:func:`_same_draws`)."""
    with _same_draws(sig, padded) as draws:
        try:
            _check_padding_is_neutral(dblock, sig, padded)
        except InputError as err:
            message = str(err)
            advice = _PADDING_ADVICE if message.endswith(_PADDING_ADVICE) else ''
            more = ''
            if draws:
                more += (' (It draws random numbers: the check runs the shorter and the padded '
                         'lists from one seed, so a draw for a padding element, or one whose '
                         "shape the lists' length changes, differs.)")
            if advice and ' changes ' in message and _softmax_without_lengths(padded.symbol):
                # (a user trial's attention over a node's parents: the
                # refusal offered pad_lists=False alone)
                more += (' Its softmax (or log_softmax) without lengths spreads weight over '
                         "the padding: given the list's length, F.softmax(x, length, "
                         'axis=..., use_length=True), it leaves the padding out.')
            if advice and ' changes ' in message and _padding_read_as_ids(sig, padded):
                # (a user trial's bag of words over a ragged list of token
                # ids: a sum, which looks neutral, refused with no reason)
                more += (' It looks up ids from a list element (Embedding or take): a zero '
                         'padding element is id 0, a row of the table like any other, '
                         "unless the rows looked up past the list's length are masked, "
                         'F.SequenceMask(rows, length, use_sequence_length=True, axis=...).')
            if not more:
                raise
            raise InputError(message[:len(message) - len(advice)] + more + advice) from None


def _padding_read_as_ids(sig, padded):
    """Whether an op that looks rows up in a table (``Embedding``,
    ``take``) reads ids computed from a padding element of ``padded``'s
    lists (those ``sig``'s lists lack): a zero there is id 0, a real row,
    which no block's arithmetic can tell from a token."""
    padding = {name for name, short in zip(
        padded.data_names, pad_leaves(sig.fmt, list(sig.data_names), padded.fmt,
                                      lambda item: None)) if short is None}
    nodes = json.loads(symbol_json(padded.symbol))['nodes']
    below = inputs_below(nodes)
    return any(padding & below[node['inputs'][ID_INPUTS[node['op']]][0]] for node in nodes
               if node['op'] in INDEXED_OPS + ('take',) and
               len(node['inputs']) > ID_INPUTS[node['op']])


def _softmax_without_lengths(symbol):
    """Whether ``symbol`` has a ``softmax`` or ``log_softmax`` that reads no
    lengths (``use_length``)."""
    return any(node['op'] in ('softmax', 'log_softmax') and
               node.get('attrs', {}).get('use_length', 'False').lower() not in ('true', '1')
               for node in json.loads(symbol_json(symbol))['nodes'])


def _check_padding_is_neutral(dblock, sig, padded):
    """The checks of :func:`check_padding_is_neutral`."""
    rng = np.random.RandomState(0)
    dtype = sig.dtype
    short, long = _CheckPrep.of(dblock, sig, dtype), _CheckPrep.of(dblock, padded, dtype)
    # the symbols run in float64 where MXNet can: rounding then cannot hide
    # a real difference behind the largest value of an output (see _close);
    # integer arguments (token ids beside float states) keep their dtype
    kinds = [np.float64, dtype] if short.runs_wide and long.runs_wide else [dtype]
    made = {}

    def cannot_run(err):
        # a parameter cast since the trace (under pending calls), which the
        # run with the block's parameters meets first: no fault of padding
        changed = changed_parameters_error((sig, padded), err)
        if changed is not None:
            return changed
        # MXNet 1.9.1 cannot build some symbols as a CachedOp that it runs
        # as NDArray calls
        return InputError(
            'block %s declares pad_lists, but MXNet cannot run its traced symbol for its list '
            'arguments padded (%s) to check that claim (%s).%s'
            % (dblock.block.name, _padding_text(sig.fmt, padded.fmt), error_line(err),
               _PADDING_ADVICE))

    def runs_in(kind):
        if kind not in made:
            try:
                made[kind] = _SymbolRuns(short, long, kind, kind is not dtype, ids)
            except mx.base.MXNetError as err:
                if kind is not dtype:
                    made[kind] = None       # the check runs in the block's own dtype
                    return None
                raise cannot_run(err) from None
        return made[kind]
    ids = short.ids | long.ids
    kinds = [kind for kind in kinds if kind is dtype or runs_in(kind) is not None]
    gradient_kinds = list(kinds)
    lengths = short.lengths + long.lengths
    length_rng = np.random.RandomState(2)
    zero = {}
    for which, (low, high) in enumerate(PADDING_CHECK_RANGES):
        leaves = [_drawn_array(rng.uniform(low, high, shape), sig.ctx, leaf_dtype)
                  for shape, leaf_dtype in zip(sig.in_shapes, sig.in_dtypes)]
        if lengths:
            leaves = _valid_lengths(dblock, sig, padded, lengths, leaves, length_rng, zero,
                                    lambda: runs_in(kinds[0]).params, which < 3)
        with mx.autograd.pause():
            longer = _pad_with_zeros(sig, padded, leaves, dtype, zero)
            try:
                runs = [(short.own_run(leaves), long.own_run(longer), 'its parameters', False)]
            except mx.base.MXNetError as err:
                raise cannot_run(err) from None
            for kind in kinds:
                symbol_runs = runs_in(kind).outputs(leaves, kind in gradient_kinds)
                if symbol_runs is not None:
                    break
            runs.append(symbol_runs + ('random parameters', kind is not dtype))
        _check_padded_outputs(dblock, sig, padded, runs, (low, high))
        if padded.in_inference:
            # calls made outside autograd take no gradient; and BatchNorm's
            # backward (which runs in training) takes the batch's statistics,
            # padding rows and all, where its calls read the running ones
            continue
        for kind in list(gradient_kinds):
            grads = runs_in(kind).gradients(leaves, ids, rng)
            if grads is not None:
                break
            if kind is not dtype:   # (a float64 backward MXNet cannot run: not tried again)
                gradient_kinds.remove(kind)
        if grads is None:
            # no gradient to compare: MXNet 1.9.1 cannot run this backward
            # here; the outputs were compared
            continue
        _check_padded_gradients(dblock, sig, padded, grads, kind is not dtype, (low, high))


def _check_padded_outputs(dblock, sig, padded, runs, drawn):
    """Raise unless each of the padding check's ``runs`` (the block's
    outputs for its lists as they are and padded, what parameters it ran
    with, and whether in float64) gave equal outputs, inputs drawn from the
    range ``drawn`` (see :func:`check_padding_is_neutral`).  The symbols'
    outputs come flat, in the order flatten() gives the block's."""
    for short_out, long_out, parameters, wide in runs:
        flat_short, flat_long = [], []
        flatten([short_out], flat_short)
        flatten([long_out], flat_long)
        for out, (a, b) in enumerate(zip(flat_short, flat_long)):
            a, b = a.asnumpy(), b.asnumpy()
            if a.shape != b.shape:
                raise InputError(
                    'block %s declares pad_lists, but padding its list arguments with '
                    'zeros (%s) changes the shape of its output %d from %s to %s%s.%s'
                    % (dblock.block.name, _padding_text(sig.fmt, padded.fmt), out,
                       a.shape, b.shape, _shifted_outputs(runs, sig, padded),
                       _PADDING_ADVICE))
            if not _close(a, b, wide):
                raise InputError(
                    'block %s declares pad_lists, but padding its list arguments with '
                    'zeros (%s) changes its output %d (inputs drawn from [%g, %g], '
                    '%s)%s.%s' % (
                        dblock.block.name, _padding_text(sig.fmt, padded.fmt), out,
                        drawn[0], drawn[1], parameters, _shifted_outputs(runs, sig, padded),
                        _PADDING_ADVICE))


def _check_padded_gradients(dblock, sig, padded, grads, wide, drawn):
    """Raise unless the padding check's gradients ``grads`` (``(name,
    array)`` pairs for the lists as they are and padded) agree, inputs
    drawn from the range ``drawn``.  By name: a parameter only longer lists
    read (one per child position) takes no gradient per sample, so none
    padded either."""
    short_grads, long_grads = grads
    short_names, long_grads = {name for name, _ in short_grads}, dict(long_grads)
    for what, a in short_grads + [(name, None) for name in long_grads
                                  if name not in short_names]:
        b = long_grads.get(what)
        if a is None or b is None:
            a, b = (np.zeros_like(b), b) if a is None else (a, np.zeros_like(a))
        if not _close(a, b, wide):
            raise InputError(
                'block %s declares pad_lists, but padding its list arguments with zeros '
                '(%s) changes the gradient of %s (inputs drawn from [%g, %g], random '
                'parameters), though not its output.%s' % (
                    dblock.block.name, _padding_text(sig.fmt, padded.fmt), what, drawn[0],
                    drawn[1], _PADDING_ADVICE))


LENGTH_INPUTS = {'softmax': ('use_length', 'axis', -1),
                 'log_softmax': ('use_length', 'axis', -1),
                 'SequenceMask': ('use_sequence_length', 'axis', 0),
                 'SequenceLast': ('use_sequence_length', 'axis', 0),
                 'SequenceReverse': ('use_sequence_length', None, 0)}
"""Ops that read a length per row from their input 1, when their flag is
set (the flag, the attribute naming the axis the length runs along, its
default).  MXNet 1.9.1 does not check the lengths: ``softmax`` given a
length past its axis reads and writes out of bounds (the process aborted
in ``free()``), so :func:`check_padding_is_neutral` draws the arguments
that lengths are computed from as whole numbers that fit."""

INDEX_INPUTS = {'pick': ('axis', -1)}
"""Ops that read a position per row along an axis from their input 1 (the
attribute naming the axis, its default): :func:`check_padding_is_neutral`
draws the arguments those positions are computed from as whole numbers
from 0 to the shorter list's axis, as for :data:`LENGTH_INPUTS`.  Drawn
from its ranges instead, a pointer network's ``pick`` of the target's
probability from a softmax over a ragged list read past the shorter list
(``pick`` clips: its last element) where the padded one read a padding
element, and a block neutral for every valid target was refused (a user
trial)."""

POSITION_COPIES = ('Cast', 'amp_cast', 'Reshape', 'expand_dims', 'squeeze', 'Flatten', '_copy',
                   'BlockGrad', 'broadcast_like', 'reshape_like', 'broadcast_to',
                   'broadcast_axis')
"""Ops through whose input 0 ``pick`` reads an argument's values as its
positions, unchanged but for dtype and shape: only such arguments are
drawn as positions (:func:`_drawn_arguments`).  The user promises valid
positions, not valid scores: an argument reached otherwise (the list's
scores under ``argmax``, or under ``zeros_like`` or ``broadcast_like``'s
shape input) was drawn as whole numbers from 0, never negative, and a
block whose ``max`` over the list padding changes for negative scores
passed the check and batched wrong values (a fuzzer's case)."""

SHAPE_INPUTS = {'broadcast_like': (1,), 'reshape_like': (1,), 'zeros_like': (0,),
                'ones_like': (0,), 'shape_array': (0,), 'size_array': (0,)}
"""Inputs of ops whose values the output does not read, only their shape:
lengths computed through them do not make those arguments lengths (a
length ``broadcast_like(n, scores)`` drew the list's scores as whole
numbers from 1, and a ``min`` over the list passed the check)."""


def _drawn_arguments(nodes, entry, positions):
    """The names of the arguments whose values reach the graph entry
    ``entry``: for ``positions``, only through :data:`POSITION_COPIES`;
    for lengths, through any input but :data:`SHAPE_INPUTS`."""
    found, seen, todo = set(), set(), [entry]
    while todo:
        index = todo.pop()
        if index in seen:
            continue
        seen.add(index)
        node = nodes[index]
        if node['op'] == 'null':
            found.add(node['name'])
        elif positions:
            if node['op'] in POSITION_COPIES:
                todo.append(node['inputs'][0][0])
        else:
            skip = SHAPE_INPUTS.get(node['op'], ())
            todo += [inp[0] for k, inp in enumerate(node['inputs']) if k not in skip]
    return found


def _length_inputs(dblock, symbol, one):
    """``[(op, length symbol, axis size, data names, one)]`` for each op of
    :data:`LENGTH_INPUTS` in ``symbol`` (of signature ``one``) that reads
    lengths computed from the block's arguments: what computes its lengths,
    the size of the axis they run along, and the names of the arguments
    they are computed from (``one``'s names: a signature names its
    arguments by position, so a list padded longer moves the names of the
    arguments after it)."""
    graph = json.loads(symbol_json(symbol))
    nodes = graph['nodes']
    below = inputs_below(nodes)
    known = {name: shape for name, shape in zip(one.data_names, one.in_shapes)
             if name in symbol.list_arguments()}
    found = []
    for node in nodes:
        attrs = node.get('attrs', {})
        if node['op'] in INDEX_INPUTS:
            if attrs.get('mode', 'clip') == 'wrap':
                # (a negative position is valid there, the list's last
                # element per sample and padding batched: drawn as any
                # argument, negatives too, so such a block is refused)
                continue
            spec, kind = (None,) + INDEX_INPUTS[node['op']], 'positions'
        else:
            spec, kind = LENGTH_INPUTS.get(node['op']), 'lengths'
        if spec is None or len(node['inputs']) < 2 or (
                kind == 'lengths' and attrs.get(spec[0], 'False').lower() not in ('true', '1')):
            continue
        if not any(name in one.data_names for name in below[node['inputs'][1][0]]):
            continue
        # (the arguments drawn: may be none, the values then still checked)
        drawn = _drawn_arguments(nodes, node['inputs'][1][0], kind == 'positions')
        data = [name for name in one.data_names if name in drawn]
        if not data and kind == 'positions':
            continue    # (positions computed: the check runs them as they come)
        # the op's data and lengths, each exactly the entry it reads (by
        # the graph: an op's outputs are not all named '<op>_output<i>')
        source, length = (load_graph(dict(graph), nodes, [entry])
                          for entry in node['inputs'][:2])
        args = set(source.list_arguments())
        data_shape = source.infer_shape_partial(
            **{name: shape for name, shape in known.items() if name in args})[1][0]
        axis = int(attrs[spec[1]]) if spec[1] and spec[1] in attrs else spec[2]
        if not data_shape or not data_shape[axis % len(data_shape)]:
            raise InputError(
                'block %s declares pad_lists, but the padding check cannot tell how long the '
                'axis of its op %s (%s) is, to give it valid %s.%s'
                % (dblock.block.name, node['op'], node['name'], kind, _PADDING_ADVICE))
        # (the largest valid value: a length may be the axis, a position not)
        size = data_shape[axis % len(data_shape)]
        found.append((node, length, size if kind == 'lengths' else size - 1, data, one, kind))
    return found


def _drawn_array(values, ctx, dtype):
    """``mx.nd.array(values, ctx=ctx, dtype=dtype)`` for a numpy array the
    padding check has just drawn (fresh, never written afterwards, as
    :func:`~.execute.to_device` asks): the same values, converted by numpy
    as ``mx.nd.array`` converts them, without its slice assignment's ~0.2
    ms of Python checks (~50 arrays a check of a SICK node: inputs, head
    gradients, random parameters).  ``mx.nd.array`` itself for a 0-d or
    empty array, which it makes otherwise."""
    dtype = np.float32 if dtype is None else dtype      # (mx.nd.array's default)
    if values.ndim == 0 or values.size == 0:
        return mx.nd.array(values, ctx=ctx, dtype=dtype)
    return to_device(np.asarray(values, dtype=dtype), ctx)


def _valid_lengths(dblock, sig, padded, lengths, leaves, rng, zero, random_parameters,
                   whole=False):
    """``leaves`` with the arguments that lengths are computed from
    (``lengths``, :func:`_length_inputs`; and those ``pick`` reads as
    positions, drawn from 0 to the shorter list's last position) drawn as
    whole numbers from 1 to the shortest axis those lengths run along (0
    is no length of a real list: a masked fill of every step,
    ``SequenceMask(value=-1e9)``, then makes a softmax over the padding
    uniform); raise if the lengths so
    computed still fall outside it (computed otherwise than copied or
    cast), since MXNet would read out of bounds.  The padded symbol's
    names are mapped to the shorter signature's by position (a padding
    element is no argument drawn): taken as they are, the name of an
    argument after a padded list named another argument of the shorter
    signature, which was then drawn as whole numbers instead (a list under
    ``max`` drawn positive passed a false claim).  Lengths computed with
    parameters are checked with the block's own and with the random values
    the symbols run with (``random_parameters()``, by name): unchecked, a
    length argument scaled by a parameter aborted the process.  With
    ``whole``, each is drawn at its largest value (the whole shorter list,
    its last position), as a list told its own length is at run time:
    drawn at random only, a ``min`` over a list masked past its length
    passed the check wherever no draw was the whole list (a fuzzer's
    case)."""
    # the padded signature's name -> the shorter one's, None for padding
    short_name = dict(zip(padded.data_names, pad_leaves(sig.fmt, list(sig.data_names),
                                                        padded.fmt, lambda item: None)))
    # name -> (lowest, highest) whole number drawn: from 1 to the shortest
    # axis for lengths, from 0 to its last position for positions, both
    # for an argument read as both.  (One range for all, the least of
    # their largest values, drew lengths short of a list of n, or of 0
    # beside a position along an axis of 1, where a softmax gave NaN alike
    # padded or not: false claims passed, a fuzzer's case.)
    ranges = {}
    for _, _, size, data, one, kind in lengths:
        for name in data:
            name = name if one is sig else short_name.get(name)
            if name is not None:
                low, high = ranges.get(name, (0, size))
                ranges[name] = (max(low, kind == 'lengths'), min(high, size))
    ranges = {name: (min(low, high), high) for name, (low, high) in ranges.items()}
    names = set(ranges)
    # (drawn at random in every range, whole or not: skipped in the whole
    # ranges, the random range drew other lengths than before they were
    # added, and a max masked to 0 over lists of 3 that it had refused
    # passed, a fuzzer's case; so drawn, the random range draws as before)
    draws = {name: rng.randint(ranges[name][0], ranges[name][1] + 1, leaf.shape)
             for name, leaf in zip(sig.data_names, leaves) if name in names}
    leaves = [_drawn_array(np.full(leaf.shape, ranges[name][1]) if whole else draws[name],
                           leaf.context, leaf.dtype) if name in names else leaf
              for name, leaf in zip(sig.data_names, leaves)]
    longer = _pad_with_zeros(sig, padded, leaves, sig.dtype, zero)
    for node, length, size, data, one, kind in lengths:
        drawn = [ranges[name] for name in {name if one is sig else short_name.get(name)
                                           for name in data} - {None}]
        low = min((low for low, _ in drawn), default=0)
        limit = max((high for _, high in drawn), default=size)
        given = dict(zip(one.data_names, leaves if one is sig else longer))
        needed = length.list_inputs()
        if set(needed) <= set(given):
            tries = [('', given)]
        else:
            own = _own_parameters(one)
            drawn = {name: value.astype(sig.dtype or value.dtype, copy=False)
                     for name, value in random_parameters().items() if name in needed}
            tries = [(' with its parameters', dict(own, **given)),
                     (' with random parameters', dict(drawn, **given))]
        for parameters, values in tries:
            with mx.autograd.pause():
                got = mx.nd.CachedOp(length)(*[values[name] for name in needed]).asnumpy()
            if got.min() < 0 or got.max() > size:
                raise InputError(
                    'block %s declares pad_lists, but the padding check cannot give its op %s '
                    '(%s) %s within its axis of %d: drawn as whole numbers from %d to %d, '
                    'its arguments %s gave %s from %g to %g%s, %s.%s'
                    % (dblock.block.name, node['op'], node['name'], kind,
                       size if kind == 'lengths' else size + 1, low, limit,
                       ', '.join(_leaf_path(sig.fmt, sig.data_names.index(name))
                                 for name in sorted(names, key=sig.data_names.index)),
                       kind, got.min(), got.max(), parameters,
                       'and MXNet does not check them' if kind == 'lengths' else
                       'and past the shorter list the padded one reads padding',
                       _PADDING_ADVICE))
    return leaves


class _CheckPrep:
    """What the padding check derives from one traced signature (for a
    block of ``dtype``), made at its first check and kept on the
    signature: a signature meets several (a SICK Tree-LSTM node of one
    child is checked against the padded forms of 2 to 8 children, 27
    checks over 8 signatures), and its symbols, their analyses and its
    CachedOps were made again each time.

    * ``small``: the traced symbol with small ``Embedding`` tables
      (:func:`_small_tables`), which the runs with random parameters run;
      ``wide``: that symbol in float64 (:func:`_widened`) and
      ``runs_wide`` whether the check runs it (:func:`_runs_wide`);
    * ``ids`` and ``lengths``: its inputs that ids and lengths are computed
      from (:func:`_id_inputs`, :func:`_length_inputs`);
    * :meth:`own_run`: the traced symbol with the block's own parameters,
      what batched steps run (a hybridized Gluon block called with lists
      of another length than at its first call refuses them, so the check
      failed every flush that padded after ``wrapper.hybridize()``, found
      by a fuzzer, and its calls would fix the user's block to the
      check's list lengths; a block called as it is, not hybridized, ran
      one imperative op at a time, ~5x the CachedOp's time);
    * :meth:`op`: the CachedOps, one per thread (MXNet 1.9.1's CachedOp is
      not safe to call from two threads at once);
    * :meth:`parameter_shapes`: the shapes of its symbols' parameters,
      which every check of it inferred again (~1.6 ms a check of a SICK
      node)."""

    def __init__(self, dblock, sig, dtype):
        self.sig = sig
        self.small = _small_tables(sig.symbol)
        self.wide = _widened(self.small, dtype)
        self.runs_wide = _runs_wide([self.wide], dtype, [_integer_inputs(sig)])
        self.ids = _id_inputs(self.small)
        self.lengths = _length_inputs(dblock, self.small, sig)
        self._ops = op_local()
        self._shapes = {}

    @classmethod
    def of(cls, dblock, sig, dtype):
        """``sig``'s preparation for the check of a block of ``dtype``."""
        preps = sig.__dict__.setdefault('padding_check', {})
        key = np.dtype(dtype).name if dtype is not None else None
        prep = preps.get(key)
        if prep is None:
            prep = preps[key] = cls(dblock, sig, dtype)
        return prep

    def op(self, which):
        """This thread's CachedOp of ``'own'`` (the traced symbol), ``'small'``
        or ``'wide'``."""
        ops = self._ops.__dict__
        if which not in ops:
            ops[which] = make_cached_op(self.sig.symbol if which == 'own' else
                                        getattr(self, which))[0]
        return ops[which]

    def parameter_shapes(self, which):
        """``[(name, shape)]`` of the inputs of the symbol ``which``
        (``'small'`` or ``'wide'``) that are not data inputs (parameters
        and auxiliary states), in the order :func:`_random_parameters`
        draws them: arguments, then auxiliary states."""
        shapes = self._shapes.get(which)
        if shapes is None:
            one, symbol = self.sig, getattr(self, which)
            known = {name: shape for name, shape in zip(one.data_names, one.in_shapes)
                     if name in one.input_names}
            arg_shapes, _, aux_shapes = symbol.infer_shape(**known)
            names = symbol.list_arguments() + symbol.list_auxiliary_states()
            shapes = self._shapes[which] = [
                (name, shape) for name, shape in zip(names, arg_shapes + aux_shapes)
                if name not in one.data_names]
        return shapes

    def own_run(self, values):
        """The outputs on ``values`` with the block's parameters as they
        stand, nested as the block returns them (a failed check compares
        them so, see :func:`_shifted_outputs`).  The block's parameters
        are read, never written (another thread may be running them)."""
        one = self.sig
        out = _run_symbol(self.op('own'), one, values, _own_parameters(one))
        return out[0] if one.out_fmt == 0 else regroup(one.out_fmt, out)[0]


_PADDING_ADVICE = (' Pass pad_lists=False to DynBatchBlock (calls of different list lengths '
                   'then run as separate groups).')


FLOAT16_CLOSE = 4e-3
"""The padding check's tolerance for float16 values, relative to the
largest (:func:`_close`): four float16 steps (one step is 2**-10, 9.8e-4,
between 1 and 2)."""


def _close(a, b, wide=False):
    """Whether the padding check's outputs or gradients ``a`` and ``b``
    agree: float32 rounding, which longer sums order differently, grows
    with the values (~3e-7 of the largest output at a Tree-LSTM's sizes),
    so the tolerance is scaled to the largest, for every element: one that
    cancels to near zero keeps the rounding of its large terms (an absolute
    tolerance failed a correct Tree-LSTM, see :doc:`history`).  That
    tolerance hides a real difference in small elements beside large ones
    (a mean over the list beside a value of 1e6), so the symbols run in
    float64 where they can (``wide``: see :func:`_runs_wide`), compared
    within 1e-9 of the largest value.  NaNs in the same places are the
    block's own.

    Computed as ``np.allclose`` computes it, but where both are float
    arrays of one shape with no NaN or infinity (the largest magnitude of
    each is finite), ``np.allclose``'s general path is ``abs(a - b) <= atol
    + rtol * abs(b)`` everywhere, computed here in place without its ~60
    us of dispatch, ``isfinite`` and ``errstate`` a call (~60 calls a
    check, some of a parameter's gradient of 135,000 values), and
    ``nanmax`` is ``max`` where no NaN is.  (The same values: a sum and a
    product are the same whichever operand comes first.)  Equal finite
    arrays are close whatever the tolerance (it is never negative): a
    zero row added to a sum leaves it as it was, so most pairs are equal,
    and one comparison then decides.  Values of float16 (a block cast to it,
    whose parameters keep it from running wide) round ~500x coarser: a sum
    over two rows and over those and three zero rows differed by one
    float16 step (~1e-3), which refused a correct block (a user's trial);
    they are compared within 4e-3."""
    scale = 1e-9 if wide else FLOAT16_CLOSE if np.float16 in (
        getattr(a, 'dtype', None), getattr(b, 'dtype', None)) else 1e-5
    if type(a) is np.ndarray and type(b) is np.ndarray and a.shape == b.shape and \
            a.dtype.kind == 'f' and b.dtype.kind == 'f':
        top = np.abs(a).max(initial=0.1)
        if np.isfinite(top) and np.equal(a, b).all():
            return True
        tolerance = np.abs(b)
        if np.isfinite(top) and np.isfinite(tolerance.max(initial=0)):
            atol = scale * top
            np.multiply(tolerance, scale, out=tolerance)
            np.add(tolerance, atol, out=tolerance)
            difference = a - b
            np.abs(difference, out=difference)
            return bool(np.less_equal(difference, tolerance).all())
    atol = scale * np.nanmax(np.abs(a), initial=0.1)
    return np.allclose(a, b, rtol=scale, atol=atol, equal_nan=True)


def _widened(symbol, dtype):
    """``symbol`` with every op attribute ``dtype`` that names ``dtype``
    (a cast, a constant of a fixed type) naming float64 instead, for the
    padding check's float64 runs: in a block of that dtype such ops keep
    the values as they are, and a part left narrow would round as
    ``dtype`` does and fail float64's tolerance.  ``symbol`` itself when
    there is none."""
    graph = json.loads(symbol_json(symbol))
    changed = False
    for node in graph['nodes']:
        value = node.get('attrs', {}).get('dtype')
        if node['op'] != 'null' and value not in (None, 'None'):
            try:
                same = np.dtype(value) == np.dtype(dtype)
            except TypeError:
                continue
            if same:
                node['attrs']['dtype'] = 'float64'
                changed = True
    return mx.sym.load_json(json.dumps(graph)) if changed else symbol


def _runs_wide(symbols, dtype, integers):
    """Whether the padding check runs ``symbols`` (for a block of
    ``dtype``) in float64: ``dtype`` is a narrower float, and every value
    of each symbol is float64 when its inputs are (see :func:`_widened`),
    but for the integer data inputs that ``integers`` gives per symbol
    (name -> dtype) and the integer values computed from them.  MXNet's
    ``infer_type`` prints its arguments when it fails; the method behind
    it does not."""
    if dtype is None or np.dtype(dtype) not in (np.float32, np.float16):
        return False
    for symbol, fixed in zip(symbols, integers):
        try:
            _, types, _ = symbol.get_internals()._infer_type_impl(
                False, **{name: fixed.get(name, np.float64) for name in symbol.list_arguments()})
        except mx.base.MXNetError:
            return False
        if types is None or any(t is None or np.dtype(t) != np.float64 and not (
                fixed and np.issubdtype(t, np.integer)) for t in types):
            return False
    return True


def _integer_inputs(sig):
    """The data inputs of ``sig`` of an integer dtype, by name, with it."""
    return {name: dtype for name, dtype in zip(sig.data_names, sig.in_dtypes)
            if not np.issubdtype(dtype, np.floating)}


def _padding_text(short, long):
    """``'argument #1 from 1 to 3 arrays'`` for the list arguments whose
    lengths differ between nestings ``short`` and ``long`` (numbered from
    0, as the other errors number arguments; only flat lists of arrays are
    padded, see :meth:`DynBatchBlock._family_id`)."""
    return ', '.join('argument #%d from %d to %d arrays' % (i, len(a), len(b))
                     for i, (a, b) in enumerate(zip(short, long)) if a != b)


def _shifted_outputs(runs, sig, padded):
    """For a failed padding check, ``' (...)'`` when the outputs differ only
    in that a list output grew (else ``''``).  Outputs are compared flat,
    in order, as batched steps hand them out: a list output as long as a
    list argument moves every output after it."""
    nested = [runs[0][:2], [out[0] if one.out_fmt == 0 else regroup(one.out_fmt, out)[0]
                            for one, out in zip((sig, padded), runs[1][:2])]]
    if not all(_same_when_nested(*pair) for pair in nested):
        return ''
    counts = [[], []]
    flatten([runs[0][0]], counts[0])
    flatten([runs[0][1]], counts[1])
    return (' (it returns %d arrays for the shorter lists and %d padded: a list output as '
            'long as a list argument moves the outputs after it, so return such lists last)'
            % (len(counts[0]), len(counts[1])))


def _same_when_nested(short, long):
    """Whether the block's outputs for the shorter and the padded lists
    differ only in the length of list outputs: equal, output by output,
    where the two nestings overlap, and longer somewhere."""
    pairs, longer = [], [False]

    def walk(a, b):
        nested = isinstance(a, (list, tuple)), isinstance(b, (list, tuple))
        if nested == (True, True):
            longer[0] |= len(b) > len(a)
            return all(walk(x, y) for x, y in zip(a, b))
        if nested == (False, False):
            pairs.append((a, b))
            return True
        return False
    return walk(short, long) and longer[0] and all(
        a.shape == b.shape and _close(a.asnumpy(), b.asnumpy()) for a, b in pairs)


def _random_parameters(signatures, dtype, ctx):
    """Values drawn from [-0.5, 0.5] for every input of the symbols of
    ``signatures`` (pairs of a signature and the ``[(name, shape)]`` of its
    symbol's inputs that are not data inputs, :meth:`_CheckPrep.parameter_shapes`:
    parameters and auxiliary states, named alike in both), by name, in
    ``dtype`` (None: each parameter's own): one after another, in that
    order, from ``np.random.RandomState(1)`` (see :func:`_parameter_draws`)."""
    order, dtypes = [], {}
    for one, shapes in signatures:
        own = {param.name: param.dtype for _, param in one.param_slots}
        for name, shape in shapes:
            if name not in dtypes:
                order.append((name, shape))
                dtypes[name] = dtype or own.get(name, np.float32)
    draws = _parameter_draws(tuple(shape for _, shape in order))
    # (a copy: a CPU array of a threaded engine wraps the numpy array it is
    # given, and the draws are kept)
    return {name: _drawn_array(np.array(draw, dtype=dtypes[name]), ctx, dtypes[name])
            for (name, _), draw in zip(order, draws)}


_DRAWS = collections.OrderedDict()
_DRAWS_LOCK = threading.Lock()
DRAWS_KEPT = (4, 1 << 20)
"""How many lists of :func:`_parameter_draws` are kept, and the most
values one may hold to be kept (8 MB in float64; a SICK node's hold
~280,000)."""


def _parameter_draws(shapes):
    """``[np.random.RandomState(1).uniform(-0.5, 0.5, shape) for shape in
    shapes]``, drawn one after another from one generator: the random
    parameters of the padding check, which depend on nothing but these
    shapes.  Kept for the last few lists (:data:`DRAWS_KEPT`): every check
    of a block draws the same (a SICK node's checks draw ~200,000 values
    each, ~2-5 ms), and are never written."""
    with _DRAWS_LOCK:
        draws = _DRAWS.get(shapes)
        if draws is not None:
            _DRAWS.move_to_end(shapes)
            return draws
    rng = np.random.RandomState(1)
    draws = [rng.uniform(-0.5, 0.5, shape) for shape in shapes]
    if sum(np.size(draw) for draw in draws) <= DRAWS_KEPT[1]:
        with _DRAWS_LOCK:
            _DRAWS[shapes] = draws
            while len(_DRAWS) > DRAWS_KEPT[0]:
                _DRAWS.popitem(last=False)
    return draws


CHECK_TABLE_ROWS = 16
"""Rows of each ``Embedding`` table in the symbols
:func:`check_padding_is_neutral` runs with random parameters: its random
ids lie in [-8, 8], which read rows 0 to 8 of any table (``Embedding``
clips), and both symbols it compares read the same small table.  With a
table of the vocabulary's size, every check drew, copied and compared
it whole, sixteen times: ~2.6-5 s a check and 1 GB of memory for a
Tree-LSTM node embedding 100,000 words (a minibatch's first flushes run
~20 checks)."""


def _small_tables(symbol):
    """``symbol`` with every ``Embedding`` reading a table of at most
    :data:`CHECK_TABLE_ROWS` rows, where its table is read by
    ``Embedding`` ops alone (a table an output layer also reads, tied
    weights, keeps its size); ``symbol`` itself when nothing changes."""
    graph = json.loads(symbol_json(symbol))
    nodes = graph['nodes']
    changed = False
    for number, users in graph_readers(nodes, graph['heads']).items():
        if nodes[number]['op'] != 'null' or not all(
                user is not None and nodes[user]['op'] == 'Embedding' and
                nodes[user]['inputs'][1][0] == number for user in users):
            continue
        for user in users:
            attrs = nodes[user]['attrs']
            if int(attrs['input_dim']) > CHECK_TABLE_ROWS:
                attrs['input_dim'] = str(CHECK_TABLE_ROWS)
                changed = True
        attrs = nodes[number].get('attrs', {})          # a Gluon parameter's variable
        shape = tuple(ast.literal_eval(attrs.get('__shape__', '()')))
        if shape and shape[0] > CHECK_TABLE_ROWS:
            attrs['__shape__'] = str((CHECK_TABLE_ROWS,) + shape[1:])
            changed = True
    return mx.sym.load_json(json.dumps(graph)) if changed else symbol


def _list_elements(fmt, leaves):
    """The leaves of ``leaves`` (flat, nested as ``fmt``) that are
    elements of list arguments."""
    elements, start = [], 0
    for item in fmt:
        width = leaf_count(item)
        if item != 0:
            elements.extend(leaves[start:start + width])
        start += width
    return elements


def _symbol_gradients(op, sig, leaves, real, params, rng):
    """``[(name, gradient as numpy)]`` of ``op`` (see :func:`_run_symbol`)
    on ``leaves`` for the parameters (``params``, their gradients
    attached) and the leaves in ``real`` (by identity, in order), under a
    head gradient drawn from ``rng``'s state as it is now (so that two
    calls with outputs of equal shapes use the same one; ``rng`` is left
    as it was)."""
    return _recorded_gradients(_recorded_run(op, sig, leaves, real, params), sig, params, rng)


def _recorded_run(op, sig, leaves, real, params):
    """The forward half of :func:`_symbol_gradients`: ``(outputs, copies of
    the leaves in real)``, recorded for autograd."""
    # (copies of those that take a gradient, which marks them: the leaves
    # themselves are read again, by the other symbol's run)
    copies = [leaf.copy() if any(leaf is r for r in real) else leaf for leaf in leaves]
    kept = [copy for copy, leaf in zip(copies, leaves) if copy is not leaf]
    for value in kept:
        value.attach_grad()
    with mx.autograd.record(train_mode=False):     # (Dropout: no mask to differ)
        outputs = _run_symbol(op, sig, copies, params)
    return outputs, kept


def _recorded_gradients(run, sig, params, rng):
    """The backward half of :func:`_symbol_gradients`, of ``run`` (see
    :func:`_recorded_run`).  (The head gradients are drawn after the
    forward: it draws nothing from ``rng``.)"""
    outputs, kept = run
    state = rng.get_state()
    arguments = _symbol_arguments(sig)
    heads = [_drawn_array(rng.uniform(-1, 1, out.shape), out.context, out.dtype)
             for out in outputs]
    rng.set_state(state)
    mx.autograd.backward(outputs, heads)
    grads = [('list element %d' % i, value.grad.asnumpy()) for i, value in enumerate(kept)]
    grads += [(name, params[name].grad.asnumpy()) for name in sorted(params)
              if name in arguments]
    return grads


def _symbol_arguments(sig):
    """The set of the names of ``sig``'s traced symbol's arguments, kept on
    the signature: each backward of the padding check asked MXNet (~0.2
    ms, 8 a check)."""
    known = sig.__dict__.get('padding_check_arguments')
    if known is None:
        known = sig.__dict__['padding_check_arguments'] = frozenset(
            sig.symbol.list_arguments())
    return known


def _pad_with_zeros(sig, padded, leaves, kind, made):
    """``leaves`` (``sig``'s) padded to the lists of ``padded`` with zero
    rows, one per list element position, kept in ``made``: of the float
    type ``kind`` for a list of floats, of the list's own dtype otherwise
    (see :func:`_in_kind`)."""
    def zeros(item):
        if item not in made:
            made[item] = mx.nd.zeros(padded.item_shape(item), ctx=sig.ctx,
                                     dtype=_in_kind(padded.item_dtype(item), kind))
        return made[item]
    return pad_leaves(sig.fmt, leaves, padded.fmt, zeros)


def _in_kind(dtype, kind):
    """The dtype in which the padding check gives a value of ``dtype`` to
    a run in ``kind``: ``kind`` for a float, ``dtype`` itself for another
    (token ids stay integers in a float64 run) or without a ``kind``."""
    return kind if kind is not None and np.issubdtype(dtype, np.floating) else dtype


class _SymbolRuns:
    """The padding check's runs of the short and the padded traced symbol
    in one float type (``kind``), with random values for every parameter:
    drawn as :func:`_random_parameters` draws them, so the same in every
    kind, their gradients attached once (each backward writes every
    input's, zeros where none reaches it, and each is read before the
    next).  A gradient is made in the parameter's dtype and context:
    MXNet 1.9.1's ``attach_grad(stype=...)`` makes a float32 one on the
    default context, and every float64 backward failed ('Backward shape
    inconsistent', its type check's message)."""

    def __init__(self, short, long, kind, wide, ids):
        sig, padded = short.sig, long.sig
        self.sig, self.padded, self.kind, self.ids = sig, padded, kind, ids
        self._recorded = self._cast_of = None
        which = 'wide' if wide else 'small'
        short_symbol, long_symbol = getattr(short, which), getattr(long, which)
        self.short_op, self.long_op = short.op(which), long.op(which)
        self.params = _random_parameters(((sig, short.parameter_shapes(which)),
                                          (padded, long.parameter_shapes(which))), kind, sig.ctx)
        arguments = set(long_symbol.list_arguments()) | set(short_symbol.list_arguments())
        stypes = {param.name: getattr(param, '_grad_stype', 'default')
                  for _, param in padded.param_slots}
        for name, value in self.params.items():
            if name in arguments:   # (an Embedding with sparse_grad takes a row-sparse one)
                mx.autograd.mark_variables([value], [mx.nd.zeros(
                    value.shape, ctx=value.context, dtype=value.dtype,
                    stype=stypes.get(name, 'default'))])
        self._zeros = {}

    def _cast(self, leaves):
        """``leaves`` cast to this kind: the same arrays for the same
        ``leaves`` (a list, by identity), which :meth:`outputs` and
        :meth:`gradients` both cast (a SICK node's check cast 17 arrays a
        range twice)."""
        known = self._cast_of
        if known is not None and known[0] is leaves:
            return known[1]
        cast = [leaf.astype(_in_kind(leaf.dtype, self.kind), copy=False) for leaf in leaves]
        self._cast_of = (leaves, cast)
        return cast

    def pad(self, leaves):
        """``leaves`` (the short signature's) padded with zero rows."""
        return _pad_with_zeros(self.sig, self.padded, leaves, self.kind, self._zeros)

    def outputs(self, leaves, recorded=False):
        """``(short outputs, padded outputs)`` on ``leaves`` (cast to this
        kind), or None where MXNet cannot run them in it.  With
        ``recorded`` (the check takes this kind's gradients next), run as
        the first try of :meth:`gradients` runs them, recorded for
        autograd, and kept for it: it ran the same two forwards again
        (~1/3 of a check's ~24 runs).  Where that fails, as before."""
        self._recorded = None
        cast = self._cast(leaves)
        if recorded:
            runs = self._record(leaves, cast)
            if runs is not None:
                return runs
        leaves = cast
        try:
            runs = (_run_symbol(self.short_op, self.sig, leaves, self.params),
                    _run_symbol(self.long_op, self.padded, self.pad(leaves), self.params))
            for out in runs[0] + runs[1]:
                out.wait_to_read()
        except mx.base.MXNetError:
            if self.kind == self.sig.dtype:
                raise
            return None
        return runs

    def _record(self, leaves, cast):
        """The runs of :meth:`outputs` as :meth:`gradients` runs them first
        (its list elements copied and marked, nothing zeroed: so only
        where no argument but the list elements is read as ids), kept for
        it; None where they fail or would differ.  The padded run reads
        copies of the other arguments: an array that two recorded runs
        read, and that takes no gradient, is a node of both graphs, which
        the short run's backward clears, where before it came first
        (read by both, every padded backward of 40 random blocks failed,
        'The any container is empty requested=...AGInfo', and ran again
        as before)."""
        elements = _list_elements(self.sig.fmt, cast)
        others = {name for name, leaf in zip(self.sig.data_names, cast)
                  if not any(leaf is e for e in elements)}
        if others & self.ids:
            return None
        try:
            short = _recorded_run(self.short_op, self.sig, cast, elements, self.params)
            apart = [leaf if any(leaf is e for e in elements) else leaf.copy() for leaf in cast]
            long = _recorded_run(self.long_op, self.padded, self.pad(apart), elements,
                                 self.params)
            for out in short[0] + long[0]:
                out.wait_to_read()
        except Exception:   # pylint: disable=broad-except
            return None     # (run as before: what failed fails there again)
        self._recorded = (leaves, short, long)
        return short[0], long[0]

    def gradients(self, leaves, ids, rng):
        """The gradients (see :func:`_symbol_gradients`) of the short and
        the padded symbol, or None where MXNet can differentiate neither.
        The other arguments keep their random values (a gradient that
        scales with one is compared where it is not zero), but those read
        as ids (``ids``) are zero: a gradient lookup checks them (a
        row-sparse one refuses a negative id; the values were clipped);
        where MXNet still refuses, all of them are zero.  The first try's
        forwards are those :meth:`outputs` recorded for the same
        ``leaves``, where it did."""
        recorded, self._recorded = self._recorded, None
        if recorded is not None and recorded[0] is leaves:
            try:
                return (_recorded_gradients(recorded[1], self.sig, self.params, rng),
                        _recorded_gradients(recorded[2], self.padded, self.params, rng))
            except Exception:   # pylint: disable=broad-except
                pass            # (run again as before: what failed fails there again)
        leaves = self._cast(leaves)
        elements = _list_elements(self.sig.fmt, leaves)
        others = {name for name, leaf in zip(self.sig.data_names, leaves)
                  if not any(leaf is e for e in elements)}
        for zeroed in [others & ids] + ([others] if others - ids else []):
            tried = [leaf.zeros_like() if name in zeroed else leaf
                     for name, leaf in zip(self.sig.data_names, leaves)]
            real = elements
            try:
                try:
                    short = _symbol_gradients(self.short_op, self.sig, tried, real, self.params,
                                              rng)
                except mx.base.MXNetError:  # an element read where it takes no gradient (an id)
                    real = []
                    short = _symbol_gradients(self.short_op, self.sig, tried, real, self.params,
                                              rng)
                return short, _symbol_gradients(self.long_op, self.padded, self.pad(tried), real,
                                                self.params, rng)
            except mx.base.MXNetError:
                continue
        return None


ID_INPUTS = dict({op: 0 for op in INDEXED_OPS}, take=1, pick=1, batch_take=1, one_hot=0,
                 gather_nd=1, scatter_nd=1)
"""Ops that read ids (which position of their inputs): the padding check's
gradient half feeds zeros to the inputs that reach them."""


def _id_inputs(symbol):
    """Names of the inputs of ``symbol`` from which an op of
    :data:`ID_INPUTS` computes the ids it reads."""
    nodes = json.loads(symbol_json(symbol))['nodes']
    below = inputs_below(nodes)
    return set().union(*(below[node['inputs'][ID_INPUTS[node['op']]][0]] for node in nodes
                         if node['op'] in ID_INPUTS and
                         len(node['inputs']) > ID_INPUTS[node['op']]))


def _own_parameters(sig):
    """The block's parameters as they stand, by the name of ``sig``'s
    traced symbol's input each feeds (for :func:`_run_symbol`)."""
    return {sig.input_names[i]: param.data(sig.ctx) for i, param in sig.param_slots}


def _run_symbol(op, sig, leaves, params):
    """``op``, a CachedOp of ``sig``'s traced symbol, run on ``leaves``
    with ``params`` (by name): the list of its outputs."""
    data = dict(zip(sig.data_names, leaves))
    inputs = [data[name] if name in data else params[name] for name in sig.input_names]
    _seed_draws()
    outputs = op(*inputs)
    return [outputs] if isinstance(outputs, mx.nd.NDArray) else list(outputs)


def _materialize(args, ctx=None):
    """Arguments for the wrapped block outside a scope: lazy values become
    their NDArrays and host numpy arrays become NDArrays on the context of
    the call's first NDArray or lazy value (else the current one), where a
    scope runs the call (:func:`_signature_key`).  Made on
    ``mx.current_context()`` instead, the token ids of a model on a GPU
    failed, or sent its gradients to another context's copy of its
    parameters."""
    if ctx is None:
        ctx = _first_context(args) or mx.current_context()
    out = []
    for arg in args:
        if isinstance(arg, (list, tuple)):
            out.append(type(arg)(_materialize(arg, ctx)))
        elif type(arg) is LazyValue:
            out.append(arg.data)
        elif isinstance(arg, np.ndarray):
            out.append(mx.nd.array(arg, ctx=ctx, dtype=arg.dtype))
        else:
            out.append(arg)
    return out


def _first_context(args):
    """The context of the first NDArray or lazy value in ``args`` (nested
    lists too), or None."""
    for arg in args:
        if isinstance(arg, (list, tuple)):
            found = _first_context(arg)
            if found is not None:
                return found
        elif type(arg) is LazyValue or isinstance(arg, NDArray):
            return arg.context
    return None


class DynBatchBlock(Block):
    """Wrap a Gluon ``HybridBlock`` so that per-sample calls inside a
    :func:`~gluon_dynbatch.batching` scope are recorded and run batched.

    Parameters
    ----------
    block : HybridBlock
        The per-sample block.  Its symbol decides batch safety (see
        :mod:`gluon_dynbatch.rules`).
    pad_lists : bool, optional
        Declares that appending zero rows to the block's list arguments leaves
        its outputs unchanged (true of sums over children, as in the child-sum
        Tree-LSTM; false of means).  Calls that differ only in list lengths
        may then run as one batched call, their lists padded with zeros.  The
        claim is checked numerically once per padded shape (with the
        block's parameters and with random ones).  Defaults to the
        block's ``dynbatch_pad_lists`` attribute, else False.
    prefix : str, optional
        Gluon's name prefix of the wrapper itself (its parameters are the
        wrapped block's, under their own names).

    Notes
    -----
    Parameters are the wrapped block's own: ``collect_params``,
    ``initialize``, ``save_parameters`` and ``load_parameters`` act on it
    with the same names, so files move freely between the two.  Other
    attributes the wrapper lacks are the wrapped block's (an RNN cell's
    ``begin_state``, a parameter); ``block`` is the wrapped block.  A recorded
    call reads the parameters when it runs: changing them (``set_data``,
    ``initialize(force_reinit=True)``, a trainer step) before its scope has
    run it changes its result; the wrapper's :meth:`cast` runs them first.
    """

    def __init__(self, block, pad_lists=None, prefix=None):
        if not isinstance(block, mx.gluon.HybridBlock):
            hybrid = {'Sequential': 'HybridSequential',
                      'SequentialRNNCell': 'HybridSequentialRNNCell'}.get(type(block).__name__)
            raise InputError('DynBatchBlock wraps a gluon HybridBlock (it traces the block\'s '
                             'hybrid_forward symbolically); got %s.%s'
                             % (type(block).__name__, ' Use its hybrid form, %s.' % hybrid
                                if hybrid else ''))
        super().__init__(prefix=prefix)
        self.block = block
        if pad_lists is None:
            pad_lists = getattr(block, 'dynbatch_pad_lists', False)
        if not _is_flag(pad_lists):
            raise InputError('DynBatchBlock(%s): pad_lists=%r (or the block\'s '
                             'dynbatch_pad_lists): give True or False.'
                             % (block.name, pad_lists))
        self.pad_lists = bool(pad_lists)
        self.__dict__.update(self._untraced())

    def __getstate__(self):
        """Pickled and deep-copied without what it traced: traced signatures
        hold MXNet CachedOps and per-thread state, which cannot be copied
        (copying failed once the block had run in a scope).  A copy traces
        its own at its first calls (a target network, a best-so-far
        snapshot).  A hybridized block that ran outside a scope drops its
        CachedOp (it is made again at its next such call), which Gluon
        cannot copy either."""
        clear = getattr(self.block, '_clear_cached_op', None)
        if clear is not None:
            clear()
        return self._shared_state()

    def __setstate__(self, state):
        self.__dict__.update(state)
        # a copied parameter's gradient buffer is not marked for autograd
        # (plain Gluon blocks copy so too, and backward then fails with
        # "Cannot differentiate node"): give the copy's parameters their own
        for param in self.collect_params().values():
            if param._data is not None:   # pylint: disable=protected-access
                param._init_grad()        # pylint: disable=protected-access

    def __copy__(self):
        """A shallow copy shares the parameters (and their gradients, which
        :meth:`__setstate__` would reset) but, as a copy, traces its own."""
        twin = type(self).__new__(type(self))
        twin.__dict__.update(self._shared_state())
        return twin

    def _shared_state(self):
        """This block's attributes, with what it traced left out."""
        return dict(self.__dict__, **self._untraced())

    @staticmethod
    def _untraced():
        """The state of a block that has traced nothing (set in __init__)."""
        return {'_signatures': {}, '_families': {}, '_pad_checked': set(),
                '_padded': {},       # tuple of signatures -> their padded signature
                '_warned': False,    # PerSampleWarning given
                '_warned_many': False,      # ManySignaturesWarning given
                '_traced_blocks': None,     # blocks_of(self.block) when it first traced
                '_sparse_params': ()}       # row-sparse-gradient parameters its graphs read

    def _forget_traces(self):
        """Drop every signature traced so far: the next calls trace the
        block again (what they were traced under changed, see
        :func:`_forget_stale_traces`, or :meth:`hybridize` or :meth:`cast`
        was called).
        Calls already recorded keep their signatures."""
        with _TRACING:
            self.__dict__.update(self._untraced())
            _TRACED.discard(self)
        if accel.memo_clear is not None:
            accel.memo_clear()

    def __call__(self, *args, **kwargs):
        # Replaced by its C version where the extension is built (see
        # gluon_dynbatch.accel), which runs this one for what it defers.
        if kwargs:
            raise InputError('block %s takes its arguments by position (got keyword '
                             'arguments %s): pass them in the order of its hybrid_forward.'
                             % (self.block.name, ', '.join(sorted(kwargs))))
        scope = getattr(_LOCAL, 'scope', None)     # current_scope(), inlined: hot path
        if scope is None:
            return self.block(*_materialize(args))
        return scope.record(self, args)

    def forward(self, *args):  # pylint: disable=arguments-differ
        return self.block(*_materialize(args))

    def _trace(self, key, fmt, ctx):
        shapes = key[1:-2]
        dtypes = list(key[-2]) if type(key[-2]) is tuple else [key[-2]] * len(shapes)
        for pos, dtype in enumerate(dtypes):
            if np.dtype(dtype).type not in _DTYPE_NP_TO_MX:
                # (the trace's type inference failed with a bare TypeError)
                name = np.dtype(dtype).name
                raise InputError(
                    'block %s, argument %s has dtype %s%s, which MXNet arrays cannot hold (they '
                    'take float16/32/64, uint8, int8/32/64 and bool). Convert it, e.g. '
                    'x.astype(np.%s), or keep such values out of the block\'s arguments.'
                    % (self.block.name, _leaf_path(fmt, pos), name,
                       # (numpy's longlong is int64 by name, not MXNet's np.int64)
                       ' (numpy\'s %s)' % np.dtype(dtype).type.__name__
                       if name in _MXNET_DTYPE_NAMES else '',
                       name if name in _MXNET_DTYPE_NAMES else 'float32'))
        for pos, shape in enumerate(shapes):
            if not shape or shape[0] != 1:
                raise InputError(
                    'block %s, argument %s has shape %s: per-sample inputs need a leading batch '
                    'axis of 1 (use x[i:i+1] or x.reshape((1,) + x.shape)).'
                    % (self.block.name, _leaf_path(fmt, pos), shape))
        pos = 0
        for item, nesting in enumerate(fmt):   # a list is gathered as one (N, K, ...) block
            width = leaf_count(nesting)
            if nesting != 0 and len(set(shapes[pos:pos + width])) > 1:
                raise InputError(
                    'block %s, argument #%d is a list of arrays of different shapes %s; the '
                    'arrays of one list argument must share a shape (a list is gathered as one '
                    '(N, K, ...) array). Pass arrays of other shapes as separate arguments: '
                    'for a block that takes such a list, e.g. a state [r, c] of '
                    'gluon.contrib.rnn.LSTMPCell, wrap a HybridBlock whose hybrid_forward(F, '
                    'x, r, c) calls it with [r, c] (see the quickstart).'
                    % (self.block.name, item, sorted(set(shapes[pos:pos + width]))))
            if nesting != 0 and len(set(dtypes[pos:pos + width])) > 1:
                raise InputError(
                    'block %s, argument #%d is a list of arrays of different dtypes (%s); the '
                    'arrays of one list argument must share a dtype (a list is gathered as one '
                    '(N, K, ...) array). Cast them alike (x.astype(...)).'
                    % (self.block.name, item, ', '.join(
                        sorted({np.dtype(d).name for d in dtypes[pos:pos + width]}))))
            pos += width
        # One trace at a time: Gluon's name scopes and ``with ctx`` keep their
        # state on the (shared) block and Context objects, so two threads
        # tracing at once corrupt each other.  A signature is published only
        # when complete (the C recorder reads _signatures without the lock).
        with _TRACING:
            sig = self._signatures.get(key)     # traced by another thread meanwhile
            if sig is not None:
                return sig
            # a copy: a Context keeps the one it replaces on itself, so
            # entering the user's own current Context again would lose theirs
            with mx.Context(ctx):
                sig = trace_signature(_SIG_IDS, self.block, fmt, shapes, dtypes)
            widths = [leaf_count(nesting) for nesting in fmt]
            for each in filter(None, (sig, sig.inference)):
                each.ctx, each.fmt, each.dblock, each.in_shapes = ctx, fmt, self, shapes
                each.key, each.in_dtypes, each.dtype = key, dtypes, common_dtype(dtypes)
                each.spans = tuple((sum(widths[:item]), width)
                                   for item, width in enumerate(widths))
                each.out_info = [(shape, dtype, ctx)
                                 for shape, dtype in zip(each.out_shapes, each.out_dtypes)]
                each.group_key = self._family_id(key, fmt) if each.batch_safe \
                    else -1 - each.sig_id
            if self._traced_blocks is None:
                self._traced_blocks = blocks_of(self.block)
                _TRACED.add(self)
            sparse = [param for _, param in sig.param_slots
                      if getattr(param, '_grad_stype', 'default') == 'row_sparse']
            if sparse:      # (those its graphs read: one that none reads retraced every scope)
                self._sparse_params = tuple(set(self._sparse_params).union(sparse))
            self._signatures[key] = sig
        if not sig.batch_safe and not self._warned:
            if sig.inference is not None and autograd_mode() == 0:
                _UNWARNED.add(self)     # (its calls batch here: warned if run under autograd)
            else:
                self.warn_per_sample(sig)
        if len(self._signatures) >= MANY_SIGNATURES and not self._warned_many:
            self._warned_many = True
            warnings.warn(ManySignaturesWarning(
                'block %s has traced %d signatures, one per distinct combination of its '
                'arguments\' shapes, dtypes, list lengths and context (the latest: leaves of '
                'shapes %s), and '
                'keeps each, with its compiled programs, for the wrapper\'s life: memory '
                'grows with every new shape. Pad arguments whose shape varies freely to a few '
                'sizes, pass rows as a list to a pad_lists block, or call '
                'forget_signatures() now and then.'
                % (self.block.name, len(self._signatures), _few(key[1:-2]))),
                stacklevel=user_stacklevel())
        return sig

    def forget_signatures(self):
        """Drop every signature traced so far, with its compiled programs:
        later calls trace the block again (milliseconds each).  For a
        long-running process whose calls meet ever new argument shapes,
        which would otherwise keep one signature each for the wrapper's life
        (see :class:`~gluon_dynbatch.ManySignaturesWarning`).  The calls
        pending in this thread's scope run first, as for :meth:`cast`."""
        _run_pending_here()
        if self._signatures:
            self._forget_traces()

    def warn_per_sample(self, sig):
        """Say, once a wrapper, that ``sig``'s calls run per sample, why,
        and what to do."""
        if self._warned:
            return
        self._warned = True
        _UNWARNED.discard(self)
        warnings.warn(PerSampleWarning(
            'block %s runs per sample (correct, but one call at a time): %s. %s'
            'DYNBATCH_DEBUG=2 prints each flush\'s plan.'
            % (self.block.name, sig.reason, _per_sample_advice(sig.reason))),
            stacklevel=user_stacklevel())

    def _family_id(self, key, fmt):
        """Calls with equal family ids may merge.  With ``pad_lists`` the
        family is the signature with list lengths forgotten (flat lists whose
        leaves share one shape; a list empty in a call keeps the others padded
        with those of calls where it is empty too); otherwise it is the
        signature itself."""
        family = key
        if self.pad_lists and all(item == 0 or set(item) <= {0} for item in fmt):
            shapes, pos, parts = key[1:-2], 0, []
            # leaves of several dtypes: each argument's (lists' lengths forgotten)
            dtypes, kinds = (key[-2], []) if type(key[-2]) is tuple else (None, None)
            for item in fmt:
                width = 1 if item == 0 else len(item)
                elems = set(shapes[pos:pos + width])
                pos += width
                if len(elems) > 1:
                    parts = None
                    break
                parts.append(shapes[pos - 1] if item == 0 else ('list', min(elems, default=None)))
                if dtypes is not None:
                    kinds.append(dtypes[pos - 1] if width else None)
            if parts is not None:
                family = (tuple(0 if item == 0 else 'list' for item in fmt),) + tuple(parts) \
                    + (key[-2] if dtypes is None else tuple(kinds), key[-1])
        family_id = self._families.get(family)
        if family_id is None:   # ids unique across blocks: one counter for all
            family_id = self._families[family] = next(_SIG_IDS)
        return family_id

    def padded_signature(self, sigs):
        """The signature that runs calls of ``sigs`` (one family) together:
        each list argument padded to its longest length in the group.
        Remembered per tuple of signatures: depth grouping asks for every
        mixed step of every flush (SICK minibatch 25: depth planning 0.15
        -> 0.10 ms)."""
        sigs = tuple(sigs)
        sig = self._padded.get(sigs)
        if sig is None:
            SETUP[0] += 1
            sig = self._padded[sigs] = self._padded_signature(sigs)
        return sig

    def _padded_signature(self, sigs):
        first = sigs[0]
        lengths = [max(len(s.fmt[i]) for s in sigs) if item != 0 else 0
                   for i, item in enumerate(first.fmt)]
        fmt, shapes, dtypes = [], [], []
        for i, item in enumerate(first.fmt):
            if item == 0:
                fmt.append(0)
                shapes.append(first.item_shape(i))
                dtypes.append(first.item_dtype(i))
            else:
                fmt.append((0,) * lengths[i])
                one = next((s for s in sigs if len(s.fmt[i])), None)
                if one is not None:
                    shapes += [one.item_shape(i)] * lengths[i]
                    dtypes += [one.item_dtype(i)] * lengths[i]
        fmt = tuple(fmt)
        # (a key names one dtype where all leaves share it)
        dtype = tuple(dtypes) if len(set(dtypes)) > 1 else dtypes[0] if dtypes else None
        key = (fmt,) + tuple(shapes) + (dtype, first.key[-1])
        sig = self._signatures.get(key)
        if sig is None:
            sig = self._trace(key, fmt, first.ctx)
        if first.in_inference and sig.inference is not None:
            sig = sig.inference     # (calls made in inference, padded: theirs too)
        for other in sigs:
            # (an inference signature's check compares no gradients: apart)
            checked = (other.key, key, sig.in_inference)
            if other is not sig and checked not in self._pad_checked:
                start = time.perf_counter()
                try:
                    check_padding_is_neutral(self, other, sig)
                finally:
                    count, seconds = padding_checks()
                    _CHECKS.count, _CHECKS.seconds = \
                        count + 1, seconds + time.perf_counter() - start
                self._pad_checked.add(checked)
        ragged_lists(sig)       # sets sig.ragged, which plans read
        return sig

    def signatures(self):
        """Traced signatures so far: one per distinct call signature, and
        the padded signatures of steps that mix list lengths; after each,
        its :attr:`~.trace.TracedSignature.inference` where it has one."""
        return [each for sig in self._signatures.values()
                for each in (sig, sig.inference) if each is not None]

    def collect_params(self, select=None):
        return self.block.collect_params(select)

    def _collect_params_with_prefix(self, prefix=''):
        return self.block._collect_params_with_prefix(prefix)

    def save_parameters(self, filename, deduplicate=False):
        self.block.save_parameters(filename, deduplicate)

    def load_parameters(self, filename, ctx=None, allow_missing=False, ignore_extra=False,
                        cast_dtype=False, dtype_source='current'):
        # the block's own: a file of a block without child blocks holds
        # names without a '.', which Gluon loads by the loading block's
        # prefix (the wrapper's would match none of them)
        self.block.load_parameters(filename, ctx, allow_missing, ignore_extra, cast_dtype,
                                   dtype_source)

    def __getattr__(self, name):
        # only for names the wrapper lacks: the wrapped block's (an RNN
        # cell's begin_state, a parameter); private names are not forwarded
        # (and ``block`` itself is missing while Gluon's __init__ runs)
        block = self.__dict__.get('block')
        if name.startswith('_') or name == 'block' or block is None or \
                not hasattr(block, name):
            raise AttributeError("'%s' object has no attribute '%s'%s"
                                 % (type(self).__name__, name, '' if block is None else
                                    ' (nor has the %s it wraps)' % type(block).__name__))
        return getattr(block, name)

    def hybridize(self, active=True, **kwargs):
        """Hybridize the wrapped block (for its calls outside a scope) and,
        as Gluon clears a hybridized block's cached graph, forget what was
        traced: the next calls in a scope trace the block as it is now."""
        self.block.hybridize(active, **kwargs)
        if self._signatures:
            self._forget_traces()

    def cast(self, dtype):
        """Cast the wrapped block's parameters, after running the calls
        pending in this thread's scope: per sample they ran before the cast,
        in the old dtype, and their programs cannot read parameters of
        another.  The signatures traced so far are forgotten (their calls
        need inputs of the old dtype, which plain Gluon would refuse too)."""
        _run_pending_here()
        super().cast(dtype)
        if self._signatures:
            self._forget_traces()

    def __repr__(self):
        return 'DynBatchBlock(%r)' % (self.block,)


accel.attach_call(DynBatchBlock, _LOCAL, BatchingScope)


def _refusing_wrappers(register_child):
    """``HybridBlock.register_child``, refusing a :class:`DynBatchBlock` child
    with what to do instead.  Gluon refuses it too (a wrapper is no
    ``HybridBlock``), but advises ``HybridSequential``, which a user trial
    that nested wrappers in its model's ``HybridBlock`` could not act on."""
    @functools.wraps(register_child)
    def method(self, block, name=None):
        if isinstance(block, DynBatchBlock):
            raise ValueError(
                '%s cannot be a child of HybridBlock %s: a wrapper records calls, which a '
                'HybridBlock\'s symbolic trace cannot. Put the bare block in %s and wrap that '
                '(DynBatchBlock(%s(...))), or hold the wrappers in a plain gluon.Block.'
                % (block, self.name, self.name, type(self).__name__))
        return register_child(self, block, name)
    return method


mx.gluon.HybridBlock.register_child = _refusing_wrappers(mx.gluon.HybridBlock.register_child)
