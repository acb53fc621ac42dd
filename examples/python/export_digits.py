"""Exports scikit-learn's handwritten-digits dataset (1797 8x8 images, 10 classes; it ships inside the package,
no download) to a flat binary file the C++ demo reads: int32 n, int32 d, float32 x[n*d] (pixels / 16), int64 y[n].

Usage: python examples/python/export_digits.py OUT_PATH
"""
from __future__ import annotations

import struct
import sys

import numpy as np
from sklearn.datasets import load_digits


def main(path: str) -> None:
    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int64)
    with open(path, "wb") as f:
        f.write(struct.pack("<ii", x.shape[0], x.shape[1]))
        f.write(x.tobytes())
        f.write(y.tobytes())
    print(f"wrote {x.shape[0]} digits of {x.shape[1]} pixels to {path}")


if __name__ == "__main__":
    main(sys.argv[1])
