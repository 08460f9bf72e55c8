"""What fused elementwise kernels could save a Tree-LSTM minibatch: a probe.

A batched child-sum Tree-LSTM step runs its gate arithmetic as ~13 small
MXNet operators.  This script writes two fused kernels through MXNet's C
library API (``mx.library.load``, compiled here with ``g++`` against the
``lib_api.h`` and ``lib_api.cc`` that ship in the mxnet wheel; forward
only, as a probe) and times each against the native operators it replaces,
both inside a CachedOp as batched steps run them, with one OpenMP thread:

* ``tl_gates``: the node's tail, ``c = sigmoid(i) tanh(u) + fsum`` and
  ``h = sigmoid(o) tanh(c)`` (natively 3 ``slice_axis``, 4 ``Activation``,
  2 ``elemwise_mul`` and an add);
* ``sig_mul``: the children's forget gates, ``sigmoid(a) * b``
  (natively ``Activation`` and ``elemwise_mul``).

It then runs ``auto`` on SICK minibatches (inference), reads each step's
calls from ``stats()``, and projects the saving per minibatch: each step's
tail at its calls and its forget gates at as many rows (each node is the
child of one parent, so a minibatch's child rows are its calls less its
roots).  It prints the ratio that the fusion would give at most, and writes
``<out>/fused_gates.json`` (``--out`` defaults to ``benchmarks/results/``;
with ``--quick`` to ``benchmarks/results/quick/``, so that a smoke run
leaves the published results alone).

    python benchmarks/fused_gates.py [--batch 256] [--minibatches 8] [--out DIR]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_OUT = os.path.join(HERE, 'results')
QUICK_OUT = os.path.join(DEFAULT_OUT, 'quick')
sys.path.insert(0, HERE)
import bench_treelstm as bt  # noqa: E402  (no MXNet import at module level)

KERNELS = r'''
#include <cmath>
#include "mxnet/lib_api.h"
using namespace mxnet::ext;

static inline float sigm(float x) { return 1.0f / (1.0f + std::exp(-x)); }
static inline float tanh_(float x) { return 1.0f - 2.0f / (std::exp(2.0f * x) + 1.0f); }

MXReturnValue gates(const std::unordered_map<std::string, std::string>& attrs,
                    std::vector<MXTensor>* in, std::vector<MXTensor>* out,
                    const OpResource& res) {
  const float* iou = in->at(0).data<float>();
  const float* fs = in->at(1).data<float>();
  float* c = out->at(0).data<float>();
  float* h = out->at(1).data<float>();
  const int64_t n = in->at(1).shape[0], H = in->at(1).shape[1];
  for (int64_t r = 0; r < n; ++r) {
    const float* i = iou + r * 3 * H; const float* o = i + H; const float* u = o + H;
    const float* f = fs + r * H; float* cr = c + r * H; float* hr = h + r * H;
    for (int64_t k = 0; k < H; ++k) {
      float cc = sigm(i[k]) * tanh_(u[k]) + f[k];
      cr[k] = cc;
      hr[k] = sigm(o[k]) * tanh_(cc);
    }
  }
  return MX_SUCCESS;
}

MXReturnValue sig_mul(const std::unordered_map<std::string, std::string>& attrs,
                      std::vector<MXTensor>* in, std::vector<MXTensor>* out,
                      const OpResource& res) {
  const float* a = in->at(0).data<float>();
  const float* b = in->at(1).data<float>();
  float* y = out->at(0).data<float>();
  const int64_t size = in->at(0).size();
  for (int64_t k = 0; k < size; ++k) y[k] = sigm(a[k]) * b[k];
  return MX_SUCCESS;
}

MXReturnValue no_backward(const std::unordered_map<std::string, std::string>& attrs,
                          std::vector<MXTensor>* in, std::vector<MXTensor>* out,
                          const OpResource& res) { return MX_FAIL; }

MXReturnValue two_in_two_out(const std::unordered_map<std::string, std::string>& attrs,
                             int* num_in, int* num_out) {
  *num_in = 2; *num_out = 2; return MX_SUCCESS; }
MXReturnValue two_in_one_out(const std::unordered_map<std::string, std::string>& attrs,
                             int* num_in, int* num_out) {
  *num_in = 2; *num_out = 1; return MX_SUCCESS; }
MXReturnValue same_type(const std::unordered_map<std::string, std::string>& attrs,
                        std::vector<int>* in, std::vector<int>* out) {
  for (auto& t : *out) t = (*in)[0];
  return MX_SUCCESS; }
MXReturnValue second_shape(const std::unordered_map<std::string, std::string>& attrs,
                           std::vector<std::vector<unsigned int>>* in,
                           std::vector<std::vector<unsigned int>>* out) {
  for (auto& s : *out) s = (*in)[1];
  return MX_SUCCESS; }

REGISTER_OP(tl_gates).setForward(gates, "cpu").setBackward(no_backward, "cpu")
    .setParseAttrs(two_in_two_out).setInferType(same_type).setInferShape(second_shape);
REGISTER_OP(tl_sig_mul).setForward(sig_mul, "cpu").setBackward(no_backward, "cpu")
    .setParseAttrs(two_in_one_out).setInferType(same_type).setInferShape(second_shape);
MXReturnValue initialize(int version) { return MX_SUCCESS; }
'''


def build_library(mx, folder):
    """Compile :data:`KERNELS` into ``folder``; the library's path."""
    root = os.path.dirname(mx.__file__)
    source, library = os.path.join(folder, 'fused.cc'), os.path.join(folder, 'libfused.so')
    with open(source, 'w') as f:
        f.write(KERNELS)
    subprocess.run(['g++', '-shared', '-fPIC', '-std=c++11', '-O3', '-ffast-math',
                    '-march=native', '-I', os.path.join(root, 'include'), source,
                    os.path.join(root, 'src', 'lib_api.cc'), '-o', library], check=True)
    return library


