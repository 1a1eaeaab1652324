//! The fused attention op (`ai.mpc::Attention`): both layouts, causal and full masks, a fully
//! masked row, no mask, and a mask that needs a gradient (refused).

use super::*;

/// A causal mask over `[sq, sk]`: 0 where key j ≤ query i (+ the offset sk − sq), −∞ above.
fn causal_mask(c: &mut Case, sq: u64, sk: u64) -> ValueId {
    let v: Vec<f64> =
        (0..sq).flat_map(|i| (0..sk).map(move |j| if j <= i + (sk - sq) { 0.0 } else { f64::NEG_INFINITY })).collect();
    c.g.add_initializer("mask", Tensor::from_f64_as(DType::F64, vec![sq, sk], &v))
}

fn attention_op(scale: f64) -> Op {
    Op::from_mpc_attrs("Attention", vec![("scale".to_string(), Attr::Float(scale as f32))]).unwrap().unwrap()
}

#[test]
fn attention_heads_in_place() {
    // The bshd layout: [batch 2, 4 queries, heads 3, head dim 2] against 5 keys, a mask per head.
    let mut c = Case::new("attention_bshd");
    c.on_gpu = false;
    let q = c.param("q", &[2, 4, 3, 2]);
    let k = c.param_in("k", &[2, 5, 3, 2], -2.0, 2.0);
    let v = c.param("v", &[2, 5, 3, 2]);
    let mask = c.tensor("mask", &[3, 4, 5], -1.0, 1.0);
    let attrs = vec![("scale".to_string(), Attr::Float(0.8)), ("layout".to_string(), Attr::String("bshd".into()))];
    let op = Op::from_mpc_attrs("Attention", attrs).unwrap().unwrap();
    let (_, outs) = c.g.add_op("attention", op, &[Some(q), Some(k), Some(v), Some(mask)], 2);
    c.check(outs[0], TOL);
}

#[test]
fn attention_causal_mask() {
    // Q, K and V of [batch 2, heads 2, 5 queries, 7 keys, head dim 3], a causal mask broadcast over
    // batch and heads: the gradient recomputes the probabilities from the saved log-sum-exp.
    let mut c = Case::new("attention_causal_mask");
    c.on_gpu = false; // the CUDA kernels are f16 and bf16 only
    let q = c.param("q", &[2, 2, 5, 3]);
    let k = c.param("k", &[2, 2, 7, 3]);
    let v = c.param("v", &[2, 2, 7, 3]);
    let mask = causal_mask(&mut c, 5, 7);
    let (_, outs) = c.g.add_op("attention", attention_op(0.7), &[Some(q), Some(k), Some(v), Some(mask)], 2);
    c.check(outs[0], TOL);
}

#[test]
fn attention_fully_masked_row() {
    // Row 1 of every head sees no key: its output is 0 (not Softmax's NaN) and no gradient flows
    // through it; the other rows as usual.
    let mut c = Case::new("attention_fully_masked_row");
    c.on_gpu = false;
    let q = c.param("q", &[1, 2, 3, 2]);
    let k = c.param("k", &[1, 2, 4, 2]);
    let v = c.param("v", &[1, 2, 4, 2]);
    let m: Vec<f64> = (0..12).map(|i| if i / 4 == 1 { f64::NEG_INFINITY } else { 0.1 * i as f64 }).collect();
    let mask = c.g.add_initializer("mask", Tensor::from_f64_as(DType::F64, vec![3, 4], &m));
    let (_, outs) = c.g.add_op("attention", attention_op(0.9), &[Some(q), Some(k), Some(v), Some(mask)], 2);
    c.check(outs[0], TOL);
}

#[test]
fn attention_without_mask() {
    let mut c = Case::new("attention_without_mask");
    c.on_gpu = false;
    let q = c.param_in("q", &[3, 4, 2], -2.0, 2.0);
    let k = c.param_in("k", &[3, 6, 2], -2.0, 2.0);
    let v = c.param("v", &[3, 6, 2]);
    let (_, outs) = c.g.add_op("attention", attention_op(1.0), &[Some(q), Some(k), Some(v)], 2);
    c.check(outs[0], TOL);
}

#[test]
fn attention_mask_that_needs_a_gradient_is_refused() {
    let mut c = Case::new("attention_trained_mask");
    let q = c.param("q", &[1, 2, 2]);
    let m = c.param("m", &[2, 2]);
    let (_, outs) = c.g.add_op("attention", attention_op(1.0), &[Some(q), Some(q), Some(q), Some(m)], 2);
    let s = c.op1("ReduceSum", &[("keepdims", Attr::Int(0))], &[outs[0]]);
    mpc_passes::infer_types(&mut c.g).unwrap();
    let seed = c.g.add_initializer("seed", Tensor::from_f64_as(DType::F64, vec![], &[1.0]));
    let err = mpc_passes::train::differentiate(&mut c.g, &[q, m], s, seed).unwrap_err().to_string();
    assert!(err.contains("the mask of a fused Attention depends on parameters"), "{err}");
}
