"""Smoke test of the Tree-LSTM benchmark harness: ``--quick`` runs end to end,
checks that every form computes the same thing, and writes its results.

Speeds are not asserted (CI machines vary); only that every form produced a
positive, finite throughput in every setting of the quick run.
"""
import importlib
import json
import math
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

from helpers import ROOT, needs_sick, run_benchmark


@needs_sick
def test_quick_benchmark(tmp_path):
    run_benchmark('bench_treelstm.py', '--quick', '--out', tmp_path)

    with open(tmp_path / 'results.json') as f:
        res = json.load(f)
    assert res['equivalence']['passed'], res['equivalence']['failures']
    assert not res['equivalence']['failures']

    import gluon_dynbatch as dyb
    expected = {'per-sample', 'per-sample-hybrid'}
    expected |= {'dynbatch-' + s for s in dyb.STRATEGIES}
    if os.path.exists(os.path.join(ROOT, 'benchmarks', 'handbatched.py')):
        expected |= {'hand-batched', 'hand-batched-unique'}
    forms = set(res['forms'])
    assert expected <= forms, 'missing forms: %s' % (expected - forms)
    # every compared form was checked against the per-sample reference
    assert forms - {'per-sample'} <= set(res['equivalence']['forms'])

    settings = [s['name'] for s in res['settings']]
    assert settings
    for form in forms:
        for name in settings:
            cell = res['results'][form][name]
            assert 'skipped' not in cell, (form, name, cell)
            rate = cell['pairs_per_s']
            assert math.isfinite(rate) and rate > 0, (form, name, rate)

    # each dynbatch cell's split has recording's wall cost beside its clock
    for form in forms:
        for name in settings if form.startswith('dynbatch-') else ():
            split = res['results'][form][name]['dynbatch_split']
            ms = split['ms_per_minibatch']
            assert ms['user_loop'] > 0 and ms['wall'] > 0, (form, name, ms)
            assert math.isfinite(ms['record_wall']), (form, name, ms)
            assert split['fraction_of_wall']['record_wall'] == ms['record_wall'] / ms['wall']

    for key in ('threads', 'engine', 'LD_PRELOAD', 'allocator'):
        assert key in res['config']
    assert res['limit']['pairs_per_s']['infer'] > 0
    assert (tmp_path / 'throughput.png').stat().st_size > 0
    table = (tmp_path / 'results.md').read_text()
    bench = _bench_module()
    for row in bench.throughput_rows(res):
        assert '| ' + ' | '.join(row) + ' |' in table


def _bench_module(name='bench_treelstm'):
    """``benchmarks/<name>.py`` imported (the scripts import MXNet only in
    ``main``, after setting its engine and threads)."""
    sys.path.insert(0, os.path.join(ROOT, 'benchmarks'))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.pop(0)


def test_throughput_table_rows():
    """The README / docs table: one row per form with its readable label,
    pairs/s per setting ('*' where a per-sample form stopped at the time
    budget, '-' where skipped), then the GEMM limit of each setting's mode."""
    bench = _bench_module()
    result = {
        'settings': [{'name': 'infer B=1'}, {'name': 'train B=25'}],
        'results': {
            'per-sample-hybrid': {'infer B=1': {'pairs_per_s': 363.4},
                                  'train B=25': {'pairs_per_s': 26.2, 'partial': True}},
            'dynbatch-auto': {'infer B=1': {'pairs_per_s': 1551.2},
                              'train B=25': {'skipped': 'too slow'}},
        },
        'limit': {'pairs_per_s': {'infer': 9582.0, 'train': 3194.0}},
        'config': {'cpu': 'x', 'cores_available': 2, 'mxnet': '1.9.1', 'engine': 'NaiveEngine',
                   'threads': 1, 'allocator': 'glibc'},
        'model': {'embedding_grad': 'dense', 'optimizer': 'fusedadagrad lr 0.05'},
        'timing': {'statistic': 'median'}, 'elapsed_s': 12.0,
    }
    assert bench.throughput_rows(result) == [
        ['form', 'infer B=1', 'train B=25'],
        ['per-sample, hybridized', '363', '26*'],
        ['gluon_dynbatch auto', '1,551', '-'],
        ['GEMM-bound limit', '9,582', '3,194'],
    ]
    md = bench.markdown_table(result)
    assert '|---|---:|---:|' in md and '| gluon_dynbatch auto | 1,551 | - |' in md
    assert 'NaiveEngine' in md.splitlines()[0]


