"""Trace a block once per call signature into its per-sample symbol.

A call's signature is (block, nesting of its arguments, per-sample shape and
dtype of every array leaf, context).  The first call with a new signature
traces the block through Gluon's own symbolic path (``block(*symbols)`` runs
``hybrid_forward(F=mx.sym, ...)``), infers output shapes and dtypes, finishes
deferred parameter initialisation, and checks batch safety against
:mod:`gluon_dynbatch.rules`.  Later calls with that signature cost one dict
lookup: the per-sample recording path never touches MXNet.
"""
import ast
import ctypes
import json
import warnings

import mxnet as mx
import numpy as np
from mxnet.ndarray.ndarray import _DTYPE_NP_TO_MX

from .errors import InputError, StatefulBlockWarning, user_stacklevel
from .rules import (BUILTIN_RULES, JOIN_ADVICE, NOT_FUNCTIONS, RANDOM_LIKE, UNBATCHABLE, OpView,
                    batching_rule, draws_random)
from .rules import _axes as _axes_of

__all__ = ['symbol_json', 'flatten', 'regroup', 'leaf_count', 'TracedSignature', 'trace_signature',
           'prelu_by_ops', 'reshapes_keeping_rows', 'may_batch_on_axis_1', 'constant_shape',
           'fast_forms', 'own_forms', 'load_graph', 'inputs_below', 'moved_entry',
           'graph_readers', 'is_function_of_inputs', 'error_line', 'blocks_of']


_LISTS = (list, tuple)


def flatten(args, leaves):
    """Append the leaves of nested lists/tuples ``args`` to ``leaves`` and
    return the nesting format: ``0`` per leaf, a tuple per list.  Runs for
    every recorded call: flat lists (a node's children) take a loop without
    recursion."""
    fmt = []
    for arg in args:
        if isinstance(arg, _LISTS):
            mark = len(leaves)
            for x in arg:
                if isinstance(x, _LISTS):
                    del leaves[mark:]
                    fmt.append(flatten(arg, leaves))
                    break
                leaves.append(x)
            else:
                fmt.append(_ZEROS[len(arg)] if len(arg) < len(_ZEROS) else (0,) * len(arg))
        else:
            leaves.append(arg)
            fmt.append(0)
    return tuple(fmt)


_ZEROS = tuple((0,) * n for n in range(64))


def leaf_count(fmt):
    """Number of leaves in nesting ``fmt`` (``0`` for one leaf)."""
    return 1 if fmt == 0 else sum(leaf_count(item) for item in fmt)


def regroup(fmt, leaves, start=0):
    """Inverse of :func:`flatten`: ``(nested list, next leaf index)``."""
    out = []
    for item in fmt:
        if item == 0:
            out.append(leaves[start])
            start += 1
        else:
            sub, start = regroup(item, leaves, start)
            out.append(sub)
    return out, start


class TracedSignature:
    """Everything known about one (block, signature): the per-sample symbol,
    its input names in CachedOp order, output shapes/dtypes and nesting, and
    whether calls may be merged (with the reason when not)."""

    def __init__(self, sig_id, block, symbol, data_names, out_fmt, out_shapes, out_dtypes,
                 batch_safe, reason, repeatable=False, passthrough=None):
        self.sig_id = sig_id
        self.block = block
        self.symbol = symbol
        self.data_names = data_names
        self.out_fmt = out_fmt
        self.out_shapes = out_shapes
        self.out_dtypes = out_dtypes
        self.batch_safe = batch_safe
        self.reason = reason
        # calls with equal host arguments may share one node (see
        # BatchingScope.record): batch-safe and a function of its inputs
        self.repeatable = repeatable
        # output -> flat argument it returns unchanged (``return x``): the
        # call returns that argument itself when it is an NDArray or a lazy
        # value, as per sample (see graph.lazy_results)
        self.passthrough = passthrough or {}
        self.input_names = symbol.list_inputs()
        params = block.collect_params()
        by_name = {p.name: p for p in params.values()}
        unknown = [n for n in self.input_names if n not in data_names and n not in by_name]
        attached = _parameters_by_attribute_only(block, unknown)
        if attached:
            # (hybridized Gluon refuses it too: 'Unknown input to HybridBlock')
            raise InputError(
                'block %s reads parameter %s, set as an attribute (%s) but not in its '
                'collect_params(): a parameter of another block (weight tying) must be shared '
                'through the ParameterDict, e.g. pass params=other.collect_params() to the '
                'block\'s constructor and get it with self.params.get(...).'
                % (block.name, ', '.join(sorted(attached)),
                   ', '.join(sorted(set(attached.values())))))
        if unknown:
            # MXNet makes a variable of an operator input left out
            raise InputError(
                'block %s reads %s, neither one of its arguments nor one of its parameters: '
                'an operator input left out (such as SoftmaxOutput\'s label) becomes such a '
                'variable. Give the operator every input, from the arguments or parameters.'
                % (block.name, ', '.join(unknown)))
        self.param_slots = [(i, by_name[n]) for i, n in enumerate(self.input_names)
                            if n not in data_names]
        # what its programs were built for (see changed_parameters)
        self.param_kinds = [(p.shape, np.dtype(p.dtype)) for _, p in self.param_slots]
        # compiled step programs by gather pattern (see lower.py); row-wise
        # symbols accept any batch size, so one program serves every N
        self.programs = {}              # under autograd.record()
        self.inference_programs = {}    # the same, not recording (see lower.step_program)
        # set by the DynBatchBlock that traced it: shapes, dtypes and
        # nesting of its leaves, its common_dtype(), context and key
        self.in_shapes = self.in_dtypes = self.dtype = self.fmt = self.ctx = self.key = None
        self.zero_rows = {}     # padding rows of its list arguments (see execute.py)
        self.host_parts = {}    # host items -> whether ops depend on them alone (execute.py)
        self.table_reads = {}   # host items -> embeddings they index (execute.FlushTables)
        self.host_splits = {}   # host items -> lower.HostSplit or None (execute.FlushHoist)
        self.ragged = None      # whether its lists can run ragged (lower.ragged_lists)
        # the signature of the calls made in inference (outside autograd:
        # neither recording nor in training), where its verdict differs: a
        # BatchNorm's calls batch there (they read the running statistics),
        # under autograd they run per sample.  Recording picks it by the
        # autograd state (block.autograd_mode).
        self.inference = None
        # whether it is another's ``inference``: its calls take no gradient,
        # so padding its lists need only leave the values alone
        # (block.check_padding_is_neutral)
        self.in_inference = False
        # whether a batched value has several rows per sample inside its
        # symbol (a reshape folded a sample into rows: gluonnlp's multi-head
        # attention, its heads): the passes written for one row per call
        # leave it alone.  A host part run on distinct rows, or hoisted,
        # hands its values on by a take of one row per call (a test shows it
        # failing); lanes and ragged lists are skipped as well, untried.
        self.folded = False
        self._grad_free = {}    # see grad_free_outputs
        self._reads = None

    def item_pos(self, item):
        """Position among the flat leaves of top-level argument ``item``'s
        first leaf.  Needs ``spans``, which :class:`~.block.DynBatchBlock`
        sets after tracing with ``fmt``: per top-level argument, (position
        of its first leaf, number of leaves), read per step."""
        return self.spans[item][0]

    def item_shape(self, item, elem=0):
        """Per-sample shape of top-level argument ``item`` (element ``elem``
        of it, for a list)."""
        return self.in_shapes[self.item_pos(item) + elem]

    def item_dtype(self, item):
        """The dtype (a numpy type) of top-level argument ``item``, whose
        leaves share one (a list's elements are gathered as one array)."""
        return self.in_dtypes[self.item_pos(item)]

    def grad_free_outputs(self, free_items):
        """The flat outputs that carry no gradient when the top-level
        arguments flagged in ``free_items`` carry none (host data, values
        computed from host data alone): outputs that read neither another
        argument nor a parameter that takes a gradient.  Per sample MXNet
        does not record such an output (``pos + 1`` of a numpy position);
        batched, it is an output of a step that autograd records, and an
        ``Embedding`` of the user's own code reading it as indices fails in
        backward (it takes no gradient for its data; the library's own
        programs read indices through ``BlockGrad``,
        :func:`~gluon_dynbatch.lower.indices_without_gradient`), so the step
        hands it out detached (:func:`~gluon_dynbatch.execute.grad_free`).
        Cached per flags and parameters' ``grad_req``."""
        key = (free_items, tuple(p.grad_req != 'null' for _, p in self.param_slots))
        free = self._grad_free.get(key)
        if free is None:
            carrying = {self.input_names[i] for (i, _), takes in zip(self.param_slots, key[1])
                        if takes}
            for item, (pos, width) in enumerate(self.spans):
                if not free_items[item]:
                    carrying.update(self.data_names[pos:pos + width])
            free = self._grad_free[key] = tuple(
                out for out, names in enumerate(self._output_inputs()) if not names & carrying)
        return free

    def _output_inputs(self):
        """Per flat output, the names of the inputs it depends on."""
        reads = self._reads
        if reads is None:
            graph = json.loads(symbol_json(self.symbol))
            below = inputs_below(graph['nodes'])
            reads = self._reads = [below[head[0]] for head in graph['heads']]
        return reads

    def changed_parameters(self):
        """Text naming each parameter whose shape or dtype is no longer the
        one this signature was traced with (``block.cast`` or ``set_data``
        since then), or '' where none is: said when a step's program fails,
        since MXNet's own error names only an operator and an input number."""
        changed = []
        for (_, param), (shape, dtype) in zip(self.param_slots, self.param_kinds):
            if param.shape != shape or np.dtype(param.dtype) != dtype:
                changed.append('%s: %s %s when traced, %s %s now' % (
                    param.name, dtype.name, shape, np.dtype(param.dtype).name, param.shape))
        return '; '.join(changed)

    def describe(self):
        shapes = ', '.join(str(s) for s in self.out_shapes)
        return '%s#%d(%d in) -> (%s)%s' % (self.block.name, self.sig_id, len(self.data_names),
                                           shapes,
                                 '' if self.batch_safe else ' per-sample: ' + self.reason)


