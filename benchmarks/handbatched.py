"""Expert hand-batched child-sum Tree-LSTM + SICK similarity head (MXNet 1.9.1,
imperative NDArray, CPU).

This is the baseline that dynamic batching is measured against: the same model
as :mod:`gluon_dynbatch.models.treelstm` (``TreeLSTMNode`` + ``Similarity``),
computed for a whole minibatch of sentence pairs with the batching written out
by hand.  It reads the weights of a ``TreeLSTMNode`` and a ``Similarity``
through ``Parameter.data()``, so under ``autograd.record()`` the gradients
land in those very Parameters and a ``gluon.Trainer`` over
``node.collect_params()`` and ``head.collect_params()`` trains them.

Layout (:meth:`HandBatchedTreeLSTM.prepare`, all numpy): every node of every
tree of the minibatch is put on a *level* = its height (leaves 0, a node one
above its highest child).  The nodes of a level depend only on lower levels,
so a level is computed by one call of each op.  The forward
(:meth:`HandBatchedTreeLSTM.forward`) embeds the minibatch's distinct token
ids once (one ``Embedding``) and then, per level:

* gathers the level's embeddings from that table (one ``take``) and applies
  ``i2h`` with one GEMM.  Leaves use only the ``[i, o, u]`` rows of the
  weight (a leaf has no forget gate).  For inner nodes ``[i, o, u]`` come
  from ONE GEMM over ``[x, sum_h]`` with the weight ``[W_x_iou | W_h_iou]``
  (no separate ``h2h_iou`` GEMM, no add), and ``f_x`` from a small GEMM over
  ``x``;
* gathers the children's ``[h, c]`` rows with one ``take`` from the
  *frontier* (below) and sums them per parent with a CSR ``sparse.dot`` by the
  child x parent incidence matrix (``transpose_a=True``; ~40x faster than
  summing a padded gather).  ``h2h_iou`` thus runs on the sums (one row per
  parent); the forget gates run on the child rows (``f_x`` of the parent
  gathered by ``take``, ``h2h_f`` of the child), and ``f * c`` is summed per
  parent by the same CSR dot;
* cuts the gates with one ``split`` of the ``(n, k, H)`` reshape (a
  contiguous copy; ``split`` along the last axis of a 2-D array is ~10x
  slower, and ``slice_axis`` writes a full-size gradient per slice in
  backward).  Nonlinearities use ``Activation(act_type=...)`` (~10x faster
  than ``sigmoid``/``tanh`` in MXNet 1.9.1 at large batch).

The *frontier* after a level is a ``(F, 2, H)`` array with ``[h, c]`` of every
node computed so far whose parent is not (roots stay to the end):
``take(concat(frontier, new states), keep)``.  Children from any lower level
are then one gather away, and a node's state is only copied while it waits
for its parent (~1.5 N rows in all on SICK-like trees), instead of gathering
from the concatenation of all previous levels (quadratic copies, and each
gather's backward zero-fills its whole source).  After the last level the
frontier is exactly the roots, left trees then right trees, and the
similarity head runs on all pairs at once.

The recurring cost in MXNet 1.9.1 imperative backward is that an array used
by k ops gets k full-size gradient arrays summed by ``add_n``, and that the
backward of ``slice_axis`` / ``take`` writes a gradient the size of its
*input*.  Most choices below avoid fan-out from large arrays.

Measured (NaiveEngine, 1 thread, 2-core AMD EPYC) and rejected:

* one ``i2h`` GEMM over all nodes up front (``i2h='global'``), then cut into
  levels by peeling rows off the rest with ``slice_axis``: the GEMM is no
  faster (the per-level GEMMs already run at ~85 GFLOP/s) while each slice's
  backward writes a gradient of the whole 4H-wide remainder: ~20% slower
  training at minibatch 256, a tie at 25.  Peeling the 300-wide embeddings
  instead was ~5% slower than gathering them from the table of distinct ids;
* ``split_v2`` along axis 0 (to cut levels, or the states into per-parent-level
  blocks): its kernel copies at ~8 ns/element (24 ms for one 5000 x 600
  array, vs 0.7 ms for a copy);
* ``h2h_iou`` padded to 4H rows and added to the up-front ``i2h``
  (``g + sum_h W^T``), with or without ``linalg.gemm``'s fused add: more
  FLOPs and an extra pass; ``linalg.gemm`` for the forget-gate add: neutral;
* the sum as ``dot(csr, dense)`` with the parent x child matrix: its
  backward w.r.t. the dense side falls back to dense storage (a dense GEMM
  with the incidence matrix).  With the child x parent matrix and
  ``transpose_a=True`` the backward is a sparse product; ``forward_stype=
  'default'`` keeps the output dense (else row_sparse, and the next
  FullyConnected falls back);
* per-level ``Embedding`` of the parameter: each backward writes a dense
  vocab x E gradient (~2x slower backward at minibatch 25);
  ``sparse_grad=True`` fails when the Parameter's gradient is dense;
* one ``nd.array`` per index array in ``prepare`` (~70 us each): all index
  arrays now travel as one int32 buffer used through views (~5 us each);
* ``gc.disable()`` around the forward: no measurable change.

``i2h='unique'`` applies ``i2h`` once to the distinct token ids and gathers
the gate rows per level: exact, a data-dependent saving (~60% of the ``i2h``
FLOPs at minibatch 256 with uniform random ids; on SICK ~4,900 nodes share
~750 ids).  gluon_dynbatch makes the same saving per step (the host-only ops
of a step run once per distinct host row, see ``gluon_dynbatch.lower``), so
``bench_treelstm.py`` runs this mode too, as ``hand-batched-unique``.  The
default stays ``'level'``, the form measured in every earlier run.

Run ``python benchmarks/handbatched.py`` for the throughput benchmark (see
:func:`main`).
"""
import argparse
import time

