"""SICK semantic-relatedness data in the format of Tai et al. (2015).

The Tree-LSTM benchmark reads the SICK corpus as preprocessed by the scripts
of https://github.com/stanfordnlp/treelstm: one folder per split
(``train/``, ``dev/``, ``test/``), each holding line-aligned files

``a.toks`` / ``b.toks``
    space-separated tokens of the first / second sentence of each pair;
``a.parents`` / ``b.parents``
    for every token, the 1-based index of its head in the dependency parse
    (``0`` marks the root);
``sim.txt``
    the gold relatedness score, a float in ``[1, 5]``.

This module turns those files into :class:`SickPair` objects with a
:class:`Tree` per sentence, builds a vocabulary and an embedding matrix.  The
data are never bundled with the package: :func:`find_sick_dir` locates them.

Trees are built and walked without recursion so that arbitrarily deep parses
(or synthetic chains used in tests and benchmarks) never hit Python's
recursion limit.
"""
from __future__ import annotations

import logging
import math
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, List, Optional, Sequence, Tuple

import numpy as np

__all__ = [
    'DATA_ENV_VAR', 'SPLITS', 'REQUIRED_FILES', 'find_sick_dir', 'Tree', 'build_tree',
    'SickPair', 'load_split', 'build_vocab', 'index_pairs', 'make_embedding_matrix',
]

_LOG = logging.getLogger(__name__)

DATA_ENV_VAR = 'GLUON_DYNBATCH_SICK'
"""Environment variable naming the SICK data folder (used when no path is passed)."""

SPLITS = ('train', 'dev', 'test')
"""The split folders expected inside the data folder."""

REQUIRED_FILES = ('a.toks', 'b.toks', 'a.parents', 'b.parents', 'sim.txt')
"""Files every split folder must hold; ``*.rels`` and ``id.txt`` are not used."""

_DEFAULT_RELATIVE = Path('..') / 'shared' / 'data' / 'sick'
_HOW_TO_GET = (
    'Get the data with the preprocessing scripts of Tai et al. 2015 '
    '(https://github.com/stanfordnlp/treelstm: fetch_and_preprocess.sh), then pass '
    '--data PATH or set {} to the folder holding train/ dev/ test/.'.format(DATA_ENV_VAR))


# --------------------------------------------------------------------------
# Locating the data
# --------------------------------------------------------------------------

def _default_candidates() -> List[Path]:
    """Places to look when neither an argument nor the env var names the data.

    The repository root (parent of the package folder) comes first because
    the shared data sit next to the checkout; the working directory covers
    running from the repository root of an installed copy.
    """
    repo_root = Path(__file__).resolve().parents[2]
    candidates = [repo_root / _DEFAULT_RELATIVE, Path.cwd() / _DEFAULT_RELATIVE]
    unique = []
    for cand in candidates:
        if cand.resolve() not in [u.resolve() for u in unique]:
            unique.append(cand)
    return unique


def _missing_files(folder: Path) -> List[str]:
    """Relative names of the required files absent from ``folder``."""
    return [
        '{}/{}'.format(split, name)
        for split in SPLITS for name in REQUIRED_FILES
        if not (folder / split / name).is_file()
    ]


def _why_not(folder: Path) -> Optional[str]:
    """Reason ``folder`` is not a usable SICK folder, or None if it is."""
    if not folder.is_dir():
        return 'not a folder'
    missing = _missing_files(folder)
    if missing:
        shown = ', '.join(missing[:3]) + (', ...' if len(missing) > 3 else '')
        return 'missing {}'.format(shown)
    return None