def blocks_of(block):
    """``block`` and every block below it, in a fixed order: the blocks a
    trace of it reads."""
    found, stack = [], [block]
    while stack:
        block = stack.pop()
        found.append(block)
        stack.extend(block._children.values())     # pylint: disable=protected-access
    return found


def _parameters_by_attribute_only(block, names):
    """Of the variable ``names``, those that are Parameters set as attributes
    of ``block`` or a block below it (``self.weight = other.params.get(...)``)
    though not in its ParameterDict, as name -> 'Block.attribute'."""
    if not names:
        return {}
    return {value.name: '%s.%s' % (type(below).__name__, attr)
            for below in blocks_of(block) for attr, value in vars(below).items()
            if isinstance(value, mx.gluon.Parameter) and value.name in names}


def _block_name(block):
    return '%s (%s)' % (block.name, type(block).__name__)


def _trace_failure(block, fmt, shapes, err):
    """The message for a block whose tracing raised ``err``, naming the
    per-sample argument shapes (lists as lists) it was traced for.  An
    MXNetError is MXNet refusing an operator's parameters or shapes (a
    size of 0, lists of different lengths), which the same call outside a
    scope meets too, unless it is an op's several outputs given as one
    input (a Symbol may have more outputs than the eager op: a user trial's
    ``F.random.multinomial(p)``, which runs eagerly); anything else is most
    often code that does not hybridize."""
    text = str(err)
    name = type(err).__name__
    if text.startswith(name + ':'):     # MXNetError repeats its own name
        text = text[len(name) + 1:].strip()
    text = text.strip().rstrip('.')     # (MXNet's messages may end in a newline)
    message = ('block %s could not be traced for arguments of per-sample shapes %s: its '
               'hybrid_forward, called with F=mx.sym and Symbols for arguments, raised %s: %s.'
               % (_block_name(block), _shapes_text(regroup(fmt, list(shapes))[0]), name, text))
    if 'argument name state_cell not found' in text:
        # (Gluon's _RNNLayer passes the LSTM's cell state by keyword whatever
        # its mode, where it runs symbols with lengths)
        return message + (' Gluon 1.9.1\'s fused GRU and RNN layers with '
                          'use_sequence_length=True run eagerly only: hybridized or traced, '
                          'they give RNN the LSTM\'s cell state, which fails. Use rnn.LSTM '
                          'with lengths, or these layers on sequences of their own length '
                          'without use_sequence_length.')
    if 'is a tuple, single value is required' in text:
        # (a Symbol of several outputs given whole to an op's input: some ops
        # have more outputs as a Symbol than eagerly, so the call runs
        # outside a scope unless the block is hybridized)
        return message + (' A Symbol of several outputs was given as one input: as a Symbol '
                          'an op may have more outputs than when it runs eagerly, as '
                          'F.random.multinomial(p) has two in MXNet 1.9.1 (its draws and their '
                          'log-probabilities) even without get_prob=True (take the one needed, '
                          'F.random.multinomial(p, get_prob=True)[0]), and some Gluon code '
                          'passes a split whole (ResidualCell.unroll with merge_outputs=False '
                          'and valid_length: pass merge_outputs=True). The block fails the same '
                          'way outside a scope once hybridized.')
    if 'numpy ndarray' in text or _in_numpy_interface(err):
        # (a block written with F.np / F.npx: the advice to hybridize it
        # misled a user's trial, whose block hybridizes under set_np())
        return message + (' The block uses MXNet\'s numpy interface (F.np / F.npx, or layers '
                          'made under npx.set_np()), which batching() does not support: it '
                          'traces with the legacy Symbol API. Write the block with the legacy '
                          'F operators, or run it outside a scope.')
    # (NotImplementedForSymbol, an NDArray-only call on a Symbol, is an
    # MXNetError too, but the block's doing, not MXNet's refusal)
    if isinstance(err, mx.base.MXNetError) and \
            not isinstance(err, mx.base.NotImplementedForSymbol):
        return message + (' MXNet refused an operator of the block for these arguments: the '
                          'same call outside a scope fails the same way. Check the sizes the '
                          'block was built with and the arguments (list lengths included).')
    return message + (' If the block runs outside a scope, it does not hybridize, which a '
                      'DynBatchBlock needs: no .shape, .asnumpy() or other NDArray-only calls '
                      'on its arguments, and no Python branches on their values (check: '
                      'block.hybridize(), then one call outside any scope).')


def _in_numpy_interface(err):
    """Whether ``err`` was raised inside MXNet's numpy interface
    (``mx.sym.np``, ``mx.nd.np``, ``mx.np``, ``mx.npx``): a block written with
    ``F.np`` meeting legacy Symbols."""
    tb = err.__traceback__
    while tb is not None:
        path = tb.tb_frame.f_code.co_filename.replace('\\', '/')
        if '/mxnet/' in path and ('/numpy/' in path or '/numpy_extension/' in path):
            return True
        tb = tb.tb_next
    return False


def _shapes_text(args):
    """``((1, 4), [(1, 3), (1, 3)], [])`` for arguments nested as lists."""
    def one(arg):
        if isinstance(arg, list):
            return '[%s]' % ', '.join(one(a) for a in arg)
        return str(tuple(arg))
    return '(%s)' % ', '.join(one(a) for a in args)


def common_dtype(dtypes):
    """The dtype of a signature whose leaves have ``dtypes`` (numpy types):
    the one they share, else the one floating type among them (the
    ``float32`` of states beside ``int32`` token ids), in which values that
    the library makes for the block (padding rows, rows of ones, random
    inputs of the padding check) and its float rewrites are made; None
    when there is no leaf or two floating types differ."""
    distinct = set(dtypes)
    if len(distinct) > 1:
        distinct = {dtype for dtype in distinct if np.issubdtype(dtype, np.floating)}
    return next(iter(distinct)) if len(distinct) == 1 else None


