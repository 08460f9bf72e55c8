"""Tests of the SICK data loading: trees, data lookup, splits, vocab, embeddings."""
import numpy as np
import pytest

from gluon_dynbatch.data import sick
from gluon_dynbatch.data.sick import (DATA_ENV_VAR, SickPair, Tree, build_tree, build_vocab,
                                      find_sick_dir, index_pairs, load_split,
                                      make_embedding_matrix)


def _structure(tree):
    """(idx, [children structures]) built iteratively, for easy comparison."""
    out = (tree.idx, [])
    stack = [(tree, out)]
    while stack:
        node, slot = stack.pop()
        for child in node.children:
            entry = (child.idx, [])
            slot[1].append(entry)
            stack.append((child, entry))
    return out


@pytest.fixture(scope='module')
def dev_pairs(sick_dir):
    return load_split(sick_dir, 'dev')


# -- trees -----------------------------------------------------------------

def test_build_tree_small():
    # "A dog runs": A <- dog <- runs(root); runs also heads token 3.
    tree = build_tree([2, 3, 0, 3])
    assert tree.idx == 2
    assert _structure(tree) == (2, [(1, [(0, [])]), (3, [])])
    assert [c.idx for c in tree.children] == [1, 3]  # increasing token order
    assert tree.size() == 4
    assert tree.depth() == 3
    assert 'idx=2' in repr(tree)


def test_build_tree_single_and_children_order():
    leaf = build_tree([0])
    assert leaf.idx == 0 and leaf.children == [] and leaf.size() == 1 and leaf.depth() == 1
    star = build_tree([3, 3, 0, 3, 3])
    assert [c.idx for c in star.children] == [0, 1, 3, 4]
    assert star.depth() == 2


def test_build_tree_skips_minus_one():
    tree = build_tree([2, 0, -1, 2])
    assert tree.size() == 3
    assert _structure(tree) == (1, [(0, []), (3, [])])


def test_tree_manual_construction():
    tree = Tree(0, [Tree(1), Tree(2, [Tree(3)])])
    assert tree.size() == 4 and tree.depth() == 3
    with pytest.raises(AttributeError):
        tree.other = 1  # __slots__


def test_deep_chain_no_recursion_error():
    n = 5000
    parents = [i + 2 for i in range(n - 1)] + [0]  # token i's head is token i+1
    tree = build_tree(parents)
    assert tree.idx == n - 1
    assert tree.size() == n
    assert tree.depth() == n
    repr(tree)


@pytest.mark.parametrize('parents, word', [
    ([2, 1], 'no root'),
    ([0, 0], 'several roots'),
    ([0, 3, 2], 'cycle'),
    ([0, 2], 'cycle'),          # self-loop
    ([0, 5], 'outside'),
    ([], 'no root'),
])
def test_build_tree_bad_parents(parents, word):
    with pytest.raises(ValueError, match=word):
        build_tree(parents)


# -- locating the data -----------------------------------------------------

def test_find_sick_dir_bad_path(tmp_path):
    bad = tmp_path / 'nope'
    with pytest.raises(FileNotFoundError) as info:
        find_sick_dir(bad)
    msg = str(info.value)
    assert str(bad) in msg
    assert 'treelstm' in msg and DATA_ENV_VAR in msg


def test_find_sick_dir_incomplete_folder(tmp_path):
    (tmp_path / 'train').mkdir()
    (tmp_path / 'train' / 'a.toks').write_text('x\n')
    with pytest.raises(FileNotFoundError, match='missing'):
        find_sick_dir(tmp_path)


def _fake_sick(root):
    for split in sick.SPLITS:
        (root / split).mkdir(parents=True)
        for name in sick.REQUIRED_FILES:
            (root / split / name).write_text('')
    return root


