"""Plans: which recorded calls run together, in what order.

A :class:`Plan` is plain data, a tuple of :class:`BatchStep`; the executor
only iterates over it.  Strategies turn a list of pending nodes into a plan:

* :class:`PerSample` - one step per call (no analysis at all);
* :class:`ByDepth` - calls of equal signature and equal depth (linear time);
  calls that nothing in the flush reads (sinks, e.g. a loss head per
  sample) wait for the deepest sink of their family, so they run as one step;
* :class:`Agenda` - DyNet's heuristic: repeatedly run every ready call of the
  signature whose calls have the lowest average depth.  It merges work that
  depth misaligns, e.g. chains of different lengths feeding a common head;
* :class:`CachedPlan` - reuse the plan of an earlier graph of the same
  structure (a hash, no analysis).

:class:`gluon_dynbatch.cost.Auto` chooses among them per flush.

Calls whose signature is not batch-safe always run one per step.  Calls are
grouped by their signature's ``group_key``: the signature itself, or its
family when the block allows zero-padded lists (``pad_lists``).
"""
import numbers
import threading
import time
import weakref
from collections import OrderedDict, defaultdict
from dataclasses import dataclass, field
from operator import itemgetter
from typing import List, Optional, Tuple

import numpy as np
from mxnet import autograd

from . import accel
from .errors import ScopeError
from .graph import PENDING, LazyValue

__all__ = ['BatchStep', 'Plan', 'Strategy', 'PerSample', 'ByDepth', 'Agenda', 'CachedPlan',
           'structure_key', 'merge_sinks', 'summarize', 'agenda_groups_py', 'STRATEGIES']


@dataclass(frozen=True)
class BatchStep:
    """Run ``nodes`` (calls of one signature) as one batched call; with
    ``ragged``, calls of a padded signature run their lists ragged (no
    padding elements: see :func:`~.lower.ragged_lists`)."""
    sig: object
    nodes: Tuple
    ragged: bool = False

    def __str__(self):
        return '%-40s x%d%s' % (self.sig.describe(), len(self.nodes),
                                ' ragged' if self.ragged else '')


@dataclass(frozen=True)
class Plan:
    """Steps in an order that respects every dependency.  ``recipes`` (one
    per step, filled in as steps run) lets a cached plan's later runs skip
    finding each row's source, and ``program`` (a whole cached plan compiled
    into one call, :func:`~.lower.flush_program`) replaces the steps' own
    calls; see :func:`~.execute.run_plan`."""
    strategy: str
    steps: Tuple[BatchStep, ...]
    recipes: Optional[List] = field(default=None, compare=False, repr=False)
    program: Optional[object] = field(default=None, compare=False, repr=False)

    def batch_sizes(self):
        return [len(step.nodes) for step in self.steps]

    def __str__(self):
        lines = ['Plan(%s, %d steps)' % (self.strategy, len(self.steps))]
        lines += ['  %3d %s' % (i, step) for i, step in enumerate(self.steps)]
        return '\n'.join(lines)


RAGGED = True
"""Whether a family whose padded signature allows it may run its calls of
every list length as one ragged step (see :func:`steps_of`)."""

RAGGED_STEP = 0.25
"""The extra cost of a ragged step, as a fraction of a step's fixed cost:
a SICK Tree-LSTM node step reading two earlier steps has 31 ops ragged, 26
padded in inference (two of the 31 make the zero rows its sums read, see
:data:`~.lanes.SEGMENT`).  Pricing ragged steps below padded ones in
training was slower (in one process, alternating, SICK minibatch 25:
-0.1 ran 0.94-0.97x, 0.6 ran 0.91x): a ragged step's host work (its
layout) costs more."""

SETUP = [0]
"""How many times planning did one-time work: a group of signatures met
for the first time gets its padded signature traced and checked
(``DynBatchBlock.padded_signature``, tens of ms).  The cost model skips
analysis times that include it: one such flush once priced depth's
analysis at 8 us a node instead of 0.4, and ``auto`` ran agenda's for a
hundred flushes."""

