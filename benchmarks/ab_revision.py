#!/usr/bin/env python
"""Is the working tree faster than an earlier revision?  Loads
``gluon_dynbatch`` from the working tree and from a git revision *in one
process* and times both on the same SICK minibatches, interleaved, so that
the machine's drift (about 10% between runs on a 2-core VM) hits both alike.
Comparing two separate benchmark runs cannot resolve changes that small.

::

    python benchmarks/ab_revision.py --rev 298e024
    python benchmarks/ab_revision.py --rev HEAD~3 --settings 'infer 25' 'train 256'

Both sides run the same model (this tree's ``TreeLSTMNode`` and
``Similarity``, one set of weights) through the plain per-sample recursion
of ``bench_treelstm.py``, with one strategy (``--strategy``, default
``auto``); each repeat uses new minibatches.  Training uses one trainer,
with this tree's ``'fusedadagrad'`` for both sides: changes to the
optimizer itself are not compared.  Output: per setting, ms per minibatch
for each side (median over repeats) and the speed-up, and the record and
analysis times a minibatch of each side (``stats()``, medians).

The setting ``record <minibatch size>`` times recording alone: each side
runs the user's loop in a scope and drops what it recorded (no analysis,
no run), so a change of a few percent to the recorder shows, which the
whole step's noise hides.  Both sides run the same user loop, so the
difference of their times is the difference of their recorders.
"""
import argparse
import atexit
import gc
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import bench_treelstm as bt  # noqa: E402  (no MXNet import at module level)


MODES = ('infer', 'train', 'record')


def parse_setting(text):
    """A ``--settings`` entry, ``'<infer|train|record> <minibatch size>'``,
    checked as the command line is read (a malformed one is a usage error,
    not a traceback after the revision is built and the data loaded)."""
    parts = text.split()
    if len(parts) != 2 or parts[0] not in MODES or not parts[1].isdigit() \
            or int(parts[1]) < 1:
        raise argparse.ArgumentTypeError(
            "%r: write '<%s> <minibatch size>', e.g. 'infer 25'" % (text, '|'.join(MODES)))
    return '%s %d' % (parts[0], int(parts[1]))


def check_revision(rev):
    """Why ``git archive`` could not take ``rev``, or None: a revision that is
    not a commit of this repository, or has no ``gluon_dynbatch`` folder,
    is named as such before anything runs."""
    try:
        found = subprocess.run(['git', '-C', ROOT, 'rev-parse', '--verify', '--quiet',
                                rev + '^{commit}'], capture_output=True, text=True)
    except OSError as err:
        return 'git cannot be run (%s)' % err
    if found.returncode:
        return '%r is not a commit of the git repository at %s' % (rev, ROOT)
    commit = found.stdout.strip()
    if subprocess.run(['git', '-C', ROOT, 'cat-file', '-e', commit + ':gluon_dynbatch'],
                      capture_output=True).returncode:
        return 'revision %r (%s) has no gluon_dynbatch folder' % (rev, commit[:12])
    return None


def build_parser():
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('--rev', required=True, help='git revision to compare against')
    p.add_argument('--settings', nargs='+', type=parse_setting,
                   default=['infer 25', 'infer 256', 'train 25', 'train 256'],
                   help="'<infer|train|record> <minibatch size>' pairs")
    p.add_argument('--strategy', default='auto')
    p.add_argument('--engine', default='NaiveEngine',
                   choices=['NaiveEngine', 'ThreadedEnginePerDevice', 'ThreadedEngine'],
                   help='MXNET_ENGINE_TYPE for both sides')
    p.add_argument('--repeats', type=bt.positive_int, default=5)
    p.add_argument('--pairs', type=bt.positive_int, default=1500,
                   help='pairs timed per repeat and side (at least 4 minibatches)')
    p.add_argument('--data', default=None)
    return p


