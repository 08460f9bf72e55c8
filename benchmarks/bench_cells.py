#!/usr/bin/env python
"""Gluon's own recurrent cells over ragged sequences: per sample, padded and
fused, and gluon_dynbatch with and without its fast operator forms.

The model is a sequential encoder of SICK sentences (Tai et al.'s
sequential LSTM baseline without its head): a sentence's tokens, embedded
(300), go through a stock ``gluon.rnn.LSTMCell`` or ``GRUCell`` (150) one
token at a time, and its result is its last hidden state.  A minibatch of
B pairs is 2B sentences of 3-30 tokens.  Forms, one set of weights:

=====================  ======================================================
``per-sample``         the plain loop, eager Gluon
``per-sample-hybrid``  the same loop, its step block hybridized (static
                       buffers in inference, plain ``hybridize()`` in
                       training)
``padded-fused``       what one writes by hand for sequences: the sentences
                       padded to the longest, one fused ``gluon.rnn.LSTM`` /
                       ``GRU`` layer (MXNet's CPU RNN kernel) over them,
                       ``SequenceLast`` by length
``bucketed-fused``     the same per bucket of 64 sentences of similar length
                       (the minibatch sorted by length), less padding
``dynbatch``           the plain loop inside ``gluon_dynbatch.batching()``
``dynbatch-unshared``  the same without running the embedding and the
                       ``i2h`` GEMM once per distinct token (the fused
                       kernel cannot share them): ``execute.SHARE_ROWS`` and
                       ``HOIST_ROWS`` set past any step
``dynbatch-slow-ops``  the same with :func:`gluon_dynbatch.trace.fast_forms`
                       turned off: the cells' own ``SliceChannel`` and
                       ``sigmoid`` / ``tanh`` ops run batched as they are
``dynbatch-fused``     a sentence at a time through the fused layer (its
                       (1, T) tokens embedded, the layer's last output), in
                       ``gluon_dynbatch.batching()``: sentences of one length
                       run as one fused call
=====================  ======================================================

Every form is first checked against ``per-sample`` (results and gradients
in training on 16 sentences, results in inference on 200; ``--tol``).
Inference copies the results to the host; training is forward
and backward of the results' sum (no optimizer), steps back to back, a
turn ending when its last backward has finished.  Repeats interleave the
forms in a rotated order, every form of a repeat on the same minibatches;
a cell is the median pairs/s, a ratio the median of the ratios within each
repeat.  Each cell runs in a process of its own (see
:func:`each_cell_apart`).  Writes ``cells.json`` and ``cells.md``.

::

    python benchmarks/bench_cells.py            # both cells, ~4 min on 2 cores
    python benchmarks/bench_cells.py --quick    # a smoke run
"""
import argparse
import contextlib
import gc
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import bench_treelstm as bt  # noqa: E402  (no MXNet import at module level)
FORMS = ('per-sample', 'per-sample-hybrid', 'padded-fused', 'bucketed-fused', 'dynbatch',
         'dynbatch-unshared', 'dynbatch-slow-ops', 'dynbatch-fused')
SETTINGS = (('infer', 1), ('infer', 25), ('infer', 256), ('train', 25), ('train', 256))
QUICK_SETTINGS = (('infer', 4), ('train', 4))
PER_SAMPLE_MAX = 25
"""The per-sample forms stop a minibatch when their budget is spent, and
skip settings past this minibatch size."""
EMBED, HIDDEN = 300, 150
BUCKET = 64
"""Sentences per fused call of ``bucketed-fused`` (sorted by length)."""


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('--cells', nargs='+', default=['LSTMCell', 'GRUCell'],
                   choices=['LSTMCell', 'GRUCell'])
    return add_run_options(p, 'ThreadedEnginePerDevice', 'cells.json / cells.md').parse_args(argv)


