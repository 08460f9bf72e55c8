"""Per-operator batching rules: which MXNet ops act row-wise on axis 0.

A block's per-sample symbol is batch-safe when every op that touches a
*batched* tensor (one derived from a per-sample input) has a rule here that
accepts its attributes and inputs.  Ops that only touch *shared* tensors
(parameters, constants) need no rule: they compute the same thing per sample
and per batch.  An op without a rule makes the block run per sample, with the
reason reported; we never guess (as JAX's vmap raises rather than guess).

A rule is ``rule(op) -> None | str``: ``None`` when batching is safe, else the
reason it is not.  ``op`` is an :class:`OpView` with the op's attributes and,
per input, whether it is batched and its per-sample shape.
"""
import ast
import warnings

__all__ = ['register_batching_rule', 'batching_rule', 'draws_random', 'OpView', 'RULES',
           'BUILTIN_RULES', 'UNBATCHABLE']

RULES = {}
"""Operator name -> its batching rule (see :func:`~gluon_dynbatch.register_batching_rule`)."""
NOT_FUNCTIONS = {'Custom'}
"""Operators that may give other outputs for equal inputs: every custom op
(``Custom``, whose Python code may draw random numbers or keep state; one
rule serves every ``op_type``, so one custom op's word cannot vouch for
another's), and each operator whose rule the user registered without
``function_of_inputs=True``.  Calls of a block that has one are never
merged (see :func:`~gluon_dynbatch.trace.is_function_of_inputs`)."""


def register_batching_rule(*op_names, function_of_inputs=False):
    """Decorator registering ``rule`` for each MXNet operator name.

    Overriding an existing rule warns, as ``mxnet.registry`` does.  Pass
    ``function_of_inputs=True`` when the operator's outputs depend on its
    inputs alone (no random draws, no state kept between calls): only then
    may calls with equal host arguments of a block that uses it share one
    result (``batching(merge_repeats=True)``, see :data:`NOT_FUNCTIONS`;
    never for ``'Custom'``, whose rule covers every custom op).

    Misuse fails here, where it was silent (found by a review): a name
    that is no MXNet operator (a misspelling registered nothing useful),
    no name (``@register_batching_rule`` without parentheses), the rule
    given as an argument, or a rule that cannot be called."""
    _check_operator_names(op_names)

    def register(rule):
        if not callable(rule):
            raise TypeError('register_batching_rule(%s) decorates a function rule(op) -> '
                            'None | str; got %r.' % (', '.join(map(repr, op_names)), rule))
        for name in op_names:
            if name in RULES and RULES[name] is not rule:
                warnings.warn('batching rule for %r overridden' % name, stacklevel=2)
            RULES[name] = rule
            if function_of_inputs and name != 'Custom':
                NOT_FUNCTIONS.discard(name)
            else:
                NOT_FUNCTIONS.add(name)
        return rule
    return register


_OPERATORS = set()      # MXNet's operator names, read again for a name not among them


def _check_operator_names(op_names):
    for name in op_names:
        if callable(name):
            raise TypeError(
                'register_batching_rule takes operator names and returns the decorator: write '
                "@register_batching_rule('op_name'), or register_batching_rule('op_name')(rule); "
                'got the function %s among the names.' % getattr(name, '__name__', name))
        if not isinstance(name, str):
            raise TypeError('register_batching_rule: operator names are strings; got %r.'
                            % (name,))
    if not op_names:
        raise TypeError("register_batching_rule needs at least one operator name: "
                        "@register_batching_rule('op_name').")
    import difflib                          # pylint: disable=import-outside-toplevel
    import mxnet as mx                      # pylint: disable=import-outside-toplevel
    if not _OPERATORS.issuperset(op_names):      # (mx.library.load adds operators)
        _OPERATORS.update(mx.operator.get_all_registered_operators())
    for name in op_names:
        if name not in _OPERATORS:
            close = difflib.get_close_matches(
                name, [op for op in _OPERATORS if not op.startswith('_backward')], n=3)
            raise ValueError('register_batching_rule: %r is no MXNet operator%s (a graph names '
                             'its ops as MXNet registers them, e.g. \'hard_sigmoid\', '
                             '\'FullyConnected\').'
                             % (name, '; did you mean %s?' % ' or '.join(map(repr, close))
                                if close else ''))


def batching_rule(op_name):
    """The rule for ``op_name``, or None."""
    return RULES.get(op_name)


UNBATCHABLE = {
    'softmax_cross_entropy': 'sums the loss over the batch axis, so one sample\'s loss would '
                             'be the whole step\'s: compute each sample\'s loss as '
                             '-F.pick(F.log_softmax(x), label, axis=-1, keepdims=True), as '
                             'gluon.loss.SoftmaxCrossEntropyLoss does',
    'gather_nd': 'indexes the batch axis with the first axis of its indices, so batched a '
                 'sample would read other samples\' rows: pick along a sample\'s own axes '
                 'with F.pick, or F.take(x, indices, axis=1)',
    'SequenceReverse': 'reverses axis 0, MXNet 1.9.1\'s only time axis, which is the batch '
                       'axis here (per sample it leaves a sample of one row as it is): '
                       'reverse a batch-major sequence\'s steps with F.reverse(x, axis=1), '
                       'or swap it time-major first, F.swapaxes(x, 0, 1), which batches '
                       'with a length per sample too',
    '_contrib_arange_like': 'counts positions across the batch axis (axis unset or 0): '
                            'count a sample\'s positions as F.cumsum(F.ones_like(x), axis=1) '
                            '- 1, or along one of its own axes, F.contrib.arange_like(x, '
                            'axis=1), which is the same for every sample',
}
"""Operators without a rule that no rule could batch, and why (with what
to write instead): the tracer gives the reason where it would say that the
op has no rule, whose advice to register one would mislead."""