import numpy as np
import mxnet as mx
from mxnet import autograd, nd

__all__ = ['HandBatchedTreeLSTM', 'Prepared', 'Level', 'random_tree', 'random_pairs']

I2H_MODES = ('level', 'global', 'unique')


def _data(param, shape):
    """``param.data()``, finishing a deferred initialisation first if needed
    (e.g. ``Similarity(in_units=0)`` before its first call): here the input
    sizes are known."""
    try:
        return param.data()
    except mx.gluon.parameter.DeferredInitializationError:
        param.shape = shape
        param._finish_deferred_init()  # pylint: disable=protected-access
        return param.data()


def _walk(tree, parent, base, idx, par, lev):
    """Pre-order walk of one tree appending each node's token position
    (offset by ``base`` into the minibatch's concatenated ids), parent walk
    index and height; returns the height of ``tree``."""
    me = len(idx)
    idx.append(tree.idx + base)
    par.append(parent)
    lev.append(0)
    height = 0
    for child in tree.children:
        h = _walk(child, me, base, idx, par, lev) + 1
        if h > height:
            height = h
    lev[me] = height
    return height


class Level:
    """Device-side data of one level (NDArray views into the minibatch's
    index buffer).

    ``n``: number of nodes; ``tokens``: their rows in the table of the
    minibatch's distinct ids (with ``i2h='global'``: their token ids);
    ``child``:
    rows of their children in the frontier before this level; ``inc``:
    ``(n_children, n)`` CSR child -> parent incidence (a single 1 per row), so
    that ``dot(inc, X, transpose_a=True)`` sums the children's rows ``X`` per
    parent; ``parent``: for each child the row of its parent in this level;
    ``keep``: rows of ``concat(frontier, new states)`` forming the next
    frontier (after the last level: the roots, left trees then right trees),
    None when that is all of them in order.  ``child``, ``inc`` and
    ``parent`` are None for the leaves.
    """
    __slots__ = ('n', 'tokens', 'child', 'inc', 'parent', 'keep')