def add_run_options(p, engine, written, data=True):
    """``p`` with the options of a timed run (``--data`` for SICK unless
    ``data`` is False, ``--engine`` defaulting to ``engine``, threads,
    repeats, budget, tolerance, seed, ``--quick``, ``--out`` for the files
    ``written``): this script's, ``bench_transformer.py``'s and, without
    ``--data``, ``bench_graph.py``'s."""
    if data:
        p.add_argument('--data', default=None, help='SICK folder (else $GLUON_DYNBATCH_SICK, '
                                                    'else ../shared/data/sick)')
    p.add_argument('--engine', default=engine,
                   choices=['ThreadedEnginePerDevice', 'NaiveEngine', 'ThreadedEngine'])
    p.add_argument('--threads', type=bt.positive_int, default=1,
                   help='OMP_NUM_THREADS / MKL_NUM_THREADS')
    p.add_argument('--repeats', type=bt.positive_int, default=None, help='default 5; quick 2')
    p.add_argument('--budget', type=bt.positive_float, default=None,
                   help='seconds per form per repeat per setting (default 0.5; quick 0.1)')
    p.add_argument('--tol', type=bt.non_negative_float, default=1e-4,
                   help='equivalence tolerance (0: bit for bit)')
    p.add_argument('--seed', type=bt.seed_int, default=0, help='0 to %d' % bt.SEED_MAX)
    p.add_argument('--quick', action='store_true')
    p.add_argument('--out', default=None,
                   help='folder for %s (default benchmarks/results; '
                        'quick: benchmarks/results/quick)' % written)
    return p


