"""Tests of the SICK Tree-LSTM example (examples/sick/train.py).

The equivalence tests import the example's training loop and run it in this
process in both modes; the others run the script as a user would.  All skip
when the SICK data cannot be found.
"""
import importlib.util
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import mxnet as mx
from mxnet import autograd

SCRIPT = Path(__file__).resolve().parents[1] / 'examples' / 'sick' / 'train.py'


def _load_example():
    spec = importlib.util.spec_from_file_location('sick_train_example', SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope='module')
def example():
    return _load_example()


@pytest.fixture(scope='module')
def small_data(example, sick_dir):
    return example.load_data(sick_dir, train_limit=100, dev_limit=40, test_limit=10)


def _args(example, *argv):
    return example.build_parser().parse_args(list(argv))


def _run_script(*argv, env_extra=None, timeout=300):
    env = dict(os.environ)
    env.pop('MXNET_ENGINE_TYPE', None)   # let the script pick its default
    env.update(env_extra or {})
    return subprocess.run([sys.executable, str(SCRIPT)] + [str(a) for a in argv],
                          capture_output=True, text=True, env=env, timeout=timeout)


# -- equivalence of the two modes ----------------------------------------

# 100 pairs at batch size 2 = 50 steps.  lr 0.01 rather than the default
# 0.05: Adagrad's first updates are lr * g / sqrt(g^2 + 1e-7), a gain of up
# to lr / sqrt(1e-7) (~160x at 0.05) on small gradient entries, so the 1e-7
# float32 rounding differences between a batched GEMM and per-row GEMMs grow
# to ~1e-2 in the loss over 50 steps at lr 0.05 (while plain SGD at 0.05
# stays at 1e-7, and the first-step gradients agree: see below).
EQUIV_ARGV = ('--train-limit', '100', '--batch-size', '2', '--lr', '0.01')


def _train_and_eval(example, data, vocab, mode, strategy='depth'):
    args = _args(example, *EQUIV_ARGV, '--strategy', strategy)
    model, _ = example.build_model(vocab, args)
    trainer = example.make_trainer(model, args)
    order = example.epoch_orders(len(data['train']), 1, args.seed)[0]
    stats = example.train_epoch(model, trainer, data['train'], order, mode, strategy,
                                args.batch_size)
    dev = example.evaluate(model, data['dev'], mode, strategy, batch_size=16)
    return np.array(stats['step_losses']), dev


@pytest.fixture(scope='module')
def per_sample_reference(example, small_data):
    data, vocab = small_data
    return _train_and_eval(example, data, vocab, 'per-sample')


@pytest.mark.parametrize('strategy', ['depth', 'agenda'])
def test_dynbatch_matches_per_sample_step_by_step(example, small_data, per_sample_reference,
                                                   strategy):
    data, vocab = small_data
    ref_losses, ref_dev = per_sample_reference
    losses, dev = _train_and_eval(example, data, vocab, 'dynbatch', strategy)
    assert len(ref_losses) == len(losses) == 50
    assert np.all(np.isfinite(losses))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-4, atol=1e-6)
    assert abs(dev['pearson'] - ref_dev['pearson']) < 1e-4
    assert abs(dev['mse'] - ref_dev['mse']) < 1e-4 * max(1.0, ref_dev['mse'])
    np.testing.assert_allclose(dev['predictions'], ref_dev['predictions'], rtol=1e-4,
                               atol=1e-5)


def test_a_long_pass_prints_progress_lines_where_stderr_is_no_terminal(
        example, small_data, monkeypatch, capsys):
    """Where stderr is a file or a pipe (CI, nohup) there are no bars, and
    a per-sample epoch ran for minutes without a word (found by a review)."""
    data, vocab = small_data
    args = _args(example, '--train-limit', '100', '--batch-size', '25')
    model, _ = example.build_model(vocab, args)
    order = example.epoch_orders(len(data['train']), 1, args.seed)[0]
    monkeypatch.setattr(example, 'PROGRESS_LINE_EVERY_S', 0.0)     # a line every update
    example.train_epoch(model, example.make_trainer(model, args), data['train'], order,
                        'dynbatch', 'depth', 25, 'lines', desc='dynbatch epoch 1')
    example.evaluate(model, data['dev'], 'dynbatch', 'depth', 16, 'lines', desc='dynbatch dev')
    err = capsys.readouterr().err.splitlines()
    assert re.fullmatch(r'  dynbatch epoch 1: 100/100 pairs, [\d.]+ pairs/s, loss [\d.]+',
                        err[0]), err
    assert re.fullmatch(r'  dynbatch dev: 16/40 pairs, [\d.]+ pairs/s', err[1]), err
    assert len(err) == 1 + 3
    monkeypatch.setattr(example, 'PROGRESS_LINE_EVERY_S', 3600.0)      # a short pass: none
    example.evaluate(model, data['dev'], 'dynbatch', 'depth', 16, 'lines')
    assert capsys.readouterr().err == ''