def find_sick_dir(path=None) -> Path:
    """Locate the preprocessed SICK data folder.

    The folder is looked up so that the benchmarks run unchanged from a fresh
    checkout while still letting a user point elsewhere explicitly.

    Parameters
    ----------
    path : str or os.PathLike, optional
        Explicit folder.  When given it is the only place checked, so a typo
        is reported instead of silently falling back to another copy.

    Returns
    -------
    pathlib.Path
        The resolved folder holding ``train/``, ``dev/`` and ``test/``.

    Raises
    ------
    FileNotFoundError
        If no candidate holds the required files.  The message lists every
        place looked at (with the reason it was rejected) and how to get the
        data.

    Notes
    -----
    Search order: ``path``; else the environment variable ``DATA_ENV_VAR``
    (``GLUON_DYNBATCH_SICK``), which, like ``path``, is then the only place
    checked; else ``../shared/data/sick`` relative to the repository root
    and relative to the current working directory.
    """
    if path is not None:
        candidates = [Path(path).expanduser()]
    elif os.environ.get(DATA_ENV_VAR):
        candidates = [Path(os.environ[DATA_ENV_VAR]).expanduser()]
    else:
        candidates = _default_candidates()

    looked = []
    for cand in candidates:
        reason = _why_not(cand)
        if reason is None:
            return cand.resolve()
        looked.append('  {} ({})'.format(cand, reason))
    raise FileNotFoundError(
        'SICK data not found. Looked in:\n{}\n{}'.format('\n'.join(looked), _HOW_TO_GET))


# --------------------------------------------------------------------------
# Dependency trees
# --------------------------------------------------------------------------

class Tree:
    """A node of a dependency tree over a sentence.

    Parameters
    ----------
    idx : int
        0-based position of the node's token in the sentence, used to pick
        the token's embedding.
    children : list of Tree, optional
        Dependents of the token, in increasing token order.

    Notes
    -----
    ``__slots__`` keeps the many small nodes of a corpus cheap.  ``size`` and
    ``depth`` walk the tree with an explicit stack, so deep trees are safe.
    """

    __slots__ = ('idx', 'children')

    def __init__(self, idx: int, children: Optional[List['Tree']] = None):
        self.idx = idx
        self.children = [] if children is None else children

    def size(self) -> int:
        """Number of nodes in the subtree rooted here."""
        count, stack = 0, [self]
        while stack:
            node = stack.pop()
            count += 1
            stack.extend(node.children)
        return count

    def depth(self) -> int:
        """Number of nodes on the longest root-to-leaf path (a leaf has depth 1)."""
        best, stack = 0, [(self, 1)]
        while stack:
            node, d = stack.pop()
            best = max(best, d)
            stack.extend((child, d + 1) for child in node.children)
        return best

    def __repr__(self) -> str:
        # Summary rather than the nested structure: cheap and safe for deep trees.
        return 'Tree(idx={}, n_children={}, size={})'.format(
            self.idx, len(self.children), self.size())


def build_tree(parents: Sequence[int]) -> Tree:
    """Build a :class:`Tree` from a dependency parent list.

    Parameters
    ----------
    parents : sequence of int
        ``parents[i]`` is the 1-based position of token ``i``'s head, ``0``
        for the root and ``-1`` for a token left out of the tree (skipped).

    Returns
    -------
    Tree
        The root node.  Children are in increasing token order, which makes
        the tree (and so a model's computation order) deterministic.

    Raises
    ------
    ValueError
        If there is no root, several roots, a parent index out of range, or
        tokens that cannot be reached from the root (a cycle, or a token
        hanging off a skipped one).

    Notes
    -----
    Built by one pass over the tokens plus an explicit-stack reachability
    check, so no recursion limit applies however deep the tree is.
    """
    parents = [int(p) for p in parents]
    n = len(parents)
    nodes = [Tree(i) for i in range(n)]
    roots = []
    for i, p in enumerate(parents):
        if p == -1:
            continue
        if p == 0:
            roots.append(i)
        elif 1 <= p <= n:
            if parents[p - 1] == -1:
                raise ValueError('token {} has skipped token {} (parent -1) as its parent'
                                 .format(i, p - 1))
            nodes[p - 1].children.append(nodes[i])
        else:
            raise ValueError('token {} has parent {} outside 0..{}'.format(i, p, n))
    if not roots:
        raise ValueError('no root: no token has parent 0 (parents={})'.format(_short(parents)))
    if len(roots) > 1:
        raise ValueError('several roots: tokens {} all have parent 0'.format(roots))

    root = nodes[roots[0]]
    kept = sum(1 for p in parents if p != -1)
    reached = root.size()
    if reached != kept:
        raise ValueError('cycle: {} of {} tokens are not reachable from the root token {} '
                         '(parents={})'.format(kept - reached, kept, roots[0], _short(parents)))
    return root