RANDOM_PREFIXES = ('_random_', 'random_', '_sample_', 'sample_', '_npi_random_',
                   '_image_random_', '_npx__image_random_')
RANDOM = frozenset('''Dropout _npx_dropout _shuffle shuffle _npi_shuffle _npi_bernoulli
_npi_choice _npi_gumbel _npi_normal _npi_uniform _npi_normal_n _npi_uniform_n _npi_exponential
_npi_gamma _npi_logistic _npi_pareto _npi_rayleigh _npi_weibull _npi_multinomial
_npi_powerd _contrib_dgl_csr_neighbor_uniform_sample
_contrib_dgl_csr_neighbor_non_uniform_sample'''.split())


def draws_random(op_name, attrs=None):
    """Whether ``op_name`` (with attributes ``attrs``) draws random numbers
    (the ``*_pdf_*`` ops only evaluate densities; ``LeakyReLU`` draws with
    ``act_type='rrelu'``, ``RNN`` with dropout ``p``).  Such an op reading
    no per-sample input makes its block run per sample: run once for a
    step, its one draw would serve every sample, where per sample each
    call draws its own."""
    if op_name == 'LeakyReLU':
        return (attrs or {}).get('act_type') == 'rrelu'
    if op_name == 'RNN':            # dropout between layers (in training)
        try:
            return float((attrs or {}).get('p', 0)) > 0
        except ValueError:
            return True
    return op_name in RANDOM or (op_name.startswith(RANDOM_PREFIXES) and '_pdf_' not in op_name)


class OpView:
    """What a rule may look at: op name, parsed attributes, per input
    whether it is batched and its per-sample shape (None when unknown), and
    ``inference``: whether the calls are made outside autograd (neither
    recording nor in training).  A rule that refuses only under autograd
    (``BatchNorm``'s) reads it: a signature is checked for calls under
    autograd first, and where that refuses, for inference too
    (:attr:`~.trace.TracedSignature.inference`)."""
    __slots__ = ('op', 'attrs', 'batched', 'shapes', 'inference')

    def __init__(self, op, attrs, batched, shapes, inference=False):
        self.op, self.attrs, self.batched, self.shapes = op, attrs, batched, shapes
        self.inference = inference

    def attr(self, key, default=None):
        raw = self.attrs.get(key)
        if raw is None:
            return default
        try:
            return ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            return raw

    def flag(self, key, default=False):
        """Whether the boolean attribute ``key`` is set (MXNet stores
        ``'True'``, ``'1'``, ``'true'`` alike)."""
        return self.attr(key, default) not in (False, 0, 'false', 'False', '0')

    def batched_ndim(self):
        """ndim of the first batched input.  A batched input's axis 0 holds
        a sample's rows: one, or several after a reshape folds a sample into
        rows; then every batched input of the op has as many, and only the
        builtin rules (:data:`BUILTIN_RULES`) see it (checked by the
        tracer)."""
        for is_batched, shape in zip(self.batched, self.shapes):
            if is_batched and shape is not None:
                return len(shape)
        return None

    def axis_is_batch(self, key, default, added=0):
        """True when the axis attribute ``key`` names axis 0 (or all axes).
        ``added``: axes the op inserts (1 for ``expand_dims`` and
        ``stack``), whose axis counts among the output's dimensions: on a
        ``(1, 4)`` input, ``expand_dims(axis=-3)`` inserts before the batch
        axis and ``axis=2`` after the last."""
        axis = self.attr(key, default)
        if axis is None or axis == ():
            return True
        ndim = self.batched_ndim()
        axes = axis if isinstance(axis, (tuple, list)) else (axis,)
        if ndim is None:
            return True
        return any(a % (ndim + added) == 0 for a in axes)


# --- rule helpers ---------------------------------------------------------

def _rowwise(op):
    """Acts on each row alone; every input may be batched."""
    return None


def _all_batched(op):
    """Element-wise on inputs of equal shape (or, as ``pick``'s, of one
    leading size): a shared input would keep its per-sample shape while the
    batched ones grow, so all must be batched."""
    if not all(op.batched):
        shapes = {shape for shape in op.shapes if shape is not None}
        return '%s mixes batched and shared inputs%s%s' % (
            op.op, ' of equal shape' if len(shapes) == 1 else ' (shapes %s)' % ', '.join(
                '%s %s' % ('batched' if batched else 'shared', shape)
                for batched, shape in zip(op.batched, op.shapes)),
            BROADCAST_ADVICE if op.op in _ARITHMETIC else '')
    return None