def test_find_sick_dir_env_var(tmp_path, monkeypatch):
    fake = _fake_sick(tmp_path / 'sick')
    monkeypatch.setenv(DATA_ENV_VAR, str(fake))
    assert find_sick_dir() == fake.resolve()
    # The explicit argument wins over the environment variable.
    other = _fake_sick(tmp_path / 'other')
    assert find_sick_dir(other) == other.resolve()


def test_find_sick_dir_env_var_bad(tmp_path, monkeypatch):
    bad = tmp_path / 'missing'
    monkeypatch.setenv(DATA_ENV_VAR, str(bad))
    with pytest.raises(FileNotFoundError, match='missing'):
        find_sick_dir()


def test_find_sick_dir_lists_defaults(tmp_path, monkeypatch):
    monkeypatch.delenv(DATA_ENV_VAR, raising=False)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sick, '_default_candidates',
                        lambda: [tmp_path / 'x1', tmp_path / 'x2'])
    with pytest.raises(FileNotFoundError) as info:
        find_sick_dir()
    assert str(tmp_path / 'x1') in str(info.value)
    assert str(tmp_path / 'x2') in str(info.value)


# -- loading splits ----------------------------------------------------------

def test_load_dev(dev_pairs):
    assert len(dev_pairs) == 500
    for pair in dev_pairs:
        assert isinstance(pair, SickPair)
        assert 1.0 <= pair.score <= 5.0
        assert pair.a_tree.size() == len(pair.a_tokens) > 0
        assert pair.b_tree.size() == len(pair.b_tokens) > 0
        assert pair.a_ids is None


def test_load_split_limit_and_bad_split(sick_dir):
    assert len(load_split(sick_dir, 'train', limit=7)) == 7
    with pytest.raises(ValueError, match='unknown split'):
        load_split(sick_dir, 'valid')


def _write_split(root, **files):
    """A ``dev`` split under ``root`` with the given files (``a_toks`` ->
    ``a.toks``, ``sim`` -> ``sim.txt``), one line per list item."""
    folder = root / 'dev'
    folder.mkdir()
    for key, lines in files.items():
        name = 'sim.txt' if key == 'sim' else key.replace('_', '.')
        (folder / name).write_text(''.join(line + '\n' for line in lines))


def test_load_split_line_mismatch(tmp_path):
    _write_split(tmp_path, a_toks=['A dog', 'A cat'], b_toks=['A dog', 'A cat'],
                 a_parents=['2 0', '2 0'], b_parents=['2 0'], sim=['3.5', '4.0'])
    with pytest.raises(ValueError, match='b.parents'):
        load_split(tmp_path, 'dev')


GOOD = dict(a_toks=['A dog', 'A cat'], b_toks=['A dog', 'A cat'], a_parents=['2 0', '2 0'],
            b_parents=['2 0', '2 0'], sim=['3.5', '4.0'])


@pytest.mark.parametrize('change,match', [
    (dict(sim=['3.5', '0.5']), r'sim\.txt line 2: bad score .0\.5.*\[1, 5\]'),
    (dict(sim=['nan', '4.0']), r'sim\.txt line 1: bad score .nan.'),
    (dict(sim=['3.5', 'high']), r'sim\.txt line 2: bad score .high.'),
    (dict(b_parents=['2 0', '2 x']), r'b\.parents line 2: bad parent list'),
    (dict(b_parents=['2 0', '0 0']), r'b\.parents line 2: several roots'),
    (dict(a_parents=['2 0', '1 2 0']), r'a\.toks line 2: 2 tokens but 3 parents in .*a\.parents'),
    (dict(a_toks=[], b_toks=[], a_parents=[], b_parents=[], sim=[]), 'holds no pairs'),
])
def test_error_load_split_names_file_and_line(tmp_path, change, match):
    _write_split(tmp_path, **dict(GOOD, **change))
    with pytest.raises(ValueError, match=match):
        load_split(tmp_path, 'dev')


def test_error_load_split_text_that_is_not_utf8(tmp_path):
    _write_split(tmp_path, **GOOD)
    (tmp_path / 'dev' / 'b.toks').write_bytes(b'A dog\nA caf\xe9\n')
    with pytest.raises(ValueError, match=r'b\.toks line 2: not UTF-8'):
        load_split(tmp_path, 'dev')