def _short(seq: Sequence[int], limit: int = 20) -> str:
    """Readable prefix of a long list for error messages."""
    head = ' '.join(str(x) for x in seq[:limit])
    return '[{}{}]'.format(head, ' ...' if len(seq) > limit else '')


# --------------------------------------------------------------------------
# Pairs
# --------------------------------------------------------------------------

@dataclass
class SickPair:
    """One SICK sentence pair with its parses and relatedness score.

    Attributes
    ----------
    a_tokens, b_tokens : list of str
        Tokens of the two sentences.
    a_tree, b_tree : Tree
        Dependency trees; node ``idx`` indexes the token lists.
    score : float
        Gold relatedness in ``[1, 5]``.
    a_ids, b_ids : numpy.ndarray of int64, optional
        Vocabulary indices of the tokens, filled by :func:`index_pairs` so
        that the tokens are looked up once rather than every epoch.
    """

    a_tokens: List[str]
    b_tokens: List[str]
    a_tree: Tree
    b_tree: Tree
    score: float
    a_ids: Optional[np.ndarray] = None
    b_ids: Optional[np.ndarray] = None


def _read_lines(path: Path) -> List[str]:
    """Lines of a UTF-8 text file without newline characters, and without
    the blank lines that end it (an editor's extra newline; no SICK line is
    blank, and the files of a split must still align).

    Splits on ``'\\n'`` only (not ``str.splitlines``) so unusual Unicode
    separators inside a sentence cannot shift the line alignment.
    """
    raw = path.read_bytes()
    try:
        text = raw.decode('utf-8-sig')      # a byte-order mark is no part of the first token
    except UnicodeDecodeError as err:       # (err.start counts from after the mark)
        raise ValueError('{} line {}: not UTF-8 text ({})'.format(
            path, err.object.count(b'\n', 0, err.start) + 1, err.reason)) from None
    lines = [line.rstrip('\r') for line in text.split('\n')]
    while lines and not lines[-1].strip():
        lines.pop()
    return lines


def _read_split_files(split_dir: Path) -> dict:
    """Read the required files of a split and check they are line-aligned."""
    contents = {}
    for name in REQUIRED_FILES:
        path = split_dir / name
        if not path.is_file():
            raise FileNotFoundError('missing SICK file {}'.format(path))
        contents[name] = _read_lines(path)
    expected = len(contents['sim.txt'])
    for name, lines in contents.items():
        if len(lines) != expected:
            raise ValueError('{} has {} lines but {} has {}; the files of a split must be '
                             'line-aligned'.format(split_dir / name, len(lines),
                                                   split_dir / 'sim.txt', expected))
    return contents


def _parse_sentence(toks_line: str, parents_line: str, toks_path: Path, parents_path: Path,
                    line: int) -> Tuple[List[str], Tree]:
    """Tokens and tree of one sentence, from ``line`` (counted from 1) of
    the two files, which errors name (only then: formatting their places
    for every sentence took a third of the time to load SICK)."""
    tokens = toks_line.split(' ') if toks_line else []
    try:
        parents = [int(p) for p in parents_line.split()]
    except ValueError as err:
        raise ValueError('{} line {}: bad parent list: {}'.format(
            parents_path, line, err)) from None
    if len(parents) != len(tokens):
        raise ValueError('{} line {}: {} tokens but {} parents in {} line {}'.format(
            toks_path, line, len(tokens), len(parents), parents_path, line))
    try:
        tree = build_tree(parents)
    except ValueError as err:
        raise ValueError('{} line {}: {}'.format(parents_path, line, err)) from None
    return tokens, tree


