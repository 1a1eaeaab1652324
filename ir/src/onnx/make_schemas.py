#!/usr/bin/env python3
"""Writes schemas.tsv: the signature of every ai.onnx operator version, from the `onnx` package.

One line per (op, since_version), tab-separated:
    op  since  deprecated  min_in  max_in  min_out  max_out  inputs  outputs  attributes  types
inputs/outputs: `name:type` joined by `,`; a suffix `?` marks an optional parameter, `*N` a
variadic one with at least N values (`*N~` when its values may have different types).
attributes: `name:kind` joined by `,` (`!` suffix: required); kinds as ONNX spells them, lower case.
types: `T=float|float16|...` joined by `;` (`tensor(x)` written `x`).
Run it with the onnx version pinned in .ci/requirements.txt: python3 make_schemas.py > schemas.tsv
"""
import sys

import onnx
from onnx import defs

OPT = {"Single": "", "Optional": "?", "Variadic": "*"}


def params(ps):
    out = []
    for p in ps:
        opt = OPT[p.option.name]
        if opt == "*":
            opt += str(p.min_arity) + ("" if p.is_homogeneous else "~")
        out.append(f"{p.name}:{p.type_str}{opt}")
    return ",".join(out) or "-"


def ty(t):
    return t[len("tensor("):-1] if t.startswith("tensor(") else t


def main():
    rows = []
    for s in defs.get_all_schemas_with_history():
        if s.domain not in ("", "ai.onnx"):
            continue
        attrs = ",".join(
            f"{n}:{a.type.name.lower()}{'!' if a.required else ''}" for n, a in sorted(s.attributes.items())
        ) or "-"
        types = ";".join(
            f"{t.type_param_str}={'|'.join(ty(x) for x in t.allowed_type_strs)}" for t in s.type_constraints
        ) or "-"
        rows.append((s.name, s.since_version, int(s.deprecated), s.min_input, s.max_input, s.min_output,
                     s.max_output, params(s.inputs), params(s.outputs), attrs, types))
    rows.sort(key=lambda r: (r[0], r[1]))
    sys.stdout.write(f"# ai.onnx operator signatures from onnx {onnx.__version__} (make_schemas.py)\n")
    for r in rows:
        sys.stdout.write("\t".join(str(x) for x in r) + "\n")


if __name__ == "__main__":
    main()