BROADCAST_ADVICE = (' (a shared input of leading dimension 1, such as a (1, n) parameter, '
                    'broadcasts over the batch with F.broadcast_add, broadcast_mul, ...)')
"""Appended to the reason of an element-wise op that mixes batched and
shared inputs, where a broadcasting op would batch (found by a user test:
``x + self.v.data()`` with ``v`` of shape (1, n) ran per sample)."""


def _batched_data_shared_rest(op):
    """Input 0 is the batched data, the rest (weights, indices) are shared."""
    if not op.batched[0] or any(op.batched[1:]):
        return '%s needs batched data and shared weights' % op.op
    return None


def _broadcast(op):
    """Broadcasting: every batched input has the full rank, and no shared
    input of full rank has a leading dimension other than 1 (it would be
    broadcast over the batch)."""
    ndim = max(len(s) for s in op.shapes if s is not None)
    for is_batched, shape in zip(op.batched, op.shapes):
        if shape is None:
            return '%s: unknown input shape' % op.op
        if is_batched and len(shape) != ndim:
            return '%s broadcasts a batched input across axis 0' % op.op
        if not is_batched and len(shape) == ndim and shape[0] != 1:
            return '%s broadcasts a shared input of leading dim %d over the batch' % (
                op.op, shape[0])
    return None


def _axis_rule(key, default, need_all_batched=False, added=0, advice=''):
    """A rule refusing the op where its axis attribute ``key`` (``default``
    when absent) is the batch axis, ``advice`` appended to the reason."""
    def rule(op):
        if op.axis_is_batch(key, default, added):
            return '%s acts on the batch axis (%s=%s)%s' % (
                op.op, key, op.attrs.get(key, default), advice)
        if need_all_batched:
            return _all_batched(op)
        return None
    return rule


def _reduction(op):
    """A reduction over ``axis``, or with ``exclude=True`` over every axis
    but those named, so then safe only when axis 0 is among them."""
    if op.flag('exclude') and op.attr('axis', None) not in (None, ()):
        if op.batched_ndim() is None:
            return '%s with exclude=True on an input of unknown rank' % op.op
        if not op.axis_is_batch('axis', None):
            return '%s acts on the batch axis (axis=%s, exclude=True)' % (
                op.op, op.attrs.get('axis'))
        return None
    return _axis_rule('axis', None)(op)


def _softmax(op):
    """Along a non-batch axis; with ``use_length``, the second input holds
    one length per row, so it must be batched too (a shared ``(1,)``
    length would keep its per-sample shape while the data grow)."""
    reason = _axis_rule('axis', -1)(op)
    if reason is None and op.flag('use_length') and not all(op.batched):
        if not op.batched[0]:
            return _all_batched(op)
        return ('%s with use_length reads one length per row, but its lengths are shared by '
                'every sample (a constant of the block): pass them to the call, a (1,) int32 '
                'array per sample, or compute them from its arguments' % op.op)
    return reason


def _dropout(op):
    """Each element draws its own mask, unless ``axes`` shares the mask
    along some axes (variational dropout): along the batch axis, one mask
    would then serve every sample of a step, where per sample each call
    draws its own."""
    axes = op.attr('axes', ())
    ndim = op.batched_ndim()
    if axes and (ndim is None or any(a % ndim == 0 for a in axes)):
        return 'Dropout shares its mask along the batch axis (axes=%s)' % (axes,)
    return None


def _reshape(op):
    """Keeps the batch axis: a target shape starting with ``0``, or ``-1``
    followed by positive sizes.  The tracer writes every other target out
    so (:func:`~.trace.reshapes_keeping_rows`), and a reshape of a sample
    into several rows (gluonnlp's multi-head attention folds its heads into
    axis 0) keeps each sample's elements together: batched, its rows follow
    the sample's, as the tracer checks for the ops that read them."""
    shape = op.attr('shape', ())
    if op.flag('reverse'):
        return ('reshape(shape=%s, reverse=True) of a sample of unknown shape: write the '
                'shape from the left, starting with 0 (keep axis 0)' % (shape,))
    if shape and shape[0] == 0:
        return None
    if shape and shape[0] == -1 and all(isinstance(d, int) and d > 0 for d in shape[1:]):
        return None
    return ('reshape(shape=%s) may move data across the batch axis: start the shape with 0 '
            '(keep axis 0), as in shape=(0, ...)' % (shape,))


def _size(shape):
    size = 1
    for dim in shape:
        size *= dim
    return size


def _transpose(op):
    """The permutation keeps axis 0 first."""
    axes = op.attr('axes', ())
    if not axes or axes[0] != 0:
        return 'transpose(axes=%s) moves the batch axis' % (axes,)
    return None


def _rank1(op):
    """Refuses a per-sample input of rank 1: batched, its only axis is the
    batch axis, which the op would read as its features.  Returns the
    reason, or None."""
    ndim = op.batched_ndim()
    if ndim is None or ndim < 2:
        return ('%s reads the only axis of a per-sample input of shape %s as its own, which '
                'batched is the batch axis' % (op.op, op.shapes[0]))
    return None