def parse_args(argv=None):
    p = build_parser()
    args = p.parse_args(argv)
    problem = check_revision(args.rev)
    if problem:
        p.error('--rev: %s' % problem)
    return args


def load_revision(rev):
    """Import ``gluon_dynbatch`` as of ``rev`` under the name ``gdb_rev``
    (from a temporary folder removed at exit)."""
    folder = tempfile.mkdtemp(prefix='dynbatch_ab_')
    atexit.register(shutil.rmtree, folder, True)
    archive = subprocess.run(['git', '-C', ROOT, 'archive', rev, 'gluon_dynbatch'],
                             check=True, capture_output=True).stdout
    subprocess.run(['tar', '-x', '-C', folder], input=archive, check=True)
    os.rename(os.path.join(folder, 'gluon_dynbatch'), os.path.join(folder, 'gdb_rev'))
    if os.path.exists(os.path.join(folder, 'gdb_rev', '_speedups.c')):
        # the revision's C extension, built as pip would (else both sides
        # would not be compared as installed)
        subprocess.run([sys.executable, '-c', 'from setuptools import setup, Extension; '
                        'setup(name="gdb_rev", script_args=["-q", "build_ext", "--inplace"], '
                        'ext_modules=[Extension("gdb_rev._speedups", ["gdb_rev/_speedups.c"], '
                        'extra_compile_args=["-O2"])])'],
                       cwd=folder, check=True, capture_output=True)
    sys.path.insert(0, folder)
    import gdb_rev  # pylint: disable=import-outside-toplevel,import-error
    return gdb_rev