def trace_signature(ids, block, fmt, shapes, dtypes):
    """Trace ``block`` for arguments of nesting ``fmt`` and per-sample leaf
    ``shapes``/``dtypes``; see :class:`TracedSignature`.  Signature ids are
    drawn from the iterator ``ids`` (two where the verdict differs in
    inference: :attr:`TracedSignature.inference`)."""
    data_names = ['dynbatch_in%d' % i for i in range(len(shapes))]
    variables = [mx.sym.var(n) for n in data_names]
    sym_args, _ = regroup(fmt, variables)
    _drop_stale_vars(block)
    before = _attribute_ids(block)
    reset = _watch_resets(block)
    try:
        out = _outputs_as_lists(block(*sym_args))
    except InputError:
        raise
    except Exception as err:    # pylint: disable=broad-except
        raise InputError(_trace_failure(block, fmt, shapes, err)) from err
    finally:
        for below in reset:
            vars(below).pop('reset', None)
    kept = _symbols_kept(block, before, {id(below) for below, met in reset.items() if met})
    if kept:
        warnings.warn(StatefulBlockWarning(
            'block %s keeps symbols of its trace in %s: state carried from one call to the '
            'next (a previous output, a dropout mask drawn once per sequence), which its '
            'batched calls do not see, since its Python code runs once per signature, when '
            'traced. Each call computes as the first of a sequence would (Gluon\'s '
            'ZoneoutCell copies zeros, VariationalDropoutCell draws a new mask every step), '
            'which differs from per-sample execution where that state is used (in training, '
            'for these two). Pass the state as an argument and return it as an output.'
            % (_block_name(block), ', '.join(kept))), stacklevel=user_stacklevel())
    out_leaves = []
    out_fmt = flatten(out if isinstance(out, (list, tuple)) else [out], out_leaves)
    if not isinstance(out, (list, tuple)):
        out_fmt = 0
    for number, leaf in enumerate(out_leaves):
        if not isinstance(leaf, mx.sym.Symbol):
            raise InputError(
                'block %s returns %r as its output %d: a wrapped block returns arrays, or '
                '(nested) lists or tuples of arrays, the same nesting for every call. Leave '
                'out what it does not compute (or return a zeros array in its place), and '
                'keep other values as attributes of the block.'
                % (_block_name(block), leaf, number))
    if not out_leaves:
        # (mx.sym.Group([]) raised "Expected a list of symbols as input",
        # naming no block: a user's trial)
        raise InputError(
            'block %s returns %r, no array: a wrapped block returns at least one array (an '
            'output nothing reads is run and dropped). Return what it computes, or call it '
            'outside the scope if it is run for its side effects.' % (_block_name(block), out))
    # an output that is an argument itself (``return x`` for a leaf) is no
    # op of the graph, and a program built on it would lose it: copy it
    # (the call returns the argument itself, see TracedSignature.passthrough)
    passthrough = {number: data_names.index(leaf.name) for number, leaf in enumerate(out_leaves)
                   if leaf.get_children() is None and leaf.name in data_names}
    out_leaves = [mx.sym.identity(leaf) if leaf.get_children() is None else leaf
                  for leaf in out_leaves]
    symbol = unique_op_names(out_leaves[0] if len(out_leaves) == 1 else mx.sym.Group(out_leaves))
    if not symbol.list_inputs():
        # (found by a review: the warning said it would run per sample,
        # then the flush failed with MXNet's raw error)
        raise InputError(
            'block %s computes its outputs from constants alone (it reads none of its '
            'arguments and no parameter), and MXNet builds no graph without inputs '
            '(hybridized Gluon fails alike, with "There are no inputs in computation graph"). '
            'Make the constant outside the block, or have the block read an argument.'
            % _block_name(block))

    # an argument the block ignores is no input of its graph (its rows are
    # still gathered, and nothing reads them)
    inputs = set(symbol.list_inputs())
    known = {name: shape for name, shape in zip(data_names, shapes) if name in inputs}
    params = {p.name: p for p in block.collect_params().values()}
    for name, param in params.items():
        if name in inputs and param.shape is not None and all(d > 0 for d in param.shape):
            known[name] = param.shape
    arg_shapes, out_shapes, aux_shapes = _infer_shapes(block, symbol, known, shapes)
    for number, shape in enumerate(out_shapes):
        if not shape or shape[0] != 1:
            raise InputError(
                'block %s: output %d has per-sample shape %s, but a wrapped block returns one '
                'row per sample: each output needs a leading batch axis of 1, as each argument '
                'has. Keep that axis in the block (e.g. reshape to (1, ...) or (0, ...), expand '
                'or stack on an axis after it).' % (_block_name(block), number, shape))
    _finish_deferred_init(block, symbol, arg_shapes, aux_shapes, params)
    types = {name: dtype for name, dtype in zip(data_names, dtypes) if name in inputs}
    try:
        _, out_types, _ = _quiet(symbol, 'infer_type')(**types)
    except mx.base.MXNetError as err:
        param_types = sorted({np.dtype(p.dtype).name for p in params.values()})
        raise InputError(
            'block %s cannot take per-sample inputs of dtype %s (its parameters are %s): %s. '
            'Cast the inputs (x.astype(...)) or the block (block.cast(...)) so that they agree.'
            % (_block_name(block), _dtypes_text(dtypes),
               ', '.join(param_types) or 'none', error_line(err))) from None
    out_dtypes = [np.dtype(t).type for t in out_types]
    if np.bool_ in out_dtypes:
        raise InputError(
            'block %s: output %d is bool, which MXNet 1.9.1 cannot cut out of a batched step '
            '(its slices take no bool): cast it inside the block, e.g. F.cast(x, \'uint8\').'
            % (_block_name(block), out_dtypes.index(np.bool_)))
    written = symbol
    symbol = reshapes_keeping_rows(prelu_by_ops(symbol, known), known)
    folded = []
    batch_safe, reason = check_batch_safe(symbol, set(data_names), known, folded=folded)
    # (a BatchNorm that refuses under autograd batches in inference)
    inference = not batch_safe and \
        check_batch_safe(symbol, set(data_names), known, inference=True, folded=folded)[0]
    if not batch_safe:
        reason = _prelu_reason(written, reason)
    symbol = fast_forms(symbol, known, types)
    sig = TracedSignature(next(ids), block, symbol, data_names, out_fmt, out_shapes,
                          out_dtypes, batch_safe, reason,
                          batch_safe and is_function_of_inputs(symbol), passthrough)
    if inference:
        sig.inference = TracedSignature(
            next(ids), block, symbol, data_names, out_fmt, out_shapes, out_dtypes, True, '',
            is_function_of_inputs(symbol, inference=True), passthrough)
        sig.inference.in_inference = True
        sig.inference.folded = bool(folded)
    sig.folded = bool(folded)
    return sig


def _dtypes_text(dtypes):
    """``float32``, or for leaves of several dtypes each one's in order
    (``(int32, float32, float32)``), for error messages."""
    names = [np.dtype(dtype).name for dtype in dtypes]
    if len(set(names)) <= 1:
        return names[0] if names else None
    return '(%s)' % ', '.join(names)


def is_function_of_inputs(symbol, inference=False):
    """Whether every output of ``symbol`` is a function of its inputs and
    parameters alone, so that two calls with equal arguments may share one
    result: no op draws random numbers (:func:`~.rules.draws_random`:
    ``Dropout`` in training, samplers), none keeps auxiliary state
    (``BatchNorm``'s running statistics, which every training call updates;
    calls made in inference, with ``inference``, only read them, as they
    read parameters) and none is a custom op or one whose rule the user
    registered without saying it is such a function
    (:data:`~.rules.NOT_FUNCTIONS`)."""
    if symbol.list_auxiliary_states() and not inference:
        return False
    return not any(node['op'] != 'null' and (node['op'] in NOT_FUNCTIONS or
                                             draws_random(node['op'], node.get('attrs')))
                   for node in json.loads(symbol_json(symbol))['nodes'])


def _attribute_ids(block):
    """``{(id of block, attribute): id of value}`` over ``block`` and the
    blocks below it: what a trace may change (see :func:`_symbols_kept`)."""
    return {(id(below), attr): id(value)
            for below in blocks_of(block) for attr, value in vars(below).items()
            if attr != 'reset'}


def _holds_symbol(value):
    if isinstance(value, mx.sym.Symbol):
        return True
    return isinstance(value, (list, tuple)) and any(_holds_symbol(item) for item in value)


def _watch_resets(block):
    """``{block: False}`` for the recurrent cells at and below ``block``,
    their ``reset`` replaced, until the caller deletes it, by one that marks
    the cell True when called: a cell reset during a trace (an ``unroll``
    resets first) starts its state afresh, as every call per sample does."""
    cells = {below: False for below in blocks_of(block)
             if isinstance(below, mx.gluon.rnn.RecurrentCell) and 'reset' not in vars(below)}
    for cell in cells:
        def reset(cell=cell, own=cell.reset):
            cells[cell] = True
            own()
        object.__setattr__(cell, 'reset', reset)
    return cells


def _symbols_kept(block, before, fresh=()):
    """``['ZoneoutCell._prev_output', ...]``: the attributes of ``block`` or
    a block below it that its trace set to a Symbol (or a list of them).
    Per sample such an attribute carries state from one call to the next
    (Gluon's modifier cells do, and reset() clears it); traced, it holds a
    Symbol no batched call reads.  Attributes that held the same object
    before the trace (a hybridized block's own cached graph) are not
    counted, nor those of the cells in ``fresh`` (ids of cells that the trace
    reset, see :func:`_watch_resets`)."""
    return sorted({'%s.%s' % (type(below).__name__, attr)
                   for below in blocks_of(block) if id(below) not in fresh
                   for attr, value in vars(below).items()
                   if before.get((id(below), attr)) != id(value) and _holds_symbol(value)})


def _outputs_as_lists(out):
    """The traced outputs nested as per-sample execution nests them: an op
    with several outputs returned as it is (``F.split(x, 2)``) is one
    Symbol when traced but a list of NDArrays per sample, so it becomes the
    list of its outputs (as one leaf, its outputs were counted as one, and
    the values of later outputs went to the wrong places)."""
    if isinstance(out, (list, tuple)):
        return type(out)(_outputs_as_lists(item) for item in out)
    if isinstance(out, mx.sym.Symbol) and len(out.list_outputs()) > 1:
        return [out[i] for i in range(len(out.list_outputs()))]
    return out


def _drop_stale_vars(block):
    """Make Gluon build afresh the symbol variable of a parameter cast since
    it was built (``block.cast('float64')`` after a trace at float32): it
    keeps the old dtype, and type inference of the new trace fails."""
    for param in block.collect_params().values():
        var = param._var
        if var is not None and param.dtype is not None and \
                var.attr('__dtype__') != str(_DTYPE_NP_TO_MX.get(np.dtype(param.dtype).type)):
            param._var = None


def reshapes_keeping_rows(symbol, known):
    """``symbol`` with the target shape of every ``Reshape`` that does not
    keep axis 0 (a target not starting with ``0``, or read from the right
    with ``reverse``) written out as ``(-1,)`` and its output's per-sample
    sizes after axis 0, or ``symbol`` itself when it has none; ``known``:
    input shapes, which give each reshaped value its shape.

    Per sample the two are one: they give the same shape.  Batched, the
    written-out form is right for any reshape.  A step stacks its calls'
    values along axis 0, each sample's elements one contiguous run, and a
    reshape keeps the order of the elements; so with the sizes after axis 0
    fixed, the batched result holds each call's result in turn, its rows
    those of the call (``check_batch_safe`` follows how many rows a
    sample has).  Per-sample code writes targets that do not say so:
    ``(1, d, 2 * d)`` (a user trial's RNTN), or ``(-1, 0, 0)`` read from
    the right, as gluonnlp's multi-head attention folds its heads into
    axis 0, a sample then having a row per head.  A target of rank 0, or
    a legacy ``target_shape``, is left for the rule to refuse."""
    graph = json.loads(symbol_json(symbol))
    nodes = graph['nodes']
    found = [number for number, node in enumerate(nodes) if _reshape_not_keeping_rows(node)]
    if not found:
        return symbol
    _, _, by_name = _parse_graph(symbol, known)
    changed = False
    for number in found:
        shape = _entry_shape(nodes, (number, 0), by_name)
        attrs = nodes[number]['attrs']
        target = str((-1,) + tuple(shape[1:])) if shape else None
        if target and all(size > 0 for size in shape) and \
                (target != attrs['shape'] or 'reverse' in attrs):
            attrs['shape'] = target
            attrs.pop('reverse', None)
            changed = True
    return mx.sym.load_json(json.dumps(graph)) if changed else symbol


