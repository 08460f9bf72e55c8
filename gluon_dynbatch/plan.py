"""Plans: which recorded calls run together, in what order.

A :class:`Plan` is plain data, a tuple of :class:`BatchStep`; the executor
only iterates over it.  Strategies turn a list of pending nodes into a plan:

* :class:`PerSample` - one step per call (no analysis at all);
* :class:`ByDepth` - calls of equal signature and equal depth (linear time);
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
from collections import defaultdict
from dataclasses import dataclass
from typing import Tuple

from .graph import LazyValue, PENDING

__all__ = ['BatchStep', 'Plan', 'Strategy', 'PerSample', 'ByDepth', 'Agenda', 'CachedPlan',
           'structure_key', 'STRATEGIES']


@dataclass(frozen=True)
class BatchStep:
    """Run ``nodes`` (calls of one signature) as one batched call."""
    sig: object
    nodes: Tuple

    def __str__(self):
        return '%-40s x%d' % (self.sig.describe(), len(self.nodes))


@dataclass(frozen=True)
class Plan:
    """Steps in an order that respects every dependency."""
    strategy: str
    steps: Tuple[BatchStep, ...]

    def batch_sizes(self):
        return [len(step.nodes) for step in self.steps]

    def __str__(self):
        lines = ['Plan(%s, %d steps)' % (self.strategy, len(self.steps))]
        lines += ['  %3d %s' % (i, step) for i, step in enumerate(self.steps)]
        return '\n'.join(lines)


def make_step(nodes):
    """A step over ``nodes`` of one family; mixed list lengths run under the
    padded signature."""
    sig = nodes[0].sig
    if any(node.sig is not sig for node in nodes):
        sig = sig.dblock.padded_signature(list({id(n.sig): n.sig for n in nodes}.values()))
    return BatchStep(sig, nodes)


class Strategy:
    """Interface: ``plan(nodes, summary=None) -> Plan`` for nodes in recording
    order (``summary``: what recording counted, see ``cost.summarize``), and
    ``observe(...)``, told what the plan then cost."""
    name = 'strategy'

    def plan(self, nodes, summary=None):
        raise NotImplementedError

    def prepare(self):
        """Called when a scope opens (one-time set-up, kept out of timings)."""

    def observe(self, plan, step_seconds, analyse_s, nodes):
        """Called after the plan ran; strategies that learn override it."""


class PerSample(Strategy):
    """Every call alone, in recording order (a valid topological order)."""
    name = 'per-sample'

    def plan(self, nodes, summary=None):
        return Plan(self.name, tuple(BatchStep(n.sig, (n,)) for n in nodes))


class ByDepth(Strategy):
    """Group by (depth, signature); depth was computed while recording."""
    name = 'depth'

    def plan(self, nodes, summary=None):
        groups = defaultdict(list)
        steps = []
        for node in nodes:
            if node.sig.batch_safe:
                groups[(node.depth, node.sig.group_key)].append(node)
            else:
                steps.append((node.depth, node.sig.group_key, (node,)))
        steps += [(depth, key, tuple(group)) for (depth, key), group in groups.items()]
        steps.sort(key=lambda item: (item[0], item[1]))
        return Plan(self.name, tuple(make_step(group) for _, _, group in steps))


class Agenda(Strategy):
    """DyNet's agenda heuristic (``autobatch_strategy=1``): among the
    signatures with ready calls, run the one of lowest average depth."""
    name = 'agenda'

    def plan(self, nodes, summary=None):
        waiting, users = self._dependencies(nodes)
        depth_sum, count = defaultdict(int), defaultdict(int)
        ready = defaultdict(list)
        for node in nodes:
            key = self._key(node)
            depth_sum[key] += node.depth
            count[key] += 1
            if waiting[node] == 0:
                ready[key].append(node)
        steps = []
        while ready:
            key = min(ready, key=lambda k: (depth_sum[k] / count[k], k))
            group = ready.pop(key)
            if key < 0:  # not batch-safe: one call, the rest stay ready
                group, rest = group[:1], group[1:]
                if rest:
                    ready[key] = rest
            steps.append(make_step(tuple(group)))
            for node in group:
                for user in users.get(node, ()):
                    waiting[user] -= 1
                    if waiting[user] == 0:
                        ready[self._key(user)].append(user)
        return Plan(self.name, tuple(steps))

    @staticmethod
    def _key(node):
        return node.sig.group_key

    @staticmethod
    def _dependencies(nodes):
        waiting, users = {}, defaultdict(list)
        for node in nodes:
            producers = {id(leaf._node): leaf._node for leaf in node.leaves
                         if type(leaf) is LazyValue and leaf._node.state == PENDING}
            waiting[node] = len(producers)
            for producer in producers.values():
                users[producer].append(node)
        return waiting, users


def structure_key(nodes):
    """Hashable structure of a recorded graph: per node its signature and,
    per lazy input, which earlier node and output it reads.  Two flushes with
    equal keys can run the same plan."""
    position = {id(node): i for i, node in enumerate(nodes)}
    key = []
    for node in nodes:
        reads = tuple((position.get(id(leaf._node), -1), leaf._index)
                      if type(leaf) is LazyValue else None for leaf in node.leaves)
        key.append((node.sig.sig_id, reads))
    return tuple(key)


class CachedPlan(Strategy):
    """Reuse the plan of an earlier flush with the same structure: no
    analysis beyond hashing the structure.  On a miss, plan with ``fallback``
    and remember the result (at most ``capacity`` structures)."""
    name = 'cached'

    def __init__(self, fallback=None, capacity=4096):
        self.fallback = fallback or ByDepth()
        self.capacity = capacity
        self.cache = {}
        self.hits = self.misses = 0

    def lookup(self, nodes):
        """``(key, cached steps or None)``."""
        key = structure_key(nodes)
        return key, self.cache.get(key)

    def plan(self, nodes, summary=None, key=None):
        if key is None:
            key, entry = self.lookup(nodes)
        else:
            entry = self.cache.get(key)
        if entry is not None:
            self.hits += 1
            return Plan(self.name, tuple(BatchStep(sig, tuple(nodes[i] for i in rows))
                                         for sig, rows in entry))
        self.misses += 1
        plan = self.fallback.plan(nodes)
        self.store(key, nodes, plan)
        return Plan(self.name + '-miss:' + plan.strategy, plan.steps)

    def store(self, key, nodes, plan):
        """Remember ``plan`` (made for ``nodes``) under structure ``key``."""
        position = {id(node): i for i, node in enumerate(nodes)}
        if len(self.cache) >= self.capacity:
            self.cache.pop(next(iter(self.cache)))
        self.cache[key] = [(step.sig, [position[id(n)] for n in step.nodes])
                           for step in plan.steps]


STRATEGIES = {strategy.name: strategy for strategy in (PerSample(), ByDepth(), Agenda(),
                                                        CachedPlan())}
"""Shared strategy instances by name (``batching(name)``); the cached-plan
strategy keeps its cache across scopes."""