class Prepared:
    """What :meth:`HandBatchedTreeLSTM.prepare` returns: ``tokens`` (for all
    nodes, level by level, what :attr:`Level.tokens` holds), ``unique`` (the
    distinct token ids; None with ``i2h='global'``), ``levels`` (list of
    :class:`Level`), ``n_pairs`` and ``n_nodes``."""
    __slots__ = ('tokens', 'unique', 'levels', 'n_pairs', 'n_nodes')


class HandBatchedTreeLSTM:
    """Hand-batched ``TreeLSTMNode`` + ``Similarity`` over a minibatch of
    sentence pairs (see the module docstring for the layout and the choices).

    ``model(pairs)``, with ``pairs`` a list of ``(a_ids, a_tree, b_ids,
    b_tree)`` (trees: objects with ``idx`` and ``children``; ids: int arrays,
    ``ids[tree.idx]`` is the node's token), returns the ``(len(pairs),
    num_classes)`` log-probabilities.

    ``i2h``: ``'level'`` (default, fastest measured: one GEMM per level over
    embeddings gathered from the table of the minibatch's distinct ids),
    ``'global'`` (one GEMM over all nodes, then cut into levels) or
    ``'unique'`` (one GEMM over the distinct ids, gate rows gathered per
    level; a data-dependent saving, see the module docstring).
    """

    def __init__(self, node, head, i2h='level'):
        if i2h not in I2H_MODES:
            raise ValueError('i2h must be one of %s' % (I2H_MODES,))
        self.node = node
        self.head = head
        self.i2h = i2h
        self.vocab_size, self.embed_size = node.embedding.weight.shape
        self.hidden_size = node.cell.hidden_size
        self.head_hidden = head.wh.weight.shape[0]
        self.num_classes = head.wp.weight.shape[0]
        self._ones = self._arange = None                # grown on demand

    @property
    def ctx(self):
        """Context of the parameters (where the index arrays go)."""
        return self.node.embedding.weight.list_ctx()[0]

    def _constants(self, size):
        """Cached ``ones`` (CSR values) and ``arange`` (CSR row pointers of a
        one-entry-per-row matrix) of at least ``size`` entries, so that the
        CSR matrices are built from views, without host copies."""
        if self._ones is None or self._ones.shape[0] < size:
            size = max(size, 1024 if self._ones is None else 2 * self._ones.shape[0])
            self._ones = nd.ones((size,), ctx=self.ctx)
            self._arange = nd.array(np.arange(size + 1), ctx=self.ctx, dtype='int64')
        return self._ones, self._arange

    # ------------------------------------------------------------------ host
    def prepare(self, pairs):
        """All host-side (numpy) work for a minibatch; see :class:`Prepared`.

        Trees are numbered left trees first (``0..P-1``), then right trees
        (``P..2P-1``); nodes get global rows sorted by level.  The nodes are
        walked once in Python, the rest is O(levels) numpy calls.  All index
        arrays go to MXNet as one int32 buffer (and the CSR column indices as
        one int64 buffer), then per-level views: creating an NDArray from
        numpy costs ~70 us, 10x a view.
        """
        n_pairs = len(pairs)
        idx, par, lev = [], [], []
        ids_parts, roots = [], []
        base = 0
        for side in (0, 2):
            for pair in pairs:
                ids, tree = pair[side], pair[side + 1]
                roots.append(len(idx))
                _walk(tree, -1, base, idx, par, lev)
                ids_parts.append(ids)
                base += len(ids)
        all_ids = np.concatenate(ids_parts).astype(np.int64, copy=False)
        idx = np.asarray(idx, dtype=np.int64)
        par = np.asarray(par, dtype=np.int64)
        lev = np.asarray(lev, dtype=np.int64)
        roots = np.asarray(roots, dtype=np.int64)
        n_nodes = len(idx)
        n_levels = int(lev.max()) + 1

        # Global rows: by level (stable, so walk order inside a level).
        order = np.argsort(lev, kind='stable')
        pos = np.empty(n_nodes, dtype=np.int64)   # walk index -> global row
        pos[order] = np.arange(n_nodes)
        # Level that consumes each node (its parent's); roots: n_levels.
        plev_g = np.where(par < 0, n_levels, lev[np.maximum(par, 0)])[order]
        par_g = np.where(par < 0, -1, pos[np.maximum(par, 0)])[order]
        offsets = np.concatenate([[0], np.cumsum(np.bincount(lev, minlength=n_levels))])
        rows = np.arange(n_nodes)
        where = np.empty(n_nodes, dtype=np.int64)  # global row -> frontier row

        tokens = all_ids[idx[order]]
        if self.i2h != 'global':
            # Distinct ids: embedded once, gathered per level.
            unique, tokens = np.unique(tokens, return_inverse=True)
            chunks = [tokens, unique]
        else:
            chunks = [tokens]
        prows = []
        spans = []        # per level: (child, parent, keep) numpy or None
        front = None      # global rows of the frontier, in frontier order
        for lv in range(n_levels):
            lo, hi = offsets[lv], offsets[lv + 1]
            child = parent = keep = None
            if lv:
                where[front] = np.arange(len(front))
                kids = rows[:lo][plev_g[:lo] == lv]
                child, parent = where[kids], par_g[kids] - lo
                prows.append(parent)
            joined = rows[lo:hi] if front is None else np.concatenate([front, rows[lo:hi]])
            nxt = joined[plev_g[joined] > lv] if lv + 1 < n_levels else pos[roots]
            if len(nxt) != len(joined) or (nxt != joined).any():
                where[joined] = np.arange(len(joined))
                keep = where[nxt]
            front = nxt
            spans.append((child, parent, keep))
        for span in spans:
            chunks.extend(a for a in span if a is not None)

        # One host -> NDArray copy per buffer, then views.
        buf = nd.array(np.concatenate(chunks), ctx=self.ctx, dtype='int32')
        cols = nd.array(np.concatenate(prows), ctx=self.ctx, dtype='int64') if prows else None
        ones, arange = self._constants(n_nodes)
        prep = Prepared()
        prep.n_pairs = n_pairs
        prep.n_nodes = n_nodes
        prep.tokens = buf[0:n_nodes]
        at, at_cols = n_nodes, 0
        prep.unique = None
        if self.i2h != 'global':
            prep.unique = buf[at:at + len(unique)]
            at += len(unique)
        prep.levels = []
        for lv, (child, parent, keep) in enumerate(spans):
            info = Level()
            lo, hi = int(offsets[lv]), int(offsets[lv + 1])
            info.n = hi - lo
            info.tokens = prep.tokens[lo:hi]
            info.child = info.parent = info.inc = info.keep = None
            if child is not None:
                m = len(child)
                info.child = buf[at:at + m]
                info.parent = buf[at + m:at + 2 * m]
                at += 2 * m
                info.inc = nd.sparse.csr_matrix(
                    (ones[0:m], cols[at_cols:at_cols + m], arange[0:m + 1]), shape=(m, info.n),
                    ctx=self.ctx)
                at_cols += m
            if keep is not None:
                info.keep = buf[at:at + len(keep)]
                at += len(keep)
            prep.levels.append(info)
        return prep

    # ---------------------------------------------------------------- device
    def forward(self, prep):
        """Log-probabilities ``(n_pairs, num_classes)`` for a prepared
        minibatch; differentiable w.r.t. all parameters of ``node`` and
        ``head`` (embedding included)."""
        H, E, V = self.hidden_size, self.embed_size, self.vocab_size
        cell, head, mode = self.node.cell, self.head, self.i2h
        w_emb = _data(self.node.embedding.weight, (V, E))
        w_x = _data(cell.i2h.weight, (4 * H, E))
        b_x = _data(cell.i2h.bias, (4 * H,))
        w_iou = _data(cell.h2h_iou.weight, (3 * H, H))
        w_f = _data(cell.h2h_f.weight, (H, H))
        w_wh = _data(head.wh.weight, (self.head_hidden, 2 * H))
        b_wh = _data(head.wh.bias, (self.head_hidden,))
        w_wp = _data(head.wp.weight, (self.num_classes, self.head_hidden))
        b_wp = _data(head.wp.bias, (self.num_classes,))
        levels = prep.levels

        sparse_grad = self.node.embedding._kwargs['sparse_grad']

        def embed(tokens):
            return nd.Embedding(tokens, w_emb, input_dim=V, output_dim=E,
                                sparse_grad=sparse_grad)

        def peel(rest, n, last):
            """(first ``n`` rows, remaining rows) of ``rest``.  Peeling level
            by level keeps each slice's backward (which writes a gradient the
            size of its input) to the shrinking remainder."""
            if last:
                return rest, None
            return (nd.slice_axis(rest, axis=0, begin=0, end=n),
                    nd.slice_axis(rest, axis=0, begin=n, end=None))

        def cut(arr, k):
            """``(n, k*H)`` -> k arrays ``(n, H)``: one contiguous-copy split."""
            return nd.split(arr.reshape((0, k, H)), num_outputs=k, axis=1, squeeze_axis=True)

        if mode == 'level':
            # Leaves: x -> [i, o, u]; inner nodes: [x, sum_h] -> [i, o, u] in
            # one GEMM, and x -> f.
            w_x3 = nd.slice_axis(w_x, axis=0, begin=0, end=3 * H)
            b_x3 = nd.slice_axis(b_x, axis=0, begin=0, end=3 * H)
            w_xf = nd.slice_axis(w_x, axis=0, begin=3 * H, end=4 * H)
            b_xf = nd.slice_axis(b_x, axis=0, begin=3 * H, end=4 * H)
            w_cat = nd.concat(w_x3, w_iou, dim=1)
            # Embeddings of the distinct ids, gathered per level.
            table = embed(prep.unique)
        else:
            # x -> [i, o, u, f] up front (all nodes, or the distinct ids);
            # h2h_iou padded with zero f rows gives the level's [i, o, u, f]
            # pre-activation as ``g + sum_h W4^T``.
            w_4 = nd.concat(w_iou, nd.zeros((H, H), ctx=w_iou.context), dim=0)
            tokens = prep.unique if mode == 'unique' else prep.tokens
            table = rest = nd.FullyConnected(embed(tokens), w_x, b_x, num_hidden=4 * H)

        front = None
        for lv, info in enumerate(levels):
            if mode == 'global':
                g, rest = peel(rest, info.n, lv + 1 == len(levels))
            else:
                g = nd.take(table, info.tokens)
            if lv == 0:
                # Leaves: no children (f, if computed, is unused).
                if mode == 'level':
                    gates = cut(nd.FullyConnected(g, w_x3, b_x3, num_hidden=3 * H), 3)
                else:
                    gates = cut(g, 4)
                c = nd.Activation(gates[0], act_type='sigmoid') * \
                    nd.Activation(gates[2], act_type='tanh')
            else:
                child_h, child_c = nd.split(nd.take(front, info.child), num_outputs=2, axis=1,
                                            squeeze_axis=True)
                sum_h = nd.sparse.dot(info.inc, child_h, transpose_a=True,
                                      forward_stype='default')
                if mode == 'level':
                    gates = cut(nd.FullyConnected(nd.concat(g, sum_h, dim=1), w_cat, b_x3,
                                                  num_hidden=3 * H), 3)
                    f_x = nd.FullyConnected(g, w_xf, b_xf, num_hidden=H)
                else:
                    gates = cut(g + nd.FullyConnected(sum_h, w_4, no_bias=True,
                                                      num_hidden=4 * H), 4)
                    f_x = gates[3]
                # Per-child forget gates: parent's f_x + h2h_f(child h).
                f = nd.Activation(nd.take(f_x, info.parent) +
                                  nd.FullyConnected(child_h, w_f, no_bias=True, num_hidden=H),
                                  act_type='sigmoid')
                kept = nd.sparse.dot(info.inc, f * child_c, transpose_a=True,
                                     forward_stype='default')
                c = nd.Activation(gates[0], act_type='sigmoid') * \
                    nd.Activation(gates[2], act_type='tanh') + kept
            h = nd.Activation(gates[1], act_type='sigmoid') * nd.Activation(c, act_type='tanh')
            states = nd.stack(h, c, axis=1)                 # (n, 2, H)
            if front is not None:
                states = nd.concat(front, states, dim=0)
            front = states if info.keep is None else nd.take(states, info.keep)

        # The frontier is now the roots' [h, c], left trees then right trees.
        P = prep.n_pairs
        roots_h = nd.split(front, num_outputs=2, axis=1, squeeze_axis=True)[0]
        hl = nd.slice_axis(roots_h, axis=0, begin=0, end=P)
        hr = nd.slice_axis(roots_h, axis=0, begin=P, end=2 * P)
        feats = nd.concat(hl * hr, nd.abs(hl - hr), dim=1)
        hidden = nd.Activation(nd.FullyConnected(feats, w_wh, b_wh, num_hidden=self.head_hidden),
                               act_type='sigmoid')
        return nd.log_softmax(nd.FullyConnected(hidden, w_wp, b_wp,
                                                num_hidden=self.num_classes), axis=-1)

    def __call__(self, pairs):
        return self.forward(self.prepare(pairs))


