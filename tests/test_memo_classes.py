"""Adversarial checks of the C recorder's signature memo (leaf classes) and
signature cache: every recorded node gets the signature its key names,
batched values equal per-sample ones, across producers with many outputs,
dtypes, contexts, and blocks made and dropped (addresses reused)."""
import gc
import random

import mxnet as mx
import numpy as np
import pytest
from mxnet import gluon

import gluon_dynbatch as dyb
from gluon_dynbatch import accel
from gluon_dynbatch.block import _signature_key, private_scope
from gluon_dynbatch.trace import flatten

needs_extension = pytest.mark.skipif(accel.STATUS != 'C extension', reason=accel.STATUS)


class AddItems(gluon.HybridBlock):
    """``relu(x)`` plus every item of a list."""

    def hybrid_forward(self, F, x, items):
        out = F.relu(x)
        for item in items:
            out = out + item
        return out


class CastAdd(gluon.HybridBlock):
    """``relu(x)`` plus every item of a list, all as float64: arguments of
    any dtypes (a key of several dtypes)."""

    def hybrid_forward(self, F, x, items):
        out = F.relu(x.astype('float64'))
        for item in items:
            out = out + item.astype('float64')
        return out


class Multiples(gluon.HybridBlock):
    """``x`` times 1, 2, ..., ``count``: ``count`` outputs."""

    def __init__(self, count, **kwargs):
        super().__init__(**kwargs)
        self.count = count

    def hybrid_forward(self, F, x):
        return tuple(x * (i + 1) for i in range(self.count))


class Casts(gluon.HybridBlock):
    """Outputs of several dtypes: x*2 as float32, x*3 as float64, x as int32,
    x*5 as float64, x*7 as float32."""

    def hybrid_forward(self, F, x):
        return ((x * 2).astype('float32'), (x * 3).astype('float64'), x.astype('int32'),
                (x * 5).astype('float64'), (x * 7).astype('float32'))


CAST_FACTORS = [(2, np.float32), (3, np.float64), (1, np.int32), (5, np.float64), (7, np.float32)]


def _check_keys(consumers, calls, scope):
    nodes = list(scope.pending)     # (checked in place: the scope then runs them)
    by_sig = {}
    for block in consumers:
        for sig in block._signatures.values():
            by_sig[sig] = block
    consumed = [node for node in nodes if node.sig in by_sig]
    assert len(consumed) == len(calls)
    for node, (block, ctx, args) in zip(consumed, calls):
        assert by_sig[node.sig] is block
        leaves = []
        fmt = flatten(args, leaves)
        with ctx:
            key = _signature_key(block, fmt, leaves, scope)[0]
        assert node.sig is block._signatures[key], (key, node.sig.key)
    return nodes


def _one_round(rng, consumers, rounds_made):
    """Make producers (kept only for this round), record consumer calls on
    random mixes of their outputs; returns (calls, expected values, results)."""
    contexts = [mx.cpu(0), mx.cpu(1)]
    producers = [dyb.DynBatchBlock(Multiples(rng.choice([2, 3, 9, 12]))) for _ in range(3)]
    producers += [dyb.DynBatchBlock(Casts()) for _ in range(2)]
    calls, expected, results = [], [], []
    with dyb.batching('depth', merge_repeats=False, flush_every=None) as scope:
        for _ in range(30):
            ctx = rng.choice(contexts)
            width = rng.choice([2, 3, 4])
            base = rng.choice([1.0, -2.0, 0.5])
            x = np.full((1, width), base, np.float32)
            with ctx:
                made = []       # (lazy value, its exact numpy value)
                for producer in rng.sample(producers, 3):
                    outs = producer(x)
                    if isinstance(producer.block, Multiples):
                        for i, out in enumerate(outs):
                            made.append((out, x * (i + 1)))
                    else:
                        for (factor, dtype), out in zip(CAST_FACTORS, outs):
                            made.append((out, (x * factor).astype(dtype)))
                # consumer calls: x of one dtype, a list of one dtype
                by_dtype = {}
                for value, want in made:
                    by_dtype.setdefault(want.dtype, []).append((value, want))
                for _ in range(6):
                    dtype = rng.choice(sorted(by_dtype, key=str))
                    pool = by_dtype[dtype]
                    picks = [rng.choice(pool) for _ in range(rng.choice([0, 1, 2, 3, 5]))]
                    head, head_want = rng.choice(made)
                    block = rng.choice(consumers)
                    args = (head, [value for value, _ in picks])
                    out = block(*args)
                    want = np.maximum(head_want.astype(np.float64), 0)
                    for _, item in picks:
                        want = want + item.astype(np.float64)
                    calls.append((block, ctx, args))
                    expected.append(want)
                    results.append(out)
        _check_keys(consumers, calls, scope)
    rounds_made.append(len(producers))
    return calls, expected, results