PADDING_COST = {'step_us': 300.0, 'elem_us': 1.0, 'family_step_us': {}}
"""What splitting a padded group trades: one more step (``step_us``, or the
family's own ``family_step_us``, kept up to date by the cost model) against
the padded list elements it avoids (``elem_us`` each: a gathered row and its
share of the per-element ops)."""


def make_steps(nodes):
    """Steps over ``nodes`` of one family (see :func:`steps_of`)."""
    by_sig = {}
    for node in nodes:
        by_sig.setdefault(node.sig, []).append(node)
    return steps_of(by_sig)


def steps_of(by_sig):
    """Steps over the calls of one family, given per signature.  Calls of
    one signature make one step.  Calls of several (list lengths differ) run
    under padded signatures, split into buckets of similar length where the
    padding saved outweighs the cost of another step (an exact minimisation
    over the distinct lengths, of which there are few); or, where the padded
    signature runs its lists ragged (:func:`~.lower.ragged_lists`: no
    padding element computed) and that is priced below the best split
    (:func:`_ragged_us`), as one ragged step."""
    if len(by_sig) == 1:
        sig, nodes = next(iter(by_sig.items()))
        return [BatchStep(sig, tuple(nodes))]
    sigs = sorted(by_sig, key=lambda sig: len(sig.data_names))
    step_us = PADDING_COST['family_step_us'].get(sigs[0].group_key)
    widths, counts = [len(sig.data_names) for sig in sigs], [len(by_sig[sig]) for sig in sigs]
    buckets, split_us = _split_buckets(widths, counts, step_us)
    if RAGGED:
        padded = sigs[0].dblock.padded_signature(sigs)
        if padded.ragged and _ragged_us(widths, counts, step_us) < split_us:
            return [BatchStep(padded, _joined(by_sig, sigs), True)]
    steps = []
    for first, last in buckets:
        group = _joined(by_sig, sigs[first:last + 1])
        sig = sigs[last] if first == last else \
            sigs[0].dblock.padded_signature(sigs[first:last + 1])
        steps.append(BatchStep(sig, group))
    return steps


def _joined(by_sig, sigs):
    """The calls of ``sigs``, in that order, as one tuple (joined as lists:
    a generator over every call was a third of :func:`steps_of`'s time)."""
    if len(sigs) == 1:
        return tuple(by_sig[sigs[0]])
    nodes = []
    for sig in sigs:
        nodes += by_sig[sig]
    return tuple(nodes)


def _ragged_us(widths, counts, step_us=None):
    """What one ragged step over calls of ``widths`` (``counts`` of each)
    costs in the terms of :func:`_split_buckets`: a step, its extra ops
    (:data:`RAGGED_STEP` of a step) and the real elements only."""
    step_us = step_us or PADDING_COST['step_us']
    return step_us * (1 + RAGGED_STEP) + \
        PADDING_COST['elem_us'] * sum(w * c for w, c in zip(widths, counts))


def _split_buckets(widths, counts, step_us=None):
    """Contiguous buckets ``[(first, last)]`` of the sorted ``widths`` that
    minimise sum(step_us + rows * widest * elem_us), and that sum."""
    step_us = step_us or PADDING_COST['step_us']
    elem_us = PADDING_COST['elem_us']
    n = len(widths)
    best = [0.0] + [float('inf')] * n
    cut = [0] * (n + 1)
    for end in range(1, n + 1):
        rows = 0
        for start in range(end, 0, -1):
            rows += counts[start - 1]
            cost = best[start - 1] + step_us + rows * widths[end - 1] * elem_us
            if cost < best[end]:
                best[end], cut[end] = cost, start - 1
    buckets, end = [], n
    while end:
        buckets.append((cut[end], end - 1))
        end = cut[end]
    return buckets[::-1], best[n]


PLANNING = threading.RLock()
"""Held while a strategy that keeps state across flushes (:class:`CachedPlan`,
:class:`~gluon_dynbatch.cost.Auto`) plans or learns: the instances of
:data:`STRATEGIES` serve the scopes of every thread (two threads once
raced on the cache of compiled plans)."""


