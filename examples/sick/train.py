#!/usr/bin/env python
"""Train Tai et al.'s (2015) child-sum Tree-LSTM on SICK semantic relatedness,
per sample or with just-in-time dynamic batching.

The model code is the plain per-sample recursion of the paper; the only
change that batches it is ``with dyb.batching():`` around each minibatch::

    python examples/sick/train.py                    # dynbatch, 10 epochs (20-50 s, 2 cores)
    python examples/sick/train.py --mode both --epochs 3   # per-sample vs dynbatch
    python examples/sick/train.py --epochs 1 --train-limit 500 --dev-limit 100 \
        --test-limit 100                             # a quick look

Writes ``results.json``, ``learning_curves.png`` and the best-dev checkpoint
into ``--out`` (default ``runs/sick-<mode>``).  See ``README.md`` next to this
file for measured numbers.

The training loop is importable (``build_model``, ``make_trainer``,
``train_epoch``, ``evaluate``, ``run``) so that tests can check that both
modes compute the same thing step by step.
"""
import argparse
import contextlib
import json
import math
import os
import platform
import sys
import time

MODES = ('per-sample', 'dynbatch')
DEFAULT_EPOCHS = 10
DEFAULT_TRAIN_LIMIT = 0  # 0: all 4500 training pairs
PROGRESS_LINE_EVERY_S = 30
"""Where stderr is no terminal (a file, a pipe, CI), a pass that runs longer
than this prints a plain progress line this often instead of a bar, whose
redraws would pile up there: an epoch per sample takes minutes."""
DEFAULT_EMBED_SIZE = 300  # random embeddings' size without --embed-size


def _number(kind, least, strict=False):
    """An argparse type: ``kind`` (int or float), finite and at least
    ``least`` (above it with ``strict``), else argparse's own error (exit 2,
    before MXNet loads: ``--threads`` is exported at once)."""
    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError('%r is not %s' % (
                text, 'a whole number' if kind is int else 'a number')) from None
        if not math.isfinite(value) or value < least or (strict and value == least):
            raise argparse.ArgumentTypeError('%s; give a number %s %g' % (
                text, '>' if strict else '>=', least))
        return value
    parse.__name__ = kind.__name__      # argparse names the type in its messages
    return parse


POSITIVE, COUNT = _number(int, 1), _number(int, 0)


