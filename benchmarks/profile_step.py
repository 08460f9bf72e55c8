#!/usr/bin/env python
"""Where a SICK minibatch's time goes, thread by thread: the profile behind
the "what limits it" notes of ``README.md`` and ``benchmarks/README.md``.

::

    python benchmarks/profile_step.py                          # train 25, auto
    python benchmarks/profile_step.py --setting 'infer 256' --form hand-batched-unique

Under MXNet's threaded engine a step runs on two threads: Python records,
plans, launches the steps' CachedOps and builds the backward pass, while
MXNet's worker runs the operators.  The slower of the two sets the pace, so
a speed-up must come from that one.  On fresh minibatches of the shuffled
SICK test split (the model, weights, optimizer and settings of
``bench_treelstm.py``, one form), after a warm-up (pairs holding every
child count, the split's last 512 pairs as one minibatch, then up to 30
minibatches of the setting), the script runs:

1. a timed pass: wall ms per minibatch; the Python thread's split (for
   ``dynbatch-*`` forms the scope's recording, analysis, padding checks,
   compile and launch from ``stats()``, and the user's loop around them;
   the loss; the ``backward()`` call; the optimizer step; the pass's last
   wait for the worker), each thread's CPU time per wall time
   (``time.thread_time`` for Python, the rest of the process's for MXNet's
   worker).  Padding checks that fresh minibatches still meet (rare child
   counts) are one-time work inside the pass: the line "without its
   padding checks" takes their Python time out (their operators stay);
2. a profiled pass over other fresh minibatches, with MXNet's profiler
   aggregating operator times: operator ms per minibatch (the engine's
   frees and waits apart), each operator's calls and share, and the C
   calls Python spends in MXNet (``WAITS``), and from its event trace the
   worker's timeline (:func:`worker_timeline`): how long it ran operators
   and how long it waited in a minibatch, and how much of that wait came
   before its first operator.  The profiler slows every operator a
   little: compare shares, not its totals with pass 1's.

It prints both and writes ``<out>/profile_<mode>_<B>_<form>[_<engine>].json``.
One process, one form: run forms one after the other to compare them.
"""
import argparse
import atexit
import json
import os
import shutil
import sys
import tempfile
import time
from collections import defaultdict

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import bench_treelstm as bt  # noqa: E402  (no MXNet import at module level)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument('--setting', default='train 25', help="'<infer|train> <minibatch size>'")
    p.add_argument('--form', default='dynbatch-auto',
                   help="a form of bench_treelstm.py: dynbatch-<strategy>, hand-batched, "
                        "hand-batched-unique")
    p.add_argument('--minibatches', type=int, default=60,
                   help='fresh minibatches in each pass (at least 2), at most what the test '
                        'split holds after the warm-up')
    # the split is of two threads: the NaiveEngine runs the operators in
    # Python's, inside the calls this script times
    p.add_argument('--engine', default='ThreadedEnginePerDevice', choices=THREADED,
                   help='MXNET_ENGINE_TYPE (a threaded one: the profile splits two threads)')
    p.add_argument('--top', type=bt.positive_int, default=15, help='operators listed')
    p.add_argument('--data', default=None, help='SICK folder (else $GLUON_DYNBATCH_SICK, else '
                                                '../shared/data/sick)%(default).0s')
    p.add_argument('--out', default=os.path.join(HERE, 'results'),
                   help='folder for the JSON')
    args = p.parse_args(argv)
    parts = args.setting.split()
    if len(parts) != 2 or parts[0] not in ('infer', 'train') or not parts[1].isdigit() \
            or int(parts[1]) < 1:
        p.error("--setting must be 'infer B' or 'train B' with B >= 1, not %r" % args.setting)
    if args.minibatches < 2:
        p.error('--minibatches must be at least 2, not %d' % args.minibatches)
    args.mode, args.batch = parts[0], int(parts[1])
    return args


PADDING_CHECKS = 'padding checks (once per new pair of list lengths)'
THREADED = [engine for engine in bt.ENGINES if engine != 'NaiveEngine']
BOOKKEEPING = ('DeleteVariable', 'WaitForVar')
"""Engine operations that are no operators: freeing an array, a wait."""
WAITS = ('MXAutogradBackwardEx', 'MXInvokeCachedOp', 'MXNDArraySyncCopyFromCPU',
         'MXNDArraySyncCopyToCPU', 'MXNDArrayWaitAll')
"""The C calls whose time Python spends in MXNet (building, launching, waiting)."""