def _reshape_not_keeping_rows(node):
    """Whether ``node`` reshapes to a target shape that does not start with
    ``0`` (keep axis 0), or reads its target from the right."""
    if node['op'] not in ('Reshape', 'reshape'):
        return False
    attrs = node.get('attrs', {})
    if attrs.get('reverse', 'False').lower() in ('true', '1'):
        return True
    try:
        shape = ast.literal_eval(attrs.get('shape', '()'))
    except (ValueError, SyntaxError):
        return False
    return isinstance(shape, tuple) and len(shape) >= 1 and shape[0] != 0


def prelu_by_ops(symbol, known):
    """``symbol`` with every ``LeakyReLU(act_type='prelu')`` computed as
    ``relu(x) + alpha * min(x, 0)`` (``alpha`` along axis 1, as ``prelu``
    takes it), or ``symbol`` itself when it has none; ``known``: input
    shapes, which give each ``x`` its rank.

    MXNet 1.9.1's ``prelu`` backward inside a CachedOp, which every step
    program is, scales ``alpha``'s gradient by ``alpha`` when ``x`` needs a
    gradient too (a ``Dense`` before it): plain hybridized Gluon gets it
    wrong the same way, eager Gluon right.  These ops compute it right."""
    graph = json.loads(symbol_json(symbol))
    nodes = graph['nodes']
    if not any(_is_prelu(node) for node in nodes):
        return symbol
    _, _, by_name = _parse_graph(symbol, known)
    out, moved = [], {}

    def add(name, op, inputs, attrs=None):
        out.append({'op': op, 'name': name, 'attrs': attrs or {}, 'inputs': inputs})
        return [len(out) - 1, 0, 0]

    for old, node in enumerate(nodes):
        inputs = [moved_entry(e, moved) for e in node['inputs']]
        if not _is_prelu(node):
            out.append(dict(node, inputs=inputs))
            moved[old] = len(out) - 1
            continue
        name, (x, alpha) = node['name'], inputs[:2]
        shape = _entry_shape(nodes, node['inputs'][0], by_name)
        if shape is not None and len(shape) > 2:
            alpha = add(name + '_alpha', 'Reshape', [alpha],
                        {'shape': str((1, -1) + (1,) * (len(shape) - 2))})
        positive = add(name + '_pos', 'Activation', [x], {'act_type': 'relu'})
        negative = add(name + '_neg', '_minimum_scalar', [x], {'scalar': '0.0'})
        scaled = add(name + '_scaled', 'broadcast_mul', [alpha, negative])
        moved[old] = add(name, 'broadcast_add', [positive, scaled])[0]
    return load_graph(graph, out, [moved_entry(e, moved) for e in graph['heads']])


ACTIVATION_OPS = frozenset(('sigmoid', 'tanh', 'softsign'))
"""Ops that are also an ``Activation(act_type=<op>)``, which computes the
same function faster in float32 (see :func:`fast_forms`).  Not ``relu``:
MKLDNN's makes a NaN 0, where the ``relu`` op keeps it."""

EXACT = '__dynbatch_exact__'
"""Attribute of the ``Activation`` nodes :func:`fast_forms` made, holding
the op the block wrote (``'Activation'`` for a block's own ``tanh`` of
another dtype than float32), whose values must not change further
(:func:`~gluon_dynbatch.lower.tanh_by_sigmoid` leaves them alone; see
:func:`own_forms`)."""

SLICED = '__dynbatch_sliced__'
"""Attribute of the nodes :func:`fast_forms` made of a split:
``'<split name>;<outputs>;<axis>;<squeeze>;<output>;<slice|squeeze>'``
(see :func:`own_forms`)."""

SPLIT_OPS = frozenset(('SliceChannel', 'split'))
CONCAT_OPS = frozenset(('Concat', 'concat'))


def fast_forms(symbol, known, types):
    """``symbol`` with the ops MXNet 1.9.1 runs slowly on CPU replaced by
    their fast forms, or ``symbol`` itself when it has none; ``known`` and
    ``types``: input shapes and dtypes, which give splits their widths,
    axes their ranks and activations their dtype.

    * ``sigmoid``, ``tanh`` and ``softsign`` of float32 become
      ``Activation(act_type=...)`` (MKLDNN's kernel: the same function to
      the last bit or two, NaN and infinities alike, but for ``sigmoid``
      outputs under 1.2e-38, which it flushes to 0: inputs in about
      [-103, -87.3]).  Marked :data:`EXACT`, so that large steps do not
      compute such a ``tanh`` through ``sigmoid`` as they do the block's
      own ``Activation``.
    * ``SliceChannel`` / ``split`` along an axis other than the batch axis
      becomes one ``slice_axis`` per output that is read (and a
      ``squeeze`` where it squeezes), unless an output feeds
      ``zeros_like`` or ``ones_like`` (whose backward through
      ``slice_axis`` crashes MXNet 1.9.1).
    * ``Concat`` along a negative axis names it from the front (MKLDNN's
      kernel takes it only so: on 2-d rows 4x / 15x / 26x faster at 25 /
      256 / 2,500 rows); the same values to the bit.  Only forms that keep
      one row per sample: the passes that run a block's host part once per
      distinct row count on it (see ``docs/design.rst``).

    Gluon's own cells use the slow forms: ``LSTMCell`` both (its gates cut
    by ``SliceChannel``, three ``sigmoid`` ops and a ``tanh``), ``GRUCell``
    the split and ``RNNCell`` its activation.  On one thread, at 365 rows
    of an ``LSTMCell(150)``'s gates: ``SliceChannel`` into 4 took 700 us
    where four ``slice_axis`` took 56; ``sigmoid`` 165 us and ``tanh`` 730
    us where ``Activation`` took 21 (``benchmarks/bench_cells.py`` measures
    whole cells).  Runs after the batch-safety check, which thus judges the
    block's own ops."""
    graph = json.loads(symbol_json(symbol))
    nodes = graph['nodes']
    ops = {node['op'] for node in nodes}
    if not ops & (ACTIVATION_OPS | SPLIT_OPS | CONCAT_OPS | {'Activation'}):
        return symbol
    by_name = _parse_graph(symbol, known)[2] if ops & (SPLIT_OPS | CONCAT_OPS) else {}
    dtypes = _entry_types(symbol, types) if ops & (ACTIVATION_OPS | {'Activation'}) else {}
    readers = {}                # (node, output) -> ops reading it
    for node in nodes:
        for entry in node['inputs']:
            readers.setdefault((entry[0], entry[1]), set()).add(node['op'])
    heads = {(entry[0], entry[1]) for entry in graph['heads']}
    taken = {node['name'] for node in nodes}
    out, moved, parts = [], {}, {}     # parts: (old node, output) -> new entry

    def entry_for(entry):
        part = parts.get((entry[0], entry[1]))
        return part if part is not None else moved_entry(entry, moved)

    def add(name, op, inputs, attrs):
        while name in taken:
            name += '_'
        taken.add(name)
        out.append({'op': op, 'name': name, 'attrs': attrs, 'inputs': inputs})
        return [len(out) - 1, 0, 0]

    for old, node in enumerate(nodes):
        inputs = [entry_for(entry) for entry in node['inputs']]
        op, name = node['op'], node['name']
        hidden = {key: value for key, value in node.get('attrs', {}).items()
                  if key.startswith('__')}
        shapes = [_entry_shape(nodes, entry, by_name) for entry in node['inputs']] \
            if op in SPLIT_OPS | CONCAT_OPS else []
        slices = _split_as_slices(node, old, shapes, readers, heads) if op in SPLIT_OPS else None
        if slices is not None:
            count, axis, width, squeeze, used = slices
            for number in used:
                mark = '%s;%d;%d;%d;%d;' % (name, count, axis, squeeze, number)
                part = add('%s_part%d' % (name, number), 'slice_axis', inputs[:1],
                           dict(hidden, axis=str(axis), begin=str(number * width),
                                end=str((number + 1) * width), **{SLICED: mark + 'slice'}))
                if squeeze:
                    part = add('%s_part%d_squeezed' % (name, number), 'squeeze', [part],
                               dict(hidden, axis='(%d,)' % axis, **{SLICED: mark + 'squeeze'}))
                parts[(old, number)] = part
            continue
        axis = _concat_axis(node, shapes) if op in CONCAT_OPS else None
        if axis is not None:
            node = dict(node, attrs=dict(node.get('attrs', {}), dim=str(axis)))
        elif op in ACTIVATION_OPS and \
                _entry_value(nodes, node['inputs'][0], dtypes) is np.float32:
            node = dict(node, op='Activation', attrs=dict(hidden, act_type=op, **{EXACT: op}))
        elif op == 'Activation' and node.get('attrs', {}).get('act_type') == 'tanh' and \
                _entry_value(nodes, node['inputs'][0], dtypes) is not np.float32:
            # (large float32 steps compute tanh through sigmoid, which in
            # float16 errs by a float16 step: lower.tanh_by_sigmoid)
            node = dict(node, attrs=dict(node['attrs'], **{EXACT: op}))
        out.append(dict(node, inputs=inputs))
        moved[old] = len(out) - 1
    if out == nodes:
        return symbol
    return load_graph(graph, out, [entry_for(entry) for entry in graph['heads']])


