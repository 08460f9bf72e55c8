"""Variable arity on SICK: per-arity groups vs zero-padded vs ragged lists.

Tree-LSTM nodes differ in their number of children.  Without ``pad_lists``
each arity is its own signature, so every depth runs one batched step per
arity present; with it (``TreeLSTMNode.dynbatch_pad_lists``) one step runs
all arities padded with zeros, and the planner splits a group by list length
only where the padding costs more than another step; or (the default) one
step runs all arities *ragged*, computing no padding element at all, where
that costs less than the best split.  This script measures the four variants
side by side (interleaved repeats, medians) for inference and
forward+backward at minibatch 25 and 256, and writes JSON.

    python benchmarks/bench_arity.py [--out benchmarks/results] [--repeats 3]
"""
import argparse
import json
import os
import sys
import time


def main():
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_treelstm import positive_int, seed_int, SEED_MAX   # (no MXNet import there)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('--out', default=os.path.join(os.path.dirname(__file__), 'results'),
                   help='folder for arity.json (default: benchmarks/results)')
    p.add_argument('--data', default=None,
                   help='SICK folder (else $GLUON_DYNBATCH_SICK, else ../shared/data/sick)')
    p.add_argument('--seed', type=seed_int, default=0,
                   help='data order and parameters (0 to %d)' % SEED_MAX)
    p.add_argument('--repeats', type=positive_int, default=3, help='timed repeats per variant')
    p.add_argument('--pairs', type=positive_int, default=1000,
                   help="pairs per timed repeat, at most the test split's (SICK: 4927)")
    args = p.parse_args()
    os.environ.setdefault('MXNET_ENGINE_TYPE', 'NaiveEngine')
    os.environ.setdefault('OMP_NUM_THREADS', '1')
    import mxnet as mx
    from mxnet import autograd
    import gluon_dynbatch as dyb
    from gluon_dynbatch.models import Similarity, TreeLSTMNode
    from gluon_dynbatch import plan
    from gluon_dynbatch.plan import PADDING_COST
    from bench_treelstm import load_data
    _, items, _, vocab_size, _ = load_data(args)
    if args.pairs > len(items):     # (the repeats would time empty minibatches)
        p.error('argument --pairs: %d is more than the %d pairs of the test split'
                % (args.pairs, len(items)))
    print('engine %s, OMP_NUM_THREADS %s' % (os.environ['MXNET_ENGINE_TYPE'],
                                             os.environ['OMP_NUM_THREADS']))

    def make(pad):
        mx.random.seed(args.seed)
        node = dyb.DynBatchBlock(TreeLSTMNode(vocab_size, 300, 150), pad_lists=pad)
        head = dyb.DynBatchBlock(Similarity(50, 5, in_units=150))
        node.initialize(mx.init.Xavier())
        head.initialize(mx.init.Xavier())
        return node, head

    # name -> (model, per-element padding cost (0 disables splitting), ragged)
    variants = {'per-arity groups': (make(False), None, False),
                'padded, no split': (make(True), 0.0, False),
                'padded + cost-split': (make(True), PADDING_COST['elem_us'], False),
                'ragged where cheaper': (make(True), PADDING_COST['elem_us'], True)}

    def run(model, batch, train):
        node, head = model

        def encode(tree, ids):
            children = [encode(c, ids) for c in tree.children]
            return node(ids[tree.idx:tree.idx + 1], [h for h, _ in children],
                        [c for _, c in children])
        with autograd.record() if train else autograd.pause():
            with dyb.batching('depth'):
                preds = [head(encode(a, ia)[0], encode(b, ib)[0]) for ia, a, ib, b in batch]
            out = dyb.concat_rows(preds)
            loss = out.sum()
        if train:
            loss.backward()
        out.asnumpy()

    def timed(name, batch_size, train):
        model, elem, plan.RAGGED = variants[name]
        if elem is not None:
            PADDING_COST['elem_us'] = elem
        start, done = time.perf_counter(), 0
        for i in range(0, args.pairs, batch_size):
            run(model, items[i:i + batch_size], train)
            done += len(items[i:i + batch_size])
        return done / (time.perf_counter() - start)

    results = []
    for train, batch_size in ((False, 25), (False, 256), (True, 25), (True, 256)):
        for name in variants:                       # warm-up: trace every arity
            timed(name, batch_size, train)
        samples = {name: [] for name in variants}
        for _ in range(args.repeats):
            for name in variants:
                samples[name].append(timed(name, batch_size, train))
        row = {'mode': 'train' if train else 'infer', 'batch_size': batch_size,
               'pairs_per_s': {k: sorted(v)[len(v) // 2] for k, v in samples.items()}}
        results.append(row)
        print('%-5s B=%-4d ' % (row['mode'], batch_size) + '  '.join(
            '%s %.0f' % kv for kv in row['pairs_per_s'].items()), flush=True)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, 'arity.json')
    with open(path, 'w') as f:
        json.dump({'settings': vars(args), 'results': results}, f, indent=1)
    print('wrote', path)


if __name__ == '__main__':
    main()