def _dot(op):
    """Batched, untransposed left operand of rank 2 or more per sample,
    and a shared right operand."""
    if op.flag('transpose_a') or not op.batched[0] or op.batched[1]:
        return 'dot needs a batched lhs (not transposed) and a shared rhs'
    return _rank1(op)


def _fully_connected(op):
    """With ``flatten=False`` the last axis holds the features, which at
    rank 1 is the batch axis (``flatten=True`` makes rows of axis 0)."""
    reason = _batched_data_shared_rest(op)
    if reason is None and not op.flag('flatten', True):
        return _rank1(op)
    return reason


def _take(op):
    """Batched data with shared indices along an axis other than 0, or
    shared data indexed by batched indices along axis 0 (an embedding
    lookup)."""
    axis = op.attr('axis', 0)
    if op.batched[0] and not op.batched[1]:
        return op.axis_is_batch('axis', 0) and 'take along the batch axis' or None
    if op.batched[1] and not op.batched[0] and axis == 0:
        return None  # embedding-like lookup: one row of indices per sample
    return 'take with batched data and batched indices'


def _axes(op, key, ndim, default=()):
    """The axis attribute ``key`` (an int or a tuple; ``default``, MXNet's,
    where unset) as a tuple of axes in ``range(ndim)`` (negative ones
    counted from the end)."""
    axes = op.attr(key, default)
    axes = axes if isinstance(axes, (tuple, list)) else (axes,)
    return tuple(a % ndim for a in axes)


def _broadcast_axis(op):
    """``axis`` does not name axis 0 (an empty one broadcasts nothing).  The
    op broadcasts axes of size 1 to ``size``: per sample axis 0 has size 1
    and would be broadcast to ``size`` rows, batched it has N."""
    ndim = op.batched_ndim()
    if ndim is None or 0 in _axes(op, 'axis', ndim):
        return ('%s broadcasts the batch axis (axis=%s): a sample has one row; broadcast the '
                'other axes only' % (op.op, op.attrs.get('axis')))
    return None


def _broadcast_to(op):
    """The target ``shape`` has ``0`` (keep) for axis 0.  It includes the
    batch axis, which batched has N rows: a ``1`` there, right per
    sample, fails batched, and more would give a sample more rows."""
    shape = op.attr('shape', ())
    if not shape or shape[0] != 0:
        return ('broadcast_to(shape=%s) fixes the batch axis at %s: write 0 (keep) for axis 0, '
                'as in shape=(0, ...)' % (shape, shape[0] if shape else None))
    return None


def _broadcast_like(op):
    """A batched ``rhs`` when no axes are named; with ``lhs_axes`` and
    ``rhs_axes``, a batched ``lhs`` and no pair naming axis 0, or a shared
    ``lhs`` and the pair (0, 0).  ``lhs`` is broadcast to ``rhs``'s shape,
    on every axis when none are named (a shared ``lhs`` has leading dim 1
    and broadcasts over the batch; a shared ``rhs`` would keep one row).
    On named pairs, the rows are ``lhs``'s unless axis 0 is named: the
    pair (0, 0) takes them from a batched ``rhs``, where MXNet needs
    ``lhs``'s dim 1, so a shared ``lhs``; any other pair with axis 0 moves
    the batch axis."""
    lhs_axes, rhs_axes = op.attr('lhs_axes'), op.attr('rhs_axes')
    if lhs_axes is None and rhs_axes is None:
        if not op.batched[1]:
            return ('broadcast_like of a batched lhs like a shared rhs broadcasts across the '
                    'batch axis: broadcast like a batched tensor, or name lhs_axes/rhs_axes '
                    'other than 0')
        return None
    if lhs_axes is None or rhs_axes is None or None in op.shapes:
        return 'broadcast_like with only one of lhs_axes and rhs_axes, or unknown shapes'
    pairs = list(zip(_axes(op, 'lhs_axes', len(op.shapes[0])),
                     _axes(op, 'rhs_axes', len(op.shapes[1]))))
    batch_pairs = [pair for pair in pairs if 0 in pair]
    if not batch_pairs:
        if not op.batched[0]:
            return ('broadcast_like of a shared lhs on axes other than the batch axis gives a '
                    'shared result: include the pair (0, 0) in lhs_axes/rhs_axes')
        return None
    if batch_pairs == [(0, 0)] and not op.batched[0]:
        return None
    return ('broadcast_like(lhs_axes=%s, rhs_axes=%s) moves the batch axis, or broadcasts a '
            'batched lhs on it: pair axis 0 with axis 0, with a shared lhs, or leave it out'
            % (lhs_axes, rhs_axes))


