"""The hand-batched Tree-LSTM baseline (benchmarks/handbatched.py) must compute
exactly the per-sample model: same log-probs and same gradients for every
parameter, on random trees of all shapes (single-node trees, wide nodes,
deep chains, roots on different levels)."""
import os
import sys

import numpy as np
import pytest
import mxnet as mx
from mxnet import autograd, nd

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), '..')
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, 'benchmarks'))

from gluon_dynbatch.models.treelstm import TreeLSTMNode, Similarity  # noqa: E402
from handbatched import HandBatchedTreeLSTM, I2H_MODES  # noqa: E402

VOCAB, EMBED, HIDDEN = 50, 8, 6


class Tree:
    def __init__(self, idx):
        self.idx = idx
        self.children = []


def random_tree(n, rng, max_arity=6):
    """Random tree over ``n`` tokens from a random parent array (each token
    after the first in a random order attaches to an earlier one with fewer
    than ``max_arity`` children)."""
    nodes = [Tree(i) for i in range(n)]
    perm = rng.permutation(n)
    for k in range(1, n):
        while True:
            parent = nodes[perm[rng.randint(k)]]
            if len(parent.children) < max_arity:
                break
        parent.children.append(nodes[perm[k]])
    return nodes[perm[0]]


def chain(n):
    nodes = [Tree(i) for i in range(n)]
    for a, b in zip(nodes, nodes[1:]):
        a.children.append(b)
    return nodes[0]


def random_pairs(n_pairs, rng):
    pairs = []
    for _ in range(n_pairs):
        item = []
        for _side in range(2):
            n = rng.randint(1, 21)
            item += [rng.randint(VOCAB, size=n), random_tree(n, rng)]
        pairs.append(tuple(item))
    return pairs


def reference(node, head, pairs):
    def encode(ids, tree):
        states = [encode(ids, ch) for ch in tree.children]
        return node(nd.array([ids[tree.idx]]), [s[0] for s in states], [s[1] for s in states])

    outs = [head(encode(a_ids, a_tree)[0], encode(b_ids, b_tree)[0])
            for a_ids, a_tree, b_ids, b_tree in pairs]
    return nd.concat(*outs, dim=0)


def make_model(seed):
    mx.random.seed(seed)
    node = TreeLSTMNode(VOCAB, EMBED, HIDDEN)
    head = Similarity(7, 5)  # in_units deferred: both paths must cope
    node.initialize(mx.init.Uniform(0.5))
    head.initialize(mx.init.Uniform(0.5))
    return node, head


def outputs_and_grads(fn, node, head, pairs, weights):
    params = list(node.collect_params().values()) + list(head.collect_params().values())
    with autograd.record():
        out = fn(pairs)
        loss = (out * weights).sum()
    loss.backward()
    return out.asnumpy(), {p.name: p.grad().asnumpy().copy() for p in params}


def check(pairs, seed=0, all_used=True, i2h='level'):
    rng = np.random.RandomState(seed)
    node, head = make_model(seed)
    weights = nd.array(rng.randn(len(pairs), 5))
    ref_out, ref_grads = outputs_and_grads(lambda p: reference(node, head, p),
                                           node, head, pairs, weights)
    model = HandBatchedTreeLSTM(node, head, i2h=i2h)
    out, grads = outputs_and_grads(model, node, head, pairs, weights)
    assert out.shape == (len(pairs), 5)
    np.testing.assert_allclose(out, ref_out, rtol=1e-5, atol=1e-5)
    assert set(grads) == set(ref_grads)
    for name, ref in ref_grads.items():
        scale = max(np.abs(ref).max(), 1e-3)
        np.testing.assert_allclose(grads[name], ref, rtol=1e-4, atol=1e-4 * scale,
                                   err_msg=name)
        if all_used:  # the test really exercises every parameter
            assert np.abs(ref).max() > 0, name


@pytest.mark.parametrize('i2h', I2H_MODES)
def test_random_trees(i2h):
    check(random_pairs(24, np.random.RandomState(1)), seed=1, i2h=i2h)


@pytest.mark.parametrize('i2h', I2H_MODES)
def test_edge_shapes(i2h):
    rng = np.random.RandomState(2)
    ids = lambda n: rng.randint(VOCAB, size=n)  # noqa: E731
    star = Tree(0)
    star.children = [Tree(i) for i in range(1, 7)]
    pairs = [
        (ids(1), Tree(0), ids(1), Tree(0)),          # single nodes
        (ids(7), star, ids(9), chain(9)),            # wide vs deep
        (ids(12), chain(12), ids(3), random_tree(3, rng)),
    ]
    check(pairs, seed=2, i2h=i2h)


@pytest.mark.parametrize('i2h', I2H_MODES)
def test_only_leaves(i2h):
    rng = np.random.RandomState(3)
    check([(rng.randint(VOCAB, size=2), Tree(1), rng.randint(VOCAB, size=1), Tree(0))
           for _ in range(3)], seed=3, all_used=False, i2h=i2h)


def heights(tree, out):
    """Heights of all nodes of ``tree`` appended to ``out`` (with the number
    of children of each node); returns the height of ``tree``."""
    h = 1 + max([heights(ch, out) for ch in tree.children], default=-1)
    out.append((h, len(tree.children)))
    return h


def test_prepare_layout():
    """Levels are the node heights; each level's children and CSR agree."""
    pairs = random_pairs(10, np.random.RandomState(4))
    node, head = make_model(4)
    prep = HandBatchedTreeLSTM(node, head).prepare(pairs)
    nodes = []
    for a_ids, a_tree, b_ids, b_tree in pairs:
        heights(a_tree, nodes)
        heights(b_tree, nodes)
    hs = np.array([h for h, _ in nodes])
    kids_per_level = np.bincount(hs, weights=[k for _, k in nodes]).astype(int)
    assert prep.n_nodes == len(nodes)
    assert [lv.n for lv in prep.levels] == list(np.bincount(hs))
    assert prep.levels[0].child is None and prep.levels[0].inc is None
    for lv, info in enumerate(prep.levels[1:], 1):
        m = kids_per_level[lv]
        assert info.inc.shape == (m, info.n)
        assert info.child.shape == (m,) and info.parent.shape == (m,)
        # every parent has at least one child
        assert set(info.parent.asnumpy().tolist()) == set(range(info.n))
    # the last frontier is the 2 * P roots
    assert prep.levels[-1].keep is None or prep.levels[-1].keep.shape == (2 * len(pairs),)


def test_float_ids_and_trainer_step():
    """Token ids may come as float32 arrays; a gluon Trainer over the
    node's and head's parameters trains through the hand-batched forward."""
    pairs = [(a.astype(np.float32), ta, b.astype(np.float32), tb)
             for a, ta, b, tb in random_pairs(6, np.random.RandomState(5))]
    node, head = make_model(5)
    model = HandBatchedTreeLSTM(node, head)
    ref = reference(node, head, pairs).asnumpy()
    np.testing.assert_allclose(model(pairs).asnumpy(), ref, rtol=1e-5, atol=1e-5)
    params = node.collect_params()
    params.update(head.collect_params())
    trainer = mx.gluon.Trainer(params, 'adagrad', {'learning_rate': 0.05})
    before = {k: p.data().asnumpy().copy() for k, p in params.items()}
    with autograd.record():
        loss = -model(pairs).sum()
    loss.backward()
    trainer.step(len(pairs))
    for k, p in params.items():
        assert not np.allclose(p.data().asnumpy(), before[k]), k
