//! Colouring and cast rules on small graphs, adapted from TF grappler's auto_mixed_precision
//! scenarios. Class stand-ins: MatMul is low (allow), Exp is f32 (deny), Sigmoid follows (infer),
//! Relu is data movement (clear).

use mpc_ir::{text, DType, Graph, Op};
use mpc_passes::precision::Policy;
use mpc_passes::{Context, PassManager, Pipeline};

fn run_with(body: &str, policy: Policy) -> Result<Graph, String> {
    let src = format!("mpcir 1\nmodel ir_version=8\nopset \"\" 17\ngraph \"t\"\n{body}\nend\n");
    let mut g = text::parse(&src, None).map_err(|e| e.to_string())?;
    let cx = Context { policy: Some(policy), ..Default::default() };
    PassManager::pipeline(Pipeline::Inference).run(&mut g, &cx, &mut |_, _| {}).map_err(|e| e.to_string())?;
    Ok(g)
}

fn run(body: &str) -> Graph {
    run_with(body, Policy::named("mixed").unwrap().unwrap()).unwrap()
}

/// The dtype the op producing `name` computes in. A graph output computed low is renamed
/// `{name}.f16` (or `.bf16`) and cast back under its own name, so look there first.
fn dt(g: &Graph, name: &str) -> DType {
    let v = [format!("{name}.f16"), format!("{name}.bf16"), name.to_string()]
        .iter()
        .find_map(|n| g.find(n))
        .unwrap_or_else(|| panic!("no value `{name}`"));
    g.ty(v).dtype.unwrap()
}

fn casts(g: &Graph) -> usize {
    g.node_ids().filter(|&n| matches!(g.node(n).op, Op::Cast(_))).count()
}

const W: &str =
    "  init %1 \"w\" = f32[4,4]{1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0}";

#[test]
fn deny_infer_clear_infer_clear_allow_infer() {
    let g = run(&format!(
        "  input %0 \"x\": f32[4,4]\n{W}
  %2 \"deny\": ? = Exp(%0)
  %3 \"infer1\": ? = Sigmoid(%2)
  %4 \"clear1\": ? = Relu(%3)
  %5 \"infer2\": ? = Sigmoid(%4)
  %6 \"clear2\": ? = Relu(%5)
  %7 \"allow\": ? = MatMul(%6, %1)
  %8 \"infer3\": ? = Sigmoid(%7)
  output %8"
    ));
    for v in ["deny", "infer1", "clear1", "infer2"] {
        assert_eq!(dt(&g, v), DType::F32, "{v}");
    }
    // The clear op only leads to the allow op: it goes low with it. The infer op that only
    // follows an allow op stays f32.
    assert_eq!(dt(&g, "clear2"), DType::F16);
    assert_eq!(dt(&g, "allow"), DType::F16);
    assert_eq!(dt(&g, "infer3"), DType::F32);
    assert_eq!(casts(&g), 2, "one cast in, one cast out");
}

#[test]
fn clear_and_infer_chain_between_two_allow_ops_goes_low() {
    let g = run(&format!(
        "  input %0 \"x\": f32[4,4]\n{W}
  %2 \"a\": ? = MatMul(%0, %1)
  %3 \"r1\": ? = Relu(%2)
  %4 \"s\": ? = Sigmoid(%3)
  %5 \"r2\": ? = Relu(%4)
  %6 \"b\": ? = MatMul(%5, %1)
  output %6"
    ));
    for v in ["a", "r1", "s", "r2"] {
        assert_eq!(dt(&g, v), DType::F16, "{v}");
    }
    assert_eq!(casts(&g), 2, "x in, the output back");
}

#[test]
fn infer_op_after_allow_only_stays_f32() {
    let g = run(&format!(
        "  input %0 \"x\": f32[4,4]\n{W}\n  %2 \"a\": ? = MatMul(%0, %1)\n  %3 \"s\": ? = Sigmoid(%2)\n  output %3"
    ));
    assert_eq!(dt(&g, "a"), DType::F16);
    assert_eq!(dt(&g, "s"), DType::F32);
}

#[test]
fn clear_chains_go_low_in_both_directions() {
    // r1 feeds the MatMul (backwards from it) and r2 (forwards from r1): both go low.
    let g = run(&format!(
        "  input %0 \"x\": f32[4,4]\n{W}
  %2 \"r1\": ? = Relu(%0)
  %3 \"a\": ? = MatMul(%2, %1)
  %4 \"r2\": ? = Relu(%2)
  %5 \"r3\": ? = Relu(%3)
  output %4, %5"
    ));
    for v in ["r1", "a", "r2", "r3"] {
        assert_eq!(dt(&g, v), DType::F16, "{v}");
    }
}