class Step:
    """The per-sample step (embedding, then the cell) and the forms built
    on it; imported after the environment is set."""

    def __init__(self, cell_type, vocab_size, seed):
        import mxnet as mx
        from mxnet import gluon
        import gluon_dynbatch as dyb
        self.mx, self.dyb, self.lstm = mx, dyb, cell_type == 'LSTMCell'

        class StepBlock(gluon.HybridBlock):
            def __init__(self, **kwargs):
                super().__init__(**kwargs)
                with self.name_scope():
                    self.embed = gluon.nn.Embedding(vocab_size, EMBED)
                    self.cell = getattr(gluon.rnn, cell_type)(HIDDEN, input_size=EMBED)

            def hybrid_forward(self, F, token, *states):  # pylint: disable=arguments-differ
                _, new = self.cell(self.embed(token), list(states))
                return tuple(new) if len(new) > 1 else new[0]

        mx.random.seed(seed)
        self.step = StepBlock()
        self.step.initialize(mx.init.Xavier())
        # as bench_treelstm.py's hybridized form, each fastest for its mode
        # there: static buffers for inference, plain hybridize() for training
        self.hybrid = {}
        for training, flags in ((False, {'static_alloc': True, 'static_shape': True}),
                                (True, {})):
            self.hybrid[training] = StepBlock(prefix=self.step.prefix,
                                              params=self.step.collect_params())
            self.hybrid[training].hybridize(**flags)
        self.dstep = dyb.DynBatchBlock(self.step)
        self.slow = dyb.DynBatchBlock(self.step)
        self.unshared = dyb.DynBatchBlock(self.step)
        self.fused = (gluon.rnn.LSTM if self.lstm else gluon.rnn.GRU)(
            HIDDEN, input_size=EMBED, layout='NTC')
        self.fused.initialize()
        cell_params = self.step.cell.collect_params()
        self.fused_of = {}      # fused parameter -> the cell's
        for name, param in self.fused.collect_params().items():
            (mine,) = [p for n, p in cell_params.items() if n.endswith(name.split('l0_')[-1])]
            param.set_data(mine.data())
            self.fused_of[param.name] = mine.name
        self.fused.hybridize(static_alloc=True)
        self.zeros = mx.nd.zeros((1, HIDDEN))

        class SentenceBlock(gluon.HybridBlock):
            """One sentence's (1, T) tokens through the embedding and the
            fused layer: its last output, (1, HIDDEN)."""

            def __init__(self, embed, fused, **kwargs):
                super().__init__(**kwargs)
                self.embed, self.fused = embed, fused

            def hybrid_forward(self, F, tokens):  # pylint: disable=arguments-differ
                out = self.fused(self.embed(tokens))
                return F.reshape(F.slice_axis(out, axis=1, begin=-1, end=None), (0, -1))

        self.sentence = dyb.DynBatchBlock(SentenceBlock(self.step.embed, self.fused))

    def states(self):
        return (self.zeros, self.zeros) if self.lstm else (self.zeros,)

    def encode(self, block, ids, host):
        """One sentence through ``block``, token by token: its last h."""
        mx, states = self.mx, self.states()
        for token in ids:
            out = block(token if host else mx.nd.array(token), *states)
            states = out if self.lstm else (out,)
        return states[0]

    def run(self, form, sentences, deadline=None):
        """The (n, HIDDEN) last hidden states of ``sentences`` (each a list of
        (1,) float32 token arrays), and how many were done before
        ``deadline``."""
        mx, dyb = self.mx, self.dyb
        if form == 'padded-fused':
            return self.padded_fused(sentences), len(sentences)
        if form == 'bucketed-fused':
            return self.bucketed_fused(sentences), len(sentences)
        if form == 'dynbatch-fused':
            import numpy as np
            with dyb.batching():
                outs = [self.sentence(np.concatenate(ids)[None, :]) for ids in sentences]
            return dyb.concat_rows(outs), len(sentences)
        if form.startswith('dynbatch'):
            block = {'dynbatch': self.dstep, 'dynbatch-unshared': self.unshared,
                     'dynbatch-slow-ops': self.slow}[form]
            with unshared(form == 'dynbatch-unshared'):
                with dyb.batching():
                    outs = [self.encode(block, ids, True) for ids in sentences]
            return dyb.concat_rows(outs), len(sentences)
        block = self.step if form == 'per-sample' else \
            self.hybrid[mx.autograd.is_recording()]
        outs = []
        for ids in sentences:
            outs.append(self.encode(block, ids, False))
            if deadline is not None and time.perf_counter() > deadline:
                break
        return mx.nd.concat(*outs, dim=0), len(outs)

    def padded_fused(self, sentences):
        import numpy as np
        mx = self.mx
        longest = max(len(ids) for ids in sentences)
        tokens = np.zeros((len(sentences), longest), np.float32)
        for row, ids in enumerate(sentences):
            tokens[row, :len(ids)] = np.concatenate(ids)
        lengths = mx.nd.array([len(ids) for ids in sentences])
        out = self.fused(self.step.embed(mx.nd.array(tokens)))
        return mx.nd.SequenceLast(out, lengths, use_sequence_length=True, axis=1)

    def bucketed_fused(self, sentences):
        """:meth:`padded_fused` over buckets of :data:`BUCKET` sentences of
        similar length (the minibatch sorted by length), put back in order."""
        import numpy as np
        order = sorted(range(len(sentences)), key=lambda i: len(sentences[i]))
        parts = [self.padded_fused([sentences[i] for i in order[start:start + BUCKET]])
                 for start in range(0, len(order), BUCKET)]
        out = parts[0] if len(parts) == 1 else self.mx.nd.concat(*parts, dim=0)
        return self.mx.nd.take(out, self.mx.nd.array(np.argsort(order)))

    def grads(self, form, sentences, weights):
        """Results and the gradients of sum(weights * results), by the
        cell's parameter names."""
        mx = self.mx
        with mx.autograd.record():
            out, _ = self.run(form, sentences)
            loss = (out * weights).sum()
        loss.backward()
        fused = form.endswith('-fused')
        grads = {}
        for name, param in self.step.collect_params().items():
            if not (fused and name in self.fused_of.values()):
                grads[name] = param.grad().asnumpy().copy()
        if fused:
            for name, param in self.fused.collect_params().items():
                grads[self.fused_of[name]] = param.grad().asnumpy().copy()
        for param in list(self.step.collect_params().values()) + \
                list(self.fused.collect_params().values()):
            param.zero_grad()
        return out.asnumpy(), grads