def test_gemm_limit_with_i2h_per_distinct_token():
    """The tighter limit counts i2h once per distinct token of a minibatch
    (mean over the split's consecutive minibatches; the first one for a
    'same' setting); its table row follows the every-node one."""
    bench = _bench_module()
    ids = [np.array(v, np.float32) for v in ([1, 2], [2, 3], [1, 1], [4, 4])]
    items = [(ids[0], None, ids[1], None), (ids[2], None, ids[3], None)]
    assert bench.distinct_tokens_per_pair(items, 1) == 2.5     # {1,2,3}, {1,4}
    assert bench.distinct_tokens_per_pair(items, 2) == 2.0     # {1,2,3,4} over 2 pairs
    assert bench.distinct_tokens_per_pair(items, 8) == 0.5     # 4 tokens over 8 pairs, repeated
    assert bench.distinct_tokens_per_pair(items, 1, same=True) == 3.0   # the first pair's
    limit = {'pairs_per_s': {'infer': 100.0, 'train': 30.0},
             'per_setting': {'infer B=1': {'pairs_per_s': 250.0},
                             'train B=25': {'pairs_per_s': 90.0}}}
    assert bench.limit_of(limit, 'train B=25') == 30.0
    assert bench.limit_of(limit, 'train B=25', distinct=True) == 90.0
    result = {'settings': [{'name': 'infer B=1'}, {'name': 'train B=25'}],
              'results': {}, 'limit': limit}
    assert bench.throughput_rows(result)[-2:] == [
        ['GEMM-bound limit', '100', '30'],
        ['GEMM-bound limit, i2h once per distinct token', '250', '90']]


@needs_sick
def test_ab_revision_runs_against_head():
    """The in-process A/B tool loads a git revision beside the working tree
    and reports a speed-up per setting (HEAD against itself here)."""
    proc = run_benchmark('ab_revision.py', '--rev', 'HEAD', '--settings', 'infer 4', 'train 4',
                         '--repeats', '1', '--pairs', '8')
    lines = [line for line in proc.stdout.splitlines() if 'speed-up' in line]
    assert [line.split()[:2] for line in lines] == [['infer', '4'], ['train', '4']]
    assert all(float(line.split()[-1]) > 0 for line in lines)


@needs_sick
def test_pipeline_benchmark_runs_and_pipelines(tmp_path):
    """``bench_pipeline.py`` on tiny settings: every form timed, and the
    pipelined forms really flushed several times a minibatch."""
    proc = run_benchmark('bench_pipeline.py', '--repeats', '1', '--settings', 'infer 8',
                         'train 4', '--every', '40', '--out', tmp_path)
    assert 'engine ThreadedEnginePerDevice, OMP_NUM_THREADS 1' in proc.stdout
    with open(tmp_path / 'pipeline.json') as f:
        res = json.load(f)
    assert [(r['mode'], r['batch_size']) for r in res['results']] == [('infer', 8), ('train', 4)]
    for row in res['results']:
        assert set(row['pairs_per_s']) == {'one flush', 'one flush (again)', 'every 40', 'auto'}
        assert all(math.isfinite(v) and v > 0 for v in row['pairs_per_s'].values())
        flushes = row['flushes_per_minibatch']
        # 'auto' (the default) follows the engine: a minibatch this small is one part
        assert flushes['one flush'] == flushes['one flush (again)'] == flushes['auto'] == 1
        assert flushes['every 40'] >= 2