class Strategy:
    """Interface: ``plan(nodes, summary=None) -> Plan`` for nodes in recording
    order (``summary``: see :func:`summarize`), and
    ``observe(...)``, told what the plan then cost.  What a strategy says
    of its last plan (``last_compile_s``, ``Auto.last``) is kept per
    thread."""
    name = 'strategy'

    def _thread_state(self):
        """This thread's record of the strategy's last plan."""
        state = self.__dict__.get('_per_thread')
        if state is None:
            with PLANNING:
                state = self.__dict__.setdefault('_per_thread', threading.local())
        return state

    @property
    def last_compile_s(self):
        """Seconds this thread's last :meth:`plan` spent compiling a whole
        plan (cached plans), part of its analysis time."""
        return getattr(self._thread_state(), 'compile_s', 0.0)

    @last_compile_s.setter
    def last_compile_s(self, seconds):
        self._thread_state().compile_s = seconds

    def plan(self, nodes, summary=None):
        raise NotImplementedError(
            'strategy %s (%s) does not implement plan(nodes, summary=None), which must return a '
            'Plan of the nodes (see gluon_dynbatch.plan.ByDepth for an example)'
            % (self.name, type(self).__name__))

    def prepare(self):
        """Called when a scope opens (one-time set-up, kept out of timings)."""

    def wants_step_times(self, every):
        """Whether the flush just planned should wait for each of its steps
        under a threaded engine, whose host clock otherwise sees only their
        launch, so that :meth:`observe` gets real step times.  Waiting
        stops Python from preparing the next step while the worker runs
        this one, so strategies that do not learn never ask; those that do
        override this (``every``: :data:`~gluon_dynbatch.block.TIMED_EVERY`)."""
        return False

    def observe(self, plan, step_seconds, analyse_s, nodes):
        """Called after the plan ran, with each step's seconds (None when
        the flush was not timed: see :meth:`wants_step_times`); strategies
        that learn override it."""


def check_plan(plan, nodes, strategy):
    """Refuse, naming the strategy, a plan of a strategy of the user's own
    that does not run each of ``nodes`` exactly once after the nodes it
    reads, merging only calls that may merge, each under a signature that
    runs it (its own, or its lists padded): such a plan failed deep in the
    execution (``'NoneType' object is not subscriptable``, numpy's
    ``cannot reshape``), or could have run rows of one signature through
    another's program (found by a review and a user's trial).  Plans of
    the package's own ``plan`` methods, subclasses' included, are not
    checked (a pass over the nodes, ~1 us a node)."""
    if type(strategy).plan.__module__.startswith(__package__ + '.'):
        return

    def refuse(what):
        raise ScopeError(
            'strategy %r (%s) planned %s: plan(nodes, summary) must return a Plan whose '
            'steps (BatchSteps) run every node of the flush exactly once, each after the '
            'nodes it reads, and merge only nodes of one signature whose calls may merge '
            '(sig.group_key equal, sig.batch_safe), each under its own signature, or, where '
            'their lists differ in length, under their padded signature, as '
            'gluon_dynbatch.plan.ByDepth does (gluon_dynbatch.plan.make_steps(nodes) makes '
            'such steps of one family\'s nodes).'
            % (strategy.name, type(strategy).__name__, what))
    if not isinstance(plan, Plan):
        refuse('a %s, not a Plan' % type(plan).__name__)
    flush = {id(node) for node in nodes}
    done = set()
    for number, step in enumerate(plan.steps):
        if not isinstance(step, BatchStep) or not step.nodes:
            refuse('step %d as %r' % (number, step))
        key = step.nodes[0].sig.group_key
        for node in step.nodes:
            if id(node) not in flush or id(node) in done:
                refuse('step %d with %r, %s' % (number, node, 'a node run twice'
                                                if id(node) in done else 'no node of the flush'))
            if len(step.nodes) > 1 and (node.sig.group_key != key or not node.sig.batch_safe):
                refuse('step %d merging %r with nodes it cannot merge with' % (number, node))
            if node.sig is not step.sig and not _pads_to(node.sig, step.sig):
                refuse('step %d running %r under the signature %s, which is neither its own '
                       'nor its lists padded' % (number, node, _describe(step.sig)))
            for producer in node.producers():
                if id(producer) not in done:
                    refuse('step %d with %r before a node it reads, %r' % (number, node,
                                                                          producer))
        if step.ragged and not getattr(step.sig, 'ragged', False):
            refuse('step %d ragged under the signature %s, which cannot run its lists ragged '
                   '(a padded signature whose .ragged is true can)'
                   % (number, _describe(step.sig)))
        done.update(id(node) for node in step.nodes)
    if len(done) != len(flush):
        refuse('%d of the flush\'s %d nodes' % (len(done), len(flush)))


