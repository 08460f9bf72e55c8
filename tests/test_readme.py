"""The README's user snippet runs as written and trains."""
import re
from pathlib import Path

import numpy as np

README = Path(__file__).resolve().parents[1] / 'README.md'


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
