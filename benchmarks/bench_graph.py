#!/usr/bin/env python
"""Message passing over graphs with typed edges (an R-GCN): per sample, by
hand, and gluon_dynbatch.

Each sample is a random graph of 4-24 nodes with 1-3 edges a node, each of
one of 4 types (seeded; no data set needed).  A node's state starts as the
embedding (64) of its label (50 labels), then two rounds update every node
at once: ``relu(W h + (sum over its incoming edges of U_type h_source) /
degree)``; the graph's result is ``tanh(V mean(h))`` (16).  Forms, one set
of weights:

========================  ===================================================
``per-sample``            the plain loop, eager Gluon: a call per edge (its
                          type's message block on the source's state), a
                          call per node and round (its state, 1/degree and
                          the list of its messages), a readout call per
                          graph
``hand-batched``          what an expert writes: a minibatch's graphs as one
                          graph, each type's sums as a CSR ``sparse.dot``
                          (source x target, ``transpose_a``, whose backward
                          stays sparse), then that type's GEMM; the
                          readout's means so too
``dynbatch``              the plain loop inside ``gluon_dynbatch.batching()``,
                          the node and readout blocks declaring ``pad_lists``
``dynbatch-typed-lists``  the plain loop, but a node block taking a list of
                          neighbour states per edge type (applying each
                          type's weights itself), under ``pad_lists``: a
                          signature per combination of four list lengths,
                          and a family per set of empty lists
========================  ===================================================

Checking is ``bench_cells.py``'s (results and gradients against
``per-sample``).  The ``dynbatch`` forms are then warmed up over the data
at each minibatch size (their padding checks, reported apart), and
measured as ``bench_cells.py`` measures (repeats that interleave the forms
on the same minibatches; a cell is the median graphs/s, a ratio the median
of the ratios within a repeat).  Writes ``graph.json`` and ``graph.md``.

::

    python benchmarks/bench_graph.py            # ~3 min on 2 cores
    python benchmarks/bench_graph.py --quick    # a smoke run
"""
import argparse
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import bench_cells  # noqa: E402  (no MXNet import at module level)
FORMS = ('per-sample', 'hand-batched', 'dynbatch', 'dynbatch-typed-lists')
SETTINGS = (('infer', 1), ('infer', 16), ('infer', 128), ('train', 16), ('train', 128))
QUICK_SETTINGS = (('infer', 4), ('train', 4))
TYPES, LABELS, UNITS, OUT, ROUNDS = 4, 50, 64, 16, 2
GRAPHS = 1000


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    return bench_cells.add_run_options(p, 'NaiveEngine', 'graph.json / graph.md',
                                       data=False).parse_args(argv)


def random_graphs(count, seed):
    """``count`` graphs ``(labels, edges)``: float32 (1,) label arrays and
    ``(source, target, type)`` edges."""
    import numpy as np
    rng = np.random.RandomState(seed)
    graphs = []
    for _ in range(count):
        n = rng.randint(4, 25)
        m = int(rng.randint(n, 3 * n + 1))
        edges = list(zip(rng.randint(0, n, m), rng.randint(0, n, m), rng.randint(0, TYPES, m)))
        graphs.append(([np.array([label], np.float32) for label in rng.randint(0, LABELS, n)],
                       edges))
    return graphs