def _tile(op):
    """``reps`` shorter than the rank (MXNet pads it with leading 1s), or
    of the rank with ``reps[0] == 1``.  A longer ``reps`` adds leading
    axes, and a repeat of axis 0 gives a sample more rows (batched, the
    whole batch would be repeated).  Nor may a batch of several rows give
    MXNet's tile kernels more than 5 axes, which fail ('Too many reduction
    axes') where one row, merged away, left 5: ``reps=(2, 2, 2)`` on a
    sample of shape ``(1, 1, 2, 6)`` (found by the property test)."""
    reps, ndim = tuple(op.attr('reps', ())), op.batched_ndim()
    if ndim is None or len(reps) > ndim or (len(reps) == ndim and reps[0] != 1):
        return ('tile(reps=%s) repeats or moves the batch axis: give reps of at most the rank, '
                'with 1 for axis 0 when of the rank' % (reps,))
    shape = (2,) + tuple(op.shapes[0][1:])      # the batch axis of more than one row
    reps = (1,) * (ndim - len(reps)) + reps
    if _kernel_ndim([d for r, n in zip(reps, shape) for d in (r, n)],
                    [d for n in shape for d in (1, n)]) > 5:
        return ('tile(reps=%s) of a sample of shape %s: with the batch axis grown, MXNet\'s '
                'tile kernels would need more than 5 axes and fail; tile fewer axes'
                % (op.attr('reps'), op.shapes[0]))
    return None


def _kernel_ndim(big, small):
    """The number of axes MXNet's broadcast and reduce kernels use between
    shapes ``big`` and ``small`` (``BroadcastReduceShapeCompact``: runs of
    broadcast or of kept axes merge, axes of size 1 vanish; over 5 fail)."""
    if _size(small) == 1:
        return 1
    count, bprod, sprod = 0, 1, 1
    for b, s in zip(big, small):
        if (b != s and sprod > 1) or (b == s and bprod != sprod):
            count, bprod, sprod = count + 1, 1, 1
        bprod *= b
        sprod *= s if b == s else 1
    return count + (bprod > 1 or sprod > 1)


def _swapaxes(op):
    """Neither ``dim1`` nor ``dim2`` is axis 0, or both are (a no-op, as
    the default ``dim1=dim2=0``); else the batch axis is moved."""
    ndim = op.batched_ndim()
    dims = [op.attr(key, 0) for key in ('dim1', 'dim2')]
    if ndim is None or (dims[0] % ndim == 0) != (dims[1] % ndim == 0):
        return 'swapaxes(dim1=%d, dim2=%d) moves the batch axis' % tuple(dims)
    return None


def _gemm2(op):
    """A and B batched when axis 0 is a batch axis of matrices (rank 3 or
    more, rows on another axis); A batched and not transposed, B shared,
    when axis 0 holds the rows (rank 2, or ``axis=0``).  The op multiplies
    ``op(A) op(B)`` over the rows (axis ``axis``, -2 by default) and
    columns (the last axis); other axes are batch axes of equal size in A
    and B (a shared operand's 1 would not broadcast).  Only A's rows are
    rows of the result: B's are summed over, or its columns."""
    ndim = op.batched_ndim()
    rows = op.attr('axis', -2) % ndim if ndim else None
    if rows == ndim - 1 or rows is None:
        return 'linalg_gemm2 with rows on the last axis, or of unknown rank'
    if rows != 0:
        if not all(op.batched):
            return ('linalg_gemm2 on a batch axis of matrices with a shared operand, which '
                    'keeps one row while the batched grows: batch both, or use rank 2')
        return None
    if op.flag('transpose_a') or not op.batched[0] or op.batched[1]:
        return ('linalg_gemm2 with rows on the batch axis (rank 2, or axis=0) multiplies '
                'across it unless A is batched and not transposed, and B shared')
    return None


ROWWISE = '''Activation relu sigmoid tanh softsign exp log log1p expm1 sqrt rsqrt cbrt
square abs negative sign round rint floor ceil trunc fix reciprocal sin cos tan arcsin
arccos arctan sinh cosh arctanh arcsinh arccosh erf erfinv gamma gammaln _copy identity
BlockGrad stop_gradient zeros_like ones_like Cast cast clip LeakyReLU
_plus_scalar _minus_scalar _rminus_scalar _mul_scalar _div_scalar _rdiv_scalar
_power_scalar _rpower_scalar _maximum_scalar _minimum_scalar _mod_scalar _rmod_scalar
_equal_scalar _not_equal_scalar _greater_scalar _greater_equal_scalar _lesser_scalar
_lesser_equal_scalar _logical_and_scalar _logical_or_scalar _logical_xor_scalar _hypot_scalar
Flatten flatten one_hot L2Normalization smooth_l1 hard_sigmoid log2 log10 rcbrt degrees
radians logical_not _contrib_gradientmultiplier _contrib_round_ste _contrib_sign_ste
_contrib_quadratic'''.split()
ELEMENTWISE = '''elemwise_add elemwise_sub elemwise_mul elemwise_div _plus _Plus _add
_minus _Minus _sub _mul _Mul _div _Div _maximum _Maximum _minimum _Minimum _power _Power
_hypot _mod add_n ElementWiseSum _grad_add where _equal _not_equal _greater
_greater_equal _lesser _lesser_equal _logical_and _logical_or _logical_xor'''.split()
BROADCAST = '''broadcast_add broadcast_plus broadcast_sub broadcast_minus broadcast_mul
broadcast_div broadcast_mod broadcast_power broadcast_maximum broadcast_minimum
broadcast_hypot broadcast_equal broadcast_not_equal broadcast_greater
broadcast_greater_equal broadcast_lesser broadcast_lesser_equal broadcast_logical_and
broadcast_logical_or broadcast_logical_xor'''.split()