def test_load_split_drops_a_byte_order_mark(tmp_path):
    _write_split(tmp_path, **GOOD)
    (tmp_path / 'dev' / 'a.toks').write_bytes(b'\xef\xbb\xbfA dog\nA cat\n')
    assert load_split(tmp_path, 'dev')[0].a_tokens == ['A', 'dog']
    (tmp_path / 'dev' / 'a.toks').write_bytes(b'\xef\xbb\xbfA dog\nA caf\xe9\n')
    with pytest.raises(ValueError, match=r'a\.toks line 2: not UTF-8'):
        load_split(tmp_path, 'dev')


def test_load_split_ignores_blank_lines_at_the_end_of_a_file(tmp_path):
    """An extra newline (or a few, with spaces or CRs) at the end of some
    files of a split is not a line: the pairs load as without them.  A
    blank line inside a file still misaligns it, which the error says."""
    _write_split(tmp_path, **GOOD)
    folder = tmp_path / 'dev'
    (folder / 'sim.txt').write_text('3.5\n4.0\n\n')
    (folder / 'a.toks').write_text('A dog\nA cat\n \r\n\n')
    pairs = load_split(tmp_path, 'dev')
    assert [p.score for p in pairs] == [3.5, 4.0]
    assert pairs[1].a_tokens == ['A', 'cat']
    (folder / 'b.toks').write_text('A dog\n\nA cat\n')
    with pytest.raises(ValueError, match=r'b\.toks has 3 lines but .*sim\.txt has 2'):
        load_split(tmp_path, 'dev')


def test_glove_file_of_one_dimensional_vectors(tmp_path):
    """Vectors of one number each load (they were taken for headers and the
    file for one without vectors), the first token's included, and a
    word2vec-style header before them is still skipped."""
    for header in ('', '2 1\n'):
        path = tmp_path / 'glove1d.txt'
        path.write_text(header + 'dog 0.5\ncat -1.5\n')
        matrix, n_found = make_embedding_matrix(_toy_vocab(), path=path)
        assert n_found == 2 and matrix.shape[1] == 1
        assert matrix[_toy_vocab()['dog'], 0] == 0.5
        assert matrix[_toy_vocab()['cat'], 0] == -1.5


def test_glove_file_with_a_byte_order_mark(tmp_path):
    path = tmp_path / 'glove.txt'
    path.write_bytes(b'\xef\xbb\xbfdog 1 2 3\ncat 4 5 6\n')
    matrix, n_found = make_embedding_matrix(_toy_vocab(), path=path)
    assert n_found == 2
    np.testing.assert_allclose(matrix[_toy_vocab()['dog']], [1, 2, 3])


def test_load_split_small_fake(tmp_path):
    _write_split(tmp_path, a_toks=['A dog runs'], b_toks=['Dogs'], a_parents=['2 3 0'],
                 b_parents=['0'], sim=['4.5'])
    (pair,) = load_split(tmp_path, 'dev')
    assert pair.a_tokens == ['A', 'dog', 'runs'] and pair.b_tokens == ['Dogs']
    assert _structure(pair.a_tree) == (2, [(1, [(0, [])])])
    assert pair.score == 4.5


# -- vocabulary and embeddings -----------------------------------------------

def test_vocab_round_trip(dev_pairs):
    pairs = dev_pairs[:50]
    vocab = build_vocab([pairs[:25], pairs[25:]])
    index_pairs(pairs, vocab)
    for pair in pairs:
        for ids, tokens in ((pair.a_ids, pair.a_tokens), (pair.b_ids, pair.b_tokens)):
            assert ids.dtype == np.int64 and ids.shape == (len(tokens),)
            assert vocab.to_tokens(ids.tolist()) == tokens
            assert vocab.unknown_token not in vocab.to_tokens(ids.tolist())