def test_build_model_is_seeded(example, small_data):
    _, vocab = small_data
    args = _args(example)
    first, _ = example.build_model(vocab, args)
    second, _ = example.build_model(vocab, args)
    third, _ = example.build_model(vocab, _args(example, '--seed', '1'))
    p1, p2, p3 = (list(m.params().values()) for m in (first, second, third))
    for a, b in zip(p1, p2):
        np.testing.assert_array_equal(a.data().asnumpy(), b.data().asnumpy())
    assert any(not np.array_equal(a.data().asnumpy(), c.data().asnumpy())
               for a, c in zip(p1, p3))


def test_first_step_gradients_match_at_default_settings(example, small_data):
    data, vocab = small_data
    args = _args(example)   # default lr, batch size 25
    batch = [data['train'][i] for i in example.epoch_orders(100, 1, args.seed)[0][:25]]
    target = mx.nd.array(np.stack([ex.target for ex in batch]))
    grads = {}
    for mode in example.MODES:
        model, _ = example.build_model(vocab, args)
        with autograd.record():
            loss = example.kl_loss(example.forward_batch(model, batch, mode, 'depth'), target)
        loss.backward()
        grads[mode] = [p.grad().asnumpy() for p in model.params().values()]
    for ref, got in zip(grads['per-sample'], grads['dynbatch']):
        scale = max(np.abs(ref).max(), 1e-8)
        assert np.abs(ref - got).max() <= 1e-4 * scale


def test_epoch_orders_are_reproducible(example):
    a = example.epoch_orders(30, 3, 0)
    b = example.epoch_orders(30, 3, 0)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not np.array_equal(a[0], a[1])
    assert sorted(a[2]) == list(range(30))


def test_kl_loss_is_zero_at_the_target(example):
    target = np.array([[0, 0.3, 0.7, 0, 0], [1, 0, 0, 0, 0]], dtype='float32')
    logp = mx.nd.log(mx.nd.array(target) + 1e-30)
    loss = example.kl_loss(logp, mx.nd.array(target)).asnumpy()
    np.testing.assert_allclose(loss, 0, atol=1e-5)
    uniform = mx.nd.log(mx.nd.ones((2, 5)) / 5)
    expected = [0.3 * math.log(0.3 * 5) + 0.7 * math.log(0.7 * 5), math.log(5)]
    np.testing.assert_allclose(example.kl_loss(uniform, mx.nd.array(target)).asnumpy(),
                               expected, rtol=1e-5)


# -- the script, end to end ----------------------------------------------

def _check_run(run, n_epochs):
    assert len(run['epochs']) == n_epochs
    for epoch in run['epochs']:
        assert math.isfinite(epoch['train_loss']) and epoch['train_loss'] > 0
        assert -1 <= epoch['dev_pearson'] <= 1
        assert epoch['dev_mse'] >= 0
    assert 1 <= run['best_epoch'] <= n_epochs
    assert -1 <= run['test']['pearson'] <= 1
    assert -1 <= run['test']['spearman'] <= 1
    assert run['test']['mse'] >= 0
    for phase in ('train', 'dev_eval', 'test_eval'):
        assert run['pairs_per_s'][phase] > 0
    assert run['first_step_losses'] and all(math.isfinite(x) for x in run['first_step_losses'])
    for path in run['checkpoint']:
        assert os.path.isfile(path)


def test_script_uses_no_more_threads_than_cores(sick_dir, tmp_path):
    """--threads was exported as it came: 100,000 crashed MXNet (found by a
    review).  More than the machine's cores are capped, with a warning."""
    cores = os.cpu_count() or 1
    out = tmp_path / 'run'
    proc = _run_script('--data', sick_dir, '--epochs', 1, '--train-limit', 20, '--dev-limit',
                       10, '--test-limit', 10, '--threads', 1000, '--no-progress', '--out', out)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert 'warning: --threads 1000 is more than the %d cores here; using %d' % (cores, cores) \
        in proc.stderr
    assert json.loads((out / 'results.json').read_text())['env']['OMP_NUM_THREADS'] == str(cores)


