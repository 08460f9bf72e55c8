"""gluon_dynbatch: just-in-time dynamic batching for MXNet Gluon."""
import re
import sys
from pathlib import Path

from setuptools import Extension, find_packages, setup

HERE = Path(__file__).parent

# pip resolves numpy before it reads python_requires, and numpy<1.24 fails to
# build on 3.12 with a traceback that names neither Python nor this package
if sys.version_info >= (3, 12):
    sys.exit('gluon_dynbatch needs Python 3.8 to 3.11 (this is %d.%d): it pins '
             'mxnet==1.9.1 and numpy<1.24, and numpy 1.23 has no wheel for 3.12 and '
             'does not build there. Make the venv with python3.11 -m venv .venv'
             % sys.version_info[:2])
VERSION = re.search(r"__version__ = '([^']+)'",
                    (HERE / 'gluon_dynbatch' / '__init__.py').read_text()).group(1)

setup(
    name='gluon_dynbatch',
    version=VERSION,
    description='Just-in-time dynamic batching for MXNet Gluon',
    long_description=(HERE / 'README.md').read_text() if (HERE / 'README.md').exists() else '',
    long_description_content_type='text/markdown',
    packages=find_packages(include=['gluon_dynbatch', 'gluon_dynbatch.*']),
    # C fast paths for recording (gluon_dynbatch/accel.py) and FusedAdaGrad's
    # CPU kernel (gluon_dynbatch/optim.py).  Optional: without a compiler the
    # install goes on and everything runs in pure Python and MXNet ops.
    # the recorder finds MXNet's autograd flags with dlsym: libdl before glibc 2.34
    ext_modules=[Extension('gluon_dynbatch._speedups', ['gluon_dynbatch/_speedups.c'],
                           depends=['gluon_dynbatch/_pycompat.h'],
                           libraries=['dl'] if sys.platform.startswith('linux') else [],
                           extra_compile_args=['-O2'], optional=True),
                 # -fno-math-errno lets the square roots vectorise; the
                 # arithmetic stays IEEE float32 (no -ffast-math); -fexceptions
                 # lets an MXNet error raised in a C++ function it calls
                 # unwind through it to the engine, which reports it
                 Extension('gluon_dynbatch._adagrad', ['gluon_dynbatch/_adagrad.c'],
                           depends=['gluon_dynbatch/_pycompat.h'],
                           extra_compile_args=['-O3', '-fno-math-errno', '-ffp-contract=off',
                                               '-fexceptions'],
                           optional=True)],
    python_requires='>=3.8,<3.12',
    install_requires=[
        'mxnet==1.9.1',
        'numpy>=1.16,<1.24',   # mxnet 1.9.1 breaks with numpy>=1.24
        'gluonnlp==0.10.0',
        'tqdm',
        'scipy',
        'matplotlib',
    ],
    extras_require={
        'test': ['pytest', 'hypothesis', 'sphinx'],   # the docs build is a test
        'docs': ['sphinx'],
    },
    license='Apache-2.0',
)