def main(argv=None):
    args = parse_args(argv)
    os.environ['MXNET_ENGINE_TYPE'] = args.engine
    os.environ['OMP_NUM_THREADS'] = os.environ['MKL_NUM_THREADS'] = '1'
    import numpy as np  # pylint: disable=import-outside-toplevel
    import mxnet as mx  # pylint: disable=import-outside-toplevel
    import gluon_dynbatch as dyb  # pylint: disable=import-outside-toplevel
    old = load_revision(args.rev)
    for side, module in (('revision %s' % args.rev, old), ('working tree', dyb)):
        known = getattr(module, 'STRATEGIES', None)
        if known is not None and args.strategy not in known:
            build_parser().error('argument --strategy: %r is no strategy of the %s: choose '
                                 'from %s' % (args.strategy, side, ', '.join(known)))
    # importing the revision registered its 'fusedadagrad' over this tree's
    # (and its C kernel is not built): both sides share one trainer, which
    # uses this tree's optimizer, so training compares the batching only
    mx.optimizer.register(dyb.optim.FusedAdaGrad)

    class OldForm(bt.DynBatchForm):
        """Reads results the way the revision allows (``concat_rows`` is
        newer than some revisions)."""

        def __call__(self, pairs, deadline=None):
            if hasattr(self.dyb, 'concat_rows'):
                return super().__call__(pairs, deadline)
            with self.dyb.batching(self.strategy):
                preds = [self.dhead(self.encode(a, ai)[0], self.encode(b, bi)[0])
                         for ai, a, bi, b in pairs]
            return mx.nd.concat(*[p.data for p in preds], dim=0)

    _, items, targets, vocab_size, embedding = bt.load_data(bt.build_parser().parse_args(
        ['--data', args.data] if args.data else []))
    largest = max(int(setting.split()[1]) for setting in args.settings)
    if largest >= len(items):   # (the minibatches start anywhere but past the split's end)
        build_parser().error('argument --settings: a minibatch of %d is not less than the %d '
                             'pairs of the test split' % (largest, len(items)))
    # Python's full collections walked the data set's ~0.5M objects (~0.2-0.5
    # s each) and landed on one side's repeat now and then, adding 100-300 us
    # a minibatch to it at 'infer 1' (found while chasing a 3% that was
    # noise).  Frozen, they walk only what the two sides make.
    gc.collect()
    gc.freeze()
    ctx = bt.Forms(vocab_size, embedding, 0, wanted=['dynbatch-depth'])
    sides = {'revision': OldForm(old, old.DynBatchBlock(ctx.node), old.DynBatchBlock(ctx.head),
                                 args.strategy),
             'working tree': bt.DynBatchForm(dyb, ctx.dnode, ctx.dhead, args.strategy)}
    print('MXNET_ENGINE_TYPE=%s OMP_NUM_THREADS=1; revision %s vs working tree, '
          'strategy %s' % (args.engine, args.rev, args.strategy), flush=True)
    for name, module in (('revision', old), ('working tree', dyb)):
        accel = getattr(module, 'accel', None)
        print('%s: %s' % (name, accel.STATUS if accel else 'pure Python (no accel module)'))
    for setting in args.settings:
        mode, batch = setting.split()
        batch = int(batch)
        if mode == 'record':
            record_only(sides, items, batch, args.repeats, np)
            continue
        count = max(4, args.pairs // batch)
        offset = 0
        times = {name: [] for name in sides}
        split = {name: [] for name in sides}    # (record, analysis) ms a minibatch
        for form in sides.values():          # warm-up: trace, build programs, calibrate
            for start in range(0, 4 * batch, batch):
                bt.run_minibatch(ctx, form, mode, items[start:start + batch], targets)
        for rep in range(args.repeats):
            starts = [(offset + i * batch) % (len(items) - batch) for i in range(count)]
            offset += count * batch
            order = list(sides) if rep % 2 else list(sides)[::-1]
            for name in order:
                module = sides[name].dyb
                module.reset_stats()
                tic = time.perf_counter()
                for start in starts:
                    bt.run_minibatch(ctx, sides[name], mode, items[start:start + batch],
                                     targets[start:start + batch])
                times[name].append((time.perf_counter() - tic) / count)
                stats = module.stats()
                split[name].append((stats['record_ms'] / count, stats['analyse_ms'] / count))
        old_ms, new_ms = (1e3 * float(np.median(times[n])) for n in sides)
        print('%-10s revision %8.2f ms  working tree %8.2f ms  speed-up %.3f'
              % (setting, old_ms, new_ms, old_ms / new_ms), flush=True)
        (old_rec, old_an), (new_rec, new_an) = (np.median(split[n], axis=0) for n in sides)
        print('%-10s record + analysis: revision %.2f + %.2f ms, working tree %.2f + %.2f ms'
              % ('', old_rec, old_an, new_rec, new_an), flush=True)


def record_only(sides, items, batch, repeats, np):
    """Time each side's recording of the same minibatches, interleaved:
    the user's loop in a scope whose calls are then dropped."""
    def record(form, pairs):
        with form.dyb.batching(form.strategy) as scope:
            [form.dhead(form.encode(a, ai)[0], form.encode(b, bi)[0])
             for ai, a, bi, b in pairs]
            scope.abandon()

    count = max(20, 6000 // batch)
    times = {name: [] for name in sides}
    for rep in range(repeats):
        start = (rep * batch) % (len(items) - batch)
        pairs = items[start:start + batch]
        for form in sides.values():             # warm: signatures traced
            record(form, pairs)
        order = list(sides) if rep % 2 else list(sides)[::-1]
        for name in order:
            tic = time.perf_counter()
            for _ in range(count):
                record(sides[name], pairs)
            times[name].append((time.perf_counter() - tic) / count)
    old_ms, new_ms = (1e3 * float(np.median(times[n])) for n in sides)
    # repeat by repeat: the machine's drift cancels in each pair
    diff = 1e3 * float(np.median(np.subtract(*(times[n] for n in list(sides)[::-1]))))
    print('%-10s revision %8.3f ms  working tree %8.3f ms  (the user\'s loop with recording; '
          'median difference %+.3f ms)' % ('record %d' % batch, old_ms, new_ms, diff),
          flush=True)


if __name__ == '__main__':
    main()
