"""Refcount / object / RSS stress of the C recorder (run as a script):
many scopes recording calls of blocks with several outputs, dtypes, shapes
and contexts, producers made and dropped each round.  Prints per phase the
refcounts of dtype types, contexts and a shape, gc object count and RSS.

python tests/stress_review_refcounts.py [rounds] [new_shapes]
  new_shapes=1: every round uses a shape never seen (leaf_classes grows)."""
import gc
import os
import resource
import sys

import mxnet as mx
import numpy as np
from mxnet import gluon

import gluon_dynbatch as dyb
from gluon_dynbatch import accel

sys.path.insert(0, os.path.dirname(__file__))
from test_review_memo import CastAdd, Casts, Multiples  # noqa: E402


def rss_mb():
    with open('/proc/self/statm') as f:
        return int(f.read().split()[1]) * os.sysconf('SC_PAGE_SIZE') / 2 ** 20


CTX0, CTX1 = mx.cpu(0), mx.cpu(1)
DT32 = np.dtype('float32')


def one_round(consumer, keeper, width):
    producers = [keeper] + [dyb.DynBatchBlock(Multiples(n)) for n in (3, 10)] + [dyb.DynBatchBlock(Casts())]
    outs = []
    with dyb.batching('depth'):
        for ctx in (CTX0, CTX1):
            with ctx:
                for w in (width, width + 1):
                    x = np.full((1, w), 0.5, np.float32)
                    made = []
                    for p in producers:
                        made.extend(p(x))
                    f32 = [v for v in made if v.dtype == np.float32]
                    f64 = [v for v in made if v.dtype == np.float64]
                    for i in range(12):
                        outs.append(consumer(made[i % len(made)], f32[i % 3:i % 3 + 1 + i % 4]))
                        outs.append(consumer(made[-1 - i % 5], f64[:1 + i % 2]))
                        outs.append(consumer(x, []))
                        outs.append(consumer(x, [x.copy(), x]))
    s = 0.0
    for o in outs:
        s += float(o.asnumpy().sum())
    return s


def snapshot(shape):
    gc.collect()
    return dict(f32=sys.getrefcount(np.float32), f64=sys.getrefcount(np.float64),
                i32=sys.getrefcount(np.int32), dt32=sys.getrefcount(DT32),
                ctx0=sys.getrefcount(CTX0), ctx1=sys.getrefcount(CTX1),
                shape=sys.getrefcount(shape), objects=len(gc.get_objects()),
                rss=round(rss_mb(), 1), maxrss=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)


def main():
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 300
    new_shapes = len(sys.argv) > 2 and sys.argv[2] == '1'
    print('accel:', accel.STATUS)
    consumer = dyb.DynBatchBlock(CastAdd())
    keeper = dyb.DynBatchBlock(Multiples(9))        # kept: its signatures' shapes measured
    one_round(consumer, keeper, 3)
    sig = next(iter(keeper.signatures()))
    shape = sig.out_info[0][0]
    for r in range(rounds):
        if r % 25 == 0:
            consumer = dyb.DynBatchBlock(CastAdd())     # dropped and remade too
        one_round(consumer, keeper, 3 + (r if new_shapes else r % 2))
        if r in (rounds // 5, 2 * rounds // 5, 3 * rounds // 5, 4 * rounds // 5, rounds - 1):
            print(r, snapshot(shape), flush=True)


if __name__ == '__main__':
    main()