_ARITHMETIC = frozenset(ELEMENTWISE) - {'where', 'add_n', 'ElementWiseSum', '_grad_add'}
"""Element-wise ops that a ``broadcast_*`` op can replace."""

register_batching_rule(*ROWWISE)(_rowwise)
register_batching_rule(*ELEMENTWISE)(_all_batched)
register_batching_rule(*BROADCAST)(_broadcast)
register_batching_rule('Embedding')(_batched_data_shared_rest)
register_batching_rule('FullyConnected')(_fully_connected)
# a softmax over each row: at rank 1 over the whole batch
register_batching_rule('SoftmaxActivation')(_rank1)


@register_batching_rule('LayerNorm')
def _layer_norm(op):
    """Refuses a normalisation axis that is the batch axis; needs batched
    data and shared gamma/beta."""
    return _axis_rule('axis', -1)(op) or _batched_data_shared_rest(op)


@register_batching_rule('BatchNorm')
def _batch_norm(op):
    """With ``use_global_stats``, or in inference, it normalises each row by
    the running statistics (shared inputs).  In training a step's mean and
    variance would be taken over every sample's rows, and the running
    statistics moved once where per sample every call moves them; and under
    ``autograd.record(train_mode=False)`` its backward (which runs in
    training unless told) still takes the batch's statistics.  Not over
    channels of axis 0, the batch axis."""
    if not op.inference and not op.flag('use_global_stats'):
        return ('BatchNorm normalises over the batch axis in training, so a sample\'s '
                'statistics would be the whole step\'s (in inference, outside autograd, it '
                'batches): give it use_global_stats=True, or normalise each sample on its own '
                '(nn.LayerNorm, nn.InstanceNorm)')
    if op.axis_is_batch('axis', 1):
        # (batched, the channels would be the N samples where the statistics
        # hold one: MXNet 1.9.1 read past them, silently)
        return ('BatchNorm with its channel axis the batch axis (axis=%s): give a sample its '
                'channels on another axis' % op.attr('axis', 1))
    return _batched_data_shared_rest(op)


# (a text CNN over a sentence, NCW and the like: every layout MXNet takes
# has the batch axis first; MXNet refuses Pad on axes 0 and 1)
register_batching_rule('Convolution')(_batched_data_shared_rest)
register_batching_rule('Pooling', 'LRN', 'Pad', 'depth_to_space', 'space_to_depth', 'im2col',
                       '_contrib_AdaptiveAvgPooling2D')(_rowwise)
# (normalise each sample's channels, or groups of them, over its own
# axes: nn.InstanceNorm, nn.GroupNorm; found without rules by a user trial)
register_batching_rule('InstanceNorm', 'GroupNorm')(_batched_data_shared_rest)
# (where users met them: a readout over a list of states, per sample
# F.mean(F.stack(*hs, axis=0), axis=0), runs per sample, and the reason
# says how to write it so that it batches)
JOIN_ADVICE = ('; to join per-sample rows (1, ...) and reduce over them, stack them on axis 1 '
               'and reduce over axis 1 (F.mean(F.stack(*hs, axis=1), axis=1)), or sum them '
               'with F.add_n(*hs)')
register_batching_rule('concat', 'Concat')(_axis_rule('dim', 1, need_all_batched=True,
                                                      advice=JOIN_ADVICE))
register_batching_rule('stack')(_axis_rule('axis', 0, need_all_batched=True, added=1,
                                           advice=JOIN_ADVICE))
register_batching_rule('expand_dims')(_axis_rule('axis', None, added=1))
register_batching_rule('slice_axis', 'argmax', 'argmin')(_axis_rule('axis', None))


@register_batching_rule('repeat')
def _repeat(op):
    """Along any axis but the batch axis.  Along axis 0 it gives a sample
    more rows, which batched no rule may do (see :data:`BUILTIN_RULES`);
    the refusal shows the form that batches (a user trial's per-head
    lengths in a graph transformer)."""
    reason = _axis_rule('axis', None)(op)
    if reason and op.attr('axis', None) is not None:
        reason += ('; to repeat each of a sample\'s rows n times, write '
                   'F.broadcast_axis(F.expand_dims(x, axis=1), axis=1, size=n).reshape((-3, -2)), '
                   'which batches')
    return reason


