"""gluon_dynbatch: just-in-time dynamic batching for MXNet Gluon.

Wrap a ``HybridBlock`` in :class:`DynBatchBlock`, write the per-sample loop
inside a :func:`~gluon_dynbatch.batching` scope, and the calls run merged
into batched CachedOp calls, forward and backward.
"""
__version__ = '0.1.0'

from .block import DynBatchBlock, batching, concat_rows, current_scope
from .debug import reset_stats, stats
from .errors import (DynBatchError, FreedGraphWarning, InputError, LazyValueError,
                     ManySignaturesWarning, PerSampleWarning, ScopeError, StatefulBlockWarning)
from .graph import LazyValue
from .plan import STRATEGIES, Agenda, BatchStep, ByDepth, CachedPlan, Plan, PerSample, Strategy
from .cost import Auto, CostModel, default_cost_model
from .rules import register_batching_rule
from .optim import FusedAdaGrad

__all__ = ['DynBatchBlock', 'batching', 'concat_rows', 'current_scope', 'stats', 'reset_stats',
           'DynBatchError', 'InputError', 'LazyValueError', 'ScopeError', 'PerSampleWarning',
           'FreedGraphWarning', 'StatefulBlockWarning', 'ManySignaturesWarning', 'LazyValue',
           'Plan', 'BatchStep', 'Strategy', 'PerSample', 'ByDepth', 'Agenda', 'CachedPlan',
           'Auto', 'CostModel', 'default_cost_model', 'STRATEGIES',
           'register_batching_rule', 'FusedAdaGrad']