class Model:
    """The blocks and the forms; imported after the environment is set."""

    def __init__(self, seed):
        import mxnet as mx
        import numpy as np
        from mxnet import gluon
        import gluon_dynbatch as dyb
        self.mx, self.np, self.dyb = mx, np, dyb

        class Node(gluon.HybridBlock):
            """A node's new state from its own, 1/degree (1, 1) and the list
            of its incoming messages (maybe empty): zero messages add
            nothing, so it declares ``pad_lists``."""
            dynbatch_pad_lists = True

            def __init__(self, **kwargs):
                super().__init__(**kwargs)
                with self.name_scope():
                    self.own = gluon.nn.Dense(UNITS, in_units=UNITS)

            def hybrid_forward(self, F, h, inverse_degree, messages):
                # pylint: disable=arguments-differ
                out = self.own(h)
                if messages:
                    total = F.add_n(*messages) if len(messages) > 1 else messages[0]
                    out = out + F.broadcast_mul(total, inverse_degree)
                return F.relu(out)

        class TypedNode(gluon.HybridBlock):
            """The same update from a list of neighbour states per edge type
            (any may be empty), each type's sum through its own weights
            (``typed``, the message blocks' layers)."""
            dynbatch_pad_lists = True

            def __init__(self, own, typed, **kwargs):
                super().__init__(**kwargs)
                with self.name_scope():
                    self.own = own
                    self.typed = typed

            def hybrid_forward(self, F, h, inverse_degree, *lists):
                # pylint: disable=arguments-differ
                messages = [dense(F.add_n(*hs) if len(hs) > 1 else hs[0])
                            for dense, hs in zip(self.typed, lists) if hs]
                return Node.hybrid_forward(self, F, h, inverse_degree, messages)

        class Readout(gluon.HybridBlock):
            """``tanh(V mean)`` of a graph's node states, given 1/n."""
            dynbatch_pad_lists = True

            def __init__(self, **kwargs):
                super().__init__(**kwargs)
                with self.name_scope():
                    self.out = gluon.nn.Dense(OUT, in_units=UNITS, activation='tanh')

            def hybrid_forward(self, F, inverse_count, hs):  # pylint: disable=arguments-differ
                return self.out(F.broadcast_mul(F.add_n(*hs), inverse_count))

        mx.random.seed(seed)
        self.embed, self.node, self.readout = gluon.nn.Embedding(LABELS, UNITS), Node(), \
            Readout()
        self.typed = gluon.nn.HybridSequential()
        for _ in range(TYPES):
            self.typed.add(gluon.nn.Dense(UNITS, in_units=UNITS, use_bias=False))
        self.blocks = (self.embed, self.typed, self.node, self.readout)
        for block in self.blocks:
            block.initialize(mx.init.Xavier())
        self.typed_node = TypedNode(self.node.own, self.typed)
        embed, node, readout = (dyb.DynBatchBlock(block)
                                for block in (self.embed, self.node, self.readout))
        typed = [dyb.DynBatchBlock(dense) for dense in self.typed]
        self.wrapped = (embed, typed, node, readout)
        self.wrapped_typed = (embed, dyb.DynBatchBlock(self.typed_node), readout)
        self.wrappers = [embed, node, readout, self.wrapped_typed[1]] + typed

    def run(self, form, graphs, deadline=None):  # pylint: disable=unused-argument
        """The (len(graphs), OUT) results of ``graphs``, and how many."""
        if form == 'hand-batched':
            return self.hand_batched(graphs), len(graphs)
        if form == 'per-sample':
            return self.mx.nd.concat(*self._loop(graphs, self.blocks), dim=0), len(graphs)
        with self.dyb.batching():
            outs = self._loop(graphs, self.wrapped) if form == 'dynbatch' else \
                self._typed_loop(graphs)
        return self.dyb.concat_rows(outs), len(graphs)

    def _incoming(self, labels, edges, host):
        """Per node, its incoming edges' ``(source, type)``, and
        1/degree as ``host`` makes arrays."""
        into = [[] for _ in labels]
        for source, target, kind in edges:
            into[target].append((source, kind))
        return into, [host(self.np.array([[1.0 / max(1, len(incoming))]], self.np.float32))
                      for incoming in into]

    def _loop(self, graphs, blocks):
        """The per-sample loop: each graph's result through ``blocks``
        (given host arrays as they are where wrapped, as NDArrays where
        Gluon's own)."""
        np = self.np
        embed, typed, node, readout = blocks
        host = self.mx.nd.array if blocks is self.blocks else (lambda array: array)
        outs = []
        for labels, edges in graphs:
            into, inverse_degree = self._incoming(labels, edges, host)
            h = [embed(host(label)) for label in labels]
            for _ in range(ROUNDS):
                h = [node(h[i], inverse_degree[i], [typed[kind](h[s]) for s, kind in into[i]])
                     for i in range(len(labels))]
            outs.append(readout(host(np.array([[1.0 / len(labels)]], np.float32)), h))
        return outs

    def _typed_loop(self, graphs):
        """The loop of ``dynbatch-typed-lists``: a list per edge type."""
        np = self.np
        embed, node, readout = self.wrapped_typed
        outs = []
        for labels, edges in graphs:
            into, inverse_degree = self._incoming(labels, edges, lambda array: array)
            h = [embed(label) for label in labels]
            for _ in range(ROUNDS):
                h = [node(h[i], inverse_degree[i], *[[h[s] for s, kind in into[i] if kind == r]
                                                     for r in range(TYPES)])
                     for i in range(len(labels))]
            outs.append(readout(np.array([[1.0 / len(labels)]], np.float32), h))
        return outs

    def hand_batched(self, graphs):
        """The minibatch as one graph of all its nodes: per edge type a
        source x target CSR matrix holding 1/degree of the target, summed
        with ``transpose_a`` (a sparse backward), and the readout's means
        by a node x graph one."""
        mx, np = self.mx, self.np
        labels, by_type, degree, members, at = [], [[] for _ in range(TYPES)], [], [], 0
        for number, (graph_labels, edges) in enumerate(graphs):
            n = len(graph_labels)
            labels += graph_labels
            counts = np.zeros(n)
            for source, target, kind in edges:
                by_type[kind].append((at + source, at + target))
                counts[target] += 1
            degree.append(np.maximum(counts, 1))
            members.append(np.full(n, number))
            at += n
        inverse_degree = 1.0 / np.concatenate(degree)

        def matrix(pairs, values, shape):
            """CSR of shape ``shape`` with ``values`` at ``pairs`` (rows sorted)."""
            pairs = np.array(pairs, np.int64).reshape(-1, 2)
            order = np.argsort(pairs[:, 0], kind='stable')
            rows, cols = pairs[order, 0], pairs[order, 1]
            indptr = np.searchsorted(rows, np.arange(shape[0] + 1))
            return mx.nd.sparse.csr_matrix((values[order].astype(np.float32), cols, indptr),
                                           shape=shape)
        sums = [matrix(pairs, inverse_degree[[t for _, t in pairs]], (at, at))
                for pairs in by_type if pairs]
        typed = [dense for dense, pairs in zip(self.typed, by_type) if pairs]
        nodes = np.concatenate(members)
        means = matrix(list(zip(range(at), nodes)), 1.0 / np.bincount(nodes)[nodes],
                       (at, len(graphs)))
        h = self.embed(mx.nd.array(np.concatenate(labels)))
        for _ in range(ROUNDS):
            messages = [dense(mx.nd.sparse.dot(m, h, transpose_a=True, forward_stype='default'))
                        for dense, m in zip(typed, sums)]
            h = mx.nd.relu(self.node.own(h) + mx.nd.add_n(*messages))
        return self.readout.out(mx.nd.sparse.dot(means, h, transpose_a=True,
                                                 forward_stype='default'))

    def grads(self, form, graphs, weights):
        """Results and the gradients of sum(weights * results)."""
        mx = self.mx
        with mx.autograd.record():
            out, _ = self.run(form, graphs)
            loss = (out * weights).sum()
        loss.backward()
        params = {}
        for block in self.blocks:
            params.update(block.collect_params())
        grads = {name: param.grad().asnumpy().copy() for name, param in params.items()}
        for param in params.values():
            param.zero_grad()
        return out.asnumpy(), grads


