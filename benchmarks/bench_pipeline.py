"""Pipelined scopes on SICK: flushing every K calls against one flush per
minibatch, under MXNet's threaded engine.

Under the threaded engine operators run on the engine's worker thread, so a
scope that runs what it holds every K calls (``batching(flush_every=K)``)
lets the worker compute one part of a minibatch while Python records the
next; each flush batches fewer calls, so K trades overlap against batching.
This script runs the same minibatches (a different one per repeat, so
structures do not repeat; past the end of the split the pairs are shuffled
into new minibatches) with one flush per minibatch (twice: the spread
between the two identical forms is the harness's noise), with each K and
with the default (``flush_every='auto'``, the form ``auto``), in an order
shuffled every repeat (a rotated order made each form always follow the
same one, which moved identical forms by up to 25%), and prints medians and
ratios; JSON goes to ``<out>/pipeline.json``.

    python benchmarks/bench_pipeline.py [--repeats 25] [--out benchmarks/results]
"""
import argparse
import json
import os
import sys
import time

SETTINGS = (('infer', 256), ('infer', 512), ('infer', 1024), ('train', 256), ('train', 1024))


def parse_setting(text):
    """A ``--settings`` entry, ``'infer 256'`` or ``'train 1024'``, checked as
    the command line is read: a malformed one is a usage error before the
    data is loaded, not a traceback after."""
    parts = text.split()
    if len(parts) != 2 or parts[0] not in ('infer', 'train') or not parts[1].isdigit() \
            or int(parts[1]) < 1:
        raise argparse.ArgumentTypeError(
            "%r: write '<infer|train> <minibatch size>', e.g. 'infer 256'" % text)
    return '%s %d' % (parts[0], int(parts[1]))


def main():
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import bench_treelstm as bt         # (no MXNet import there)
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0].replace('\n', ' '))
    p.add_argument('--out', default=os.path.join(os.path.dirname(__file__), 'results'))
    p.add_argument('--data', default=None)
    p.add_argument('--seed', type=bt.seed_int, default=0, help='0 to %d' % bt.SEED_MAX)
    p.add_argument('--repeats', type=bt.positive_int, default=25,
                   help='minibatches per setting')
    p.add_argument('--every', type=bt.positive_int, nargs='+', default=[3072, 6144, 12288],
                   help='flush_every values (calls, at least 1) to compare with one flush per '
                        'minibatch')
    p.add_argument('--settings', nargs='+', type=parse_setting,
                   default=['%s %d' % s for s in SETTINGS],
                   help="'infer <minibatch size>' or 'train <minibatch size>'")
    p.add_argument('--engine', default='ThreadedEnginePerDevice', choices=bt.ENGINES)
    args = p.parse_args()
    os.environ['MXNET_ENGINE_TYPE'] = args.engine
    os.environ['OMP_NUM_THREADS'] = '1'
    import numpy as np
    import gluon_dynbatch as dyb
    from gluon_dynbatch.block import PIPELINE_CALLS
    print('engine %s, OMP_NUM_THREADS %s, %d minibatches per setting'
          % (os.environ['MXNET_ENGINE_TYPE'], os.environ['OMP_NUM_THREADS'], args.repeats),
          flush=True)
    _, items, targets, vocab_size, embedding = bt.load_data(args)
    largest = max(int(setting.split()[1]) for setting in args.settings)
    if largest > len(items):    # (its minibatches would hold fewer pairs than said)
        p.error('argument --settings: a minibatch of %d is more than the %d pairs of the test '
                'split' % (largest, len(items)))
    ctx = bt.Forms(vocab_size, embedding, args.seed, wanted=['dynbatch-auto'])

    class Pipelined(bt.DynBatchForm):
        # an `auto` of its own per form: with the shared one, the two
        # one-flush forms met each other's structures (every form runs the
        # same minibatch), which biased the comparison toward them (0.80x
        # for pipelining at inference 1,024, against 1.07-1.10x apart)
        def __init__(self, every):
            strategy = dyb.Auto()
            strategy.cached = dyb.CachedPlan()
            super().__init__(dyb, ctx.dnode, ctx.dhead, strategy)
            self.every = every

        def __call__(self, pairs, deadline=None):
            with dyb.batching(self.strategy, flush_every=self.every):
                preds = [self.dhead(self.encode(a_tree, a_ids)[0],
                                    self.encode(b_tree, b_ids)[0])
                         for a_ids, a_tree, b_ids, b_tree in pairs]
            return dyb.concat_rows(preds)

    forms = {'one flush': Pipelined(None), 'one flush (again)': Pipelined(None)}
    forms.update(('every %d' % k, Pipelined(k)) for k in args.every)
    forms['auto'] = Pipelined('auto')      # the default: follows the engine (see PIPELINE_FIRST)
    names = list(forms)
    order_rng = np.random.RandomState(args.seed)
    results = []
    for setting in args.settings:
        mode, batch = setting.split()[0], int(setting.split()[1])
        seconds = {name: [] for name in names}
        flushes = {name: 0 for name in names}
        start = 0
        for repeat in range(args.repeats + 2):          # two warm-up minibatches
            if start + batch > len(items):
                # new minibatches on each pass: a minibatch met again would
                # run its cached plan where its structure repeats, which the
                # parts of a scope that follows the engine (cut by timing)
                # rarely do, biasing against it
                start = 0
                shuffle = order_rng.permutation(len(items))
                items, targets = [items[i] for i in shuffle], targets[shuffle]
            pairs, target = items[start:start + batch], targets[start:start + batch]
            start += batch
            for name in order_rng.permutation(names):
                dyb.reset_stats()
                began = time.perf_counter()
                bt.run_minibatch(ctx, forms[name], mode, pairs, target)
                if repeat >= 2:
                    seconds[name].append(time.perf_counter() - began)
                    flushes[name] += dyb.stats()['flushes']
        medians = {name: float(np.median(s)) for name, s in seconds.items()}
        base = medians['one flush']
        row = {'mode': mode, 'batch_size': batch,
               'pairs_per_s': {n: batch / m for n, m in medians.items()},
               'ratio_to_one_flush': {n: base / m for n, m in medians.items()},
               'flushes_per_minibatch': {n: f / args.repeats for n, f in flushes.items()}}
        results.append(row)
        print('%-5s B=%-4d ' % (mode, batch) + '  '.join(
            '%s %.0f (%.2fx, %.1f flushes)' % (n, row['pairs_per_s'][n],
                                               row['ratio_to_one_flush'][n],
                                               row['flushes_per_minibatch'][n])
            for n in names), flush=True)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, 'pipeline.json')
    with open(path, 'w') as f:
        json.dump({'settings': vars(args), 'flush_every_cap': PIPELINE_CALLS,
                   'results': results}, f, indent=1)
    print('wrote', path)


if __name__ == '__main__':
    main()