@contextlib.contextmanager
def unshared(active):
    """While ``active``, no step runs a block's host part once per distinct
    host row, and no flush hoists it (see ``gluon_dynbatch.execute``)."""
    from gluon_dynbatch import execute
    saved = execute.SHARE_ROWS, execute.HOIST_ROWS
    if active:
        execute.SHARE_ROWS = execute.HOIST_ROWS = float('inf')
    try:
        yield
    finally:
        execute.SHARE_ROWS, execute.HOIST_ROWS = saved


def sentences_of(items):
    """Each pair's two sentences as lists of (1,) float32 token arrays."""
    import numpy as np
    out = []
    for a_ids, _, b_ids, _ in items:
        for ids in (a_ids, b_ids):
            out.append([np.array([t], np.float32) for t in ids])
    return out


def check(model, sentences, many, tol, forms=FORMS, width=HIDDEN):
    """Every form's results and gradients on ``sentences``, and its results
    in inference on ``many`` (steps on both sides of
    ``lower.FAST_FORMS_ROWS``, several buckets), against per-sample (the
    first of ``forms``; results ``width`` wide); exits 2 on a difference.
    ``bench_transformer.py`` checks its forms so too."""
    import numpy as np
    with model.mx.autograd.pause():
        want = model.run('per-sample', many)[0].asnumpy()
        for form in forms[1:]:
            if not np.allclose(model.run(form, many)[0].asnumpy(), want, atol=tol, rtol=0):
                print('error: form %s disagrees with per-sample in inference on %d sentences'
                      % (form, len(many)), file=sys.stderr)
                raise SystemExit(2)
    weights = model.mx.nd.array(np.random.RandomState(1).uniform(-1, 1, (len(sentences),
                                                                         width)))
    want, want_grads = model.grads('per-sample', sentences, weights)
    for form in forms[1:]:
        got, grads = model.grads(form, sentences, weights)
        bad = [] if np.allclose(got, want, atol=tol, rtol=0) else ['results']
        for name, grad in want_grads.items():
            scale = max(float(np.abs(grad).max()), 1e-12)
            if name not in grads or np.abs(grads[name] - grad).max() > tol * scale:
                bad.append('gradient of %s' % name)
        if bad:
            print('error: form %s disagrees with per-sample: %s' % (form, ', '.join(bad)),
                  file=sys.stderr)
            raise SystemExit(2)


def measure(model, sentences, settings, repeats, budget, all_forms=FORMS, per_unit=2):
    """{setting: {form: [units/s per repeat]}} for the forms ``all_forms``,
    a unit ``per_unit`` items: pairs of sentences here and in
    ``bench_transformer.py`` (2), graphs in ``bench_graph.py`` (1)."""
    mx = model.mx
    for form in all_forms:    # trace, build programs, calibrate the cost model
        model.run(form, sentences[:8])[0].asnumpy()
    results, offset = {}, 0
    pairs_in_data = len(sentences) // per_unit
    for mode, batch in settings:
        name = '%s B=%d' % (mode, batch)
        forms = [f for f in all_forms
                 if batch <= PER_SAMPLE_MAX or not f.startswith('per-sample')]
        rates = results[name] = {form: [] for form in forms}
        for rep in range(repeats):
            turn = forms[rep % len(forms):] + forms[:rep % len(forms)]
            offset += 997       # every form of a repeat walks the same minibatches
            for form in turn:
                gc.collect()    # not in the next form's turn: a form's own garbage
                pairs, start, walked = 0, time.perf_counter(), offset
                deadline = start + budget
                while time.perf_counter() < deadline:
                    first = (walked % (pairs_in_data - batch)) * per_unit
                    walked += batch
                    part = sentences[first:first + per_unit * batch]
                    with mx.autograd.record() if mode == 'train' else mx.autograd.pause():
                        out, done = model.run(form, part, deadline)
                        loss = out.sum() if mode == 'train' else out
                    if mode == 'train':
                        loss.backward()
                    loss.asnumpy()
                    pairs += done / per_unit
                mx.nd.waitall()     # a turn ends when its work (the backward too) is done
                rates[form].append(pairs / (time.perf_counter() - start))
        print('%-12s %s' % (name, '  '.join('%s %.0f' % (f, _median(r))
                                             for f, r in rates.items())), flush=True)
    return results