def own_forms(symbol):
    """``symbol`` with what :func:`fast_forms` made put back as the block
    wrote it (the ``Activation`` nodes marked :data:`EXACT` as their ops,
    the slices of a split, marked :data:`SLICED`, as one split), or
    ``symbol`` itself when it has none; a split whose slices no longer
    read one input, or whose squeezed slices are read by anything but
    their squeezes (or not at all), stays sliced.  Steps of a few rows run this form
    (:data:`~gluon_dynbatch.lower.FAST_FORMS_ROWS`): there an op's fixed
    cost rules, and four slices are four ops where the split was one."""
    graph = json.loads(symbol_json(symbol))
    nodes = graph['nodes']
    marks = [node.get('attrs', {}).get(SLICED) for node in nodes]
    if not any(marks) and not any(EXACT in node.get('attrs', {}) for node in nodes):
        return symbol
    readers = graph_readers(nodes, graph['heads'])
    sources, broken = {}, set()     # split name -> the entries its slices read
    for number, (node, mark) in enumerate(zip(nodes, marks)):
        if not mark or not mark.endswith(';slice'):
            continue
        key, _, _, squeeze, _, _ = _sliced(mark)
        sources.setdefault(key, set()).add(tuple(node['inputs'][0][:2]))
        if squeeze == '1':      # read by its squeeze alone, in this graph
            mine, prefix = readers.get(number, []), mark[:-len('slice')]
            if not mine or any(reader is None or not (marks[reader] or '').startswith(prefix)
                               for reader in mine):
                broken.add(key)
    whole = {key for key, found in sources.items() if len(found) == 1 and key not in broken}
    out, moved, parts, made = [], {}, {}, {}

    def entry_for(entry):
        part = parts.get(entry[0])
        return [part[0], part[1], 0] if part is not None else moved_entry(entry, moved)

    for old, (node, mark) in enumerate(zip(nodes, marks)):
        attrs = node.get('attrs', {})
        if mark and _sliced(mark)[0] in whole:
            key, count, axis, squeeze, output, kind = _sliced(mark)
            if key not in made:         # its first slice (a squeeze comes after)
                hidden = {k: v for k, v in attrs.items() if k.startswith('__') and k != SLICED}
                out.append({'op': 'SliceChannel', 'name': key,
                            'inputs': [entry_for(node['inputs'][0])],
                            'attrs': dict(hidden, num_outputs=count, axis=axis,
                                          squeeze_axis=squeeze)})
                made[key] = len(out) - 1
            if kind == 'squeeze' or squeeze == '0':
                parts[old] = (made[key], int(output))
            continue
        inputs = [entry_for(entry) for entry in node['inputs']]
        if EXACT in attrs:
            kept = {k: v for k, v in attrs.items()
                    if k != EXACT and (k.startswith('__') or attrs[EXACT] == 'Activation')}
            node = dict(node, op=attrs[EXACT], attrs=kept)
        out.append(dict(node, inputs=inputs))
        moved[old] = len(out) - 1
    return load_graph(graph, out, [entry_for(entry) for entry in graph['heads']])


def _sliced(mark):
    """The fields of a :data:`SLICED` mark (the split's name may hold a
    ';': a block's prefix is the user's to choose)."""
    return mark.rsplit(';', 5)


def _split_as_slices(node, number, shapes, readers, heads):
    """``(outputs, axis, width, squeeze, outputs read)`` of a split that
    :func:`fast_forms` may cut by slices, else None."""
    view = OpView(node['op'], node.get('attrs', {}), [True], [])
    count, axis = view.attr('num_outputs'), view.attr('axis', 1)
    shape = shapes[0]
    if not isinstance(count, int) or not isinstance(axis, int) or count < 1 or \
            not shape or not -len(shape) <= axis < len(shape):
        return None
    axis %= len(shape)
    if axis == 0 or shape[axis] % count:
        return None
    used = [output for output in range(count)
            if (number, output) in heads or (number, output) in readers]
    if any(readers.get((number, output), set()) & {'zeros_like', 'ones_like'}
           for output in used):
        return None
    return count, axis, shape[axis] // count, view.flag('squeeze_axis'), used


def _concat_axis(node, shapes):
    """The axis, counted from the front, of a concatenation along an axis
    named from the back, else None."""
    dim = OpView(node['op'], node.get('attrs', {}), [], []).attr('dim', 1)
    if not shapes or any(not shape or len(shape) != len(shapes[0]) for shape in shapes) or \
            not isinstance(dim, int) or not -len(shapes[0]) <= dim < len(shapes[0]):
        return None
    return dim % len(shapes[0]) if dim < 0 else None


def unique_op_names(symbol):
    """``symbol`` with a name of its own for every op.  Gluon names a child
    block's ops by the child (``<prefix>fwd``), so a block calling one child
    twice has ops named alike, and the passes that find an op or its shape
    by name took one for the other: the batch-safety check judged the
    first call's ``sum`` by the second's input shape (wrong values, as
    batch-safe), and the host-part split failed to find an op once.  A
    repeated name gets ``_dup<k>``; inputs keep theirs (they are bound by
    name)."""
    graph = json.loads(symbol_json(symbol))
    nodes = graph['nodes']
    seen, taken = {}, {node['name'] for node in nodes}
    renamed = False
    for node in nodes:
        if node['op'] == 'null':
            continue
        name = node['name']
        if name in seen:
            count = seen[name]
            while '%s_dup%d' % (name, count) in taken:
                count += 1
            seen[name] = count + 1
            node['name'] = '%s_dup%d' % (name, count)
            taken.add(node['name'])
            renamed = True
        else:
            seen[name] = 1
    return load_graph(graph, nodes, graph['heads']) if renamed else symbol


def symbol_json(symbol):
    """``symbol.tojson()`` without its leak.  MXNet 1.9.1's ``tojson()``
    (``remove_amp_cast=True``) copies the graph into a new symbol handle
    (``MXSymbolRemoveAmpCast``) that it never frees: every call leaked a
    deep copy of the graph, ~2.2-2.8 bytes per JSON character (~2 MB per
    Tree-LSTM model; apache/mxnet#19574).  The same JSON, the copy owned
    by a :class:`mxnet.symbol.Symbol` that frees it."""
    handle = mx.base.SymbolHandle()
    mx.base.check_call(mx.base._LIB.MXSymbolRemoveAmpCast(  # pylint: disable=protected-access
        symbol.handle, ctypes.byref(handle)))
    return mx.sym.Symbol(handle).tojson(remove_amp_cast=False)


def inputs_below(nodes):
    """Per node of a symbol's JSON ``nodes`` (in topological order), the
    names of the inputs it depends on (a frozenset)."""
    below = []
    for node in nodes:
        names = {node['name']} if node['op'] == 'null' else set()
        for entry in node['inputs']:
            names |= below[entry[0]]
        below.append(frozenset(names))
    return below


def load_graph(graph, nodes, heads):
    """The symbol of a symbol's JSON ``graph`` rebuilt with new ``nodes``
    (in topological order) and ``heads``."""
    graph.update(nodes=nodes, heads=heads,
                 arg_nodes=[i for i, node in enumerate(nodes) if node['op'] == 'null'])
    graph.pop('node_row_ptr', None)
    return mx.sym.load_json(json.dumps(graph))


def graph_readers(nodes, heads):
    """``{node: [reader, ...]}`` over a symbol's JSON ``nodes``: the nodes
    that read any output of each node, once per input that does, and None
    for each of the graph's ``heads`` that is one."""
    readers = {}
    for i, node in enumerate(nodes):
        for entry in node['inputs']:
            readers.setdefault(entry[0], []).append(i)
    for entry in heads:
        readers.setdefault(entry[0], []).append(None)
    return readers


def moved_entry(entry, moved):
    """A graph entry ``[node, output, version]`` of a rewritten graph:
    ``entry`` with its node renumbered by ``moved`` (old index -> new)."""
    return [moved[entry[0]], entry[1], 0]


PRELU_PARTS = ('_alpha', '_scaled')
"""Suffixes of the ops :func:`prelu_by_ops` makes of a prelu's slope: a
refusal there means the slope is per sample."""


def _prelu_reason(symbol, reason):
    """``reason`` (a refusal of the rewritten symbol), told in terms of the
    block's own ``LeakyReLU(act_type='prelu')`` when it names an op that
    :func:`prelu_by_ops` made of its slope (the user never wrote a
    ``broadcast_mul``)."""
    for node in json.loads(symbol_json(symbol))['nodes']:
        if _is_prelu(node) and any('(%s%s)' % (node['name'], part) in reason
                                   for part in PRELU_PARTS):
            return ("op LeakyReLU (%s, act_type='prelu') reads a per-sample slope (gamma); "
                    "it runs batched only with a slope the same for every sample, such as a "
                    "parameter" % node['name'])
    return reason


