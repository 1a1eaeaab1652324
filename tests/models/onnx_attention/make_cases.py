#!/usr/bin/env python3
"""ONNX's own test cases of the `Attention` operator (opset 23 and later), as the onnx package
generates them (its node test case generators and numpy reference implementation), written in
the layout of the ONNX backend node tests:

    NAME/model.onnx
    NAME/test_data_set_0/input_J.pb, output_J.pb

The onnx-node-tests set beside a checkout leaves this operator out; tests/onnx_attention.rs runs
these. Regenerate with `python3 tests/models/onnx_attention/make_cases.py` (needs onnx and numpy;
the committed cases came from onnx 1.23.2).
"""

import os
import shutil

import numpy as np
import onnx
from onnx import numpy_helper
from onnx.backend.test.case.node import collect_testcases

HERE = os.path.dirname(os.path.abspath(__file__))


def main():
    for entry in os.listdir(HERE):
        if entry.startswith("test_"):
            shutil.rmtree(os.path.join(HERE, entry))
    cases = [c for c in collect_testcases("Attention") if "_expanded" not in c.name]
    for case in cases:
        folder = os.path.join(HERE, case.name)
        data = os.path.join(folder, "test_data_set_0")
        os.makedirs(data)
        onnx.save(case.model, os.path.join(folder, "model.onnx"))
        (inputs, outputs) = case.data_sets[0]
        graph = case.model.graph
        for kind, values, infos in (("input", inputs, graph.input), ("output", outputs, graph.output)):
            for j, (value, info) in enumerate(zip(values, infos)):
                t = value if isinstance(value, onnx.TensorProto) else numpy_helper.from_array(np.asarray(value), info.name)
                with open(os.path.join(data, f"{kind}_{j}.pb"), "wb") as f:
                    f.write(t.SerializeToString())
    print(f"{len(cases)} cases, onnx {onnx.__version__}")


if __name__ == "__main__":
    main()