def load_split(data_dir, split: str, limit: Optional[int] = None) -> List[SickPair]:
    """Load one split of SICK as a list of :class:`SickPair`.

    Parameters
    ----------
    data_dir : str or os.PathLike
        Folder holding the split folders, e.g. from :func:`find_sick_dir`.
    split : {'train', 'dev', 'test'}
        Which split to read.
    limit : int, optional
        Keep only the first ``limit`` pairs, for quick runs and tests.

    Returns
    -------
    list of SickPair
        Pairs in file order, with ``a_ids`` / ``b_ids`` still None.

    Raises
    ------
    ValueError
        For an unknown split, empty files, files with different line counts
        (naming the file), text that is not UTF-8, or a malformed line (a
        bad parent list or tree, a score outside [1, 5]; naming file and
        line number).
    FileNotFoundError
        If a required file is missing.
    """
    if split not in SPLITS:
        raise ValueError('unknown split {!r}; expected one of {}'.format(split, SPLITS))
    split_dir = Path(data_dir) / split
    files = _read_split_files(split_dir)
    if not files['sim.txt']:
        raise ValueError('{} holds no pairs: its files are empty'.format(split_dir))
    n = len(files['sim.txt']) if limit is None else min(limit, len(files['sim.txt']))

    pairs = []
    sides = [(files['{}.toks'.format(side)], files['{}.parents'.format(side)],
              split_dir / '{}.toks'.format(side), split_dir / '{}.parents'.format(side))
             for side in ('a', 'b')]
    for i in range(n):
        sentences = [_parse_sentence(toks[i], parents[i], toks_path, parents_path, i + 1)
                     for toks, parents, toks_path, parents_path in sides]
        try:
            score = float(files['sim.txt'][i])
        except ValueError:
            score = float('nan')
        if not 1.0 <= score <= 5.0:     # NaN too
            raise ValueError('{} line {}: bad score {!r}; SICK relatedness scores lie in '
                             '[1, 5]'.format(split_dir / 'sim.txt', i + 1,
                                             files['sim.txt'][i])) from None
        (a_tokens, a_tree), (b_tokens, b_tree) = sentences
        pairs.append(SickPair(a_tokens, b_tokens, a_tree, b_tree, score))
    return pairs


# --------------------------------------------------------------------------
# Vocabulary and embeddings
# --------------------------------------------------------------------------

def _numbers(fields: List[str]) -> bool:
    """Whether every field parses as a float (an empty one, from two spaces
    in a row, does not)."""
    try:
        [float(x) for x in fields]
    except ValueError:
        return False
    return True


COMPRESSED = ((b'PK\x03\x04', 'a zip archive'), (b'\x1f\x8b', 'gzip-compressed'),
              (b'\xfd7zXZ\x00', 'xz-compressed'))
"""Leading bytes of the compressed forms GloVe files come in (Stanford's are
zips), which read as text give a few 'vectors' of one or two numbers
(bzip2's, ``BZh`` and a digit, also begins text: its block header is
checked too, in :func:`_check_text_file`)."""


def _check_text_file(path: Path) -> None:
    """Raise a ValueError naming ``path`` when it is compressed or binary
    (a NUL byte in its first 4 KB; word2vec's binary format, say): read as
    text such a file yields no token of the vocabulary but a 'dimension',
    and training would go on with random vectors of that size."""
    with open(path, 'rb') as f:
        start = f.read(4096)
    kinds = [kind for magic, kind in COMPRESSED if start.startswith(magic)]
    if start[:3] == b'BZh' and start[3:4] in b'123456789' and start[4:10] == b'1AY&SY':
        kinds.append('bzip2-compressed')
    if kinds:
        raise ValueError('embedding file {} is {}: unpack it first and give the text file '
                         '(GloVe: one word and its numbers per line)'.format(path, kinds[0]))
    if b'\x00' in start:
        raise ValueError('embedding file {} is not a text file (it holds NUL bytes); give '
                         'vectors in GloVe\'s text format (one word and its numbers per '
                         'line), e.g. word2vec\'s binary files converted to text'.format(path))


