#!/usr/bin/env python
"""A transformer encoder layer per sentence: per sample, padded, grouped by
length by hand, and gluon_dynbatch.

The model encodes each SICK sentence on its own: its tokens, embedded (64,
random), go through one stock gluonnlp ``TransformerEncoderCell`` (4 heads,
feed-forward 128), and its result is the mean of the layer's outputs over
the sentence's tokens.  gluonnlp's multi-head attention folds its heads
into axis 0, so before gluon_dynbatch followed a sample's rows through such
reshapes (``docs/rules.rst``) its calls ran one per step.  A minibatch of B
pairs is 2B sentences of 3-30 tokens.  Forms, one set of weights, one
block (token ids, attention mask and the mask of valid tokens in, the
sentence's vector out):

=====================  ======================================================
``per-sample``         the plain loop, eager Gluon, a sentence a call
``per-sample-hybrid``  the same loop, the block hybridized (static buffers in
                       inference, plain ``hybridize()`` in training)
``padded``             what one writes by hand: every sentence padded to the
                       longest, one call of the hybridized block with the
                       masks
``by-length``          by hand too, without padding: one call of the
                       hybridized block per sentence length (what
                       gluon_dynbatch's steps run)
``dynbatch-pad-lists``  the plain loop too, each sentence given as a list of
                       token ids and its length, the masks computed from
                       the length, the block declaring ``pad_lists``: calls
                       of every length can run as one padded step
``dynbatch-buckets``   the plain loop, each sentence padded on its own to a
                       multiple of 8 tokens (its masks say which are real):
                       calls of one bucket batch, ~4 steps a minibatch
``dynbatch``           the plain loop inside ``gluon_dynbatch.batching()``
=====================  ======================================================

Every form is first checked against ``per-sample`` (results and gradients
in training on 16 sentences, results in inference on 200; ``--tol``), and
``dynbatch-pad-lists`` is warmed up over the split at each minibatch size
(its padding checks, reported apart).
Measuring is as in ``bench_cells.py``: inference copies the results to the
host, training runs forward and backward of the results' sum; repeats
interleave the forms in a rotated order, each on the same minibatches; a
cell is the median pairs/s, a ratio the median of the ratios within each
repeat.  Writes ``transformer.json`` and ``transformer.md``.

::

    python benchmarks/bench_transformer.py            # ~3 min on 2 cores
    python benchmarks/bench_transformer.py --quick    # a smoke run
"""
import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import bench_cells  # noqa: E402  (no MXNet import at module level)
FORMS = ('per-sample', 'per-sample-hybrid', 'padded', 'by-length', 'dynbatch-pad-lists',
         'dynbatch-buckets', 'dynbatch')
SETTINGS = (('infer', 1), ('infer', 25), ('infer', 256), ('train', 25), ('train', 256))
QUICK_SETTINGS = (('infer', 4), ('train', 4))
UNITS, HIDDEN, HEADS = 64, 128, 4
BUCKET = 8
"""``dynbatch-buckets`` pads a sentence to a multiple of this many tokens."""


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    return bench_cells.add_run_options(p, 'NaiveEngine',
                                       'transformer.json / .md').parse_args(argv)