def _is_prelu(node):
    return node['op'] == 'LeakyReLU' and node.get('attrs', {}).get('act_type') == 'prelu'


def _quiet(symbol, name):
    """``symbol.infer_shape`` or ``infer_type`` without the list of
    arguments MXNet prints on failure (the error raised names them)."""
    impl = getattr(symbol, '_%s_impl' % name, None)
    if impl is None:
        return getattr(symbol, name)
    return lambda **known: impl(False, **known)


def error_line(err):
    """The line of an MXNet error that says what went wrong, without the
    traceback it carries."""
    lines = [l for l in str(err).strip().splitlines() if l.strip()]
    return next((l for l in lines if 'Error' in l and 'Traceback' not in l), lines[-1])


def _infer_shapes(block, symbol, known, shapes):
    try:
        arg_shapes, out_shapes, aux_shapes = _quiet(symbol, 'infer_shape')(**known)
    except mx.base.MXNetError as err:
        hint = ''
        if 'elemwise_op_common' in str(err):     # an element-wise op met unequal shapes
            hint = (' If they are right, the block relies on NDArray\'s implicit broadcasting '
                    '(x + y of shapes (1, 4) and (1, 1)), which its Symbol form does not do '
                    '(block.hybridize() fails the same way): write F.broadcast_add, '
                    'F.broadcast_mul and the like.')
        raise InputError(
            'block %s cannot take per-sample inputs of shapes %s: %s. Check the argument '
            'shapes (each with a leading batch axis of 1) against the block\'s parameters.%s'
            % (_block_name(block), list(shapes), error_line(err), hint)) from None
    if out_shapes is None or any(s is None or 0 in s for s in out_shapes):
        unknown = _first_unknown_shape(symbol, known)
        if unknown is None:
            advice = 'give its layers their input sizes (e.g. in_units).'
        else:
            advice = ('the first unknown shape is the output of its op %s (%s), whose inputs '
                      'are known: its output shape depends on the input values (as '
                      'contrib.boolean_mask\'s does), or MXNet\'s shape inference does not '
                      'see through the op (contrib.cond and while_loop, say), and batching '
                      'must know it ahead of the data. Call the block outside the scope, or '
                      'move that op out of it.' % unknown)
        raise InputError('block %s: output shapes cannot be inferred from inputs %s; %s'
                         % (_block_name(block), list(shapes), advice))
    return arg_shapes, [tuple(s) for s in out_shapes], aux_shapes


def _first_unknown_shape(symbol, known):
    """``(op, node name)`` of the first op in ``symbol`` whose inputs all
    have known shapes but whose output shape is unknown (an output shape
    that depends on the data, not a deferred parameter size), else None."""
    try:
        nodes, _, by_name = _parse_graph(symbol, known)
    except mx.base.MXNetError:
        return None

    def known_shape(entry):
        shape = _entry_shape(nodes, entry, by_name)
        return shape is not None and 0 not in shape

    for index, node in enumerate(nodes):
        if node['op'] != 'null' and node['inputs'] and \
                all(known_shape(e) for e in node['inputs']) and not known_shape([index, 0, 0]):
            return node['op'], node['name']
    return None


def _finish_deferred_init(block, symbol, arg_shapes, aux_shapes, params):
    """Give deferred-initialised parameters the shapes inferred from the
    trace, as Gluon's own ``_deferred_infer_shape`` does on first call."""
    inferred = dict(zip(symbol.list_arguments(), arg_shapes))
    inferred.update(zip(symbol.list_auxiliary_states(), aux_shapes))
    for name, param in params.items():
        if name in inferred and param.grad_req == 'add' and \
                getattr(param, '_grad_stype', 'default') == 'row_sparse':
            raise InputError(
                'parameter %s of block %s has a row-sparse gradient (sparse_grad=True) and '
                "grad_req='add', which MXNet's sparse Embedding gradient does not support (eager "
                "Gluon silently keeps only the last gradient). Use grad_req='write', or "
                'sparse_grad=False.' % (name, _block_name(block)))
        if name not in inferred or param._data is not None:
            continue
        if param._deferred_init:
            param.shape = tuple(inferred[name])
            param._finish_deferred_init()
        elif param._data is None:
            raise InputError('parameter %s of block %s is not initialized: call '
                             '.initialize() on the block (or the DynBatchBlock) first.'
                             % (name, _block_name(block)))


def _parse_graph(symbol, known):
    """Nodes of the symbol's JSON and the per-sample shape of every entry,
    by output name and by ``(node, output)`` (an op's outputs need not be
    named ``output<k>``: RNN's are ``output``, ``state_output`` and
    ``statecell_output``)."""
    graph = json.loads(symbol_json(symbol))
    internals = symbol.get_internals()
    _, shapes, _ = internals.infer_shape_partial(**known)
    shapes = shapes or []
    by_name = dict(zip(internals.list_outputs(), shapes))
    inner = json.loads(symbol_json(internals))
    if [node['name'] for node in inner['nodes']] == [node['name'] for node in graph['nodes']]:
        by_name.update(((entry[0], entry[1]), shape)
                       for entry, shape in zip(inner['heads'], shapes))
    return graph['nodes'], graph['heads'], by_name


def _entry_types(symbol, types):
    """The dtype (a numpy type, or None) of every entry of ``symbol``, by
    its output name, from its inputs' ``types``."""
    internals = symbol.get_internals()
    _, out_types, _ = internals.infer_type_partial(**types)
    return dict(zip(internals.list_outputs(), out_types or []))


def _entry_value(nodes, entry, by_name):
    """What ``by_name`` (by output name, or by ``(node, output)``, see
    :func:`_parse_graph`) holds for a graph entry."""
    node = nodes[entry[0]]
    if node['op'] == 'null':
        return by_name.get(node['name'])
    value = by_name.get('%s_output' % node['name']) if entry[1] == 0 else None
    if value is None:
        value = by_name.get('%s_output%d' % (node['name'], entry[1]))
    return value if value is not None else by_name.get((entry[0], entry[1]))


def _entry_shape(nodes, entry, by_name):
    shape = _entry_value(nodes, entry, by_name)
    return tuple(shape) if shape else None


def _draw_advice(op_name):
    """How to draw what ``op_name`` draws from a per-sample tensor, which
    batches (see :data:`~.rules.RANDOM_LIKE`), or ``''``."""
    like = op_name + '_like'
    if like not in RANDOM_LIKE:
        return ''
    return ('; draw it from a per-sample tensor of the shape wanted, which batches: '
            'F.random.%s(x)' % like[len('_random_'):])


def check_batch_safe(symbol, data_names, known, inference=False, folded=None):
    """``(True, '')`` when every op touching a batched tensor has a rule that
    accepts it (for calls made under autograd, or with ``inference`` outside
    it: see :class:`~.rules.OpView`), no op draws random numbers for shared tensors (see
    :func:`~.rules.draws_random`) and every output is batched on axis 0;
    else ``(False, reason)``.  A value may also be batched on axis 1 (see
    :func:`_time_major`): that of ``swapaxes(x, 0, 1)``, and Gluon's fused
    recurrent layers' ``RNN``, which takes the batch there.

    A constant whose rows are left open, ``zeros(shape=(0, H))``, counts
    as batched where MXNet gives it the batch's rows: Gluon's recurrent
    cells make their default begin states so (``cell.unroll(T, x)`` in a
    block), and taken as shared, the first step's ``h2h`` ran per sample
    ("mixes batched and shared inputs", a user trial).  As batched, every
    rule sees it: a sum over all its axes is one over the batch axis.
    Where it takes one row whatever the batch (its rows inferred from a
    parameter's), it is shared: told apart by inferring the shapes again
    for two samples (:func:`_open_rows_following_batch`).

    A batched value of several rows per sample (a reshape folded a sample
    into rows, see :func:`reshapes_keeping_rows`) is read only by ops with
    builtin rules (:data:`~.rules.BUILTIN_RULES`) whose batched inputs all
    have as many rows, and the shapes inferred again for two samples must
    give each such value twice its rows; the entries read so are appended
    to ``folded`` (a list) when given: passes that take one row per call
    (a host part run on distinct rows, lanes) leave such a signature
    alone (:attr:`TracedSignature.folded`)."""
    nodes, heads, by_name = _parse_graph(symbol, known)
    readers = graph_readers(nodes, heads)
    opened = [number for number, node in enumerate(nodes) if _open_rows(node)]
    complete = all(shape for name, shape in known.items() if name in data_names)
    if opened and complete:
        opened = _open_rows_following_batch(symbol, known, data_names, nodes, opened,
                                            by_name)
    else:
        opened = set()
    several = []
    safe, reason = _batch_safe(nodes, heads, by_name, readers, data_names, opened, inference,
                               several)
    if safe and several:
        wrong = _rows_not_following_batch(symbol, known, data_names, nodes, several, by_name) \
            if complete else several[0]
        if wrong is not None:
            return False, ('%s (%s) of per-sample shape %s: its rows did not follow the '
                           'batch when its shapes were inferred for two samples'
                           % (nodes[wrong[0]]['op'], nodes[wrong[0]]['name'],
                              _entry_shape(nodes, wrong, by_name)))
        if folded is not None:
            folded.extend(several)
    return safe, reason