def traced_ops(block):
    """The ops of ``block``'s traced signatures (what its steps run)."""
    from gluon_dynbatch.trace import symbol_json  # pylint: disable=import-outside-toplevel
    return sorted({node['op'] for sig in block.signatures()
                   for node in json.loads(symbol_json(sig.symbol))['nodes']} - {'null'})


def _median(values):
    return statistics.median(values)


def table(all_results):
    """Markdown: pairs/s per form and setting, and dynbatch's ratios."""
    lines = []
    for cell, results in all_results.items():
        settings = list(results)
        lines += ['', '%s (pairs/s; sentences/s is twice that)' % cell, '',
                  '| form | ' + ' | '.join(settings) + ' |',
                  '|---|' + '---:|' * len(settings)]
        for form in FORMS:
            row = [('%.0f' % _median(results[s][form])) if form in results[s] else '-'
                   for s in settings]
            lines.append('| %s | %s |' % (form, ' | '.join(row)))
        for other in ('padded-fused', 'bucketed-fused', 'dynbatch-unshared',
                      'dynbatch-slow-ops', 'dynbatch-fused', 'per-sample-hybrid'):
            row = []
            for s in settings:
                if other not in results[s]:
                    row.append('-')
                    continue
                ratios = [a / b for a, b in zip(results[s]['dynbatch'], results[s][other])]
                row.append('%.2fx' % _median(ratios))
            lines.append('| dynbatch / %s | %s |' % (other, ' | '.join(row)))
    return '\n'.join(lines) + '\n'


def each_cell_apart(args):
    """Run each cell in a process of its own and merge what they wrote:
    in one process the cell measured second ran its ``dynbatch`` forms
    10-25% slower than alone (GRU at inference 256 and training 25, after
    the LSTM) while the fused forms held, so the process itself, not the
    form, was being measured."""
    import subprocess
    import tempfile
    merged = {'config': None, 'results': {}, 'traced_ops': {}}
    with tempfile.TemporaryDirectory() as scratch:
        for cell in args.cells:
            child = [sys.executable, os.path.abspath(__file__), '--cells', cell,
                     '--engine', args.engine, '--threads', str(args.threads),
                     '--tol', str(args.tol), '--seed', str(args.seed),
                     '--out', os.path.join(scratch, cell)]
            for flag, value in (('--data', args.data), ('--repeats', args.repeats),
                                ('--budget', args.budget)):
                if value is not None:
                    child += [flag, str(value)]
            if args.quick:
                child.append('--quick')
            done = subprocess.run(child, check=False)
            if done.returncode:
                raise SystemExit(done.returncode)
            with open(os.path.join(scratch, cell, 'cells.json')) as f:
                part = json.load(f)
            merged['config'] = dict(part['config'], processes='one per cell')
            merged['results'].update(part['results'])
            merged['traced_ops'].update(part['traced_ops'])
    write(args, merged)


QUICK_NOTE = ('\n**--quick: a smoke run, not a measurement.** Tiny budgets, and one-time '
              'work (tracing, padding checks, building programs) not warmed up, so it falls in '
              'the timed repeats; run without --quick for numbers.\n')


