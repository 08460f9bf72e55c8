"""Cost model, cached plans and the automatic choice."""
import json
import statistics

import mxnet as mx
from mxnet import autograd
import numpy as np
import pytest
from mxnet.gluon import nn

import gluon_dynbatch as dyb
from gluon_dynbatch import accel
from gluon_dynbatch.cost import LEARN_RUNS
from gluon_dynbatch.lower import programs_built
from gluon_dynbatch.plan import count_groups_py, summarize
from gluon_dynbatch.models import ChildSumTreeLSTMCell

from helpers import DenseAddLists, assert_same, random_tree, run_both


def record_trees(cell, trees):
    def enc(t):
        ch = [enc(c) for c in t.children]
        return cell(mx.nd.ones((1, 3)), [h for h, _ in ch], [c for _, c in ch])
    return [enc(t)[0] for t in trees]


def test_calibration_is_short_and_sane():
    import time
    start = time.perf_counter()
    model = dyb.CostModel().calibrate()
    assert time.perf_counter() - start < 1.0
    assert model.step_us > 0 and model.row_us > 0
    assert model.step_us > model.row_us          # a step costs more than one more row
    assert set(model.analyse_us) == {'per-sample', 'depth', 'agenda', 'cached'}


def test_calibration_leaves_the_random_stream_alone():
    """The probe's block was initialised at random from MXNet's global
    generator, so opening the first 'auto' scope of a process moved a
    user's seeded stream (other Dropout masks, other initial weights)."""
    mx.random.seed(11)
    expected = mx.nd.random.uniform(shape=(4,)).asnumpy()
    mx.random.seed(11)
    dyb.CostModel().calibrate()
    np.testing.assert_array_equal(mx.nd.random.uniform(shape=(4,)).asnumpy(), expected)


def test_predictions_rank_strategies_as_expected():
    model = dyb.CostModel(step_us=200, row_us=5,
                          analyse_us={'per-sample': 0.2, 'depth': 1, 'agenda': 4, 'cached': 2})
    big = model.predict(5000, 40)
    total = {k: sum(v) for k, v in big.items()}
    assert min(total, key=total.get) == 'depth'
    assert total['per-sample'] > 10 * total['depth']
    one = model.predict(1, 1)
    assert abs(sum(one['per-sample']) - sum(one['depth'])) < 0.01
    with_cache = model.predict(5000, 40, cached_steps=40)
    assert sum(with_cache['cached']) < sum(with_cache['agenda'])


@pytest.mark.parametrize('args,kwargs,match', [
    (('5000', 40), {}, "n_nodes='5000'; give a whole number of calls >= 0"),
    ((5000, 40.5), {}, 'n_steps_by_depth=40.5; give a whole number of steps >= 0'),
    ((True, 1), {}, 'n_nodes=True'),
    ((-1, 1), {}, 'n_nodes=-1'),
    ((5000, 40), dict(cached_steps='40'), "cached_steps='40'; give a whole number of steps"),
    ((5000, 40), dict(groups=[((0, 'f'), 3)]), r"groups=\[\(\(0, 'f'\), 3\)\]; give a dict"),
    ((5000, 40), dict(groups={(0, 'f'): '3'}), r"groups holds \(0, 'f'\): '3'; give calls per "
                                               r"\(depth, family\)"),
    ((5000, 40), dict(groups={7: 3}), 'groups holds 7: 3'),
    ((5000, 40), dict(agenda_ratio='0.5'), "agenda_ratio must be a finite number >= 0, "
                                           "got '0.5'"),
    ((5000, 40), dict(agenda_ratio=float('nan')), 'agenda_ratio must be a finite number')])
def test_error_predict_arguments_named(args, kwargs, match):
    """A string was a raw TypeError (``can't multiply sequence by non-int
    of type 'float'``), or taken (found by a review)."""
    with pytest.raises(ValueError, match='CostModel.predict: ' + match):
        dyb.CostModel().predict(*args, **kwargs)


def test_predict_takes_numpy_counts():
    model = dyb.CostModel()
    groups = {(0, 'f'): 30, (1, 'f'): 10}
    expected = model.predict(40, 2, 2, groups, 0.5)
    assert model.predict(np.int64(40), np.int32(2), np.uint8(2),
                         {key: np.int64(n) for key, n in groups.items()},
                         np.float64(0.5)) == expected
    assert model.predict(40, 2, groups={}, agenda_ratio=1) == model.predict(40, 2)


def test_save_and_load_profile(tmp_path):
    model = dyb.CostModel(step_us=123, row_us=4.5)
    model.save(str(tmp_path / 'profile.json'))
    again = dyb.CostModel.load(str(tmp_path / 'profile.json'))
    assert again.to_dict() == model.to_dict()
    assert json.load(open(tmp_path / 'profile.json'))['step_us'] == 123


def test_partial_analysis_costs_keep_the_defaults_for_the_rest(tmp_path):
    """A model given some strategies' analysis costs (by hand or in a
    profile) keeps the defaults for the others: Auto's first flush of 32
    calls or more failed with a KeyError before."""
    from gluon_dynbatch.cost import ANALYSE_US
    model = dyb.CostModel(analyse_us={'depth': 0.3})
    assert model.analyse_us == dict(ANALYSE_US, depth=0.3)
    path = tmp_path / 'partial.json'
    path.write_text(json.dumps({'step_us': 100, 'analyse_us': {'agenda': 2}}))
    loaded = dyb.CostModel.load(str(path))
    assert loaded.analyse_us == dict(ANALYSE_US, agenda=2.0) and loaded.calibrated
    block = dyb.DynBatchBlock(nn.Dense(3, in_units=3))
    block.initialize()
    x = mx.nd.ones((1, 3))
    with dyb.batching(dyb.Auto(loaded)):
        outs = [block(x) for _ in range(40)]
    np.testing.assert_allclose(outs[-1].asnumpy(), block(x).asnumpy(), rtol=1e-6)


@pytest.mark.parametrize('text,match', [
    ('{"step_us": 1', 'not a saved profile'),
    ('[1, 2]', r'keys step_us.*; got an array \(\[1, 2\]\)'),
    ('{"speed": 3}', "unexpected key 'speed'; a saved profile holds some of the keys step_us"),
    ('{}', 'keys step_us'),        # no constant: it skipped the probe (found by a review)
    ('{"step_us": "fast"}', 'step_us must be a finite number'),
    ('{"analyse_us": {"greedy": 1}}', 'names no strategy'),
    # taken as 1, and as 300, before (found by a review)
    ('{"step_us": true}', 'step_us must be a finite number >= 0, got True'),
    ('{"analyse_us": {"depth": false}}', r"analyse_us\['depth'\] must be a finite number"),
    ('{"row_us": "300"}', "row_us must be a finite number >= 0, got '300'"),
])
def test_error_load_of_a_file_that_is_no_profile(tmp_path, text, match):
    path = tmp_path / 'bad.json'
    path.write_text(text)
    with pytest.raises(ValueError, match=r"CostModel.load\('.*bad.json'\).*" + match):
        dyb.CostModel.load(str(path))


@pytest.mark.parametrize('kwargs,match', [
    (dict(step_us=True), 'step_us must be a finite number >= 0, got True'),
    (dict(row_us=np.bool_(False)), 'row_us must be a finite number >= 0, got False'),
    (dict(agenda_ratio='1'), "agenda_ratio must be a finite number >= 0, got '1'"),
    (dict(analyse_us={'agenda': True}), r"analyse_us\['agenda'\] must be a finite number"),
    (dict(step_us=float('inf')), 'step_us must be a finite number >= 0, got inf')])
def test_error_cost_model_constants_must_be_numbers(kwargs, match):
    """A bool was taken as 1 and a string as the number it spells (found
    by a review); numpy's numbers still count."""
    with pytest.raises(ValueError, match='CostModel: ' + match):
        dyb.CostModel(**kwargs)
    model = dyb.CostModel(step_us=np.float32(200), row_us=np.int64(5), agenda_ratio=0)
    assert (model.step_us, model.row_us, model.agenda_ratio) == (200.0, 5.0, 0.0)
    assert type(model.step_us) is float
    with pytest.raises(ValueError, match='seconds must be a finite number >= 0, got True'):
        model.observe_analysis('depth', True, 500)


def test_error_load_names_an_unexpected_key_not_the_whole_profile(tmp_path):
    """A profile with one key this version does not know (a future
    version's "version") was refused with the whole dict in the message,
    the key not named (found by a review)."""
    saved = dict(dyb.CostModel(step_us=4321.5).to_dict(), version=2)
    path = tmp_path / 'bad.json'
    path.write_text(json.dumps(saved))
    with pytest.raises(ValueError, match=r"bad.json'\): unexpected key 'version'; ") as err:
        dyb.CostModel.load(str(path))
    # (the value as the dict printed it: pytest's folder, pytest-123, once held '123')
    assert 'analyse_us' not in str(err.value).split(';')[0] and '4321.5' not in str(err.value)
    path.write_text(json.dumps(dict(saved, family_step_us={})))
    with pytest.raises(ValueError, match="unexpected keys 'version', 'family_step_us'"):
        dyb.CostModel.load(str(path))


def test_every_saved_profile_loads_again(tmp_path):
    """A model that had learned from a negative analysis time saved a
    negative ``analyse_us`` that load() then refused (found by a review):
    observe_analysis refuses such a time, and save() refuses, naming it,
    any constant load() would, writing nothing."""
    model = dyb.CostModel()
    with pytest.raises(ValueError, match='seconds must be a finite number >= 0, got -1.0'):
        model.observe_analysis('depth', -1.0, 500)
    with pytest.raises(ValueError, match='seconds must be a finite number >= 0, got nan'):
        model.observe_analysis('depth', float('nan'), 500)
    model.observe_analysis('depth', np.float32(0.001), 500)     # learns, as a float
    assert model.analyse_us['depth'] == pytest.approx(0.8 + 0.2 * 2.0)
    path = tmp_path / 'profile.json'
    model.save(str(path))
    assert dyb.CostModel.load(str(path)).to_dict() == model.to_dict()
    model.analyse_us['depth'] = -399.2      # set by hand
    with pytest.raises(ValueError, match=r"save\('.*profile.json'\): not written.*"
                                         r"analyse_us\['depth'\] must be a finite number"):
        model.save(str(path))
    assert dyb.CostModel.load(str(path)).analyse_us['depth'] == pytest.approx(1.2)


def test_error_observe_analysis_of_an_unknown_strategy_names_it():
    """A bare KeyError: 'bogus' before (found by a review)."""
    with pytest.raises(ValueError, match=r"observe_analysis: no strategy 'bogus'; it learns "
                                         r"the analysis of agenda, cached, depth, per-sample"):
        dyb.CostModel().observe_analysis('bogus', 0.001, 500)


@pytest.mark.parametrize('kwargs,match', [
    (dict(rows=(1, 1)), r'rows=\(1, 1\); give two different batch sizes >= 1'),   # was 1/0
    (dict(rows=(1,)), r'rows=\(1,\); give two'),                   # was an IndexError
    (dict(rows=(0, 64)), r'rows=\(0, 64\)'),
    (dict(rows=(1, 64, 128)), r'rows=\(1, 64, 128\)'),
    (dict(rows=64), 'rows=64'),
    (dict(repeats=0), 'repeats=0; give a number of runs of each size >= 1'),   # IndexError
    (dict(repeats='5'), "repeats='5'")])