def test_vocab_round_trip_fake():
    a = SickPair(['a', 'b'], ['b'], build_tree([0, 1]), build_tree([0]), 3.0)
    vocab = build_vocab([[a]])
    assert {'a', 'b', '<unk>', '<pad>'} <= set(vocab.idx_to_token)
    index_pairs([a], vocab)
    assert vocab.to_tokens(a.a_ids.tolist()) == ['a', 'b']
    assert vocab.to_tokens(a.b_ids.tolist()) == ['b']


def _toy_vocab():
    pair = SickPair(['the', 'dog', 'runs'], ['a', 'cat'], build_tree([2, 3, 0]),
                    build_tree([2, 0]), 2.0)
    return build_vocab([[pair]])


def test_embedding_random_default():
    vocab = _toy_vocab()
    m1, n1 = make_embedding_matrix(vocab, dim=8, seed=3)
    m2, _ = make_embedding_matrix(vocab, dim=8, seed=3)
    m3, _ = make_embedding_matrix(vocab, dim=8, seed=4)
    assert m1.shape == (len(vocab), 8) and m1.dtype == np.float32
    assert n1 == 0
    np.testing.assert_array_equal(m1, m2)
    assert not np.array_equal(m1, m3)
    assert np.abs(m1).max() < 1.0  # small init


def test_embedding_from_glove_file(tmp_path):
    vocab = _toy_vocab()
    glove = {
        'dog': [0.1, 0.2, 0.3, 0.4],
        'cat': [-1.0, 0.5, 2.0, 3.5],
        'the': [1.0, 1.0, 1.0, 1.0],
        'zebra': [9.0, 9.0, 9.0, 9.0],  # not in the vocabulary
    }
    path = tmp_path / 'glove.txt'
    path.write_text(''.join('{} {}\n'.format(w, ' '.join(map(str, v)))
                            for w, v in glove.items()))
    random_m, _ = make_embedding_matrix(vocab, dim=4, seed=0)
    matrix, n_found = make_embedding_matrix(vocab, dim=300, path=path, seed=0)
    assert matrix.shape == (len(vocab), 4)  # the file's dimension wins
    assert matrix.dtype == np.float32
    assert n_found == 3
    for word in ('dog', 'cat', 'the'):
        np.testing.assert_allclose(matrix[vocab[word]], glove[word], rtol=1e-6)
    for word in ('runs', 'a', '<unk>'):
        np.testing.assert_array_equal(matrix[vocab[word]], random_m[vocab[word]])


def test_glove_file_with_spaced_tokens_a_header_and_bad_bytes(tmp_path, caplog):
    """glove.840B.300d.txt has tokens with spaces ('. . .'); word2vec-style
    files start with a header; some files hold bytes that are not UTF-8.
    Only the vocabulary's lines are handed to gluonnlp, so none of these
    stops the load (gluonnlp failed on the first two)."""
    vocab = _toy_vocab()
    path = tmp_path / 'glove.txt'
    path.write_bytes(b'5 3\n'
                     b'dog 1 2 3\n'
                     b'. . . 4 5 6\n'
                     b'New York 7 8 9\n'
                     b'caf\xe9 1 1 1\n'
                     b'cat -1 0.5 2\r\n'
                     b'dog 9 9 9 \n')
    matrix, n_found = make_embedding_matrix(vocab, path=path)
    assert matrix.shape == (len(vocab), 3) and n_found == 2
    np.testing.assert_allclose(matrix[vocab['dog']], [1, 2, 3])      # the first line wins
    np.testing.assert_allclose(matrix[vocab['cat']], [-1, 0.5, 2])


