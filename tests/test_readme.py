"""The README's user snippet, and the quickstart's for Gluon's own cells,
run as written and train."""
import re
from pathlib import Path

import numpy as np

README = Path(__file__).resolve().parents[1] / 'README.md'
QUICKSTART = README.parent / 'docs' / 'quickstart.rst'


def test_readme_snippet_runs_and_matches_unbatched():
    blocks = re.findall(r'```python\n(.*?)```', README.read_text(), re.S)
    assert blocks, 'README lost its python snippet'
    namespace = {}
    exec(compile(blocks[0], 'README.md', 'exec'), namespace)
    preds, loss = namespace['preds'], namespace['loss']
    assert np.isfinite(loss.asnumpy()).all()
    assert all(p.shape == (1, 5) for p in preds)
    # after the training step, batched and unbatched runs still agree
    import gluon_dynbatch as dyb
    encode, head, minibatch = namespace['encode'], namespace['head'], namespace['minibatch']
    with dyb.batching():
        lazy = [head(encode(l, el)[0], encode(r, er)[0]) for (l, el, r, er) in minibatch]
    plain = [head(encode(l, el)[0], encode(r, er)[0]) for (l, el, r, er) in minibatch]
    for a, b in zip(lazy, plain):
        np.testing.assert_allclose(a.asnumpy(), b.asnumpy(), rtol=1e-5, atol=1e-6)


def test_quickstart_cell_snippet_runs_and_matches_unbatched():
    import textwrap

    import mxnet as mx

    import gluon_dynbatch as dyb
    blocks = [textwrap.dedent(block) for block in re.findall(
        r'\.\. code-block:: python\n\n((?:   .*\n|\n)+)', QUICKSTART.read_text())]
    (block,) = [b for b in blocks if 'LSTMCell' in b]
    namespace = {}
    exec(compile(block, 'quickstart.rst', 'exec'), namespace)
    assert np.isfinite(namespace['loss'].asnumpy()).all()
    assert dyb.stats()['last']['batch_sizes'] == [3, 3, 2, 2, 1, 1, 3]
    cell, sequences = namespace['cell'], namespace['sequences']
    grad = cell.collect_params()[cell.block.prefix + 'h2h_weight'].grad().asnumpy().copy()
    with mx.autograd.record():
        plain = [namespace['last_output']([seq[t:t + 1] for t in range(len(seq))])
                 for seq in sequences]
        loss = mx.nd.concat(*plain, dim=0).sum()
    loss.backward()
    np.testing.assert_allclose(namespace['loss'].asnumpy(), loss.asnumpy(), rtol=1e-5)
    np.testing.assert_allclose(
        grad, cell.collect_params()[cell.block.prefix + 'h2h_weight'].grad().asnumpy(),
        rtol=1e-4, atol=1e-6)


def test_quickstart_split_state_snippet_batches_and_matches_unbatched():
    """The wrapper for a list argument that mixes shapes (LSTMPCell's
    [r, c]): it runs batched, with no per-sample warning, and equals the
    unbatched loop."""
    import textwrap
    import warnings

    import gluon_dynbatch as dyb
    blocks = [textwrap.dedent(block) for block in re.findall(
        r'\.\. code-block:: python\n\n((?:   .*\n|\n)+)', QUICKSTART.read_text())]
    (block,) = [b for b in blocks if 'LSTMPCell' in b]
    namespace = {}
    with warnings.catch_warnings():
        warnings.simplefilter('error', dyb.PerSampleWarning)
        exec(compile(block, 'quickstart.rst', 'exec'), namespace)
    assert dyb.stats()['last']['batch_sizes'] == [3, 3, 2, 2, 1, 1, 3]
    batched = dyb.concat_rows(namespace['outs']).asnumpy()
    assert batched.shape == (3, 4)
    plain = [namespace['last_output']([seq[t:t + 1] for t in range(len(seq))]).asnumpy()
             for seq in namespace['sequences']]
    np.testing.assert_allclose(batched, np.concatenate(plain), rtol=1e-5, atol=1e-6)