def test_error_calibrate_arguments_named_before_the_probe(kwargs, match):
    with pytest.raises(ValueError, match=r'CostModel.calibrate: ' + match):
        dyb.CostModel().calibrate(**kwargs)


def test_error_probe_every_below_one():
    with pytest.raises(ValueError, match='probe_every=0'):
        dyb.Auto(probe_every=0)


@pytest.mark.parametrize('kwargs,match', [
    (dict(model='depth'), "model='depth'; give a CostModel"),
    (dict(small='5'), "small='5'; give a whole number of calls >= 0"),
    (dict(memory=0), 'memory=0; give a whole number of summaries and kinds of graph >= 1'),
    (dict(cached_trials=-1), 'cached_trials=-1; give a whole number of runs >= 0'),
    (dict(explore_within=None), 'explore_within=None'),
    # counts taken silently before (found by a review)
    (dict(memory=1.5), 'memory=1.5; give a whole number'),
    (dict(memory=float('inf')), 'memory=inf; give a whole number'),
    (dict(memory=True), 'memory=True'),
    (dict(cached_trials=2.5), 'cached_trials=2.5; give a whole number of runs'),
    (dict(cached_trials=float('inf')), 'cached_trials=inf'),
    (dict(small=31.5), 'small=31.5; give a whole number of calls'),
    (dict(small=False), 'small=False'),
    (dict(probe_every=2.0), 'probe_every=2.0; give a whole number of flushes >= 1'),
    (dict(explore_within=True), 'explore_within=True'),
    (dict(explore_within=float('nan')), 'explore_within=nan'),
    (dict(explore_within=-0.1), r'explore_within=-0.1; give a fraction of the best '
                                r'prediction >= 0')])
def test_error_auto_arguments_named_when_built(kwargs, match):
    """A wrong argument is named when the strategy is made, not met at
    the first flush as an AttributeError (found by a review)."""
    with pytest.raises(ValueError, match='Auto: ' + match):
        dyb.Auto(**kwargs)


def test_auto_takes_its_documented_values():
    """Counts may be numpy integers (kept as ints); ``explore_within`` any
    real number >= 0, infinity included."""
    auto = dyb.Auto(model=dyb.CostModel(), probe_every=np.int64(3), memory=np.int32(8),
                    small=0, cached_trials=np.uint8(0), explore_within=float('inf'))
    assert (auto.probe_every, auto.memory, auto.small, auto.cached_trials) == (3, 8, 0, 0)
    assert all(type(value) is int for value in (auto.probe_every, auto.memory, auto.small,
                                                auto.cached_trials))
    assert dyb.Auto(explore_within=0).explore_within == 0
    assert dyb.Auto(explore_within=np.float32(0.2)).explore_within == np.float32(0.2)


def test_cached_plan_fallback_by_name_or_error():
    assert isinstance(dyb.CachedPlan(fallback='agenda').fallback, dyb.Agenda)
    assert isinstance(dyb.CachedPlan().fallback, dyb.ByDepth)
    with pytest.raises(ValueError, match="fallback='auto'; give None"):
        dyb.CachedPlan(fallback='auto')


@pytest.mark.parametrize('kwargs,match', [
    (dict(capacity=None), 'capacity=None; give a number of structures >= 1'),
    (dict(capacity='x'), "capacity='x'"),
    (dict(capacity=-1), 'capacity=-1'),
    (dict(capacity=0), 'capacity=0'),
    (dict(max_calls='1e6'), "max_calls='1e6'; give a number of calls >= 1"),
    (dict(compile_after=-1), r"compile_after=-1; give a number of hits \(float\('inf'\): "),
    (dict(compile_after=True), 'compile_after=True'),
    (dict(max_compiled=-5), 'max_compiled=-5; give a number of programs >= 0'),
    (dict(max_compiled=float('nan')), 'max_compiled=nan')])
def test_error_cached_plan_arguments_named_when_built(kwargs, match):
    """Only ``fallback`` was checked: ``capacity=None`` or ``'x'`` and
    ``max_calls='1e6'`` failed with a raw TypeError at a flush's second
    distinct structure, ``capacity=-1`` or ``compile_after=-1`` were taken
    silently (found by a review)."""
    with pytest.raises(ValueError, match='CachedPlan: ' + match):
        dyb.CachedPlan(**kwargs)


def test_cached_plan_bounds_take_numbers_and_infinity():
    block = dyb.DynBatchBlock(nn.Dense(4, in_units=4))
    block.initialize()
    x = mx.nd.ones((1, 4))
    cached = dyb.CachedPlan(capacity=np.int64(2), max_calls=1e6, compile_after=float('inf'),
                            max_compiled=0)
    for n in (2, 3, 4, 2, 2, 2):
        with dyb.batching(cached):
            outs = [block(block(x)) for _ in range(n)]
    assert len(cached.cache) == 2 and cached.hits == 2 and not cached.compiled
    np.testing.assert_allclose(outs[-1].asnumpy(), block(block(x)).asnumpy(), rtol=1e-6)
    # max_compiled=0 keeps no program, so none is built only to be dropped
    none_kept = dyb.CachedPlan(compile_after=1, max_compiled=0)
    dyb.reset_stats()
    for _ in range(3):
        with dyb.batching(none_kept):
            outs = [block(block(x)) for _ in range(3)]
    assert none_kept.hits == 2 and dyb.stats()['last']['strategy'] == 'cached'
    assert dyb.CachedPlan(compile_after=0).compile_after == 0   # (as 1: taken before the checks)
    assert dyb.stats()['compile_ms'] == 0


def test_recording_counts_what_depth_grouping_makes():
    """The counts behind the cost model's step estimate, kept while recording
    (Python) or counted at the flush (C), give depth grouping's groups."""
    cell = dyb.DynBatchBlock(ChildSumTreeLSTMCell(4, 3))
    cell.initialize()
    rng = np.random.RandomState(1)
    accel.enable(False)                 # the Python recorder: counts as it goes
    try:
        with dyb.batching('depth') as scope:
            record_trees(cell, [random_tree(rng, rng.randint(1, 15), 4) for _ in range(6)])
            nodes = list(scope.pending)
            kept = (scope.groups, scope.used, scope.unsafe)
            assert kept == count_groups_py(nodes)
            if accel.enable(True):
                assert accel.count_groups(nodes) == kept
    finally:
        accel.enable(True)
    recorded = summarize(nodes, kept)['depth_steps']
    last_root = {}      # roots are read by nothing: they wait for the deepest root
    for n in nodes:
        if not n.used:
            key = n.sig.group_key
            last_root[key] = max(last_root.get(key, 0), n.depth)
    families = len({(n.depth if n.used else last_root[n.sig.group_key], n.sig.group_key)
                    for n in nodes})
    assert recorded == summarize(nodes)['depth_steps'] == families
    assert len(dyb.ByDepth().plan(nodes).steps) >= families   # splits only add steps


def test_cached_plan_is_reused_for_equal_structures():
    cell = dyb.DynBatchBlock(ChildSumTreeLSTMCell(4, 3))
    cell.initialize()
    trees = [random_tree(np.random.RandomState(4), 12, 4) for _ in range(5)]
    cached = dyb.CachedPlan()
    outs = []
    for _ in range(3):
        with dyb.batching(cached):
            outs.append(record_trees(cell, trees))
        outs[-1] = [o.asnumpy() for o in outs[-1]]
    assert cached.misses == 1 and cached.hits == 2
    assert dyb.stats()['last']['strategy'] == 'cached'
    for again in outs[1:]:
        for a, b in zip(outs[0], again):
            np.testing.assert_allclose(a, b, rtol=1e-6)
    with dyb.batching(cached):                     # a different structure misses
        record_trees(cell, trees[:3])
    assert cached.misses == 2


def test_auto_reports_prediction_and_actual():
    block = dyb.DynBatchBlock(nn.Dense(3, in_units=3))
    block.initialize()
    dyb.reset_stats()
    for _ in range(3):
        with dyb.batching('auto'):
            xs = [block(mx.nd.ones((1, 3))) for _ in range(20)]
            [block(x) for x in xs]
    stats = dyb.stats()
    assert sum(stats['choices'].values()) == 3
    assert stats['last']['choice'] in ('depth', 'agenda', 'cached', 'per-sample')
    assert stats['predicted_ms'] > 0 and stats['actual_ms'] > 0
    assert stats['last']['steps'] <= 2           # 40 calls, two depths: batched


def test_auto_prefers_cached_plan_for_repeated_structures():
    auto = dyb.Auto(dyb.CostModel(step_us=200, row_us=5,
                                  analyse_us={'per-sample': 0.5, 'depth': 5, 'agenda': 20,
                                              'cached': 1}))
    block = dyb.DynBatchBlock(nn.Dense(3, in_units=3))
    block.initialize()
    for _ in range(4):
        with dyb.batching(auto):
            xs = [block(mx.nd.ones((1, 3))) for _ in range(30)]
            [block(block(x)) for x in xs]
    assert auto.choices.get('cached', 0) >= 1


def test_padded_groups_split_only_where_padding_costs_more_than_a_step():
    from gluon_dynbatch.plan import PADDING_COST, _split_buckets
    saved = dict(PADDING_COST)
    try:
        PADDING_COST.update(step_us=300.0, elem_us=1.0)
        # one very wide call among many narrow ones gets its own step; the two
        # close widths share one (a step costs more than the padding saved)
        assert _split_buckets([9, 11, 21], [100, 100, 1])[0] == [(0, 1), (2, 2)]
        # few calls: padding is cheaper than another step
        assert _split_buckets([3, 5, 21], [2, 3, 1]) == ([(0, 2)], 300.0 + 6 * 21)
        PADDING_COST.update(step_us=1e9)
        assert _split_buckets([3, 5, 21], [1000, 300, 1])[0] == [(0, 2)]
    finally:
        PADDING_COST.update(saved)


def test_cached_plan_recipes_follow_new_data_and_gradients():
    """A cached plan reruns its recorded gathers (recipes) on a flush of the
    same structure; host token ids and user NDArrays still come from the new
    flush, and values and gradients equal per-sample execution."""
    from gluon_dynbatch.models import TreeLSTMNode
    node = TreeLSTMNode(20, 6, 4)
    node.initialize(mx.init.Xavier())
    dnode = dyb.DynBatchBlock(node)
    head = dyb.DynBatchBlock(nn.Dense(2, in_units=4))
    head.initialize(mx.init.Xavier())
    params = dict(node.collect_params())
    params.update(head.collect_params())
    rng = np.random.RandomState(3)
    trees = [random_tree(rng, n, 4) for n in (1, 5, 9, 14)]

    def run(ids, scale, strategy):
        def enc(t):
            ch = [enc(c) for c in t.children]
            return dnode(ids[t.idx:t.idx + 1], [h for h, _ in ch], [c for _, c in ch])
        with autograd.record():
            if strategy is None:
                outs = [head(enc(t)[0]) * scale for t in trees]
            else:
                with dyb.batching(strategy, merge_repeats=False):
                    roots = [enc(t)[0] for t in trees]
                    outs = [head(r) for r in roots]
                outs = [o.data * scale for o in outs]
            loss = sum((o * o).sum() for o in outs)
        loss.backward()
        return ([o.asnumpy() for o in outs],
                {k: p.grad().asnumpy().copy() for k, p in params.items()})

    cached = dyb.CachedPlan()
    for flush in range(3):
        ids = rng.randint(0, 20, 20).astype(np.float32)
        scale = mx.nd.array([[1.0 + flush]])
        got, got_grads = run(ids, scale, cached)
        want, want_grads = run(ids, scale, None)
        for a, b in zip(got, want):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
        for k in want_grads:
            np.testing.assert_allclose(got_grads[k], want_grads[k], rtol=1e-4, atol=1e-6)
    assert cached.misses == 1 and cached.hits == 2
    entry, = cached.cache.values()
    recipes = entry.recipes
    assert all(r is not None for r in recipes)
    assert entry.program is None              # training replays its recipes, uncompiled
    assert dyb.stats()['last']['strategy'] == 'cached'
    assert any(part not in (None, 'host') for r in recipes for part in r)  # gathers reused