def write(args, out, stem='cells', text=None):
    """Print the tables (``text``, else this script's of ``out``) and write
    ``<stem>.json`` / ``<stem>.md`` where ``args`` says (``--out``,
    ``--quick``): this script's files and ``bench_transformer.py``'s and
    ``bench_graph.py``'s."""
    out_dir = args.out or os.path.join(HERE, 'results', 'quick' if args.quick else '')
    text = table(out['results']) if text is None else text
    if args.quick:      # (its tables read like results: a user's trial took them for some)
        text = QUICK_NOTE + text
        out = dict(out, note=QUICK_NOTE.strip())
    print(text)
    os.makedirs(out_dir, exist_ok=True)
    json_path, md_path = (os.path.join(out_dir, stem + ext) for ext in ('.json', '.md'))
    with open(json_path, 'w') as f:
        json.dump(out, f, indent=1)
    with open(md_path, 'w') as f:
        f.write('`python benchmarks/bench_%s.py` (%s)\n%s' % (
            stem, ', '.join('%s %s' % kv for kv in out['config'].items()), text))
    print('wrote %s' % json_path)
    print('wrote %s (the tables in Markdown)' % md_path)


def set_up(args):
    """Set the engine and threads ``args`` name (before MXNet is imported)
    and print the run's settings; returns ``(repeats, budget, config)``:
    :func:`start_run`'s start and ``bench_graph.py``'s (no data set)."""
    os.environ['MXNET_ENGINE_TYPE'] = args.engine
    os.environ['OMP_NUM_THREADS'] = os.environ['MKL_NUM_THREADS'] = str(args.threads)
    import mxnet as mx                 # pylint: disable=import-outside-toplevel
    repeats = args.repeats or (2 if args.quick else 5)
    budget = args.budget or (0.1 if args.quick else 0.5)
    config = {'engine': args.engine, 'OMP_NUM_THREADS': str(args.threads),
              'mxnet': mx.__version__, 'repeats': repeats, 'budget_s': budget,
              'cpu': bt._cpu_model()}      # pylint: disable=protected-access
    print(' '.join('%s=%s' % kv for kv in config.items()), flush=True)
    return repeats, budget, config


def start_run(args, settings):
    """:func:`set_up`, then load SICK's test split; returns ``(repeats,
    budget, settings, items, vocab_size, config)``: this script's start
    and ``bench_transformer.py``'s."""
    repeats, budget, config = set_up(args)
    _, items, _, vocab_size, _ = bt.load_data(bt.build_parser().parse_args(
        ['--data', args.data, '--seed', str(args.seed)] if args.data else
        ['--seed', str(args.seed)]))
    return repeats, budget, settings, items, vocab_size, config


def main(argv=None):
    args = parse_args(argv)
    if len(args.cells) > 1:
        return each_cell_apart(args)
    repeats, budget, settings, items, vocab_size, config = start_run(
        args, QUICK_SETTINGS if args.quick else SETTINGS)
    from gluon_dynbatch import trace   # pylint: disable=import-outside-toplevel
    sentences = sentences_of(items)
    all_results, traced, fast_forms = {}, {}, trace.fast_forms
    for cell in args.cells:
        model = Step(cell, vocab_size, args.seed)
        # the slow form's signatures are traced without the fast forms
        # (its first calls, in check): it keeps them for the run
        trace.fast_forms = lambda symbol, *shapes_and_types: symbol
        try:
            model.run('dynbatch-slow-ops', sentences[:8])[0].asnumpy()
        finally:
            trace.fast_forms = fast_forms
        check(model, sentences[:16], sentences[16:16 + (70 if args.quick else 200)], args.tol)
        print('%s: every form agrees with per-sample (tol %g)' % (cell, args.tol), flush=True)
        per_sample = {sig.reason for sig in model.sentence.signatures() if not sig.batch_safe}
        if per_sample:      # a per-sample form under dynbatch-fused's name
            print('error: dynbatch-fused runs per sample: %s' % '; '.join(per_sample),
                  file=sys.stderr)
            raise SystemExit(2)
        traced[cell] = {form: traced_ops(block) for form, block in
                        (('dynbatch', model.dstep), ('dynbatch-slow-ops', model.slow),
                         ('dynbatch-fused', model.sentence))}
        all_results[cell] = measure(model, sentences, settings, repeats, budget)
    write(args, {'config': config, 'results': all_results, 'traced_ops': traced})


if __name__ == '__main__':
    main()