def run_step(ctx, form, mode, pairs, targets, split):
    """``bench_treelstm.run_minibatch`` without waiting, adding the seconds
    of its parts to ``split`` (a ``defaultdict(float)``)."""
    mx = ctx.mx
    tic = time.perf_counter()
    if mode == 'infer':
        out = form(pairs)
        split['forward'] += time.perf_counter() - tic
        tic = time.perf_counter()
        out.asnumpy()
        split['read results (waits for the worker)'] += time.perf_counter() - tic
        return
    with mx.autograd.record():
        logp = form(pairs)
        split['forward'] += time.perf_counter() - tic
        tic = time.perf_counter()
        loss = -(logp * bt._to_device(targets[:logp.shape[0]])).sum()
    split['loss (its targets\' upload waits for the worker)'] += time.perf_counter() - tic
    tic = time.perf_counter()
    loss.backward()
    split['backward() call'] += time.perf_counter() - tic
    tic = time.perf_counter()
    ctx.trainer.step(logp.shape[0], ignore_stale_grad=True)
    split['optimizer step'] += time.perf_counter() - tic


def operator_table(text):
    """{name: (calls, ms)} of one section of MXNet's aggregate profile table."""
    rows = {}
    for line in text.splitlines()[2:]:     # below the header and its underline
        parts = line.split()        # name (may hold spaces), calls, total, min, max, avg
        if len(parts) < 6:
            break
        rows[' '.join(parts[:-5])] = (int(parts[-5]), float(parts[-4]))
    return rows


def profile_sections(dump):
    """The 'operator' and 'MXNET_C_API' sections of ``mx.profiler.dumps()``."""
    sections = {}
    for name in ('operator', 'MXNET_C_API'):
        marker = '\n%s\n=================\n' % name
        if marker in dump:
            sections[name] = operator_table(dump.split(marker, 1)[1])
    return sections


MARKER = 'profile_step_minibatch'
"""Name of the profiler's instant markers that pass 2 sets as each minibatch
starts (and once after the pass's last wait)."""