@needs_sick
def test_arithmetic_benchmark_runs(tmp_path):
    """``bench_arithmetic.py`` on a tiny setting: its forms agree (it exits
    otherwise) and each is timed."""
    proc = run_benchmark('bench_arithmetic.py', '--repeats', '1', '--sizes', '4',
                         '--hidden', '8', '--out', tmp_path)
    assert 'engine NaiveEngine, OMP_NUM_THREADS 1, hidden 8' in proc.stdout
    with open(tmp_path / 'arithmetic.json') as f:
        (row,) = json.load(f)['results']
    assert row['batch_size'] == 4 and len(row['pairs_per_s']) == 3
    assert all(math.isfinite(v) and v > 0 for v in row['pairs_per_s'].values())


def test_paired_ratio_takes_the_ratio_turn_by_turn():
    """Ratios between forms: the median of their ratios within each turn
    (a slow turn slows both), else the ratio of their medians."""
    bench = _bench_module()
    ours = {'pairs_per_s': 200.0, 'pairs_per_s_repeats': [100.0, 200.0, 400.0]}
    theirs = {'pairs_per_s': 200.0, 'pairs_per_s_repeats': [50.0, 400.0, 200.0]}
    assert bench.paired_ratio(ours, theirs) == 2.0          # 2, 0.5, 2
    unpaired = {'pairs_per_s': 100.0, 'pairs_per_s_repeats': [100.0]}
    assert bench.paired_ratio(ours, unpaired) == 2.0        # 200 / 100
    assert bench.paired_ratio(ours, None) is None
    assert bench.paired_ratio(ours, {'skipped': 'too slow'}) is None


@needs_sick
def test_quick_transformer_benchmark(tmp_path):
    """``bench_transformer.py --quick``: every form agreed with per-sample and
    the wrapped transformer layer batched (else it exits 2), and every form
    has a positive rate in every setting."""
    proc = run_benchmark('bench_transformer.py', '--quick', '--out', tmp_path)
    assert 'dynbatch batches' in proc.stdout
    for name in ('transformer.json', 'transformer.md'):
        assert 'wrote %s' % (tmp_path / name) in proc.stdout
    res = json.loads((tmp_path / 'transformer.json').read_text())
    assert set(res['results']) == {'infer B=4', 'train B=4'}
    for name, forms in res['results'].items():
        assert set(forms) == {'per-sample', 'per-sample-hybrid', 'padded', 'by-length',
                              'dynbatch-pad-lists', 'dynbatch-buckets', 'dynbatch'}, name
        for form, rates in forms.items():
            assert rates and all(math.isfinite(r) and r > 0 for r in rates), (name, form)
    assert '| dynbatch / padded |' in (tmp_path / 'transformer.md').read_text()


def test_quick_graph_benchmark(tmp_path):
    """``bench_graph.py --quick`` (no data set needed): every form agreed
    with per-sample and no dynbatch signature ran per sample (else it
    exits 2), and every form has a positive rate in every setting."""
    proc = run_benchmark('bench_graph.py', '--quick', '--out', tmp_path)
    assert 'dynbatch batches' in proc.stdout
    for name in ('graph.json', 'graph.md'):
        assert 'wrote %s' % (tmp_path / name) in proc.stdout
    res = json.loads((tmp_path / 'graph.json').read_text())
    assert set(res['results']) == {'infer B=4', 'train B=4'}
    for name, forms in res['results'].items():
        assert set(forms) == {'per-sample', 'hand-batched', 'dynbatch',
                              'dynbatch-typed-lists'}, name
        for form, rates in forms.items():
            assert rates and all(math.isfinite(r) and r > 0 for r in rates), (name, form)
    assert '| dynbatch / hand-batched |' in (tmp_path / 'graph.md').read_text()
    # (its tables read like results: a user's trial took them for some)
    assert 'a smoke run, not a measurement' in (tmp_path / 'graph.md').read_text()
    assert 'not a measurement' in res['note'] and 'not a measurement' in proc.stdout