def _rows_not_following_batch(symbol, known, data_names, nodes, entries, single):
    """The first of ``entries`` (values batched on axis 0, several rows per
    sample in ``single``, the shapes for one sample) whose shape for two
    samples (the inputs named ``data_names`` of twice their rows) is not
    its per-sample one with twice the rows, or None."""
    doubled = {name: (2 * shape[0],) + tuple(shape[1:]) if name in data_names else shape
               for name, shape in known.items()}
    try:
        _, _, by_name = _parse_graph(symbol, doubled)
    except mx.base.MXNetError:
        return entries[0]
    for entry in entries:
        one, two = _entry_shape(nodes, entry, single), _entry_shape(nodes, entry, by_name)
        if not one or not two or two != (2 * one[0],) + one[1:]:
            return entry
    return None


def _open_rows(node):
    """Whether ``node`` makes a constant whose rows (axis 0) are left open
    (0), for MXNet to infer from what reads it, as Gluon's cells make their
    default begin states."""
    shape = constant_shape(node)
    return bool(shape) and not node['inputs'] and shape[0] == 0 and 0 not in shape[1:]


def _open_rows_following_batch(symbol, known, data_names, nodes, opened, single):
    """The constants of open rows among ``opened`` (see :func:`_open_rows`)
    that MXNet gives one row per sample (``single``: the shapes inferred
    from ``known``) and two where the per-sample inputs (``known`` shapes,
    those of ``data_names``) have two samples' rows: batched, they take one
    row per sample.  (Rows inferred from a (2, H) parameter are two either
    way: counted as batched, every op reading them was refused, 'sees a
    batched input of shape (2, 3)'.)"""
    doubled = {name: (2 * shape[0],) + tuple(shape[1:]) if name in data_names else shape
               for name, shape in known.items()}
    try:
        _, _, by_name = _parse_graph(symbol, doubled)
    except mx.base.MXNetError:
        return set()
    return {number for number in opened
            if (_entry_shape(nodes, (number, 0), single) or (None,))[0] == 1 and
            (_entry_shape(nodes, (number, 0), by_name) or (None,))[0] == 2}


def _batch_safe(nodes, heads, by_name, readers, data_names, opened, inference, several):
    """:func:`check_batch_safe`'s verdict, with the nodes ``opened``
    (constants of open rows) batched on axis 0; appends to ``several`` the
    entries batched on axis 0 that ops read with several rows per
    sample."""
    batched = []    # per node: its outputs' batch axis (0 or 1), None where shared
    for number, node in enumerate(nodes):
        if node['op'] == 'null':
            batched.append(0 if node['name'] in data_names else None)
            continue
        if number in opened:
            batched.append(0)
            continue
        inputs = node['inputs']
        axes = [batched[e[0]] for e in inputs]
        if all(axis is None for axis in axes):
            if draws_random(node['op'], node.get('attrs')):
                return False, ('op %s (%s) draws random numbers from no per-sample input: '
                               'batched, one draw would serve every sample%s'
                               % (node['op'], node['name'], _draw_advice(node['op'])))
            batched.append(None)
            continue
        shapes = [_entry_shape(nodes, e, by_name) for e in inputs]
        if _counts_along_a_sample_axis(node, axes, shapes):
            batched.append(None)
            continue
        rows = {shape[0] if shape else None for axis, shape in zip(axes, shapes) if axis == 0}
        if 1 in axes or node['op'] == 'RNN' or _swaps_axis_0_and_1(node, shapes) or \
                _moves_batch_to_1(node, axes, shapes):
            if rows - {1, None}:
                return False, 'op %s (%s) sees a batched input of shape %s' % (
                    node['op'], node['name'], _several_rows(axes, shapes))
            axis, reason = _time_major(node, nodes, axes, shapes, readers)
            if reason:
                return False, '%s (%s)' % (reason, node['name'])
            batched.append(axis)
            continue
        rule = batching_rule(node['op'])
        if rule is None:
            return False, 'op %s (%s) %s' % (node['op'], node['name'], UNBATCHABLE.get(
                node['op'], 'has no batching rule'))
        flags = [axis is not None for axis in axes]
        for flag, shape in zip(flags, shapes):
            if flag and (shape is None or not shape):
                return False, 'op %s (%s) sees a batched input of shape %s' % (
                    node['op'], node['name'], shape)
        if rows != {1}:
            reason = _several_rows_reason(node, rule, _rows_read(node, axes, shapes), axes,
                                          shapes)
            if reason:
                return False, reason
            several.extend((entry[0], entry[1]) for entry, axis in zip(inputs, axes)
                           if axis == 0 and (entry[0], entry[1]) not in several)
        reason = rule(OpView(node['op'], node.get('attrs', {}), flags, shapes, inference))
        if reason is not None and (not isinstance(reason, str) or not reason.strip()):
            # (True became the reason 'True', and False, meant as 'no', read as safe; so
            # did '', an empty reason, found by a user's trial)
            raise InputError('the batching rule %s for op %s returned %r: a rule returns None '
                             'when stacking along axis 0 is safe, else a string saying why '
                             'not (see register_batching_rule).'
                             % (getattr(rule, '__name__', rule), node['op'], reason))
        if reason:
            return False, '%s (%s)' % (reason, node['name'])
        batched.append(0)
    for head in heads:
        if batched[head[0]] is None:
            return False, 'an output does not depend on the per-sample inputs'
        if batched[head[0]] == 1:
            return False, ('an output (of %s) has its batch on axis 1, as RNN gives it: swap '
                           'it back to axis 0 (F.swapaxes(x, 0, 1), as a layout=\'NTC\' layer '
                           'does for its output)' % nodes[head[0]]['name'])
    return True, ''


def _counts_along_a_sample_axis(node, axes, shapes):
    """Whether ``node`` is an ``arange_like`` along an axis other than the
    batch axis of an input batched on axis 0: its result, the positions
    ``0 .. n - 1`` of that axis, reads only the axis's size, the same for
    every sample and batched, so it is shared.  gluonnlp's
    ``TransformerEncoder`` counts its steps so for its positional encoding
    and its mask of each sample's valid length, and ran per sample."""
    if node['op'] != '_contrib_arange_like' or axes != [0] or not shapes[0]:
        return False
    axis = OpView(node['op'], node.get('attrs', {}), [True], shapes).attr('axis')
    return isinstance(axis, int) and -len(shapes[0]) <= axis < len(shapes[0]) and \
        axis % len(shapes[0]) != 0


def _rows_read(node, axes, shapes):
    """The rows per sample of the inputs batched on axis 0 whose rows
    ``node`` reads: not those of the second input of a ``broadcast_like``
    or ``slice_like`` naming axes without axis 0, which gives only its
    sizes along them (the result has the first input's rows).  So a
    sample's one row broadcast like its folded rows' sizes on another axis
    batches (``broadcast_like(length, scores, lhs_axes=(2,),
    rhs_axes=(1,))``, a user trial's attention over valid lengths)."""
    skip = None
    if node['op'] in ('broadcast_like', 'slice_like') and len(shapes) == 2 and all(shapes):
        view = OpView(node['op'], node.get('attrs', {}), [axis is not None for axis in axes],
                      shapes)
        if node['op'] == 'broadcast_like':
            named = [view.attr(key) for key in ('lhs_axes', 'rhs_axes')]
            if None not in named and 0 not in _axes_of(view, 'lhs_axes', len(shapes[0])) + \
                    _axes_of(view, 'rhs_axes', len(shapes[1])):
                skip = 1
        elif view.attr('axes') and 0 not in _axes_of(view, 'axes', len(shapes[0])):
            skip = 1
    return {shape[0] for number, (axis, shape) in enumerate(zip(axes, shapes))
            if axis == 0 and number != skip}


def _several_rows(axes, shapes):
    """The shape of the first input batched on axis 0 whose sample has
    several rows."""
    return next(shape for axis, shape in zip(axes, shapes)
                if axis == 0 and shape and shape[0] != 1)


def _several_rows_reason(node, rule, rows, axes, shapes):
    """Why an op cannot read its batched inputs of ``rows`` rows per
    sample (not all one), or None when it can: every batched input has as
    many rows and its rule is a builtin one (see :func:`check_batch_safe`)."""
    if len(rows) > 1:
        return ('op %s (%s) reads batched inputs of %s rows per sample (shapes %s): batched, '
                'their rows would not pair up as a sample\'s do; give them equal rows, '
                'broadcasting along another axis' % (
                    node['op'], node['name'], ' and '.join(map(str, sorted(rows))),
                    ', '.join(str(shape) for axis, shape in zip(axes, shapes) if axis == 0)))
    if rule is not BUILTIN_RULES.get(node['op']):
        return ('op %s (%s) has a batching rule of the user\'s, written for one row per '
                'sample, but reads a sample of several rows, of shape %s (a reshape folded it '
                'into rows): reshape it to one row, shape=(1, ...), before the op'
                % (node['op'], node['name'], _several_rows(axes, shapes)))
    return None


SWAPAXES = ('SwapAxis', 'swapaxes')
TIME_MAJOR_SEQUENCE_OPS = ('SequenceMask', 'SequenceReverse')
SPLITS = ('SliceChannel', 'split')
TIME_MAJOR_OPS = frozenset(SWAPAXES + ('RNN', 'stack', 'transpose') + SPLITS +
                           TIME_MAJOR_SEQUENCE_OPS)
