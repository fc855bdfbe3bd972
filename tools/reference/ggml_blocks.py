#!/usr/bin/env python3
"""GGML block fixtures (tests/fixtures/ggml_blocks/) from gguf-py's quants.py.

For each of Q4_0, Q8_0, Q4_K, Q5_K, Q6_K:
  <type>.blocks.bin       random blocks (random codes and sub-block scales;
                          f16 block scales drawn from ordinary values and
                          extremes: 0, subnormals, +-65504), 2048 elements
  <type>.dequant.f32.bin  gguf-py `dequantize` of those blocks, float32 LE
and for the quantizers gguf-py implements (bit-exact with llama.cpp's
quantize_row_q4_0_ref / q8_0_ref):
  values.f32.bin          2048 float32 LE inputs with edge cases (all-zero
                          blocks, ties between +max and -max, exact .5
                          quotients, tiny and huge values)
  q4_0.quant.bin          gguf-py `quantize(values, Q4_0)`
  q8_0.quant.bin          gguf-py `quantize(values, Q8_0)`

The Rust tests (crates/kernels/src/ggml/tests.rs) compare bit for bit.

Environment: the pinned venv of tools/reference/README.md (numpy 2.4.6) and
gguf-py 0.19.0 from the llama-cpp-python 0.3.36 sdist (nothing is built):

  pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d /tmp/sd
  tar xzf /tmp/sd/llama_cpp_python-0.3.36.tar.gz -C /tmp/sd
  LLAMA_CPP_DIR=/tmp/sd/llama_cpp_python-0.3.36/vendor/llama.cpp \\
    tools/reference/.venv/bin/python tools/reference/ggml_blocks.py

Deterministic: re-running gives byte-identical files.
"""

import os
import sys
from pathlib import Path

import numpy as np

LLAMA = os.environ.get("LLAMA_CPP_DIR")
if not LLAMA:
    sys.exit("set LLAMA_CPP_DIR to the vendored llama.cpp of llama-cpp-python 0.3.36")
sys.path.insert(0, str(Path(LLAMA) / "gguf-py"))

import gguf  # noqa: E402
from gguf import GGMLQuantizationType as T  # noqa: E402
from gguf.quants import dequantize, quantize  # noqa: E402

assert np.__version__ == "2.4.6", np.__version__
OUT = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "ggml_blocks"
N = 2048

# name -> (type, block elements, block bytes, offsets of f16 block scales)
TYPES = {
    "q4_0": (T.Q4_0, 32, 18, [0]),
    "q8_0": (T.Q8_0, 32, 34, [0]),
    "q4_k": (T.Q4_K, 256, 144, [0, 2]),
    "q5_k": (T.Q5_K, 256, 176, [0, 2]),
    "q6_k": (T.Q6_K, 256, 210, [208]),
}


def f16_scales(rng, n):
    ordinary = (rng.uniform(1e-3, 1.0, n) * rng.choice([-1.0, 1.0], n)).astype(np.float16)
    extremes = np.array([0.0, 5.96e-8, 3.0e-6, 6.1e-5, 65504.0, -65504.0, 1.0, -0.5], dtype=np.float16)
    pick = rng.integers(0, 3, n)
    return np.where(pick == 0, extremes[rng.integers(0, len(extremes), n)], ordinary).astype(np.float16)


def random_blocks(rng, be, bb, offs):
    nb = N // be
    blocks = rng.integers(0, 256, (nb, bb), dtype=np.uint8)
    for o in offs:
        blocks[:, o : o + 2] = f16_scales(rng, nb).view(np.uint8).reshape(nb, 2)
    return blocks


def values(rng):
    v = rng.standard_normal(N).astype(np.float32)
    b = v.reshape(-1, 32)
    b[0] = 0.0  # all-zero block
    b[1] = np.linspace(-1, 1, 32, dtype=np.float32)  # +max and -max tie
    b[2] = np.arange(-16, 16, dtype=np.float32) * 0.5  # exact .5 quotients
    b[3] *= 1e-6
    b[4] *= 1e4
    b[5] = np.float32(3.0)  # constant block
    b[6] = -np.abs(b[6])
    b[7, ::2] = 8.5
    return v


def main():
    rng = np.random.default_rng(20260701)
    OUT.mkdir(parents=True, exist_ok=True)
    for name, (qt, be, bb, offs) in TYPES.items():
        blocks = random_blocks(rng, be, bb, offs)
        deq = dequantize(blocks.reshape(1, -1), qt).astype("<f4", copy=False)
        assert deq.shape == (1, N), deq.shape
        assert np.isfinite(deq).all(), name
        (OUT / f"{name}.blocks.bin").write_bytes(blocks.tobytes())
        (OUT / f"{name}.dequant.f32.bin").write_bytes(deq.tobytes())
    v = values(rng)
    (OUT / "values.f32.bin").write_bytes(v.astype("<f4").tobytes())
    for name, qt in [("q4_0", T.Q4_0), ("q8_0", T.Q8_0)]:
        q = quantize(v.reshape(1, -1), qt)
        (OUT / f"{name}.quant.bin").write_bytes(q.tobytes())
    print(f"wrote {OUT} (gguf-py {gguf.__file__})")


if __name__ == "__main__":
    main()