# SliceChannel (split) cuts along axis 1 unless told otherwise: Gluon's
# LSTMCell and GRUCell slice their gates so, and ran per sample while a
# missing axis was taken for every axis
register_batching_rule('SliceChannel', 'split')(_axis_rule('axis', 1))
# (split_v2 cuts along axis 0 unless told otherwise)
register_batching_rule('_split_v2')(_axis_rule('axis', 0))
register_batching_rule('softmax', 'log_softmax', 'softmin')(_softmax)
register_batching_rule('sum', 'mean', 'max', 'min', 'prod', 'nansum', 'nanprod')(_reduction)
# (a mean and variance over ``axes``, as a LayerNorm written by hand computes them)
register_batching_rule('moments')(_axis_rule('axes', None))
register_batching_rule('norm', 'squeeze')(_axis_rule('axis', None))
register_batching_rule('Dropout', '_npx_dropout')(_dropout)
register_batching_rule('pick')(_axis_rule('axis', -1, need_all_batched=True))
register_batching_rule('Reshape', 'reshape')(_reshape)
register_batching_rule('transpose')(_transpose)
register_batching_rule('dot')(_dot)
register_batching_rule('take')(_take)
register_batching_rule('batch_dot')(_all_batched)
register_batching_rule('broadcast_axis', 'broadcast_axes')(_broadcast_axis)
register_batching_rule('broadcast_to')(_broadcast_to)
register_batching_rule('broadcast_like')(_broadcast_like)
register_batching_rule('tile')(_tile)
register_batching_rule('SwapAxis', 'swapaxes')(_swapaxes)
register_batching_rule('_linalg_gemm2', 'linalg_gemm2')(_gemm2)
# along one axis; axis=None sorts the flattened tensor, across samples
register_batching_rule('topk', 'sort', 'argsort')(_axis_rule('axis', -1))
register_batching_rule('reverse', 'flip')(_axis_rule('axis', None))
# F.cumsum (top-p sampling's cumulative probabilities); axis=None cumulates
# the flattened tensor, across samples
register_batching_rule('_np_cumsum')(_axis_rule('axis', None))


@register_batching_rule('slice')
def _slice(op):
    """``slice(begin, end, step)`` keeps the batch axis whole when its bounds
    on axis 0 are unset (``None``) or begin at 0, with step 1: per sample
    ``end=1`` also keeps the one row, but batched it would keep the first
    sample only, so axis 0's end must be ``None`` (as ``x[:, 1:3]`` has)."""
    begin, end, step = (op.attr(key, ()) or () for key in ('begin', 'end', 'step'))
    if ((begin and begin[0] not in (None, 0)) or (end and end[0] is not None)
            or (step and step[0] not in (None, 1))):
        return ('slice cuts the batch axis (begin=%s, end=%s%s): leave axis 0 unset, '
                'F.slice(x, begin=(None, ...), end=(None, ...)), or use slice_axis'
                % (begin, end, ', step=%s' % (step,) if step else ''))
    return None


@register_batching_rule('slice_like')
def _slice_like(op):
    """Batched data cut to the shape of ``shape_like`` on ``axes`` (every
    axis when none are named): on the batch axis only to a batched one's
    N rows, where a shared one's single row would cut the batch to it."""
    ndim = op.batched_ndim()
    if not op.batched[0] or ndim is None:
        return 'slice_like of shared data or of unknown rank'
    if (not op.attr('axes') or 0 in _axes(op, 'axes', ndim)) and not op.batched[1]:
        return ('slice_like cuts the batch axis to a shared shape_like\'s one row: leave axis 0 '
                'out of axes')
    return None


@register_batching_rule('diag')
def _diag(op):
    """The diagonal of ``axis1`` and ``axis2`` (0 and 1 by default): of
    each sample's own matrices when neither is the batch axis."""
    ndim = op.batched_ndim()
    # (unset, they are MXNet's defaults, not absent: F.diag(x) reads axes 0 and 1)
    if ndim is None or ndim < 3 or \
            0 in _axes(op, 'axis1', ndim, 0) + _axes(op, 'axis2', ndim, 1):
        return ('diag reads the batch axis as a matrix axis (axis1=%s, axis2=%s): give a sample '
                'of rank 3 or more, with axis1 and axis2 other than 0'
                % (op.attr('axis1', 0), op.attr('axis2', 1)))
    return None


@register_batching_rule('_contrib_index_array')
def _index_array(op):
    """The indices of each element on ``axes``: on the batch axis (or on
    every axis, unset) a sample's row would count as the step's."""
    ndim = op.batched_ndim()
    if not op.attr('axes') or ndim is None or 0 in _axes(op, 'axes', ndim):
        return 'index_array counts the batch axis\'s rows: name axes other than 0'
    return None


LINALG_VECTORS = ('_linalg_makediag', '_linalg_maketrian')
"""Linear algebra ops reading vectors on the last axis (the rest, matrices
on the last two axes)."""


def _matrices(op):
    """MXNet's ``linalg`` ops act on each matrix of the last two axes (each
    vector of the last, for :data:`LINALG_VECTORS`), the axes before them
    axes of matrices; batched when axis 0 is one of these, and every
    operand batched (a shared one would keep its one matrix while the
    batched grow to N)."""
    ndim, rows = op.batched_ndim(), op.attr('axis')      # (gemm's rows: -2 unless set)
    if ndim is None or ndim < (2 if op.op in LINALG_VECTORS else 3) or \
            (rows is not None and rows % ndim == 0):
        return ('%s reads the batch axis as a matrix axis: give a sample its own matrices, '
                'of shape (1, m, n)' % op.op)
    if not all(op.batched):
        return ('%s with a shared operand, which keeps one matrix while the batched grow: '
                'batch every operand' % op.op)
    return None