def test_script_end_to_end_both_modes(sick_dir, tmp_path):
    out = tmp_path / 'run'
    proc = _run_script('--data', sick_dir, '--mode', 'both', '--epochs', 2,
                       '--train-limit', 50, '--dev-limit', 30, '--test-limit', 30,
                       '--no-progress', '--out', out)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert 'ThreadedEnginePerDevice' in proc.stdout and 'OMP_NUM_THREADS=1' in proc.stdout

    results = json.loads((out / 'results.json').read_text())
    settings = results['settings']
    assert settings['epochs'] == 2 and settings['train_limit'] == 50
    assert settings['n_train'] == 50 and settings['n_dev'] == 30 and settings['n_test'] == 30
    assert settings['batch_size'] == 25 and settings['mode'] == 'both'
    assert results['env']['MXNET_ENGINE_TYPE'] == 'ThreadedEnginePerDevice'
    assert results['env']['OMP_NUM_THREADS'] == '1'
    assert results['versions']['mxnet'] == mx.__version__
    assert results['versions']['numpy'] == np.__version__
    assert results['wall_s'] > 0
    assert set(results['runs']) == {'per-sample', 'dynbatch'}
    for run in results['runs'].values():
        _check_run(run, 2)
    # 50 pairs at batch 25 = 2 steps per epoch; same seed and order in both modes.
    ps, db = (results['runs'][m]['first_step_losses'] for m in ('per-sample', 'dynbatch'))
    assert len(ps) == len(db) == 4
    np.testing.assert_allclose(db, ps, rtol=1e-3)
    assert results['step_loss_agreement']['steps'] == 4

    png = (out / 'learning_curves.png').read_bytes()
    assert png[:8] == b'\x89PNG\r\n\x1a\n'
    assert len(png) > 10_000


def test_script_missing_data_fails_clearly(tmp_path):
    missing = tmp_path / 'nonexistent'
    proc = _run_script('--data', missing, '--out', tmp_path / 'out', timeout=120)
    assert proc.returncode == 2
    assert str(missing) in proc.stderr
    assert 'fetch_and_preprocess' in proc.stderr and 'GLUON_DYNBATCH_SICK' in proc.stderr
    assert 'Traceback' not in proc.stderr
    assert not (tmp_path / 'out' / 'results.json').exists()


def test_script_malformed_data_and_bad_paths_fail_clearly(sick_dir, tmp_path):
    """A score outside [1, 5] (it trained on a wrong target before), a
    missing or malformed embeddings file and an output folder that cannot
    be made end the script with a message (exit 2), not a traceback."""
    import shutil
    data = tmp_path / 'sick'
    for split in ('train', 'dev', 'test'):
        shutil.copytree(sick_dir / split, data / split)
    sim = data / 'train' / 'sim.txt'
    lines = sim.read_text().split('\n')
    sim.write_text('\n'.join(['0.5'] + lines[1:]))
    blocked = tmp_path / 'file'
    blocked.write_text('not a folder')
    bad_vectors = tmp_path / 'bad.txt'      # (a traceback before, found by a review)
    bad_vectors.write_text('the 1 2 3\nA 4 5\n')
    # a zip (GloVe's form) and a file of no SICK word trained on with random
    # vectors of the size they seemed to give (found by a review)
    import zipfile
    zipped = tmp_path / 'glove.zip'
    with zipfile.ZipFile(zipped, 'w', zipfile.ZIP_DEFLATED) as archive:
        archive.writestr('glove.txt', 'the 1 2 3\n')
    foreign = tmp_path / 'foreign.txt'
    foreign.write_text('zzyzx 1 2 3\nqwxv 4 5 6\n')
    out = tmp_path / 'out'
    for argv, message in (
            (['--data', data, '--out', out], r'sim\.txt line 1: bad score'),
            (['--data', sick_dir, '--out', out, '--embeddings', tmp_path / 'no.txt'],
             'no.txt: no such file'),
            (['--data', sick_dir, '--out', out, '--train-limit', '20', '--embeddings',
              bad_vectors], 'bad.txt line 2'),
            (['--data', sick_dir, '--out', out, '--train-limit', '20', '--embeddings', zipped],
             r'glove\.zip is a zip archive: unpack it first'),
            (['--data', sick_dir, '--out', out, '--train-limit', '20', '--embeddings', foreign],
             r'foreign\.txt holds no vector for any of the \d+ tokens'),
            (['--data', sick_dir, '--out', blocked / 'out'], 'cannot create the output folder')):
        proc = _run_script(*argv, timeout=120)
        assert proc.returncode == 2, proc.stderr
        assert re.search(message, proc.stderr) and 'Traceback' not in proc.stderr


@pytest.mark.parametrize('argv, message', [
    (['--hidden-size', '0'], r'--hidden-size: 0; give a number >= 1'),
    (['--sim-hidden-size', '-5'], r'--sim-hidden-size: -5; give a number >= 1'),
    (['--embed-size', '0'], r'--embed-size: 0'),
    (['--threads', '0'], r'--threads: 0'),
    (['--lr', 'nan'], r'--lr: nan; give a number > 0'),
    (['--wd', '-1'], r'--wd: -1; give a number >= 0'),
    (['--epochs', 'x'], r"--epochs: 'x' is not a whole number"),
    (['--test-limit', '-1'], r'--test-limit: -1; give a number >= 0')])