@needs_sick
def test_quick_cells_benchmark(tmp_path):
    """``bench_cells.py --quick``: every form agreed with per-sample (else it
    exits 2), has a positive rate in every setting, and the dynbatch forms
    ran what they say: the cells' own slow ops (both cut their gates by
    SliceChannel; LSTMCell also applies sigmoid and tanh ops), the fast
    forms, and the fused layer per sentence as one RNN op a step."""
    proc = run_benchmark('bench_cells.py', '--quick', '--out', tmp_path)
    for name in ('cells.json', 'cells.md'):     # it says where each file went
        assert 'wrote %s' % (tmp_path / name) in proc.stdout
    res = json.loads((tmp_path / 'cells.json').read_text())
    assert set(res['results']) == {'LSTMCell', 'GRUCell'}
    assert res['config']['processes'] == 'one per cell'     # merged from two processes
    for cell, settings in res['results'].items():
        assert set(settings) == {'infer B=4', 'train B=4'}
        for name, forms in settings.items():
            assert len(forms) == 8, (cell, name, forms)
            for form, rates in forms.items():
                assert rates and all(math.isfinite(r) and r > 0 for r in rates), \
                    (cell, name, form, rates)
        ops = res['traced_ops'][cell]
        assert 'SliceChannel' in ops['dynbatch-slow-ops'], ops
        assert not {'SliceChannel', 'sigmoid', 'tanh'} & set(ops['dynbatch']), ops
        assert 'RNN' in ops['dynbatch-fused'], ops
        assert 'slice_axis' in ops['dynbatch']
    assert {'sigmoid', 'tanh'} <= set(res['traced_ops']['LSTMCell']['dynbatch-slow-ops'])
    assert '| dynbatch / padded-fused |' in (tmp_path / 'cells.md').read_text()


@needs_sick
@pytest.mark.skipif(shutil.which('g++') is None, reason='the probe compiles its kernels with g++')
def test_fused_gates_probe_runs_and_agrees(tmp_path):
    """``fused_gates.py --quick``: its kernels, compiled through MXNet's
    library API, compute what the native operators do, and it projects a
    saving per minibatch from the steps that ``auto`` ran."""
    proc = run_benchmark('fused_gates.py', '--quick', '--batch', '16', '--out', tmp_path)
    assert 'fused kernels would save' in proc.stdout
    with open(tmp_path / 'fused_gates.json') as f:
        res = json.load(f)
    assert len(res['minibatch_ms']) == 2 and res['at_most'] > 1.0
    for times in res['kernels_us'].values():
        for native, fused, diff in times.values():
            assert native > 0 and fused > 0 and diff < 1e-5