def _pads_to(sig, padded):
    """Whether calls of ``sig`` may run under ``padded``: a signature of the
    same block and family whose padding of ``sig``'s lists was checked
    (:meth:`~.block.DynBatchBlock.padded_signature` checks it).  A step of
    mixed list lengths under the signature of its shortest lists failed
    deep in the execution with numpy's reshape error (a user's trial)."""
    dblock = getattr(padded, 'dblock', None)
    return (dblock is not None and getattr(sig, 'dblock', None) is dblock
            and sig.group_key == padded.group_key
            and (sig.key, padded.key, padded.in_inference) in dblock._pad_checked)


def _describe(sig):
    """A signature as error messages name it (any object a plan put there)."""
    describe = getattr(sig, 'describe', None)
    return describe() if callable(describe) else repr(sig)


def one_call(name, nodes):
    """The plan of a flush of one call, which every strategy runs alone:
    grouping it took a few microseconds a flush, which a loop that reads a
    value after every call pays every call (50 such flushes of a tiny block
    ran 1.12x slower by depth than per sample)."""
    return Plan(name, (BatchStep(nodes[0].sig, (nodes[0],)),))


class PerSample(Strategy):
    """Every call alone, in recording order (a valid topological order)."""
    name = 'per-sample'

    def plan(self, nodes, summary=None):
        return Plan(self.name, tuple(BatchStep(n.sig, (n,)) for n in nodes))


class ByDepth(Strategy):
    """Group by (depth, family); depth was computed while recording.

    A call that no other call of the flush reads (a sink) may run as late as
    its family's deepest sink without delaying anything, so sinks of one
    family run together: per-sample heads over trees of different depths
    make one step, not one per depth."""
    name = 'depth'

    def plan(self, nodes, summary=None):
        if len(nodes) == 1:
            return one_call(self.name, nodes)
        fast = accel.depth_groups
        groups, alone = fast(nodes) if fast is not None and type(nodes) is list \
            else depth_groups_py(nodes)
        steps = [(depth, key, [BatchStep(node.sig, (node,))]) for depth, key, node in alone]
        steps += [(depth, key, steps_of(by_sig)) for (depth, key), by_sig in groups.items()]
        steps.sort(key=lambda item: (item[0], item[1]))
        return Plan(self.name, tuple(step for _, _, group in steps for step in group))


def depth_groups_py(nodes):
    """Depth grouping: ``(groups, alone)``, with ``groups`` the batch-safe
    calls per (depth, family), each given per signature in recording order,
    and ``alone`` the (depth, family, node) of the others.  Sinks go to
    their family's deepest sink (see :class:`ByDepth`)."""
    last_sink = {}
    for node in nodes:
        if not node.used and node.sig.batch_safe:
            key = node.sig.group_key
            if node.depth > last_sink.get(key, -1):
                last_sink[key] = node.depth
    groups, alone = {}, []
    for node in nodes:
        sig = node.sig
        key = sig.group_key
        if sig.batch_safe:
            by_sig = groups.setdefault((node.depth if node.used else last_sink[key], key), {})
            by_sig.setdefault(sig, []).append(node)
        else:
            alone.append((node.depth, key, node))
    return groups, alone