def test_script_rejects_bad_numbers_with_a_message(argv, message, tmp_path):
    """Sizes of 0 ended in a trace failure's traceback, a negative one in
    Gluon's bare AssertionError, and --threads 0 was exported as
    OMP_NUM_THREADS (found by a review): argparse refuses them, exit 2."""
    proc = _run_script(*argv, '--out', tmp_path / 'out', timeout=120)
    assert proc.returncode == 2
    assert re.search(message, proc.stderr), proc.stderr
    assert 'Traceback' not in proc.stderr and not (tmp_path / 'out').exists()


def test_script_rejects_unknown_strategy(sick_dir, tmp_path):
    proc = _run_script('--data', sick_dir, '--strategy', 'nope', '--out', tmp_path,
                       timeout=120)
    assert proc.returncode == 2
    assert 'nope' in proc.stderr and 'depth' in proc.stderr


GLOVE_8D = """a 0.844 0.758 0.421 0.259 0.511 0.405 0.784 0.303
the 0.477 0.583 0.908 0.505 0.282 0.756 0.618 0.251
man 0.910 0.983 0.810 0.902 0.310 0.730 0.899 0.684
is 0.472 0.101 0.434 0.611 0.913 0.967 0.477 0.865
woman 0.260 0.805 0.549 0.014 0.720 0.399 0.825 0.668
dog 0.001 0.494 0.868 0.244 0.325 0.870 0.191 0.568
playing 0.239 0.968 0.803 0.448 0.080 0.320 0.508 0.933
. 0.109 0.551 0.707 0.547 0.814 0.540 0.964 0.603
"""


def test_script_trains_with_glove_vectors_of_its_own(sick_dir, tmp_path):
    """A reviewer's 8-d GloVe file: its training met a padding check whose
    absolute tolerance took float rounding for a wrong pad_lists claim, and
    the run stopped with an InputError (see block._close)."""
    glove = tmp_path / 'glove8.txt'
    glove.write_text(GLOVE_8D)
    proc = _run_script('--data', sick_dir, '--embeddings', glove, '--epochs', 1,
                       '--train-limit', 30, '--dev-limit', 20, '--test-limit', 20,
                       '--no-progress', '--out', tmp_path / 'run')
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert '(8-d, 8 of' in proc.stdout


def test_script_frozen_glove_embeddings(example, sick_dir, tmp_path):
    words = ['a', 'man', 'is', 'the', 'dog', 'woman', 'playing', 'zzz-not-in-sick']
    rng = np.random.RandomState(3)
    vectors = rng.uniform(-1, 1, size=(len(words), 8)).round(4).astype('float32')
    glove = tmp_path / 'tiny.glove.txt'
    glove.write_text(''.join('%s %s\n' % (w, ' '.join('%.4f' % x for x in v))
                             for w, v in zip(words, vectors)))
    out = tmp_path / 'run'
    proc = _run_script('--data', sick_dir, '--embeddings', glove, '--freeze-embeddings',
                       '--embed-size', 50,
                       '--epochs', 1, '--train-limit', 30, '--dev-limit', 20,
                       '--test-limit', 20, '--no-progress', '--out', out)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # a size that the file contradicts is dropped, and said so
    assert 'warning: --embed-size 50 ignored: %s holds 8-d vectors' % glove in proc.stderr
    results = json.loads((out / 'results.json').read_text())
    assert results['settings']['freeze_embeddings'] is True
    assert results['settings']['embeddings'] == str(glove)
    run = results['runs']['dynbatch']
    assert run['pretrained_found'] == len(words) - 1
    # the model's embedding size is the file's, and the header says so
    assert results['settings']['embed_size'] == 8
    assert '%s (8-d, %d of %d tokens found)' % (glove, len(words) - 1,
                                                 results['settings']['vocab_size']) in proc.stdout
    _check_run(run, 1)

    _, vocab = example.load_data(sick_dir, 1, 1, 1)
    saved = mx.nd.load(str(out / 'dynbatch-node.params'))
    key = [k for k in saved if k.endswith('embedding.weight')]
    assert len(key) == 1, sorted(saved)
    table = saved[key[0]].asnumpy()
    assert table.shape == (len(vocab), 8)
    for word, vec in zip(words[:-1], vectors[:-1]):
        np.testing.assert_array_equal(table[vocab[word]], vec)
    # The cell reads the 8-d vectors of the file.
    assert saved[[k for k in saved if k.endswith('i2h.weight')][0]].shape[1] == 8
