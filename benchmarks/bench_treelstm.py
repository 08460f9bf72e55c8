#!/usr/bin/env python
"""Throughput of the child-sum Tree-LSTM (Tai et al. 2015) on SICK, computed
every way this project cares about, with one set of weights:

1. ``per-sample``        plain imperative Gluon, node-by-node recursion;
2. ``per-sample-hybrid`` the same recursion through hybridized blocks (one
                         hybridized instance per child count, all sharing the
                         parameters: a hybridized block fixes its argument
                         structure, and a node's child lists vary);
3. ``hand-batched``      expert hand-batched MXNet (``benchmarks/handbatched.py``);
   ``hand-batched-unique`` the same with ``i2h='unique'``: the embedding and
                         ``i2h`` GEMM once per distinct token id of the
                         minibatch (gluon_dynbatch does the same per step);
4. ``dynbatch-<s>``      gluon_dynbatch, for every strategy ``s`` in
                         ``gluon_dynbatch.STRATEGIES`` (read at run time).

One invocation does everything::

    python benchmarks/bench_treelstm.py                 # full run, < 8 min on 2 cores
    python benchmarks/bench_treelstm.py --quick         # CI smoke run, < 1 min (into results/quick/)
    python benchmarks/bench_treelstm.py --sweep-settings   # threads x engine sweep

Steps: (a) every form must give the same log-probabilities and the same
gradient of every parameter as ``per-sample`` on a couple of minibatches, or
the run stops with an error; (b) a GEMM roofline ("physical limit") from the
model's real matrix products on the real trees and the GEMM speed measured
here; (c) inference (log-probs to host) and training (forward, backward,
Adagrad step) throughput in pairs/s, median of repeats, forms interleaved in
every repeat.  The ``... same`` settings run one minibatch again and again:
a repeated structure, where a cached plan replays its gathers and, reused
twice, runs compiled as one call (the other settings walk the split, so
structures rarely repeat).  Output: a table on stdout, ``results.json``,
``results.md`` (the pairs/s table in Markdown, as the README shows it; the
docs build the same table from ``results.json``) and ``throughput.png`` in
``--out`` (default ``benchmarks/results/``).

MXNet's threads and engine are set from the command line *before* MXNet is
imported (``--threads``, default 1; ``--engine``, default
ThreadedEnginePerDevice, the fastest setting for every batched form in the
settings sweeps): see ``benchmarks/README.md``.
"""
import argparse
import gc
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_OUT = os.path.join(HERE, 'results')
QUICK_OUT = os.path.join(DEFAULT_OUT, 'quick')

ENGINES = ('NaiveEngine', 'ThreadedEnginePerDevice', 'ThreadedEngine')
PER_SAMPLE = 'per-sample'
HYBRID = 'per-sample-hybrid'
HAND = 'hand-batched'
HAND_UNIQUE = 'hand-batched-unique'
DYB_PREFIX = 'dynbatch-'
DYB_PURE = 'dynbatch-auto-py'

# (name, mode, minibatch size)
FULL_SETTINGS = [('infer B=1', 'infer', 1), ('infer B=25', 'infer', 25),
                 ('infer B=256', 'infer', 256), ('infer B=1024', 'infer', 1024),
                 ('train B=25', 'train', 25), ('train B=256', 'train', 256),
                 ('infer B=25 same', 'infer', 25), ('train B=25 same', 'train', 25)]
SAME_SUFFIX = ' same'    # settings that run one minibatch again and again (a repeated
                         # structure: where cached plans pay), not the split in order
QUICK_SETTINGS = [('infer B=1', 'infer', 1), ('infer B=25', 'infer', 25),
                  ('train B=25', 'train', 25)]
SWEEP_SETTINGS = [('infer B=25', 'infer', 25), ('infer B=256', 'infer', 256),
                  ('train B=25', 'train', 25)]

EMBED, HIDDEN, SIM_HIDDEN, CLASSES = 300, 150, 50, 5
LEARNING_RATE = 0.05      # Adagrad, every form
OPTIMIZERS = ('fusedadagrad', 'adagrad')   # gluon_dynbatch.FusedAdaGrad (default), MXNet's
TRAIN_FORWARD_SHARE = 0.35
TRAIN_TIMING = {False: 'training steps back to back, timed to the end of the last',
                True: 'each training step waits for its own end (--sync-train)'}
REPEATS, BUDGET_S = 8, 0.48
"""Per setting, 8 repeats in which each form runs for 0.48 s (a turn ends
with the minibatch that passes its budget; 0.55 s, about the 4.8 s per form
of the 3 x 1.6 s before, made full runs of 471-474 s, within 2% of the
issue's 8 minutes): the machine's speed drifts within seconds, and shorter
turns, rotated, spread it over the forms more evenly.  A form that cannot
stop mid-minibatch skips settings whose minibatch takes over
``--max-batch-s`` (1 s), since each repeat runs at least one: at 4 s,
``dynbatch-per-sample`` ran 8 minibatches of 256 (~11 s), and a run in a
slow hour took 495 s.
Two forms running the same plans (``auto`` and ``depth``) differed by 4.9%
on average over 9 cells with 3 x 1.6 s, by 3.4% with 8 x 0.6 s, and by 2.9%
with their ratio taken repeat by repeat (:func:`paired_ratio`; three runs
of each)."""


# ==========================================================================
# Command line and environment (no MXNet import here)
# ==========================================================================

def number(kind, least, strict=False, most=None):
    """An argparse type for the benchmarks' numeric options: ``kind`` (int or
    float), finite, at least ``least`` (above it with ``strict``), at most
    ``most``; else argparse's own error, exit status 2, before the data or
    MXNet loads, naming the option, the value and what is allowed (a
    ``--workers 0`` hung MXNet, a ``--budget nan`` never ended, a
    ``--repeats 0`` divided by zero after minutes).  The other scripts here
    import theirs from this module, as examples/sick/train.py has its own."""
    if most is not None:
        allowed = '%s from %s to %s' % ('an integer' if kind is int else 'a number',
                                         least, most)
    elif least == 0:
        allowed = 'a %s %s' % ('positive' if strict else 'non-negative',
                               'integer' if kind is int else 'finite number')
    elif least == 1 and kind is int and not strict:
        allowed = 'a positive integer'
    else:
        allowed = '%s %s %s' % ('an integer' if kind is int else 'a finite number',
                                '>' if strict else '>=', least)

    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or not math.isfinite(value) or value < least or \
                (strict and value == least) or (most is not None and value > most):
            raise argparse.ArgumentTypeError('%r is not %s' % (text, allowed))
        return value
    parse.__name__ = kind.__name__      # argparse names the type in its messages
    return parse


positive_int = number(int, 1)
"""A count: ``--repeats 0`` would be a median of nothing, ``--batch 0`` a
zero ``range()`` step far into the run."""
positive_float = number(float, 0, strict=True)
non_negative_float = number(float, 0)
SEED_MAX = 2 ** 31 - 1
seed_int = number(int, 0, most=SEED_MAX)
"""A seed: numpy's ``RandomState`` takes 0 to 2**32 - 1, and some scripts
seed with ``seed + k`` too."""


