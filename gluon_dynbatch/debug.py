"""Counters per flush, and ``DYNBATCH_DEBUG`` printing.

``DYNBATCH_DEBUG=1`` prints one line per flush (nodes, steps, batch sizes,
record / analysis / run milliseconds, strategy); ``=2`` also prints the plan
and why any signature runs per sample.  ``0`` (or unset, empty, ``false``,
``no``, ``off``) prints nothing, ``true``, ``yes`` or ``on`` mean 1; any
other value (a negative number, a word) is warned about once and prints
nothing (:func:`debug_level`).  :func:`~gluon_dynbatch.stats`
returns the running totals and the last flush,
:func:`~gluon_dynbatch.reset_stats` clears them.
"""
import os
import sys
import warnings

from .errors import user_stacklevel

__all__ = ['stats', 'reset_stats', 'debug_level']

_TOTALS = {}
_LAST = {}


OFF = ('', 'false', 'no', 'off')
"""Values of ``DYNBATCH_DEBUG`` (any case, spaces around) that mean 0."""

ON = ('true', 'yes', 'on')
"""Values of ``DYNBATCH_DEBUG`` (any case, spaces around) that mean 1."""

_LEVELS = {}
"""``DYNBATCH_DEBUG`` values read so far -> their level (each flush asks;
a value that is no level is warned about once)."""


def debug_level():
    """``DYNBATCH_DEBUG`` as an int (see the module's docstring for the
    levels): 0 when unset or one of :data:`OFF`, 1 for one of :data:`ON`,
    else the number it holds.  A value that is none of these (a negative
    number, ``-1`` turned printing on; a word, any of which did) gives a
    warning, the first time it is read, and 0: whoever set it meant
    something the variable does not say, and guessing "on" printed a line
    at every flush of a run that had meant it off."""
    raw = os.environ.get('DYNBATCH_DEBUG', '0')
    level = _LEVELS.get(raw)
    if level is None:
        level = _LEVELS[raw] = _read_level(raw)
    return level


def _read_level(raw):
    value = raw.strip().lower()
    if value in OFF:
        return 0
    if value in ON:
        return 1
    try:
        level = int(value)
    except ValueError:
        level = -1
    if level >= 0:
        return level
    warnings.warn('DYNBATCH_DEBUG=%r is not a debug level, so nothing is printed: give 0 (or '
                  'false, no, off) for nothing, 1 (or true, yes, on) for a line per flush, '
                  '2 for the plan as well' % raw, UserWarning, stacklevel=user_stacklevel())
    return 0


def reset_stats():
    """Zero every counter."""
    _TOTALS.clear()
    _TOTALS.update(flushes=0, nodes=0, steps=0, record_ms=0.0, analyse_ms=0.0, compile_ms=0.0,
                   run_ms=0.0, per_sample_nodes=0, repeated_calls=0, choices={}, predicted_ms=0.0,
                   actual_ms=0.0, programs_built=0, padding_checks=0, padding_check_ms=0.0)
    _LAST.clear()


def stats():
    """Counters since the last :func:`~gluon_dynbatch.reset_stats`: totals,
    plus ``last``, the most recent flush (nodes, steps, batch_sizes, ``*_ms``, strategy).
    ``choices`` counts the flushes ``auto`` planned by each strategy;
    ``predicted_ms`` and ``actual_ms`` total those it decided by the cost
    model (not those under 32 nodes, nor chains of one block, see
    :class:`~gluon_dynbatch.Auto`).
    ``nodes`` counts the calls that ran; ``repeated_calls`` those that
    reused an earlier call's results instead (equal host arguments, see
    :meth:`~gluon_dynbatch.block.BatchingScope.record`); ``programs_built``
    the step programs (MXNet CachedOps) flushes built, a one-time cost of
    new shapes that their run times include; ``padding_checks`` and
    ``padding_check_ms`` the checks that padding a ``pad_lists`` block's
    lists is neutral (once per pair of list lengths a step mixes), a
    one-time cost that ``analyse_ms`` includes.  ``record_ms`` is the time
    inside the recorded calls; what a scope adds to the user's loop in wall
    time is larger (see the quickstart's *Counters*)."""
    out = dict(_TOTALS)
    out['choices'] = dict(_TOTALS['choices'])
    out['last'] = dict(_LAST)
    return out