BAD_COMMAND_LINES = [
    # (script, arguments ('OUT': a scratch folder), what the error must say)
    ('bench_treelstm.py', ['--quick', '--forms', 'dynbatch-autoo', '--out', 'OUT'],
     'unknown form(s) dynbatch-autoo; available: per-sample, per-sample-hybrid'),
    # (checked before the sweep starts its children, each of which failed)
    ('bench_treelstm.py', ['--sweep-settings', '--forms', 'dynbatch-autoo', '--out', 'OUT'],
     'unknown form(s) dynbatch-autoo; available: per-sample, per-sample-hybrid'),
    ('bench_pipeline.py', ['--settings', 'infer', '--out', 'OUT'],
     "argument --settings: 'infer': write '<infer|train> <minibatch size>'"),
    ('bench_pipeline.py', ['--settings', 'infer 8', 'infer B=25', '--out', 'OUT'],
     "argument --settings: 'infer B=25': write '<infer|train> <minibatch size>'"),
    ('ab_revision.py', ['--rev', 'HEAD', '--settings', 'infer'],
     "argument --settings: 'infer': write '<infer|train|record> <minibatch size>'"),
    pytest.param('ab_revision.py', ['--rev', 'nosuchrev'],
                 "--rev: 'nosuchrev' is not a commit of the git repository",
                 marks=pytest.mark.skipif(shutil.which('git') is None or not os.path.exists(
                     os.path.join(ROOT, '.git')), reason='not a git checkout')),
    ('handbatched.py', ['--batch', '0', '--pairs', '10', '--repeats', '1'],
     "argument --batch: '0' is not a positive integer"),
    # numbers out of range: refused as read, not a hang (--workers 0, --budget nan), a
    # traceback or a check of nothing later
    ('bench_treelstm.py', ['--quick', '--workers', '0', '--out', 'OUT'],
     "argument --workers: '0' is not a positive integer"),
    ('bench_treelstm.py', ['--quick', '--workers', '-3', '--out', 'OUT'],
     "argument --workers: '-3' is not a positive integer"),
    ('bench_treelstm.py', ['--quick', '--budget', 'nan', '--out', 'OUT'],
     "argument --budget: 'nan' is not a positive finite number"),
    ('bench_treelstm.py', ['--quick', '--check-batches', '0', '--out', 'OUT'],
     "argument --check-batches: '0' is not a positive integer"),
    ('bench_treelstm.py', ['--quick', '--tol', '-1', '--out', 'OUT'],
     "argument --tol: '-1' is not a non-negative finite number"),
    ('bench_treelstm.py', ['--quick', '--tol', 'nan', '--out', 'OUT'],
     "argument --tol: 'nan' is not a non-negative finite number"),
    ('bench_treelstm.py', ['--quick', '--threads', '-1', '--out', 'OUT'],
     "argument --threads: '-1' is not a positive integer"),
    ('bench_treelstm.py', ['--quick', '--repeats', '0', '--out', 'OUT'],
     "argument --repeats: '0' is not a positive integer"),
    ('bench_treelstm.py', ['--quick', '--seed', '-1', '--out', 'OUT'],
     "argument --seed: '-1' is not an integer from 0 to 2147483647"),
    ('bench_treelstm.py', ['--quick', '--settings', 'infer B=0', '--out', 'OUT'],
     "argument --settings: unknown setting 'infer B=0': write 'infer B=<size>'"),
    ('bench_treelstm.py', ['--sweep-settings', '--sweep-rounds', '0', '--out', 'OUT'],
     "argument --sweep-rounds: '0' is not a positive integer"),
    ('handbatched.py', ['--hidden', '-1', '--pairs', '10', '--repeats', '1'],
     "argument --hidden: '-1' is not a positive integer"),
    ('handbatched.py', ['--batch', '25', '300', '--pairs', '100', '--repeats', '1'],
     'argument --batch: 300 is more than --pairs 100'),
    ('tradeoff.py', ['--quick', '--repeats', '-1', '--out', 'OUT'],
     "argument --repeats: '-1' is not a positive integer"),
    # (a --pairs 0 or -5 wrote an arity.json of zeros, by default over the published one)
    ('bench_arity.py', ['--pairs', '0', '--out', 'OUT'],
     "argument --pairs: '0' is not a positive integer"),
    ('bench_arity.py', ['--pairs', '-5', '--out', 'OUT'],
     "argument --pairs: '-5' is not a positive integer"),
    ('bench_pipeline.py', ['--repeats', '0', '--out', 'OUT'],
     "argument --repeats: '0' is not a positive integer"),
    ('bench_pipeline.py', ['--engine', 'Bogus', '--out', 'OUT'],
     "argument --engine: invalid choice: 'Bogus' (choose from 'NaiveEngine'"),
    ('bench_cells.py', ['--quick', '--budget', '-1', '--out', 'OUT'],
     "argument --budget: '-1' is not a positive finite number"),
    ('bench_transformer.py', ['--quick', '--repeats', '0', '--out', 'OUT'],
     "argument --repeats: '0' is not a positive integer"),
    ('bench_graph.py', ['--quick', '--budget', '0', '--out', 'OUT'],
     "argument --budget: '0' is not a positive finite number"),
    ('fused_gates.py', ['--quick', '--batch', '0', '--out', 'OUT'],
     "argument --batch: '0' is not a positive integer"),
    ('ab_revision.py', ['--rev', 'HEAD', '--repeats', '0'],
     "argument --repeats: '0' is not a positive integer"),
    ('profile_step.py', ['--top', '-3', '--out', 'OUT'],
     "argument --top: '-3' is not a positive integer"),
    ('bench_arithmetic.py', ['--sizes', '0', '--out', 'OUT'],
     "argument --sizes: '0' is not a positive integer"),
    # (checked once the data is loaded: the split's size)
    pytest.param('bench_arithmetic.py', ['--sizes', '25', '9999', '--out', 'OUT'],
                 'argument --sizes: 9999 is more than the 4927 pairs', marks=needs_sick),
    pytest.param('bench_treelstm.py', ['--quick', '--check-batches', '1000', '--out', 'OUT'],
                 '--check-batches 1000 x --check-pairs 8: more than the', marks=needs_sick),
]