#[test]
fn clear_op_upstream_of_deny_stays_f32() {
    let g = run(&format!(
        "  input %0 \"x\": f32[4,4]\n{W}
  %2 \"a\": ? = MatMul(%0, %1)
  %3 \"r\": ? = Relu(%2)
  %4 \"e\": ? = Exp(%3)
  output %4"
    ));
    // Relu is upstream of Exp (deny) but F32 spreads only forward from deny ops, and low
    // spreads into clear ops next to low ops: the Relu goes low, the cast sits before Exp.
    assert_eq!(dt(&g, "r"), DType::F16);
    assert_eq!(dt(&g, "e"), DType::F32);
}

#[test]
fn one_shared_cast_per_value_and_existing_casts_are_reused() {
    let g = run(&format!(
        "  input %0 \"x\": f32[4,4]\n  input %9 \"m\": bool[4,4]\n{W}
  %2 \"a\": ? = MatMul(%0, %1)
  %3 \"b\": ? = MatMul(%0, %1)
  %4 \"mf\": ? = Cast[to=1](%9)
  %5 \"c\": ? = MatMul(%4, %1)
  output %2, %3, %5"
    ));
    let cast_of_x =
        g.node_ids().filter(|&n| matches!(g.node(n).op, Op::Cast(_)) && g.node(n).input(0) == g.find("x")).count();
    assert_eq!(cast_of_x, 1, "two readers of x share one cast");
    // The bool → f32 cast feeding only a low MatMul becomes bool → f16: no second cast.
    let mf = g.find("mf");
    assert!(mf.is_none() || g.value(mf.unwrap()).uses().is_empty() || dt(&g, "mf") == DType::F16);
    let bool_casts: Vec<_> =
        g.node_ids().filter(|&n| matches!(g.node(n).op, Op::Cast(_)) && g.node(n).input(0) == g.find("m")).collect();
    assert_eq!(bool_casts.len(), 1);
    assert!(matches!(&g.node(bool_casts[0]).op, Op::Cast(c) if c.to == DType::F16));
}

#[test]
fn integer_inputs_are_never_cast() {
    let g = run(&format!(
        "  input %0 \"ids\": i64[2]\n{W}
  init %2 \"table\" = f32[3,4]{{0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5}}
  %3 \"e\": ? = Gather(%2, %0)
  %4 \"y\": ? = MatMul(%3, %1)
  output %4"
    ));
    assert_eq!(dt(&g, "ids"), DType::I64);
    assert_eq!(dt(&g, "e"), DType::F16, "the embedding lookup is data movement next to a low op");
    assert!(g.node_ids().all(|n| !matches!(g.node(n).op, Op::Cast(_)) || g.node(n).input(0) != g.find("ids")));
    // The table is read only by a low op: stored in f16, no run-time cast.
    assert_eq!(g.value(g.find("table").unwrap()).initializer().unwrap().dtype(), DType::F16);
}

#[test]
fn graph_outputs_keep_name_and_dtype() {
    let g = run(&format!("  input %0 \"x\": f32[4,4]\n{W}\n  %2 \"y\": ? = MatMul(%0, %1)\n  output %2"));
    let y = g.outputs()[0];
    assert_eq!(g.name(y), "y");
    assert_eq!(g.ty(y).dtype, Some(DType::F32));
    assert_eq!(dt(&g, "y.f16"), DType::F16);
}

#[test]
fn unsafe_constants_keep_their_reader_f32() {
    let g = run(&format!(
        "  input %0 \"x\": f32[4,4]\n{W}
  init %2 \"eps\" = f32[]{{1e-12}}
  init %3 \"big\" = f32[]{{-1e9}}
  %4 \"a\": ? = MatMul(%0, %1)
  %5 \"p\": ? = Add(%4, %2)
  %6 \"q\": ? = Add(%5, %3)
  %7 \"b\": ? = MatMul(%6, %1)
  output %7"
    ));
    // Between two low ops, but each reads a constant f16 cannot hold (1e-12 → 0, -1e9 → -inf).
    assert_eq!(dt(&g, "p"), DType::F32);
    assert_eq!(dt(&g, "q"), DType::F32);
    assert_eq!(g.value(g.find("eps").unwrap()).initializer().unwrap().dtype(), DType::F32);
    assert_eq!(g.value(g.find("big").unwrap()).initializer().unwrap().dtype(), DType::F32);
}

#[test]
fn pins_and_list_edits() {
    let body = format!("  input %0 \"x\": f32[4,4]\n{W}\n  %2 \"a\": ? = MatMul(%0, %1) @\"mm\"\n  %3 \"s\": ? = Sigmoid(%2)\n  output %3");
    let mut p = Policy::named("mixed").unwrap().unwrap();
    p.pin_fp32.insert("mm".into());
    assert_eq!(dt(&run_with(&body, p).unwrap(), "a"), DType::F32);
    let mut p = Policy::named("mixed").unwrap().unwrap();
    p.set_class("Sigmoid", mpc_passes::precision::Class::Low).unwrap();
    assert_eq!(dt(&run_with(&body, p).unwrap(), "s"), DType::F16);
    let mut p = Policy::named("mixed").unwrap().unwrap();
    assert!(p
        .set_class("Frobnicate", mpc_passes::precision::Class::Low)
        .unwrap_err()
        .contains("unknown op `Frobnicate`"));
    p.pin_fp32.insert("nope".into());
    assert!(run_with(&body, p).unwrap_err().contains("--pin-fp32 `nope`: no node has that name"));
}

