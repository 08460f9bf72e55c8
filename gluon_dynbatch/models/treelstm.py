"""Child-sum Tree-LSTM (Tai et al. 2015) and its SICK relatedness head, as
plain per-sample Gluon blocks.

The blocks are written for one sample at a time: every tensor has a leading
batch axis of 1 and children arrive as Python lists.  Every op acts row-wise
on axis 0 (``FullyConnected``, ``Activation``, ``slice_axis`` on axis 1,
element-wise arithmetic), so :class:`gluon_dynbatch.DynBatchBlock` can merge
calls of equal arity into one batched call without any help from the model.

Gate activations use ``Activation(act_type=...)``, and gates are cut with
``slice_axis``: both measured ~10x faster in MXNet 1.9.1 than ``sigmoid`` /
``tanh`` and ``split`` at large batch.
"""
from mxnet import symbol
from mxnet.gluon import HybridBlock, nn

__all__ = ['ChildSumTreeLSTMCell', 'TreeLSTMNode', 'Similarity', 'sick_target', 'sick_score']


def _add_all(F, items):
    return items[0] if len(items) == 1 else F.add_n(*items)


class ChildSumTreeLSTMCell(HybridBlock):
    """One node of a child-sum Tree-LSTM.

    ``cell(x, child_h, child_c)`` takes the node input ``x`` of shape
    ``(1, input_size)`` and lists of the children's hidden and memory states,
    each ``(1, hidden_size)`` (empty lists for a leaf), and returns ``(h, c)``.
    As in Tai et al., ``i``, ``o`` and ``u`` read the sum of the children's
    hidden states and each child has its own forget gate.

    Zero children add nothing to either sum, so the cell sets
    ``dynbatch_pad_lists``: nodes of different arity may run as one batched
    call with their child lists padded with zeros.
    """
    dynbatch_pad_lists = True

    def __init__(self, hidden_size, input_size=0, prefix=None, params=None):
        super().__init__(prefix=prefix, params=params)
        self.hidden_size = hidden_size
        with self.name_scope():
            # x -> [i, o, u, f] in one GEMM; children -> [i, o, u] and f.
            self.i2h = nn.Dense(4 * hidden_size, in_units=input_size, prefix='i2h_')
            self.h2h_iou = nn.Dense(3 * hidden_size, in_units=hidden_size, use_bias=False,
                                    prefix='h2h_iou_')
            self.h2h_f = nn.Dense(hidden_size, in_units=hidden_size, use_bias=False,
                                  prefix='h2h_f_')

    def hybrid_forward(self, F, x, child_h, child_c):
        H = self.hidden_size
        if child_h:
            gates_x = self.i2h(x)
            iou = F.slice_axis(gates_x, axis=1, begin=0, end=3 * H)
        else:   # a leaf has no forget gate: multiply by the [i, o, u] rows only
            iou = F.FullyConnected(x, _rows(F, self.i2h.weight, x, 3 * H),
                                   _rows(F, self.i2h.bias, x, 3 * H), num_hidden=3 * H)
        if child_h:
            iou = iou + self.h2h_iou(_add_all(F, child_h))
        i = F.Activation(F.slice_axis(iou, axis=1, begin=0, end=H), act_type='sigmoid')
        o = F.Activation(F.slice_axis(iou, axis=1, begin=H, end=2 * H), act_type='sigmoid')
        u = F.Activation(F.slice_axis(iou, axis=1, begin=2 * H, end=3 * H), act_type='tanh')
        c = i * u
        if child_h:
            f_x = F.slice_axis(gates_x, axis=1, begin=3 * H, end=4 * H)
            kept = [F.Activation(f_x + self.h2h_f(h_k), act_type='sigmoid') * c_k
                    for h_k, c_k in zip(child_h, child_c)]
            c = c + _add_all(F, kept)
        h = o * F.Activation(c, act_type='tanh')
        return h, c


def _rows(F, param, like, count):
    """The first ``count`` rows of a child block's parameter, as a symbol
    when tracing and as an NDArray when running imperatively."""
    value = param.var() if F is symbol else param.data(like.context)
    return F.slice_axis(value, axis=0, begin=0, end=count)


class TreeLSTMNode(HybridBlock):
    """Word embedding followed by a :class:`ChildSumTreeLSTMCell`.

    ``node(token, child_h, child_c)`` takes the token id as a ``(1,)`` array.
    Feeding ids instead of embedding rows lets DynBatchBlock send the ids of a
    whole flush to the device at once (host data) and look them up with one
    ``Embedding`` op, instead of one slicing op per node.
    """
    dynbatch_pad_lists = True

    def __init__(self, vocab_size, embed_size=300, hidden_size=150, sparse_grad=False,
                 prefix=None, params=None):
        super().__init__(prefix=prefix, params=params)
        with self.name_scope():
            self.embedding = nn.Embedding(vocab_size, embed_size, sparse_grad=sparse_grad,
                                          prefix='embedding_')
            self.cell = ChildSumTreeLSTMCell(hidden_size, embed_size, prefix='cell_')

    def hybrid_forward(self, F, token, child_h, child_c):
        return self.cell(self.embedding(token), child_h, child_c)


class Similarity(HybridBlock):
    """Tai et al.'s relatedness head: from the two sentence vectors ``hl, hr``
    (each ``(1, hidden_size)``) to log-probabilities over ``num_classes``
    scores, through ``[hl * hr, |hl - hr|]`` and a sigmoid layer."""

    def __init__(self, hidden_size=50, num_classes=5, in_units=0, prefix=None, params=None):
        super().__init__(prefix=prefix, params=params)
        with self.name_scope():
            self.wh = nn.Dense(hidden_size, in_units=2 * in_units if in_units else 0,
                               prefix='wh_')
            self.wp = nn.Dense(num_classes, in_units=hidden_size, prefix='wp_')

    def hybrid_forward(self, F, hl, hr):
        features = F.concat(hl * hr, F.abs(hl - hr), dim=1)
        hidden = F.Activation(self.wh(features), act_type='sigmoid')
        return F.log_softmax(self.wp(hidden), axis=-1)


def sick_target(score, num_classes=5):
    """Tai et al.'s sparse target distribution for a relatedness score in
    ``[1, num_classes]``: the mass sits on the two classes around the score."""
    import numpy as np
    score = np.asarray(score, dtype='float32').reshape(-1)
    bad = ~((score >= 1) & (score <= num_classes))      # NaN too
    if bad.any():
        raise ValueError('sick_target: score %r lies outside [1, %d]'
                         % (float(score[bad][0]), num_classes))
    target = np.zeros((score.size, num_classes), dtype='float32')
    floor = np.floor(score).astype(int)
    for row, (s, fl) in enumerate(zip(score, floor)):
        if fl >= num_classes:
            target[row, num_classes - 1] = 1.0
        else:
            target[row, fl - 1] = fl - s + 1
            target[row, fl] = s - fl
    return target


def sick_score(log_probs):
    """Expected score ``sum_k k * p_k`` from log-probabilities ``(N, C)``."""
    import numpy as np
    probs = np.exp(np.asarray(log_probs))
    return probs @ np.arange(1, probs.shape[1] + 1, dtype=probs.dtype)
