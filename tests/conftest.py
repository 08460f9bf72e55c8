"""Seeded tests; a small hypothesis profile that CI can afford."""
import os
import random

import mxnet as mx
import numpy as np
import pytest
from hypothesis import settings

settings.register_profile('ci', max_examples=20, deadline=None, derandomize=True)
settings.load_profile(os.environ.get('HYPOTHESIS_PROFILE', 'ci'))


@pytest.fixture(autouse=True)
def _seed():
    random.seed(0)
    np.random.seed(0)
    mx.random.seed(0)
    yield