#[test]
fn cast_cleanup_folds_exact_round_trips_only() {
    // low → high → low is exact and goes; high → low → high rounds and stays.
    let body = "  input %0 \"h\": f16[4]\n  input %1 \"x\": f32[4]
  %2 \"h32\": ? = Cast[to=1](%0)
  %3 \"h16\": ? = Cast[to=10](%2)
  %4 \"r\": ? = Relu(%3)
  %5 \"x16\": ? = Cast[to=10](%1)
  %6 \"x32\": ? = Cast[to=1](%5)
  %7 \"s\": ? = Sigmoid(%6)
  output %4, %7";
    let g = run(body);
    let relu = g.node_ids().find(|&n| matches!(g.node(n).op, Op::Relu)).unwrap();
    assert_eq!(g.node(relu).input(0), g.find("h"), "f16 → f32 → f16 folded away");
    let sig = g.node_ids().find(|&n| matches!(g.node(n).op, Op::Sigmoid)).unwrap();
    assert_eq!(g.node(sig).input(0), g.find("x32"), "f32 → f16 → f32 kept: it rounds");
}

#[test]
fn fp16_policy_makes_everything_low_and_bf16_keeps_sums_following() {
    let body = format!(
        "  input %0 \"x\": f32[4,4]\n{W}\n  %2 \"e\": ? = Exp(%0)\n  %3 \"a\": ? = MatMul(%2, %1)\n  output %3"
    );
    let g = run_with(&body, Policy::named("fp16").unwrap().unwrap()).unwrap();
    assert_eq!(dt(&g, "e"), DType::F16);
    let sum = format!(
        "  input %0 \"x\": f32[4,4]\n{W}\n  init %9 \"ax\" = i64[1]{{1}}\n  init %8 \"ax0\" = i64[1]{{0}}\n  %2 \"a\": ? = MatMul(%0, %1)\n  %3 \"s\": ? = ReduceSum[keepdims=0](%2, %9)\n  %4 \"u\": ? = Unsqueeze(%3, %8)\n  %5 \"b\": ? = MatMul(%4, %1)\n  output %5"
    );
    assert_eq!(dt(&run(&sum), "s"), DType::F32, "f16 sums stay f32");
    let g = run_with(&sum, Policy::named("mixed-bf16").unwrap().unwrap()).unwrap();
    assert_eq!(dt(&g, "s"), DType::BF16, "bf16 sums follow their neighbours");
}

#[test]
fn scatters_that_add_or_multiply_stay_f32_between_low_ops() {
    // MatMul → scatter → MatMul: a scatter that only moves data (none, max) goes low between
    // the two; one that adds or multiplies accumulates, and stays FP32 as ReduceSum would.
    let body = |attrs: &str| {
        format!(
            "  input %0 \"x\": f32[4,4]\n{W}\n  init %5 \"i\" = i64[2,1]{{1, 1}}\n  init %6 \"u\" = f32[2,4]{{1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0}}
  %2 \"a\": ? = MatMul(%0, %1)\n  %3 \"s\": ? = ScatterND{attrs}(%2, %5, %6)\n  %4 \"y\": ? = MatMul(%3, %1)\n  output %4"
        )
    };
    for (attrs, want) in [
        ("", DType::F16),
        ("[reduction=\"max\"]", DType::F16),
        ("[reduction=\"add\"]", DType::F32),
        ("[reduction=\"mul\"]", DType::F32),
    ] {
        assert_eq!(dt(&run(&body(attrs)), "s"), want, "ScatterND{attrs}");
    }
    // As ReduceSum, an adding scatter follows its neighbours under BF16.
    let bf16 = run_with(&body("[reduction=\"add\"]"), Policy::named("mixed-bf16").unwrap().unwrap()).unwrap();
    assert_eq!(dt(&bf16, "s"), DType::BF16);
    // GatherND and ScatterElements are data movement too.
    let g = run(&format!(
        "  input %0 \"x\": f32[4,4]\n{W}\n  init %5 \"i\" = i64[4,1]{{3, 2, 1, 0}}\n  init %6 \"j\" = i64[1,4]{{0, 1, 2, 3}}
  init %8 \"u\" = f32[1,4]{{1.0, 2.0, 3.0, 4.0}}
  %2 \"a\": ? = MatMul(%0, %1)\n  %3 \"g\": ? = GatherND(%2, %5)\n  %7 \"e\": ? = ScatterElements(%3, %6, %8)\n  %4 \"y\": ? = MatMul(%7, %1)\n  output %4"
    ));
    assert_eq!((dt(&g, "g"), dt(&g, "e")), (DType::F16, DType::F16));
}
