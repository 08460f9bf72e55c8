"""Cost-aware choice of strategy: spend analysis time only where it pays.

Analysing a recorded graph costs time that grows with the graph; what it buys
(fewer, larger batched calls) saturates.  :class:`CostModel` predicts, for a
flush, each strategy's analysis time and the run time of the plan it would
make, from a few constants measured on this machine:

* ``step_us`` - fixed cost of one batched step (a CachedOp call, index
  uploads), and ``family_step_us`` the same per signature family, learned;
* ``row_us`` - cost per input element inside a step (learned per element,
  calls x input leaves; :meth:`~gluon_dynbatch.CostModel.predict` charges
  it once per call, alike for every strategy, so it moves the predicted
  times but not the choice);
* ``analyse_us[name]`` - analysis cost per node of each strategy (for the
  cached plan: hashing the structure).

The steps each strategy makes are known before analysing: recording already
counts the calls per (depth, signature family) and which of them later calls
read, which is exactly what depth grouping produces (see
:func:`~.plan.merge_sinks`); per-sample makes one step per call; agenda makes
at most as many as depth (the observed ratio is learned per kind of graph); a
cached plan has the count of the plan it reuses.

:class:`Auto` (the strategy behind ``batching('auto')``) asks the model,
runs the cheapest, and feeds what it measured back into the model, so the
constants follow the machine and the workload.
"""
import json
import numbers
import time
from collections import deque
from types import MappingProxyType

import mxnet as mx

from .execute import run_plan
from .lower import programs_built
from .plan import (PADDING_COST, PLANNING, SETUP, STRATEGIES, Agenda, ByDepth, CachedPlan,
                   PerSample, Strategy, at_least, count_at_least, summarize)

__all__ = ['CostModel', 'Auto', 'default_cost_model', 'ANALYSE_US', 'PROFILE_KEYS']


ANALYSE_US = {'per-sample': 0.3, 'depth': 1.0, 'agenda': 5.0, 'cached': 2.0}
"""A :class:`CostModel`'s per-node analysis costs (us) until it learns or
is given its own."""


def _non_negative(name, value, where='CostModel'):
    """``value`` as a float when it is a finite real number >= 0, or a
    ValueError naming ``where`` and ``name``.  A bool (``true`` in a saved
    profile) or a string is not a number here: ``float()`` took them as 1
    or as the number they spell."""
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        number = float(value)
    else:
        number = float('nan')
    if not number >= 0 or number == float('inf'):
        raise ValueError('%s: %s must be a finite number >= 0, got %r' % (where, name, value))
    return number


PROFILE_KEYS = ('step_us', 'row_us', 'analyse_us', 'agenda_ratio')
"""The keys of a saved profile (:meth:`CostModel.save`), all optional in
one written by hand."""

FITTED_FAMILIES = set()
"""Signature families whose step cost a line has been fitted for
(:meth:`CostModel.observe_steps`), shared as ``family_step_us`` is: from
then on only fitted lines move it."""