def small_tree_lstm(vocab, embed, seed, sizes):
    """A Tree-LSTM node (hidden size 4) wrapped in DynBatchBlock, a random
    state, random trees of ``sizes`` nodes (at most 3 children) and
    ``enc(tree, ids)``, the per-sample recursion over a tree."""
    from gluon_dynbatch.models import TreeLSTMNode
    node = TreeLSTMNode(vocab, embed, 4)
    node.initialize(mx.init.Xavier())
    dnode = dyb.DynBatchBlock(node)
    rng = np.random.RandomState(seed)
    trees = [random_tree(rng, n, 3) for n in sizes]

    def enc(t, ids):
        ch = [enc(c, ids) for c in t.children]
        return dnode(ids[t.idx:t.idx + 1], [h for h, _ in ch], [c for _, c in ch])
    return node, rng, trees, enc


def test_a_miss_runs_as_its_fallback_and_the_first_hit_learns_recipes():
    """A miss stores its plan but runs it as the fallback would (no
    recipes: the flush may share host parts and distinct rows); the first
    hit learns the recipes, and only then can the plan be compiled."""
    _, rng, trees, enc = small_tree_lstm(20, 6, 5, (3, 7, 12))
    cached = dyb.CachedPlan(compile_after=1)
    plans = []
    plan_with_cache = cached.plan
    cached.plan = lambda *args, **kwargs: plans.append(plan_with_cache(*args, **kwargs)) \
        or plans[-1]
    learned = []
    for _ in range(3):
        ids = rng.randint(0, 20, 12).astype(np.float32)
        with dyb.batching(cached, merge_repeats=False):
            got = [enc(t, ids)[0] for t in trees]
        want = [enc(t, ids)[0] for t in trees]
        for a, b in zip(got, want):
            np.testing.assert_allclose(a.asnumpy(), b.asnumpy(), rtol=1e-5, atol=1e-6)
        entry, = cached.cache.values()
        learned.append(sum(recipe is not None for recipe in entry.recipes))
    steps = len(entry.recipes)
    assert [plan.strategy for plan in plans] == ['cached-miss:depth', 'cached',
                                                 'cached-compiled']
    assert plans[0].recipes is None and plans[1].recipes is entry.recipes
    assert learned == [0, steps, steps]


@pytest.mark.parametrize('make', [lambda: dyb.CachedPlan(compile_after=1),
                                  lambda: dyb.Auto(model=dyb.CostModel())],
                         ids=['compiled cached plan', 'auto replaying small flushes'])
@pytest.mark.parametrize('train', [False, True])
def test_stored_plans_do_not_keep_dropped_blocks_alive(make, train):
    """The cached strategies live as long as the process (the shared
    ``'auto'`` and ``'cached'`` ones): a plan they stored held its
    signatures, so the blocks and parameters of a model the user dropped
    stayed in memory (found by a review).  They now hold signatures by
    weak reference, and a compiled program its parameters; the plans of a
    freed model are dropped at the next lookup (a second review: their
    keys never come back, and compiled programs hold device memory)."""
    import gc
    import weakref
    strategy = make()
    if not isinstance(strategy, dyb.CachedPlan) and accel.Tape is None:
        pytest.skip('auto replays small flushes by the structure key that only the C '
                    'recorder writes')
    cache = strategy if isinstance(strategy, dyb.CachedPlan) else strategy.replay
    kept = []

    def use_a_model():
        node, rng, trees, enc = small_tree_lstm(20, 6, 5, (3, 7))
        kept.append(node)
        for _ in range(4):
            ids = rng.randint(0, 20, 12).astype(np.float32)
            with autograd.record(train_mode=train) if train else autograd.pause():
                with dyb.batching(strategy, merge_repeats=False):
                    got = [enc(t, ids)[0] for t in trees]
                dyb.concat_rows(got).wait_to_read()
        return weakref.ref(node), weakref.ref(node.cell.i2h.weight)

    def freed(refs):
        kept.clear()
        gc.collect()
        return all(ref() is None for ref in refs)

    first = use_a_model()
    assert dyb.stats()['last']['strategy'] == \
        ('cached-compiled' if cache is strategy and not train else 'cached')
    assert len(cache.cache) == 1 and freed(first)
    second = use_a_model()      # the same structure, new blocks: the first plan is dropped
    assert len(cache.cache) == 1 and cache.calls == next(iter(cache.cache.values())).calls
    assert all(sig() is not None for sig, _, _ in next(iter(cache.cache.values())).steps)
    assert len(cache.compiled) == (0 if train or cache is not strategy else 1)
    assert freed(second)


def test_a_dropped_compiled_plan_replays_its_recipes_until_it_is_in_use_again():
    """More structures reused in turn than compiled programs are kept (a
    fixed evaluation split, minibatch after minibatch): each is compiled
    once, and once its program is dropped it replays its recipes instead
    of compiling again (recompiling every time ran ``auto`` at 0.5x
    ``depth``), with the same results, until it comes back within
    ``max_compiled`` hits of its last: then it is in use again."""
    _, rng, trees, enc = small_tree_lstm(20, 6, 7, (2, 5, 9, 4, 8))
    cached = dyb.CachedPlan(compile_after=1, max_compiled=1)
    compiles = []
    compile_plan = cached._compile
    cached._compile = lambda *args: compiles.append(args[0]) or compile_plan(*args)
    groups = [trees[:2], trees[2:]]             # two structures, one after the other
    ids = rng.randint(0, 20, 12).astype(np.float32)
    strategies = []
    for turn in range(10):
        group = groups[turn % 2 if turn < 8 else 0]
        with dyb.batching(cached):
            got = [enc(t, ids)[0] for t in group]
        strategies.append(dyb.stats()['last']['strategy'])
        want = [enc(t, ids)[0] for t in group]
        for a, b in zip(got, want):
            np.testing.assert_allclose(a.asnumpy(), b.asnumpy(), rtol=1e-5, atol=1e-6)
    assert strategies[:6] == ['cached-miss:depth'] * 2 + ['cached'] * 2 + \
        ['cached-compiled'] * 2
    assert strategies[6:8] == ['cached', 'cached-compiled']     # the first was dropped
    assert strategies[8:] == ['cached', 'cached-compiled']      # back at once: again
    assert len(compiles) == 3 and compiles[2] == compiles[0]
    assert sorted(entry.dropped for entry in cached.cache.values()) == [False, True]


def test_cached_plan_reads_new_user_arrays():
    """Arguments fed from user NDArrays have no recipe: a hit gathers them
    anew, so new values give new results."""
    cell = dyb.DynBatchBlock(ChildSumTreeLSTMCell(4, 3))
    cell.initialize()
    rng = np.random.RandomState(6)
    trees = [random_tree(rng, 8, 3) for _ in range(3)]
    cached = dyb.CachedPlan()

    def enc(t, xs):
        ch = [enc(c, xs) for c in t.children]
        return cell(xs[t.idx], [h for h, _ in ch], [c for _, c in ch])
    for _ in range(3):
        xs = [mx.nd.array(rng.uniform(-1, 1, (1, 3))) for _ in range(8)]
        with dyb.batching(cached):
            got = [enc(t, xs)[0] for t in trees]
        want = [enc(t, xs)[0] for t in trees]
        for a, b in zip(got, want):
            np.testing.assert_allclose(a.asnumpy(), b.asnumpy(), rtol=1e-5, atol=1e-6)
    assert cached.hits == 2