def worker_timeline(events):
    """When MXNet's worker ran operators, minibatch by minibatch, from the
    profiler's event trace: for each span between two :data:`MARKER` s,
    the worker's busy ms, its idle ms, and the idle ms before its first
    operator of the span (under a pipelined inference scope, the time
    Python takes to record the first part), as medians over the spans (None
    without markers).  Operators include the engine's bulks of a CachedOp's
    operators (``ImperativeBulk``), not its frees and waits
    (:data:`BOOKKEEPING`); the worker is the thread that ran the most of
    them, and their intervals are merged, so time counts once."""
    marks = sorted(e['ts'] for e in events if e.get('ph') == 'n' and e.get('name') == MARKER)
    began, by_thread = defaultdict(list), defaultdict(list)     # began: a stack per name
    for e in events:
        if e.get('cat') != 'operator' or e.get('ph') not in ('B', 'E') or \
                e.get('name') in BOOKKEEPING:
            continue
        key = (e['tid'], e['name'])
        if e['ph'] == 'B':
            began[key].append(e['ts'])
        elif began[key]:
            by_thread[e['tid']].append((began[key].pop(), e['ts']))
    if len(marks) < 2 or not by_thread:
        return None
    ops = sorted(max(by_thread.values(), key=len))
    spans = []
    for start, end in zip(marks, marks[1:]):
        busy, first, reached = 0.0, None, start     # reached: the merged intervals' end
        for a, b in ops:
            a, b = max(a, reached), min(b, end)
            if b <= a:
                continue
            first = a if first is None else first
            busy, reached = busy + b - a, b
        spans.append((busy, end - start - busy, (first if first is not None else end) - start))
    median = lambda values: sorted(values)[len(values) // 2]     # noqa: E731
    return {name: median([span[i] for span in spans]) / 1e3
            for i, name in enumerate(('busy', 'idle', 'idle_before_first_operator'))}


def main(argv=None):
    args = parse_args(argv)
    bench_args = bt.build_parser().parse_args(
        ['--engine', args.engine] + (['--data', args.data] if args.data else []))
    bt.configure_env(bench_args)
    import mxnet as mx  # pylint: disable=import-outside-toplevel
    import gluon_dynbatch  # pylint: disable=import-outside-toplevel
    known = [bt.PER_SAMPLE, bt.HYBRID, bt.HAND, bt.HAND_UNIQUE, bt.DYB_PURE] + \
        [bt.DYB_PREFIX + strategy for strategy in gluon_dynbatch.STRATEGIES]
    if args.form not in known:
        raise SystemExit('error: no form %r; forms: %s' % (args.form, ', '.join(known)))
    _, items, targets, vocab_size, embedding = bt.load_data(bench_args)
    ctx = bt.Forms(vocab_size, embedding, bench_args.seed, [args.form],
                   bench_args.sparse_grad, bench_args.optimizer)
    if args.form not in ctx.forms:
        raise SystemExit('error: form %r cannot run here: %s'
                         % (args.form, ctx.skipped.get(args.form, 'unknown reason')))
    form, dyb, batch = ctx.forms[args.form], ctx.dyb, args.batch
    # every minibatch fresh, as in the benchmark's walk over the split (a
    # repeated one would reuse its cached plan): up to 30 warm up
    available = len(items) // batch
    warm = min(30, available // 5)
    count = min(args.minibatches, (available - warm) // 2)
    if count < 2:
        raise SystemExit('error: the test split (%d pairs) holds too few minibatches of %d '
                         'for two passes' % (len(items), batch))
    print('MXNET_ENGINE_TYPE=%s OMP_NUM_THREADS=%s; %s %d, form %s; %d warm-up minibatches, '
          '%d a pass' % (os.environ['MXNET_ENGINE_TYPE'], os.environ['OMP_NUM_THREADS'],
                         args.mode, batch, args.form, warm, count), flush=True)

    def minibatches(first, n):
        return [(items[s:s + batch], targets[s:s + batch])
                for s in range(first * batch, (first + n) * batch, batch)]

    # warm-up as the benchmark's: pairs holding every child count, in both
    # modes (signatures traced, programs built); then the split's last 512
    # pairs as one minibatch, whose depths mix most pairs of child counts
    # (a pad_lists block's padding is checked once per pair, ~0.1 s each:
    # one-time work that would otherwise fall into the passes); then
    # minibatches of the setting (calibration, auto's first choices)
    covering = bt.covering_pairs(items)
    for mode in ('infer', 'train'):
        run_step(ctx, form, mode, covering, targets[:len(covering)], defaultdict(float))
        run_step(ctx, form, mode, items[-512:], targets[-512:], defaultdict(float))
    for pairs, tg in minibatches(0, warm):
        run_step(ctx, form, args.mode, pairs, tg, defaultdict(float))
    mx.nd.waitall()

    # pass 1: timed
    split = defaultdict(float)
    dyb.reset_stats()
    wall, cpu, thread = time.perf_counter(), time.process_time(), time.thread_time()
    for pairs, tg in minibatches(warm, count):
        run_step(ctx, form, args.mode, pairs, tg, split)
    tic = time.perf_counter()
    mx.nd.waitall()
    split['the pass\'s last wait for the worker'] += time.perf_counter() - tic
    wall, cpu, thread = (time.perf_counter() - wall, time.process_time() - cpu,
                         time.thread_time() - thread)
    stats = dyb.stats()
    per_mb = {name: 1e3 * s / count for name, s in split.items()}
    if args.form.startswith(bt.DYB_PREFIX):
        inside = {'recording (recorder\'s clock)': stats['record_ms'],
                  'analysis': stats['analyse_ms'] - stats['padding_check_ms'],
                  PADDING_CHECKS: stats['padding_check_ms'],
                  'compile': stats['compile_ms'], 'launching the steps': stats['run_ms']}
        inside = {name: ms / count for name, ms in inside.items()}
        forward = per_mb.pop('forward')
        per_mb.update(('forward: ' + name, ms) for name, ms in inside.items())
        per_mb['forward: the user\'s loop and the rest of the scope'] = \
            forward - sum(inside.values())
    per_mb['rest (between the parts)'] = 1e3 * wall / count - sum(per_mb.values())
    timed = {'wall_ms': 1e3 * wall / count, 'pairs_per_s': count * batch / wall,
             'programs_built': stats['programs_built'], 'padding_checks': stats['padding_checks'],
             'auto_choices': stats['choices'],
             'python_busy': thread / wall, 'worker_busy': (cpu - thread) / wall,
             'python_ms': per_mb}

    # pass 2: profiled
    # (MXNet writes its event trace at exit, MBs of it: into a folder removed then)
    trace_dir = tempfile.mkdtemp(prefix='profile_step_')
    atexit.register(shutil.rmtree, trace_dir, True)
    mx.profiler.set_config(profile_all=True, aggregate_stats=True,
                           filename=os.path.join(trace_dir, 'trace.json'))
    os.makedirs(args.out, exist_ok=True)
    mx.profiler.set_state('run')
    domain = mx.profiler.Domain(MARKER)
    tic = time.perf_counter()
    for pairs, tg in minibatches(warm + count, count):
        mx.profiler.Marker(domain, MARKER).mark('process')
        run_step(ctx, form, args.mode, pairs, tg, defaultdict(float))
    mx.nd.waitall()
    mx.profiler.Marker(domain, MARKER).mark('process')
    profiled_wall = time.perf_counter() - tic
    mx.profiler.set_state('stop')
    sections = profile_sections(mx.profiler.dumps(reset=True))
    mx.profiler.dump()
    with open(os.path.join(trace_dir, 'trace.json')) as f:
        timeline = worker_timeline(json.load(f)['traceEvents'])
    ops = sections.get('operator', {})
    real = {name: row for name, row in ops.items() if name not in BOOKKEEPING}
    kept = {name: row for name, row in ops.items() if name in BOOKKEEPING}
    capi = sections.get('MXNET_C_API', {})
    profiled = {'wall_ms': 1e3 * profiled_wall / count,
                'operator_ms': sum(ms for _, ms in real.values()) / count,
                'operator_calls': sum(c for c, _ in real.values()) / count,
                'bookkeeping_ms': sum(ms for _, ms in kept.values()) / count,
                'bookkeeping_calls': sum(c for c, _ in kept.values()) / count,
                'operators': {name: {'calls': c / count, 'ms': ms / count}
                              for name, (c, ms) in ops.items()},
                'python_waits_in_ms': {name: capi[name][1] / count for name in WAITS
                                       if name in capi},
                'worker_timeline_ms': timeline}
    report(args, timed, profiled)
    engine = '' if args.engine == 'ThreadedEnginePerDevice' else '_' + args.engine
    path = os.path.join(args.out, 'profile_%s_%d_%s%s.json'
                        % (args.mode, batch, args.form, engine))
    with open(path, 'w') as f:
        json.dump({'setting': args.setting, 'form': args.form, 'minibatches': count,
                   'engine': os.environ['MXNET_ENGINE_TYPE'], 'timed': timed,
                   'profiled': profiled}, f, indent=1)
    print('wrote %s' % path)


def report(args, timed, profiled):
    print('\npass 1 (timed): %.2f ms a minibatch, %.0f pairs/s; busy (CPU s per wall s): '
          'Python thread %.2f, MXNet\'s worker %.2f'
          % (timed['wall_ms'], timed['pairs_per_s'], timed['python_busy'],
             timed['worker_busy']))
    checks = timed['python_ms'].get('forward: ' + PADDING_CHECKS, 0.0)
    if checks:      # one-time work that fresh minibatches still meet (rare child counts)
        print('  without its padding checks: %.2f ms a minibatch, %.0f pairs/s'
              % (timed['wall_ms'] - checks, 1e3 * args.batch / (timed['wall_ms'] - checks)))
    if timed['programs_built'] or timed['padding_checks'] or timed['auto_choices']:
        print('  gluon_dynbatch: %d programs built, %d padding checks%s'
              % (timed['programs_built'], timed['padding_checks'],
                 '; auto chose %s' % timed['auto_choices'] if timed['auto_choices'] else ''))
    print('  the Python thread, ms a minibatch:')
    for name, ms in timed['python_ms'].items():
        print('    %-58s %7.2f  %5.1f%%' % (name, ms, 100 * ms / timed['wall_ms']))
    print('\npass 2 (profiled): %.2f ms a minibatch; operators %.2f ms (%.0f calls) = %.0f%% '
          'of it, and the engine\'s frees and waits %.2f ms (%.0f)'
          % (profiled['wall_ms'], profiled['operator_ms'], profiled['operator_calls'],
             100 * profiled['operator_ms'] / profiled['wall_ms'], profiled['bookkeeping_ms'],
             profiled['bookkeeping_calls']))
    timeline = profiled['worker_timeline_ms']
    if timeline:
        print('  MXNet\'s worker (medians over the minibatches): busy %.2f ms, idle %.2f ms, '
              'of which %.2f before its first operator'
              % (timeline['busy'], timeline['idle'], timeline['idle_before_first_operator']))
    for name, ms in profiled['python_waits_in_ms'].items():
        print('  Python in %-26s %6.2f ms a minibatch' % (name, ms))
    print('  %-34s %8s %8s %8s %6s' % ('operator', 'calls/mb', 'ms/mb', 'us/call', 'share'))
    ranked = sorted(profiled['operators'].items(), key=lambda kv: -kv[1]['ms'])
    for name, row in ranked[:args.top]:     # shares of the operators' time and the engine's
        print('  %-34s %8.1f %8.3f %8.1f %5.1f%%'
              % (name, row['calls'], row['ms'], 1e3 * row['ms'] / max(row['calls'], 1e-9),
                 100 * row['ms'] / max(profiled['operator_ms'] + profiled['bookkeeping_ms'],
                                       1e-9)))


if __name__ == '__main__':
    main()