def _finite(fields: List[str]) -> bool:
    """Whether every field is a finite number (``nan`` and ``inf`` parse)."""
    return all(math.isfinite(float(x)) for x in fields)


def _vocab_lines(path: Path, tokens: set) -> Tuple[List[str], int]:
    """The lines of GloVe file ``path`` whose token is in ``tokens``
    (``token v1 ... vD``, the token being all but the last D fields), and
    D, the dimension most of the first lines give.  Raises a ValueError
    naming the file (and the 1-based line) when it is compressed or binary
    (:func:`_check_text_file`), holds no vectors, or a wanted token's
    vector is not D finite numbers."""
    _check_text_file(path)

    def fields(raw):
        return raw.decode('utf8', errors='replace').rstrip('\r\n').rstrip(' ').split(' ')

    def header(number, parts):      # a word2vec-style first line: count and dimension
        return number == 1 and len(parts) == 2 and all(x.isdigit() for x in parts)

    with open(path, 'rb') as f:
        head = [fields(raw) for _, raw in zip(range(50), f)]
    sizes = [len(parts) - 1 for number, parts in enumerate(head, 1)
             if len(parts) > 1 and not header(number, parts)]
    if not sizes:
        raise ValueError('embedding file {} holds no vectors (lines of a word and its '
                         'numbers, separated by single spaces as in GloVe)'.format(path))
    dim = max(sizes, key=sizes.count)      # ties: the first line's
    picked, seen = [], set()
    with open(path, 'rb') as f:
        for number, raw in enumerate(f, 1):
            if number == 1 and raw.startswith(b'\xef\xbb\xbf'):
                raw = raw[3:]       # a byte-order mark
            first = raw.split(b' ', 1)[0].rstrip(b'\r\n').decode('utf8', errors='replace')
            if first not in tokens:
                continue            # a multi-word token's first word may be, below
            parts = fields(raw)
            if header(number, parts):
                continue
            if '' in parts[1:]:
                raise ValueError('{} line {}: the vector of {!r} is not {} numbers (one space '
                                 'between fields)'.format(path, number, first, dim))
            if len(parts) - 1 != dim and _numbers(parts[1:]):
                raise ValueError('{} line {}: {!r} has {} numbers, the file\'s vectors {}'
                                 .format(path, number, first, len(parts) - 1, dim))
            token = ' '.join(parts[:-dim])
            if token not in tokens or token in seen:
                continue            # a token with spaces, or met before (gluonnlp keeps the first)
            if not _numbers(parts[-dim:]):
                raise ValueError('{} line {}: the vector of {!r} is not {} numbers (one space '
                                 'between fields)'.format(path, number, token, dim))
            if not _finite(parts[-dim:]):
                raise ValueError('{} line {}: the vector of {!r} holds a NaN or an infinity'
                                 .format(path, number, token))
            seen.add(token)
            picked.append(' '.join(parts) + '\n')
    return picked, dim


def build_vocab(pair_lists: Iterable[Sequence[SickPair]]):
    """Build a vocabulary over every token of the given pairs.

    Parameters
    ----------
    pair_lists : iterable of list of SickPair
        E.g. ``[train, dev, test]``.  Including all splits (no minimum
        frequency) lets pretrained vectors cover test words, as in Tai et al.

    Returns
    -------
    gluonnlp.Vocab
        With gluonnlp's default ``<unk>``, ``<pad>``, ``<bos>``, ``<eos>``.
    """
    import gluonnlp as nlp

    counter = None
    for pairs in pair_lists:
        for pair in pairs:
            counter = nlp.data.count_tokens(pair.a_tokens, counter=counter)
            counter = nlp.data.count_tokens(pair.b_tokens, counter=counter)
    return nlp.Vocab(counter if counter is not None else nlp.data.count_tokens([]))