class Model:
    """The encoder block and the forms built on it; imported after the
    environment is set."""

    def __init__(self, vocab_size, seed):
        import mxnet as mx
        import numpy as np
        from mxnet import gluon
        import gluonnlp
        import gluon_dynbatch as dyb
        self.mx, self.np, self.dyb = mx, np, dyb

        class Encoder(gluon.HybridBlock):
            """Token ids (n, T), attention mask (n, T, T) and valid tokens
            (n, T, 1) in: the mean of the layer's outputs over the valid
            tokens, (n, UNITS)."""

            def __init__(self, **kwargs):
                super().__init__(**kwargs)
                with self.name_scope():
                    self.embed = gluon.nn.Embedding(vocab_size, UNITS)
                    self.cell = gluonnlp.model.transformer.TransformerEncoderCell(
                        units=UNITS, hidden_size=HIDDEN, num_heads=HEADS, dropout=0.0)

            def hybrid_forward(self, F, ids, mask, valid):  # pylint: disable=arguments-differ
                out, _ = self.cell(self.embed(ids), mask)
                return F.broadcast_div(F.sum(F.broadcast_mul(out, valid), axis=1),
                                       F.sum(valid, axis=1))

        class ListEncoder(Encoder):
            """The same layer over a sentence given as a list of (1,) token
            ids and its length, (1,): the embeddings past the length are
            zeroed and the masks computed from the length, so padding the
            list with id 0 changes nothing, and the block declares
            ``pad_lists``.  (Without the ``SequenceMask`` the padding check
            refused it, the embedding's gradient differing under its random
            parameters, and said to mask the rows past the length so.)"""
            dynbatch_pad_lists = True

            def hybrid_forward(self, F, ids, length):  # pylint: disable=arguments-differ
                x = F.SequenceMask(self.embed(F.stack(*ids, axis=1)), length,
                                   use_sequence_length=True, axis=1)   # (1, T, UNITS)
                steps = F.reshape(F.contrib.arange_like(x, axis=1), shape=(1, -1))
                valid = F.broadcast_lesser(steps, F.reshape(length, shape=(-1, 1)))  # (1, T)
                mask = F.broadcast_mul(F.expand_dims(valid, axis=1),
                                       F.expand_dims(valid, axis=2))
                out, _ = self.cell(x, mask)
                valid = F.expand_dims(valid, axis=2)
                return F.broadcast_div(F.sum(F.broadcast_mul(out, valid), axis=1),
                                       F.sum(valid, axis=1))

        mx.random.seed(seed)
        self.block = Encoder()
        self.block.initialize(mx.init.Xavier())
        self.hybrid = {}
        for training, flags in ((False, {'static_alloc': True, 'static_shape': True}),
                                (True, {})):
            self.hybrid[training] = Encoder(prefix=self.block.prefix,
                                            params=self.block.collect_params())
            self.hybrid[training].hybridize(**flags)
        self.wrapped = dyb.DynBatchBlock(self.block)
        self.padded_lists = dyb.DynBatchBlock(ListEncoder(prefix=self.block.prefix,
                                                          params=self.block.collect_params()))

    def inputs(self, sentences, length=None):
        """Token ids, masks and valid tokens of ``sentences`` (numpy), padded
        to ``length`` (default the longest)."""
        np = self.np
        length = length or max(len(ids) for ids in sentences)
        ids = np.zeros((len(sentences), length), np.float32)
        valid = np.zeros((len(sentences), length, 1), np.float32)
        for row, tokens in enumerate(sentences):
            ids[row, :len(tokens)] = tokens
            valid[row, :len(tokens)] = 1
        mask = np.broadcast_to(valid.transpose(0, 2, 1), (len(sentences), length, length))
        return ids, np.ascontiguousarray(mask), valid

    def run(self, form, sentences, deadline=None):
        """The (n, UNITS) vectors of ``sentences`` (each a numpy array of
        token ids), and how many were done before ``deadline``."""
        mx, np = self.mx, self.np
        hybrid = self.hybrid[mx.autograd.is_recording()]
        if form == 'padded':
            return hybrid(*map(mx.nd.array, self.inputs(sentences))), len(sentences)
        if form == 'by-length':
            by_length = {}
            for number, tokens in enumerate(sentences):
                by_length.setdefault(len(tokens), []).append(number)
            parts = [hybrid(*map(mx.nd.array, self.inputs([sentences[i] for i in numbers])))
                     for numbers in by_length.values()]
            order = [i for numbers in by_length.values() for i in numbers]
            out = parts[0] if len(parts) == 1 else mx.nd.concat(*parts, dim=0)
            return mx.nd.take(out, mx.nd.array(np.argsort(order))), len(sentences)
        if form.startswith('dynbatch'):
            block, arguments = self.wrapped, self._per_sample_arguments
            if form == 'dynbatch-pad-lists':
                block, arguments = self.padded_lists, self._list_arguments
            with self.dyb.batching():
                outs = [block(*arguments(tokens, form == 'dynbatch-buckets'))
                        for tokens in sentences]
            return self.dyb.concat_rows(outs), len(sentences)
        singles = [self.inputs([tokens]) for tokens in sentences]
        block = self.block if form == 'per-sample' else hybrid
        outs = []
        for arrays in singles:
            outs.append(block(*map(mx.nd.array, arrays)))
            if deadline is not None and time.perf_counter() > deadline:
                break
        return mx.nd.concat(*outs, dim=0), len(outs)

    def _per_sample_arguments(self, tokens, bucket):
        """One sentence's ids and masks, padded (``bucket``) to a multiple of
        :data:`BUCKET` tokens or not at all."""
        return self.inputs([tokens], -(-len(tokens) // BUCKET) * BUCKET if bucket else None)

    def _list_arguments(self, tokens, _):
        """One sentence as a list of (1,) ids and its length, (1,)."""
        return list(tokens.reshape(-1, 1)), self.np.array([len(tokens)], self.np.float32)

    def grads(self, form, sentences, weights):
        """Results and the gradients of sum(weights * results)."""
        mx = self.mx
        with mx.autograd.record():
            out, _ = self.run(form, sentences)
            loss = (out * weights).sum()
        loss.backward()
        grads = {name: param.grad().asnumpy().copy()
                 for name, param in self.block.collect_params().items()}
        for param in self.block.collect_params().values():
            param.zero_grad()
        return out.asnumpy(), grads


def sentences_of(items):
    """Each pair's two sentences as float32 arrays of token ids."""
    import numpy as np
    return [np.array(ids, np.float32) for a_ids, _, b_ids, _ in items for ids in (a_ids, b_ids)]


def check(model, sentences, many, tol):
    """Every form's results and gradients on ``sentences``, and its results
    in inference on ``many``, against per-sample (``bench_cells.check``);
    exits 2 on a difference or where a ``dynbatch`` form ran a signature
    per sample."""
    bench_cells.check(model, sentences, many, tol, forms=FORMS, width=UNITS)
    per_sample = {sig.reason for block in (model.wrapped, model.padded_lists)
                  for sig in block.signatures() if not sig.batch_safe}
    if per_sample:
        print('error: dynbatch runs per sample: %s' % '; '.join(sorted(per_sample)),
              file=sys.stderr)
        raise SystemExit(2)


def warm_padded_lists(model, sentences, settings):
    """Run ``dynbatch-pad-lists`` over ``sentences`` (the whole split, as
    the timed turns walk it) once per minibatch size of ``settings``;
    returns the seconds it took and the padding checks it ran.  Its calls
    pad a sentence to the longest of its step, and the first time a length
    pads to another the block is checked (a padding check; ~0.15 s with the
    calls that wait for it) and a program built: ~200 checks in the first
    2,000 sentences, which would otherwise fall into the timed turns."""
    from gluon_dynbatch.block import padding_checks  # pylint: disable=import-outside-toplevel
    start, checks = time.perf_counter(), padding_checks()[0]
    for batch in sorted({batch for _, batch in settings}):
        for first in range(0, len(sentences), 2 * batch):
            model.run('dynbatch-pad-lists', sentences[first:first + 2 * batch])[0].asnumpy()
    return time.perf_counter() - start, padding_checks()[0] - checks


def table(results):
    """Markdown: pairs/s per form and setting, and dynbatch's ratios."""
    settings = list(results)
    lines = ['', 'pairs/s (sentences/s is twice that)', '',
             '| form | ' + ' | '.join(settings) + ' |', '|---|' + '---:|' * len(settings)]
    for form in FORMS:
        row = [('%.0f' % statistics.median(results[s][form])) if form in results[s] else '-'
               for s in settings]
        lines.append('| %s | %s |' % (form, ' | '.join(row)))
    for ours, other in [(ours, other) for ours in ('dynbatch', 'dynbatch-buckets')
                        for other in FORMS if not other.startswith('dynbatch')] + \
            [('dynbatch-buckets', 'dynbatch'), ('dynbatch-pad-lists', 'dynbatch')]:
        row = []
        for s in settings:
            if other not in results[s]:
                row.append('-')
                continue
            ratios = [a / b for a, b in zip(results[s][ours], results[s][other])]
            row.append('%.2fx' % statistics.median(ratios))
        lines.append('| %s / %s | %s |' % (ours, other, ' | '.join(row)))
    return '\n'.join(lines) + '\n'


def main(argv=None):
    args = parse_args(argv)
    repeats, budget, settings, items, vocab_size, config = bench_cells.start_run(
        args, QUICK_SETTINGS if args.quick else SETTINGS)
    sentences = sentences_of(items)
    model = Model(vocab_size, args.seed)
    check(model, sentences[:16], sentences[16:16 + (70 if args.quick else 200)], args.tol)
    print('every form agrees with per-sample (tol %g); dynbatch batches' % args.tol,
          flush=True)
    if not args.quick:
        config['pad_lists_warm_up_s'], config['pad_lists_checks'] = warm_padded_lists(
            model, sentences, settings)
        print('dynbatch-pad-lists warmed up: %d padding checks, %.1f s'
              % (config['pad_lists_checks'], config['pad_lists_warm_up_s']), flush=True)
    results = bench_cells.measure(model, sentences, settings, repeats, budget, FORMS)
    bench_cells.write(args, {'config': config, 'results': results}, 'transformer',
                      table(results))


if __name__ == '__main__':
    main()
