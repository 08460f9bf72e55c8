"""Sphinx configuration for gluon_dynbatch.

Builds offline (no intersphinx, builtin theme) and without the SICK data:
importing the package never reads it.  Two small include files are written
into ``_generated/`` at configuration time:

* ``rules_table.inc`` - the operators that have batching rules, read from
  :data:`gluon_dynbatch.rules.RULES`, so the list never goes stale;
* ``tradeoff.inc`` - the measured trade-off figure if
  ``_static/tradeoff.png`` exists (made by ``python benchmarks/tradeoff.py``),
  else a note saying where it will come from;
* ``throughput.inc`` - the Tree-LSTM throughput table of the last
  ``python benchmarks/bench_treelstm.py`` run, read from
  ``benchmarks/results/results.json`` (built by the benchmark's own
  ``throughput_rows``, the rows of its ``results.md``).
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

import gluon_dynbatch  # noqa: E402
from gluon_dynbatch import rules as _rules  # noqa: E402

# -- Project -----------------------------------------------------------------

project = 'gluon_dynbatch'
author = 'gluon_dynbatch maintainers'
copyright = '2026, gluon_dynbatch maintainers'  # pylint: disable=redefined-builtin
version = gluon_dynbatch.__version__
release = gluon_dynbatch.__version__

# -- General -----------------------------------------------------------------

extensions = [
    'sphinx.ext.autodoc',
    'sphinx.ext.napoleon',
    'sphinx.ext.viewcode',
]
source_suffix = {'.rst': 'restructuredtext'}
master_doc = 'index'
exclude_patterns = ['_build', '_generated', 'Thumbs.db', '.DS_Store']
templates_path = []
default_role = 'literal'
pygments_style = 'sphinx'

# numpydoc-style docstrings through napoleon
napoleon_google_docstring = False
napoleon_numpy_docstring = True
napoleon_use_ivar = True
napoleon_use_rtype = False

autodoc_member_order = 'bysource'
autodoc_typehints = 'signature'   # types in prose come from the numpydoc sections
# Document the package's own docstrings only, not those inherited from Gluon
# (``forward``, ``collect_params``, ... of mxnet.gluon.Block).
autodoc_inherit_docstrings = False
autodoc_default_options = {'show-inheritance': True}

# -- HTML --------------------------------------------------------------------

html_theme = 'alabaster'
html_title = 'gluon_dynbatch %s' % release
html_static_path = ['_static'] if os.path.isdir(os.path.join(HERE, '_static')) else []
html_theme_options = {
    'description': 'Just-in-time dynamic batching for MXNet Gluon',
    'fixed_sidebar': True,
}

# -- Generated include files ---------------------------------------------------

GENERATED = os.path.join(HERE, '_generated')

# What each rule helper of gluon_dynbatch/rules.py means, for helpers without
# a docstring; rules with a docstring use its first sentence.
_RULE_TEXT = {
    '_broadcast': 'Broadcasting: every batched input has the full rank, and no shared '
                  'input of full rank has a leading dimension other than 1 (it would be '
                  'broadcast over the batch).',
    '_layer_norm': 'Refuses a normalisation axis that is the batch axis; needs batched data '
                   'and shared gamma/beta.',
    '_reshape': 'Keeps the batch axis: target shape starting with ``0``, or with ``-1`` '
                'followed by positive sizes; no ``reverse``.',
    '_transpose': 'The permutation keeps axis 0 first.',
    '_dot': 'Batched, untransposed left operand and shared right operand.',
    '_take': 'Batched data with shared indices along an axis other than 0, or shared data '
             'indexed by batched indices along axis 0 (an embedding lookup).',
}


def _first_sentence(text):
    text = ' '.join(text.split())
    end = text.find('. ')
    return text if end < 0 else text[:end + 1]


def _describe_rule(rule):
    """One line saying what ``rule`` accepts."""
    name = rule.__name__
    if rule.__closure__ and 'key' in rule.__code__.co_freevars:
        cells = dict(zip(rule.__code__.co_freevars,
                         (c.cell_contents for c in rule.__closure__)))
        key, default = cells['key'], cells.get('default')
        text = 'Attribute ``%s`` does not name axis 0' % key
        if default is None:
            text += ' (left unset it means every axis, so it is refused)'
        else:
            text += ' (default ``%r``)' % (default,)
        call = '_axis_rule(%r, %r' % (key, default)
        if cells.get('need_all_batched'):
            text += ', and every input is batched'
            call += ', need_all_batched=True'
        return text + '.', call + ')'
    if name in _RULE_TEXT:
        return _RULE_TEXT[name], name
    if rule.__doc__:
        return _first_sentence(rule.__doc__), name
    return 'See ``%s`` in ``gluon_dynbatch/rules.py``.' % name, name


def _write_rules_table():
    groups = {}
    for op_name, rule in _rules.RULES.items():
        groups.setdefault(id(rule), (rule, []))[1].append(op_name)
    lines = [
        '.. This file is generated by docs/conf.py from gluon_dynbatch.rules.RULES.',
        '',
        '%d operators have a batching rule, grouped here by the rule they share.' % len(
            _rules.RULES),
        '',
        '.. list-table::',
        '   :header-rows: 1',
        '   :widths: 45 55',
        '',
        '   * - Operators',
        '     - Batch-safe when',
    ]
    for rule, ops in sorted(groups.values(), key=lambda item: -len(item[1])):
        text, name = _describe_rule(rule)
        lines.append('   * - %s' % ', '.join('``%s``' % op for op in sorted(ops)))
        lines.append('     - %s (``%s``)' % (text, name))
    lines.append('')
    _write(os.path.join(GENERATED, 'rules_table.inc'), '\n'.join(lines))


def _write_tradeoff():
    if os.path.isfile(os.path.join(HERE, '_static', 'tradeoff.png')):
        text = '''\
.. figure:: /_static/tradeoff.png
   :alt: Analysis time against run time of each strategy
   :width: 100%

   Measured trade-off between analysis time and run time of each strategy
   (produced by ``python benchmarks/tradeoff.py``).
'''
    else:
        text = '''\
.. note::

   The figure for this section is produced by ``python benchmarks/tradeoff.py``
   and will be included here (as ``docs/_static/tradeoff.png``) once the
   benchmark has been run.
'''
    _write(os.path.join(GENERATED, 'tradeoff.inc'), text)


def _write_throughput():
    path = os.path.join(ROOT, 'benchmarks', 'results', 'results.json')
    if not os.path.isfile(path):
        _write(os.path.join(GENERATED, 'throughput.inc'), '''\
.. note::

   The table for this section is produced by ``python benchmarks/bench_treelstm.py``
   (``benchmarks/results/results.json``) and will be included here once the
   benchmark has been run.
''')
        return
    sys.path.insert(0, os.path.join(ROOT, 'benchmarks'))
    try:
        import bench_treelstm  # pylint: disable=import-outside-toplevel
    finally:
        sys.path.pop(0)
    import json  # pylint: disable=import-outside-toplevel
    with open(path) as f:
        result = json.load(f)
    rows = bench_treelstm.throughput_rows(result)
    lines = ['.. list-table:: Pairs/s, ``python benchmarks/bench_treelstm.py``.  %s'
             % bench_treelstm.caption(result).replace('*', r'\*'),
             '   :header-rows: 1', '   :stub-columns: 1', '']
    for row in rows:
        lines.append('   * - %s' % row[0])
        lines += ['     - %s' % cell.replace('*', r'\*') for cell in row[1:]]
    lines.append('')
    _write(os.path.join(GENERATED, 'throughput.inc'), '\n'.join(lines))


def _write(path, text):
    """Write only on change, so that Sphinx does not re-read every page."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    try:
        with open(path) as f:
            if f.read() == text:
                return
    except OSError:
        pass
    with open(path, 'w') as f:
        f.write(text)


_write_rules_table()
_write_tradeoff()
_write_throughput()