@needs_extension
def test_memo_sound_over_producers_made_and_dropped():
    """Rounds of new producers (2, 3, 9, 12 outputs; mixed dtypes), cpu(0)
    and cpu(1), random lists of their outputs; consumers kept across some
    rounds and remade across others."""
    rng = random.Random(7)
    consumers = [dyb.DynBatchBlock(CastAdd()) for _ in range(2)]
    made = []
    for round_ in range(12):
        if round_ % 4 == 3:     # drop and remake the consumers too
            consumers = [dyb.DynBatchBlock(CastAdd()) for _ in range(2)]
        calls, expected, results = _one_round(rng, consumers, made)
        for (block, ctx, args), want, out in zip(calls, expected, results):
            got = out.asnumpy()
            assert got.shape == want.shape, (got.shape, want.shape)
            np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64),
                                       rtol=1e-6)
        del calls, results
        gc.collect()


@needs_extension
def test_lists_mixing_dtypes_or_contexts_are_refused_every_time():
    """A list mixing dtypes, or lazy values of two contexts, raises as the
    Python recorder does, also after equal-shaped calls were memoized."""
    consumer = dyb.DynBatchBlock(AddItems())
    casts = dyb.DynBatchBlock(Casts())
    x = np.ones((1, 3), np.float32)
    for _ in range(3):
        with private_scope('depth'):
            a32, a64, i32, b64, b32 = casts(x)
            consumer(a32, [b32, a32])        # fine, memoized
            consumer(a64, [b64, a64])
            with pytest.raises(dyb.InputError):
                consumer(a32, [a32, a64])
            with pytest.raises(dyb.InputError):
                consumer(a64, [b64, i32])
            with mx.cpu(1):
                c32 = casts(x)[0]
            consumer(c32, [c32])
            with pytest.raises(dyb.InputError):
                consumer(a32, [a32, c32])
            with pytest.raises(dyb.InputError):
                consumer(c32, [a32])
            with pytest.raises(dyb.InputError):
                consumer(a32, [c32])


@needs_extension
def test_outputs_past_the_eighth_and_shapes_alike_by_value():
    """Outputs 0-11 of a 12-output block, of two shapes that differ only in
    the order of dims ((1, 2, 3) vs (1, 3, 2)), and same-class outputs from
    blocks of other output counts, mixed in one list."""
    twelve = dyb.DynBatchBlock(Multiples(12))
    three = dyb.DynBatchBlock(Multiples(3))
    consumer = dyb.DynBatchBlock(AddItems())
    calls = []
    outs = []
    with dyb.batching('depth', merge_repeats=False, flush_every=None) as scope:
        for _ in range(2):
            for shape in ((1, 2, 3), (1, 3, 2)):
                x = np.ones(shape, np.float32)
                many = twelve(x)
                few = three(x)
                for i in range(12):
                    for j in (0, 2):
                        args = (many[i], [few[j], many[11 - i], many[i]])
                        outs.append((consumer(*args), 2 * (i + 1) + (j + 1) + (12 - i)))
                        calls.append((consumer, mx.cpu(0), args))
        _check_keys([consumer], calls, scope)
    for out, factor in outs:
        np.testing.assert_allclose(out.asnumpy(), np.full(out.shape, factor, np.float32))
