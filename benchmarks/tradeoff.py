#!/usr/bin/env python
"""The analysis-vs-batching trade-off (issue 4): what each batching strategy
spends on recording and analysing a graph, what it buys in batched calls, and
whether ``batching('auto')`` picks well.

Workloads (inference; every output is brought to the host with ``asnumpy``):

* ``sick B=n`` - the child-sum Tree-LSTM (``TreeLSTMNode(V, 300, 150)`` and the
  ``Similarity`` head) on SICK test pairs, minibatches of n = 1, 4, 16, 64,
  256, 1024 pairs, token ids fed as float32 numpy ``(1,)`` arrays, the plain
  per-sample recursion of the README; every repeat is a *new* minibatch;
* ``chains`` - 32 chains of random lengths 1..200 of a small Dense block
  (hidden 64), each feeding a common 4-layer head: depth grouping runs the
  head layers once per distinct chain length, agenda once in all;
* ``bushy`` - shallow trees (3 levels) of arity up to 8 of a child-sum node
  block (hidden 64, child lists zero-padded);
* ``dag`` - a random DAG: each node averages 1..3 random earlier nodes
  (three signatures, no padding), hidden 64;
* ``sick-repeat B=n`` - the *same* SICK minibatch again and again, where a
  cached plan can be reused;
* where little or nothing batches, so that ``auto`` must not cost more than
  it saves: ``long chain`` (800-1,000 calls of one block), ``read each
  call`` (a chain whose loop reads every value: one-call flushes),
  ``layered dag`` (32 calls wide, 6 deep, new random wiring each
  minibatch: depth moves unread calls to one wide last step, agenda runs
  each layer in one) and ``repeated small`` (Gluon's ``LSTMCell`` over
  one sequence of 12, 16 or 20 tokens at a time: small flushes whose
  structure comes back, which ``auto`` replays).

Per workload and strategy (every strategy of ``gluon_dynbatch.STRATEGIES``,
plus ``plain``: the same per-sample code called outside any scope, i.e. plain
imperative Gluon) the script measures, from ``dyb.stats()``, record, analysis
and run milliseconds and the number of batched calls, and the wall time of the
whole minibatch; medians over repeats after warm-up, strategies interleaved
in every repeat, in a new (seeded) order each time.  A run is faster right
after a batched run of the same minibatch (its inputs in cache, MXNet's
memory pool primed: ~10% at B=16, ~25% on the bushy graphs) than first on
a new minibatch or after ``plain``.  So in each repeat ``plain`` and
``per-sample`` run first, then one untimed ``depth`` run, then the batched
strategies: each of those follows a batched run of the same minibatch.  (A
fixed cyclic order made each strategy always follow the same one; a
shuffled order of all of them gave each a random share of cold runs, and
auto, running depth's very plan on the bushy graphs, measured 1.15x depth.)  ``plain`` and ``per-sample`` only run on graphs of
at most ``--per-sample-cap`` nodes (they cost ~0.1-0.3 ms per node).

After the matrix, on the repeated SICK minibatch with a cached plan, it
measures record + analysis as a share of an inference step and of a
training step (forward, backward and a ``'fusedadagrad'`` step), and the
user's per-sample loop alone, with Python functions that return at once in
place of the blocks: the floor under recording.

Every strategy's outputs are compared with the reference (``plain`` where it
ran, else ``depth``) on every measured minibatch (max abs difference <=
``--tol``).  Output: a table on stdout, ``tradeoff.json`` and ``tradeoff.png``
in ``--out`` (default ``benchmarks/results/``)::

    python benchmarks/tradeoff.py            # full run, < 6 min on 2 cores
    python benchmarks/tradeoff.py --quick    # smoke run, < 40 s (into results/quick/)

Notes on fairness: the ``cached`` column uses a ``CachedPlan()`` private to
the workload (same class and fallback as ``STRATEGIES['cached']``), so it can
only hit plans it stored itself, never one that ``auto`` stored while running
the same minibatch in the same repeat.  ``auto`` is ``STRATEGIES['auto']``,
the instance ``batching()`` uses, with its process-wide cost model learning
across workloads in the order they run.
"""
import argparse
import gc
import json
import os
import platform
import random
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
DEFAULT_OUT = os.path.join(HERE, 'results')
QUICK_OUT = os.path.join(DEFAULT_OUT, 'quick')
STATIC_PNG = os.path.join(ROOT, 'docs', '_static', 'tradeoff.png')

EMBED, HIDDEN, SIM_HIDDEN, CLASSES = 300, 150, 50, 5
SYN_HIDDEN = 64
PLAIN = 'plain'
FIXED = ('per-sample', 'depth', 'agenda', 'cached')
AUTO_SLACK = 1.10          # flag auto when slower than best fixed by more than 10%
OVERHEAD_LIMIT = 0.05      # flag record+analysis above 5% of the step (cached, SICK B=256)

sys.path.insert(0, HERE)
from bench_treelstm import (number, positive_int, non_negative_float,  # noqa: E402
                            seed_int, SEED_MAX)                  # (no MXNet import there)


# ==========================================================================
# Command line and environment (no MXNet import here)
# ==========================================================================

