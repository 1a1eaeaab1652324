//! The simplify pass on small graphs written in text IR: exporters' GELU decompositions become
//! one `Gelu` node; anything that only looks like one stays as it is.

use mpc_ir::text;
use mpc_passes::{infer_types, Context, Pass, Simplify};

/// Runs inference and simplify over text-IR body lines; returns the printed graph's node lines.
fn simplified(body: &str) -> String {
    let src = format!("mpcir 1\nmodel ir_version=8\nopset \"\" 17\ngraph \"t\"\n{body}\nend\n");
    let mut g = text::parse(&src, None).unwrap();
    infer_types(&mut g).unwrap();
    Simplify.run(&mut g, &Context::default()).unwrap();
    infer_types(&mut g).unwrap();
    let printed = text::print(&g, text::TensorMode::Inline).unwrap().text;
    printed.lines().filter(|l| l.contains(" = ") && !l.trim_start().starts_with("init")).collect::<Vec<_>>().join("\n")
}

/// torch.onnx's erf GELU: x/√2, Erf, +1, ·x, ·0.5.
const ERF: &str = r#"  input %0 "x": f32[batch,16]
  init %1 "sqrt2" = f32[]{1.4142135}
  init %2 "one" = f32[]{1}
  init %3 "half" = f32[]{0.5}
  %4 "d": ? = Div(%0, %1)
  %5 "e": ? = Erf(%4)
  %6 "a": ? = Add(%5, %2)
  %7 "m": ? = Mul(%0, %6)
  %8 "y": ? = Mul(%7, %3)
  output %8"#;

#[test]
fn the_erf_decomposition_becomes_one_gelu() {
    let out = simplified(ERF);
    assert!(out.contains("\"y\": f32[batch,16] = Gelu(%0)"), "{out}");
    assert!(!out.contains("Erf") && !out.contains("Mul"), "{out}");
}

#[test]
fn torch_legacy_tanh_form_with_cast_constants_becomes_gelu_tanh() {
    // symbolic_opset9's gelu(approximate="tanh"): f64 constants, cast to f32.
    let g = r#"  input %0 "x": f32[batch,16]
  %1 "beta64": ? = Constant[value=f64[]{0.7978845608028654}]()
  %2 "beta": ? = Cast[to=1](%1)
  %3 "kappa64": ? = Constant[value=f64[]{0.044715}]()
  %4 "kappa": ? = Cast[to=1](%3)
  init %5 "one" = f32[]{1}
  init %6 "half" = f32[]{0.5}
  %7 "sq": ? = Mul(%0, %0)
  %8 "cube": ? = Mul(%0, %7)
  %9 "kc": ? = Mul(%4, %8)
  %10 "s": ? = Add(%0, %9)
  %11 "inner": ? = Mul(%2, %10)
  %12 "t": ? = Tanh(%11)
  %13 "a": ? = Add(%5, %12)
  %14 "xa": ? = Mul(%0, %13)
  %15 "y": ? = Mul(%6, %14)
  output %15"#;
    let out = simplified(g);
    assert!(out.contains("\"y\": f32[batch,16] = Gelu[approximate=\"tanh\"](%0)"), "{out}");
    assert!(!out.contains("Tanh("), "{out}");
}

#[test]
fn the_transformers_tanh_form_with_pow_becomes_gelu_tanh() {
    // Hugging Face's NewGELUActivation: 0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x^3))).
    let g = r#"  input %0 "x": f16[2,8,32]
  init %1 "three" = f16[]{3}
  init %2 "kappa" = f16[]{0.044715}
  init %3 "beta" = f16[]{0.7978846}
  init %4 "one" = f16[]{1}
  init %5 "half" = f16[]{0.5}
  %6 "p": ? = Pow(%0, %1)
  %7 "kc": ? = Mul(%2, %6)
  %8 "s": ? = Add(%0, %7)
  %9 "inner": ? = Mul(%3, %8)
  %10 "t": ? = Tanh(%9)
  %11 "hx": ? = Mul(%5, %0)
  %12 "a": ? = Add(%4, %10)
  %13 "y": ? = Mul(%11, %12)
  output %13"#;
    let out = simplified(g);
    assert!(out.contains("\"y\": f16[2,8,32] = Gelu[approximate=\"tanh\"](%0)"), "{out}");
}

#[test]
fn lookalikes_stay_as_they_are() {
    // A constant off by 20%.
    let off = ERF.replace("f32[]{0.5}", "f32[]{0.6}");
    assert!(!simplified(&off).contains("Gelu"));
    // The tanh form's constants around erf: neither GELU.
    let swapped = ERF.replace("Erf(%4)", "Tanh(%4)");
    assert!(!simplified(&swapped).contains("Gelu"));
    // An intermediate read outside the subgraph stays computed: no rewrite.
    let shared = ERF.replace("  output %8", "  output %8, %5");
    assert!(!simplified(&shared).contains("Gelu"), "{}", simplified(&shared));
    // Two different inputs.
    let two = ERF
        .replace("  input %0 \"x\": f32[batch,16]", "  input %0 \"x\": f32[batch,16]\n  input %9 \"z\": f32[batch,16]")
        .replace("Mul(%0, %6)", "Mul(%9, %6)");
    assert!(!simplified(&two).contains("Gelu"), "{}", simplified(&two));
    // A broadcast "x" that is not the output's shape.
    let wide = ERF.replace("Div(%0, %1)", "Div(%0, %9)").replace(
        "  init %1 \"sqrt2\" = f32[]{1.4142135}",
        "  init %1 \"sqrt2\" = f32[]{1.4142135}\n  input %9 \"w\": f32[16]",
    );
    assert!(!simplified(&wide).contains("Gelu"), "{}", simplified(&wide));
}