def build_parser():
    p = argparse.ArgumentParser(
        description='Tree-LSTM/SICK throughput: per-sample, hybridized, hand-batched and '
                    'gluon_dynbatch, same weights.',
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    # ArgumentDefaultsHelpFormatter adds '(default: ...)' to every help that
    # holds no '%(default)': a help that says its default itself ends with
    # the empty '%(default).0s', so that the default is said once
    p.add_argument('--data', default=None, help='SICK folder (default $GLUON_DYNBATCH_SICK, '
                                                'else ../shared/data/sick)%(default).0s')
    p.add_argument('--out', default=None,
                   help='folder for results.json and the PNG (default %s; with --quick %s, '
                        'so that a smoke run leaves the published results alone)%%(default).0s'
                        % (DEFAULT_OUT, QUICK_OUT))
    p.add_argument('--threads', type=positive_int, default=1,
                   help='OpenMP/MKL threads per operator (OMP_NUM_THREADS, MKL_NUM_THREADS)')
    p.add_argument('--engine', choices=ENGINES, default='ThreadedEnginePerDevice',
                   help='MXNET_ENGINE_TYPE (NaiveEngine: exact per-step times, runs '
                        'comparable with those before this default)')
    p.add_argument('--workers', type=positive_int, default=None,
                   help='MXNET_CPU_WORKER_NTHREADS for the threaded engines (default: unset, '
                        'which MXNet reads as 1)%(default).0s')
    p.add_argument('--quick', action='store_true',
                   help='tiny run for CI: B in {1, 25}, train 25, short timings')
    p.add_argument('--sweep-settings', action='store_true',
                   help='re-run a short subset under threads {1,2} x engine {Naive, '
                        'ThreadedEnginePerDevice} as subprocesses; report the fastest per form')
    p.add_argument('--sweep-rounds', type=positive_int, default=2,
                   help='rounds of the sweep (combinations interleaved; median over rounds)')
    p.add_argument('--sweep-child', action='store_true', help=argparse.SUPPRESS)
    p.add_argument('--budget', type=positive_float, default=None,
                   help='seconds of minibatches per form per repeat per setting '
                        '(default %g; quick 0.3)%%(default).0s' % BUDGET_S)
    p.add_argument('--repeats', type=positive_int, default=None,
                   help='repeats per setting, forms interleaved (default %d; quick 2)'
                        '%%(default).0s' % REPEATS)
    p.add_argument('--max-batch-s', type=positive_float, default=1.0,
                   help='skip a setting for a form that cannot stop mid-minibatch when one '
                        'minibatch is estimated to take longer than this')
    p.add_argument('--forms', nargs='+', default=None,
                   help='only these forms (default: all; per-sample is always run for the '
                        'check)%(default).0s')
    p.add_argument('--settings', nargs='+', type=parse_setting, default=None,
                   help="only these settings, e.g. 'infer B=25' 'train B=256' "
                        "'infer B=256 same' (any minibatch size; default: those of the full "
                        "run, or of --quick)%(default).0s")
    p.add_argument('--check-pairs', type=positive_int, default=None,
                   help='pairs per equivalence-check minibatch (default 25; quick 8)'
                        '%(default).0s')
    p.add_argument('--check-batches', type=positive_int, default=2,
                   help='minibatches of the equivalence check (at least 1: no run skips it)')
    p.add_argument('--tol', type=non_negative_float, default=1e-4,
                   help='equivalence tolerance: log-probs absolute, gradients relative to '
                        'the largest gradient entry of the parameter (0: bit for bit)')
    p.add_argument('--seed', type=seed_int, default=0,
                   help='weights and pair order (0 to %d)' % SEED_MAX)
    grads = p.add_mutually_exclusive_group()
    grads.add_argument('--dense-grad', dest='sparse_grad', action='store_false',
                       default=argparse.SUPPRESS,
                       help='dense embedding gradients in every form (a vocabulary-sized '
                            'gradient and update per step)')
    grads.add_argument('--sparse-grad', dest='sparse_grad', action='store_true', default=True,
                       help='row-sparse embedding gradients in every form, as the SICK '
                            'example trains and as DyNet updates lookup parameters')
    p.add_argument('--optimizer', default=OPTIMIZERS[0], choices=OPTIMIZERS,
                   help="every form's Adagrad: gluon_dynbatch.FusedAdaGrad (one op per "
                        "parameter, the same values) or MXNet's own")
    p.add_argument('--sync-train', action='store_true',
                   help='wait for each training step to finish before the next starts (as '
                        'runs before this flag did); by default steps run back to back, as '
                        'in a training loop that does not read its loss every step, and a '
                        'timed turn ends when its last step has finished')
    p.add_argument('--gc-freeze', action='store_true',
                   help='gc.freeze() after loading the data, so that Python\'s full '
                        'collections do not walk the ~0.3M objects of the data set')
    p.add_argument('--no-plot', action='store_true')
    return p


def configure_env(args):
    """Set threads / engine for MXNet; must run before ``import mxnet``."""
    env = os.environ
    env['MXNET_ENGINE_TYPE'] = args.engine
    env['OMP_NUM_THREADS'] = str(args.threads)
    env['MKL_NUM_THREADS'] = str(args.threads)
    if args.workers is not None:
        env['MXNET_CPU_WORKER_NTHREADS'] = str(args.workers)
    if 'mxnet' in sys.modules:
        print('warning: mxnet was imported before the environment was set; --threads/--engine '
              'may not apply', file=sys.stderr)


def _loaded_allocator():
    """'tcmalloc' / 'jemalloc' when one is mapped into this process, else 'glibc'."""
    try:
        with open('/proc/self/maps') as f:
            maps = f.read()
    except OSError:
        return 'unknown'
    for name in ('tcmalloc', 'jemalloc'):
        if name in maps:
            return name
    return 'glibc'


def _cpu_model():
    try:
        with open('/proc/cpuinfo') as f:
            for line in f:
                if line.startswith('model name'):
                    return line.split(':', 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or 'unknown'


def runtime_config(args, mx):
    try:
        features = [f.name for f in mx.runtime.Features().values() if f.enabled]
    except Exception:  # pylint: disable=broad-except
        features = []
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count()
    return {
        'threads': args.threads,
        'engine': os.environ.get('MXNET_ENGINE_TYPE'),
        'OMP_NUM_THREADS': os.environ.get('OMP_NUM_THREADS'),
        'MKL_NUM_THREADS': os.environ.get('MKL_NUM_THREADS'),
        'MXNET_CPU_WORKER_NTHREADS': os.environ.get('MXNET_CPU_WORKER_NTHREADS',
                                                    '(unset: 1)'),
        'LD_PRELOAD': os.environ.get('LD_PRELOAD', ''),
        'allocator': _loaded_allocator(),
        'mxnet': mx.__version__,
        'mxnet_features': [f for f in features if f in ('MKLDNN', 'ONEDNN', 'BLAS_OPEN',
                                                         'BLAS_MKL', 'OPENMP', 'CUDA')],
        'python': platform.python_version(),
        'platform': platform.platform(),
        'cpu': _cpu_model(),
        'cores_available': cores,
        'dynbatch_accel': _accel_status(),
        'fusedadagrad_kernel': _kernel_status(),
    }


def _accel_status():
    import gluon_dynbatch.accel  # pylint: disable=import-outside-toplevel
    return gluon_dynbatch.accel.STATUS


def _kernel_status():
    """Whether ``'fusedadagrad'`` updates dense CPU gradients with its C
    kernel (gluon_dynbatch.optim.KERNEL) or with MXNet's op."""
    from gluon_dynbatch import optim  # pylint: disable=import-outside-toplevel
    if optim.KERNEL is None:
        return 'sparse.adagrad_update'
    return 'C kernel, %s' % ('addresses read in the job: a step does not wait'
                             if optim.in_job_addresses()
                             else 'a step waits for the backward pass')


# ==========================================================================
# The forms
# ==========================================================================

class Forms:
    """Builds every form over one set of parameters (imported lazily so that
    the environment is configured before MXNet loads)."""
    sync_train = False      # time_cell: each training step waits for its end (--sync-train)

    def __init__(self, vocab_size, embedding, seed, wanted=None, sparse_grad=False,
                 optimizer=OPTIMIZERS[0]):
        import mxnet as mx
        import gluon_dynbatch as dyb
        from gluon_dynbatch.models import Similarity, TreeLSTMNode

        self.mx, self.dyb = mx, dyb
        mx.random.seed(seed)
        self.node = TreeLSTMNode(vocab_size, EMBED, HIDDEN, sparse_grad=sparse_grad,
                                 prefix='treelstm_')
        self.head = Similarity(SIM_HIDDEN, CLASSES, in_units=HIDDEN, prefix='sim_')
        self.node.initialize(mx.init.Xavier())
        self.head.initialize(mx.init.Xavier())
        self.node.embedding.weight.set_data(mx.nd.array(embedding))
        self.params = self.node.collect_params()
        self.params.update(self.head.collect_params())
        self.trainer = mx.gluon.Trainer(self.params, optimizer, {'learning_rate': LEARNING_RATE})

        self.forms = {}          # name -> callable(pairs, deadline) -> (n, C) log-probs
        self.can_cut = set()     # forms that may stop mid-minibatch at the deadline
        self.skipped = {}        # name -> reason
        self.forms[PER_SAMPLE] = PerSampleForm(self.node, self.head)
        self.can_cut.add(PER_SAMPLE)
        self.forms[HYBRID] = HybridPerSampleForm(self.node, self.head, vocab_size)
        self.can_cut.add(HYBRID)
        hand = _load_handbatched()
        if isinstance(hand, str):
            self.skipped[HAND] = self.skipped[HAND_UNIQUE] = hand
            print('NOTE: hand-batched forms skipped: %s' % hand, flush=True)
        else:
            self.forms[HAND] = HandForm(hand(self.node, self.head))
            self.forms[HAND_UNIQUE] = HandForm(hand(self.node, self.head, i2h='unique'))
        self.dnode = dyb.DynBatchBlock(self.node)
        self.dhead = dyb.DynBatchBlock(self.head)
        for strategy in dyb.STRATEGIES:
            # the cached form gets a cache of its own: auto must not reuse plans
            # that another form stored for the same minibatches
            self.forms[DYB_PREFIX + strategy] = DynBatchForm(
                dyb, self.dnode, self.dhead,
                dyb.CachedPlan() if strategy == 'cached' else strategy)
        if dyb.accel.STATUS == 'C extension':     # what the C fast paths are worth
            # an Auto of its own (own cost model and plan cache): it must not
            # run structures the other auto form stored, nor learn its costs
            dyb.accel.enable(False)
            try:
                pure_auto = dyb.Auto(model=dyb.CostModel().calibrate())
            finally:
                dyb.accel.enable(True)
            pure_auto.cached = dyb.CachedPlan()
            self.forms[DYB_PURE] = PurePythonForm(dyb, self.dnode, self.dhead, pure_auto)
        if wanted:
            # the names known before any is filtered out (main() checks
            # --forms against form_names() earlier; this is the last word)
            known = list(self.forms) + [n for n in self.skipped if n not in self.forms]
            unknown = set(wanted) - set(known)
            if unknown:
                raise SystemExit('unknown form(s) %s; available: %s' % (sorted(unknown), known))
            for name in list(self.forms):
                if name != PER_SAMPLE and name not in wanted:
                    del self.forms[name]
        self.order = list(self.forms)
        self.measured = [n for n in self.order if not wanted or n in wanted]


def form_names(dyb):
    """The name of every form that :class:`Forms` builds, in its order: what
    ``--forms`` may name, known from ``dyb`` alone so that a misspelt name
    fails before the data is loaded and a cost model calibrated."""
    names = [PER_SAMPLE, HYBRID, HAND, HAND_UNIQUE]
    names += [DYB_PREFIX + strategy for strategy in dyb.STRATEGIES]
    if dyb.accel.STATUS == 'C extension':
        names.append(DYB_PURE)
    return names


def check_forms(parser, names, dyb):
    """Refuse (through ``parser``) a ``--forms`` name that no form has."""
    unknown = [name for name in names if name not in form_names(dyb)]
    if unknown:
        parser.error('unknown form(s) %s; available: %s'
                     % (', '.join(unknown), ', '.join(form_names(dyb))))


def _load_handbatched():
    """The HandBatchedTreeLSTM class, or the reason it cannot be used."""
    if HERE not in sys.path:
        sys.path.insert(0, HERE)
    try:
        from handbatched import HandBatchedTreeLSTM  # pylint: disable=import-outside-toplevel
    except ImportError as err:
        return 'benchmarks/handbatched.py not importable (%s)' % err
    except Exception as err:  # pylint: disable=broad-except
        return 'benchmarks/handbatched.py failed to import: %s: %s' % (type(err).__name__, err)
    return HandBatchedTreeLSTM


def _to_device(host):
    """numpy -> NDArray without ``mx.nd.array``'s per-call checks (the same
    fast copy the other forms use)."""
    import mxnet as mx
    array = mx.nd.empty(host.shape, dtype=host.dtype)
    array._sync_copyfrom(host)  # pylint: disable=protected-access
    return array


class PerSampleForm:
    """Plain Gluon: recursion over the tree, one block call per node."""

    def __init__(self, node, head):
        self.node, self.head = node, head

    def node_block(self, arity):
        return self.node

    def encode(self, tree, ids):
        states = [self.encode(child, ids) for child in tree.children]
        return self.node_block(len(states))(ids[tree.idx:tree.idx + 1],
                                            [h for h, _ in states], [c for _, c in states])

    def __call__(self, pairs, deadline=None):
        import mxnet as mx
        outs = []
        for a_ids, a_tree, b_ids, b_tree in pairs:
            ha = self.encode(a_tree, _to_device(a_ids))[0]
            hb = self.encode(b_tree, _to_device(b_ids))[0]
            outs.append(self.head(ha, hb))
            if deadline is not None and time.perf_counter() >= deadline:
                break
        return outs[0] if len(outs) == 1 else mx.nd.concat(*outs, dim=0)


class HybridPerSampleForm(PerSampleForm):
    """The same recursion through hybridized (CachedOp) blocks.  A hybridized
    Gluon block fixes the structure of its arguments, so there is one
    hybridized ``TreeLSTMNode`` per child count, all sharing the one set of
    parameters.  Each mode uses the hybridize flags measured fastest for it
    on MXNet 1.9.1: ``static_alloc`` + ``static_shape`` for inference, plain
    ``hybridize()`` under autograd (static shapes made training ~3x slower)."""

    FLAGS = {False: {'static_alloc': True, 'static_shape': True}, True: {}}

    def __init__(self, node, head, vocab_size):
        from gluon_dynbatch.models import Similarity, TreeLSTMNode
        import mxnet as mx
        self.autograd = mx.autograd
        self.base, self.vocab_size = node, vocab_size
        self.TreeLSTMNode = TreeLSTMNode
        self.by_arity = {}
        # a leaf's hybridized graph reads no child state, so Gluon warns that
        # the h2h weights are unused in it: true, and expected
        warnings.filterwarnings('ignore', message=r'Parameter .*h2h.* is not used by any '
                                'computation', category=UserWarning)
        self.heads = {}
        for training, flags in self.FLAGS.items():
            head_h = Similarity(SIM_HIDDEN, CLASSES, in_units=HIDDEN, prefix=head.prefix,
                                params=head.collect_params())
            head_h.hybridize(**flags)
            self.heads[training] = head_h
        super().__init__(node, None)

    def node_block(self, arity):
        key = (self.training, arity)
        block = self.by_arity.get(key)
        if block is None:
            block = self.TreeLSTMNode(self.vocab_size, EMBED, HIDDEN, prefix=self.base.prefix,
                                      sparse_grad=self.base.embedding._kwargs['sparse_grad'],
                                      params=self.base.collect_params())
            block.hybridize(**self.FLAGS[self.training])
            self.by_arity[key] = block
        return block

    def __call__(self, pairs, deadline=None):
        self.training = self.autograd.is_recording()
        self.head = self.heads[self.training]
        return super().__call__(pairs, deadline)


class HandForm:
    def __init__(self, model):
        self.model = model

    def __call__(self, pairs, deadline=None):
        return self.model(pairs)


class DynBatchForm:
    """The per-sample recursion, unchanged, inside a ``batching`` scope.

    With ``measure_loop`` set (:func:`record_wall`), a call is
    :meth:`measured`."""
    measure_loop = False

    def __init__(self, dyb, dnode, dhead, strategy):
        self.dyb, self.dnode, self.dhead, self.strategy = dyb, dnode, dhead, strategy
        self.last_body_ms = self.last_loop_ms = None
        self.loop_first = False

    def encode(self, tree, ids):
        states = [self.encode(child, ids) for child in tree.children]
        return self.dnode(ids[tree.idx:tree.idx + 1],
                          [h for h, _ in states], [c for _, c in states])

    def user_loop(self, pairs):
        """The user's loop: every pair's head call over its two trees."""
        return [self.dhead(self.encode(a_tree, a_ids)[0], self.encode(b_tree, b_ids)[0])
                for a_ids, a_tree, b_ids, b_tree in pairs]

    def __call__(self, pairs, deadline=None):
        if self.measure_loop:
            return self.measured(pairs)
        with self.dyb.batching(self.strategy):
            preds = self.user_loop(pairs)
        return self.dyb.concat_rows(preds)

    def measured(self, pairs):
        """A call that also leaves, in milliseconds, ``last_body_ms``: the
        scope from its opening through its exit, the user's loop inside it
        included, less what its flushes spent planning, compiling and
        running (so recording, and each flush's taking of its calls and
        bookkeeping); and ``last_loop_ms``, :meth:`loop_alone` on the same
        pairs, alternately before the scope opens and after it closes.
        Their difference is what recording adds to the loop in wall time."""
        self.loop_first = not self.loop_first
        if self.loop_first:
            self.last_loop_ms = self.loop_alone(pairs)
        flushed = _flush_ms(self.dyb.stats())
        start = time.perf_counter()
        with self.dyb.batching(self.strategy):
            preds = self.user_loop(pairs)
        scope_ms = (time.perf_counter() - start) * 1e3
        self.last_body_ms = scope_ms - (_flush_ms(self.dyb.stats()) - flushed)
        if not self.loop_first:
            self.last_loop_ms = self.loop_alone(pairs)
        return self.dyb.concat_rows(preds)

    def loop_alone(self, pairs):
        """This form's recursion over ``pairs`` with its blocks replaced by
        functions that return at once: the user's own loop, with no library
        in it (the cyclic collector paused, as in a scope), in
        milliseconds."""
        saved = self.dnode, self.dhead
        self.dnode, self.dhead = _RETURN_PAIR, _RETURN_ONE
        enabled = gc.isenabled()
        gc.disable()
        try:
            start = time.perf_counter()
            self.user_loop(pairs)
            return (time.perf_counter() - start) * 1e3
        finally:
            if enabled:
                gc.enable()
            self.dnode, self.dhead = saved


def _RETURN_PAIR(*_):    # pylint: disable=invalid-name
    return 0, 0


def _RETURN_ONE(*_):     # pylint: disable=invalid-name
    return 0


def _flush_ms(stats):
    """Host milliseconds the flushes counted in ``stats`` took."""
    return stats['analyse_ms'] + stats['compile_ms'] + stats['run_ms']


class PurePythonForm(DynBatchForm):
    """``dynbatch-auto`` with the C fast paths off (gluon_dynbatch.accel):
    the same strategy, recorded and run by the pure-Python reference code."""

    def __call__(self, pairs, deadline=None):
        self.dyb.accel.enable(False)
        try:
            return super().__call__(pairs, deadline)
        finally:
            self.dyb.accel.enable(True)


# ==========================================================================
# Data
# ==========================================================================

def load_data(args):
    """Shuffled SICK test pairs as (a_ids, a_tree, b_ids, b_tree), their
    targets, the vocabulary size and an embedding matrix."""
    import numpy as np
    from gluon_dynbatch.data import sick
    from gluon_dynbatch.models import sick_target

    try:
        folder = sick.find_sick_dir(args.data)
        splits = [sick.load_split(folder, s) for s in sick.SPLITS]
    except (OSError, ValueError) as err:     # no data, or malformed files: say which
        print('error: %s' % err, file=sys.stderr)
        raise SystemExit(2) from None
    vocab = sick.build_vocab(splits)
    test = splits[sick.SPLITS.index('test')]
    sick.index_pairs(test, vocab)
    order = np.random.RandomState(args.seed).permutation(len(test))
    test = [test[i] for i in order]
    items = [(p.a_ids.astype(np.float32), p.a_tree, p.b_ids.astype(np.float32), p.b_tree)
             for p in test]
    targets = sick_target([p.score for p in test], CLASSES)
    embedding, _ = sick.make_embedding_matrix(vocab, EMBED, seed=args.seed)
    return folder, items, targets, len(vocab), embedding


def tree_counts(items):
    """Nodes, internal nodes and child edges over all trees of ``items``, and
    the set of child counts seen."""
    nodes = internal = edges = 0
    arities = set()
    for _, a_tree, _, b_tree in items:
        stack = [a_tree, b_tree]
        while stack:
            t = stack.pop()
            k = len(t.children)
            nodes += 1
            edges += k
            internal += k > 0
            arities.add(k)
            stack.extend(t.children)
    return nodes, internal, edges, arities


def parse_setting(name):
    """``'infer B=25'``, ``'train B=256 same'``, ... as (name, mode, size);
    any minibatch size, not only those of the full run: the type of
    ``--settings``, so that a malformed one is a usage error before MXNet
    loads."""
    parts = name.split()
    try:
        mode, size = parts[0], int(parts[1][2:])
        valid = mode in ('infer', 'train') and parts[1][:2] == 'B=' and size > 0 and \
            parts[2:] in ([], [SAME_SUFFIX.strip()])
    except (IndexError, ValueError):
        valid = False
    if not valid:
        raise argparse.ArgumentTypeError(
            "unknown setting %r: write 'infer B=<size>' or 'train B=<size>' (size >= 1), "
            "with ' same' to run one minibatch again and again (the full run: %s)"
            % (name, ', '.join(s[0] for s in FULL_SETTINGS)))
    return ' '.join(parts), mode, size


def covering_pairs(items):
    """A few pairs that together hold every child count of the data: used to
    warm every form up (trace dynbatch signatures, build hybridized blocks)."""
    chosen, seen = [], set()
    for item in items:
        _, _, _, arities = tree_counts([item])
        if arities - seen:
            chosen.append(item)
            seen |= arities
    return chosen


# ==========================================================================
# Running a minibatch
# ==========================================================================

def run_minibatch(ctx, form, mode, pairs, targets, deadline=None, wait=True):
    """One inference or training step; returns the number of pairs done.
    A training step waits for its backward pass and update to finish unless
    ``wait`` is False (then the next step's Python work overlaps them)."""
    mx = ctx.mx
    if mode == 'infer':
        logp = form(pairs, deadline)
        logp.asnumpy()
        return logp.shape[0]
    with mx.autograd.record():
        logp = form(pairs, deadline)
        n = logp.shape[0]
        loss = -(logp * _to_device(targets[:n])).sum()
    loss.backward()
    ctx.trainer.step(n, ignore_stale_grad=True)
    if wait:
        mx.nd.waitall()
    return n


def grads_of(ctx, form, pairs, weights):
    """Log-probs and every parameter's gradient for loss = -sum(w * logp)."""
    mx = ctx.mx
    with mx.autograd.record():
        logp = form(pairs)
        loss = -(logp * _to_device(weights)).sum()
    loss.backward()
    grads = {name: p.grad().asnumpy().copy() for name, p in ctx.params.items()
             if p.grad_req != 'null'}
    return logp.asnumpy(), grads


def check_equivalence(ctx, items, n_batches, batch, tol):
    """Every form against ``per-sample``: log-probs (absolute) and gradients
    (relative to the largest entry of each reference gradient)."""
    import numpy as np
    rng = np.random.RandomState(1)
    report = {'tolerance': tol, 'minibatches': n_batches, 'pairs_per_minibatch': batch,
              'reference': PER_SAMPLE, 'forms': {}, 'failures': []}
    for b in range(n_batches):
        pairs = items[b * batch:(b + 1) * batch]
        weights = rng.dirichlet(np.ones(CLASSES), size=len(pairs)).astype(np.float32)
        ref_logp, ref_grads = grads_of(ctx, ctx.forms[PER_SAMPLE], pairs, weights)
        for name in ctx.order:
            if name == PER_SAMPLE:
                continue
            logp, grads = grads_of(ctx, ctx.forms[name], pairs, weights)
            entry = report['forms'].setdefault(
                name, {'max_logp_abs_diff': 0.0, 'max_grad_rel_diff': 0.0, 'worst_param': None})
            if logp.shape != ref_logp.shape:
                report['failures'].append('%s: log-probs of shape %s, expected %s'
                                          % (name, logp.shape, ref_logp.shape))
                continue
            d = float(np.max(np.abs(logp - ref_logp)))
            entry['max_logp_abs_diff'] = max(entry['max_logp_abs_diff'], d)
            if not d <= tol:
                report['failures'].append('%s: minibatch %d log-probs differ by %.3g (> %g)'
                                          % (name, b, d, tol))
            for pname, ref in ref_grads.items():
                scale = max(float(np.max(np.abs(ref))), 1e-6)
                rel = float(np.max(np.abs(grads[pname] - ref))) / scale
                if rel > entry['max_grad_rel_diff'] or entry['worst_param'] is None:
                    entry['max_grad_rel_diff'] = max(entry['max_grad_rel_diff'], rel)
                    entry['worst_param'] = pname
                if not rel <= tol:
                    report['failures'].append(
                        '%s: minibatch %d gradient of %s differs by %.3g of its largest entry '
                        '(> %g)' % (name, b, pname, rel, tol))
    report['passed'] = not report['failures']
    return report


# ==========================================================================
# Physical limit: GEMMs only
# ==========================================================================

def distinct_tokens_per_pair(items, batch, same=False):
    """Distinct token ids per pair in a minibatch of ``batch`` pairs (mean
    over the split's consecutive minibatches, as the timings walk it; with
    ``same`` the first minibatch's, which those settings time again and
    again): the rows of ``i2h`` an implementation that runs it once per
    distinct token of a minibatch computes (SICK test: ~6.4 at 25, ~2.9 at
    256, ~1.5 at 1,024, against ~19.3 nodes).  A minibatch larger than the
    split repeats its pairs, and no tokens."""
    import numpy as np
    starts = [0] if same or batch >= len(items) else range(0, len(items) - batch + 1, batch)
    counts = [len(np.unique(np.concatenate([np.concatenate((a, b))
                                            for a, _, b, _ in items[start:start + batch]])))
              for start in starts]
    return float(np.mean(counts)) / batch


def gemm_limit(mx, items, settings=(), rows=2048, seconds=0.25):
    """FLOPs of the model's matrix products per pair (from the real trees) and
    the best time those GEMMs can take at ``rows`` rows on this machine;
    and, per setting of ``settings``, the same with ``i2h`` run once per
    distinct token of a minibatch (``per_setting``), the bound of the
    fastest forms, which compute no more (``i2h`` is ~77% of the FLOPs of
    every node's)."""
    import numpy as np
    nodes, internal, edges, _ = tree_counts(items)
    n_pairs = len(items)
    # (name, in, out, rows per pair)
    gemms = [('i2h', EMBED, 4 * HIDDEN, nodes / n_pairs),
             ('h2h_iou', HIDDEN, 3 * HIDDEN, internal / n_pairs),
             ('h2h_f', HIDDEN, HIDDEN, edges / n_pairs),
             ('sim_wh', 2 * HIDDEN, SIM_HIDDEN, 1.0),
             ('sim_wp', SIM_HIDDEN, CLASSES, 1.0)]
    out = {'rows_timed': rows, 'gemms': {}}
    flops = t_pair = 0.0
    per_row = {}            # GEMM -> (seconds per row, FLOPs per row)
    for name, k, n, per_pair in gemms:
        x = mx.nd.array(np.random.RandomState(0).uniform(-1, 1, (rows, k)))
        w = mx.nd.array(np.random.RandomState(1).uniform(-1, 1, (n, k)))
        b = mx.nd.zeros((n,))
        for _ in range(3):
            mx.nd.FullyConnected(x, w, b, num_hidden=n).wait_to_read()
        reps, tic = 0, time.perf_counter()
        while True:
            mx.nd.FullyConnected(x, w, b, num_hidden=n).wait_to_read()
            reps += 1
            if time.perf_counter() - tic >= seconds and reps >= 5:
                break
        per_call = (time.perf_counter() - tic) / reps
        f = 2.0 * k * n
        per_row[name] = (per_call / rows, f)
        out['gemms'][name] = {'shape': '(%d,%d)x(%d,%d)' % (rows, k, k, n),
                              'rows_per_pair': per_pair, 'flops_per_row': f,
                              'gflops': f * rows / per_call / 1e9}
        flops += f * per_pair
        t_pair += per_call / rows * per_pair
    out['flops_per_pair_infer'] = flops
    out['flops_per_pair_train'] = 3 * flops
    out['effective_gflops'] = flops / t_pair / 1e9
    out['pairs_per_s'] = {'infer': 1.0 / t_pair, 'train': 1.0 / (3 * t_pair)}
    out['per_setting'] = {}
    i2h_time, i2h_flops = per_row['i2h']
    for sname, mode, batch in settings:
        i2h_rows = distinct_tokens_per_pair(items, batch, same=sname.endswith(SAME_SUFFIX))
        scale = 3 if mode == 'train' else 1
        saved = nodes / n_pairs - i2h_rows        # i2h rows a pair need not compute
        out['per_setting'][sname] = {
            'i2h_rows_per_pair': i2h_rows,
            'flops_per_pair': scale * (flops - saved * i2h_flops),
            'pairs_per_s': 1.0 / (scale * (t_pair - saved * i2h_time))}
    return out


def limit_of(limit, sname, distinct=False):
    """Pairs/s of the GEMM-bound limit for setting ``sname``: every node's
    ``i2h``, or with ``distinct`` once per distinct token (where known)."""
    per = limit.get('per_setting', {}).get(sname)
    if distinct:
        return per['pairs_per_s'] if per else None
    return limit['pairs_per_s']['train' if sname.startswith('train') else 'infer']


# ==========================================================================
# Timing
# ==========================================================================

def time_cell(ctx, name, mode, batch, items, targets, start, budget, same=False):
    """Run minibatches of ``name`` from position ``start`` until ``budget``
    seconds have passed (at least one); returns (pairs, seconds, cut).  With
    ``same`` the minibatch at ``start`` runs every time.  Training steps run
    back to back and the time ends when the last has finished, unless
    ``ctx.sync_train`` (each step waits for its own end)."""
    form = ctx.forms[name]
    wait = mode != 'train' or ctx.sync_train
    cut = name in ctx.can_cut
    n_items = len(items)
    pos, done, partial = start, 0, False
    cpu0 = time.process_time()
    tic = time.perf_counter()
    deadline = tic + budget
    # per-sample backward takes ~2x the forward: stop the forward early
    cut_at = tic + (budget * TRAIN_FORWARD_SHARE if mode == 'train' else budget)
    while True:
        idx = [(pos + i) % n_items for i in range(batch)]
        pairs = [items[i] for i in idx]
        n = run_minibatch(ctx, form, mode, pairs, targets[idx], cut_at if cut else None, wait)
        partial |= n < batch
        done += n
        if not same:
            pos = (pos + n) % n_items
        if time.perf_counter() >= deadline:
            break
    ctx.mx.nd.waitall()
    wall = time.perf_counter() - tic
    return done, wall, partial, (time.process_time() - cpu0) / wall


def measure(ctx, items, targets, settings, repeats, budget, max_batch_s):
    import numpy as np
    dyb = ctx.dyb
    results = {name: {} for name in ctx.measured}
    rates = {}   # (form, mode) -> last pairs/s, for the skip estimate
    n_items = len(items)
    for number, (sname, mode, batch) in enumerate(settings):
        same = sname.endswith(SAME_SUFFIX)
        # Each setting and repeat starts elsewhere in the split (offsets that
        # are not multiples of the minibatch size), so that a dynbatch form
        # meets a structure again only where it truly repeats: not because
        # training walks the minibatches that inference just ran.
        offset = 389 * number
        active = []
        for name in ctx.measured:
            est = rates.get((name, mode))
            if name not in ctx.can_cut and est and batch / est > max_batch_s:
                results[name][sname] = {
                    'skipped': 'one minibatch of %d estimated at %.1f s (> --max-batch-s %g)'
                               % (batch, batch / est, max_batch_s)}
                continue
            active.append(name)
        # warm-up: one (time-boxed) minibatch per form at this setting
        for name in active:
            time_cell(ctx, name, mode, batch, items, targets,
                      0 if same else (offset + 4001) % n_items, min(budget, 0.3), same)
        cells = {name: {'pairs': [], 'seconds': [], 'cpu_per_wall': [], 'partial': False,
                        'dyb': []}
                 for name in active}
        for rep in range(repeats):
            start = 0 if same else (offset + rep * 997) % n_items
            shift = rep % max(1, len(active))
            for name in active[shift:] + active[:shift]:
                dyb.reset_stats()
                pairs, secs, partial, cpu = time_cell(ctx, name, mode, batch, items, targets,
                                                      start, budget, same)
                cell = cells[name]
                cell['cpu_per_wall'].append(cpu)
                cell['pairs'].append(pairs)
                cell['seconds'].append(secs)
                cell['partial'] |= partial
                if name.startswith(DYB_PREFIX):
                    st = dyb.stats()
                    st.pop('last', None)
                    st['wall_ms'] = secs * 1e3
                    cell['dyb'].append(st)
        for name in active:
            if name.startswith(DYB_PREFIX):
                cells[name]['record_wall'] = record_wall(ctx, name, mode, batch, items, targets,
                                                         offset, budget, same)
        line = []
        for name in active:
            cell = cells[name]
            per_rep = [p / s for p, s in zip(cell['pairs'], cell['seconds'])]
            cell['pairs_per_s_repeats'] = per_rep
            cell['pairs_per_s'] = float(np.median(per_rep))
            rates[(name, mode)] = cell['pairs_per_s']
            if cell['dyb']:
                cell['dynbatch_split'] = dyb_split(cell['dyb'], sum(cell['pairs']), batch,
                                                   cell.pop('record_wall'))
            del cell['dyb']
            results[name][sname] = cell
            line.append('%s %.0f' % (name, cell['pairs_per_s']))
        print('  %-13s %s' % (sname, ' | '.join(line)), flush=True)
    return results


def record_wall(ctx, name, mode, batch, items, targets, offset, budget, same, count=7):
    """(scope less its flushes' planning and running, user's loop alone)
    milliseconds on ``count`` minibatches (fewer past ``budget`` seconds),
    from :meth:`DynBatchForm.measured`, which runs the loop alone on the
    same pairs right before or right after the scope, in turn, so that both
    meet the caches a step leaves.  With ``same`` the minibatch the cell
    repeats.  These minibatches are not timed."""
    form = ctx.forms[name]
    form.measure_loop = True
    pairs_at = 0 if same else (offset + 211) % len(items)
    out = []
    deadline = time.perf_counter() + budget
    try:
        while len(out) < count and (not out or time.perf_counter() < deadline):
            idx = [(pairs_at + i) % len(items) for i in range(batch)]
            run_minibatch(ctx, form, mode, [items[i] for i in idx], targets[idx])
            out.append((form.last_body_ms, form.last_loop_ms))
            if not same:
                pairs_at = (pairs_at + batch) % len(items)
    finally:
        form.measure_loop = False
    return out


def load_report(results, load_start, load_end, cpu_share):
    """Was the machine busy?  With the NaiveEngine and one thread this process
    should get a whole core (CPU time / wall ~ 1) while it times; much less
    means other work competed and the numbers are low."""
    shares = sorted(s for cells in results.values() for cell in cells.values()
                    for s in cell.get('cpu_per_wall', []))
    low = [s for s in shares if s < 0.85]
    summary = ('machine load: 1-min load average %.2f at start of timing, %.2f at end; this '
               'process used %.2f CPU-s per wall-s while timing' % (load_start[0], load_end[0],
                                                                  cpu_share))
    if shares:
        summary += ' (per timed run: min %.2f, median %.2f)' % (shares[0],
                                                                shares[len(shares) // 2])
    if low and os.environ.get('MXNET_ENGINE_TYPE') == 'NaiveEngine':
        summary += ('\nWARNING: %d of %d timed runs got less than 0.85 of a core: other '
                    'processes competed for the CPU; those numbers are low.'
                    % (len(low), len(shares)))
    return {'loadavg_start': load_start, 'loadavg_end': load_end,
            'cpu_per_wall': cpu_share, 'runs_below_0.85_core': len(low), 'runs': len(shares),
            'summary': summary}


def dyb_split(stats_list, pairs, batch, walls=()):
    """Where a dynbatch minibatch's time goes: record (the recorder's own
    time, by its clock), analysis (planning), compile (when reported), run
    (batched execution of the forward), other (the rest of the wall time:
    the user's loop, reading results, backward and the optimizer step when
    training).  ``record_wall`` is what recording adds to the user's loop
    in wall time (the median over ``walls``, :func:`record_wall`'s pairs,
    of the scope less its flushes' planning and running, less the loop
    alone), as a share of the mean minibatch: more than ``record``, for it
    also holds the loop handling the lazy values the calls return, the
    caches the recorded calls take, and each flush's taking of its calls
    and bookkeeping."""
    keys = ('record_ms', 'analyse_ms', 'compile_ms', 'run_ms')
    tot = {k: sum(float(s.get(k, 0.0) or 0.0) for s in stats_list) for k in keys}
    wall = sum(s['wall_ms'] for s in stats_list)
    flushes = sum(int(s.get('flushes', 0) or 0) for s in stats_list)
    steps = sum(int(s.get('steps', 0) or 0) for s in stats_list)
    nodes = sum(int(s.get('nodes', 0) or 0) for s in stats_list)
    split = {k[:-3]: tot[k] / wall for k in keys}
    split['other'] = max(0.0, 1.0 - sum(split.values()))
    # (a pipelined scope, batching(flush_every=...), runs several flushes a minibatch)
    minibatches = max(1, -(-pairs // batch))
    choices = {}
    for s in stats_list:
        for k, v in (s.get('choices') or {}).items():
            choices[k] = choices.get(k, 0) + v
    record_wall = _median([body - loop for body, loop in walls])
    if record_wall is not None:
        split['record_wall'] = record_wall / (wall / minibatches)
    return {'auto_choices': choices or None, 'fraction_of_wall': split,
            'ms_per_minibatch': {**{k[:-3]: tot[k] / minibatches for k in keys},
                                 'wall': wall / minibatches, 'record_wall': record_wall,
                                 'user_loop': _median([loop for _, loop in walls])},
            'flushes': flushes, 'flushes_per_minibatch': flushes / minibatches,
            'steps_per_flush': steps / max(1, flushes), 'steps_per_minibatch': steps / minibatches,
            'nodes_per_step': nodes / max(1, steps), 'pairs': pairs, 'batch': batch}


# ==========================================================================
# Reporting
# ==========================================================================

def paired_ratio(cell, other):
    """``cell``'s speed over ``other``'s: the median over repeats of the
    ratio within each repeat, where the two ran seconds apart (the ratio of
    the medians when their repeats do not pair up), or None."""
    if not other or not other.get('pairs_per_s'):
        return None
    mine, theirs = cell.get('pairs_per_s_repeats'), other.get('pairs_per_s_repeats')
    if mine and theirs and len(mine) == len(theirs) and all(theirs):
        return _median([a / b for a, b in zip(mine, theirs)])
    return cell['pairs_per_s'] / other['pairs_per_s']


def add_ratios(results, limit):
    for name, cells in results.items():
        for sname, cell in cells.items():
            if 'pairs_per_s' not in cell:
                continue
            for key, ref in (('x_per_sample_hybrid', HYBRID), ('x_hand_batched', HAND),
                             ('x_hand_unique', HAND_UNIQUE)):
                cell[key] = paired_ratio(cell, results.get(ref, {}).get(sname))
            cell['fraction_of_limit'] = cell['pairs_per_s'] / limit_of(limit, sname)
            distinct = limit_of(limit, sname, distinct=True)
            cell['fraction_of_distinct_limit'] = \
                cell['pairs_per_s'] / distinct if distinct else None


def format_table(results, settings, limit):
    names = [s[0] for s in settings]
    width = max(12, max(len(n) for n in names) + 1)
    rows = ['%-22s %-11s' % ('form', 'metric') + ''.join('%*s' % (width, n) for n in names)]
    rows.append('-' * len(rows[0]))

    def fmt(v, kind):
        if v is None:
            return 'n/a'
        if kind == 'rate':
            return '%.0f' % v if v >= 10 else '%.2f' % v
        if kind == 'x':
            return '%.2fx' % v
        return '%.2f%%' % (100 * v)

    metrics = [('pairs/s', 'pairs_per_s', 'rate'), ('x hybrid', 'x_per_sample_hybrid', 'x'),
               ('x hand', 'x_hand_batched', 'x'), ('x hand-uniq', 'x_hand_unique', 'x'),
               ('of limit', 'fraction_of_limit', '%'),
               ('of lim-uniq', 'fraction_of_distinct_limit', '%')]
    for name, cells in results.items():
        for i, (label, key, kind) in enumerate(metrics):
            vals = []
            for sname in names:
                cell = cells.get(sname, {})
                if 'skipped' in cell:
                    vals.append('skipped' if i == 0 else '')
                elif not cell:
                    vals.append('')
                else:
                    v = fmt(cell.get(key), kind)
                    if i == 0 and cell.get('partial'):
                        v += '*'
                    vals.append(v)
            rows.append('%-22s %-11s' % (name if i == 0 else '', label)
                        + ''.join('%*s' % (width, v) for v in vals))
    rows.append('%-22s %-11s' % ('GEMM limit', 'pairs/s') + ''.join(
        '%*s' % (width, fmt(limit_of(limit, n), 'rate')) for n in names))
    rows.append('%-22s %-11s' % ('GEMM lim-uniq', 'pairs/s') + ''.join(
        '%*s' % (width, fmt(limit_of(limit, n, distinct=True), 'rate')) for n in names))
    rows.append('* per-sample forms stop mid-minibatch when the time budget runs out '
                '(pairs/s over the pairs done); GEMM limit: every node\'s i2h; lim-uniq: i2h '
                'once per distinct token of a minibatch')
    return '\n'.join(rows)


FORM_LABELS = {
    PER_SAMPLE: 'per-sample Gluon', HYBRID: 'per-sample, hybridized',
    HAND: 'hand-batched MXNet', HAND_UNIQUE: 'hand-batched, i2h once per distinct token',
    'dynbatch-per-sample': 'gluon_dynbatch per-sample', DYB_PURE: 'auto without the C extension',
}


def throughput_rows(result):
    """The results table as rows of strings (header first): pairs/s per
    form and setting, then the GEMM limit and (where the run measured it)
    the one with ``i2h`` once per distinct token.  One source for the Markdown
    file the benchmark writes (``results.md``, for the README) and the
    table the docs build from ``results.json`` (``docs/conf.py``)."""
    names = [s['name'] for s in result['settings']]
    rows = [['form'] + names]
    for form, cells in result['results'].items():
        label = FORM_LABELS.get(form)
        if label is None:
            label = ('gluon_dynbatch ' + form[len(DYB_PREFIX):]) if form.startswith(DYB_PREFIX) \
                else form
        row = [label]
        for name in names:
            cell = cells.get(name, {})
            rate = cell.get('pairs_per_s')
            row.append('-' if 'skipped' in cell or rate is None else
                       '{:,.0f}'.format(rate) + ('*' if cell.get('partial') else ''))
        rows.append(row)
    limit = result['limit']
    rows.append(['GEMM-bound limit'] + ['{:,.0f}'.format(limit_of(limit, name))
                                        for name in names])
    if limit.get('per_setting'):
        rows.append(['GEMM-bound limit, i2h once per distinct token'] + [
            '{:,.0f}'.format(limit_of(limit, name, distinct=True)) for name in names])
    return rows


def caption(result):
    """One line: where and how the table was measured."""
    cfg = result['config']
    return ('%s, %d cores, MXNet %s, %s, %d thread(s), %s allocator, %s embedding gradients, '
            '%s; %s; %s; %.0f s.  *: per-sample form stopped mid-minibatch at the time budget; '
            '-: skipped.' % (cfg.get('cpu'), cfg.get('cores_available') or 0, cfg.get('mxnet'),
                             cfg.get('engine'), cfg.get('threads') or 0, cfg.get('allocator'),
                             result['model']['embedding_grad'], result['model']['optimizer'],
                             TRAIN_TIMING[bool(result['timing'].get('sync_train', True))],
                             result['timing']['statistic'], result.get('elapsed_s') or 0))


def markdown_table(result):
    rows = throughput_rows(result)
    lines = ['| ' + ' | '.join(rows[0]) + ' |',
             '|---' + '|---:' * (len(rows[0]) - 1) + '|']
    lines += ['| ' + ' | '.join(row) + ' |' for row in rows[1:]]
    return 'Pairs/s.  %s\n\n%s\n' % (caption(result), '\n'.join(lines))


def format_split(results, settings):
    lines = ['dynbatch time split (fraction of wall time per minibatch: record / analyse / '
             'compile / run / other; record by the recorder\'s clock, other = the user\'s loop, '
             'reading results, backward + optimizer in training; then record (wall), what '
             'recording adds to the user\'s loop in wall time)']
    for name, cells in results.items():
        if not name.startswith(DYB_PREFIX):
            continue
        for sname, _, _ in settings:
            sp = cells.get(sname, {}).get('dynbatch_split')
            if not sp:
                continue
            f = sp['fraction_of_wall']
            wall = f.get('record_wall')
            lines.append('  %-22s %-13s %5.1f%% %5.1f%% %5.1f%% %5.1f%% %5.1f%%  record (wall) %s'
                         '   %.2f ms/mb, %.0f steps/mb%s, %.1f nodes/step%s'
                         % (name, sname, 100 * f['record'], 100 * f['analyse'],
                            100 * f['compile'], 100 * f['run'], 100 * f['other'],
                            '-' if wall is None else '%4.1f%%' % (100 * wall),
                            sp['ms_per_minibatch']['wall'], sp['steps_per_minibatch'],
                            ' in %.1f flushes' % sp['flushes_per_minibatch']
                            if sp['flushes_per_minibatch'] > 1.05 else '',
                            sp['nodes_per_step'],
                            ', chose %s' % sp['auto_choices'] if sp['auto_choices'] else ''))
    return '\n'.join(lines)


def plot(results, settings, limit, path):
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    import numpy as np

    names = [s[0] for s in settings]
    forms = list(results)
    fig, ax = plt.subplots(figsize=(max(9, 1.9 * len(names) + 4), 5.5))
    width = 0.8 / max(1, len(forms))
    x = np.arange(len(names))
    colors = plt.get_cmap('tab10')
    for j, form in enumerate(forms):
        vals = [results[form].get(n, {}).get('pairs_per_s', np.nan) for n in names]
        pos = x - 0.4 + width * (j + 0.5)
        ax.bar(pos, vals, width, label=form, color=colors(j % 10))
        for i, n in enumerate(names):
            if 'skipped' in results[form].get(n, {}):
                ax.text(pos[i], 0.02, 'skipped', rotation=90, ha='center', va='bottom',
                        fontsize=7, color=colors(j % 10), transform=ax.get_xaxis_transform())
    for i, n in enumerate(names):
        ax.hlines(limit_of(limit, n), i - 0.45, i + 0.45, colors='k', linestyles='--',
                  linewidth=1, label='GEMM limit' if i == 0 else None)
        distinct = limit_of(limit, n, distinct=True)
        if distinct:
            ax.hlines(distinct, i - 0.45, i + 0.45, colors='k', linestyles=':', linewidth=1,
                      label='GEMM limit, i2h per distinct token' if i == 0 else None)
    ax.set_yscale('log')
    ax.set_xticks(x)
    ax.set_xticklabels(names)
    ax.set_ylabel('pairs / s (log scale)')
    ax.set_title('Child-sum Tree-LSTM on SICK test: throughput by form (higher is better)')
    ax.grid(axis='y', which='both', alpha=0.3)
    ax.legend(fontsize=8, loc='upper left', bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ==========================================================================
# Settings sweep (subprocesses; no MXNet in this process)
# ==========================================================================

SWEEP_COMBOS = [(1, 'NaiveEngine'), (2, 'NaiveEngine'), (1, 'ThreadedEnginePerDevice'),
                (2, 'ThreadedEnginePerDevice')]
_SHORT_ENGINE = {'NaiveEngine': 'Naive', 'ThreadedEnginePerDevice': 'ThreadedPerDev',
                 'ThreadedEngine': 'Threaded'}


def _median(values):
    return statistics.median(values) if values else None


def run_sweep(args):
    """Each threads x engine combination in its own subprocess (MXNet reads
    them at load), ``--sweep-rounds`` rounds with the combinations
    interleaved; a cell is the median over rounds."""
    os.makedirs(args.out, exist_ok=True)
    runs = {}    # label -> list of results.json contents
    loads = {}   # label -> list of machine_load summaries
    labels = ['t%d %s' % (t, _SHORT_ENGINE[e]) for t, e in SWEEP_COMBOS]
    print('settings sweep: threads {1,2} x engine {NaiveEngine, ThreadedEnginePerDevice}, '
          'subset %s, %d round(s), one subprocess per run'
          % ([s[0] for s in SWEEP_SETTINGS], args.sweep_rounds), flush=True)
    for rnd in range(args.sweep_rounds):
        for (threads, engine), label in zip(SWEEP_COMBOS, labels):
            sub_out = os.path.join(args.out, 'sweep', 'round%d-t%d-%s' % (rnd, threads, engine))
            cmd = [sys.executable, os.path.abspath(__file__), '--sweep-child', '--threads',
                   str(threads), '--engine', engine, '--out', sub_out, '--seed', str(args.seed)]
            if args.data:
                cmd += ['--data', args.data]
            if args.forms:
                cmd += ['--forms'] + args.forms
            if args.gc_freeze:
                cmd += ['--gc-freeze']
            if not args.sparse_grad:
                cmd += ['--dense-grad']
            print('\n=== round %d: threads=%d %s ===' % (rnd + 1, threads, engine), flush=True)
            tic = time.perf_counter()
            proc = subprocess.run(cmd, check=False)
            if proc.returncode != 0:
                print('%s: failed with exit code %d' % (label, proc.returncode), flush=True)
                continue
            with open(os.path.join(sub_out, 'results.json')) as f:
                res = json.load(f)
            runs.setdefault(label, []).append(res)
            loads.setdefault(label, []).append(res.get('machine_load', {}))
            print('(took %.0f s)' % (time.perf_counter() - tic), flush=True)
    if not runs:
        raise SystemExit('every sweep run failed')

    labels = [l for l in labels if l in runs]
    forms = []
    for res_list in runs.values():
        for res in res_list:
            forms += [f for f in res['results'] if f not in forms]
    names = [s[0] for s in SWEEP_SETTINGS]
    sweep = {'combos': {l: {'threads': t, 'engine': e}
                        for (t, e), l in zip(SWEEP_COMBOS, labels)},
             'rounds': args.sweep_rounds, 'settings': names,
             'statistic': 'median over rounds of each run\'s pairs/s; geomean over settings',
             'machine_load': loads, 'forms': {}}
    width = max(len(l) for l in labels) + 2
    print('\nsettings sweep: pairs/s, geometric mean over %s (median of %d round(s))'
          % (names, args.sweep_rounds))
    print('%-22s' % 'form' + ''.join('%*s' % (width, l) for l in labels) + '   fastest')
    for form in forms:
        per_combo = {}
        for label in labels:
            per_setting = {}
            for sname in names:
                vals = [r['results'].get(form, {}).get(sname, {}).get('pairs_per_s')
                        for r in runs[label]]
                per_setting[sname] = _median([v for v in vals if v])
            vals = [v for v in per_setting.values() if v]
            geo = (math.exp(sum(math.log(v) for v in vals) / len(vals))
                   if vals and len(vals) == len(names) else None)
            per_combo[label] = {'per_setting': per_setting, 'geomean': geo}
        valid = {l: v['geomean'] for l, v in per_combo.items() if v['geomean']}
        best = max(valid, key=valid.get) if valid else None
        best_per_setting = {}
        for sname in names:
            cand = {l: per_combo[l]['per_setting'][sname] for l in labels
                    if per_combo[l]['per_setting'][sname]}
            best_per_setting[sname] = max(cand, key=cand.get) if cand else None
        sweep['forms'][form] = {'per_combo': per_combo, 'fastest': best,
                                'fastest_per_setting': best_per_setting}
        print('%-22s' % form + ''.join(
            '%*s' % (width, '%.0f' % per_combo[l]['geomean'] if per_combo[l]['geomean']
                     else 'n/a') for l in labels) + '   ' + str(best))
    print('\nfastest per setting:')
    for form, entry in sweep['forms'].items():
        print('  %-22s %s' % (form, '; '.join('%s: %s' % kv
                                               for kv in entry['fastest_per_setting'].items())))
    print('\nCPU-s per wall-s of each run while timing (1 thread + NaiveEngine should be ~1.0; '
          'lower means the machine was busy):')
    for label in labels:
        print('  %-*s %s' % (width, label, ' '.join('%.2f' % l.get('cpu_per_wall', float('nan'))
                                                    for l in loads[label])))
    path = os.path.join(args.out, 'sweep.json')
    with open(path, 'w') as f:
        json.dump(sweep, f, indent=1)
    print('\nwrote %s' % path)


# ==========================================================================
# Main
# ==========================================================================

def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.out is None:
        args.out = QUICK_OUT if args.quick else DEFAULT_OUT
    if args.sweep_settings:
        if args.forms:          # (a misspelt one would fail in every child)
            import gluon_dynbatch as dyb  # pylint: disable=import-outside-toplevel
            check_forms(parser, args.forms, dyb)
        return run_sweep(args)
    configure_env(args)
    wall0 = time.perf_counter()

    if args.sweep_child:
        settings, repeats, budget, check_pairs = SWEEP_SETTINGS, 2, 0.5, 8
        args.no_plot = True
        args.check_batches = 1
    elif args.quick:
        settings, repeats, budget, check_pairs = QUICK_SETTINGS, 2, 0.3, 8
    else:
        settings, repeats, budget, check_pairs = FULL_SETTINGS, REPEATS, BUDGET_S, 25
    repeats = args.repeats or repeats
    budget = args.budget or budget
    check_pairs = args.check_pairs or check_pairs
    if args.settings:
        settings = args.settings      # (name, mode, size), parsed by parse_setting

    import mxnet as mx  # pylint: disable=import-outside-toplevel
    import gluon_dynbatch as dyb  # pylint: disable=import-outside-toplevel
    check_forms(parser, args.forms or (), dyb)

    config = runtime_config(args, mx)
    print('MXNet %s | engine %s | OMP_NUM_THREADS=%s | MXNET_CPU_WORKER_NTHREADS=%s | '
          'LD_PRELOAD=%r | allocator %s | %s, %s cores | gluon_dynbatch: %s'
          % (config['mxnet'], config['engine'], config['OMP_NUM_THREADS'],
             config['MXNET_CPU_WORKER_NTHREADS'], config['LD_PRELOAD'], config['allocator'],
             config['cpu'], config['cores_available'], config['dynbatch_accel']), flush=True)

    folder, items, targets, vocab_size, embedding = load_data(args)
    if args.check_batches * check_pairs > len(items):   # (a check of empty minibatches)
        parser.error('--check-batches %d x --check-pairs %d: more than the %d pairs of the '
                     'test split' % (args.check_batches, check_pairs, len(items)))
    nodes, internal, edges, arities = tree_counts(items)
    print('SICK test: %d pairs from %s, %.1f nodes/pair, child counts %s, vocab %d'
          % (len(items), folder, nodes / len(items), sorted(arities), vocab_size), flush=True)

    if args.gc_freeze:
        import gc  # pylint: disable=import-outside-toplevel
        gc.collect()
        gc.freeze()
    ctx = Forms(vocab_size, embedding, args.seed, args.forms, args.sparse_grad, args.optimizer)
    ctx.sync_train = args.sync_train
    ctx.mx = mx
    print('training: %s lr %g%s, %s embedding gradients; %s'
          % (args.optimizer, LEARNING_RATE,
             ' (dense CPU gradients: %s)' % _kernel_status() if args.optimizer == 'fusedadagrad'
             else '', 'row-sparse' if args.sparse_grad else 'dense', TRAIN_TIMING[args.sync_train]),
          flush=True)
    print('forms: %s | dynbatch strategies: %s' % (', '.join(ctx.order), list(dyb.STRATEGIES)),
          flush=True)

    # warm-up: every child count, inference and training, every form
    warm = covering_pairs(items)
    for name in ctx.order:
        for mode in ('infer', 'train'):
            run_minibatch(ctx, ctx.forms[name], mode, warm, targets[:len(warm)])

    result = {
        'benchmark': 'child-sum Tree-LSTM, SICK test', 'argv': sys.argv[1:],
        'mode': 'sweep-child' if args.sweep_child else ('quick' if args.quick else 'full'),
        'config': config,
        'data': {'folder': str(folder), 'split': 'test', 'pairs': len(items), 'seed': args.seed,
                 'nodes_per_pair': nodes / len(items), 'child_counts': sorted(arities),
                 'vocab': vocab_size},
        'model': {'embed': EMBED, 'hidden': HIDDEN, 'sim_hidden': SIM_HIDDEN,
                  'embedding_grad': 'row_sparse' if args.sparse_grad else 'dense',
                  'classes': CLASSES, 'optimizer': '%s lr %g' % (args.optimizer, LEARNING_RATE),
                  'loss': '-sum(target * logp) (KL up to a constant)'},
        'timing': {'repeats': repeats, 'budget_s': budget, 'max_batch_s': args.max_batch_s,
                   'gc_freeze': args.gc_freeze, 'sync_train': args.sync_train,
                   'statistic': 'median over repeats of pairs/s; forms interleaved per repeat; '
                                'ratios: median over repeats of the ratio within a repeat'},
        'forms': ctx.measured, 'skipped_forms': ctx.skipped,
        'dynbatch_strategies': list(dyb.STRATEGIES),
        'settings': [{'name': n, 'mode': m, 'batch': b} for n, m, b in settings],
    }
    os.makedirs(args.out, exist_ok=True)
    json_path = os.path.join(args.out, 'results.json')

    # (a) equivalence
    print('equivalence check: %d minibatches of %d pairs, tolerance %g ...'
          % (args.check_batches, check_pairs, args.tol), flush=True)
    eq = check_equivalence(ctx, items, args.check_batches, check_pairs, args.tol)
    result['equivalence'] = eq
    for name, entry in eq['forms'].items():
        print('  %-22s max |logp diff| %.2e   max grad diff %.2e of largest entry (%s)'
              % (name, entry['max_logp_abs_diff'], entry['max_grad_rel_diff'],
                 entry['worst_param']), flush=True)
    if not eq['passed']:
        with open(json_path, 'w') as f:
            json.dump(result, f, indent=1)
        bad = sorted({f.split(':')[0] for f in eq['failures']})
        print('\nERROR: %s disagree(s) with %s beyond tolerance %g; aborting before any '
              'timing (details in %s):\n  %s'
              % (', '.join(bad), PER_SAMPLE, args.tol, json_path,
                 '\n  '.join(eq['failures'])), file=sys.stderr)
        return 2
    print('  all forms agree', flush=True)

    # (b) physical limit
    limit = gemm_limit(mx, items, settings)
    result['limit'] = limit
    print('GEMM limit: %.2f MFLOP/pair forward; GEMMs at %d rows run at %s GFLOP/s -> '
          '%.0f pairs/s inference, %.0f pairs/s training (3x FLOPs); with i2h once per '
          'distinct token of a minibatch: %s'
          % (limit['flops_per_pair_infer'] / 1e6, limit['rows_timed'],
             '/'.join('%.1f' % g['gflops'] for g in limit['gemms'].values()),
             limit['pairs_per_s']['infer'], limit['pairs_per_s']['train'],
             ', '.join('%s %.0f' % (n, v['pairs_per_s'])
                       for n, v in limit['per_setting'].items())), flush=True)

    # (c) throughput
    print('timing: %d repeats x %.1f s per form per setting' % (repeats, budget), flush=True)
    load0, cpu0, tic = os.getloadavg(), time.process_time(), time.perf_counter()
    results = measure(ctx, items, targets, settings, repeats, budget, args.max_batch_s)
    add_ratios(results, limit)
    result['results'] = results
    result['machine_load'] = load_report(results, load0, os.getloadavg(),
                                         (time.process_time() - cpu0) / (time.perf_counter() - tic))
    result['elapsed_s'] = time.perf_counter() - wall0

    print()
    print(format_table(results, settings, limit))
    print()
    print(format_split(results, settings))
    print()
    print(result['machine_load']['summary'])
    with open(json_path, 'w') as f:
        json.dump(result, f, indent=1)
    print('\nwrote %s' % json_path)
    md_path = os.path.join(args.out, 'results.md')
    with open(md_path, 'w') as f:
        f.write(markdown_table(result))
    print('wrote %s (the table for the README)' % md_path)
    if not args.no_plot:
        png = os.path.join(args.out, 'throughput.png')
        plot(results, settings, limit, png)
        print('wrote %s' % png)
    print('total %.0f s' % (time.perf_counter() - wall0))
    return 0


if __name__ == '__main__':
    sys.exit(main())
