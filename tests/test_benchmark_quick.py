"""Smoke test of the Tree-LSTM benchmark harness: ``--quick`` runs end to end,
checks that every form computes the same thing, and writes its results.

Speeds are not asserted (CI machines vary); only that every form produced a
positive, finite throughput in every setting of the quick run.
"""
import json
import math
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, 'benchmarks', 'bench_treelstm.py')


from helpers import sick_available as _sick_available


@pytest.mark.skipif(not _sick_available(), reason='SICK data not found (see '
                    'gluon_dynbatch.data.sick.find_sick_dir)')
def test_quick_benchmark(tmp_path):
    proc = subprocess.run([sys.executable, SCRIPT, '--quick', '--out', str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, 'benchmark failed:\n%s\n%s' % (proc.stdout[-4000:],
                                                                 proc.stderr[-4000:])

    with open(tmp_path / 'results.json') as f:
        res = json.load(f)
    assert res['equivalence']['passed'], res['equivalence']['failures']
    assert not res['equivalence']['failures']

    import gluon_dynbatch as dyb
    expected = {'per-sample', 'per-sample-hybrid'}
    expected |= {'dynbatch-' + s for s in dyb.STRATEGIES}
    if os.path.exists(os.path.join(ROOT, 'benchmarks', 'handbatched.py')):
        expected.add('hand-batched')
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

    for key in ('threads', 'engine', 'LD_PRELOAD', 'allocator'):
        assert key in res['config']
    assert res['limit']['pairs_per_s']['infer'] > 0
    assert (tmp_path / 'throughput.png').stat().st_size > 0


@pytest.mark.skipif(not _sick_available(), reason='SICK data not found (see '
                    'gluon_dynbatch.data.sick.find_sick_dir)')
def test_ab_revision_runs_against_head():
    """The in-process A/B tool loads a git revision beside the working tree
    and reports a speed-up per setting (HEAD against itself here)."""
    proc = subprocess.run([sys.executable, os.path.join(ROOT, 'benchmarks', 'ab_revision.py'),
                           '--rev', 'HEAD', '--settings', 'infer 4', 'train 4',
                           '--repeats', '1', '--pairs', '8'],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = [line for line in proc.stdout.splitlines() if 'speed-up' in line]
    assert [line.split()[:2] for line in lines] == [['infer', '4'], ['train', '4']]
    assert all(float(line.split()[-1]) > 0 for line in lines)
