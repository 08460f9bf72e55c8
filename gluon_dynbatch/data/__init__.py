"""Data loading for the benchmarks: the SICK relatedness corpus with parse trees."""
from .sick import (DATA_ENV_VAR, REQUIRED_FILES, SPLITS, SickPair, Tree, build_tree,
                   build_vocab, find_sick_dir, index_pairs, load_split,
                   make_embedding_matrix)

__all__ = [
    'DATA_ENV_VAR', 'SPLITS', 'REQUIRED_FILES', 'find_sick_dir', 'Tree', 'build_tree',
    'SickPair', 'load_split', 'build_vocab', 'index_pairs', 'make_embedding_matrix',
]
