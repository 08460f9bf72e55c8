"""The documentation builds with warnings as errors (``sphinx-build -W``).

Skipped where sphinx is not installed (``pip install -e ".[docs]"``).  The
build needs neither network access nor the SICK data.
"""
import os
import subprocess
import sys

import pytest

pytest.importorskip('sphinx')

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.integration
def test_docs_build_without_warnings(tmp_path):
    out = tmp_path / 'html'
    proc = subprocess.run(
        [sys.executable, '-m', 'sphinx', '-W', '-b', 'html', '-d', str(tmp_path / 'doctrees'),
         os.path.join(ROOT, 'docs'), str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, 'sphinx-build failed:\n%s\n%s' % (proc.stdout[-4000:],
                                                                   proc.stderr[-4000:])
    for page in ('index', 'quickstart', 'design', 'cost_model', 'rules', 'performance', 'api'):
        assert (out / ('%s.html' % page)).is_file(), page
