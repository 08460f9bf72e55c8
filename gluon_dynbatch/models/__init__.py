"""Reusable per-sample models for the examples and benchmarks."""
from .treelstm import ChildSumTreeLSTMCell, Similarity, TreeLSTMNode, sick_score, sick_target

__all__ = ['ChildSumTreeLSTMCell', 'TreeLSTMNode', 'Similarity', 'sick_target', 'sick_score']