def record_flush(plan, record_ms, analyse_ms, run_ms, extra=None, compile_ms=0.0, repeated=0,
                 built=0, checks=(0, 0.0)):
    sizes = plan.batch_sizes()
    per_sample = sum(n for n, step in zip(sizes, plan.steps) if not step.sig.batch_safe)
    _TOTALS['flushes'] += 1
    _TOTALS['nodes'] += sum(sizes)
    _TOTALS['steps'] += len(sizes)
    _TOTALS['record_ms'] += record_ms
    _TOTALS['analyse_ms'] += analyse_ms
    _TOTALS['compile_ms'] += compile_ms
    _TOTALS['run_ms'] += run_ms
    _TOTALS['per_sample_nodes'] += per_sample
    _TOTALS['repeated_calls'] += repeated
    _TOTALS['programs_built'] += built
    _TOTALS['padding_checks'] += checks[0]
    _TOTALS['padding_check_ms'] += checks[1]
    _LAST.clear()
    _LAST.update(nodes=sum(sizes), steps=len(sizes), batch_sizes=sizes, record_ms=record_ms,
                 analyse_ms=analyse_ms, compile_ms=compile_ms, run_ms=run_ms,
                 strategy=plan.strategy, per_sample_nodes=per_sample, repeated_calls=repeated,
                 programs_built=built, padding_checks=checks[0], padding_check_ms=checks[1])
    if extra:
        _LAST.update(extra)
        if 'choice' in extra:
            choices = _TOTALS['choices']
            choices[extra['choice']] = choices.get(extra['choice'], 0) + 1
            if 'predicted_ms' in extra:
                _TOTALS['predicted_ms'] += extra['predicted_ms']
                _TOTALS['actual_ms'] += analyse_ms + run_ms
    level = debug_level()
    if level:
        _print_flush(plan, sizes, level)


def _print_flush(plan, sizes, level):
    last = _LAST
    ordered = sorted(sizes)
    line = ('[dynbatch] flush: %d nodes%s -> %d steps (batch min/median/max %d/%d/%d), '
            'record %.2f ms, analyse %.2f ms, %srun %.2f ms, strategy %s'
            % (last['nodes'], ' (+%d merged calls)' % last['repeated_calls']
               if last['repeated_calls'] else '', last['steps'], ordered[0],
               ordered[len(ordered) // 2],
               ordered[-1], last['record_ms'], last['analyse_ms'],
               'compile %.2f ms, ' % last['compile_ms'] if last['compile_ms'] else '',
               last['run_ms'], last['strategy']))
    if last['programs_built']:      # a first flush of new shapes: its times include these
        line += ', %d new program%s built' % (last['programs_built'],
                                              's' if last['programs_built'] > 1 else '')
    if last['padding_checks']:      # new list lengths: the analysis includes these
        line += ', %d padding check%s (%.0f ms)' % (
            last['padding_checks'], 's' if last['padding_checks'] > 1 else '',
            last['padding_check_ms'])
    if 'predicted_ms' in last:
        # the prediction prices a warm run; building programs and checking
        # padding are one-time costs, included in the actual time
        one_time = ' and '.join(what for what, done in (
            ('building programs', last['programs_built']),
            ('padding checks', last['padding_checks'])) if done)
        one_time = ', including one-time ' + one_time if one_time else ''
        line += ' (auto chose %s: predicted %.2f ms, actual %.2f ms%s)' % (
            last['choice'], last['predicted_ms'], last['analyse_ms'] + last['run_ms'], one_time)
    print(line, file=sys.stderr)
    if level >= 2:
        print(plan, file=sys.stderr)
        seen = set()
        for step in plan.steps:
            if not step.sig.batch_safe and step.sig.sig_id not in seen:
                seen.add(step.sig.sig_id)
                print('[dynbatch] %s runs per sample: %s' % (step.sig.block.name,
                                                             step.sig.reason), file=sys.stderr)


reset_stats()