def merge_sinks(groups, used):
    """Calls per (depth, family) as :class:`ByDepth` groups them, from
    recording's counts: ``groups`` (calls per (depth, family)) and ``used``
    (those of them read by a later call of the flush).  The unread calls of
    a family move to its deepest depth that has any."""
    last_sink = {}
    for (depth, family), count in groups.items():
        if count > used.get((depth, family), 0) and depth > last_sink.get(family, -1):
            last_sink[family] = depth
    merged = {}
    for (depth, family), count in groups.items():
        read = used.get((depth, family), 0)
        if read:
            merged[(depth, family)] = merged.get((depth, family), 0) + read
        if count > read:
            sink = (last_sink[family], family)
            merged[sink] = merged.get(sink, 0) + count - read
    return merged


def count_groups_py(nodes):
    """``(groups, used, alone)``: calls per (depth, family), those of them
    read by a later call of the flush, and the number of calls that run
    alone (not batch-safe).  Python recording keeps these counts as it goes;
    the C recorder (:mod:`~gluon_dynbatch.accel`) counts them here, in C, at
    the flush."""
    groups, used = {}, {}
    alone = 0
    for node in nodes:
        if node.sig.batch_safe:
            key = (node.depth, node.sig.group_key)
            groups[key] = groups.get(key, 0) + 1
            if node.used:
                used[key] = used.get(key, 0) + 1
        else:
            alone += 1
    return groups, used, alone


def summarize(nodes, counts=None):
    """What depth grouping will make of a flush, known before planning:
    ``depth_steps`` and a ``fingerprint`` (calls per merged (depth, family)
    group), from ``counts`` (see :func:`count_groups_py`) or, by default,
    counted from the nodes.  Its ``structure``, ``record_s`` and
    ``recorded`` are None: a scope puts there the :func:`structure_key` its
    tape wrote while recording, the seconds that recording took and the
    calls it recorded."""
    if counts is None:
        counts = (accel.count_groups or count_groups_py)(nodes)
    groups, used, alone = counts
    groups = merge_sinks(groups, used)
    return {'depth_steps': len(groups) + alone,
            'fingerprint': (frozenset(groups.items()), alone), 'structure': None,
            'record_s': None, 'recorded': None}


class Agenda(Strategy):
    """DyNet's agenda heuristic (``autobatch_strategy=1``): among the
    signatures with ready calls, run the one of lowest average depth
    (:func:`agenda_groups_py`, in C where built: in Python it cost ~1.2 us
    a node against depth grouping's 0.14, so ``auto`` paid for it wherever
    it chose it)."""
    name = 'agenda'

    def plan(self, nodes, summary=None):
        if len(nodes) == 1:
            return one_call(self.name, nodes)
        fast = accel.agenda_groups
        groups = fast(nodes) if fast is not None and type(nodes) is list else None
        if groups is None:
            groups = agenda_groups_py(nodes)
        return Plan(self.name, tuple(step for group in groups for step in make_steps(group)))


def agenda_groups_py(nodes):
    """The agenda's groups of calls (tuples of nodes), in the order they
    run: repeatedly, of the family (``group_key``) whose calls have the
    lowest average depth (ties: the lower key), every call that is ready
    (all its pending producers have run; a call that is not batch-safe,
    whose key is negative, goes alone and the rest stay ready)."""
    waiting, users = {}, defaultdict(list)
    for node in nodes:
        producers = node.producers()
        waiting[node] = len(producers)
        for producer in producers:
            users[producer].append(node)
    depth_sum, count = defaultdict(int), defaultdict(int)
    ready = defaultdict(list)
    for node in nodes:
        key = node.sig.group_key
        depth_sum[key] += node.depth
        count[key] += 1
        if waiting[node] == 0:
            ready[key].append(node)
    groups = []
    while ready:
        key = min(ready, key=lambda k: (depth_sum[k] / count[k], k))
        group = ready.pop(key)
        if key < 0:  # not batch-safe: one call, the rest stay ready
            group, rest = group[:1], group[1:]
            if rest:
                ready[key] = rest
        groups.append(tuple(group))
        for node in group:
            for user in users.get(node, ()):
                waiting[user] -= 1
                if waiting[user] == 0:
                    ready[user.sig.group_key].append(user)
    return groups