@pytest.mark.parametrize('text,match', [
    ('', 'holds no vectors'),
    ('dog 1 2 3\ncat 1 2\n', r'line 2: .cat. has 2 numbers, the file.s vectors 3'),
    ('dog 1 2 3\ncat 1 x 3\n', r'line 2: the vector of .cat. is not 3 numbers'),
    ('dog 1 2 3\ncat 4 5 6 7\n', r'line 2: .cat. has 4 numbers, the file.s vectors 3'),
    ('dog 1 2 3\ncat\n', r'line 2: .cat. has 0 numbers'),
    ('dog 1 2 3\ncat  4 5 6\n', r'line 2: the vector of .cat. is not 3 numbers \(one space'),
    # a NaN trained to a NaN loss, and the run ended well (found by a review)
    ('dog 1 nan 3\n', r'line 1: the vector of .dog. holds a NaN or an infinity'),
    ('dog 1 2 3\ncat 1 2 -inf\n', r'line 2: the vector of .cat. holds a NaN or an infinity'),
])
def test_error_glove_file_names_file_and_line(tmp_path, text, match):
    path = tmp_path / 'glove.txt'
    path.write_text(text)
    with pytest.raises(ValueError, match=r'glove\.txt.*' + match):
        make_embedding_matrix(_toy_vocab(), path=path)


@pytest.mark.parametrize('opener,kind', [('zip', 'a zip archive'), ('gzip', 'gzip'),
                                         ('bz2', 'bzip2'), ('lzma', 'xz'), (None, 'NUL bytes')])
def test_error_glove_file_compressed_or_binary(tmp_path, opener, kind):
    """GloVe comes as a zip: read as text it gave a 'dimension' of 1 or 2,
    no token, and training went on with those random vectors."""
    import bz2
    import gzip
    import lzma
    import zipfile
    text = b'dog 1 2 3\ncat 4 5 6\n'
    path = tmp_path / 'glove.bin'
    if opener == 'zip':
        with zipfile.ZipFile(path, 'w', zipfile.ZIP_DEFLATED) as archive:
            archive.writestr('glove.txt', text)
    elif opener is None:
        path.write_bytes(b'dog \x00\x00\x80?\x00\x00\x00@\n')     # word2vec's binary
    else:
        path.write_bytes({'gzip': gzip, 'bz2': bz2, 'lzma': lzma}[opener].compress(text))
    with pytest.raises(ValueError, match=r'glove\.bin .*' + kind):
        make_embedding_matrix(_toy_vocab(), path=path)


def test_a_glove_word_that_starts_like_a_compressed_file_is_text(tmp_path):
    """'BZh' and a digit begin bzip2 files and also words: only the whole
    block header marks a file compressed (a review found 'BZh' refused)."""
    path = tmp_path / 'glove.txt'
    path.write_text('BZh9 0.1 0.2 0.3\ndog 1 2 3\n')
    matrix, n_found = make_embedding_matrix(_toy_vocab(), path=path)
    assert n_found == 1 and matrix.shape[1] == 3


def test_glove_file_without_vocabulary_words_keeps_the_random_init(tmp_path):
    path = tmp_path / 'glove.txt'
    path.write_text('zebra 1 2 3\nyak 4 5 6\n')
    matrix, n_found = make_embedding_matrix(_toy_vocab(), path=path, seed=0)
    assert n_found == 0 and matrix.shape == (len(_toy_vocab()), 3)
    assert np.abs(matrix).max() < 1.0


def test_error_missing_glove_file_names_it(tmp_path):
    with pytest.raises(FileNotFoundError, match='nowhere.txt'):
        make_embedding_matrix(_toy_vocab(), path=tmp_path / 'nowhere.txt')


def test_sick_target_puts_the_mass_on_the_two_classes_around_the_score():
    from gluon_dynbatch.models import sick_target
    np.testing.assert_allclose(sick_target([1.0, 3.25, 5.0]),
                               [[1, 0, 0, 0, 0], [0, 0, 0.75, 0.25, 0], [0, 0, 0, 0, 1]])
    for bad in (0.5, 5.5, float('nan')):      # wrapped round to the last classes before
        with pytest.raises(ValueError, match=r'outside \[1, 5\]'):
            sick_target(bad)