@pytest.mark.parametrize('script, args, message', BAD_COMMAND_LINES,
                         ids=[' '.join([s] + a) for s, a, _ in
                              (getattr(line, 'values', line) for line in BAD_COMMAND_LINES)])
def test_bad_command_line_is_an_argparse_error(tmp_path, script, args, message):
    """A malformed flag ends the script at once with argparse's usage, exit
    status 2 and a message that says what is expected: not a traceback from
    deep in the run, nor an error after the data is loaded."""
    args = [str(tmp_path) if arg == 'OUT' else arg for arg in args]
    proc = subprocess.run([sys.executable, os.path.join(ROOT, 'benchmarks', script)] + args,
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, (proc.stdout[-2000:], proc.stderr[-2000:])
    assert 'Traceback' not in proc.stderr, proc.stderr[-2000:]
    assert 'usage: ' + script in proc.stderr
    assert message in proc.stderr, proc.stderr[-2000:]
    assert not any(tmp_path.iterdir())


def test_bench_treelstm_help_says_each_default_once():
    """``ArgumentDefaultsHelpFormatter`` appends '(default: ...)' to every
    help: one that states its own default (the full run's and --quick's)
    must not get a second, nor any option a bare '(default: None)'."""
    helps = re.split(r'\n  (?=-)', _bench_module().build_parser().format_help())
    assert len(helps) > 20
    for text in helps:
        assert text.count('(default') <= 1 and 'default: None' not in text, text


def test_form_names_are_the_forms_built():
    """``--forms`` is checked against :func:`form_names` before the data is
    loaded: it must name what :class:`Forms` builds, in its order, and a
    name that is neither is refused with the full list, not the filtered one."""
    import gluon_dynbatch as dyb
    bench = _bench_module()
    embedding = np.zeros((10, bench.EMBED), np.float32)
    assert list(bench.Forms(10, embedding, 0).forms) == bench.form_names(dyb)
    with pytest.raises(SystemExit, match=r"'dynbatch-autoo'.*'per-sample-hybrid'.*'dynbatch-auto'"):
        bench.Forms(10, embedding, 0, wanted=['dynbatch-autoo'])


def test_fused_gates_quick_leaves_the_published_results_alone():
    """``fused_gates.py --quick`` writes under ``results/quick/`` (git-ignored),
    as the other benchmarks' smoke runs do, not over ``results/fused_gates.json``;
    an explicit ``--out`` wins either way."""
    fused = _bench_module('fused_gates')
    results = os.path.join(ROOT, 'benchmarks', 'results')
    assert os.path.samefile(fused.parse_args([]).out, results)
    assert os.path.samefile(os.path.dirname(fused.parse_args(['--quick']).out), results)
    assert os.path.basename(fused.parse_args(['--quick']).out) == 'quick'
    assert fused.parse_args(['--quick', '--out', 'elsewhere']).out == 'elsewhere'


PROFILE_TABLE = """
operator
=================
Name                          Total Count        Time (ms)    Min Time (ms)    Max Time (ms)    Avg Time (ms)
----                          -----------        ---------    -------------    -------------    -------------
_backward_FullyConnected             1476         260.6070           0.0260           1.4550           0.1766
add_n                                3365         117.0960           0.0020           4.8280           0.0348

MXNET_C_API
=================
Name                          Total Count        Time (ms)    Min Time (ms)    Max Time (ms)    Avg Time (ms)
----                          -----------        ---------    -------------    -------------    -------------
MXAutogradBackwardEx                   80         377.7090           2.9160           9.7850           4.7214
MXNet C API Calls                   36040          34.6900           0.0010          36.0400          18.0190
"""


def test_profile_step_reads_every_row_of_mxnets_table():
    """The first row of each section is its largest: it must not be lost
    under the header (an early version dropped it), and names may hold
    spaces."""
    sys.path.insert(0, os.path.join(ROOT, 'benchmarks'))
    import profile_step
    sections = profile_step.profile_sections(PROFILE_TABLE)
    assert sections['operator'] == {'_backward_FullyConnected': (1476, 260.607),
                                    'add_n': (3365, 117.096)}
    assert sections['MXNET_C_API'] == {'MXAutogradBackwardEx': (80, 377.709),
                                       'MXNet C API Calls': (36040, 34.69)}


def test_profile_step_worker_timeline():
    """The worker's busy and idle time per minibatch, from a trace: the
    thread that ran the most operators, overlapping intervals counted once,
    frees and waits left out, the idle before its first operator apart."""
    sys.path.insert(0, os.path.join(ROOT, 'benchmarks'))
    import profile_step

    def op(tid, name, begin, end):
        return [{'cat': 'operator', 'ph': 'B', 'tid': tid, 'name': name, 'ts': begin},
                {'cat': 'operator', 'ph': 'E', 'tid': tid, 'name': name, 'ts': end}]

    mark = [{'ph': 'n', 'name': profile_step.MARKER, 'ts': ts}
            for ts in (0, 10000, 20000, 30000)]
    events = mark + op(1, 'ImperativeBulk', 4000, 7000) + op(1, 'FullyConnected', 6000, 9000) + \
        op(1, 'DeleteVariable', 500, 3500) + op(2, 'take', 0, 9000) + \
        op(1, 'take', 10000, 11000) + op(1, 'Concat', 13000, 20000) + \
        [{'cat': 'operator', 'ph': 'B', 'tid': 1, 'name': 'Concat', 'ts': 21000}] + \
        op(1, 'Concat', 22000, 23000) + \
        [{'cat': 'operator', 'ph': 'E', 'tid': 1, 'name': 'Concat', 'ts': 27000}]
    # span 1: busy 4-9 ms (5), idle 5, 4 of it first; span 2: busy 1 + 7, idle 2, none
    # first; span 3: busy 21-27 (6, one operator inside another of its name), idle 4, 1
    # first; the medians: busy 6, idle 4, first 1
    assert profile_step.worker_timeline(events) == {
        'busy': 6.0, 'idle': 4.0, 'idle_before_first_operator': 1.0}
    assert profile_step.worker_timeline(events[4:]) is None     # no markers


@needs_sick
def test_profile_step_runs(tmp_path):
    proc = run_benchmark('profile_step.py', '--setting', 'train 8', '--minibatches', 2,
                         '--out', tmp_path)
    with open(tmp_path / 'profile_train_8_dynbatch-auto.json') as f:
        res = json.load(f)
    timed, profiled = res['timed'], res['profiled']
    assert res['minibatches'] == 2 and timed['wall_ms'] > 0
    # the named parts of the Python thread's time leave little unnamed
    assert abs(timed['python_ms']['rest (between the parts)']) < 0.1 * timed['wall_ms'], timed
    assert timed['python_ms']['backward() call'] > 0
    # a training step's operators include the backward pass
    assert profiled['operators']['FullyConnected']['calls'] > 0
    assert profiled['operators']['_backward_FullyConnected']['calls'] > 0
    assert 'MXAutogradBackwardEx' in profiled['python_waits_in_ms']
    # array frees are the engine's bookkeeping, counted apart from the operators
    ops = profiled['operators']
    assert math.isclose(profiled['operator_calls'] + profiled['bookkeeping_calls'],
                        sum(row['calls'] for row in ops.values()))
    assert profiled['bookkeeping_calls'] >= ops['DeleteVariable']['calls'] > 0
    timeline = profiled['worker_timeline_ms']
    assert timeline['busy'] > 0 and timeline['idle'] >= timeline['idle_before_first_operator'] >= 0
    assert 'pass 2 (profiled)' in proc.stdout and "MXNet's worker (medians" in proc.stdout