def index_pairs(pairs: Iterable[SickPair], vocab) -> None:
    """Fill ``a_ids`` / ``b_ids`` of each pair with vocabulary indices (in place).

    Parameters
    ----------
    pairs : iterable of SickPair
        Pairs to index.
    vocab : gluonnlp.Vocab
        Vocabulary; unknown tokens map to its unknown index.
    """
    for pair in pairs:
        pair.a_ids = np.asarray(vocab[list(pair.a_tokens)], dtype=np.int64).reshape(-1)
        pair.b_ids = np.asarray(vocab[list(pair.b_tokens)], dtype=np.int64).reshape(-1)


def make_embedding_matrix(vocab, dim: int = 300, path=None,
                          seed: int = 0) -> Tuple[np.ndarray, int]:
    """Embedding matrix for ``vocab``: random, or pretrained where available.

    Parameters
    ----------
    vocab : gluonnlp.Vocab
        Row ``i`` of the result is the vector of ``vocab.idx_to_token[i]``.
    dim : int, default 300
        Vector size when no file is given.  When ``path`` is given the
        file's dimension is used instead, since vectors cannot be resized.
    path : str or os.PathLike, optional
        GloVe-format text file (``word v1 v2 ...`` per line), read with
        ``gluonnlp.embedding.TokenEmbedding.from_file`` after the lines of
        the vocabulary's tokens are picked out (:func:`_vocab_lines`): a
        2 GB file then costs one pass, and lines whose token holds spaces
        (``glove.840B.300d.txt`` has some), a header line or bytes that are
        not UTF-8 do not stop it.
    seed : int, default 0
        Seed of the random init, so runs are reproducible.

    Returns
    -------
    matrix : numpy.ndarray of float32, shape ``(len(vocab), dim)``
        Rows of tokens found in the file hold their pretrained vectors; all
        other rows keep a ``N(0, 1) * 0.05`` random init.
    n_found : int
        Number of vocabulary tokens found in the file (0 without a file),
        to report pretrained coverage.
    """
    rng = np.random.RandomState(seed)
    if path is None:
        return (rng.normal(size=(len(vocab), dim)) * 0.05).astype(np.float32), 0

    import tempfile
    from gluonnlp.embedding import TokenEmbedding

    lines, file_dim = _vocab_lines(Path(path), set(vocab.idx_to_token))
    if not lines:
        _LOG.warning('embedding file %s holds no vector for any of the %d tokens; they keep '
                     'their random init', path, len(vocab))
        return (rng.normal(size=(len(vocab), file_dim)) * 0.05).astype(np.float32), 0
    with tempfile.TemporaryDirectory() as folder:
        picked = os.path.join(folder, 'vocab_vectors.txt')
        with open(picked, 'w', encoding='utf8') as out:
            if file_dim == 1:       # gluonnlp skips a first line of one number as a header
                out.write('%d 1\n' % len(lines))
            out.writelines(lines)
        # unknown_token=None: only tokens really in the file count as found.
        with warnings.catch_warnings():
            warnings.filterwarnings('ignore', message='line 0 in .* skipped likely header line')
            emb = TokenEmbedding.from_file(picked, elem_delim=' ', unknown_token=None)
    vectors = emb.idx_to_vec.asnumpy()
    if file_dim != dim:
        _LOG.info('embedding file %s has dimension %d, not %d; using %d',
                  path, file_dim, dim, file_dim)
    matrix = (rng.normal(size=(len(vocab), file_dim)) * 0.05).astype(np.float32)
    n_found = 0
    for i, token in enumerate(vocab.idx_to_token):
        j = emb.token_to_idx.get(token)
        if j is not None:
            matrix[i] = vectors[j]
            n_found += 1
    _LOG.info('pretrained vectors found for %d of %d tokens', n_found, len(vocab))
    return matrix, n_found
