#!/usr/bin/env python3
"""Runs an ONNX model in ONNX Runtime on the inputs autopar fed it and compares the outputs.

    python3 check_ort.py MODEL.onnx DIR [TOLERANCE]

DIR holds what `autopar run MODEL.onnx --forward --outputs DIR` wrote: `inputs.NAME.npy`
and `outputs.NAME.npy`. Every output must agree within TOLERANCE (default 1e-4) relative to
the output's largest magnitude: max|autopar - ort| <= TOLERANCE * max|ort|. Prints one line
per output and exits 1 on a mismatch (2 when ONNX Runtime or NumPy is missing).
"""

import os
import sys

try:
    import numpy as np
    import onnxruntime as ort
except ImportError as e:  # pragma: no cover
    print(f"check_ort: {e} (pip install onnxruntime numpy)", file=sys.stderr)
    sys.exit(2)


def main():
    model, folder = sys.argv[1], sys.argv[2]
    tolerance = float(sys.argv[3]) if len(sys.argv) > 3 else 1e-4
    files = sorted(os.listdir(folder))
    feeds = {f[len("inputs."):-len(".npy")]: np.load(os.path.join(folder, f))
             for f in files if f.startswith("inputs.")}
    ours = {f[len("outputs."):-len(".npy")]: np.load(os.path.join(folder, f))
            for f in files if f.startswith("outputs.")}
    session = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    results = dict(zip(names, session.run(None, feeds)))
    ok = bool(ours)
    for name, mine in ours.items():
        ref = results[name]
        if mine.shape != ref.shape:
            print(f"{name}: shape {mine.shape} vs ONNX Runtime's {ref.shape}")
            ok = False
            continue
        err = float(np.max(np.abs(mine.astype(np.float64) - ref.astype(np.float64))))
        scale = float(np.max(np.abs(ref)))
        rel = err / scale if scale > 0 else err
        good = rel <= tolerance
        ok = ok and good
        print(f"{name}: shape {ref.shape} max_abs_err={err:.3e} max|ort|={scale:.3e} "
              f"rel={rel:.3e} {'OK' if good else 'FAILED'}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