# (the graph names them _linalg_*, whether written F.linalg.potrf or F.linalg_potrf)
register_batching_rule(*['_linalg_' + name for name in '''potrf potri inverse det slogdet
sumlogdiag extractdiag makediag extracttrian maketrian syrk trmm trsm gemm gelqf
syevd'''.split()])(_matrices)


@register_batching_rule('_contrib_div_sqrt_dim')
def _div_sqrt_dim(op):
    """Divides by the square root of the last axis's size (gluonnlp's
    ``DotProductAttentionCell(scaled=True)``): row-wise, but at rank 1 the
    last axis is the batch axis, whose size grows batched."""
    return _rank1(op)


@register_batching_rule('SequenceMask')
def _sequence(op):
    """Batch-major only (``axis=1``: rows on axis 0, steps on axis 1), with
    one length per row (input 1, batched) when ``use_sequence_length``.
    The default ``axis=0`` reads axis 0 as the steps: a sample's one row
    would be its one step, and batched the samples would be the steps.
    (``SequenceLast`` has no rule: MXNet 1.9.1's backward of it leaves
    the gradient of the steps it did not pick unwritten, NaN or garbage
    per sample as batched, and with ``axis=1`` and no lengths it crashed.)"""
    if op.attr('axis', 0) != 1:
        return ('%s reads the batch axis as its sequence axis (axis=%s): write it '
                'batch-major, axis=1' % (op.op, op.attr('axis', 0)))
    if op.flag('use_sequence_length') and not all(op.batched):
        return '%s with lengths shared across the batch' % op.op
    if not op.batched[0]:
        return '%s of shared data with batched lengths' % op.op
    return None


@register_batching_rule('UpSampling')
def _upsampling(op):
    """Scales each image's own spatial axes (NCHW).  ``nearest`` takes
    images and resizes them to the first's size (or adds them): every one
    must be batched, as a shared one would keep its per-sample shape.
    ``bilinear`` takes one image and a shared weight (a grouped
    deconvolution of each image on its own)."""
    if op.attr('sample_type', 'nearest') == 'bilinear':
        if not op.batched[0] or any(op.batched[1:]):
            return 'bilinear UpSampling of a shared image or with a per-sample weight'
        return None
    return _all_batched(op)


RANDOM_LIKE = '''_random_uniform_like _random_normal_like _random_gamma_like
_random_exponential_like _random_poisson_like _random_negative_binomial_like
_random_generalized_negative_binomial_like'''.split()
"""Samplers drawing an array of their input's shape (``F.random.normal_like(h)``).
Like the samplers of per-sample parameters (:data:`RANDOM_SAMPLE`, and
``F.random.multinomial(p)``) they draw every element on its own, so a
step's rows draw as its calls would: a VAE's reparameterisation ran per
sample without their rules (a user trial).  They are no functions of
their inputs (:func:`draws_random`): equal calls never share a result."""
RANDOM_SAMPLE = '''_sample_uniform _sample_normal _sample_gamma _sample_exponential
_sample_poisson _sample_negative_binomial _sample_generalized_negative_binomial'''.split()
"""Samplers of distributions whose parameters are arrays of one shape
(``F.random.normal(mu, sigma)``), the draws' ``shape`` appended after it."""
# (the *_like ops read only their input's shape)
register_batching_rule(*RANDOM_LIKE)(_rowwise)
# (distribution parameters of one shape, the draws' shape appended after them)
register_batching_rule(*RANDOM_SAMPLE)(_all_batched)


@register_batching_rule('_sample_multinomial')
def _sample_multinomial(op):
    """Draws from the distribution on each row's last axis; at rank 1 that
    is the batch axis."""
    return _rank1(op)


@register_batching_rule('reshape_like')
def _reshape_like(op):
    """Input 0 reshaped to input 1's shape (Gluon's losses reshape the label
    like the prediction): row for row when both are batched, each sample's
    row of one size; a shared input 1 would keep its per-sample shape."""
    if any(op.attr(key) is not None for key in ('lhs_begin', 'lhs_end', 'rhs_begin', 'rhs_end')):
        return 'reshape_like of part of the shapes'
    return _all_batched(op)


# The builtin rules' ops are functions of their inputs (those that draw
# random numbers are told apart by draws_random).
NOT_FUNCTIONS.intersection_update({'Custom'})

BUILTIN_RULES = dict(RULES)
"""The rules this module registers.  Only ops with one of these may read a
batched value of several rows per sample (a sample folded into rows by a
reshape, see :func:`~.trace.reshapes_keeping_rows`): each was read for it
(a row-wise op acts on each of a sample's rows as on one sample's row).
An op whose rule the user registered or replaced sees one row per sample,
what rules were written for before.

A rule added here must keep that true: besides reshapes, no accepted op
may change a batched value's axis 0.  The tracer's second check, shapes
inferred for two samples, sees how many rows a value has, not which: an
op that grew axis 0 (a ``tile``, ``repeat`` or ``concat`` along it) could
pass it with the samples' rows interleaved (a review's remark)."""