"""The ops whose output may be batched on axis 1 (see :func:`_time_major`):
Gluon's fused recurrent layers' swaps around ``RNN``, the time-major
sequence ops, and the ``stack`` on axis 0 and ``split`` back that Gluon's
cells make around ``SequenceReverse`` (an ``unroll`` with ``valid_length``),
and ``transpose``.  Which of their nodes may: :func:`may_batch_on_axis_1`."""


def may_batch_on_axis_1(node):
    """Whether graph node ``node`` may give a value batched on axis 1, by
    its op and attributes alone (for lower's host part, which knows no
    batch axes): an op of :data:`TIME_MAJOR_OPS`, but for a ``stack`` on
    another axis than 0, a ``split`` along one past 0, or a ``transpose``
    that puts neither axis 0 nor 1 second (those batch on axis 0 only:
    Gluon's cells split their gates along axis 1, and a transpose of the
    last two axes is common)."""
    op, attrs = node['op'], node.get('attrs', {})
    if op not in TIME_MAJOR_OPS:
        return False
    try:
        if op == 'stack':
            return int(attrs.get('axis', 0)) <= 0
        if op in SPLITS:
            return int(attrs.get('axis', 1)) <= 0
        if op == 'transpose':
            perm = tuple(ast.literal_eval(attrs.get('axes', '()')))
            return len(perm) < 2 or perm[1] in (0, 1) or perm[1] < 0
    except (ValueError, SyntaxError, TypeError):
        return True
    return True


def _swaps_axis_0_and_1(node, shapes):
    """Whether ``node`` is a ``swapaxes`` of axes 0 and 1."""
    if node['op'] not in SWAPAXES or not shapes[0]:
        return False
    attrs = node.get('attrs', {})
    ndim = len(shapes[0])
    return {int(attrs.get('dim1', 0)) % ndim, int(attrs.get('dim2', 0)) % ndim} == {0, 1}


def _transposed_axis(node, axis, shapes):
    """Where ``transpose`` puts the input axis ``axis``, or None."""
    try:
        perm = ast.literal_eval(node.get('attrs', {}).get('axes', '()'))
    except (ValueError, SyntaxError):
        return None
    if not shapes[0]:
        return None
    perm = tuple(perm) or tuple(range(len(shapes[0]) - 1, -1, -1))
    perm = tuple(a % len(shapes[0]) for a in perm)
    return perm.index(axis) if axis in perm else None


def _moves_batch_to_1(node, axes, shapes):
    """Whether ``node`` moves a value batched on axis 0 to axis 1: a
    ``stack`` on axis 0 of per-sample rows (Gluon's ``_reverse_sequences``
    stacks a cell's steps so, time-major, for ``SequenceReverse``), or a
    ``transpose`` that puts axis 0 second."""
    op, attrs = node['op'], node.get('attrs', {})
    if op == 'stack':
        return int(attrs.get('axis', 0)) == 0 and all(axis == 0 for axis in axes)
    return op == 'transpose' and axes[0] == 0 and _transposed_axis(node, 0, shapes) == 1


def _time_major(node, nodes, axes, shapes, readers):
    """``(batch axis of its outputs, None)`` for an op that moves the batch
    to axis 1 or reads a value batched there, else ``(None, reason)``.

    Gluon's fused recurrent layers (``rnn.LSTM``, ``GRU``, ``RNN``) run
    MXNet's ``RNN`` op, which takes the time on axis 0 and the batch on
    axis 1: a ``layout='NTC'`` layer swaps a (1, T, C) sample to (T, 1, C),
    runs ``RNN`` and swaps its output back, and its default begin states
    are zeros whose batch dimension is left open (0), for MXNet to infer.
    Batched, the samples stack on axis 1 through the three ops, each
    sample's rows its own (an LSTM step mixes no two batch rows).  Only
    these two ops take a value batched on axis 1, and the time-major
    ``SequenceMask`` and ``SequenceReverse`` (``axis=0``, a length per
    sample); any other is refused (its rule knows axis 0 only).  A default
    begin state must be read by ``RNN`` ops alone (``readers``, see
    :func:`graph_readers`): MXNet gives its open dimension the batch's
    rows, which another op would see (``F.sum`` of it grows with N)."""
    op, attrs = node['op'], node.get('attrs', {})
    if op in SWAPAXES and _swaps_axis_0_and_1(node, shapes):
        axis = axes[0]
        if shapes[0][axis] != 1:
            return None, 'swapaxes sees a batched input of shape %s' % (shapes[0],)
        return 1 - axis, None
    if op == 'stack' and int(attrs.get('axis', 0)) == 0:
        # per-sample rows (1, ...) stacked time-major: (T, 1, ...), each
        # sample's steps down its own column
        if all(axis == 0 for axis in axes) and all(shape and shape[0] == 1 for shape in shapes):
            return 1, None
        return None, ('stack on axis 0 takes per-sample rows batched, (1, ...), and stacks '
                      'them time-major, the batch on axis 1')
    if op == 'transpose' and axes[0] is not None:
        axis = _transposed_axis(node, axes[0], shapes)
        if axis in (0, 1):
            return axis, None
        return None, ('transpose(axes=%s) moves the batch axis (%d) past axis 1'
                      % (attrs.get('axes'), axes[0]))
    if op in SPLITS and axes[0] == 1 and int(attrs.get('axis', 1)) == 0:
        # steps cut off a time-major value: squeezed, each is a (1, ...) row
        squeeze = attrs.get('squeeze_axis', 'False').lower() in ('true', '1')
        if not squeeze:
            return 1, None
        if shapes[0] and int(attrs.get('num_outputs', 0)) == shapes[0][0]:
            return 0, None
    lengths = attrs.get('use_sequence_length', 'False').lower() in ('true', '1')
    if op in TIME_MAJOR_SEQUENCE_OPS and int(attrs.get('axis', 0)) == 0:
        # time-major: each sample's steps down its own column
        ok = axes[0] == 1 and shapes[0] is not None and len(shapes[0]) >= 2 and \
            shapes[0][1] == 1
        if not ok or (lengths and (axes[1] != 0 or shapes[1] != (1,))):
            return None, ('%s (time on axis 0) takes a batch on axis 1 batched, with a '
                          'length per sample, (1,), where it reads lengths' % op)
        return 1, None
    if op != 'RNN':
        stacked = any(axis == 1 and nodes[entry[0]]['op'] == 'stack'
                      for axis, entry in zip(axes, node['inputs']))
        if stacked:
            return None, ('op %s reads per-sample rows stacked on axis 0 (time-major, the '
                          'batch on axis 1), which only RNN, SequenceMask, SequenceReverse '
                          'and split back along axis 0 take%s' % (op, JOIN_ADVICE))
        return None, ('op %s reads a value whose batch axis is 1 (moved there by a swapaxes or '
                      'a transpose, time-major); '
                      'only RNN, SequenceMask, SequenceReverse, swapaxes or transpose back '
                      'to axis 0 and split along axis 0 take such values' % op)
    roles = ['data', 'parameters'] + ['state'] * (len(axes) - 2 - lengths) + \
        ['sequence_length'] * lengths
    for role, axis, shape, entry in zip(roles, axes, shapes, node['inputs']):
        if role == 'parameters':
            ok = axis is None
        elif role == 'sequence_length':     # one length per sample: (1,)
            ok = axis == 0 and shape == (1,)
        elif role == 'state' and axis is None:
            ok = _open_batch_dim(nodes[entry[0]])
            if ok and any(r is None or nodes[r]['op'] != 'RNN' for r in readers[entry[0]]):
                return None, ('RNN takes a begin state of an open batch dimension (%s) '
                              'that another op reads too: batched, that op would see the '
                              'state of every sample; make it apart for each reader'
                              % nodes[entry[0]]['name'])
        else:
            ok = axis == 1 and shape is not None and len(shape) == 3 and shape[1] == 1
        if not ok:
            return None, ('RNN takes its %s %s (batched on axis %s, per-sample shape %s): '
                          'batched, it needs the data and states batched on axis 1 (a '
                          "layout='NTC' layer's, or its default begin states), the "
                          'parameters shared and one length per sample'
                          % (role, 'shared' if axis is None else 'batched', axis, shape))
    return 1, None


def _open_batch_dim(node):
    """Whether ``node`` makes a constant whose axis 1 is left open (0), for
    MXNet to infer from what reads it: an ``RNN``'s default begin state,
    ``zeros(shape=(L, 0, H))``, which batched takes the step's rows."""
    shape = constant_shape(node)
    return shape is not None and len(shape) == 3 and shape[1] == 0


OPEN_SHAPE_OPS = ('_zeros', '_ones', '_full', '_zeros_without_dtype')
"""Ops that make a constant whose shape may hold a 0 (a dimension MXNet
infers from how the value is used)."""


def constant_shape(node):
    """The shape attribute of graph node ``node`` when it is an op of
    :data:`OPEN_SHAPE_OPS` (a 0 for each dimension left open), else None."""
    if node['op'] not in OPEN_SHAPE_OPS:
        return None
    try:
        shape = ast.literal_eval(node.get('attrs', {}).get('shape', '()'))
    except (ValueError, SyntaxError):
        return None
    return tuple(shape) if isinstance(shape, (tuple, list)) else None