def structure_key(nodes):
    """Hashable structure of a recorded graph (see :func:`structure_key_py`).
    With :mod:`~gluon_dynbatch.accel` active it is the same structure as
    int32 words in bytes, which a scope's tape also writes while recording;
    the two forms never compare equal, so a cache filled in one mode only
    misses in the other."""
    fast = accel.structure_key
    if fast is not None and type(nodes) is list:
        return fast(nodes)
    return structure_key_py(nodes)


def structure_key_py(nodes):
    """Hashable structure of a recorded graph: per node its signature and,
    per leaf, the position of the node of this flush it reads (and which
    output), or whether it is host data or another array.  Two flushes with
    equal keys can run the same plan, gathering rows the same way.  One flat
    tuple (a signature fixes its number of leaves; a lazy leaf adds two
    entries, any other leaf one), built without per-node tuples."""
    key = []
    append = key.append
    for node in nodes:
        append(node.sig.sig_id)
        for leaf in node.leaves:
            kind = type(leaf)
            if kind is LazyValue:
                producer = leaf._node
                append(producer.pos if producer.state == PENDING else -1)
                append(leaf._index)
            else:   # strings: never equal to a position (False == 0 would be)
                append('host' if kind is np.ndarray else 'array')
    return tuple(key)


def at_least(owner, name, value, least, what='a number'):
    """``value`` when it is a real number >= ``least`` (infinity counts; a
    bool, a string, None or NaN does not), else a ValueError naming
    ``owner``, the argument and its value: a strategy's arguments are
    checked when it is made, where a wrong one failed at some later flush
    with a raw TypeError, or was taken silently."""
    if not isinstance(value, numbers.Real) or isinstance(value, bool) or not value >= least:
        raise ValueError('%s: %s=%r; give %s >= %s' % (owner, name, value, what, least))
    return value


def count_at_least(owner, name, value, least, what='a whole number'):
    """``value`` as an int when it is an integer >= ``least`` (numpy's
    integers count; a bool, a float, infinity included, a string or None
    does not), else a ValueError as :func:`at_least`'s: a count such as
    ``Auto(memory=1.5)`` or ``memory=float('inf')`` was taken silently."""
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or not value >= least:
        raise ValueError('%s: %s=%r; give %s >= %s' % (owner, name, value, what, least))
    return int(value)