def build_parser():
    """The command-line options (built without importing MXNet, so that
    ``--threads`` can configure it before it loads)."""
    p = argparse.ArgumentParser(
        description='Child-sum Tree-LSTM on SICK relatedness (Tai et al. 2015), per sample '
                    'or dynamically batched with gluon_dynbatch.',
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument('--data', default=None,
                   help='SICK folder holding train/ dev/ test/ (else $GLUON_DYNBATCH_SICK, '
                        'else ../shared/data/sick)%(default).0s')
    p.add_argument('--mode', choices=MODES + ('both',), default='dynbatch',
                   help="'both' trains per-sample then dynbatch from the same seed and data "
                        'order, and plots the two learning curves together')
    p.add_argument('--strategy', default='depth',
                   help="dynbatch grouping strategy (one of gluon_dynbatch.STRATEGIES); depth's "
                        "training repeats bit for bit, 'auto' picks plans by measured time, so "
                        'its gradients, and the scores after training, vary in the last digits')
    p.add_argument('--epochs', type=POSITIVE, default=DEFAULT_EPOCHS, help='training epochs')
    p.add_argument('--batch-size', type=POSITIVE, default=25,
                   help='pairs per batching scope (and per optimizer step) in training')
    p.add_argument('--eval-batch-size', type=POSITIVE, default=256,
                   help='pairs per batching scope when evaluating')
    p.add_argument('--lr', type=_number(float, 0, strict=True), default=0.05,
                   help='Adagrad learning rate')
    p.add_argument('--optimizer', choices=('fusedadagrad', 'adagrad'), default='fusedadagrad',
                   help="Adagrad as gluon_dynbatch.FusedAdaGrad (one op per parameter) or "
                        "MXNet's own (the same update, ~10 ops per dense parameter)")
    p.add_argument('--wd', type=_number(float, 0), default=1e-4,
                   help='weight decay (L2) on every parameter but the embeddings')
    p.add_argument('--seed', type=COUNT, default=0,
                   help='seeds weights, data order and random embeddings')
    p.add_argument('--embed-size', type=POSITIVE, default=None,
                   help='size of random embeddings (default 300; a --embeddings file sets '
                        'its own)%(default).0s')
    p.add_argument('--hidden-size', type=POSITIVE, default=150,
                   help="size of the Tree-LSTM's hidden state")
    p.add_argument('--sim-hidden-size', type=POSITIVE, default=50,
                   help='hidden units of the similarity head')
    p.add_argument('--embeddings', default=None,
                   help='GloVe-format text file (word v1 v2 ...) to initialise embeddings '
                        '(default: random ones of --embed-size)%(default).0s')
    p.add_argument('--freeze-embeddings', action='store_true',
                   help='do not train the embeddings (Tai et al. froze GloVe)')
    p.add_argument('--train-limit', type=COUNT, default=DEFAULT_TRAIN_LIMIT,
                   help='use only the first N training pairs (0: all)')
    p.add_argument('--dev-limit', type=COUNT, default=0, help='first N dev pairs (0: all)')
    p.add_argument('--test-limit', type=COUNT, default=0, help='first N test pairs (0: all)')
    p.add_argument('--threads', type=POSITIVE, default=1,
                   help='OpenMP threads (sets OMP_NUM_THREADS before MXNet loads)')
    p.add_argument('--out', default=None,
                   help='output folder (default: runs/sick-<mode>)%(default).0s')
    p.add_argument('--no-progress', action='store_true',
                   help='no progress output: tqdm bars on a terminal, else a line on stderr '
                        'every %d s of a long pass' % PROGRESS_LINE_EVERY_S)
    return p


def configure_env(threads):
    """Set the MXNet environment before MXNet is imported: OpenMP threads, and
    MXNet's threaded engine (``ThreadedEnginePerDevice``, MXNet's own
    default, named explicitly) unless ``MXNET_ENGINE_TYPE`` is already set.
    With one thread its worker runs the operators on the second core while
    Python records the next steps: the fastest setting for ``auto`` in the
    five latest settings sweeps on the 2-core development VMs (README.md,
    docs/performance.rst; the latest at 7546339, benchmarks/results/sweep.json),
    and this script's training ran 1.55x faster than under the NaiveEngine
    (1,141-1,296 against 774-826 pairs/s), with the same losses.

    Returns the threads used: at most the machine's cores (more only
    compete for them, and 100,000 crashed MXNet), with a warning."""
    cores = os.cpu_count() or 1
    if threads > cores:
        print('warning: --threads %d is more than the %d cores here; using %d'
              % (threads, cores, cores), file=sys.stderr)
        threads = cores
    os.environ['OMP_NUM_THREADS'] = str(threads)
    os.environ.setdefault('MXNET_ENGINE_TYPE', 'ThreadedEnginePerDevice')
    return threads


if __name__ == '__main__':
    ARGS = build_parser().parse_args()
    ARGS.threads = configure_env(ARGS.threads)

# pylint: disable=wrong-import-position
import mxnet as mx                       # noqa: E402
import numpy as np                       # noqa: E402
from mxnet import autograd, gluon        # noqa: E402
from scipy import stats as sstats        # noqa: E402
from tqdm import tqdm                    # noqa: E402

import gluon_dynbatch as dyb             # noqa: E402
from gluon_dynbatch.data.sick import (build_vocab, find_sick_dir, index_pairs,  # noqa: E402
                                      load_split, make_embedding_matrix)
from gluon_dynbatch.models.treelstm import (Similarity, TreeLSTMNode,  # noqa: E402
                                            sick_score, sick_target)

NUM_CLASSES = 5


# --------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------

class Example:
    """A SICK pair ready for the model: trees, token ids as float32 host
    arrays (what ``Embedding`` takes), gold score and Tai's sparse target."""
    __slots__ = ('a_tree', 'a_ids', 'b_tree', 'b_ids', 'score', 'target')

    def __init__(self, pair):
        self.a_tree, self.b_tree = pair.a_tree, pair.b_tree
        self.a_ids = pair.a_ids.astype(np.float32)
        self.b_ids = pair.b_ids.astype(np.float32)
        self.score = pair.score
        self.target = sick_target(pair.score, NUM_CLASSES)[0]


def load_data(data_dir, train_limit=0, dev_limit=0, test_limit=0):
    """Splits as lists of :class:`Example`, and the vocabulary.

    The vocabulary covers all three full splits, as in Tai et al., so that it
    (and so the random embedding init) does not depend on the limits.
    """
    splits = {s: load_split(data_dir, s) for s in ('train', 'dev', 'test')}
    vocab = build_vocab(splits.values())
    limits = {'train': train_limit, 'dev': dev_limit, 'test': test_limit}
    data = {}
    for split, pairs in splits.items():
        if limits[split]:
            pairs = pairs[:limits[split]]
        index_pairs(pairs, vocab)
        data[split] = [Example(p) for p in pairs]
    return data, vocab


# --------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------

class Model:
    """The two wrapped blocks: a Tree-LSTM node and the similarity head."""

    def __init__(self, node, head):
        self.node, self.head = node, head

    def params(self):
        params = self.node.collect_params()
        params.update(self.head.collect_params())
        return params

    def encode(self, tree, ids):
        """Hidden and memory state of ``tree``: plain per-sample recursion."""
        children = [self.encode(child, ids) for child in tree.children]
        return self.node(ids[tree.idx:tree.idx + 1],
                         [h for h, _ in children], [c for _, c in children])

    def predict(self, ex):
        """Log-probabilities over the 5 scores for one pair, shape (1, 5)."""
        return self.head(self.encode(ex.a_tree, ex.a_ids)[0],
                         self.encode(ex.b_tree, ex.b_ids)[0])

    def save(self, prefix):
        self.node.save_parameters(prefix + 'node.params')
        self.head.save_parameters(prefix + 'head.params')

    def load(self, prefix):
        self.node.load_parameters(prefix + 'node.params')
        self.head.load_parameters(prefix + 'head.params')


def read_embeddings(vocab, args):
    """``(matrix, tokens found)``: the ``--embeddings`` file's vectors for
    ``vocab`` (random for the rest, seeded), or all random without one."""
    return make_embedding_matrix(vocab, dim=args.embed_size or DEFAULT_EMBED_SIZE,
                                 path=args.embeddings, seed=args.seed)


def build_model(vocab, args, ctx=None, embeddings=None):
    """Seeded model: identical weights for every call with the same args.

    ``embeddings``: :func:`read_embeddings`'s result, read here when not
    given.  Returns the model and the number of vocabulary tokens found in
    the ``--embeddings`` file (0 without one).
    """
    ctx = ctx or mx.cpu()
    matrix, n_found = embeddings or read_embeddings(vocab, args)
    mx.random.seed(args.seed)
    np.random.seed(args.seed)
    node = dyb.DynBatchBlock(TreeLSTMNode(len(vocab), matrix.shape[1], args.hidden_size,
                                          sparse_grad=True))  # see TreeLSTMNode
    head = dyb.DynBatchBlock(Similarity(args.sim_hidden_size, NUM_CLASSES,
                                        in_units=args.hidden_size))
    init = mx.init.Xavier(rnd_type='uniform', factor_type='avg', magnitude=3)
    node.initialize(init, ctx=ctx)
    head.initialize(init, ctx=ctx)
    embedding = node.block.embedding.weight
    embedding.set_data(mx.nd.array(matrix, ctx=ctx))
    # Tai et al. regularise the composition and output weights, not the
    # embeddings; weight decay on a dense embedding gradient would also move
    # every row of the vocabulary at every step.
    embedding.wd_mult = 0.0
    if args.freeze_embeddings:
        embedding.grad_req = 'null'
    return Model(node, head), n_found


def make_trainer(model, args):
    return gluon.Trainer(model.params(), args.optimizer,
                         {'learning_rate': args.lr, 'wd': args.wd})


# --------------------------------------------------------------------------
# Training and evaluation
# --------------------------------------------------------------------------

def _scope(mode, strategy):
    """The batching scope of one minibatch (nothing in per-sample mode)."""
    if mode == 'dynbatch':
        return dyb.batching(strategy)
    return contextlib.nullcontext()


def forward_batch(model, batch, mode, strategy):
    """Log-probabilities (n, 5) of a minibatch of examples."""
    with _scope(mode, strategy):
        preds = [model.predict(ex) for ex in batch]
    return dyb.concat_rows(preds)


def kl_loss(logp, target):
    """Per-pair KL(target || p), shape (n,); ``target`` is Tai's sparse
    distribution, so 0 * log 0 is taken as 0."""
    return mx.nd.sum(target * (mx.nd.log(target + 1e-12) - logp), axis=1)


class _ProgressLines:
    """tqdm's ``update`` / ``set_postfix`` / ``close`` as a plain line on
    stderr every :data:`PROGRESS_LINE_EVERY_S` seconds."""

    def __init__(self, total, desc):
        self.total, self.desc, self.done, self.postfix = total, desc, 0, ''
        self.start = self.last = time.perf_counter()

    def update(self, n):
        self.done += n
        now = time.perf_counter()
        if now - self.last >= PROGRESS_LINE_EVERY_S:
            self.last = now
            print('  %s: %d/%d pairs, %.1f pairs/s%s'
                  % (self.desc, self.done, self.total, self.done / (now - self.start),
                     self.postfix), file=sys.stderr, flush=True)

    def set_postfix(self, refresh=False, **values):
        self.postfix = ''.join(', %s %s' % item for item in values.items())

    def close(self):
        pass


def progress_meter(total, desc, progress):
    """How a pass reports its progress: ``progress`` is ``'bar'`` (tqdm),
    ``'lines'`` (:class:`_ProgressLines`) or false (nothing)."""
    if progress == 'lines':
        return _ProgressLines(total, desc)
    return tqdm(total=total, desc=desc, unit='pair', mininterval=0.5, leave=False,
                disable=not progress, dynamic_ncols=True)


READ_LOSS_EVERY = 8
"""Training reads its losses (for the progress bar and the returned
numbers) every this many steps: reading one waits for that step's backward
pass and update, and until then Python runs ahead into the next steps
while MXNet's worker finishes them (with ``'fusedadagrad'``, whose steps do
not wait either: see :mod:`gluon_dynbatch.optim`).  Reading every step
measured 1,187 and 1,120 pairs/s against 1,310 and 1,380 for steps that do
not wait, in ``benchmarks/bench_treelstm.py --sync-train`` and without it,
at minibatch 25.  Every few steps, not never: nothing else stops Python
from queueing work faster than the worker does it."""


def train_epoch(model, trainer, examples, order, mode, strategy='depth', batch_size=25,
                progress=False, desc='train', ctx=None):
    """One pass over ``examples`` in ``order``; returns the mean loss, the
    loss of every step, and timing."""
    ctx = ctx or mx.cpu()
    step_losses, weighted, seen = [], 0.0, 0
    bar = progress_meter(len(order), desc, progress)
    pending = []        # (mean loss NDArray, pairs) of the steps not read yet
    start = time.perf_counter()
    for first in range(0, len(order), batch_size):
        batch = [examples[i] for i in order[first:first + batch_size]]
        target = mx.nd.array(np.stack([ex.target for ex in batch]), ctx=ctx)
        with autograd.record():
            logp = forward_batch(model, batch, mode, strategy)
            loss = kl_loss(logp, target)
        loss.backward()
        trainer.step(len(batch))
        pending.append((loss.mean(), len(batch)))
        if len(pending) < READ_LOSS_EVERY and first + batch_size < len(order):
            continue
        for mean, n in pending:
            step_loss = float(mean.asscalar())
            step_losses.append(step_loss)
            weighted += step_loss * n
            seen += n
        bar.set_postfix(loss='%.4f' % (weighted / seen), refresh=False)
        bar.update(sum(n for _, n in pending))
        pending = []
    seconds = time.perf_counter() - start
    bar.close()
    return {'loss': weighted / max(len(order), 1), 'step_losses': step_losses,
            'seconds': seconds, 'pairs_per_s': len(order) / seconds if seconds else 0.0}


def _correlation(fn, x, y):
    if len(x) < 2 or np.std(x) == 0 or np.std(y) == 0:
        return float('nan')
    return float(fn(x, y)[0])


def evaluate(model, examples, mode, strategy='depth', batch_size=256, progress=False,
             desc='eval'):
    """Pearson, Spearman and MSE of the expected score against gold, with
    timing and the predictions themselves."""
    bar = progress_meter(len(examples), desc, progress)
    preds = []
    start = time.perf_counter()
    for first in range(0, len(examples), batch_size):
        batch = examples[first:first + batch_size]
        preds.append(sick_score(forward_batch(model, batch, mode, strategy).asnumpy()))
        bar.update(len(batch))
    seconds = time.perf_counter() - start
    bar.close()
    pred = np.concatenate(preds) if preds else np.zeros(0, np.float32)
    gold = np.array([ex.score for ex in examples], dtype=np.float64)
    return {'pearson': _correlation(sstats.pearsonr, pred, gold),
            'spearman': _correlation(sstats.spearmanr, pred, gold),
            'mse': float(np.mean((pred - gold) ** 2)) if len(gold) else float('nan'),
            'seconds': seconds, 'pairs_per_s': len(examples) / seconds if seconds else 0.0,
            'predictions': pred}


def epoch_orders(n, epochs, seed):
    """The shuffled training order of every epoch; the same for both modes."""
    rng = np.random.RandomState(seed)
    return [rng.permutation(n) for _ in range(epochs)]


def run(mode, args, data, vocab, out_dir, log=print, embeddings=None):
    """Train ``mode`` for ``args.epochs`` from the seed, keep the best dev
    checkpoint, reload it and evaluate on test.  Returns a results dict."""
    # bars redraw a line with \r: where stderr is a file or a pipe they would
    # pile up among the epoch lines, so a long pass prints a line now and then
    progress = None if args.no_progress else 'bar' if sys.stderr.isatty() else 'lines'
    model, n_found = build_model(vocab, args, embeddings=embeddings)
    trainer = make_trainer(model, args)
    ckpt = os.path.join(out_dir, '%s-' % mode)
    train, dev, test = data['train'], data['dev'], data['test']
    history, first_steps = [], []
    best = {'epoch': 0, 'pearson': -float('inf')}
    timing = {'train_s': 0.0, 'dev_s': 0.0, 'test_s': 0.0}
    start = time.perf_counter()
    for epoch, order in enumerate(epoch_orders(len(train), args.epochs, args.seed), 1):
        stats = train_epoch(model, trainer, train, order, mode, args.strategy, args.batch_size,
                            progress, desc='%s epoch %d' % (mode, epoch))
        if len(first_steps) < 50:
            first_steps.extend(stats['step_losses'][:50 - len(first_steps)])
        dev_stats = evaluate(model, dev, mode, args.strategy, args.eval_batch_size, progress,
                             desc='%s dev' % mode)
        timing['train_s'] += stats['seconds']
        timing['dev_s'] += dev_stats['seconds']
        is_best = dev_stats['pearson'] > best['pearson']
        if is_best or best['epoch'] == 0:
            best = {'epoch': epoch, 'pearson': dev_stats['pearson']}
            model.save(ckpt)
        history.append({'epoch': epoch, 'train_loss': stats['loss'],
                        'dev_pearson': dev_stats['pearson'], 'dev_spearman':
                        dev_stats['spearman'], 'dev_mse': dev_stats['mse'],
                        'train_s': stats['seconds'], 'train_pairs_per_s': stats['pairs_per_s'],
                        'dev_s': dev_stats['seconds'], 'dev_pairs_per_s':
                        dev_stats['pairs_per_s'], 'elapsed_s': time.perf_counter() - start})
        log('[%s] epoch %d  train loss %.4f  dev pearson %.4f  mse %.4f  '
            '(train %.1f s, %.1f pairs/s; dev %.1f s, %.1f pairs/s)%s'
            % (mode, epoch, stats['loss'], dev_stats['pearson'], dev_stats['mse'],
               stats['seconds'], stats['pairs_per_s'], dev_stats['seconds'],
               dev_stats['pairs_per_s'], '  *best*' if is_best else ''))
    model.load(ckpt)
    test_stats = evaluate(model, test, mode, args.strategy, args.eval_batch_size, progress,
                          desc='%s test' % mode)
    timing['test_s'] = test_stats['seconds']
    total = time.perf_counter() - start
    log('[%s] test (best dev epoch %d): pearson %.4f  spearman %.4f  mse %.4f  (%.1f pairs/s)'
        % (mode, best['epoch'], test_stats['pearson'], test_stats['spearman'],
           test_stats['mse'], test_stats['pairs_per_s']))
    n_train = len(train) * args.epochs
    n_dev = len(dev) * args.epochs
    return {
        'mode': mode,
        'strategy': args.strategy if mode == 'dynbatch' else None,
        'epochs': history,
        'best_epoch': best['epoch'],
        'best_dev_pearson': best['pearson'],
        'test': {k: test_stats[k] for k in ('pearson', 'spearman', 'mse')},
        'wall_s': total,
        'seconds': timing,
        'pairs_per_s': {
            'train': n_train / timing['train_s'] if timing['train_s'] else 0.0,
            'dev_eval': n_dev / timing['dev_s'] if timing['dev_s'] else 0.0,
            'test_eval': test_stats['pairs_per_s'],
        },
        'first_step_losses': first_steps,
        'pretrained_found': n_found,
        'checkpoint': [ckpt + 'node.params', ckpt + 'head.params'],
    }


# --------------------------------------------------------------------------
# Reporting
# --------------------------------------------------------------------------

def environment():
    return {
        'threads': int(os.environ.get('OMP_NUM_THREADS', '0') or 0) or None,
        'OMP_NUM_THREADS': os.environ.get('OMP_NUM_THREADS'),
        'MXNET_ENGINE_TYPE': os.environ.get('MXNET_ENGINE_TYPE'),
        'engine': os.environ.get('MXNET_ENGINE_TYPE') or 'ThreadedEnginePerDevice (default)',
        'context': str(mx.current_context()),
        'cpu_count': os.cpu_count(),
        'python': platform.python_version(),
        'platform': platform.platform(),
    }


def versions():
    import gluonnlp
    import scipy
    return {'mxnet': mx.__version__, 'numpy': np.__version__, 'scipy': scipy.__version__,
            'gluonnlp': gluonnlp.__version__, 'gluon_dynbatch': dyb.__version__}


def _jsonable(obj):
    """NaN/inf become None so that results.json is strict JSON."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, np.generic):
        return _jsonable(obj.item())
    return obj


def plot_curves(runs, path, title):
    """Train loss and dev Pearson per epoch, and dev Pearson against training
    time, one line per mode."""
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    styles = {'per-sample': dict(color='tab:orange', marker='o', linestyle='--',
                                 markersize=8, linewidth=2),
              'dynbatch': dict(color='tab:blue', marker='x', linestyle='-',
                               markersize=8, linewidth=2, markeredgewidth=2)}
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    for res in runs:
        epochs = [h['epoch'] for h in res['epochs']]
        train_time = np.cumsum([h['train_s'] for h in res['epochs']])
        label = '%s (%.0f pairs/s train)' % (res['mode'], res['pairs_per_s']['train'])
        style = styles.get(res['mode'], {})
        axes[0].plot(epochs, [h['train_loss'] for h in res['epochs']], label=label, **style)
        axes[1].plot(epochs, [h['dev_pearson'] for h in res['epochs']], label=label, **style)
        axes[2].plot(train_time, [h['dev_pearson'] for h in res['epochs']], label=label,
                     **style)
    axes[0].set(title='Training loss', xlabel='epoch', ylabel='mean KL divergence per pair')
    axes[1].set(title='Dev Pearson r per epoch', xlabel='epoch', ylabel='Pearson r')
    axes[2].set(title='Dev Pearson r vs training time', xlabel='training time (s)',
                ylabel='Pearson r')
    n_epochs = max((len(res['epochs']) for res in runs), default=0)
    for ax in axes[:2]:
        if n_epochs <= 20:
            ax.set_xticks(range(1, n_epochs + 1))
        else:
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    for ax in axes:
        # plain tick labels: an offset (``1e-8+1.3565``) makes differences in
        # the eighth digit, e.g. one epoch of two modes, look large
        ax.ticklabel_format(axis='y', useOffset=False)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=9)
    fig.suptitle(title, fontsize=12)
    fig.tight_layout(rect=(0, 0, 1, 0.94))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def compare_steps(runs):
    """Largest relative difference of the first step losses between modes."""
    by_mode = {r['mode']: np.array(r['first_step_losses']) for r in runs}
    if len(by_mode) < 2:
        return None
    a, b = by_mode['per-sample'], by_mode['dynbatch']
    n = min(len(a), len(b))
    rel = np.abs(a[:n] - b[:n]) / np.maximum(np.abs(a[:n]), 1e-12)
    return {'steps': int(n), 'max_rel_diff': float(rel.max()) if n else None}


def main(args):
    try:
        data_dir = find_sick_dir(args.data)
    except FileNotFoundError as err:
        print('error: %s' % err, file=sys.stderr)
        return 2
    if args.strategy not in dyb.STRATEGIES:
        print('error: unknown --strategy %r; choose one of %s'
              % (args.strategy, ', '.join(sorted(dyb.STRATEGIES))), file=sys.stderr)
        return 2
    if args.embeddings and not os.path.isfile(args.embeddings):
        print('error: --embeddings %s: no such file' % args.embeddings, file=sys.stderr)
        return 2
    modes = list(MODES) if args.mode == 'both' else [args.mode]
    out_dir = args.out or os.path.join('runs', 'sick-%s' % args.mode)
    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError as err:
        print('error: cannot create the output folder %s: %s' % (out_dir, err), file=sys.stderr)
        return 2

    start = time.perf_counter()
    try:
        data, vocab = load_data(data_dir, args.train_limit, args.dev_limit, args.test_limit)
    except (OSError, ValueError) as err:     # malformed data files: the error names them
        print('error: %s' % err, file=sys.stderr)
        return 2
    try:        # once for every mode (a GloVe file is GBs), its errors as the data's
        embeddings = read_embeddings(vocab, args)
    except (OSError, ValueError) as err:
        print('error: %s' % err, file=sys.stderr)
        return 2
    matrix, n_found = embeddings
    if args.embeddings and not n_found:     # a wrong file: its size would still set the model's
        print('error: --embeddings %s holds no vector for any of the %d tokens of SICK\'s '
              'vocabulary: is it the right file?' % (args.embeddings, len(vocab)),
              file=sys.stderr)
        return 2
    # the size the model uses: an --embeddings file sets its own
    if args.embeddings and args.embed_size not in (None, matrix.shape[1]):
        print('warning: --embed-size %d ignored: %s holds %d-d vectors'
              % (args.embed_size, args.embeddings, matrix.shape[1]), file=sys.stderr)
    settings = dict(vars(args), data=str(data_dir), out=out_dir, modes=modes,
                    n_train=len(data['train']), n_dev=len(data['dev']),
                    n_test=len(data['test']), vocab_size=len(vocab),
                    embed_size=int(matrix.shape[1]))
    env = environment()
    print('Tree-LSTM on SICK relatedness')
    print('  data      %s  (train %d, dev %d, test %d pairs; vocab %d)'
          % (data_dir, len(data['train']), len(data['dev']), len(data['test']), len(vocab)))
    print('  mode      %s  (strategy %s)  epochs %d  batch %d  %s lr %g  wd %g  seed %d'
          % (args.mode, args.strategy, args.epochs, args.batch_size, args.optimizer, args.lr,
             args.wd, args.seed))
    print('  model     embed %s%s, hidden %d, similarity hidden %d, %d classes'
          % ('%s (%d-d, %d of %d tokens found)' % (args.embeddings, matrix.shape[1], n_found,
                                                     len(vocab))
             if args.embeddings else 'random %d-d' % matrix.shape[1],
             ' (frozen)' if args.freeze_embeddings else '', args.hidden_size,
             args.sim_hidden_size, NUM_CLASSES))
    print('  runtime   threads %s  engine %s  MXNET_ENGINE_TYPE=%s  OMP_NUM_THREADS=%s  '
          'context %s  mxnet %s' % (args.threads, env['engine'], env['MXNET_ENGINE_TYPE'],
                                    env['OMP_NUM_THREADS'], env['context'], mx.__version__))
    print('  output    %s' % out_dir)
    sys.stdout.flush()

    runs = []
    for mode in modes:
        runs.append(run(mode, args, data, vocab, out_dir, embeddings=embeddings))
        sys.stdout.flush()

    results = {'settings': settings, 'env': env, 'versions': versions(),
               'runs': {r['mode']: r for r in runs},
               'step_loss_agreement': compare_steps(runs),
               'wall_s': time.perf_counter() - start}
    # Convenience copies of the last (or only) run at the top level.
    last = runs[-1]
    for key in ('best_epoch', 'test', 'pairs_per_s', 'first_step_losses'):
        results[key] = last[key]
    results['epochs'] = last['epochs']
    with open(os.path.join(out_dir, 'results.json'), 'w') as f:
        json.dump(_jsonable(results), f, indent=1, allow_nan=False)
    plot_curves(runs, os.path.join(out_dir, 'learning_curves.png'),
                'Child-sum Tree-LSTM on SICK relatedness: %d training pairs, batch %d, '
                'engine %s, OMP_NUM_THREADS=%s'
                % (len(data['train']), args.batch_size, env['engine'], args.threads))
    if results['step_loss_agreement']:
        print('first %(steps)d step losses, per-sample vs dynbatch: max relative difference '
              '%(max_rel_diff).2e' % results['step_loss_agreement'])
    print('wrote %s and %s  (total %.1f s)' % (os.path.join(out_dir, 'results.json'),
                                              os.path.join(out_dir, 'learning_curves.png'),
                                              results['wall_s']))
    return 0


if __name__ == '__main__':
    sys.exit(main(ARGS))
