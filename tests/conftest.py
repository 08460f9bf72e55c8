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


@pytest.fixture(autouse=True)
def _fresh_padding_costs():
    """The cost model tunes these as it learns; give each test the defaults."""
    from gluon_dynbatch.plan import PADDING_COST
    saved = {k: (dict(v) if isinstance(v, dict) else v) for k, v in PADDING_COST.items()}
    yield
    for key, value in saved.items():
        if isinstance(value, dict):      # shared with the cost model: restore in place
            PADDING_COST[key].clear()
            PADDING_COST[key].update(value)
        else:
            PADDING_COST[key] = value


@pytest.fixture(autouse=True)
def _tanh_by_sigmoid_pays(monkeypatch):
    """Large steps compute tanh through sigmoid (lower.tanh_by_sigmoid)
    whatever this machine's probe would say, so that every test runs the
    same programs everywhere; test_lanes measures the probe itself."""
    from gluon_dynbatch import lower
    monkeypatch.setattr(lower, 'TANH_BY_SIGMOID_PAYS', {True: True, False: True})


@pytest.fixture(scope='module')
def sick_dir():
    """The SICK data folder; tests that need it skip when it is missing."""
    from gluon_dynbatch.data.sick import find_sick_dir
    try:
        return find_sick_dir()
    except FileNotFoundError as err:
        pytest.skip('SICK data not available: {}'.format(err))


@pytest.fixture(params=[True, False], ids=['C', 'python'])
def recorder(request):
    """Record in C (where built) or in Python."""
    from gluon_dynbatch import accel
    if request.param and accel.STATUS != 'C extension':
        pytest.skip(accel.STATUS)
    was_on = accel.record is not None
    accel.enable(request.param)
    yield request.param
    accel.enable(was_on)
