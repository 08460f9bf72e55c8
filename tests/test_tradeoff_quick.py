"""Smoke test of the analysis-vs-batching trade-off benchmark
(``benchmarks/tradeoff.py --quick``): it runs end to end, every strategy ran on
every workload with positive times, and all strategies computed the same
outputs.  Speeds are not asserted (CI machines vary)."""
import json
import math

import pytest

from helpers import needs_sick, run_benchmark


@pytest.mark.integration
@needs_sick
def test_tradeoff_quick(tmp_path):
    proc = run_benchmark('tradeoff.py', '--quick', '--out', tmp_path)
    assert 'MXNET_ENGINE_TYPE=NaiveEngine' in proc.stdout
    assert 'OMP_NUM_THREADS=1' in proc.stdout

    with open(tmp_path / 'tradeoff.json') as f:
        res = json.load(f)

    import gluon_dynbatch as dyb
    expected = set(dyb.STRATEGIES) | {'plain'}
    assert expected <= set(res['strategies'])
    kinds = {w['kind'] for w in res['workloads']}
    assert {'sick', 'sick-repeat', 'synthetic'} <= kinds
    names = {w['name'] for w in res['workloads']}
    assert {'sick B=1', 'chains', 'bushy', 'dag', 'long chain', 'read each call',
            'layered dag', 'repeated small'} <= names

    for w in res['workloads']:
        cells = w['strategies']
        assert expected <= set(cells), (w['name'], expected - set(cells))
        for name in expected:
            cell = cells[name]
            assert 'skipped' not in cell, (w['name'], name, cell)
            total = cell['total_ms']
            assert math.isfinite(total) and total > 0, (w['name'], name, total)
            if name != 'plain':
                for key in ('record_ms', 'analyse_ms', 'run_ms'):
                    assert cell[key] >= 0, (w['name'], name, key, cell[key])
                assert cell['run_ms'] > 0 and cell['steps'] >= 1, (w['name'], name)
                assert cell['calls'] == w['nodes'], (w['name'], name)
                assert cell['nodes'] <= cell['calls'], (w['name'], name)
        # per-sample runs one call per step; batching strategies fewer,
        # except where nothing can batch
        assert cells['per-sample']['steps'] == cells['per-sample']['nodes']
        if w['name'] in ('long chain', 'read each call', 'repeated small'):
            assert cells['depth']['steps'] == cells['per-sample']['steps']
        else:
            assert cells['depth']['steps'] < cells['per-sample']['steps']
        eq = w['equivalence']
        assert eq['passed'], (w['name'], eq)
        assert set(eq['max_abs_diff']) | {eq['reference']} >= expected
        assert all(d <= 1e-4 for d in eq['max_abs_diff'].values()), (w['name'], eq)
        assert w['auto_over_best'] > 0
        assert set(cells['auto']['choices']) <= set(dyb.STRATEGIES) - {'auto'}

    over = res['cached_overhead']
    for name in ('infer', 'train'):
        cell = over[name]
        assert cell['plans'].startswith('cached'), (name, cell)   # the plan was replayed
        assert 0 < cell['record_ms'] + cell['analyse_ms'] < cell['total_ms'], (name, cell)
        assert 0 < cell['user_loop_frac'] < 1, (name, over)
        assert cell['body_ms'] > 0 and cell['user_loop_ms'] > 0, (name, cell)
        assert cell['frac_wall'] == pytest.approx(
            (cell['record_wall_ms'] + cell['analyse_ms']) / cell['total_ms']), (name, cell)
    assert over['train']['total_ms'] > over['infer']['total_ms']   # backward + update ran

    assert res['equivalence']['passed'], res['equivalence']['failures']
    assert res['acceptance']['auto_vs_plain_at_B1'] > 0
    assert isinstance(res['flags'], list)
    assert (tmp_path / 'tradeoff.png').stat().st_size > 0
