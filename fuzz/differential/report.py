"""The campaign's counts and its final report (docs/differential.md, "The report")."""

import collections

import harness as hs
from allowlist import allowlisted, invalid_allowlisted


class Report:
    def __init__(self):
        self.c = collections.Counter()
        self.by = collections.defaultdict(collections.Counter)
        self.classes = collections.OrderedDict()
        self.examples = collections.defaultdict(dict)
        self._index = None

    def note(self, section, reason):
        """Counts one graph under a reason of a section, keeping the first few graphs' numbers."""
        self.by[section][reason] += 1
        ex = self.examples[section].setdefault(reason, [])
        if len(ex) < 5:
            ex.append(self._index)

    def add(self, res):
        """Counts one graph's result; returns its failure class (kind, op or signature, detail) or
        None."""
        c = self.c
        self._index = res["index"]
        c["generated"] += 1
        kind = res["kind"]
        if kind == "generator_rejected":
            c["generator rejected"] += 1
            self.note("generator rejected", res["message"][:70])
            return None
        if kind == "harness_error":
            c["harness errors"] += 1
            self.note("harness errors", res["message"].strip().splitlines()[-1][:150])
            return None
        if kind == "oracle_refused":
            c["oracle refused"] += 1
            self.note("oracle refused", hs.refusal_reason(res["message"], 12))
            return None
        c["run"] += 1
        for op in set(res.get("ops", [])):
            self.by["ops run"][op] += 1
        if kind == "refused":
            c["mpc refused"] += 1
            self.note("mpc refused", hs.refusal_reason(res["message"]))
            return None
        if kind in ("matched", "ill_conditioned"):
            c["matched"] += 1
            if kind == "ill_conditioned":
                c["ill-conditioned (counted as matched)"] += 1
                if res.get("amplified"):
                    self.note("ill-conditioned (counted as matched)", f"upstream rounding amplified by {res['amplified']}")
                else:
                    self.note("ill-conditioned (counted as matched)", "onnxruntime moves as much under input jitter")
        if kind == "mismatch":
            node = res.get("node", {})
            entry = allowlisted(res)
            op = node.get("op", "?")
            if entry:
                res["allowlisted"] = entry["id"]
                c["mismatched, allowlisted"] += 1
                self.note("mismatched, allowlisted", f"{op} ({entry['id']})")
                return ("allowed", op, entry["id"])
            c["mismatched"] += 1
            self.note("mismatched", op)
            return ("mismatch", op, "")
        if kind in ("crash", "timeout"):
            c["crashed" if kind == "crash" else "timeouts"] += 1
            note = " [onnxruntime refused the graph]" if res.get("oracle_refused") else ""
            self.note("crashed" if kind == "crash" else "timeouts", res["signature"] + note)
            return (kind, res["signature"], "")
        if kind == "onnx_shape":
            op = res.get("node", {}).get("op", "?")
            c["agrees with onnxruntime, not onnx shape inference"] += 1
            self.note("agrees with onnxruntime, not onnx shape inference", f"{op} (reference: {res.get('reference')})")
            return ("onnx_shape", op, "")
        mixed = res.get("mixed")
        if mixed is None:
            return None
        if mixed in ("mixed_matched", "mixed_ill_conditioned", "mixed_mismatch"):
            c["mixed checked"] += 1
        if mixed == "mixed_ill_conditioned":
            c["mixed ill-conditioned (counted as matched)"] += 1
        if mixed == "mixed_oracle_disagrees":
            c["mixed checked"] += 1
            c["mixed: onnxruntime disagrees, reference sides with mpc"] += 1
            self.note("mixed: onnxruntime disagrees, reference sides with mpc", res.get("node", {}).get("op", "?"))
        if mixed == "mixed_mismatch":
            op = res.get("node", {}).get("op", "?")
            c["mixed mismatched"] += 1
            self.note("mixed mismatched", op)
            return ("mixed_mismatch", op, "")
        if mixed == "invalid_model":
            entry = invalid_allowlisted(res["mixed_message"])
            if entry:
                res["allowlisted"] = entry["id"]
                c["invalid models written, allowlisted"] += 1
                self.note("invalid models written, allowlisted", entry["id"])
                return ("allowed", "invalid model", entry["id"])
            c["invalid models written"] += 1
            self.note("invalid models written", hs.refusal_reason(res["mixed_message"], 10))
            return ("invalid_model", hs.refusal_reason(res["mixed_message"], 6), "")
        if mixed in ("mixed_crash", "mixed_timeout"):
            c["mixed crashed"] += 1
            self.note("mixed crashed", res["mixed_signature"])
            return ("mixed_crash", res["mixed_signature"], "")
        if mixed == "mixed_refused":
            c["mixed refused"] += 1
            self.note("mixed refused", hs.refusal_reason(res["mixed_message"]))
        if mixed == "mixed_oracle_refused":
            c["mixed oracle refused"] += 1
            self.note("mixed oracle refused", hs.refusal_reason(res["mixed_message"], 12))
        return None

    ORDER = ["generated", "generator rejected", "harness errors", "oracle refused", "run", "matched",
             "ill-conditioned (counted as matched)", "mismatched", "mismatched, allowlisted",
             "agrees with onnxruntime, not onnx shape inference", "mpc refused",
             "crashed", "timeouts", "mixed checked", "mixed ill-conditioned (counted as matched)",
             "mixed: onnxruntime disagrees, reference sides with mpc", "mixed mismatched", "invalid models written",
             "invalid models written, allowlisted", "mixed crashed", "mixed refused", "mixed oracle refused"]

    def text(self, wall):
        lines = [f"== differential campaign: {self.c['generated']} graphs in {wall:.0f} s"]
        for k in self.ORDER:
            lines.append(f"{k:44s} {self.c[k]}")
            for reason, n in self.by[k].most_common(40 if k != "oracle refused" else 12):
                ex = self.examples[k].get(reason, [])
                lines.append(f"    {n:6d}  {reason}" + (f"  (graphs {', '.join(map(str, ex))})" if ex else ""))
        if self.classes:
            lines.append("== failure classes (kind, op or signature): count, first graph, reproducer")
            for key, v in self.classes.items():
                lines.append(f"  {key[0]:15s} {key[1][:90]}  x{v['count']}  graph {v['first']}  "
                             f"{', '.join(v['repros']) or '-'}")
        ops = self.by["ops run"]
        lines.append(f"== ops in graphs mpc ran ({len(ops)} op types): " +
                     ", ".join(f"{op} {n}" for op, n in sorted(ops.items())))
        return "\n".join(lines)

    def json(self, wall):
        return {"counts": dict(self.c), "by": {k: dict(v) for k, v in self.by.items()}, "wall_s": wall,
                "examples": {k: dict(v) for k, v in self.examples.items()},
                "classes": [{"kind": k[0], "key": k[1], **v} for k, v in self.classes.items()]}