def programs(mx, hidden):
    """``{kernel: (native CachedOp, fused CachedOp, inputs(rows))}``."""
    iou, fsum = mx.sym.var('iou'), mx.sym.var('fsum')
    i, o, u = (mx.sym.slice_axis(iou, axis=1, begin=k * hidden, end=(k + 1) * hidden)
               for k in range(3))
    c = mx.sym.Activation(i, act_type='sigmoid') * mx.sym.Activation(u, act_type='tanh') + fsum
    h = mx.sym.Activation(o, act_type='sigmoid') * mx.sym.Activation(c, act_type='tanh')
    a, b = mx.sym.var('a'), mx.sym.var('b')
    gate = mx.sym.Activation(a, act_type='sigmoid') * b

    def draw(*shapes):
        return lambda rows: [mx.nd.random.uniform(-3, 3, (rows,) + shape) for shape in shapes]
    return {'tl_gates': (mx.nd.CachedOp(mx.sym.Group([c, h])),
                         mx.nd.CachedOp(mx.sym.tl_gates(iou, fsum)),
                         draw((3 * hidden,), (hidden,))),
            'tl_sig_mul': (mx.nd.CachedOp(gate), mx.nd.CachedOp(mx.sym.tl_sig_mul(a, b)),
                           draw((hidden,), (hidden,)))}


def time_call(mx, op, inputs, calls):
    mx.nd.waitall()
    start = time.perf_counter()
    for _ in range(calls):
        op(*inputs)
    mx.nd.waitall()
    return (time.perf_counter() - start) / calls * 1e6


def kernel_times(mx, progs, rows, repeats, calls):
    """``{kernel: (native us, fused us, max abs difference)}`` at ``rows``,
    native and fused interleaved, medians over ``repeats``."""
    out = {}
    for name, (native, fused, draw) in progs.items():
        inputs = draw(rows)
        diff = max(float(abs(x - y).max().asscalar())
                   for x, y in zip(_outputs(native(*inputs)), _outputs(fused(*inputs))))
        times = ([], [])
        for _ in range(repeats):
            for side, op in enumerate((native, fused)):
                times[side].append(time_call(mx, op, inputs, calls))
        out[name] = (statistics.median(times[0]), statistics.median(times[1]), diff)
    return out


def _outputs(result):
    return result if isinstance(result, (list, tuple)) else [result]


def build_parser():
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('--data', default=None)
    p.add_argument('--seed', type=bt.seed_int, default=0,
                   help='order of the SICK test pairs (0 to %d)' % bt.SEED_MAX)
    p.add_argument('--batch', type=bt.positive_int, default=256,
                   help='pairs a minibatch; (--minibatches + 4 warm-up) of them must fit in '
                        'the test split')
    p.add_argument('--minibatches', type=bt.positive_int, default=8)
    p.add_argument('--repeats', type=bt.positive_int, default=7)
    p.add_argument('--out', default=None,
                   help='folder for fused_gates.json (default %s; with --quick %s, so that '
                        'a smoke run leaves the published results alone)'
                        % (DEFAULT_OUT, QUICK_OUT))
    p.add_argument('--quick', action='store_true', help='smoke run: 2 minibatches, few timings')
    return p