def build_parser():
    p = argparse.ArgumentParser(
        description='Analysis-vs-batching trade-off of the gluon_dynbatch strategies.',
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument('--data', default=None, help='SICK folder (else $GLUON_DYNBATCH_SICK, '
                                                'else ../shared/data/sick)%(default).0s')
    p.add_argument('--out', default=None,
                   help='folder for tradeoff.json / .png (default %s; with --quick %s, so that a smoke run '
                        'leaves the published results alone)%%(default).0s' % (DEFAULT_OUT, QUICK_OUT))
    p.add_argument('--quick', action='store_true', help='smoke run (< 40 s)')
    p.add_argument('--repeats', type=positive_int, default=None,
                   help='measured repeats per workload, at least (default 11; quick 3); '
                        'small SICK minibatches get more (256 / B, quick 24 / B), the '
                        'repeated one 21 and the synthetic graphs 31%(default).0s')
    p.add_argument('--per-sample-cap', type=number(int, 0), default=None,
                   help='largest graph (nodes) on which plain and per-sample run '
                        '(default 4500; quick 1500; 0: on none)%(default).0s')
    p.add_argument('--tol', type=non_negative_float, default=1e-4,
                   help='output equality tolerance (0: bit for bit)')
    p.add_argument('--seed', type=seed_int, default=0,
                   help='data order, synthetic graphs and parameters (0 to %d)' % SEED_MAX)
    p.add_argument('--no-plot', action='store_true', help='write no PNG')
    p.add_argument('--no-static-copy', action='store_true',
                   help='do not copy the PNG to docs/_static/tradeoff.png (a run with '
                        'another --out never does)')
    return p


def configure_env():
    """NaiveEngine, one OpenMP thread: must run before ``import mxnet``."""
    if 'mxnet' in sys.modules:
        print('warning: mxnet was imported before the environment was set', file=sys.stderr)
    os.environ['MXNET_ENGINE_TYPE'] = 'NaiveEngine'
    os.environ['OMP_NUM_THREADS'] = '1'
    os.environ['MKL_NUM_THREADS'] = '1'
    print('MXNET_ENGINE_TYPE=%s OMP_NUM_THREADS=%s MKL_NUM_THREADS=%s'
          % (os.environ['MXNET_ENGINE_TYPE'], os.environ['OMP_NUM_THREADS'],
             os.environ['MKL_NUM_THREADS']), flush=True)


def settings(args):
    if args.quick:
        cfg = dict(sick_sizes=[1, 4, 16, 64], repeat_size=16, repeats=3, pairs_per_size=24,
                   warm_batches=[(1, 10), (4, 4), (16, 2)],
                   chains=(8, 60), bushy_trees=12, dag_nodes=150, cap=1500, synthetic_repeats=3,
                   same_repeats=3, long_chain=(80, 100), read_each=20, layered_dag=(8, 3),
                   repeated_small=(6, 8))
    else:
        # (11 repeats, not 7: SICK at 64 and 1,024, where auto ran the best
        # fixed strategy's very plans, measured 1.135x and 1.10x it over 7)
        cfg = dict(sick_sizes=[1, 4, 16, 64, 256, 1024], repeat_size=256, repeats=11,
                   pairs_per_size=256, warm_batches=[(1, 30), (4, 15), (16, 8), (64, 3)],
                   chains=(32, 200), bushy_trees=64, dag_nodes=600, cap=4500,
                   synthetic_repeats=31, same_repeats=21, long_chain=(800, 1000), read_each=50,
                   layered_dag=(32, 6), repeated_small=(12, 16, 20))
    if args.repeats:
        cfg['repeats'] = args.repeats
    if args.per_sample_cap is not None:
        cfg['cap'] = args.per_sample_cap
    return cfg


# ==========================================================================
# Workloads
# ==========================================================================

class Workload:
    """A named stream of minibatches and a way to run one under a strategy.

    ``run(strategy, batch)`` returns the outputs as one numpy array; strategy
    is a Strategy object, or ``PLAIN`` for calls outside any scope."""
    kind = 'synthetic'

    def __init__(self, name):
        self.name = name
        self.warmup = []      # minibatches for warm-up (not measured)
        self.batches = []     # one minibatch per measured repeat
        self.note = ''
        self.dblocks = []     # its DynBatchBlocks

    def nodes(self, batch):
        raise NotImplementedError

    def run(self, strategy, batch):
        raise NotImplementedError


def _to_device(mx, host):
    """numpy -> NDArray without ``mx.nd.array``'s per-call checks."""
    array = mx.nd.empty(host.shape, dtype=host.dtype)
    array._sync_copyfrom(host)  # pylint: disable=protected-access
    return array


class TreeLSTMModel:
    """One set of Tree-LSTM weights shared by every SICK workload."""

    def __init__(self, mx, dyb, vocab_size, embedding, seed):
        from gluon_dynbatch.models import Similarity, TreeLSTMNode
        mx.random.seed(seed)
        self.mx, self.dyb = mx, dyb
        self.node = TreeLSTMNode(vocab_size, EMBED, HIDDEN, prefix='treelstm_')
        self.head = Similarity(SIM_HIDDEN, CLASSES, in_units=HIDDEN, prefix='sim_')
        self.node.initialize(mx.init.Xavier())
        self.head.initialize(mx.init.Xavier())
        self.node.embedding.weight.set_data(mx.nd.array(embedding))
        self.dnode = dyb.DynBatchBlock(self.node)
        self.dhead = dyb.DynBatchBlock(self.head)

    # the README contract: plain per-sample recursion, unchanged
    def encode(self, tree, ids):
        states = [self.encode(child, ids) for child in tree.children]
        return self.dnode(ids[tree.idx:tree.idx + 1],
                          [h for h, _ in states], [c for _, c in states])

    def user_loop(self, pairs):
        """Every pair's head call over its two trees."""
        return [self.dhead(self.encode(a_tree, a_ids)[0], self.encode(b_tree, b_ids)[0])
                for a_ids, a_tree, b_ids, b_tree in pairs]

    def predict(self, strategy, pairs, scope=None):
        """The minibatch's (n, C) log-probs, one batching scope; the seconds
        from the scope's opening through its exit (its flush included) are
        appended to ``scope`` when given."""
        start = time.perf_counter()
        with self.dyb.batching(strategy):
            preds = self.user_loop(pairs)
        if scope is not None:
            scope.append(time.perf_counter() - start)
        if len(preds) == 1:
            return preds[0].data
        return self.dyb.concat_rows(preds)

    def batched(self, strategy, pairs):
        return self.predict(strategy, pairs).asnumpy()

    # plain Gluon: the same recursion outside any scope, ids on the device
    # once per sentence (as benchmarks/bench_treelstm.py's per-sample form)
    def encode_plain(self, tree, ids):
        states = [self.encode_plain(child, ids) for child in tree.children]
        return self.node(ids[tree.idx:tree.idx + 1], [h for h, _ in states],
                         [c for _, c in states])

    def plain(self, pairs):
        mx = self.mx
        outs = []
        for a_ids, a_tree, b_ids, b_tree in pairs:
            ha = self.encode_plain(a_tree, _to_device(mx, a_ids))[0]
            hb = self.encode_plain(b_tree, _to_device(mx, b_ids))[0]
            outs.append(self.head(ha, hb))
        out = outs[0] if len(outs) == 1 else mx.nd.concat(*outs, dim=0)
        return out.asnumpy()


class SickWorkload(Workload):
    kind = 'sick'

    def __init__(self, name, model, size, batches, warmup):
        super().__init__(name)
        self.model, self.size = model, size
        self.batches, self.warmup = batches, warmup
        self.dblocks = [model.dnode, model.dhead]

    def nodes(self, batch):
        return sum(a.size() + b.size() + 1 for _, a, _, b in batch)

    def run(self, strategy, batch):
        if strategy == PLAIN:
            return self.model.plain(batch)
        return self.model.batched(strategy, batch)


def _dense_block(mx, name, units, in_units, activation='tanh'):
    block = mx.gluon.nn.HybridSequential(prefix=name + '_')
    with block.name_scope():
        block.add(mx.gluon.nn.Dense(units, in_units=in_units, activation=activation))
    return block


def _make_blocks(mx):
    """Small per-sample blocks for the synthetic workloads (defined lazily:
    HybridBlock needs MXNet)."""
    HybridBlock, nn = mx.gluon.HybridBlock, mx.gluon.nn

    class ChildSumNode(HybridBlock):
        """``h = tanh(W x + U sum(children))``; zero children add nothing."""
        dynbatch_pad_lists = True

        def __init__(self, hidden, **kw):
            super().__init__(**kw)
            with self.name_scope():
                self.wx = nn.Dense(hidden, in_units=hidden, prefix='wx_')
                self.uh = nn.Dense(hidden, in_units=hidden, use_bias=False, prefix='uh_')

        def hybrid_forward(self, F, x, children):
            pre = self.wx(x)
            if children:
                total = children[0] if len(children) == 1 else F.add_n(*children)
                pre = pre + self.uh(total)
            return F.Activation(pre, act_type='tanh')

    class MeanNode(HybridBlock):
        """``h = tanh(W mean(inputs) + b)`` (a mean: not zero-paddable)."""

        def __init__(self, hidden, **kw):
            super().__init__(**kw)
            with self.name_scope():
                self.w = nn.Dense(hidden, in_units=hidden, prefix='w_')

        def hybrid_forward(self, F, inputs):
            total = inputs[0] if len(inputs) == 1 else F.add_n(*inputs)
            return F.Activation(self.w(total / len(inputs)), act_type='tanh')

    return ChildSumNode, MeanNode


class ChainsWorkload(Workload):
    """``n`` chains of random lengths of a Dense+tanh cell, each followed by a
    common head of ``head_layers`` calls of another Dense block."""

    def __init__(self, mx, dyb, n_chains, max_len, seed, head_layers=4, n_batches=1,
                 min_len=1, name='chains'):
        super().__init__(name)
        self.mx = mx
        self.cell = _dense_block(mx, 'chain_cell', SYN_HIDDEN, SYN_HIDDEN)
        self.head = _dense_block(mx, 'chain_head', SYN_HIDDEN, SYN_HIDDEN)
        for b in (self.cell, self.head):
            b.initialize(mx.init.Xavier())
        self.dcell, self.dhead = dyb.DynBatchBlock(self.cell), dyb.DynBatchBlock(self.head)
        self.dblocks = [self.dcell, self.dhead]
        self.head_layers = head_layers
        self.dyb = dyb
        import numpy as np
        rng = np.random.RandomState(seed)
        self.note = '%d chain%s of lengths %d..%d, %s, hidden %d' % (
            n_chains, 's' if n_chains > 1 else '', min_len, max_len,
            'head of %d layers' % head_layers if head_layers else 'no head', SYN_HIDDEN)

        def make():
            lengths = rng.randint(min_len, max_len + 1, size=n_chains)
            x = rng.uniform(-1, 1, (n_chains, SYN_HIDDEN)).astype('float32')
            rows = [mx.nd.array(x[i:i + 1]) for i in range(n_chains)]
            return {'lengths': [int(v) for v in lengths], 'x': rows}
        self.warmup = [make()]
        self.batches = [make() for _ in range(n_batches)]

    def nodes(self, batch):
        return sum(batch['lengths']) + self.head_layers * len(batch['lengths'])

    def _forward(self, cell, head, batch):
        outs = []
        for length, h in zip(batch['lengths'], batch['x']):
            for _ in range(length):
                h = cell(h)
            for _ in range(self.head_layers):
                h = head(h)
            outs.append(h)
        return outs

    def run(self, strategy, batch):
        mx = self.mx
        if strategy == PLAIN:
            outs = self._forward(self.cell, self.head, batch)
            return mx.nd.concat(*outs, dim=0).asnumpy()
        with self.dyb.batching(strategy):
            outs = self._forward(self.dcell, self.dhead, batch)
        return self.dyb.concat_rows(outs).asnumpy()


class ReadEachWorkload(Workload):
    """A chain of ``length`` calls of a Dense+tanh cell whose loop reads
    every value as it goes (as a data-dependent stop or a printed score
    does): every flush holds one call, and nothing can batch."""

    def __init__(self, mx, dyb, length, seed, n_batches=1):
        super().__init__('read each call')
        import numpy as np
        self.mx, self.dyb, self.length = mx, dyb, length
        self.cell = _dense_block(mx, 'read_cell', SYN_HIDDEN, SYN_HIDDEN)
        self.cell.initialize(mx.init.Xavier())
        self.dcell = dyb.DynBatchBlock(self.cell)
        self.dblocks = [self.dcell]
        rng = np.random.RandomState(seed + 3)
        self.warmup = [mx.nd.array(rng.uniform(-1, 1, (1, SYN_HIDDEN)))]
        self.batches = [mx.nd.array(rng.uniform(-1, 1, (1, SYN_HIDDEN)))
                        for _ in range(n_batches)]
        self.note = 'a chain of %d calls, each value read (asnumpy) before the next call, ' \
                    'hidden %d' % (length, SYN_HIDDEN)

    def nodes(self, batch):
        return self.length

    def _forward(self, cell, h):
        for _ in range(self.length):
            h = cell(h)
            h.asnumpy()
        return h

    def run(self, strategy, batch):
        if strategy == PLAIN:
            return self._forward(self.cell, batch).asnumpy()
        with self.dyb.batching(strategy):
            return self._forward(self.dcell, batch).asnumpy()


class RepeatedSmallWorkload(Workload):
    """Gluon's own ``LSTMCell`` over one sequence at a time (minibatch 1)
    whose length is one of a few: every flush is small (under
    ``Auto.small`` calls, planned without deciding) and its structure
    comes back, so ``auto`` replays stored plans where ``depth`` plans
    every flush anew; a chain, so nothing batches."""

    def __init__(self, mx, dyb, lengths, seed, n_batches=1):
        super().__init__('repeated small')
        import numpy as np
        self.mx, self.dyb = mx, dyb
        self.cell = mx.gluon.rnn.LSTMCell(SYN_HIDDEN, input_size=SYN_HIDDEN,
                                          prefix='repeated_lstm_')
        self.cell.initialize(mx.init.Xavier())
        self.dcell = dyb.DynBatchBlock(self.cell)
        self.dblocks = [self.dcell]
        self.zeros = mx.nd.zeros((1, SYN_HIDDEN))
        rng = np.random.RandomState(seed + 5)

        def make():
            x = rng.uniform(-1, 1, (int(rng.choice(lengths)), SYN_HIDDEN)).astype('float32')
            return [mx.nd.array(x[i:i + 1]) for i in range(len(x))]
        # every length seen twice before timing: its plan is stored
        self.warmup = [make() for _ in range(3 * len(lengths))]
        self.batches = [make() for _ in range(n_batches)]
        self.note = 'a Gluon LSTMCell over one sequence of %s tokens (one of these lengths, ' \
                    'at random), minibatch 1, hidden %d' % (
                        '/'.join(str(n) for n in lengths), SYN_HIDDEN)

    def nodes(self, batch):
        return len(batch)

    def _forward(self, cell, tokens):
        states = [self.zeros, self.zeros]
        for x in tokens:
            out, states = cell(x, states)
        return out

    def run(self, strategy, batch):
        if strategy == PLAIN:
            return self._forward(self.cell, batch).asnumpy()
        with self.dyb.batching(strategy):
            out = self._forward(self.dcell, batch)
        return out.asnumpy()


class BushyWorkload(Workload):
    """Shallow trees (root, 2 more levels) of arity up to 8; node inputs are
    host numpy rows (as token ids are for the Tree-LSTM)."""

    def __init__(self, mx, dyb, n_trees, seed, n_batches=1):
        super().__init__('bushy')
        import numpy as np
        ChildSumNode, _ = _make_blocks(mx)
        self.mx, self.dyb = mx, dyb
        self.block = ChildSumNode(SYN_HIDDEN, prefix='bushy_')
        self.block.initialize(mx.init.Xavier())
        self.dblock = dyb.DynBatchBlock(self.block)
        self.dblocks = [self.dblock]
        rng = np.random.RandomState(seed + 1)

        def tree(level):
            if level == 2:
                return []
            arity = rng.randint(2, 9) if level == 0 else rng.randint(0, 9)
            return [tree(level + 1) for _ in range(arity)]

        def make():
            trees = [tree(0) for _ in range(n_trees)]
            n = sum(self._count(t) for t in trees)
            x = rng.uniform(-1, 1, (n, SYN_HIDDEN)).astype('float32')
            host = [x[i:i + 1] for i in range(n)]
            dev = [mx.nd.array(row) for row in host]
            return {'trees': trees, 'host': host, 'dev': dev, 'n': n}
        self.warmup = [make()]
        self.batches = [make() for _ in range(n_batches)]
        self.note = '%d trees, 3 levels, arity up to 8, hidden %d' % (n_trees, SYN_HIDDEN)

    @staticmethod
    def _count(children):
        return 1 + sum(BushyWorkload._count(c) for c in children)

    def nodes(self, batch):
        return batch['n']

    def _forward(self, block, rows, batch):
        counter = iter(range(batch['n']))

        def encode(children):
            hs = [encode(c) for c in children]
            return block(rows[next(counter)], hs)
        return [encode(t) for t in batch['trees']]

    def run(self, strategy, batch):
        mx = self.mx
        if strategy == PLAIN:
            outs = self._forward(self.block, batch['dev'], batch)
            return mx.nd.concat(*outs, dim=0).asnumpy()
        with self.dyb.batching(strategy):
            outs = self._forward(self.dblock, batch['host'], batch)
        return self.dyb.concat_rows(outs).asnumpy()


class _MeanGraph(Workload):
    """Sources (a Dense over host rows) feeding calls of a block that
    averages its list of inputs: the random-DAG workloads, which differ in
    their wiring (``_forward``)."""

    def __init__(self, mx, dyb, name, prefix):
        super().__init__(name)
        _, MeanNode = _make_blocks(mx)
        self.mx, self.dyb = mx, dyb
        self.src = _dense_block(mx, prefix + 'src', SYN_HIDDEN, SYN_HIDDEN)
        self.block = MeanNode(SYN_HIDDEN, prefix=prefix)
        for b in (self.src, self.block):
            b.initialize(mx.init.Xavier())
        self.dsrc, self.dblock = dyb.DynBatchBlock(self.src), dyb.DynBatchBlock(self.block)
        self.dblocks = [self.dsrc, self.dblock]

    def _forward(self, src, block, rows, batch):
        raise NotImplementedError

    def run(self, strategy, batch):
        mx = self.mx
        if strategy == PLAIN:
            outs = self._forward(self.src, self.block, batch['dev'], batch)
            return mx.nd.concat(*outs, dim=0).asnumpy()
        with self.dyb.batching(strategy):
            outs = self._forward(self.dsrc, self.dblock, batch['host'], batch)
        return self.dyb.concat_rows(outs).asnumpy()


class DagWorkload(_MeanGraph):
    """A random DAG: ``n_src`` source nodes (a Dense over host rows), then
    ``n`` nodes each averaging 1..3 random earlier nodes.  Output: the sinks."""

    def __init__(self, mx, dyb, n_nodes, seed, n_src=16, n_batches=1):
        super().__init__(mx, dyb, 'dag', 'dag_')
        import numpy as np
        rng = np.random.RandomState(seed + 2)

        def make():
            reads = []
            for i in range(n_nodes):
                k = rng.randint(1, 4)
                reads.append([int(j) for j in rng.randint(0, n_src + i, size=k)])
            read = set(j for r in reads for j in r)
            sinks = [n_src + i for i in range(n_nodes) if n_src + i not in read]
            x = rng.uniform(-1, 1, (n_src, SYN_HIDDEN)).astype('float32')
            host = [x[i:i + 1] for i in range(n_src)]
            return {'reads': reads, 'sinks': sinks, 'host': host,
                    'dev': [mx.nd.array(r) for r in host], 'n': n_src + n_nodes}
        self.warmup = [make()]
        self.batches = [make() for _ in range(n_batches)]
        self.note = '%d sources + %d nodes reading 1..3 random earlier nodes, hidden %d' % (
            n_src, n_nodes, SYN_HIDDEN)

    def nodes(self, batch):
        return batch['n']

    def _forward(self, src, block, rows, batch):
        values = [src(r) for r in rows]
        for r in batch['reads']:
            values.append(block([values[j] for j in r]))
        return [values[j] for j in batch['sinks']]


class LayeredDagWorkload(_MeanGraph):
    """``width`` sources (a Dense over host rows), then ``layers`` layers of
    ``width`` calls, each the mean of two random calls of the layer before;
    calls no later call reads run too.  Depth moves those to its last step
    (a wide step gathering from every layer); agenda runs each layer in one
    step, of as many steps.  Output: the last layer."""

    def __init__(self, mx, dyb, width, layers, seed, n_batches=1):
        super().__init__(mx, dyb, 'layered dag', 'layer_')
        import numpy as np
        self.width, self.layers = width, layers
        rng = np.random.RandomState(seed + 4)

        def make():
            wiring = [rng.randint(0, width, size=(width, 2)).tolist() for _ in range(layers)]
            x = rng.uniform(-1, 1, (width, SYN_HIDDEN)).astype('float32')
            host = [x[i:i + 1] for i in range(width)]
            return {'wiring': wiring, 'host': host, 'dev': [mx.nd.array(r) for r in host]}
        self.warmup = [make()]
        self.batches = [make() for _ in range(n_batches)]
        self.note = '%d sources, then %d layers of %d calls each averaging two random calls ' \
                    'of the layer before, new wiring every minibatch, hidden %d' % (
                        width, layers, width, SYN_HIDDEN)

    def nodes(self, batch):
        return self.width * (self.layers + 1)

    def _forward(self, src, block, rows, batch):
        values = [src(r) for r in rows]
        for layer in batch['wiring']:
            values = [block([values[a], values[b]]) for a, b in layer]
        return values


def load_sick(args):
    """Shuffled SICK test pairs, vocab size and embedding matrix: the same
    data, order and embeddings as benchmarks/bench_treelstm.py."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_treelstm import load_data
    folder, items, _, vocab_size, embedding = load_data(args)
    return folder, items, vocab_size, embedding


def build_workloads(mx, dyb, args, cfg):
    import numpy as np
    folder, items, vocab_size, embedding = load_sick(args)
    print('SICK: %s, %d test pairs, vocabulary %d' % (folder, len(items), vocab_size),
          flush=True)
    model = TreeLSTMModel(mx, dyb, vocab_size, embedding, args.seed)
    rng = np.random.RandomState(args.seed + 10)
    # disjoint pools: the repeated minibatch, warm-up pairs, measured pairs
    size = cfg['repeat_size']
    same, warm_pool, pool = items[-size:], items[-size - 500:-size], items[:-size - 500]
    workloads = []
    for size in cfg['sick_sizes']:
        reps = max(cfg['repeats'], cfg['pairs_per_size'] // size)
        # a new random minibatch per repeat (never the same pairs twice in B > 1)
        batches = [[pool[i] for i in rng.choice(len(pool), size, replace=False)]
                   for _ in range(reps)]
        w = SickWorkload('sick B=%d' % size, model, size, batches,
                         [warm_pool[:min(size, 64)]])
        w.note = ('Tree-LSTM on SICK test, %d pairs per minibatch, a new random minibatch '
                  'per repeat (%d repeats)' % (size, reps))
        workloads.append(w)
    size = cfg['repeat_size']
    # one minibatch again and again: its runs differ only by the machine's
    # noise, which swung single paired ratios of auto and cached running the
    # same compiled plan from 0.73x to 1.33x.  Their median over 7 repeats
    # measured 1.02-1.14x in three runs (flagged twice); over 15, 15 and 41
    # repeats 1.00x, 1.07x and 1.02x.  Each repeat costs ~0.25 s
    reps = max(cfg['repeats'], cfg['same_repeats'])
    w = SickWorkload('sick-repeat B=%d' % size, model, size, [same] * reps,
                     [same] * 3)
    w.kind = 'sick-repeat'
    w.note = 'the same %d SICK pairs every minibatch (3 warm-up runs prime caches)' % size
    workloads.append(w)
    # synthetic graphs take 5-40 ms: more repeats keep the machine's noise
    # (runs of one plan ranged 3.4-9.3 ms on the bushy graphs) out of the
    # comparison, at a few seconds' cost
    reps = max(cfg['repeats'], cfg['synthetic_repeats'])
    n_chains, max_len = cfg['chains']
    # synthetic: a new random graph per repeat (all strategies run the same one)
    workloads.append(ChainsWorkload(mx, dyb, n_chains, max_len, args.seed, n_batches=reps))
    workloads.append(BushyWorkload(mx, dyb, cfg['bushy_trees'], args.seed, n_batches=reps))
    workloads.append(DagWorkload(mx, dyb, cfg['dag_nodes'], args.seed, n_batches=reps))
    # where little or nothing batches: auto must not cost more than it saves
    low, high = cfg['long_chain']
    workloads.append(ChainsWorkload(mx, dyb, 1, high, args.seed, head_layers=0, n_batches=reps,
                                    min_len=low, name='long chain'))
    workloads.append(ReadEachWorkload(mx, dyb, cfg['read_each'], args.seed, n_batches=reps))
    width, layers = cfg['layered_dag']
    workloads.append(LayeredDagWorkload(mx, dyb, width, layers, args.seed, n_batches=reps))
    workloads.append(RepeatedSmallWorkload(mx, dyb, cfg['repeated_small'], args.seed,
                                           n_batches=reps))
    return workloads, model, warm_pool


def check_all_padding(dblocks):
    """Build every padded signature a plan could ask for among the traced
    signatures of each family (the numeric padding check runs once per pair,
    inside ``plan()``, the first time a group mixes the two)."""
    checked = 0
    for dblock in dblocks:
        if not dblock.pad_lists:
            continue
        families = {}
        for sig in dblock.signatures():
            if sig.batch_safe:
                families.setdefault(sig.group_key, []).append(sig)
        for sigs in families.values():
            for a in sigs:
                for b in sigs:
                    if a is not b:
                        dblock.padded_signature([a, b])
                        checked += 1
    return checked


def warm_up_sick(dyb, model, warm_pool, cfg):
    """Pay the one-time costs before measuring (steady state): trace every
    signature (pairs covering every child count), compile the step programs
    of many group shapes, and check every padded signature pair of each
    family.  Otherwise whichever strategy first meets a new arity mix pays a
    CachedOp build or a numeric padding check (inside ``plan()``: it shows as
    analysis time)."""
    import numpy as np
    from bench_treelstm import covering_pairs, tree_counts
    from gluon_dynbatch.plan import CachedPlan
    covering = covering_pairs(warm_pool)
    seen = tree_counts(covering)[3]
    rng = np.random.RandomState(123)
    batches = [covering]
    for size, count in cfg['warm_batches']:
        batches += [[warm_pool[i] for i in rng.choice(len(warm_pool), size, replace=False)]
                    for _ in range(count)]
    for strategy in ('depth', 'agenda', CachedPlan(), 'auto'):
        for batch in batches:
            model.batched(dyb.STRATEGIES.get(strategy, strategy)
                          if isinstance(strategy, str) else strategy, batch)
    model.plain(covering)
    checked = check_all_padding([model.dnode])
    return {'covering_pairs': len(covering), 'arities': sorted(seen),
            'warm_minibatches': len(batches), 'padded_pairs_checked': checked}


# ==========================================================================
# Measuring
# ==========================================================================

def median(values):
    return float(statistics.median(values)) if values else None


def measure(dyb, workload, cfg, tol):
    """Warm up, then run every strategy on every measured minibatch (the
    unbatched ones first, then an untimed depth run, then the batched ones,
    each group in a new seeded order); return the per-strategy summary and the equivalence check."""
    from gluon_dynbatch.plan import CachedPlan
    auto = dyb.STRATEGIES['auto']
    cached = CachedPlan()
    strategies = {name: dyb.STRATEGIES[name] for name in ('per-sample', 'depth', 'agenda')}
    strategies['cached'] = cached
    strategies['auto'] = auto
    sizes = [workload.nodes(b) for b in workload.batches]
    big = max(sizes) > cfg['cap']
    order = [PLAIN] + list(strategies)
    skipped = {}
    if big:
        for name in (PLAIN, 'per-sample'):
            order.remove(name)
            skipped[name] = 'graph of %d nodes > cap %d (about 0.1-0.3 ms per node)' % (
                max(sizes), cfg['cap'])
    model_before = auto.model.to_dict()

    def one(name, batch):
        strategy = PLAIN if name == PLAIN else strategies[name]
        gc.collect()
        dyb.reset_stats()
        start = time.perf_counter()
        out = workload.run(strategy, batch)
        total = (time.perf_counter() - start) * 1e3
        st = dyb.stats()
        return out, total, st

    for batch in workload.warmup:
        for name in order:
            one(name, batch)
    check_all_padding(workload.dblocks)

    samples = {name: [] for name in order}
    shuffle = random.Random(len(workload.batches))
    reference = PLAIN if PLAIN in order else 'depth'
    diffs = {name: 0.0 for name in order if name != reference}
    unbatched = [name for name in order if name in (PLAIN, 'per-sample')]
    batched = [name for name in order if name not in unbatched]

    def timed(name, batch, outs):
        out, total, st = one(name, batch)
        outs[name] = out
        last = st['last']
        # nodes: the calls that ran; calls: also those that reused an
        # earlier call's results (equal host arguments, merge_repeats)
        row = {'total_ms': total, 'nodes': st['nodes'], 'steps': st['steps'],
               'calls': st['nodes'] + st['repeated_calls'],
               'flushes': st['flushes'], 'record_ms': st['record_ms'],
               'analyse_ms': st['analyse_ms'], 'run_ms': st['run_ms']}
        if name == 'auto':
            row['choice'] = last.get('choice')
            row['plan'] = last.get('strategy')
            row['predicted_ms'] = last.get('predicted_ms')
            row['predictions_ms'] = last.get('predictions_ms')
        elif name == 'cached':
            row['plan'] = last.get('strategy')
        samples[name].append(row)

    for batch in workload.batches:
        outs = {}
        for name in shuffle.sample(unbatched, len(unbatched)):
            timed(name, batch, outs)
        # untimed, so that every timed batched run follows a batched run of
        # the same minibatch (see the module's docstring)
        workload.run(dyb.STRATEGIES['depth'], batch)
        for name in shuffle.sample(batched, len(batched)):
            timed(name, batch, outs)
        ref = outs[reference]
        for name, out in outs.items():
            if name == reference:
                continue
            if out.shape != ref.shape:
                diffs[name] = float('inf')
            else:
                diffs[name] = max(diffs[name], float(abs(out - ref).max()))

    summary = {}
    for name, rows in samples.items():
        cell = {key: median([row[key] for row in rows])
                for key in ('total_ms', 'record_ms', 'analyse_ms', 'run_ms', 'steps',
                            'nodes', 'calls')}
        cell['other_ms'] = cell['total_ms'] - cell['record_ms'] - cell['analyse_ms'] \
            - cell['run_ms']
        cell['total_ms_all'] = [round(row['total_ms'], 3) for row in rows]
        if name == PLAIN:
            for key in ('record_ms', 'analyse_ms', 'run_ms', 'other_ms'):
                cell[key] = None
            cell['steps'] = None
            cell['nodes'] = cell['calls'] = median(sizes)
            cell['note'] = 'plain imperative Gluon calls outside any scope'
        if name in ('auto', 'cached'):
            plans = {}
            for row in rows:
                plans[row['plan']] = plans.get(row['plan'], 0) + 1
            cell['plans'] = plans
        if name == 'auto':
            choices = {}
            for row in rows:
                choices[row['choice']] = choices.get(row['choice'], 0) + 1
            cell['choices'] = choices
            preds = {}
            for row in rows:
                for k, v in (row['predictions_ms'] or {}).items():
                    preds.setdefault(k, []).append(v)
            cell['predictions_ms'] = {k: median(v) for k, v in preds.items()}
            # tiny flushes are planned by depth without a prediction (None)
            cell['predicted_ms'] = median([row['predicted_ms'] for row in rows
                                           if row['predicted_ms'] is not None])
        summary[name] = cell
    for name, why in skipped.items():
        summary[name] = {'skipped': why}
    equivalence = {'reference': reference, 'tolerance': tol,
                   'max_abs_diff': diffs,
                   'passed': all(d <= tol for d in diffs.values())}
    return {'name': workload.name, 'kind': workload.kind, 'note': workload.note,
            'nodes': median(sizes), 'repeats': len(workload.batches),
            'strategies': summary, 'equivalence': equivalence,
            'cost_model_before': model_before, 'cost_model_after': auto.model.to_dict()}


def analyse_results(results):
    """auto / best fixed per workload, flags, and the cost model's errors."""
    flags = []
    for res in results:
        cells = res['strategies']
        fixed = {n: cells[n]['total_ms'] for n in FIXED if 'total_ms' in cells.get(n, {})}
        best = min(fixed, key=fixed.get)
        auto = cells['auto']['total_ms']
        res['best_fixed'] = best
        # paired: each repeat runs every strategy on the same graph, so the
        # median of per-repeat ratios cancels what varies between graphs
        auto_all, best_all = cells['auto'].get('total_ms_all'), cells[best].get('total_ms_all')
        if auto_all and best_all and len(auto_all) == len(best_all):
            res['auto_over_best'] = statistics.median(a / b for a, b in zip(auto_all, best_all))
        else:
            res['auto_over_best'] = auto / fixed[best]
        res['auto_slow'] = res['auto_over_best'] > AUTO_SLACK
        if res['auto_slow']:
            flags.append('%s: auto %.2f ms is %.0f%% slower than the best fixed strategy '
                         '(%s, %.2f ms); auto chose %s'
                         % (res['name'], auto, 100 * (res['auto_over_best'] - 1), best,
                            fixed[best], cells['auto'].get('choices')))
        if PLAIN in cells and 'total_ms' in cells[PLAIN]:
            res['auto_over_plain'] = auto / cells[PLAIN]['total_ms']
        # cost model: predicted (analysis + run) vs measured, per strategy
        preds = cells['auto'].get('predictions_ms') or {}
        res['cost_model_check'] = {
            n: {'predicted_ms': preds[n],
                'measured_ms': cells[n]['analyse_ms'] + cells[n]['run_ms']}
            for n in preds if n in cells and cells[n].get('analyse_ms') is not None}
        reused = [kind for kind in cells.get('cached', {}).get('plans', {})
                  if not kind.startswith('cached-miss')]
        # only where a plan was reused: a miss plans afresh (the non-repeating
        # SICK minibatches), and its share is a fixed strategy's, not the target's
        if 'total_ms' in cells.get('cached', {}) and res['kind'].startswith('sick') \
                and res['name'].endswith('B=256') and reused:
            c = cells['cached']
            frac = (c['record_ms'] + c['analyse_ms']) / c['total_ms']
            res['cached_overhead_frac'] = frac
            if frac > OVERHEAD_LIMIT:
                flags.append('%s: with the cached plan (%s), record + analysis = %.1f + %.1f ms '
                             '= %.1f%% of the %.1f ms step (> %.0f%%)'
                             % (res['name'], ', '.join('%s x%d' % kv for kv in
                                                       sorted(c.get('plans', {}).items())),
                                c['record_ms'], c['analyse_ms'], 100 * frac, c['total_ms'],
                                100 * OVERHEAD_LIMIT))
    return flags


def cached_overhead(mx, dyb, model, batch, repeats):
    """Record + analysis with a cached plan on the repeated SICK minibatch,
    as a share of an inference step and of a training step (forward,
    backward, ``'fusedadagrad'`` step), measured two ways.

    ``record_ms`` is recording's time by its own clock: the time spent in
    the recorder's calls.  ``record_wall_ms`` is what the scope adds to the
    user's loop in wall time: the scope from its opening through its exit,
    less its flush's planning, compiling and running (``body_ms``: the
    user's loop, recording, the flush's taking of its calls and
    bookkeeping), less the same per-sample recursion with the blocks
    replaced by Python functions that return at once (what the user's own
    loop costs, with no library in it: ``user_loop_ms``), timed right
    before or right after the step in turn, with the cyclic collector
    paused as in a scope.  The wall cost is the larger: it also holds the
    user's loop handling the distinct lazy values the calls return, and
    reading memory that the recorded calls push out of the caches, which
    no clock inside the recorder sees.
    """
    import numpy as np
    from gluon_dynbatch.plan import CachedPlan
    cached = CachedPlan()
    params = model.node.collect_params()
    params.update(model.head.collect_params())
    trainer = mx.gluon.Trainer(params, 'fusedadagrad', {'learning_rate': 0.05})
    weights = _to_device(mx, np.random.RandomState(7).dirichlet(
        np.ones(CLASSES), size=len(batch)).astype(np.float32))

    def infer(scope=None):
        model.predict(cached, batch, scope).asnumpy()

    def train(scope=None):
        with mx.autograd.record():
            loss = -(model.predict(cached, batch, scope) * weights).sum()
        loss.backward()
        trainer.step(len(batch))
        mx.nd.waitall()

    def user_loop():
        saved = model.dnode, model.dhead
        model.dnode, model.dhead = (lambda *_: (0, 0)), (lambda *_: 0)
        gc.disable()
        try:
            start = time.perf_counter()
            model.user_loop(batch)
            return time.perf_counter() - start
        finally:
            gc.enable()
            model.dnode, model.dhead = saved

    out = {'pairs': len(batch), 'repeats': repeats}
    for name, step in (('infer', infer), ('train', train)):
        for _ in range(3):
            step()
        rows = []
        for rep in range(repeats):
            gc.collect()
            loop = user_loop() * 1e3 if rep % 2 else None
            dyb.reset_stats()
            scope = []
            start = time.perf_counter()
            step(scope)
            total = (time.perf_counter() - start) * 1e3
            st = dyb.stats()
            body = scope[0] * 1e3 - (st['analyse_ms'] + st['compile_ms'] + st['run_ms'])
            if loop is None:
                loop = user_loop() * 1e3
            rows.append((st['record_ms'], st['analyse_ms'], total, body, loop))
        record, analyse, total, body, loop = (median(col) for col in zip(*rows))
        # repeat by repeat: drift between repeats cancels in each difference
        wall = median([b - u for _, _, _, b, u in rows])
        out[name] = {'record_ms': record, 'analyse_ms': analyse, 'total_ms': total,
                     'frac': (record + analyse) / total,
                     'body_ms': body, 'user_loop_ms': loop, 'record_wall_ms': wall,
                     'frac_wall': (wall + analyse) / total,
                     'user_loop_frac': loop / total,
                     'plans': dyb.stats()['last'].get('strategy')}
    return out


def print_cached_overhead(res):
    print('With a cached plan, SICK B=%d repeated (median of %d): record + analysis, by the '
          "recorder's clock and in wall time (what the scope adds to the user's loop)"
          % (res['pairs'], res['repeats']))
    for name in ('infer', 'train'):
        c = res[name]
        print('  %-6s %5.2f + %4.2f ms of a %6.1f ms step = %4.1f%%; wall %5.2f + %4.2f ms = '
              '%4.1f%%  (the user\'s loop alone, functions for blocks: %.2f ms = %.1f%%)'
              % (name, c['record_ms'], c['analyse_ms'], c['total_ms'], 100 * c['frac'],
                 c['record_wall_ms'], c['analyse_ms'], 100 * c['frac_wall'],
                 c['user_loop_ms'], 100 * c['user_loop_frac']))


# ==========================================================================
# Report
# ==========================================================================

def _fmt(v, width=8, prec=2):
    if v is None:
        return '-'.rjust(width)
    return ('%.*f' % (prec, v)).rjust(width)


def print_tables(results, flags, quick=False):
    cols = [PLAIN] + list(FIXED) + ['auto']
    print()
    print('Total wall time per minibatch, ms (median); auto/best = median over repeats of auto '
          'over the best (by median) of '
          '%s' % ', '.join(FIXED))
    head = '%-20s %6s ' % ('workload', 'nodes') + ' '.join(c.rjust(10) for c in cols) \
        + '  %-10s %9s  %s' % ('best', 'auto/best', 'auto chose')
    print(head)
    print('-' * len(head))
    for res in results:
        cells = res['strategies']
        line = '%-20s %6d ' % (res['name'], res['nodes'])
        line += ' '.join(_fmt(cells[c].get('total_ms'), 10) for c in cols)
        choices = ','.join('%s:%d' % kv for kv in sorted(cells['auto']['choices'].items()))
        line += '  %-10s %8.2f%s  %s' % (res['best_fixed'], res['auto_over_best'],
                                        '!' if res['auto_slow'] else ' ', choices)
        print(line)
    print('(! = auto more than %d%% slower than the best fixed strategy; - = not run, see JSON)'
          % round(100 * (AUTO_SLACK - 1)))
    print()
    print('Breakdown, ms (median): record / analyse / run / steps')
    head = '%-20s ' % 'workload' + ' '.join(c.center(27) for c in cols[1:])
    print(head)
    print('-' * len(head))
    for res in results:
        cells = res['strategies']
        parts = []
        for c in cols[1:]:
            cell = cells[c]
            if 'total_ms' not in cell:
                parts.append('-'.center(27))
            else:
                parts.append('%6.1f/%6.2f/%6.1f/%5d' % (cell['record_ms'], cell['analyse_ms'],
                                                        cell['run_ms'], cell['steps']))
        print('%-20s ' % res['name'] + ' '.join(parts))
    print()
    print('Cost model: auto\'s predicted analysis+run ms vs measured (fixed strategy)')
    for res in results:
        check = res['cost_model_check']
        print('%-20s ' % res['name'] + '  '.join(
            '%s %.1f/%.1f' % (n, v['predicted_ms'], v['measured_ms'])
            for n, v in sorted(check.items())))
    print()
    for res in results:
        eq = res['equivalence']
        worst = max(eq['max_abs_diff'].values()) if eq['max_abs_diff'] else 0.0
        print('outputs %-20s vs %-6s max |diff| %.2g  %s' % (
            res['name'], eq['reference'], worst, 'OK' if eq['passed'] else 'MISMATCH'))
    print()
    if flags:
        # a smoke run's few repeats cannot tell strategies apart (CI checks
        # that it runs, never its speed)
        print('FLAGS:%s' % (' (a --quick run: too few repeats to judge speed by)'
                            if quick else ''))
        for f in flags:
            print('  - ' + f)
    else:
        print('FLAGS: none')


COLORS = {PLAIN: '#7f7f7f', 'per-sample': '#d62728', 'depth': '#1f77b4', 'agenda': '#2ca02c',
          'cached': '#9467bd', 'auto': '#ff7f0e'}
MARKERS = {PLAIN: 'x', 'per-sample': 'v', 'depth': 'o', 'agenda': 's', 'cached': 'D',
           'auto': '*'}


def plot(results, path, title):
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(2, 3, figsize=(17, 10))
    names = [PLAIN] + list(FIXED) + ['auto']
    sick = [r for r in results if r['kind'] == 'sick']

    # (a) Tree-LSTM: ms per pair vs minibatch
    ax = axes[0, 0]
    for n in names:
        pts = [(int(r['name'].split('=')[1]), r['strategies'][n]['total_ms']
                / int(r['name'].split('=')[1])) for r in sick if 'total_ms' in r['strategies'][n]]
        if pts:
            xs, ys = zip(*pts)
            ax.plot(xs, ys, marker=MARKERS[n], color=COLORS[n], label=n,
                    lw=2.5 if n == 'auto' else 1.4, ms=9 if n == 'auto' else 6,
                    ls='--' if n == PLAIN else '-')
    ax.set_xscale('log')
    ax.set_yscale('log')
    ax.set_xlabel('minibatch (pairs)')
    ax.set_ylabel('wall ms per pair (whole minibatch, median)')
    ax.set_title('(a) Tree-LSTM on SICK: time per pair')
    ax.legend(fontsize=8)
    ax.grid(True, which='both', alpha=0.3)

    # (b) analysis ms vs graph size; (c) batched calls vs graph size
    for ax, key, label, letter in ((axes[0, 1], 'analyse_ms', 'analysis ms per flush', 'b'),
                                   (axes[0, 2], 'steps', 'batched calls (steps)', 'c')):
        for n in names[1:]:
            pts = sorted((r['nodes'], r['strategies'][n][key]) for r in results
                         if 'total_ms' in r['strategies'][n] and r['kind'] == 'sick')
            other = [(r['nodes'], r['strategies'][n][key]) for r in results
                     if 'total_ms' in r['strategies'][n] and r['kind'] != 'sick']
            if pts:
                xs, ys = zip(*pts)
                ax.plot(xs, [max(y, 1e-3) for y in ys], marker=MARKERS[n], color=COLORS[n],
                        label=n, lw=2.5 if n == 'auto' else 1.4, ms=9 if n == 'auto' else 6)
            if other:
                xs, ys = zip(*other)
                ax.scatter(xs, [max(y, 1e-3) for y in ys], marker=MARKERS[n],
                           facecolors='none', edgecolors=COLORS[n], s=70)
        ax.set_xscale('log')
        ax.set_yscale('log')
        ax.set_xlabel('graph size (recorded calls)')
        ax.set_ylabel(label)
        ax.set_title('(%s) %s vs graph size\n(lines: SICK fresh minibatches; '
                     'open marks: repeat + synthetic)' % (letter, label), fontsize=10)
        ax.grid(True, which='both', alpha=0.3)
        ax.legend(fontsize=8)

    # (d) synthetic + repeated: total relative to best fixed
    ax = axes[1, 0]
    others = [r for r in results if r['kind'] != 'sick']
    width = 0.8 / len(names)
    for i, n in enumerate(names):
        xs, ys, labels = [], [], []
        for j, r in enumerate(others):
            cell = r['strategies'][n]
            if 'total_ms' in cell:
                best = r['strategies'][r['best_fixed']]['total_ms']
                xs.append(j + (i - len(names) / 2 + 0.5) * width)
                ys.append(cell['total_ms'] / best)
                labels.append(cell['total_ms'])
        ax.bar(xs, ys, width, color=COLORS[n], label=n,
                      edgecolor='k' if n == 'auto' else None)
        for x, y, ms in zip(xs, ys, labels):
            ax.text(x, min(y, 3.9) + 0.03, '%.0f' % ms if ms >= 10 else '%.1f' % ms,
                    ha='center', va='bottom', fontsize=6.5, rotation=90)
    ax.axhline(1.0, color='k', lw=0.8)
    ax.axhline(AUTO_SLACK, color=COLORS['auto'], lw=0.8, ls=':')
    ax.set_ylim(0, 4.3)
    ax.set_xticks(range(len(others)))
    ax.set_xticklabels(['%s\n(%d calls)' % (r['name'].replace(' ', '\n', 1)
                                              if len(r['name']) > 10 else r['name'], r['nodes'])
                        for r in others], fontsize=7)
    ax.set_ylabel('wall time / best fixed strategy (label: ms)')
    ax.set_title('(d) synthetic and repeated-structure workloads')
    ax.legend(fontsize=7, ncol=1, loc='upper left', framealpha=0.9)

    # (e) breakdown at SICK B=256 (fresh and repeated) or the largest SICK
    ax = axes[1, 1]
    pick = [r for r in results if r['kind'].startswith('sick') and r['name'].endswith('B=256')]
    if not pick:
        pick = [max(sick, key=lambda r: r['nodes'])] + [r for r in results
                                                        if r['kind'] == 'sick-repeat']
    labels, parts = [], {'record': [], 'analyse': [], 'run': [], 'other': []}
    for r in pick:
        for n in names[2:]:
            cell = r['strategies'][n]
            if 'total_ms' not in cell:
                continue
            labels.append('%s\n%s' % (n, 'repeat' if r['kind'] == 'sick-repeat' else 'fresh'))
            parts['record'].append(cell['record_ms'])
            parts['analyse'].append(cell['analyse_ms'])
            parts['run'].append(cell['run_ms'])
            parts['other'].append(max(cell['other_ms'], 0.0))
    bottom = np.zeros(len(labels))
    for part, color in (('record', '#bcbd22'), ('analyse', '#e377c2'), ('run', '#17becf'),
                        ('other', '#c7c7c7')):
        ax.bar(range(len(labels)), parts[part], bottom=bottom, color=color, label=part)
        bottom += np.array(parts[part])
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels(labels, fontsize=7)
    ax.set_ylabel('ms per minibatch')
    ax.set_title('(e) where the time goes: %s' % ', '.join(r['name'] for r in pick),
                 fontsize=10)
    ax.legend(fontsize=8)

    # (f) cost model: predicted vs measured analysis + run
    ax = axes[1, 2]
    lo, hi = float('inf'), 0.0
    for n in FIXED:
        pts = [(r['cost_model_check'][n]['measured_ms'], r['cost_model_check'][n]['predicted_ms'])
               for r in results if n in r['cost_model_check']]
        if pts:
            xs, ys = zip(*pts)
            ax.scatter(xs, ys, marker=MARKERS[n], color=COLORS[n], label=n, s=40)
            lo, hi = min(lo, min(xs), min(ys)), max(hi, max(xs), max(ys))
    if hi > 0:
        lo = max(lo, 1e-2)
        ax.plot([lo, hi], [lo, hi], 'k-', lw=0.8, label='predicted = measured')
    ax.set_xscale('log')
    ax.set_yscale('log')
    ax.set_xlabel('measured analyse + run ms (strategy pinned)')
    ax.set_ylabel("auto's predicted ms for that strategy")
    ax.set_title('(f) cost model: prediction vs measurement, all workloads', fontsize=10)
    ax.grid(True, which='both', alpha=0.3)
    ax.legend(fontsize=8)

    fig.suptitle(title, fontsize=13)
    fig.tight_layout(rect=(0, 0, 1, 0.96))
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ==========================================================================
# Main
# ==========================================================================

def main(argv=None):
    args = build_parser().parse_args(argv)
    if args.out is None:
        args.out = QUICK_OUT if args.quick else DEFAULT_OUT
    configure_env()
    tic = time.perf_counter()
    import mxnet as mx
    import gluon_dynbatch as dyb

    cfg = settings(args)
    load_start = os.getloadavg()
    print('load average at start: %.2f %.2f %.2f' % load_start, flush=True)
    workloads, model, warm_pool = build_workloads(mx, dyb, args, cfg)
    auto = dyb.STRATEGIES['auto']
    model_start = auto.model.to_dict()   # calibrates on first use
    print('cost model after calibration: %r' % auto.model, flush=True)
    t0 = time.perf_counter()
    warm = warm_up_sick(dyb, model, warm_pool, cfg)
    print('SICK warm-up: %s (%.1f s); cost model now %r'
          % (warm, time.perf_counter() - t0, auto.model), flush=True)
    model_warm = auto.model.to_dict()
    # everything built so far lives to the end: move it out of the collector's
    # reach so that the gc.collect() before each timed run stays cheap
    gc.collect()
    gc.freeze()

    results = []
    for w in workloads:
        t0 = time.perf_counter()
        res = measure(dyb, w, cfg, args.tol)
        res['seconds'] = time.perf_counter() - t0
        results.append(res)
        cells = res['strategies']
        print('%-20s %6d nodes  %s  (%.1f s)' % (
            w.name, res['nodes'], '  '.join('%s %.1f' % (n, c['total_ms'])
                                           for n, c in cells.items() if 'total_ms' in c),
            res['seconds']), flush=True)

    flags = analyse_results(results)
    print_tables(results, flags, args.quick)
    repeated = next(w for w in workloads if w.kind == 'sick-repeat')
    overhead = cached_overhead(mx, dyb, model, repeated.batches[0], len(repeated.batches))
    print()
    print_cached_overhead(overhead)
    failures = ['%s: %s differs from %s by %.3g (> %g)' % (r['name'], n, r['equivalence']
                                                           ['reference'], d, args.tol)
                for r in results for n, d in r['equivalence']['max_abs_diff'].items()
                if not d <= args.tol]

    out = {
        'config': {
            'quick': args.quick, 'settings': cfg, 'seed': args.seed,
            'MXNET_ENGINE_TYPE': os.environ.get('MXNET_ENGINE_TYPE'),
            'OMP_NUM_THREADS': os.environ.get('OMP_NUM_THREADS'),
            'mxnet': mx.__version__, 'python': platform.python_version(),
            'platform': platform.platform(), 'cpu_count': os.cpu_count(),
            'load_average_start': load_start, 'load_average_end': os.getloadavg(),
        },
        'strategies': [PLAIN] + list(dyb.STRATEGIES),
        'cost_model_calibrated': model_start,
        'sick_warm_up': warm,
        'cost_model_after_warm_up': model_warm,
        'cost_model_final': auto.model.to_dict(),
        'auto_choices_total': dict(auto.choices),
        'workloads': results,
        'cached_overhead': overhead,
        'flags': flags,
        'equivalence': {'passed': not failures, 'failures': failures, 'tolerance': args.tol},
        'acceptance': {
            'auto_vs_plain_at_B1': next((r.get('auto_over_plain') for r in results
                                         if r['name'] == 'sick B=1'), None),
            'auto_within_10pct_of_plain_at_B1': next(
                (r.get('auto_over_plain', 9) <= AUTO_SLACK for r in results
                 if r['name'] == 'sick B=1'), None),
        },
        'seconds': time.perf_counter() - tic,
    }
    os.makedirs(args.out, exist_ok=True)
    json_path = os.path.join(args.out, 'tradeoff.json')
    with open(json_path, 'w') as f:
        json.dump(out, f, indent=1, default=float)
    print('\nwrote %s' % json_path)
    if not args.no_plot:
        png = os.path.join(args.out, 'tradeoff.png')
        plot(results, png, 'gluon_dynbatch: analysis cost vs batching benefit per strategy '
             '(%s, %d cores, NaiveEngine, 1 thread, load average %.1f at start%s)'
             % (platform.machine(), os.cpu_count(), load_start[0],
                ', --quick' if args.quick else ''))
        print('wrote %s' % png)
        # only a run into the published folder replaces the docs' figure
        if not args.quick and not args.no_static_copy and \
                os.path.abspath(args.out) == os.path.abspath(DEFAULT_OUT):
            import shutil
            os.makedirs(os.path.dirname(STATIC_PNG), exist_ok=True)
            shutil.copyfile(png, STATIC_PNG)
            print('copied to %s' % STATIC_PNG)
    b1 = out['acceptance']['auto_vs_plain_at_B1']
    if b1 is not None:
        print('acceptance: auto / plain per-sample at B=1 = %.2f (%s)' % (
            b1, 'OK' if b1 <= AUTO_SLACK else 'FAIL: more than 10% slower'))
    print('total %.1f s' % out['seconds'])
    if failures:
        print('OUTPUT MISMATCH:\n  ' + '\n  '.join(failures), file=sys.stderr)
        return 1
    return 0


if __name__ == '__main__':
    sys.exit(main())