def warm_up(model, graphs, settings):
    """Run each ``dynbatch`` form over ``graphs`` (as the timed turns walk
    them) once per minibatch size of ``settings``: ``{form: [seconds,
    padding checks]}``.  Its calls pad lists to the longest of their step,
    and the first time a signature pads to another the block is checked
    (a padding check) and a program built, which would otherwise fall into
    the timed turns."""
    import time  # pylint: disable=import-outside-toplevel
    from gluon_dynbatch.block import padding_checks  # pylint: disable=import-outside-toplevel
    spent = {}
    for form in FORMS[2:]:
        start, checks = time.perf_counter(), padding_checks()[0]
        for batch in sorted({batch for _, batch in settings}):
            for first in range(0, len(graphs), batch):
                model.run(form, graphs[first:first + batch])[0].asnumpy()
        spent[form] = [round(time.perf_counter() - start, 1), padding_checks()[0] - checks]
        print('%s warmed up: %d padding checks, %.1f s' % (form, spent[form][1], spent[form][0]),
              flush=True)
    return spent


def table(results):
    """Markdown: graphs/s per form and setting, and the ratios."""
    settings = list(results)
    lines = ['', 'graphs/s', '', '| form | ' + ' | '.join(settings) + ' |',
             '|---|' + '---:|' * len(settings)]
    for form in FORMS:
        row = [('%.0f' % statistics.median(results[s][form])) if form in results[s] else '-'
               for s in settings]
        lines.append('| %s | %s |' % (form, ' | '.join(row)))
    for ours, other in (('dynbatch', 'per-sample'), ('dynbatch', 'hand-batched'),
                        ('dynbatch', 'dynbatch-typed-lists')):
        row = []
        for s in settings:
            if other not in results[s]:
                row.append('-')
                continue
            row.append('%.2fx' % statistics.median(
                a / b for a, b in zip(results[s][ours], results[s][other])))
        lines.append('| %s / %s | %s |' % (ours, other, ' | '.join(row)))
    return '\n'.join(lines) + '\n'


def main(argv=None):
    args = parse_args(argv)
    os.environ.setdefault('MXNET_STORAGE_FALLBACK_LOG_VERBOSE', '0')
    repeats, budget, config = bench_cells.set_up(args)
    settings = QUICK_SETTINGS if args.quick else SETTINGS
    graphs = random_graphs(200 if args.quick else GRAPHS, args.seed)
    model = Model(args.seed)
    bench_cells.check(model, graphs[:16], graphs[16:16 + (40 if args.quick else 150)],
                      args.tol, forms=FORMS, width=OUT)
    per_sample = {sig.reason for wrapper in model.wrappers for sig in wrapper.signatures()
                  if not sig.batch_safe}
    if per_sample:
        print('error: dynbatch runs per sample: %s' % '; '.join(sorted(per_sample)),
              file=sys.stderr)
        raise SystemExit(2)
    print('every form agrees with per-sample (tol %g); dynbatch batches' % args.tol,
          flush=True)
    if not args.quick:
        config['warm_up'] = warm_up(model, graphs, settings)
    results = bench_cells.measure(model, graphs, settings, repeats, budget, FORMS, per_unit=1)
    bench_cells.write(args, {'config': config, 'results': results}, 'graph', table(results))


if __name__ == '__main__':
    main()