# ---------------------------------------------------------------- benchmark
class _Tree:
    """Minimal tree: ``idx`` (token position) and ``children``."""
    __slots__ = ('idx', 'children')

    def __init__(self, idx):
        self.idx = idx
        self.children = []


def random_tree(n, rng):
    """Random dependency-like tree over ``n`` tokens: tokens are attached in a
    random order, each to a uniformly chosen already-attached token (a random
    recursive tree: height ~ e ln n; 10 tokens give heights ~3-5, like
    dependency parses of SICK sentences)."""
    nodes = [_Tree(i) for i in range(n)]
    perm = rng.permutation(n)
    for k in range(1, n):
        nodes[perm[rng.randint(k)]].children.append(nodes[perm[k]])
    return nodes[perm[0]]


def random_pairs(n_pairs, vocab_size, rng, mean_len=10, max_len=30):
    """SICK-like random pairs: sentence lengths 3 + Poisson(mean_len - 3)
    (SICK: ~10 tokens on average), uniform random token ids, random trees."""
    pairs = []
    for _ in range(n_pairs):
        item = []
        for _side in range(2):
            n = int(min(max_len, 3 + rng.poisson(mean_len - 3)))
            item += [rng.randint(vocab_size, size=n), random_tree(n, rng)]
        pairs.append(tuple(item))
    return pairs


