"""Cost-aware choice of strategy: spend analysis time only where it pays.

Analysing a recorded graph costs time that grows with the graph; what it buys
(fewer, larger batched calls) saturates.  :class:`CostModel` predicts, for a
flush, each strategy's analysis time and the run time of the plan it would
make, from a few constants measured on this machine:

* ``step_us`` - fixed cost of one batched step (a CachedOp call, index uploads);
* ``row_us`` - cost per row (per recorded call) inside a step;
* ``analyse_us[name]`` - analysis cost per node of each strategy (for the
  cached plan: hashing the structure).

The number of steps each strategy makes is known before analysing: recording
already counts the distinct (depth, signature family) pairs, which is exactly
what depth grouping produces; per-sample makes one step per call; agenda makes
at most as many as depth (the observed ratio is learned); a cached plan has
the count of the plan it reuses.

:class:`Auto` (the strategy behind ``batching('auto')``) asks the model,
runs the cheapest, and feeds what it measured back into the model, so the
constants follow the machine and the workload.
"""
import json
import time

import mxnet as mx

from .execute import run_plan
from .plan import STRATEGIES, Agenda, ByDepth, CachedPlan, PerSample, Strategy

__all__ = ['CostModel', 'Auto', 'default_cost_model']


class CostModel:
    """Predicts analysis and run time (ms) of each strategy for a flush.

    Parameters
    ----------
    step_us, row_us : float
        Fixed cost per batched step and cost per row, microseconds.
    analyse_us : dict
        Per-node analysis cost of each strategy, microseconds.
    """

    def __init__(self, step_us=300.0, row_us=15.0, analyse_us=None, agenda_ratio=1.0):
        self.step_us = step_us
        self.row_us = row_us
        self.analyse_us = dict(analyse_us or {'per-sample': 0.3, 'depth': 1.0, 'agenda': 5.0,
                                              'cached': 2.0})
        self.agenda_ratio = agenda_ratio
        self.calibrated = False

    # --- prediction --------------------------------------------------------
    def predict(self, n_nodes, n_steps_by_depth, cached_steps=None):
        """``{strategy: (analyse_ms, run_ms)}`` for a flush of ``n_nodes``
        calls that depth grouping would run in ``n_steps_by_depth`` steps;
        ``cached_steps`` is the step count of a reusable cached plan."""
        rows_ms = n_nodes * self.row_us / 1e3
        steps = {'per-sample': n_nodes, 'depth': n_steps_by_depth,
                 'agenda': max(1.0, n_steps_by_depth * self.agenda_ratio)}
        if cached_steps is not None:
            steps['cached'] = cached_steps
        return {name: (n_nodes * self.analyse_us[name] / 1e3,
                       count * self.step_us / 1e3 + rows_ms)
                for name, count in steps.items()}

    # --- learning ----------------------------------------------------------
    def observe(self, plan, step_seconds, analyse_s, name, n_nodes, alpha=0.2):
        """Move the constants toward what a flush measured (exponential
        moving averages, so one noisy flush cannot swing the choice)."""
        if n_nodes:
            per_node = analyse_s * 1e6 / n_nodes
            self.analyse_us[name] += alpha * (per_node - self.analyse_us[name])
        sizes = plan.batch_sizes()
        if len(sizes) >= 2:
            fit = _fit_line(sizes, [s * 1e6 for s in step_seconds])
            if fit is not None:
                step_us, row_us = fit
                self.step_us += alpha * (step_us - self.step_us)
                self.row_us += alpha * (row_us - self.row_us)

    def calibrate(self, rows=(1, 64), repeats=5):
        """Measure the constants with a short probe (~0.1-0.5 s): batched
        steps of a small Dense block at two sizes, and each strategy's
        analysis of a 400-node graph."""
        from .block import DynBatchBlock, private_scope
        block = DynBatchBlock(mx.gluon.nn.Dense(32, in_units=32, prefix='dynbatch_probe_'))
        block.initialize()
        x = mx.nd.ones((1, 32))
        times = {}
        for n in rows:
            samples = []
            for _ in range(repeats):
                with private_scope('depth') as scope:
                    for _ in range(n):
                        block(x)
                    nodes = list(scope.pending)
                    scope.pending = []
                    plan = ByDepth().plan(nodes)
                    start = time.perf_counter()
                    run_plan(plan)
                    mx.nd.waitall()
                    samples.append(time.perf_counter() - start)
            times[n] = sorted(samples)[len(samples) // 2] * 1e6
        self.row_us = max(0.1, (times[rows[1]] - times[rows[0]]) / (rows[1] - rows[0]))
        self.step_us = max(1.0, times[rows[0]] - self.row_us * rows[0])
        with private_scope('per-sample') as scope:
            chains = [block(x) for _ in range(20)]
            for _ in range(19):
                chains = [block(c) for c in chains]
            nodes = list(scope.pending)
            for name, strategy in (('per-sample', PerSample()), ('depth', ByDepth()),
                                   ('agenda', Agenda()), ('cached', CachedPlan())):
                start = time.perf_counter()
                strategy.plan(nodes)
                self.analyse_us[name] = (time.perf_counter() - start) * 1e6 / len(nodes)
        self.calibrated = True
        return self

    # --- persistence -------------------------------------------------------
    def to_dict(self):
        return {'step_us': self.step_us, 'row_us': self.row_us,
                'analyse_us': dict(self.analyse_us), 'agenda_ratio': self.agenda_ratio}

    def save(self, path):
        """Write the constants as JSON (a saved machine profile)."""
        with open(path, 'w') as f:
            json.dump(self.to_dict(), f, indent=1)

    @classmethod
    def load(cls, path):
        with open(path) as f:
            model = cls(**json.load(f))
        model.calibrated = True
        return model

    def __repr__(self):
        analyse = ', '.join('%s %.2f' % kv for kv in sorted(self.analyse_us.items()))
        return 'CostModel(step %.1f us, row %.2f us; analyse/node: %s)' % (
            self.step_us, self.row_us, analyse)


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


class Auto(Strategy):
    """Pick, per flush, the strategy with the lowest predicted analysis + run
    time, and learn from what the flush then measured.

    Plans are offered to the cache only for graphs whose summary (the counts
    per depth and family) was seen before, so graphs that never repeat pay
    nothing for the cache; every ``probe_every``-th flush also plans with
    agenda, without running it, to learn how many steps agenda saves.
    """
    name = 'auto'

    def __init__(self, model=None, probe_every=16):
        self._model = model
        self.cached = STRATEGIES['cached']
        self.probe_every = probe_every
        self.choices = {}
        self.last = {}
        self._fingerprints = set()
        self._flushes = 0

    @property
    def model(self):
        if self._model is None:
            self._model = default_cost_model()
        return self._model

    def plan(self, nodes, summary=None):
        summary = summary or summarize(nodes)
        self._flushes += 1
        key = cached_steps = None
        fingerprint = summary['fingerprint']
        if fingerprint in self._fingerprints:
            key, entry = self.cached.lookup(nodes)
            cached_steps = len(entry) if entry is not None else None
        self._fingerprints.add(fingerprint)
        predictions = self.model.predict(len(nodes), summary['depth_steps'], cached_steps)
        name = min(predictions, key=lambda k: sum(predictions[k]))
        if name == 'cached':
            plan = self.cached.plan(nodes, key)
        else:
            plan = STRATEGIES[name].plan(nodes)
            if key is not None:
                self.cached.store(key, nodes, plan)
        if name != 'agenda' and self._flushes % self.probe_every == 1 and len(nodes) > 1:
            probe = STRATEGIES['agenda'].plan(nodes)
            ratio = len(probe.steps) / max(1, summary['depth_steps'])
            self.model.agenda_ratio += 0.3 * (ratio - self.model.agenda_ratio)
        self.choices[name] = self.choices.get(name, 0) + 1
        self.last = {'choice': name, 'predicted_ms': sum(predictions[name]),
                     'depth_steps': summary['depth_steps'],
                     'predictions_ms': {k: round(sum(v), 3) for k, v in predictions.items()}}
        return plan

    def observe(self, plan, step_seconds, analyse_s, nodes):
        name = self.last.get('choice', plan.strategy)
        self.model.observe(plan, step_seconds, analyse_s, name, len(nodes))
        if name == 'agenda':
            ratio = len(plan.steps) / max(1, self.last['depth_steps'])
            self.model.agenda_ratio += 0.3 * (ratio - self.model.agenda_ratio)


def summarize(nodes):
    """What recording knows of a flush, computed from the nodes (the scope
    keeps it up to date while recording instead)."""
    groups = {}
    unsafe = 0
    for node in nodes:
        if node.sig.batch_safe:
            key = (node.depth, node.sig.group_key)
            groups[key] = groups.get(key, 0) + 1
        else:
            unsafe += 1
    return {'depth_steps': len(groups) + unsafe,
            'fingerprint': (frozenset(groups.items()), unsafe)}


STRATEGIES['auto'] = Auto()