class CachedPlan(Strategy):
    """Reuse the plan of an earlier flush with the same structure: no
    analysis beyond hashing the structure, and each step's rows are found
    from a recipe (earlier steps' outputs and a gather index already on the
    device) instead of per row.  On a miss, plan with ``fallback`` (a
    :class:`Strategy`, or ``'per-sample'``, ``'depth'`` or ``'agenda'``;
    by default a new :class:`ByDepth`) and remember the result (at most
    ``capacity`` structures and ``max_calls`` calls over all of them, the
    oldest dropped first: a stored plan keeps ~60 bytes of Python per call,
    and with entries alone as the bound a cache of minibatches of 1,024
    pairs could grow to ~4.6 GB).

    The first run of a stored plan (its first hit) learns its recipes; a
    miss runs like the fallback's plan.  A structure that has come back
    ``compile_after`` times, its recipes learned, is compiled, outside
    ``autograd.record()``, into one CachedOp for the whole plan
    (:func:`~.lower.flush_program`; the time it takes is reported as
    ``compile_ms``); at most ``max_compiled`` such
    programs are kept, the least recently used dropped first.  A structure
    whose program was dropped replays its recipes, and is compiled again
    only when it comes back within ``max_compiled`` hits of its last one
    (it is in use again): one that comes back less often would be dropped
    again before its next hit, and evaluating a fixed split of 197
    minibatches again and again recompiled every one each time (~8 ms
    each), so ``auto`` ran 0.5x ``depth``.

    A stored plan holds its signatures by weak reference, and a compiled
    program its parameters: a cache lives as long as the process (the
    shared ``'cached'`` and ``'auto'`` strategies), and must not keep a
    model the user dropped in memory; a plan whose blocks are gone is
    dropped at the next lookup or store.

    ``capacity`` and ``max_calls`` are numbers >= 1 (the newest plan is
    always kept, so a smaller bound would keep one all the same),
    ``compile_after`` a number of hits >= 0 (0 and 1 alike: at the first
    hit; ``float('inf')``: never compile), ``max_compiled`` a number of programs >= 0 (0: none is
    compiled); anything else is a ValueError when the strategy is made."""
    name = 'cached'

    def __init__(self, fallback=None, capacity=4096, compile_after=2, max_compiled=64,
                 max_calls=500_000):
        if isinstance(fallback, str) and fallback in ('per-sample', 'depth', 'agenda'):
            fallback = STRATEGIES[fallback]
        if fallback is not None and not isinstance(fallback, Strategy):
            raise ValueError("CachedPlan: fallback=%r; give None (depth), 'per-sample', "
                             "'depth', 'agenda' or a Strategy instance" % (fallback,))
        self.fallback = fallback or ByDepth()
        self.capacity = at_least('CachedPlan', 'capacity', capacity, 1,
                                 'a number of structures')
        self.max_calls = at_least('CachedPlan', 'max_calls', max_calls, 1, 'a number of calls')
        self.calls = 0          # over every stored plan
        self.compile_after = at_least('CachedPlan', 'compile_after', compile_after, 0,
                                      "a number of hits (float('inf'): never)")
        self.max_compiled = at_least('CachedPlan', 'max_compiled', max_compiled, 0,
                                     'a number of programs')
        self.cache = {}
        self.compiled = OrderedDict()      # key -> entry holding a program, in use order
        self._gone = []     # keys of entries a signature of which was freed (see store)
        self.hits = self.misses = 0
        self.last_compile_s = 0.0

    def lookup(self, nodes, summary=None):
        """``(key, cached entry or None)``; the key is the summary's
        ``structure`` when the scope's tape wrote it."""
        key = summary and summary.get('structure')
        if key is None:
            key = structure_key(nodes)
        return key, self.cache.get(key)

    def plan(self, nodes, summary=None, key=None):
        with PLANNING:
            return self._plan(nodes, summary, key)

    def _plan(self, nodes, summary, key):
        self.last_compile_s = 0.0
        if self._gone:
            self._drop_gone()
        if key is None:
            key, entry = self.lookup(nodes, summary)
        else:
            entry = self.cache.get(key)
        if entry is None:
            self.misses += 1
            plan = self.fallback.plan(nodes)
            check_plan(plan, nodes, self.fallback)
            self.store(key, plan)
            # runs as the fallback's plan would, recipes unlearned: learning
            # them fixes the row layout (no shared host part, no distinct
            # rows), which at SICK minibatch 256 made a miss 14% slower than
            # depth in one process, and most structures never come back
            return Plan(self.name + '-miss:' + plan.strategy, plan.steps)
        self.hits += 1
        entry.hits += 1
        if entry.dropped and self.hits - entry.last_hit <= self.max_compiled:
            entry.dropped = False           # in use again (see the class)
        entry.last_hit = self.hits
        # (alive: the key names this flush's signatures, which its nodes hold)
        steps = tuple(BatchStep(sig(), rows(nodes), ragged) for sig, rows, ragged in entry.steps)
        if autograd.is_recording():
            # never compiled for training: one program's backward writes a
            # (zero) gradient to every parameter it reads, and a Trainer then
            # steps the parameters of calls whose values never reached the
            # loss (momentum, weight decay), where per-sample execution and
            # step by step ones leave them alone; replaying the recipes
            # (no analysis) trained as fast at SICK minibatch 25
            return Plan(self.name, steps, entry.recipes)
        if entry.program is None and entry.hits >= self.compile_after and \
                not entry.uncompilable and not entry.dropped and None not in entry.recipes \
                and self.max_compiled:      # (0: a program would be dropped at once)
            self._compile(key, entry, steps)
        if entry.program is not None:
            self.compiled.move_to_end(key)
            return Plan(self.name + '-compiled', steps, entry.recipes, entry.program)
        return Plan(self.name, steps, entry.recipes)

    def _compile(self, key, entry, steps):
        # lower and execute import mxnet; plans stay plain data
        from .execute import flush_hoists
        from .lower import flush_program
        start = time.perf_counter()
        entry.program = flush_program(steps, entry.recipes, flush_hoists(steps))
        self.last_compile_s = time.perf_counter() - start
        if entry.program is None:
            entry.uncompilable = True
            return
        self.compiled[key] = entry
        if len(self.compiled) > self.max_compiled:
            _, oldest = self.compiled.popitem(last=False)
            oldest.program = None
            oldest.dropped = True

    def store(self, key, plan):
        """Remember ``plan`` under structure ``key``, its recipes (None per
        step) to be learned by its first hit."""
        calls = sum(len(step.nodes) for step in plan.steps)
        if self._gone:
            self._drop_gone()
        if key in self.cache:                  # replacing a stale plan
            self._drop(key)
        while self.cache and (len(self.cache) >= self.capacity or
                              self.calls + calls > self.max_calls):
            self._drop(next(iter(self.cache)))
        # signatures by weak reference: a plan must not keep the blocks it
        # ran (and their parameters) alive after the user dropped them; a
        # freed one notes the key (and nothing else: the callback may run
        # in any thread, at any allocation) for _drop_gone.  Keys are never
        # reused (signature ids only grow), so such a plan cannot be met again
        gone = self._gone

        def freed(_, key=key):
            gone.append(key)
        self.cache[key] = _Entry([(weakref.ref(step.sig, freed),
                                   _picker([n.pos for n in step.nodes]), step.ragged)
                                  for step in plan.steps],
                                 [None] * len(plan.steps), calls)
        self.calls += calls

    def _drop(self, key):
        self.calls -= self.cache.pop(key).calls
        self.compiled.pop(key, None)

    def _drop_gone(self):
        """Drop the plans whose blocks were freed: their compiled programs
        hold memory (static buffers, constants on the device) and would
        otherwise wait to be pushed out by newer plans (a review measured
        8-24 MB a dropped Tree-LSTM of hidden size 512)."""
        while self._gone:
            key = self._gone.pop()
            entry = self.cache.get(key)
            if entry is not None and any(sig() is None for sig, _, _ in entry.steps):
                self._drop(key)


def _picker(positions):
    """``f(nodes) -> tuple of nodes[i] for i in positions``, as one C call
    (``itemgetter``): on a cache hit this is all the planning left."""
    if len(positions) == 1:
        only = positions[0]
        return lambda nodes: (nodes[only],)
    return itemgetter(*positions)


class _Entry:
    """A cached plan: steps as (weak reference to the signature, picker of
    its nodes, ragged), recipes, how often it was reused and when last (the
    strategy's hit count then), its compiled program once there is one,
    whether that program was dropped (see :class:`CachedPlan`), and its
    number of calls."""
    __slots__ = ('steps', 'recipes', 'hits', 'last_hit', 'program', 'uncompilable', 'dropped',
                 'calls')

    def __init__(self, steps, recipes, calls):
        self.steps, self.recipes, self.calls = steps, recipes, calls
        self.hits = self.last_hit = 0
        self.program = None
        self.uncompilable = False
        self.dropped = False


STRATEGIES = {strategy.name: strategy for strategy in (PerSample(), ByDepth(), Agenda(),
                                                        CachedPlan())}
"""Shared strategy instances by name (``batching(name)``); the cached-plan
strategy keeps its cache across scopes."""