def test_compiled_plan_outputs_stay_valid_across_flushes():
    """A compiled plan (static memory, inference) gives every flush fresh
    outputs: values read after later flushes of the same structure match
    per-sample; and, replayed in training (never compiled there), so do
    gradients of several flushes recorded before one backward."""
    node, rng, trees, enc = small_tree_lstm(30, 5, 9, (2, 6, 11))
    cached = dyb.CachedPlan(compile_after=1)
    all_ids = [rng.randint(0, 30, 12).astype(np.float32) for _ in range(4)]
    kept = []
    for ids in all_ids:
        with dyb.batching(cached, merge_repeats=False):
            kept.append([enc(t, ids)[0] for t in trees])
    assert cached.hits == 3 and dyb.stats()['last']['strategy'] == 'cached-compiled'
    for roots, ids in zip(kept, all_ids):
        for value, tree in zip(roots, trees):
            np.testing.assert_allclose(value.asnumpy(), enc(tree, ids)[0].asnumpy(),
                                       rtol=1e-5, atol=1e-6)
    kept = []
    with autograd.record():
        for ids in all_ids:
            with dyb.batching(cached, merge_repeats=False):
                kept.append([enc(t, ids)[0] for t in trees])
        loss = sum((v.data * v.data).sum() for roots in kept for v in roots)
    loss.backward()
    got_grads = {k: p.grad().asnumpy().copy() for k, p in node.collect_params().items()}
    assert dyb.stats()['last']['strategy'] == 'cached'
    with autograd.record():
        want = [[enc(t, ids)[0] for t in trees] for ids in all_ids]
        loss = sum((v * v).sum() for roots in want for v in roots)
    loss.backward()
    for roots, refs in zip(kept, want):
        for a, b in zip(roots, refs):
            np.testing.assert_allclose(a.asnumpy(), b.asnumpy(), rtol=1e-5, atol=1e-6)
    for k, p in node.collect_params().items():
        np.testing.assert_allclose(got_grads[k], p.grad().asnumpy(), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize('hoist_rows', [0, float('inf')])
def test_compiled_plan_runs_host_parts_on_each_flushs_distinct_rows(hoist_rows, monkeypatch):
    """A compiled plan runs the node steps' shared host part (embedding and
    ``i2h``) once, inside its program, over the distinct ids of each flush,
    and a step alone with its host part (the leaves, or every step when
    steps do not share) on its own distinct ids: the number of distinct
    ids changes from flush to flush, and the results of every flush still
    equal per-sample.  (Plans are compiled for inference only.)"""
    monkeypatch.setattr(dyb.execute, 'HOIST_ROWS', hoist_rows)
    node, rng, trees, enc = small_tree_lstm(30, 5, 12, (9, 14, 20, 25))
    cached = dyb.CachedPlan(compile_after=1)
    plans = []
    plan_with_cache = cached.plan
    cached.plan = lambda *args, **kwargs: plans.append(plan_with_cache(*args, **kwargs)) \
        or plans[-1]
    distinct = set()
    for tokens in (3, 6, 10, 4, 30):            # few ids repeat often, many rarely
        ids = rng.randint(0, tokens, 25).astype(np.float32)
        distinct.add(len(np.unique(ids)))
        with dyb.batching(cached, merge_repeats=False):
            got = [enc(t, ids)[0] for t in trees]
        want = [enc(t, ids)[0] for t in trees]
        for a, b in zip(got, want):
            np.testing.assert_allclose(a.asnumpy(), b.asnumpy(), rtol=1e-5, atol=1e-6)
    assert len(distinct) == 5
    assert [plan.strategy for plan in plans][2:] == ['cached-compiled'] * 3
    entry, = cached.cache.values()
    members = [len(group) for group in entry.program.hoists]
    # node steps of every arity share one run; or, apart, each its own
    assert max(members) > 1 if hoist_rows == 0 else members and max(members) == 1


def test_narrowed_sources_gather_the_same_rows():
    """A compiled gather that takes the rows it reads out of large sources
    first, and drops sources it reads nothing of, gathers what the take
    from the whole concatenation gathers (lists too: a 2-d index)."""
    from gluon_dynbatch.lower import NARROW_ROWS, _narrow
    rng = np.random.RandomState(3)
    narrowed_some = dropped_some = False
    for trial in range(30):
        sizes = [int(rng.choice([1, 5, NARROW_ROWS, 3 * NARROW_ROWS])) for _ in range(4)]
        arrays = [mx.nd.array(rng.uniform(-1, 1, (n, 3))) for n in sizes]
        read = rng.choice(4, rng.randint(1, 4), replace=False)
        starts = np.concatenate([[0], np.cumsum(sizes)])
        positions = np.concatenate([starts[part] + rng.randint(0, sizes[part], rng.randint(1, 9))
                                    for part in read])
        rng.shuffle(positions)
        if trial % 2:
            positions = positions[:len(positions) // 2 * 2].reshape(-1, 2)
        if not positions.size:
            continue
        index = mx.nd.array(positions, dtype='int32')
        names = ['a%d' % part for part in range(4)]
        spec = {}
        sources, new_index = _narrow([mx.sym.var(n) for n in names], sizes, index, 'x', spec)
        narrowed_some |= bool(spec)
        dropped_some |= len(sources) < 4
        gather = mx.sym.take(sources[0] if len(sources) == 1 else
                             mx.sym.concat(*sources, dim=0), mx.sym.var('i'))
        feeds = dict(zip(names, arrays), i=new_index)
        feeds.update({key: value for key, (_, value) in spec.items()})
        got = gather.eval(ctx=mx.cpu(), **{k: v for k, v in feeds.items()
                                           if k in gather.list_inputs()})[0]
        want = mx.nd.take(mx.nd.concat(*arrays, dim=0), index)
        np.testing.assert_array_equal(got.asnumpy(), want.asnumpy())
    assert narrowed_some and dropped_some


def test_auto_replaces_a_stale_cached_plan(monkeypatch):
    """A plan stored while padded groups were split with a too-small step
    cost is re-planned on a probe sighting and replaced by the fresh plan
    when that has fewer steps; results stay right throughout.  (Ragged
    steps are off: with them a tiny step cost splits nothing.)"""
    from gluon_dynbatch import plan
    from gluon_dynbatch.plan import PADDING_COST
    monkeypatch.setattr(plan, 'RAGGED', False)
    cell = dyb.DynBatchBlock(ChildSumTreeLSTMCell(4, 3))
    cell.initialize()
    rng = np.random.RandomState(11)
    trees = [random_tree(rng, n, 6) for n in (30, 40, 50, 60)]
    want = [o.asnumpy() for o in record_trees(cell, trees)]
    model = dyb.CostModel()
    model.observe_steps = lambda plan, seconds, **_: None     # keep the step costs fixed
    auto = dyb.Auto(model=model, probe_every=4, small=1)
    auto.cached = dyb.CachedPlan()
    PADDING_COST['family_step_us'].clear()

    def flush():
        with dyb.batching(auto):
            got = record_trees(cell, trees)
        for a, b in zip(got, want):
            np.testing.assert_allclose(a.asnumpy(), b, rtol=1e-5, atol=1e-6)
    PADDING_COST['step_us'] = 0.001          # split every list length apart
    for _ in range(3):
        flush()
    (entry,) = auto.cached.cache.values()
    split_steps = len(entry.steps)
    PADDING_COST['step_us'] = 1e9            # now one step per depth is best
    for _ in range(4):
        flush()
    (entry,) = auto.cached.cache.values()
    assert len(entry.steps) < split_steps


def run_chains_counting_agenda(monkeypatch, lengths):
    """Flushes of 8 chains of a Dense block, the n-th flush of
    ``lengths[n]`` calls each, under an Auto that probes every 2nd flush;
    returns the Auto and the number of times agenda planned."""
    block = dyb.DynBatchBlock(nn.Dense(3, in_units=3))
    block.initialize()
    agenda = dyb.STRATEGIES['agenda']
    calls = []
    original = agenda.plan
    monkeypatch.setattr(agenda, 'plan', lambda nodes, summary=None:
                        calls.append(len(nodes)) or original(nodes, summary))
    # no exploration runs: equal chains make depth and agenda a near-tie
    auto = dyb.Auto(model=dyb.CostModel(), probe_every=2, small=1, explore_within=0)
    for length in lengths:
        with dyb.batching(auto):
            for _ in range(8):
                x = mx.nd.ones((1, 3))
                for _ in range(length):
                    x = block(x)
    return auto, len(calls)


def test_auto_probes_agenda_less_often_where_it_saves_nothing(monkeypatch):
    """Equal chains: agenda makes as many steps as depth, so after each probe
    the gap to the next doubles (16 probes at a fixed gap of 2 become 5).
    Each flush has longer chains: a structure seen before runs its cached
    plan, with no probe."""
    auto, probes = run_chains_counting_agenda(monkeypatch, range(2, 34))
    assert 'agenda' not in auto.choices and 'cached' not in auto.choices
    assert probes == 5


def test_auto_does_not_probe_a_structure_it_runs_cached(monkeypatch):
    """Twelve flushes of one structure: the first two by depth (the second
    stores the plan), four cached trials, one plain depth run to time it
    against them, then the faster; agenda is probed on the first only."""
    auto, probes = run_chains_counting_agenda(monkeypatch, [5] * 12)
    assert auto.choices['cached'] >= 4 and auto.choices['depth'] >= 3
    assert auto.choices['cached'] + auto.choices['depth'] == 12
    assert probes == 1          # the first flush of this kind of graph only


def test_auto_scales_run_predictions_by_what_it_measured(monkeypatch):
    """Per kind and size of graph, a strategy's run prediction is scaled by its
    measured / predicted run time (clipped to [0.5, 2], skipping flushes
    that built a step program); an unmeasured strategy gets the mean
    factor; a runner-up within 10% and never measured runs once."""
    auto = dyb.Auto(model=dyb.CostModel(), small=1)
    raw = {'depth': (1.0, 10.0), 'agenda': (3.0, 10.0), 'per-sample': (0.1, 100.0)}
    assert auto._corrected(raw, 'k') == raw
    auto._run_factors['k'] = {'depth': 0.5}
    assert auto._corrected(raw, 'k') == {'depth': (1.0, 5.0), 'agenda': (3.0, 5.0),
                                         'per-sample': (0.1, 50.0)}
    ranked = ['depth', 'agenda', 'per-sample']      # agenda 8.0 vs depth 6.0: not close,
    auto._explore(ranked, auto._corrected(raw, 'k'), 'k')
    assert ranked[0] == 'agenda'                    # but measured fewer than LEARN_RUNS times
    ranked = ['depth', 'agenda', 'per-sample']
    auto._run_ratios[('k', 'agenda')] = [1.0] * LEARN_RUNS     # measured enough: left alone
    auto._explore(ranked, auto._corrected(raw, 'k'), 'k')
    assert ranked[0] == 'depth'
    close = dict(raw, agenda=(1.5, 10.0))           # within 10%, never run: try it
    auto.explore_within = 0
    auto._explore(ranked, auto._corrected(close, 'k'), 'k')
    assert ranked[0] == 'depth'                     # unless exploring is turned off
    auto.explore_within = 0.1
    auto._explore(ranked, auto._corrected(close, 'k'), 'k')
    assert ranked[0] == 'agenda'
    ranked = ['depth', 'agenda', 'per-sample']
    auto._last_run[('k', 'agenda')] = auto._flushes            # it ran just now
    auto._explore(ranked, auto._corrected(close, 'k'), 'k')
    assert ranked[0] == 'depth'
    auto._flushes += auto.probe_every                           # and again after 16 flushes
    auto._explore(ranked, auto._corrected(close, 'k'), 'k')
    assert ranked[0] == 'agenda'

    auto._run_ratios.clear()                        # (the runs made up above)
    auto.last = {'sized': 'k', 'built': programs_built(), 'raw_run_ms': 10.0}
    auto._observe_run('agenda', 100.0)              # an outlier: clipped to 2
    assert auto._run_factors['k']['agenda'] == 2.0
    auto._observe_run('agenda', 5.0)                # the median of the runs so far
    assert auto._run_factors['k']['agenda'] == pytest.approx((2.0 + 0.5) / 2)
    auto._observe_run('agenda', 5.0)                # the outlier no longer counts
    assert auto._run_factors['k']['agenda'] == pytest.approx(0.5)
    for _ in range(5):
        auto._observe_run('agenda', 8.0)            # only the last five do
    auto._observe_run('agenda', 100.0)
    assert auto._run_factors['k']['agenda'] == pytest.approx(0.8)
    auto.last['built'] -= 1                         # a step program was built meanwhile
    auto._observe_run('depth', 50.0)
    assert auto._run_factors['k']['depth'] == 0.5


def test_depth_and_agenda_share_a_run_factor_where_agenda_saves_no_steps():
    """Where agenda makes depth's steps on a kind of graph, one run factor
    (the mean of theirs) prices both, so their analysis decides: two
    factors learned apart made noise choose agenda's equal plan (five
    times depth's analysis per node) at SICK minibatch 4.  Where agenda
    saves steps, each keeps its own."""
    auto = dyb.Auto(model=dyb.CostModel(), small=1)
    kind = frozenset({'family'})
    sized = (kind, 7)
    raw = {'depth': (0.1, 3.0), 'agenda': (0.4, 3.0), 'per-sample': (0.0, 30.0)}
    auto._run_factors[sized] = {'depth': 1.1, 'agenda': 0.9}    # agenda looks 0.6 ms faster
    auto._ratios[kind] = 1.0
    corrected = auto._corrected(raw, sized)
    assert corrected['depth'] == (0.1, pytest.approx(3.0))
    assert corrected['agenda'] == (0.4, pytest.approx(3.0))
    assert corrected['per-sample'] == (0.0, pytest.approx(30.0))   # the mean factor, 1.0
    assert min(corrected, key=lambda name: sum(corrected[name])) == 'depth'
    auto._ratios[kind] = 0.8                                    # agenda saves steps
    corrected = auto._corrected(raw, sized)
    assert corrected['depth'] == (0.1, pytest.approx(3.3))
    assert corrected['agenda'] == (0.4, pytest.approx(2.7))
    auto._ratios[kind] = 1.0
    auto._run_factors[sized] = {'agenda': 0.9}                  # one measured: both get it
    corrected = auto._corrected(raw, sized)
    assert corrected['depth'][1] == corrected['agenda'][1] == pytest.approx(2.7)


def test_depth_and_agenda_keep_their_own_factors_where_their_steps_differ_in_size():
    """Equal step counts are not equal plans: on random DAGs whose unread
    calls depth moves to its last step, agenda ran 20% faster in as many
    steps, and a pooled factor hid it (auto 1.25x agenda).  The probe
    compares the two plans' step sizes; pooling needs them equal."""
    from mxnet import gluon
    import random

    class Pair(gluon.HybridBlock):
        def __init__(self, **kw):
            super().__init__(**kw)
            with self.name_scope():
                self.dense = nn.Dense(4, in_units=8)

        def hybrid_forward(self, F, a, b):
            return F.tanh(self.dense(F.concat(a, b, dim=1)))

    leaf = dyb.DynBatchBlock(nn.Dense(4, in_units=4))
    pair = dyb.DynBatchBlock(Pair())
    leaf.initialize()
    pair.initialize()
    auto = dyb.Auto(model=dyb.CostModel(), small=1)
    rng = random.Random(5)
    with dyb.batching(auto):
        hs = [leaf(mx.nd.ones((1, 4)) * i) for i in range(16)]
        for _ in range(5):          # random wiring: some calls are read by none
            hs = [pair(hs[rng.randrange(16)], hs[rng.randrange(16)]) for _ in range(16)]
    kind = auto.last['kind']
    assert auto._same_sizes[kind] is False      # probed on the first flush of its kind
    from gluon_dynbatch.cost import _alike
    assert not _alike([32] * 7, [32, 30, 24, 30, 26, 30, 52])   # the review's DAG: 18% moved
    assert _alike([100, 60, 40], [61, 99, 40])      # random trees: a row here and there
    assert not _alike([100, 100], [100, 50, 50])    # as many calls, other steps
    sized = (kind, 7)
    raw = {'depth': (0.1, 3.0), 'agenda': (0.4, 3.0)}
    auto._ratios[kind] = 1.0                    # as many steps as depth...
    auto._run_factors[sized] = {'depth': 1.1, 'agenda': 0.9}
    corrected = auto._corrected(raw, sized)     # ...but each keeps its factor
    assert corrected['depth'][1] == pytest.approx(3.3)
    assert corrected['agenda'][1] == pytest.approx(2.7)
    auto._same_sizes[kind] = True
    corrected = auto._corrected(raw, sized)
    assert corrected['depth'][1] == corrected['agenda'][1] == pytest.approx(3.0)


def test_probed_plans_alike_but_not_equal_share_a_factor_and_are_not_explored():
    """Random trees' depth and agenda plans make as many steps whose sizes
    differ by a row here and there: the probe finds them alike, so the two
    share a run factor, and a near-tie between them is not explored (their
    runs price both alike; at SICK minibatch 1,024 each exploring run of
    agenda cost ~6 ms more analysis).  (A review: nothing tested that the
    probe compares sizes this way.)"""
    from gluon_dynbatch.block import private_scope
    cell = dyb.DynBatchBlock(ChildSumTreeLSTMCell(4, 3))
    cell.initialize()
    rng = np.random.RandomState(0)
    trees = [random_tree(rng, rng.randint(5, 25), 4) for _ in range(16)]
    with private_scope('depth') as scope:
        record_trees(cell, trees)
        nodes, _ = scope.take()
        depth, agenda = dyb.ByDepth().plan(nodes), dyb.Agenda().plan(nodes)
        scope.abandon()
    assert len(depth.steps) == len(agenda.steps)
    assert sorted(depth.batch_sizes()) != sorted(agenda.batch_sizes())     # not equal...
    auto = dyb.Auto(model=dyb.CostModel(), small=1)
    with dyb.batching(auto):
        record_trees(cell, trees)
    kind, sized = auto.last['kind'], auto.last['sized']
    assert auto._same_sizes[kind] is True                                  # ...but alike
    auto._ratios[kind] = 1.0
    auto._run_factors[sized] = {'depth': 1.2, 'agenda': 0.8}
    raw = {'depth': (0.1, 3.0), 'agenda': (0.4, 3.0)}
    corrected = auto._corrected(raw, sized)
    assert corrected['depth'][1] == corrected['agenda'][1] == pytest.approx(3.0)
    ranked = ['depth', 'agenda']                    # agenda within 10%, never measured
    auto._explore(ranked, corrected, sized)
    assert ranked == ['depth', 'agenda']
    auto._same_sizes[kind] = False                  # factors apart: explored
    auto._explore(ranked, auto._corrected(raw, sized), sized)
    assert ranked[0] == 'agenda'


def test_where_agenda_makes_depths_steps_depth_runs():
    """Where the probe found agenda's plan alike to depth's, their
    predictions differ only by the learned analysis costs, and depth runs
    even when agenda's is learned lower: depth's analysis is not slower
    and reading results after it costs less (at SICK minibatch 4 noise in
    those costs had auto run agenda in 64 of 64 flushes, 1.07-1.10x
    depth).  Where plans differ, agenda still wins on its prediction."""
    cell = dyb.DynBatchBlock(ChildSumTreeLSTMCell(4, 3))
    cell.initialize()
    rng = np.random.RandomState(0)
    batches = [[random_tree(rng, rng.randint(5, 25), 4) for _ in range(16)] for _ in range(6)]
    auto = dyb.Auto(model=dyb.CostModel(analyse_us={'depth': 5.0, 'agenda': 0.1}), small=1,
                    explore_within=0)
    for trees in batches:
        with dyb.batching(auto):
            record_trees(cell, trees)
    kind = auto.last['kind']
    assert auto._same_plans(auto.last['sized'])
    assert auto.last['predictions_ms']['agenda'] < auto.last['predictions_ms']['depth']
    assert auto.last['choice'] == 'depth' and auto.choices['depth'] >= len(batches) - 1
    auto._same_sizes[kind] = False          # plans apart: the prediction decides
    with dyb.batching(auto):
        record_trees(cell, batches[0])
    assert auto.last['choice'] == 'agenda'
    # depth takes agenda's place, not the one after it (a review: a
    # strategy ranked between them ran)
    auto._same_sizes[kind] = True
    auto._corrected = lambda raw, sized: {'agenda': (0.0, 1.0), 'per-sample': (0.0, 1.05),
                                          'depth': (0.0, 1.1)}
    with dyb.batching(auto):
        record_trees(cell, batches[0])
    assert auto.last['choice'] == 'depth'


def test_a_repeating_summary_is_not_explored(monkeypatch):
    """Once a summary has a stored plan, measured totals decide, and the run
    that times the best other strategy must be that one: exploring there
    (a review) once timed agenda's 81 steps instead of depth's 44."""
    from gluon_dynbatch.cost import Auto
    explored = []
    original = Auto._explore
    monkeypatch.setattr(Auto, '_explore', lambda self, ranked, predictions, sized: (
        explored.append('cached' in predictions), original(self, ranked, predictions, sized)))
    block = dyb.DynBatchBlock(nn.Dense(3, in_units=3))
    block.initialize()
    auto = dyb.Auto(model=dyb.CostModel(), small=1)
    for _ in range(8):
        with dyb.batching(auto):
            xs = [block(mx.nd.ones((1, 3))) for _ in range(20)]
            [block(block(x)) for x in xs[:10]]
    assert 'cached' in auto.last['predictions_ms']      # the summary repeats
    assert explored and not any(explored)               # explored only before it did


def test_auto_plans_a_chain_per_sample_without_deciding():
    """A chain of one block (every call a step of its own): no strategy can
    batch it, so auto neither predicts nor probes (that cost ~2 ms a flush
    of 1,000 chained calls).  Two chains of two blocks out of phase also
    make a step per call by depth, but agenda runs them in half as many:
    those are decided, and agenda is found (a review: an earlier form of
    the rule ran them per sample for good, 1.47x agenda)."""
    block = dyb.DynBatchBlock(nn.Dense(3, in_units=3, activation='tanh'))
    other = dyb.DynBatchBlock(nn.Dense(3, in_units=3, activation='relu'))
    block.initialize()
    other.initialize()

    def chain(n=40):
        x = mx.nd.ones((1, 3))
        for _ in range(n):
            x = block(x)
        return [x]

    def out_of_phase(n=20):
        a, b = mx.nd.ones((1, 3)), mx.nd.ones((1, 3)) * 2
        for t in range(n):
            a = (block if t % 2 else other)(a)
            b = (other if t % 2 else block)(b)
        return [a, b]

    auto = dyb.Auto(model=dyb.CostModel(), small=1)
    assert_same(run_both(chain, [block], strategy=auto))
    assert auto.choices == {'per-sample': 1} and 'predicted_ms' not in auto.last
    assert not auto._next_probe and not auto._run_factors      # nothing probed or learned
    dyb.reset_stats()
    for _ in range(6):
        assert_same(run_both(out_of_phase, [block, other], strategy=auto))
    assert 'predicted_ms' in auto.last and auto.choices.get('agenda')
    assert dyb.stats()['last']['steps'] == 21       # agenda's, against 40 per call


@pytest.mark.skipif(accel.Tape is None, reason='structure keys come from the C recorder')
def test_auto_replays_small_flushes_that_come_back():
    """A small flush (under ``small`` calls, planned without deciding) of
    three or more steps whose structure comes back replays a stored plan:
    the second sighting stores it, the third learns its recipes, later
    ones replay them (an LSTM cell over 20 tokens at minibatch 1 ran 0.89x
    depth's time); values and gradients stay per-sample's, in inference
    and in training, after a parameter changes too.  A flush of fewer
    steps (a single call ran 1.05x replayed), one of new structure, and
    flushes without the C recorder's structure key are planned by depth."""
    block = dyb.DynBatchBlock(nn.Dense(3, in_units=3, activation='tanh'))
    block.initialize()
    leaves = [mx.nd.array(np.random.RandomState(i).uniform(-1, 1, (1, 3))) for i in range(4)]

    def tree(n_leaves=4):       # a step of leaves, then a chain of n_leaves - 1 calls
        values = [block(x) for x in leaves[:n_leaves]]
        out = values[0]
        for _ in values[1:]:
            out = block(out)
        return [out] + values[1:]

    auto = dyb.Auto(model=dyb.CostModel())
    plans = []
    for sighting in range(5):
        if sighting == 3:       # replays read the parameters as they are now
            block.weight.set_data(block.weight.data() * 0.5)
        assert_same(run_both(tree, [block], strategy=auto))
        plans.append(dyb.stats()['last']['strategy'])
    # the storing flush runs depth's plan, and counts as depth
    assert plans == ['depth', 'cached-miss:depth', 'cached', 'cached', 'cached']
    assert auto.choices == {'depth': 2, 'cached': 3} and auto.last['choice'] == 'cached'
    assert len(auto.replay.cache) == 1 and not auto.replay.compiled    # never compiled
    with dyb.batching(auto):                    # inference replays recipes learned in training
        out = tree()[0]
    np.testing.assert_allclose(out.data.asnumpy(), tree()[0].asnumpy(), rtol=1e-5, atol=1e-6)
    assert dyb.stats()['last']['strategy'] == 'cached' and not auto.replay.compiled
    for sighting in range(4):   # recipes learned in inference, replayed in training
        if sighting < 3:
            with dyb.batching(auto):
                out = tree(3)[0]
            np.testing.assert_allclose(out.data.asnumpy(), tree(3)[0].asnumpy(), rtol=1e-5,
                                       atol=1e-6)
        else:
            assert_same(run_both(lambda: tree(3), [block], strategy=auto))
        plans.append(dyb.stats()['last']['strategy'])
    assert plans[5:] == ['depth', 'cached-miss:depth', 'cached', 'cached']
    for _ in range(3):          # two steps: planned by depth every time
        assert_same(run_both(lambda: tree(2), [block], strategy=auto))
        assert dyb.stats()['last']['strategy'] == 'depth'
    accel.enable(False)
    try:
        for _ in range(3):      # no structure key: no replay
            assert_same(run_both(tree, [block], strategy=auto))
            assert dyb.stats()['last']['strategy'] == 'depth'
    finally:
        accel.enable(True)


@pytest.mark.skipif(accel.Tape is None, reason='structure keys come from the C recorder')
@pytest.mark.parametrize('train', [False, True])
def test_a_replayed_small_plan_is_planned_anew_now_and_then(monkeypatch, train):
    """A small flush's plan is stored early, with the costs known then
    (here a tiny step cost: padded groups split into many steps); every
    ``probe_every``-th replay plans by depth again and, with fewer steps,
    runs and stores that plan (its recipes learned at the next sighting).
    Values and gradients stay per-sample's throughout (a review: nothing
    tested the refresh)."""
    from gluon_dynbatch import plan as plan_module
    from gluon_dynbatch.plan import PADDING_COST
    monkeypatch.setattr(plan_module, 'RAGGED', False)       # padded groups: split or not
    monkeypatch.setitem(PADDING_COST, 'family_step_us', {})
    monkeypatch.setitem(PADDING_COST, 'step_us', 0.001)
    cell = dyb.DynBatchBlock(ChildSumTreeLSTMCell(4, 3))
    cell.initialize()
    rng = np.random.RandomState(11)
    trees = [random_tree(rng, n, 6) for n in (6, 8, 10)]
    model = dyb.CostModel()
    monkeypatch.setattr(model, 'observe_steps', lambda plan, seconds, **_: None)  # costs fixed
    auto = dyb.Auto(model=model, probe_every=2)
    want = [o.asnumpy() for o in record_trees(cell, trees)]
    ran = []
    for sighting in range(8):
        if sighting == 3:
            PADDING_COST['step_us'] = 1e9                   # now steps cost: fewer of them
        if train:
            assert_same(run_both(lambda: record_trees(cell, trees), [cell], strategy=auto))
        else:
            with dyb.batching(auto):
                got = record_trees(cell, trees)
            for a, b in zip(got, want):
                np.testing.assert_allclose(a.asnumpy(), b, rtol=1e-5, atol=1e-6)
        last = dyb.stats()['last']
        (entry,) = auto.replay.cache.values() if sighting else (None,)
        ran.append((last['strategy'], last['steps'], entry and len(entry.steps)))
    split, fewer = ran[1][2], ran[4][1]
    assert fewer < split
    assert ran == [('depth', split, None), ('cached-miss:depth', split, split),
                   ('cached', split, split), ('cached', split, split),
                   ('depth', fewer, fewer), ('cached', fewer, fewer),
                   ('cached', fewer, fewer), ('cached', fewer, fewer)]


@pytest.mark.parametrize('strategy', ['depth', 'agenda', 'auto'])
def test_a_value_read_after_every_call_flushes_calls_one_by_one(strategy):
    """Each flush holds one call, which every strategy runs alone, planned
    without grouping (a few microseconds of a ~35 us flush); auto learns
    nothing from it and says so without a new record."""
    block = dyb.DynBatchBlock(nn.Dense(3, in_units=3, activation='tanh'))
    block.initialize()

    def read_each(n=6):
        x = mx.nd.ones((1, 3))
        for _ in range(n):
            x = block(x)
            x.asnumpy()
        return [x]

    if strategy == 'auto':
        strategy = dyb.Auto(model=dyb.CostModel(), small=2)
        before = strategy.model.to_dict()
    dyb.reset_stats()
    assert_same(run_both(read_each, [block], strategy=strategy))
    stats = dyb.stats()
    assert stats['flushes'] == 6 and stats['steps'] == 6
    if not isinstance(strategy, str):
        assert strategy.choices == {'depth': 6} and strategy.model.to_dict() == before
        with pytest.raises(TypeError):
            strategy.last['choice'] = 'agenda'      # shared by such flushes: read-only


def test_a_family_with_no_line_to_fit_is_priced_from_its_steps(monkeypatch):
    """Steps of a family that all had as many elements (one heavy step a
    flush) fit no line; until one fits, the family's step cost is its
    steps' time less the per-element cost, so that its flushes are no
    longer predicted at the default step cost (a capsule network's: 0.3
    ms predicted, 4.5 ms run).  A flush that built a program teaches
    nothing so, and once a line fits, only lines move the cost."""
    from types import SimpleNamespace
    from gluon_dynbatch import cost
    from gluon_dynbatch.plan import PADDING_COST
    monkeypatch.setitem(PADDING_COST, 'family_step_us', {})
    monkeypatch.setattr(cost, 'FITTED_FAMILIES', set())
    model = dyb.CostModel(step_us=300, row_us=2)
    sig = SimpleNamespace(group_key=7, data_names=('x', 'y'))

    def plan(*calls):
        return SimpleNamespace(steps=[SimpleNamespace(sig=sig, ragged=False, nodes=[None] * n)
                                      for n in calls])
    model.observe_steps(plan(64), [0.004], built=True)         # building its program
    assert 7 not in model.family_step_us
    model.observe_steps(plan(64), [0.004])
    assert model.family_step_us[7] == pytest.approx(4000 - 2 * 64)
    predicted = model.predict(64, 1, groups={(0, 7): 64})['depth'][1]
    assert predicted == pytest.approx(4.0)
    model.observe_steps(plan(10, 30), [0.001, 0.002])   # a line: 500 + 25 us an element
    fitted = model.family_step_us[7]
    assert fitted == pytest.approx(3872 + 0.2 * (500 - 3872))
    model.observe_steps(plan(64), [0.004])
    assert model.family_step_us[7] == fitted
    # never priced below the default step: 8 calls of 60 us, less 2 us each
    light = SimpleNamespace(group_key=8, data_names=('x',))
    model.observe_steps(SimpleNamespace(steps=[SimpleNamespace(
        sig=light, ragged=False, nodes=[None] * 8)] * 5), [60e-6] * 5)
    assert 8 not in model.family_step_us


def test_no_run_factor_is_learned_from_a_flush_that_first_priced_its_blocks():
    """A flush of blocks whose step cost is not learned yet is predicted at
    the default step cost (a Tree-LSTM's, ten times a small cell's); a
    factor learned from it would scale every informed prediction after it
    (clipped to 0.5 where the truth was 0.1: depth priced 40% low on
    ragged chains).  The next flush, priced by what the first measured,
    teaches one."""
    block = dyb.DynBatchBlock(nn.Dense(3, in_units=3, activation='tanh'))
    block.initialize()
    auto = dyb.Auto(model=dyb.CostModel(), small=1, explore_within=0)

    def ragged_chains(strategy):
        with dyb.batching(strategy):
            for length in range(1, 9):
                x = mx.nd.ones((1, 3))
                for _ in range(length):
                    x = block(x)
        return auto.last.get('unpriced'), auto.last.get('sized')

    # build its step programs first: a flush that builds one learns no
    # factor either (a review: the first version of this test passed
    # without the rule it tests)
    ragged_chains('depth')
    unpriced, sized = ragged_chains(auto)
    assert unpriced and unpriced <= set(auto.model.family_step_us)   # priced by this flush
    assert not auto._run_factors.get(sized)
    unpriced, sized = ragged_chains(auto)
    assert not unpriced and auto._run_factors[sized]


def test_run_factors_are_learned_per_size_of_graph():
    """A run factor corrects predictions for graphs of the size (calls,
    within a factor of two) it was measured on, not for others: the step
    model's error changes with the size (a factor from 5,000-call graphs
    once priced depth 1.3x at 80 calls, and auto ran agenda there)."""
    block = dyb.DynBatchBlock(nn.Dense(3, in_units=3))
    block.initialize()
    auto = dyb.Auto(model=dyb.CostModel(), small=1, explore_within=0)
    sized = {}
    for n in (40, 5):
        with dyb.batching(auto):
            [block(mx.nd.ones((1, 3))) for _ in range(n)]
        sized[n] = auto.last['sized']
        auto.last['built'] = programs_built()
        auto._observe_run(auto.last['choice'], 2.0 * auto.last['raw_run_ms'])
    assert sized[40][1] == 6 and sized[5][1] == 3 and sized[40][0] == sized[5][0]
    assert auto._run_factors[sized[40]] == {'depth': 2.0}
    assert auto._run_factors[sized[5]] == {'depth': 2.0}
    raw = {'depth': (1.0, 10.0), 'agenda': (3.0, 10.0)}
    assert auto._corrected(raw, (sized[5][0], 9)) == raw     # a size not measured yet


def test_cached_plan_reads_new_host_lists():
    """A list argument of host numpy rows is read from every new flush of a
    cached (and compiled) structure, not replayed."""
    block = dyb.DynBatchBlock(DenseAddLists())
    block.initialize()
    rng = np.random.RandomState(12)
    cached = dyb.CachedPlan(compile_after=1)
    for _ in range(4):
        xs = [rng.uniform(-1, 1, (1, 3)).astype(np.float32) for _ in range(5)]
        lists = [[rng.uniform(-1, 1, (1, 3)).astype(np.float32) for _ in range(2)]
                 for _ in range(5)]
        with dyb.batching(cached):
            got = [block(block(x, r), r) for x, r in zip(xs, lists)]
        want = [block.block(block.block(mx.nd.array(x), [mx.nd.array(v) for v in r]),
                            [mx.nd.array(v) for v in r]) for x, r in zip(xs, lists)]
        for a, b in zip(got, want):
            np.testing.assert_allclose(a.asnumpy(), b.asnumpy(), rtol=1e-5, atol=1e-6)
    assert cached.hits == 3


def test_structure_keys_tell_array_leaves_from_lazy_ones():
    """(array, output 0 of call 0) and (output 0 of call 0, array) are
    different structures: a cached plan for one must not run the other."""
    from gluon_dynbatch.plan import structure_key
    widen = dyb.DynBatchBlock(nn.Dense(3, in_units=2))
    add = dyb.DynBatchBlock(DenseAddLists())
    widen.initialize()
    add.initialize()
    keys = []
    for swap in (False, True):
        with dyb.batching('depth') as scope:
            wide = widen(mx.nd.ones((1, 2)))          # call 0
            row = mx.nd.ones((1, 3))
            add(mx.nd.ones((1, 3)), [wide, row] if swap else [row, wide])
            keys.append(structure_key(scope.pending))
    assert keys[0] != keys[1]


def test_threaded_engine_times_only_the_flushes_a_strategy_asks_for(monkeypatch):
    """Step times on the host clock are real only when each step is waited
    for, which a threaded engine otherwise avoids: a flush waits and
    reports them only when its strategy asks (a learning one, one flush in
    TIMED_EVERY here); a strategy that does not learn never makes a flush
    wait.  Under the NaiveEngine every flush reports its times."""
    from gluon_dynbatch import block as block_module
    from gluon_dynbatch.block import TIMED_EVERY
    from gluon_dynbatch.execute import threaded_engine
    from gluon_dynbatch.plan import ByDepth

    class Spy(ByDepth):
        def __init__(self):
            self.seen, self.asked = [], 0

        def wants_step_times(self, every):
            self.asked += 1
            return self.asked % every == 0

        def observe(self, plan, step_seconds, analyse_s, nodes):
            self.seen.append(step_seconds)

    waits = []
    run_plan = block_module.run_plan
    monkeypatch.setattr(block_module, 'run_plan',
                        lambda plan, wait, **kwargs: waits.append(wait) or
                        run_plan(plan, wait=wait, **kwargs))
    block = dyb.DynBatchBlock(mx.gluon.nn.Dense(3, in_units=3))
    block.initialize()
    spy = Spy()
    for strategy in [spy] * (2 * TIMED_EVERY) + ['depth'] * TIMED_EVERY:
        with dyb.batching(strategy):
            outs = [block(mx.nd.ones((1, 3))) for _ in range(4)]
        assert dyb.concat_rows(outs).shape == (4, 3)
    timed = [s for s in spy.seen if s is not None]
    assert len(timed) == (2 if threaded_engine() else 2 * TIMED_EVERY)
    assert all(len(s) == 1 and s[0] > 0 for s in timed)
    assert sum(waits) == (2 if threaded_engine() else 0)
    assert not any(waits[2 * TIMED_EVERY:])


def test_auto_times_what_it_has_not_measured_then_one_flush_in_every():
    """Auto asks for step times while its choice has fewer than LEARN_RUNS
    measured runs on this kind and size of graph, and for the runs that
    decide a repeating summary; else for one flush in ``every`` (a waited
    flush costs a threaded engine its overlap).  With one turn for all
    flushes, two alternating scopes left one never timed."""
    from gluon_dynbatch.cost import LEARN_RUNS
    auto = dyb.Auto(model=dyb.CostModel())
    auto.last = {'choice': 'depth', 'sized': ('kind', 9), 'raw_run_ms': 1.0,
                 'built': programs_built()}
    for _ in range(LEARN_RUNS):
        assert auto.wants_step_times(8)
        auto._observe_run('depth', 1.0)
    asked = [auto.wants_step_times(8) for _ in range(16)]
    assert sum(asked) == 2
    auto.last = dict(auto.last, choice='agenda')            # not measured there yet
    assert auto.wants_step_times(8)
    auto.last = dict(auto.last, choice='depth', sized=('kind', 10))     # another size
    assert auto.wants_step_times(8)
    auto.last = {'choice': 'cached', 'sized': ('kind', 9), 'deciding': True}
    assert all(auto.wants_step_times(8) for _ in range(8))
    auto.last['deciding'] = False           # decided: it learns from its totals now and then
    assert sum(auto.wants_step_times(8) for _ in range(8)) == 1


def test_analysis_that_did_one_time_work_is_not_learned_from():
    """Meeting a group of signatures for the first time traces and checks
    its padded signature inside planning: that flush's analysis time must
    not move the per-node analysis cost (once it priced depth at 8 us a
    node, 20x its real cost, and auto ran agenda for a hundred flushes)."""
    from gluon_dynbatch.plan import SETUP
    model = dyb.CostModel()
    before = dict(model.analyse_us)
    model.observe_analysis('depth', 0.05, 1000, setup=SETUP[0] - 1)
    assert model.analyse_us == before
    model.observe_analysis('depth', 0.05, 1000, setup=SETUP[0])
    assert model.analyse_us['depth'] != before['depth']

    cell = dyb.DynBatchBlock(ChildSumTreeLSTMCell(3, 3))
    cell.initialize()
    auto = dyb.Auto(model=dyb.CostModel(), probe_every=1)
    rng = np.random.RandomState(4)
    trees = [random_tree(rng, 12, max_arity=4) for _ in range(30)]
    start = dict(auto.model.analyse_us)
    setups = SETUP[0]
    with dyb.batching(auto):
        record_trees(cell, trees)
    assert SETUP[0] > setups        # this flush met its padded groups first...
    chosen = auto.last['choice']    # ...in the chosen plan (the probe after it did not)
    assert chosen in ('depth', 'agenda') and auto.model.analyse_us[chosen] == start[chosen]
    with dyb.batching(auto):        # the same groups again: learned from
        record_trees(cell, trees[::-1])
    assert auto.last['choice'] == chosen and auto.model.analyse_us[chosen] != start[chosen]


def test_a_repeating_summary_decides_on_two_timed_flushes():
    """A structure that comes back runs its cached plan ``cached_trials``
    times, then the best other strategy once; only the cached plan's last
    trial (the first ones learn its recipes and compile it, slower) and
    the rival's run are deciding, the flushes a threaded engine waits for.
    Waiting for every trial made a training epoch that repeated the last
    one's minibatches of 25 run ~1.7x slower for four epochs."""
    cell = dyb.DynBatchBlock(ChildSumTreeLSTMCell(3, 3))
    cell.initialize()
    auto = dyb.Auto(model=dyb.CostModel())
    rng = np.random.RandomState(5)
    trees = [random_tree(rng, 12, max_arity=3) for _ in range(30)]
    runs = []
    for _ in range(auto.cached_trials + 5):
        with dyb.batching(auto):
            record_trees(cell, trees)
        runs.append((auto.last['choice'], auto.last['deciding']))
    trials = auto.cached_trials
    assert [choice for choice, _ in runs[2:2 + trials]] == ['cached'] * trials
    assert runs[2 + trials][0] != 'cached'          # the rival, timed
    deciding = [deciding for _, deciding in runs]
    assert deciding[:3 + trials] == [False] * (1 + trials) + [True, True]
    # (the rival runs once more where its run built a step program, which
    # depends on which of depth and agenda the costs learned so far rank
    # first); then the summary is decided
    assert not deciding[-1]


def test_a_losing_cached_plan_is_timed_when_it_is_tried_again():
    """Past its trials, a cached plan that loses to its rival runs again on
    every ``probe_every``-th sighting; that run must be timed (a threaded
    engine times a flush only when it decides), else it could never win
    back.  So must a run whose kind (compiled or replayed) has no best time
    yet; a winning run is not: its best time could only fall."""
    auto = dyb.Auto(model=dyb.CostModel())
    record = auto._repeat('summary')
    assert [auto._cached_deciding(record) for record.cached_runs in range(4)] == \
        [False, False, False, True]
    record.cached_runs = auto.cached_trials
    assert auto._cached_deciding(record)                # no best time of its kind
    record.best_ms.update(cached=10.0, depth=11.0)
    assert not auto._cached_deciding(record)            # winning
    record.best_ms['depth'] = 5.0
    record.rival_timed = True
    record.sightings = 0
    assert not auto._cached_measured_best('summary')    # losing...
    record.sightings = auto.probe_every - 1
    assert auto._cached_measured_best('summary')        # ...tried again...
    assert auto._cached_deciding(record)                # ...and timed


def test_an_untimed_run_of_the_rival_does_not_ask_to_time_it_again():
    """Once the rival of a repeating summary's cached plan has been timed,
    its later runs (untimed under a threaded engine) must not ask for it to
    be timed again: each did, so every other flush waited, and the cached
    plan's retries, on every ``probe_every``-th sighting, always fell on a
    rival's run (found by a review).  A deciding run that built a step
    program still asks."""
    from gluon_dynbatch.plan import Plan
    auto = dyb.Auto(model=dyb.CostModel())
    auto._seen['summary'] = 3
    record = auto._repeat('summary')
    record.cached_runs = auto.cached_trials
    record.best_ms.update(cached=10.0)
    assert auto._cached_measured_best('summary') is None       # time the rival
    for deciding, seconds, built, kept in ((True, [0.004], programs_built(), True),
                                           (False, None, programs_built(), True),
                                           (True, [0.004], programs_built() - 1, False)):
        record.rival_timed = True
        auto.last = {'predicted_ms': 1.0, 'fingerprint': 'summary', 'choice': 'depth',
                     'built': built, 'kind': frozenset(), 'sized': (frozenset(), 0),
                     'raw_run_ms': 1.0, 'depth_steps': 0, 'deciding': deciding}
        auto.observe(Plan('depth', ()), seconds, 0.001, [])
        assert record.rival_timed == kept
    record.rival_timed = True
    record.sightings = auto.probe_every - 1
    assert auto._cached_measured_best('summary')    # the losing plan's retry comes


def test_cached_plan_not_yet_timed_keeps_running():
    """Under a threaded engine a cached plan can pass its trial runs
    without one timed flush; it keeps running until it is measured."""
    auto = dyb.Auto(model=dyb.CostModel())
    record = auto._repeat('summary')
    record.cached_runs = auto.cached_trials
    assert auto._cached_measured_best('summary') is None    # first: time the best other
    record.best_ms['depth'] = 10.0
    assert auto._cached_measured_best('summary')
    record.best_ms['cached'] = 20.0
    record.sightings = 0
    assert not auto._cached_measured_best('summary')


def test_a_cached_plans_best_time_is_forgotten_when_its_program_comes_or_goes():
    """A compiled run and a replay of one cached plan cost different
    amounts: when the plan's compiled program is dropped, the best time of
    its compiled runs no longer stands for it (auto would keep a replay
    that is slower than its rival)."""
    from gluon_dynbatch.plan import Plan
    auto = dyb.Auto(model=dyb.CostModel())
    auto._seen['summary'] = 3
    record = auto._repeat('summary')
    for program, seconds, best in ((object(), 0.002, 3.0), (object(), 0.004, 3.0),
                                   (None, 0.006, 7.0), (None, 0.009, 7.0)):
        auto.last = {'predicted_ms': 1.0, 'fingerprint': 'summary', 'choice': 'cached',
                     'built': programs_built(), 'kind': frozenset(), 'sized': (frozenset(), 0),
                     'raw_run_ms': 1.0, 'depth_steps': 0}
        auto.observe(Plan('cached', (), program=program), [seconds], 0.001, [])
        assert record.best_ms['cached'] == pytest.approx(best)
    assert record.cached_runs == 4 and record.cached_compiled is False


def test_rival_run_slowed_by_a_build_is_timed_again():
    """The run that times the best other strategy against a cached plan
    counts only if it built no step program (a build costs more than whole
    steps); otherwise the rival runs again at the next sighting."""
    from gluon_dynbatch.plan import Plan
    auto = dyb.Auto(model=dyb.CostModel())
    auto._seen['summary'] = 3                       # a repeating summary, stored
    record = auto._repeat('summary')
    record.cached_runs = auto.cached_trials
    assert auto._cached_measured_best('summary') is None    # time the rival now
    for built, kept in ((programs_built() - 1, False), (programs_built(), True)):
        auto.last = {'predicted_ms': 1.0, 'fingerprint': 'summary', 'choice': 'depth',
                     'built': built, 'kind': frozenset(), 'sized': (frozenset(), 0),
                     'raw_run_ms': 1.0, 'depth_steps': 0, 'deciding': True}
        auto.observe(Plan('depth', ()), [0.004], 0.001, [])
        assert ('depth' in record.best_ms) == kept
        assert record.rival_timed == kept
        if not kept:
            assert auto._cached_measured_best('summary') is None   # the rival again


def test_cached_plans_are_bounded_by_calls_as_well_as_entries():
    """A stored plan keeps ~60 bytes of Python per call: the cache drops its
    oldest plans once their calls pass ``max_calls`` (with entries alone as
    the bound, 4,096 plans of minibatches of 1,024 pairs took ~4.6 GB)."""
    block = dyb.DynBatchBlock(nn.Dense(3, in_units=3))
    block.initialize()
    x = mx.nd.ones((1, 3))
    cached = dyb.CachedPlan(max_calls=100)
    for calls in (40, 50, 30, 60):          # a new structure each: chains of this length
        with dyb.batching(cached):
            value = x
            for _ in range(calls):
                value = block(value)
    assert cached.calls == sum(entry.calls for entry in cached.cache.values()) <= 100
    assert sorted(entry.calls for entry in cached.cache.values()) == [30, 60]


def test_a_strategy_keeps_what_it_says_of_its_last_plan_per_thread():
    """The instances of STRATEGIES serve every thread's scopes: what one
    says of its last plan (Auto.last, which its observe() learns from, and
    last_compile_s) is the calling thread's, not another thread's flush
    (found by a review), and planning holds plan.PLANNING."""
    import threading
    from gluon_dynbatch import plan as plan_module
    auto = dyb.Auto()
    auto.last = {'choice': 'agenda'}
    auto.last_compile_s = 0.5
    seen = []

    def other():
        seen.append((dict(auto.last), auto.last_compile_s))
        auto.last = {'choice': 'depth'}
    thread = threading.Thread(target=other)
    thread.start()
    thread.join()
    assert seen == [({}, 0.0)]
    assert auto.last == {'choice': 'agenda'} and auto.last_compile_s == 0.5
    held = []

    class Watching(dyb.ByDepth):
        def plan(self, nodes, summary=None):
            held.append(plan_module.PLANNING._is_owned())  # pylint: disable=protected-access
            return super().plan(nodes, summary)
    block = dyb.DynBatchBlock(nn.Dense(2, in_units=2))
    block.initialize()
    with dyb.batching(dyb.CachedPlan(fallback=Watching())):
        block(mx.nd.ones((1, 2)))
    assert held == [True]


def test_auto_keeps_what_it_learned_for_at_most_memory_kinds_of_graph():
    """Block families are never reused, so per-kind entries of a dropped
    model stayed for the life of the process (a review noted it); past
    ``memory`` kinds the least recently planned kind is forgotten."""
    auto = dyb.Auto(model=dyb.CostModel(), small=1, memory=2)

    def flush(block):
        with dyb.batching(auto):
            first = [block(mx.nd.ones((1, 3))) for _ in range(6)]
            [block(x) for x in first]

    def kinds_in_tables():
        kinds = set(auto._ratios) | set(auto._same_sizes) | set(auto._next_probe) | \
            set(auto._probe_gap) | {key[0] for key in auto._run_factors} | \
            {key[0][0] for key in auto._run_ratios} | {key[0][0] for key in auto._last_run} | \
            {key[0] for key in auto._record_paces}
        return kinds

    blocks = [nn.Dense(3, in_units=3) for _ in range(3)]
    wrapped = []
    for block in blocks:
        block.initialize()
        wrapped.append(dyb.DynBatchBlock(block))
    flush(wrapped[0])
    first_kind = auto.last['kind']
    flush(wrapped[1])
    second_kind = auto.last['kind']
    assert kinds_in_tables() == {first_kind, second_kind}
    flush(wrapped[0])                       # planned again: now the most recent
    flush(wrapped[2])                       # a third kind: the second one goes
    third_kind = auto.last['kind']
    assert kinds_in_tables() == {first_kind, third_kind}
    assert list(auto._kinds) == [first_kind, third_kind]


def test_auto_keeps_remembering_new_structures_after_its_memory_fills():
    """Found by a soak test: Auto remembered a summary seen once only while
    fewer than ``memory`` were remembered, and forgot none, so after that
    many one-off flushes a structure that began repeating never got a
    cached plan.  The older half of the summaries seen once are dropped."""
    block = dyb.DynBatchBlock(nn.Dense(4, in_units=4))
    block.initialize()
    auto = dyb.Auto(memory=4)
    x = mx.nd.ones((1, 4))

    def flush(calls):
        with dyb.batching(auto):
            outs = [block(x * k) for k in range(calls)]
            outs = [block(o) for o in outs]
        return outs[-1].asnumpy()

    for calls in range(40, 50):          # ten one-off structures
        flush(calls)
    assert len(auto._seen) <= 4
    flush(60)
    flush(60)                            # seen twice: its plan is stored
    assert any(steps is not None for steps in auto._seen.values())
    np.testing.assert_allclose(flush(60), block(block(x * 59)).asnumpy(), rtol=1e-6)


def test_a_runner_up_still_being_measured_runs_again_after_learn_gap_flushes():
    """A runner-up predicted well over 10% slower, with fewer than
    LEARN_RUNS measured runs, runs again LEARN_GAP flushes after its last
    run, not ``probe_every``: a slow first run (first runs often are) had
    locked agenda out of 16 flushes at a time on a layered DAG where it was
    the faster.  Once measured, ``probe_every`` flushes apart, and only
    within 10%."""
    from gluon_dynbatch.cost import LEARN_GAP
    auto = dyb.Auto(model=dyb.CostModel(), small=1)
    raw = {'depth': (1.0, 10.0), 'agenda': (1.0, 15.0)}
    auto._run_factors['k'] = {'depth': 1.0, 'agenda': 1.0}
    auto._run_ratios[('k', 'agenda')] = [1.5]                # one (slow) run so far
    auto._last_run[('k', 'agenda')] = auto._flushes = 100

    def first():
        ranked = ['depth', 'agenda']
        auto._explore(ranked, auto._corrected(raw, 'k'), 'k')
        return ranked[0]
    auto._flushes += LEARN_GAP - 1
    assert first() == 'depth'
    auto._flushes += 1
    assert first() == 'agenda'
    auto._run_ratios[('k', 'agenda')] = [1.5] * LEARN_RUNS   # measured: 50% slower, let be
    auto._flushes += 10 * auto.probe_every
    assert first() == 'depth'
    raw['agenda'] = (1.0, 10.5)                              # measured, within 10%:
    auto._run_ratios[('k', 'agenda')] = [1.0] * LEARN_RUNS
    auto._last_run[('k', 'agenda')] = auto._flushes
    auto._flushes += auto.probe_every - 1
    assert first() == 'depth'                                # probe_every flushes apart
    auto._flushes += 1
    assert first() == 'agenda'


def test_runs_are_priced_by_the_machine_pace_recording_shows():
    """A flush whose calls recorded slower per call than the median of
    recent flushes of its kind and size ran on a slow machine: its measured
    run is divided by that pace before it moves the run factor, so a slow
    spell does not price up whichever strategy ran in it against one
    measured before (one tradeoff.py run had auto switch to the slower
    depth in 15 of 31 flushes after agenda's runs met one)."""
    from gluon_dynbatch.cost import PACE_LEARNED
    auto = dyb.Auto(model=dyb.CostModel())
    assert auto._pace('k', None, 100) == 1.0                 # no recording time: no pace
    assert [auto._pace('k', 1e-4, 100) for _ in range(PACE_LEARNED)] == [1.0] * PACE_LEARNED
    assert auto._pace('k', 1.5e-4, 100) == pytest.approx(1.5)
    assert auto._pace('k', 1e-2, 100) == 2.0                 # clipped
    assert auto._pace('other', 1.5e-4, 100) == 1.0          # per kind and size of graph
    auto.last = {'sized': 'k', 'built': programs_built(), 'raw_run_ms': 10.0, 'pace': 1.5}
    auto._observe_run('depth', 15.0)
    assert auto._run_factors['k']['depth'] == pytest.approx(1.0)


def test_a_scope_hands_auto_its_recording_time():
    """The flush's summary carries the seconds its calls took to record
    (``record_s``) and how many it recorded, merged repeats included
    (``recorded``): ``auto`` paces its runs by their ratio."""
    seen = []

    class Spy(dyb.Strategy):
        name = 'spy'

        def plan(self, nodes, summary=None):
            seen.append(summary)
            return dyb.STRATEGIES['depth'].plan(nodes)
    block = dyb.DynBatchBlock(mx.gluon.nn.Dense(3, in_units=3))
    block.initialize()
    with dyb.batching(Spy()):
        outs = [block(np.full((1, 3), i % 10, np.float32)) for i in range(40)]
    assert outs[0].asnumpy().shape == (1, 3)
    # 40 calls recorded, 30 of them merged into a pending call with equal host rows
    assert len(seen) == 1 and seen[0]['record_s'] > 0 and seen[0]['recorded'] == 40


def test_auto_paces_its_runs_by_the_recording_of_real_flushes(monkeypatch):
    """End to end: flushes of a real scope fill auto's table of recording
    paces for their kind and size, and once it holds PACE_LEARNED of them
    a flush whose calls recorded twice as slowly (the recording clock made
    to run double) gets a pace near 2, which divides its measured run."""
    from gluon_dynbatch import block as block_module
    from gluon_dynbatch.cost import PACE_LEARNED, PACE_WINDOW
    dense = dyb.DynBatchBlock(nn.Dense(3, in_units=3))
    dense.initialize()
    auto = dyb.Auto(model=dyb.CostModel(), small=1)

    def flush(n, strategy=auto):    # (a new structure each time: no cached plan)
        with dyb.batching(strategy):
            xs = [dense(mx.nd.ones((1, 3))) for _ in range(200 + n)]
            [dense(x) for x in xs]
    # warm (the trace, the memo, the steps' programs) before the paces count,
    # fill the whole window, and record ~400 calls a flush: with 130, in a
    # fresh process (CI), a flush recorded at half the median pace, the clip
    # (over 15 such runs the last pace spread 0.66-1.05 with 130 calls and
    # 0.90-1.16 with 400)
    flush(0, 'depth')
    flush(0, 'agenda')
    for n in range(PACE_WINDOW):
        flush(n)
    sized = auto.last['sized']
    assert len(auto._record_paces[sized]) == PACE_WINDOW >= PACE_LEARNED
    assert 0.5 < auto.last['pace'] < 2
    seen = []
    original = auto._observe_run
    monkeypatch.setattr(auto, '_observe_run', lambda name, run_ms: seen.append(
        auto.last['pace']) or original(name, run_ms))
    recorded = block_module.BatchingScope.take

    def slow_take(scope, repeated=0):
        nodes, summary = recorded(scope, repeated)
        summary['record_s'] *= 2 * statistics.median(
            auto._record_paces[sized]) * summary['recorded'] / summary['record_s']
        return nodes, summary
    monkeypatch.setattr(block_module.BatchingScope, 'take', slow_take)
    flush(PACE_WINDOW)
    assert auto.last['sized'] == sized and auto.last['choice'] in ('depth', 'agenda')
    assert seen and seen[-1] == pytest.approx(2.0)