def main():
    """Throughput in pairs/s of the hand-batched model on SICK-like random
    pairs: inference (prepare + forward + ``asnumpy``) and training (prepare,
    forward and backward under autograd, ``Trainer('adagrad', lr 0.05)``
    step), the median of ``--repeats`` passes over ``--pairs`` pairs after a
    warm-up pass.  Run with ``MXNET_ENGINE_TYPE=NaiveEngine
    OMP_NUM_THREADS=1`` (or 2)."""
    import os
    import sys
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:0] = [os.path.join(here, '..'), here]
    from gluon_dynbatch.models.treelstm import TreeLSTMNode, Similarity
    from bench_treelstm import positive_int     # the benchmarks' checked numbers

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument('--batch', type=positive_int, nargs='+', default=[25, 256],
                        help='minibatch sizes, each at most --pairs')
    parser.add_argument('--pairs', type=positive_int, default=2048)
    parser.add_argument('--repeats', type=positive_int, default=5)
    parser.add_argument('--vocab', type=positive_int, default=2400)
    parser.add_argument('--embed', type=positive_int, default=300)
    parser.add_argument('--hidden', type=positive_int, default=150)
    parser.add_argument('--i2h', default='level', choices=I2H_MODES)
    parser.add_argument('--modes', nargs='+', default=['infer', 'train'],
                        choices=['infer', 'train', 'prepare'])
    parser.add_argument('--sick', action='store_true',
                        help='use the first --pairs pairs of the shuffled SICK test split '
                             '(gluon_dynbatch.data.sick) instead of random SICK-like pairs')
    args = parser.parse_args()
    if max(args.batch) > args.pairs:    # (it would run, and be reported as, a smaller one)
        parser.error('argument --batch: %d is more than --pairs %d: a minibatch holds at '
                     'most the pairs there are' % (max(args.batch), args.pairs))
    print('MXNET_ENGINE_TYPE=%s OMP_NUM_THREADS=%s i2h=%s data=%s' % (
        os.environ.get('MXNET_ENGINE_TYPE'), os.environ.get('OMP_NUM_THREADS'), args.i2h,
        'SICK test' if args.sick else 'random SICK-like'))

    rng = np.random.RandomState(0)
    mx.random.seed(0)
    if args.sick:
        from gluon_dynbatch.data import sick
        splits = {s: sick.load_split(sick.find_sick_dir(), s) for s in sick.SPLITS}
        vocab = sick.build_vocab(list(splits.values()))
        test = splits['test']
        sick.index_pairs(test, vocab)
        test = [test[i] for i in rng.permutation(len(test))][:args.pairs]
        data = [(p.a_ids, p.a_tree, p.b_ids, p.b_tree) for p in test]
        args.vocab = len(vocab)
        if max(args.batch) > len(data):
            parser.error('argument --batch: %d is more than the %d pairs of the SICK test '
                         'split' % (max(args.batch), len(data)))
    else:
        data = random_pairs(args.pairs, args.vocab, rng)
    node = TreeLSTMNode(args.vocab, args.embed, args.hidden)
    head = Similarity(50, 5, in_units=args.hidden)
    node.initialize(mx.init.Xavier())
    head.initialize(mx.init.Xavier())
    params = node.collect_params()
    params.update(head.collect_params())
    trainer = mx.gluon.Trainer(params, 'adagrad', {'learning_rate': 0.05})
    model = HandBatchedTreeLSTM(node, head, i2h=args.i2h)
    targets = nd.array(rng.dirichlet(np.ones(5), size=len(data)))

    def infer(batch):
        for s in range(0, len(data), batch):
            model(data[s:s + batch]).asnumpy()

    def train(batch):
        for s in range(0, len(data), batch):
            chunk = data[s:s + batch]
            prep = model.prepare(chunk)
            with autograd.record():
                loss = -(model.forward(prep) * targets[s:s + len(chunk)]).sum()
            loss.backward()
            trainer.step(len(chunk))
        nd.waitall()

    def prepare_only(batch):
        for s in range(0, len(data), batch):
            model.prepare(data[s:s + batch])

    runs = {'infer': infer, 'train': train, 'prepare': prepare_only}
    for batch in args.batch:
        for mode in args.modes:
            runs[mode](batch)
            times = []
            for _ in range(args.repeats):
                tic = time.perf_counter()
                runs[mode](batch)
                times.append(time.perf_counter() - tic)
            best = len(data) / min(times)
            print('minibatch %4d %-8s %7.0f pairs/s  (median of %d; best %.0f)'
                  % (batch, mode, len(data) / np.median(times), args.repeats, best), flush=True)


if __name__ == '__main__':
    main()
