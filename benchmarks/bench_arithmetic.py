"""Arithmetic between block calls on SICK: child sums as lazy arithmetic
against child sums inside the block, and against the per-sample loop.

A recursive net over SICK's dependency trees, ``h = tanh(W [embed(token),
s])`` with ``s`` the sum of the children's ``h``, written two ways: the
sum outside the block (``total = total + child``, each ``+`` a recorded
call of one operator, see ``gluon_dynbatch.block.lazy_operator``) and the
sum inside it (the children as a list argument, ``F.add_n``, with
``pad_lists``: one step for every number of children).  The same
minibatches run in three forms, interleaved, after a check that they give
the same sentence vectors: the first written per sample without a scope,
and both under ``batching('auto')``.  Prints medians of pairs/s and writes
JSON to ``<out>/arithmetic.json``.

    python benchmarks/bench_arithmetic.py [--repeats 5] [--out benchmarks/results]
"""
import argparse
import json
import os
import sys
import time

FORMS = ('per-sample, sums outside the block', 'batched, sums as lazy arithmetic',
         'batched, sums inside the block')


def main():
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_treelstm import positive_int, seed_int, SEED_MAX   # (no MXNet import there)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('--out', default=os.path.join(os.path.dirname(__file__), 'results'),
                   help='folder for arithmetic.json (default: benchmarks/results)')
    p.add_argument('--data', default=None,
                   help='SICK folder (else $GLUON_DYNBATCH_SICK, else ../shared/data/sick)')
    p.add_argument('--seed', type=seed_int, default=0,
                   help='data order and parameters (0 to %d)' % SEED_MAX)
    p.add_argument('--repeats', type=positive_int, default=5, help='timed repeats per form')
    p.add_argument('--hidden', type=positive_int, default=150, help='hidden size')
    p.add_argument('--sizes', type=positive_int, nargs='+', default=[25, 256],
                   help='minibatch sizes (pairs), inference')
    args = p.parse_args()
    os.environ['MXNET_ENGINE_TYPE'] = 'NaiveEngine'
    os.environ['OMP_NUM_THREADS'] = '1'
    import mxnet as mx
    import numpy as np
    from mxnet import gluon
    from mxnet.gluon import nn
    import gluon_dynbatch as dyb
    from bench_treelstm import load_data
    _, items, _, vocab_size, _ = load_data(args)
    if max(args.sizes) > len(items):
        p.error('argument --sizes: %d is more than the %d pairs of the test split'
                % (max(args.sizes), len(items)))
    print('engine %s, OMP_NUM_THREADS %s, hidden %d' % (
        os.environ['MXNET_ENGINE_TYPE'], os.environ['OMP_NUM_THREADS'], args.hidden))

    class SumGiven(gluon.HybridBlock):
        """``tanh(W [embed(token), s])``, the children's sum ``s`` given."""

        def __init__(self):
            super().__init__(prefix='node_')
            with self.name_scope():
                self.embed = nn.Embedding(vocab_size, args.hidden)
                self.dense = nn.Dense(args.hidden, in_units=2 * args.hidden, flatten=False)

        def hybrid_forward(self, F, token, child_sum):  # pylint: disable=arguments-differ
            return F.tanh(self.dense(F.concat(self.embed(token), child_sum, dim=1)))

    class SumInside(SumGiven):
        """The same, the children given as a list (none for a leaf)."""

        def hybrid_forward(self, F, token, children):  # pylint: disable=arguments-differ
            embedded = self.embed(token)
            total = F.add_n(*children) if len(children) > 1 else \
                children[0] if children else embedded * 0
            return F.tanh(self.dense(F.concat(embedded, total, dim=1)))

    mx.random.seed(args.seed)
    given = dyb.DynBatchBlock(SumGiven())
    inside = dyb.DynBatchBlock(SumInside(), pad_lists=True)     # one step for every arity
    given.initialize(mx.init.Xavier())
    inside.initialize(mx.init.Xavier())
    for mine, theirs in zip(inside.collect_params().values(), given.collect_params().values()):
        mine.set_data(theirs.data())                # the same weights
    zero = mx.nd.zeros((1, args.hidden))

    def outside(tree, ids):
        total = zero
        for child in tree.children:
            total = total + outside(child, ids)
        return given(ids[tree.idx:tree.idx + 1], total)

    def in_block(tree, ids):
        return inside(ids[tree.idx:tree.idx + 1], [in_block(c, ids) for c in tree.children])

    def run(form, batch):
        encode = in_block if form == FORMS[2] else outside
        values = []
        if form == FORMS[0]:
            for ia, a, ib, b in batch:
                values += [encode(a, ia), encode(b, ib)]
            return mx.nd.concat(*values, dim=0).asnumpy()
        with dyb.batching('auto'):
            for ia, a, ib, b in batch:
                values += [encode(a, ia), encode(b, ib)]
            return dyb.concat_rows(values).asnumpy()

    check = [run(form, items[:8]) for form in FORMS]
    for form, vectors in zip(FORMS[1:], check[1:]):
        if not np.allclose(vectors, check[0], rtol=1e-4, atol=1e-5):
            sys.exit('%s disagrees with the per-sample form (largest difference %.3g): a bug'
                     % (form, np.abs(vectors - check[0]).max()))
    results = []
    for size in args.sizes:
        batches = [items[i * size:(i + 1) * size] for i in range(args.repeats + 1)]
        batches = [b if len(b) == size else items[:size] for b in batches]
        for form in FORMS:
            run(form, batches[0])                   # warm-up
        samples = {form: [] for form in FORMS}
        for batch in batches[1:]:
            for form in FORMS:
                start = time.perf_counter()
                run(form, batch)
                samples[form].append(size / (time.perf_counter() - start))
        row = {'mode': 'infer', 'batch_size': size,
               'pairs_per_s': {k: sorted(v)[len(v) // 2] for k, v in samples.items()}}
        results.append(row)
        rates = row['pairs_per_s']
        print('infer B=%-4d ' % size + '  '.join('%s %.0f' % kv for kv in rates.items())
              + '  (arithmetic / per-sample %.1fx, / inside %.2fx)'
              % (rates[FORMS[1]] / rates[FORMS[0]], rates[FORMS[1]] / rates[FORMS[2]]),
              flush=True)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, 'arithmetic.json')
    with open(path, 'w') as f:
        json.dump({'settings': vars(args), 'results': results}, f, indent=1)
    print('wrote', path)


if __name__ == '__main__':
    main()