class CostModel:
    """Predicts analysis and run time (ms) of each strategy for a flush.

    Each constant is a finite real number >= 0 (numpy's too; not a bool
    or a string), or a ValueError names it, here and in a profile
    :meth:`load` reads.

    Parameters
    ----------
    step_us, row_us : float
        Fixed cost per batched step and cost per input element inside a
        step (charged once per call), microseconds.
    analyse_us : dict
        Per-node analysis cost of some strategies, microseconds (the others
        keep :data:`ANALYSE_US`).
    agenda_ratio : float
        Agenda's steps over depth's, before it is learned per kind of graph.
    """

    def __init__(self, step_us=300.0, row_us=15.0, analyse_us=None, agenda_ratio=1.0):
        self.step_us = _non_negative('step_us', step_us)
        self.row_us = _non_negative('row_us', row_us)
        if analyse_us is not None and not isinstance(analyse_us, dict):
            raise ValueError('CostModel: analyse_us must map strategy names to microseconds, '
                             'got %r' % (analyse_us,))
        analyse_us = dict(analyse_us or {})
        unknown = set(analyse_us) - set(ANALYSE_US)
        if unknown:
            raise ValueError('CostModel: analyse_us names no strategy %s; it takes %s'
                             % (sorted(unknown), sorted(ANALYSE_US)))
        self.analyse_us = dict(ANALYSE_US)
        self.analyse_us.update({name: _non_negative('analyse_us[%r]' % name, value)
                                for name, value in analyse_us.items()})
        self.agenda_ratio = _non_negative('agenda_ratio', agenda_ratio)
        # fixed cost of one step per signature family: a Tree-LSTM step runs
        # dozens of ops, a Dense step one.  Shared with the planner, which
        # asks it when splitting padded groups (so shared by all models too).
        self.family_step_us = PADDING_COST['family_step_us']
        self.calibrated = False

    # --- prediction --------------------------------------------------------
    def predict(self, n_nodes, n_steps_by_depth, cached_steps=None, groups=None,
                agenda_ratio=None):
        """``{strategy: (analyse_ms, run_ms)}`` for a flush of ``n_nodes``
        calls that depth grouping would run in ``n_steps_by_depth`` steps;
        ``cached_steps`` is the step count of a reusable cached plan.

        With ``groups`` (calls per (depth, family), as recording counts them)
        each step is charged its family's learned step cost, so a workload of
        cheap blocks is not priced with the costs of expensive ones;
        ``agenda_ratio`` (agenda's steps over depth's on this kind of graph)
        overrides the model's.

        ``n_nodes``, ``n_steps_by_depth`` and ``cached_steps`` are counts
        (integers >= 0, numpy's too), ``groups`` a dict and ``agenda_ratio``
        a finite number >= 0 (either may be None); anything else, or a
        ``groups`` entry not ``(depth, family): count``, is a ValueError
        naming it (a string was a raw TypeError).  The checks cost O(1):
        :class:`Auto` asks every flush it decides."""
        if type(n_nodes) is not int or type(n_steps_by_depth) is not int or n_nodes < 0 \
                or n_steps_by_depth < 0 or not (cached_steps is None or type(cached_steps) is int
                                                and cached_steps >= 0) \
                or not (groups is None or type(groups) is dict) \
                or not (agenda_ratio is None or type(agenda_ratio) is float
                        and 0 <= agenda_ratio < float('inf')):
            n_nodes, n_steps_by_depth, cached_steps, groups, agenda_ratio = _predict_args(
                n_nodes, n_steps_by_depth, cached_steps, groups, agenda_ratio)
        rows_ms = n_nodes * self.row_us / 1e3
        step_us = self.step_us
        if groups:
            family_cost = self.family_step_us.get
            depth_us = sample_us = 0.0
            grouped = 0
            try:
                for (_, family), count in groups.items():   # (one pass: auto asks every flush)
                    cost = family_cost(family, step_us)
                    depth_us += cost
                    sample_us += count * cost
                    grouped += count
            except (TypeError, ValueError):
                raise ValueError('CostModel.predict: groups holds %s; give calls per (depth, '
                                 'family), {(depth, family): count}'
                                 % _bad_group(groups)) from None
            depth_us += (n_steps_by_depth - len(groups)) * step_us
            sample_us += (n_nodes - grouped) * step_us
        else:
            depth_us = n_steps_by_depth * step_us
            sample_us = n_nodes * step_us
        per_step = depth_us / max(1, n_steps_by_depth)
        steps_us = {'per-sample': sample_us, 'depth': depth_us,
                    'agenda': max(per_step, depth_us * (agenda_ratio or self.agenda_ratio))}
        if cached_steps is not None:
            steps_us['cached'] = cached_steps * per_step
        return {name: (n_nodes * self.analyse_us[name] / 1e3, cost / 1e3 + rows_ms)
                for name, cost in steps_us.items()}

    # --- learning ----------------------------------------------------------
    def observe_analysis(self, name, seconds, n_nodes, alpha=0.2, min_nodes=200, setup=None):
        """Move ``analyse_us[name]`` toward a measured analysis.  Flushes of
        fewer than ``min_nodes`` calls are ignored: there fixed costs, not
        per-node work, dominate the time; so are analyses that did one-time
        work (``setup``: the value of :data:`~.plan.SETUP` when the analysis
        began, if it has changed since).  ``name`` must be one of
        :attr:`analyse_us`'s strategies and ``seconds`` a finite time >= 0
        (a ValueError otherwise): one negative time would drive the cost
        negative, and the model would rank that strategy's analysis free."""
        if name not in self.analyse_us:
            raise ValueError('CostModel.observe_analysis: no strategy %r; it learns the analysis '
                             'of %s' % (name, ', '.join(sorted(self.analyse_us))))
        # a negative, infinite or NaN time would carry into analyse_us for
        # good (an average moves toward it), and into a saved profile that
        # load() then refuses
        seconds = _non_negative('seconds', seconds, 'CostModel.observe_analysis')
        if not 0.0 <= alpha <= 1.0:
            raise ValueError('CostModel.observe_analysis: alpha=%r; give a weight in [0, 1]'
                             % (alpha,))
        if n_nodes >= min_nodes and n_nodes > 0 and (setup is None or setup == SETUP[0]):
            per_node = seconds * 1e6 / n_nodes
            self.analyse_us[name] += alpha * (per_node - self.analyse_us[name])

    def observe_steps(self, plan, step_seconds, alpha=0.2, built=False):
        """Refine ``step_us``/``row_us`` from a flush's measured steps.

        Steps of different blocks cost very different amounts, so a line
        ``time = step + per_element * elements`` is fitted per signature
        family (elements = calls x input leaves, which counts padded list
        elements; a ragged step counts its real elements only), giving that
        family's step cost; the medians over families refine the global
        constants, and the per-element slope is what a padded list element
        costs.  A single line through all steps would fold the blocks'
        differences into the intercept.

        A family whose steps in a flush all had as many elements (one step:
        a flush of one heavy step, or a greedy loop that reads after every
        call) has no line to fit.  Until one is fitted for it, its step
        cost is what remains of its steps' time after the cost of their
        calls (``row_us`` each): priced at the default step cost instead, a capsule
        network's routing step was predicted at 0.3 ms a flush and ran 4.5
        ms, in every flush (a user trial).  Never below the default step
        cost, though: an estimate that rests on ``row_us`` alone can come
        out near zero (eight chains of a ``Dense`` under an uncalibrated
        model), and a step priced at nothing makes running per sample look
        as cheap as batching (``auto`` chose it, 6x slower).  Not from a
        flush that built a step program (``built`` True): its one step's
        time is mostly the building."""
        by_family = {}
        for step, seconds in zip(plan.steps, step_seconds):
            elements = sum(len(node.sig.data_names) for node in step.nodes) if step.ragged \
                else len(step.nodes) * max(1, len(step.sig.data_names))
            by_family.setdefault(step.sig.group_key, []).append(
                (elements, seconds * 1e6, len(step.nodes)))
        fits = {}
        for family, points in by_family.items():
            if len({n for n, _, _ in points}) >= 2:
                fit = _fit_line([n for n, _, _ in points], [us for _, us, _ in points])
                if fit is not None:
                    fits[family] = fit
        for family, (step_us, row_us) in fits.items():
            old = self.family_step_us.get(family, step_us)
            self.family_step_us[family] = old + alpha * (step_us - old)
        FITTED_FAMILIES.update(fits)
        for family, points in by_family.items() if not built else ():
            if family in FITTED_FAMILIES:
                continue
            # (less row_us a call, as predict() charges it)
            step_us = max(self.step_us, _median([us - self.row_us * calls
                                                 for _, us, calls in points]))
            old = self.family_step_us.get(family)
            if old is not None:
                self.family_step_us[family] = old + alpha * (step_us - old)
            elif step_us > self.step_us:
                self.family_step_us[family] = step_us
        if fits:
            ordered = sorted(fits.values())
            step_us = ordered[len(ordered) // 2][0]
            row_us = sorted(f[1] for f in ordered)[len(ordered) // 2]
            self.step_us += alpha * (step_us - self.step_us)
            self.row_us += alpha * (row_us - self.row_us)
            PADDING_COST['step_us'] = self.step_us
            PADDING_COST['elem_us'] = max(0.05, self.row_us)

    def calibrate(self, rows=(1, 64), repeats=5):
        """Measure the constants with a short probe (~0.1-0.5 s): batched
        steps of a small Dense block at two sizes, and each strategy's
        analysis of a 400-node graph.

        ``rows`` are the two batch sizes (different integers >= 1: the
        line through their step times gives ``step_us``, its intercept,
        and ``row_us``, its slope) and ``repeats`` how many times each
        runs (an integer >= 1; the median counts).  Anything else is a
        ValueError before the probe runs."""
        rows, repeats = _calibration_args(rows, repeats)
        from .block import DynBatchBlock, private_scope
        block = DynBatchBlock(mx.gluon.nn.Dense(32, in_units=32, prefix='dynbatch_probe_'))
        # constant weights: a random initializer would draw from MXNet's
        # global generator, and the first 'auto' scope would move the
        # user's seeded stream (other Dropout masks, other initial weights)
        block.initialize(mx.init.Constant(0.01))
        x = mx.nd.ones((1, 32))
        times = {}
        for n in rows:
            samples = []
            for _ in range(repeats):
                with private_scope('depth') as scope:
                    for _ in range(n):
                        block(x)
                    nodes, _ = scope.take()
                    plan = ByDepth().plan(nodes)
                    start = time.perf_counter()
                    run_plan(plan)
                    mx.nd.waitall()
                    samples.append(time.perf_counter() - start)
            times[n] = sorted(samples)[len(samples) // 2] * 1e6
        self.row_us = max(0.1, (times[rows[1]] - times[rows[0]]) / (rows[1] - rows[0]))
        self.step_us = max(1.0, times[rows[0]] - self.row_us * rows[0])
        PADDING_COST['step_us'] = self.step_us
        with private_scope('per-sample') as scope:
            chains = [block(x) for _ in range(20)]
            for _ in range(19):
                chains = [block(c) for c in chains]
            nodes, summary = scope.take()
            for name, strategy in (('per-sample', PerSample()), ('depth', ByDepth()),
                                   ('agenda', Agenda()), ('cached', CachedPlan())):
                start = time.perf_counter()
                strategy.plan(nodes, summary)
                self.analyse_us[name] = (time.perf_counter() - start) * 1e6 / len(nodes)
        self.calibrated = True
        return self

    # --- persistence -------------------------------------------------------
    def to_dict(self):
        return {'step_us': self.step_us, 'row_us': self.row_us,
                'analyse_us': dict(self.analyse_us), 'agenda_ratio': self.agenda_ratio}

    def save(self, path):
        """Write the constants as JSON (a saved machine profile).  They are
        checked as :meth:`load` checks them first, so that every profile
        written loads again: a constant it would refuse (one set by hand
        to a negative number, say) is a ValueError naming it, and the file
        is left as it was."""
        try:
            checked = CostModel(**self.to_dict())
        except ValueError as err:
            raise ValueError('CostModel.save(%r): not written, load() would refuse it: %s'
                             % (path, err)) from None
        text = json.dumps(checked.to_dict(), indent=1, allow_nan=False)
        with open(path, 'w') as f:
            f.write(text)

    @classmethod
    def load(cls, path):
        """A model from a profile written by :meth:`save` (no probe runs);
        a ValueError naming the file when it is not one.  A profile written
        by hand may hold some of the constants: the others keep their
        defaults (one holding none, ``{}``, is refused: it would skip the
        probe and run on the defaults alone).  A key other than
        :data:`PROFILE_KEYS` is refused by name, not ignored: it is a
        misspelt constant, which would otherwise keep its default
        unnoticed, or one from another version of this library, whose
        constants may not mean what this version's do."""
        with open(path) as f:
            try:
                saved = json.load(f)
            except ValueError as err:
                raise ValueError('CostModel.load(%r): not a saved profile (JSON): %s'
                                 % (path, err)) from None
        if not isinstance(saved, dict) or not saved:
            raise ValueError('CostModel.load(%r): a saved profile holds an object with some of '
                             'the keys %s; got %s' % (path, ', '.join(PROFILE_KEYS),
                                                      _json_kind(saved)))
        unknown = [key for key in saved if key not in PROFILE_KEYS]
        if unknown:
            raise ValueError('CostModel.load(%r): unexpected key%s %s; a saved profile holds '
                             'some of the keys %s (a key misspelt, or a profile from another '
                             'version: remove %s, or calibrate anew and save)'
                             % (path, 's' if len(unknown) > 1 else '',
                                ', '.join(repr(key) for key in unknown), ', '.join(PROFILE_KEYS),
                                'them' if len(unknown) > 1 else 'it'))
        try:
            model = cls(**saved)
        except ValueError as err:
            raise ValueError('CostModel.load(%r): %s' % (path, err)) from None
        model.calibrated = True
        return model

    def __repr__(self):
        analyse = ', '.join('%s %.2f' % kv for kv in sorted(self.analyse_us.items()))
        return 'CostModel(step %.1f us, row %.2f us; analyse/node: %s)' % (
            self.step_us, self.row_us, analyse)


def _predict_args(n_nodes, n_steps_by_depth, cached_steps, groups, agenda_ratio):
    """:meth:`CostModel.predict`'s arguments checked (counts as ints,
    ``agenda_ratio`` as a float), or a ValueError naming the wrong one."""
    where = 'CostModel.predict'
    n_nodes = count_at_least(where, 'n_nodes', n_nodes, 0, 'a whole number of calls')
    n_steps_by_depth = count_at_least(where, 'n_steps_by_depth', n_steps_by_depth, 0,
                                      'a whole number of steps')
    if cached_steps is not None:
        cached_steps = count_at_least(where, 'cached_steps', cached_steps, 0,
                                      'a whole number of steps')
    if groups is not None and not isinstance(groups, dict):
        raise ValueError('%s: groups=%s; give a dict of calls per (depth, family), or None'
                         % (where, _short(groups)))
    if agenda_ratio is not None:
        agenda_ratio = _non_negative('agenda_ratio', agenda_ratio, where)
    return n_nodes, n_steps_by_depth, cached_steps, groups, agenda_ratio


def _bad_group(groups):
    """The first entry of ``groups`` that is not ``(depth, family): count``
    (for :meth:`CostModel.predict`'s message)."""
    for key, count in groups.items():
        if not isinstance(key, tuple) or len(key) != 2 or \
                not isinstance(count, numbers.Real) or isinstance(count, bool):
            return '%s: %s' % (_short(key), _short(count))
    return 'an entry it cannot read'


def _short(value, limit=60):
    """``repr(value)``, cut to ``limit`` characters."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + '...'


def _json_kind(value):
    """What JSON value ``value`` was (for a message: a whole file's content
    could be long)."""
    if value == {}:
        return 'an empty object'
    if value is None:
        return 'null'
    kind = {list: 'an array', str: 'a string', bool: 'a boolean'}.get(type(value), 'a number')
    return '%s (%s)' % (kind, repr(value)[:40] + ('...' if len(repr(value)) > 40 else ''))


def _calibration_args(rows, repeats):
    """``calibrate``'s ``rows`` as a pair of ints and ``repeats`` as an
    int, or a ValueError saying what to give (two equal sizes divided by
    zero, one size or no repeat failed with an IndexError)."""
    def count(value, least):
        return isinstance(value, numbers.Integral) and not isinstance(value, bool) and \
            value >= least
    try:
        pair = tuple(rows)
    except TypeError:
        pair = ()
    if len(pair) != 2 or not all(count(n, 1) for n in pair) or pair[0] == pair[1]:
        raise ValueError('CostModel.calibrate: rows=%r; give two different batch sizes >= 1 '
                         '(the line through their step times gives step_us and row_us), '
                         'e.g. (1, 64)' % (rows,))
    if not count(repeats, 1):
        raise ValueError('CostModel.calibrate: repeats=%r; give a number of runs of each '
                         'size >= 1 (their median counts)' % (repeats,))
    return (int(pair[0]), int(pair[1])), int(repeats)


def _fit_line(xs, ys):
    """Least-squares ``y = a + b x`` with a, b >= 0; None if degenerate."""
    n = len(xs)
    mean_x, mean_y = sum(xs) / n, sum(ys) / n
    var = sum((x - mean_x) ** 2 for x in xs)
    if var == 0:
        return None
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / var
    slope = max(slope, 0.0)
    return max(mean_y - slope * mean_x, 1.0), slope


_DEFAULT = None


def default_cost_model():
    """The process-wide model, calibrated on first use."""
    global _DEFAULT
    if _DEFAULT is None:
        _DEFAULT = CostModel().calibrate()
    return _DEFAULT


SAME_STEPS = 0.99
"""An agenda/depth step ratio at least this high: agenda makes depth's steps."""


_UNDECIDED = MappingProxyType({'choice': 'depth'})
""":attr:`Auto.last` of a flush planned without deciding (fewer than
``small`` calls); read-only."""

_REPLAYED = MappingProxyType({'choice': 'cached'})
""":attr:`Auto.last` of a small flush that replays a stored plan
(:meth:`Auto._replayed`); read-only."""

REPLAY_STEPS = 3
"""Small flushes of at least this many steps by depth replay a stored plan
when their structure comes back (:meth:`Auto._replayed`)."""


RUN_WINDOW = 5
"""Measured / predicted run ratios whose median is a strategy's run factor
on a kind and size of graph (:meth:`Auto._observe_run`); their count is
also how many measured runs it has there, so it is at least
:data:`LEARN_RUNS`."""


PACE_WINDOW = 15
"""Flushes of a kind and size of graph whose median recording time per
call is the machine's usual pace there (:meth:`Auto._pace`)."""

PACE_LEARNED = 5
"""Flushes of a kind and size of graph recorded before their pace counts."""


LEARN_RUNS = 3
"""Measured runs of a choice on a kind and size of graph before
:meth:`Auto.wants_step_times` stops timing each of its flushes."""

LEARN_GAP = 3
"""Flushes (all of an :class:`Auto`'s, of any kind and size, as for
``probe_every``) between runs of a runner-up among depth/agenda that has
fewer than :data:`LEARN_RUNS` measured runs on a kind and size of graph
(:meth:`Auto._explore`; ``probe_every`` once it has them)."""


class Auto(Strategy):
    """Pick, per flush, the strategy with the lowest predicted analysis + run
    time, and learn from what the flush then measured.

    * Every strategy's analysis is timed by itself (not with this class's own
      bookkeeping).  The first flush of each kind of graph (its set of block
      families), and every ``probe_every``-th flush after (less often where
      agenda saves nothing, see ``_probe``), also plans with the strategy
      not chosen among depth/agenda, without running it, so both per-node
      costs and agenda's step saving (per kind of graph) stay measured.
      Flushes that run a cached plan are not probed: their structure was
      seen before.
    * Each strategy's predicted run time is scaled by a factor learned per
      kind of graph from its measured runs, each divided by the machine's
      pace at the time (:meth:`_pace`) (:meth:`_corrected`; depth and
      agenda share theirs where agenda makes depth's steps, and depth then
      runs: it does as well for less); a runner-up
      among depth/agenda predicted within ``explore_within`` (10%) runs
      now and then, and one not yet measured :data:`LEARN_RUNS` times runs
      every :data:`LEARN_GAP` flushes (:meth:`_explore`), so a near-tie
      the model gets wrong, or a slow first run, is found out.
    * Flushes of fewer than ``small`` nodes (calls after merged repeats) are
      planned by depth without deciding: the decision itself would cost
      more than it could save.  So are chains of one block (every call a
      step of its own), planned per sample: no strategy can batch them.
      A small flush of :data:`REPLAY_STEPS` or more steps whose structure
      comes back replays a stored plan (:meth:`_replayed`).
    * A cached plan is considered only for a graph whose summary (calls per
      depth and family) matches one whose plan was stored: plans are stored
      for summaries seen twice, so graphs that never repeat pay nothing for
      the cache.  A cached plan runs faster than its prediction says (its
      gathers come from recipes), so for a repeating summary the measured
      totals decide: the cached plan runs its first ``cached_trials`` times
      (it speeds up as it is reused: recipes, then a compiled flush; a
      threaded engine waits for the steps of the last of these only, since
      a waited flush loses the overlap of Python and the engine), the
      best other strategy then runs once to be timed, and the cached plan
      is kept while its best measured total (hashing included; over runs
      of its current kind, compiled or replayed) is within 5% of the best
      measured other, and tried again every ``probe_every``-th time the
      summary comes back.
      Otherwise the prediction decides, and the structure is hashed only when
      the cached plan's prediction wins.

    Its counts, ``probe_every``, ``memory``, ``small`` and ``cached_trials``,
    are integers (numpy's too; not a bool, a float or infinity) in the
    ranges below, and ``explore_within`` a real number >= 0; anything else
    is a ValueError naming the argument when the strategy is made.

    Parameters
    ----------
    model : CostModel, optional
        The cost model; by default the process's shared one
        (:func:`default_cost_model`), calibrated by a short probe when the
        first scope opens.  A model given here is used as it is: calibrate
        it (:meth:`CostModel.calibrate`) or load a saved profile
        (:meth:`CostModel.load`).
    probe_every : int
        Flushes between probes of the strategy not chosen (>= 1).
    memory : int
        How many flush summaries it remembers for the plan cache (when
        full, it forgets the older half of those seen only once), how many
        structures of small flushes (seen once, and stored), and for how
        many kinds of graph (sets of blocks) it keeps what it learned
        (>= 1).
    small, cached_trials : int
        As described above (>= 0).
    explore_within : float
        As described above, a fraction of the best prediction (>= 0; 0:
        never run a predicted runner-up).
    """
    name = 'auto'

    def __init__(self, model=None, probe_every=16, memory=4096, small=32, cached_trials=4,
                 explore_within=0.1):
        if model is not None and not isinstance(model, CostModel):
            raise ValueError('Auto: model=%r; give a CostModel (or None: the process\'s '
                             'default one)' % (model,))
        probe_every = count_at_least('Auto', 'probe_every', probe_every, 1,
                                     'a whole number of flushes')
        memory = count_at_least('Auto', 'memory', memory, 1,
                                'a whole number of summaries and kinds of graph')
        small = count_at_least('Auto', 'small', small, 0, 'a whole number of calls')
        cached_trials = count_at_least('Auto', 'cached_trials', cached_trials, 0,
                                       'a whole number of runs')
        explore_within = at_least('Auto', 'explore_within', explore_within, 0,
                                  "a fraction of the best prediction")
        self._model = model
        self.explore_within = explore_within    # 0: never run a predicted runner-up
        self.cached_trials = cached_trials
        self.small = small
        self.cached = STRATEGIES['cached']
        # small flushes' plans, replayed and never compiled (see _replayed)
        self.replay = CachedPlan(capacity=memory, compile_after=float('inf'))
        self._small_seen = {}   # structure key of a small flush seen once -> None
        self.probe_every = probe_every
        self.memory = memory
        self.choices = {}
        self.last = {}
        self._seen = {}      # summary fingerprint -> steps of its stored plan (None: seen once)
        self._ratios = {}    # set of families -> agenda steps / depth steps
        self._same_sizes = {}   # set of families -> were depth's and agenda's steps alike
                                # (_alike) at the last probe?
        self._run_factors = {}  # (set of families, size) -> {strategy: measured / predicted}
        self._run_ratios = {}   # ((set of families, size), strategy) -> its last ratios
        self._last_run = {}     # ((set of families, size), strategy) -> flush it last ran
        self._repeating = {}    # fingerprint -> _Repeating, for summaries with a stored plan
        self._record_paces = {}  # (set of families, size) -> recent recording seconds per call
        self._next_probe = {}   # kind of graph -> flush number of its next probe
        self._probe_gap = {}    # kind of graph -> flushes between its probes
        self._kinds = {}        # kinds of graph above, least recently planned first
        self._flushes = 0
        self._asked = 0         # flushes that asked wants_step_times

    @property
    def model(self):
        """The :class:`CostModel` in use (the process's default one,
        calibrated now, when none was given)."""
        if self._model is None:
            self._model = default_cost_model()
        return self._model

    def prepare(self):
        self.model  # calibrate now, outside any timed flush

    @property
    def last(self):
        """What this thread's last :meth:`plan` chose and predicted (for
        :meth:`observe` and ``stats()``)."""
        return getattr(self._thread_state(), 'last', {})

    @last.setter
    def last(self, value):
        self._thread_state().last = value

    def plan(self, nodes, summary=None):
        with PLANNING:
            return self._plan(nodes, summary)

    def _plan(self, nodes, summary):
        state = self._thread_state()
        state.compile_s = 0.0
        if len(nodes) < self.small:
            return self._plan_small(nodes, summary, state)
        summary = summary or summarize(nodes)
        self._flushes += 1
        fingerprint = summary['fingerprint']
        groups = dict(fingerprint[0])
        kind = frozenset(family for _, family in groups)    # which blocks are in play
        self._note_kind(kind)
        if summary['depth_steps'] >= len(nodes) and len(kind) == 1 and not fingerprint[1]:
            # Every call is a step of its own, of one block, all batch-safe:
            # each call then reads the one before (a chain), so no strategy
            # can batch any of it.  Predicting, probing and exploring among
            # equal plans cost ~2 ms a flush of 1,000 chained calls (auto
            # 1.10x per-sample).  (With two blocks, chains out of phase make
            # one step per call by depth and half as many by agenda.)
            self.choices['per-sample'] = self.choices.get('per-sample', 0) + 1
            self.last = {'choice': 'per-sample', 'kind': kind}
            return STRATEGIES['per-sample'].plan(nodes)
        model = self.model
        raw = model.predict(len(nodes), summary['depth_steps'],
                            self._seen.get(fingerprint), groups, self._ratios.get(kind))
        # run factors are learned per kind of graph and size (calls, within a
        # factor of two): the linear model's error changes with the size, and
        # a factor learned on graphs of 5,000 calls kept depth priced 1.3x at
        # 80, so auto ran agenda there (same steps, more analysis) unopposed
        sized = (kind, len(nodes).bit_length())
        pace = self._pace(sized, summary.get('record_s'), summary.get('recorded') or len(nodes))
        predictions = self._corrected(raw, sized)
        ranked = self._ranked(predictions, sized)
        verdict = self._cached_measured_best(fingerprint) if 'cached' in predictions else False
        if verdict is not False:    # True: run it; None: time the best other
            ranked.remove('cached')
            ranked.insert(0 if verdict else len(ranked), 'cached')
        plan = self._cached_plan(nodes, summary, ranked) if ranked[0] == 'cached' else None
        name = ranked[0]
        if plan is None:
            setup, start = SETUP[0], time.perf_counter()
            plan = STRATEGIES[name].plan(nodes)
            model.observe_analysis(name, time.perf_counter() - start, len(nodes), setup=setup)
            plan = self._remember(summary, nodes, plan, name)
        if 'cached' not in predictions:
            # (a summary with a stored plan was seen before: a probe would
            # learn nothing new)
            self._probe(nodes, summary, name, plan, kind)
        self.choices[name] = self.choices.get(name, 0) + 1
        # a repeating summary's decision runs (see _cached_deciding)
        deciding = verdict is None or (name == 'cached' and verdict and
                                       self._cached_deciding(self._repeat(fingerprint)))
        self.last = {'choice': name, 'predicted_ms': sum(predictions[name]), 'deciding': deciding,
                     'raw_run_ms': raw[name][1], 'pace': pace, 'built': programs_built(),
                     'unpriced': kind - model.family_step_us.keys(),
                     'depth_steps': summary['depth_steps'], 'kind': kind, 'sized': sized,
                     'fingerprint': fingerprint,
                     'predictions_ms': {k: round(a + r, 3) for k, (a, r) in predictions.items()}}
        return plan

    def _plan_small(self, nodes, summary, state):
        """The plan of a flush of fewer than :attr:`small` calls: deciding
        costs more than any choice could save on a graph this small
        (depth's analysis is a few microseconds), so it is depth's, or a
        replay of a structure seen before (:meth:`_replayed`).  (One
        thread-state lookup here and one in observe, which then returns: a
        loop that reads a value after every call flushes ~35 us calls one
        by one, and auto's bookkeeping was 4 us of each.)"""
        plan = self._replayed(nodes, summary) if summary is not None and \
            summary['depth_steps'] >= REPLAY_STEPS else None
        if plan is not None and plan.strategy == 'cached':
            self.choices['cached'] = self.choices.get('cached', 0) + 1
            state.last = _REPLAYED
            return plan
        self.choices['depth'] = self.choices.get('depth', 0) + 1
        state.last = _UNDECIDED
        return plan or STRATEGIES['depth'].plan(nodes)

    def _ranked(self, predictions, sized):
        """The strategies of ``predictions``, cheapest predicted total
        first, depth ahead of agenda where they make the same plans here,
        and with an exploring run's choice moved ahead (:meth:`_explore`)."""
        ranked = sorted(predictions, key=lambda k: sum(predictions[k]))
        if 'agenda' in predictions and 'depth' in predictions and self._same_plans(sized) \
                and ranked.index('agenda') < ranked.index('depth'):
            # Where agenda makes depth's steps, depth's plan does as well for
            # less: its analysis is never slower per node, and reading the
            # results after it cost less (at SICK minibatch 4 agenda's took
            # 0.06-0.1 ms more of a 2.1 ms flush over three runs), which the
            # model does not price.  Their predictions then differ only by
            # the learned analysis costs, whose noise once had auto run
            # agenda in 64 of 64 flushes there (1.07-1.10x depth).
            first, second = ranked.index('agenda'), ranked.index('depth')
            ranked[first], ranked[second] = 'depth', 'agenda'
        if 'cached' not in predictions:
            # (a repeating summary is decided by measured totals, and the
            # run that times the best other strategy must be that one)
            self._explore(ranked, predictions, sized)
        return ranked

    def _cached_plan(self, nodes, summary, ranked):
        """The plan ``'cached'``, first in ``ranked``, runs: the stored
        one (compiled once it comes back), or None where another strategy
        runs instead, moved to the front of ``ranked``: depth, where the
        stored plan is due a check against a fresh one (:meth:`_refreshed`),
        or the next best, where the summary's structure is not the stored
        one's (its predictions are trusted from then on)."""
        fingerprint = summary['fingerprint']
        key, entry = self.cached.lookup(nodes, summary)
        if entry is None:
            self._repeat(fingerprint).best_ms['cached'] = float('inf')
            ranked.pop(0)
            return None
        plan = self._refreshed(fingerprint, key, entry, nodes)
        if plan is not None:
            ranked.remove('depth')
            ranked.insert(0, 'depth')
            return plan
        plan = self.cached.plan(nodes, key=key)
        self.last_compile_s = self.cached.last_compile_s
        return plan

    def _replayed(self, nodes, summary):
        """The plan of a small flush whose structure (the scope's tape
        wrote its key; None without the C recorder) was seen before, from
        :attr:`replay`, a :class:`~.plan.CachedPlan` that stores it on the
        second sighting (that flush runs depth's plan, and counts as depth),
        learns its recipes on the third and replays them after, planning
        anew by depth on every ``probe_every``-th replay (kept if it has
        fewer steps); None on a first sighting.  A replay finds each step's rows
        from its recipes, with no analysis: an LSTM cell over 20 tokens at
        minibatch 1 ran 0.89x depth's time, 8 leaves summed in a chain of
        7 calls 0.78x; one or two steps gain nothing (a single call ran
        1.05x).  Compiling the whole flush was no faster than replaying
        it, and its one-time cost (milliseconds) outweighed what the few
        runs of most small structures could save: SICK pairs one at a time
        ran 1.13x depth's time, compiled, over two passes of the test
        split; with replays auto ran them at depth's median speed."""
        key = summary.get('structure')
        if key is None:
            return None
        if key not in self._small_seen and key not in self.replay.cache:
            if len(self._small_seen) >= self.memory:
                self._small_seen.clear()        # forget, and count afresh
            self._small_seen[key] = None
            return None
        self._small_seen.pop(key, None)
        entry = self.replay.cache.get(key)
        if entry is not None and entry.hits and entry.hits % self.probe_every == 0:
            # as _refreshed: the stored plan was made with the costs of its
            # time (padded groups split or not), so now and then plan anew
            fresh = _fewer_steps(nodes, entry)
            if fresh is not None:
                self.replay.store(key, fresh)       # its recipes learned anew
                return fresh
        return self.replay.plan(nodes, summary, key)

    def wants_step_times(self, every):
        """Flushes whose measurement is still missing: depth, agenda or
        per-sample run on a kind and size of graph where that choice has
        fewer than :data:`LEARN_RUNS` measured runs, and the runs that decide
        a repeating summary (the rival's run, and the cached plan's runs
        that :meth:`_cached_deciding` names: its last trial, a retry while
        it loses, a run of a kind with no best time yet);
        after that, one flush of this strategy in ``every``.  A waited flush
        is expensive under a threaded engine: Python cannot prepare a step
        while the last one runs, nor, in a pipelined scope, record the next
        part (one flush in eight cost ``auto`` 15% at SICK minibatch 1024,
        one in 64 2%).  (With one counter for all flushes, a harness
        alternating a depth scope and an auto scope timed only the depth
        one: auto's run factors were never learned.)"""
        self._asked += 1
        last = self.last
        choice, sized = last.get('choice'), last.get('sized')
        if sized is not None and choice in ('depth', 'agenda', 'per-sample') \
                and self._measured_runs(sized, choice) < LEARN_RUNS:
            return True
        return bool(last.get('deciding')) or self._asked % every == 0

    def _corrected(self, predictions, sized):
        """``predictions`` with each strategy's run time scaled by what its
        runs on this kind and size of graph (``sized``) measured against
        their prediction (see :meth:`_observe_run`).  The step model is linear in steps and rows;
        it misses, e.g., that agenda's fewer, larger steps cost less per row
        (on ragged chains it called depth and agenda a tie that agenda won
        by 10%).  A strategy not yet run on this kind and size gets the mean
        factor of those that were, so that none is favoured for being
        measured."""
        factors = self._run_factors.get(sized)
        if not factors:
            return predictions
        factors = self._pooled(factors, sized)
        common = sum(factors.values()) / len(factors)
        return {name: (analyse, run * factors.get(name, common))
                for name, (analyse, run) in predictions.items()}

    def _pooled(self, factors, sized):
        """``factors`` with one factor for depth and agenda, the mean of
        theirs, where agenda makes depth's steps on this kind of graph (its
        learned step ratio at least :data:`SAME_STEPS`, and steps of about
        the same sizes at the last probe, :func:`_alike`): the two then run
        the same steps, and only their analysis differs.  Learned apart,
        the noise in the two factors chose between equal plans: at SICK
        minibatch 4 auto ran agenda's (five times depth's analysis per node)
        in 59 of 64 flushes, 1.08x the best fixed strategy.  Equal step
        counts alone are not enough: on a random DAG whose unread calls
        depth moves to its last step (52 rows gathered from six steps;
        agenda's steps are 32 rows each, read from one), agenda ran 20%
        faster in as many steps, and the pooled factor hid it (auto 1.25x
        agenda)."""
        same = [factors[name] for name in ('depth', 'agenda') if name in factors]
        if not same or not self._same_plans(sized):
            return factors
        pooled = sum(same) / len(same)
        return dict(factors, depth=pooled, agenda=pooled)

    def _same_plans(self, sized):
        """Whether agenda makes depth's steps on this kind of graph (see
        :meth:`_pooled`)."""
        kind = sized[0]
        ratio = self._ratios.get(kind)
        return ratio is not None and ratio >= SAME_STEPS and self._same_sizes.get(kind, True)

    def _explore(self, ranked, predictions, sized):
        """Run the runner-up among depth/agenda (moving it to the front of
        ``ranked``) when it has not run on this kind and size of graph for
        ``probe_every`` flushes (or ever) and is predicted within
        ``explore_within`` (10%) of the best, or for :data:`LEARN_GAP`
        flushes while it has fewer than :data:`LEARN_RUNS` measured runs
        here: otherwise a near-tie that the prediction gets wrong is never
        found out, and one slow first run (its factor clipped at 2) would
        lock a strategy out for good (one process had auto run depth in 192
        of 200 flushes of a layered DAG where agenda was 1.17x faster;
        near-tie exploring could not undo that).  A first run is often the
        slow one, and with ``probe_every`` flushes between the runs that
        measure a runner-up, a slow first run still locked it out for
        16 flushes at a time: in 31-flush rounds of a layered DAG
        and of ragged chains, three ``Auto`` instances side by side, auto
        ran the slower depth in 11 or more of the 31 flushes in 9 of 15
        rounds (1.13x agenda on average); with runs priced by the machine's
        pace (:meth:`_pace`), in 3 of 15 (1.09x); with both that and these
        runs 3 flushes apart, in 1 of 15 (1.06x).  At most one flush in
        ``probe_every`` runs a plan predicted up to 10% slower, and a few
        more a slower one while it is measured.  Where the two share a run
        factor (:meth:`_pooled`), their runs price both alike and only
        analysis tells them apart: nothing to find out."""
        factors = self._run_factors.get(sized)
        best = ranked[0]
        if not self.explore_within or not factors or best not in ('depth', 'agenda') \
                or self._same_plans(sized):
            return
        other = 'agenda' if best == 'depth' else 'depth'
        if other not in predictions:
            return
        measured = self._measured_runs(sized, other) >= LEARN_RUNS
        if measured and \
                sum(predictions[other]) > (1 + self.explore_within) * sum(predictions[best]):
            return
        last_run = self._last_run.get((sized, other))
        gap = self.probe_every if measured else LEARN_GAP
        if last_run is None or self._flushes - last_run >= gap:
            ranked.remove(other)
            ranked.insert(0, other)

    def _observe_run(self, name, run_ms):
        """Move the run factor of ``name`` on this kind and size of graph
        toward measured / predicted (``run_ms`` None: the flush was not
        timed): the median of its last :data:`RUN_WINDOW` ratios.  Flushes
        that built a step program are skipped (building one costs more than
        whole steps), and each ratio is clipped to [0.5, 2].  A median, so
        that one slow run cannot lock a strategy out: a moving average (0.3
        a run) moved by a third of an outlier's excess, enough to price the
        faster of two close plans above the other, which then ran until
        :meth:`_explore` tried the first again (one tradeoff.py run had
        auto run depth in 10 of 31 flushes on a layered DAG where agenda
        was 12% faster, 1.14x agenda)."""
        last = self.last
        sized = last['sized']
        self._last_run[(sized, name)] = self._flushes
        if run_ms is None or programs_built() != last['built'] or last['raw_run_ms'] <= 0:
            return
        unpriced = last.get('unpriced')
        if unpriced and not unpriced.isdisjoint(self.model.family_step_us):
            # this flush's steps priced a family for the first time: its
            # prediction used the default step cost (ragged chains' 30 us
            # steps priced as a Tree-LSTM's 300: 85 ms predicted, 8 ms run,
            # a factor of 0.1 clipped to 0.5), and the factor would scale
            # the informed predictions after it: depth's then priced its
            # runs at 5 ms where they took 8, a near-tie with agenda's 6 that
            # a run of tradeoff.py lost (auto ran depth in 29 of 31
            # flushes, 1.28x agenda)
            return
        ratio = min(2.0, max(0.5, run_ms / (last['raw_run_ms'] * last.get('pace', 1.0))))
        ratios = self._run_ratios.get((sized, name))
        if ratios is None:
            ratios = self._run_ratios[(sized, name)] = deque(maxlen=RUN_WINDOW)
        ratios.append(ratio)
        self._run_factors.setdefault(sized, {})[name] = _median(ratios)

    def _pace(self, sized, record_s, calls):
        """How slowly the machine runs this flush against its usual pace on
        this kind and size of graph: the flush's recording time per call
        recorded (``calls``, with those merged into a pending call as
        repeats, whose share changes with the data) over the median of the
        last :data:`PACE_WINDOW` flushes' (1 until
        there are :data:`PACE_LEARNED`; clipped to [0.5, 2]).  Recording
        runs the same code whichever plan follows, and a run's time per
        call tracked it (correlation 0.7 over 380 flushes of ragged chains
        and of a layered DAG on a VM whose speed drifts), so
        :meth:`_observe_run` divides each measured run by it: a slow spell
        then does not price up whichever strategy ran during it against
        one last measured before it (one ``tradeoff.py`` run had ``auto``
        switch to depth on ragged chains in 15 of 31 flushes, 1.19x
        agenda, after agenda's runs met such a spell)."""
        if not record_s:
            return 1.0
        per_call = record_s / calls
        recent = self._record_paces.get(sized)
        if recent is None:
            recent = self._record_paces[sized] = deque(maxlen=PACE_WINDOW)
        usual = _median(recent) if len(recent) >= PACE_LEARNED else None
        recent.append(per_call)
        return 1.0 if not usual else min(2.0, max(0.5, per_call / usual))

    def _note_kind(self, kind):
        """Mark ``kind`` as planned now, and forget what was learned about
        the least recently planned kind once more than ``memory`` kinds
        are known: block families are never reused, so a process that
        builds model after model (a sweep, a server) would otherwise keep
        every dropped model's entries."""
        kinds = self._kinds
        if kinds.pop(kind, 0) is None:     # known: to the end
            kinds[kind] = None
            return
        kinds[kind] = None
        if len(kinds) <= self.memory:
            return
        old = next(iter(kinds))
        del kinds[old]
        for table in (self._ratios, self._same_sizes, self._next_probe, self._probe_gap):
            table.pop(old, None)
        for table in (self._run_factors, self._record_paces):
            for key in [key for key in table if key[0] == old]:
                del table[key]
        for table in (self._run_ratios, self._last_run):
            for key in [key for key in table if key[0][0] == old]:
                del table[key]

    def _measured_runs(self, sized, name):
        """Measured runs of ``name`` on this kind and size of graph, up to
        :data:`RUN_WINDOW` (at least :data:`LEARN_RUNS`, all that is asked)."""
        return len(self._run_ratios.get((sized, name), ()))

    def _repeat(self, fingerprint):
        record = self._repeating.get(fingerprint)
        if record is None:
            record = self._repeating[fingerprint] = _Repeating()
        return record

    def _cached_measured_best(self, fingerprint):
        """True when the stored plan of this summary should run: while it
        has run fewer than ``cached_trials`` times (it gets faster as it is
        reused: its first run learns recipes, then they replay, then it is
        compiled, whose first call is slow), then while its best time is
        within 5% of the best other strategy's, and on every
        ``probe_every``-th sighting of the summary, to measure it again.
        None once, right after the trials: the best other strategy should
        run, plainly, to be timed (the only other time measured is the run
        that stored the plan, which may have built step programs or missed
        the timing of a threaded engine; when the storing run learned the
        recipes, it was slowed by that, and auto kept a compiled plan 9%
        slower than depth at SICK minibatch 256)."""
        record = self._repeat(fingerprint)
        record.sightings += 1
        if record.cached_runs < self.cached_trials:
            return True
        if not record.rival_timed:
            record.rival_timed = True
            return None
        # (not timed yet, it does not lose: a threaded engine times few flushes)
        return not _cached_loses(record) or record.sightings % self.probe_every == 0

    def _cached_deciding(self, record):
        """Whether this run of a repeating summary's cached plan decides,
        so that a threaded engine waits for its steps to time it: the last
        of its trials (those before learn its recipes and compile it, and
        run slower), a run whose kind has no best time (its program came or
        went), and a run on a probing sighting while it loses (untimed, it
        could never win back).  A run that wins anyway is not timed: its
        best time, a minimum, could only fall."""
        if record.cached_runs < self.cached_trials:
            return record.cached_runs == self.cached_trials - 1
        return 'cached' not in record.best_ms or _cached_loses(record)

    def _refreshed(self, fingerprint, key, entry, nodes):
        """On every ``probe_every``-th sighting of a repeating summary,
        plan it afresh by depth: a stored plan was made with the cost model
        of its time (e.g. padded groups split with step costs not yet
        learned).  If the fresh plan has fewer steps it replaces the stored
        one (whose measurements are forgotten) and is returned, to run now;
        otherwise None."""
        record = self._repeat(fingerprint)
        if record.sightings % self.probe_every:
            return None
        fresh = _fewer_steps(nodes, entry)
        if fresh is None:
            return None
        record.best_ms.pop('cached', None)
        record.cached_runs = 0
        self._seen[fingerprint] = len(fresh.steps)
        self.cached.store(key, fresh)
        return fresh

    def _remember(self, summary, nodes, plan, name):
        """Store ``plan`` in the cache when its summary is seen the second
        time; returns the plan to run, as planned: its recipes are learned
        when the cached plan first runs (learning them here slowed this run,
        which also times ``name`` for the repeating summary)."""
        if name == 'per-sample':
            return plan
        fingerprint = summary['fingerprint']
        if fingerprint in self._seen:
            if self._seen[fingerprint] is not None:
                return plan                 # stored already
            key, _ = self.cached.lookup(nodes, summary)
            self.cached.store(key, plan)
            self._seen[fingerprint] = len(plan.steps)
            return plan
        if len(self._seen) >= self.memory:
            self._forget_seen_once()
        if len(self._seen) < self.memory:
            self._seen[fingerprint] = None
        return plan

    def _forget_seen_once(self):
        """Drop the older half of the summaries seen once (by when they
        were first seen), keeping those with a stored plan: when none were
        dropped, ``memory`` one-off flushes (a long run over structures
        that never repeat) left no room, and a structure that began
        repeating later never got a cached plan."""
        once = [fingerprint for fingerprint, steps in self._seen.items() if steps is None]
        for fingerprint in once[:max(1, len(once) // 2)]:
            del self._seen[fingerprint]

    def _probe(self, nodes, summary, chosen, chosen_plan, kind):
        """Time the other of depth/agenda (planned, not run) on the first
        flush of each kind of graph (set of block families) and now and then
        after, so agenda's step saving is known per kind of graph.  A kind
        where agenda saved under 5% of depth's steps is probed half as often
        each time (every ``probe_every`` flushes at first, at most every
        ``16 * probe_every``): on a large graph the probe costs as much as
        agenda's whole analysis."""
        if self._flushes < self._next_probe.get(kind, 0):
            return
        other = 'agenda' if chosen != 'agenda' else 'depth'
        setup, start = SETUP[0], time.perf_counter()
        plan = STRATEGIES[other].plan(nodes)
        self.model.observe_analysis(other, time.perf_counter() - start, len(nodes), setup=setup)
        if chosen in ('depth', 'agenda'):
            self._same_sizes[kind] = _alike(plan.batch_sizes(), chosen_plan.batch_sizes())
        gap = self.probe_every
        if other == 'agenda':
            self._observe_agenda(len(plan.steps), summary['depth_steps'], kind)
            if len(plan.steps) > 0.95 * summary['depth_steps']:
                gap = min(2 * self._probe_gap.get(kind, self.probe_every // 2),
                          16 * self.probe_every)
        self._probe_gap[kind] = gap
        self._next_probe[kind] = self._flushes + gap

    def _observe_agenda(self, agenda_steps, depth_steps, kind):
        ratio = agenda_steps / max(1, depth_steps)
        self.model.agenda_ratio += 0.3 * (ratio - self.model.agenda_ratio)
        old = self._ratios.get(kind, ratio)
        self._ratios[kind] = old + 0.3 * (ratio - old)

    def observe(self, plan, step_seconds, analyse_s, nodes):
        if len(plan.steps) < 2 and self.last is _UNDECIDED:
            return      # nothing to learn: no decision, no line to fit
        with PLANNING:
            self._observe(plan, step_seconds, analyse_s)

    def _observe(self, plan, step_seconds, analyse_s):
        timed = step_seconds is not None
        if timed and plan.program is None:      # a compiled plan has no per-step times
            self.model.observe_steps(plan, step_seconds,
                                     built=self.last.get('built') != programs_built())
        last = self.last
        if 'predicted_ms' not in last:
            return
        fingerprint = last['fingerprint']
        name = last['choice']
        if self._seen.get(fingerprint) is not None:     # a repeating summary
            # the best time seen: a structure costs the same every time, and
            # what varies (a one-off compile, a first call, a busy machine)
            # only adds
            record = self._repeat(fingerprint)
            if name == 'cached':
                # a compiled run and a replay cost different amounts: when
                # the plan's program comes or goes (dropped, see CachedPlan),
                # the best time of the other kind of run no longer applies
                compiled = plan.program is not None
                if record.cached_compiled is not None and compiled != record.cached_compiled:
                    record.best_ms.pop('cached', None)
                record.cached_compiled = compiled
            if timed and (name == 'cached' or programs_built() == last['built']):
                total = (analyse_s - self.last_compile_s + sum(step_seconds)) * 1e3
                record.best_ms[name] = min(total, record.best_ms.get(name, total))
            elif name != 'cached' and last.get('deciding'):
                # the rival's run, slowed by building a step program (~4 ms
                # each: at SICK minibatch 256 auto then kept a compiled plan
                # 17% slower than depth): time it again.  (Not after any
                # untimed run of it: under a threaded engine, where most
                # runs are untimed, every other flush then waited, and the
                # cached plan's retries fell on the rival's sightings.)
                record.rival_timed = False
            if name == 'cached':
                record.cached_runs += 1
        if name in ('depth', 'agenda', 'per-sample'):
            self._observe_run(name, sum(step_seconds) * 1e3 if timed else None)
        if name == 'agenda':
            self._observe_agenda(len(plan.steps), last['depth_steps'], last['kind'])


def _median(values):
    """The median of a few numbers (``statistics.median`` cost ~3 us of
    each flush's bookkeeping)."""
    ordered = sorted(values)
    half = len(ordered) // 2
    return ordered[half] if len(ordered) % 2 else (ordered[half - 1] + ordered[half]) / 2


def _cached_loses(record):
    """Whether a repeating summary's cached plan has a best time more than
    5% over the best other strategy's (False while either is missing)."""
    others = [ms for name, ms in record.best_ms.items() if name != 'cached']
    best = record.best_ms.get('cached')
    return bool(others) and best is not None and best > 1.05 * min(others)


def _fewer_steps(nodes, entry):
    """Depth's plan of ``nodes`` now, if it has fewer steps than the
    stored plan ``entry`` (made with the costs known when it was stored),
    else None."""
    fresh = STRATEGIES['depth'].plan(nodes)
    return fresh if len(fresh.steps) < len(entry.steps) else None


def _alike(sizes, others):
    """Whether two plans' step sizes match, as many steps whose sorted
    sizes differ by at most 5% of the calls in all: random trees' plans
    differ by a row here and there (pooling their factors still keeps
    noise from choosing agenda's equal plan), a layered DAG's by 18% (one
    wide step against even ones)."""
    if len(sizes) != len(others):
        return False
    moved = sum(abs(a - b) for a, b in zip(sorted(sizes), sorted(others)))
    return moved <= 0.05 * sum(sizes)


class _Repeating:
    """What :class:`Auto` measured on one repeating summary: how often it
    came back, how often its cached plan ran (and whether compiled, the
    last time), and each strategy's best total (analysis + run, ms)."""
    __slots__ = ('sightings', 'cached_runs', 'cached_compiled', 'best_ms', 'rival_timed')

    def __init__(self):
        self.sightings = 0
        self.cached_runs = 0
        self.cached_compiled = None
        self.best_ms = {}
        self.rival_timed = False    # has the best other strategy run plainly?


STRATEGIES['auto'] = Auto()