def parse_args(argv=None):
    """The command line; ``--out`` defaults by ``--quick`` (no MXNet import)."""
    args = build_parser().parse_args(argv)
    if args.out is None:
        args.out = QUICK_OUT if args.quick else DEFAULT_OUT
    return args


def main(argv=None):
    args = parse_args(argv)
    os.environ.setdefault('MXNET_ENGINE_TYPE', 'ThreadedEnginePerDevice')
    os.environ['OMP_NUM_THREADS'] = '1'
    import mxnet as mx
    if args.quick:
        args.minibatches, args.repeats = 2, 2
    calls = 5 if args.quick else 50
    _, items, targets, vocab_size, embedding = bt.load_data(args)
    if (4 + args.minibatches) * args.batch > len(items):   # (else empty minibatches)
        build_parser().error('--batch %d x (--minibatches %d + 4 warm-up): more than the %d '
                             'pairs of the test split'
                             % (args.batch, args.minibatches, len(items)))
    with tempfile.TemporaryDirectory() as folder:
        mx.library.load(build_library(mx, folder), verbose=False)
    print('MXNET_ENGINE_TYPE=%s OMP_NUM_THREADS=1, minibatch %d, %d minibatches'
          % (os.environ['MXNET_ENGINE_TYPE'], args.batch, args.minibatches), flush=True)
    progs = programs(mx, bt.HIDDEN)

    ctx = bt.Forms(vocab_size, embedding, 0, wanted=['dynbatch-auto'])
    form = ctx.forms['dynbatch-auto']
    for start in range(0, 4 * args.batch, args.batch):             # warm-up
        form(items[start:start + args.batch]).asnumpy()
    from gluon_dynbatch import debug
    record_flush, sizes = debug.record_flush, []

    def recorded(plan, *rest, **kwargs):       # every flush's step sizes
        sizes.extend(plan.batch_sizes())
        return record_flush(plan, *rest, **kwargs)
    minibatch_ms, steps = [], []
    debug.record_flush = recorded
    try:
        for k in range(args.minibatches):
            pairs = items[(4 + k) * args.batch:(5 + k) * args.batch]
            del sizes[:]
            start = time.perf_counter()
            form(pairs).asnumpy()
            minibatch_ms.append((time.perf_counter() - start) * 1e3)
            steps.append(list(sizes))
    finally:
        debug.record_flush = record_flush

    cache = {}
    per_minibatch = []      # {kernel: (native ms, fused ms)} per minibatch
    for sizes in steps:
        # every step counts (the head's too, which have no such gates: the
        # saving is overstated slightly)
        sums = {name: [0.0, 0.0] for name in progs}
        for rows in sizes:
            if rows not in cache:
                cache[rows] = kernel_times(mx, progs, rows, args.repeats, calls)
            for name, (native, fused, _) in cache[rows].items():
                sums[name][0] += native / 1e3
                sums[name][1] += fused / 1e3
        per_minibatch.append(sums)
    saved = [sum(n - f for n, f in sums.values()) for sums in per_minibatch]
    mb_ms, saved_ms = statistics.median(minibatch_ms), statistics.median(saved)
    ratio = mb_ms / (mb_ms - saved_ms)
    shown = sorted(cache)
    for rows in sorted({shown[0], shown[len(shown) // 2], shown[-1]}):
        print('step of %4d rows: ' % rows + '; '.join(
            '%s native %.1f us, fused %.1f us (%.2fx, max diff %.1e)'
            % (name, n, f, n / f, d) for name, (n, f, d) in cache[rows].items()))
    for name in progs:
        print('%s per minibatch: native %.2f ms, fused %.2f ms (medians)' % (
            name, statistics.median(m[name][0] for m in per_minibatch),
            statistics.median(m[name][1] for m in per_minibatch)))
    print('auto, inference B=%d: %.2f ms a minibatch (median, %.1f steps); fused kernels '
          'would save %.2f ms of it: at most %.3fx'
          % (args.batch, mb_ms, statistics.median(len(s) for s in steps), saved_ms, ratio))
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, 'fused_gates.json')
    with open(path, 'w') as f:
        json.dump({'batch': args.batch, 'minibatch_ms': minibatch_ms, 'saved_ms': saved,
                   'at_most': ratio, 'engine': os.environ['MXNET_ENGINE_TYPE'],
                   'kernels_us': {str(rows): times for rows, times in sorted(cache.items())}},
                  f, indent=1)
    print('wrote %s' % path)


if __name__ == '__main__':
    main()
