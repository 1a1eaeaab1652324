//! Whole-model FP32 gradients against PyTorch autograd's, on the MLP, CNN and transformer
//! fixtures, and the CNN's batch-norm running statistics after the step (PyTorch updates the
//! running variance with the unbiased batch variance). The expected values (inputs, loss, every parameter's gradient) were written by
//! tests/models/make_grads.py; this test needs no Python.

mod common;

use std::collections::HashMap;
use std::path::Path;

use common::fixture;
use mpc_passes::train::{Loss, TrainOptions};

fn check(name: &str, loss: Loss, labels: &str) {
    let path = fixture(name);
    let mut g = mpc::load(&path).unwrap();
    let t = TrainOptions { loss, labels: labels.into(), ..Default::default() };
    let opts = mpc::Options { policy: Some("fp32".into()), train: Some(t), ..Default::default() };
    mpc::compile(&mut g, &path, &opts, &mut |_, _| {}).unwrap();
    let file = Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("tests/models/grads/{name}.safetensors"));
    let expected = mpc::run::read_safetensors(&file).unwrap();
    let inputs: HashMap<_, _> =
        expected.iter().filter_map(|(k, t)| Some((k.strip_prefix("input.")?.to_string(), t.clone()))).collect();
    let mut wanted = Vec::new();
    for k in expected.keys().filter_map(|k| k.strip_prefix("grad.")) {
        let v = g.find(&format!("{k}.grad")).unwrap_or_else(|| panic!("{name}: no gradient for `{k}`"));
        g.add_output(v);
        wanted.push((k.to_string(), v));
    }
    // State after the step (batch-norm running statistics), by the state's name.
    let sig = g.train.clone().unwrap_or_default();
    let mut states = Vec::new();
    for k in expected.keys().filter_map(|k| k.strip_prefix("state.")) {
        let &(_, next) =
            sig.state.iter().find(|(s, _)| g.name(*s) == k).unwrap_or_else(|| panic!("{name}: no state `{k}`"));
        g.add_output(next);
        states.push((k.to_string(), next));
    }
    let out: HashMap<String, _> = mpc::run::run_once(&g, &inputs, &path).unwrap().into_iter().collect();
    for (k, v) in &states {
        let (a, b) = (out[g.name(*v)].f64s(), expected[&format!("state.{k}")].f64s());
        let err = a.iter().zip(&b).map(|(x, y)| (x - y).abs() / y.abs().max(1e-3)).fold(0.0, f64::max);
        assert!(err <= 1e-5, "{name}: `{k}` after the step: {a:?} where torch has {b:?}");
    }
    let loss = out["loss"].f64s()[0];
    let want_loss = expected["loss"].f64s()[0];
    assert!((loss - want_loss).abs() <= 1e-5 * want_loss.abs(), "{name}: loss {loss} vs torch {want_loss}");
    let norm = |v: &[f64]| v.iter().map(|x| x * x).sum::<f64>().sqrt();
    let pairs: Vec<(String, Vec<f64>, Vec<f64>)> = wanted
        .iter()
        .map(|(k, v)| (k.clone(), out[g.name(*v)].f64s(), expected[&format!("grad.{k}")].f64s()))
        .collect();
    let largest = pairs.iter().map(|(_, _, b)| norm(b)).fold(0.0, f64::max);
    let (mut worst, mut zeros) = ((0f64, String::new()), Vec::new());
    for (k, a, b) in &pairs {
        let diff: Vec<f64> = a.iter().zip(b).map(|(x, y)| x - y).collect();
        if norm(b) < 1e-6 * largest {
            // Zero in exact arithmetic (a bias before a normalisation, the keys' bias under
            // softmax): both sides are rounding noise; mpc's must be noise-sized too.
            assert!(norm(a) < 1e-5 * largest, "{name}: d loss / d {k} should vanish, has norm {}", norm(a));
            zeros.push(k.clone());
            continue;
        }
        let rel = norm(&diff) / norm(b);
        assert!(rel <= 1e-5, "{name}: d loss / d {k}: relative error {rel:.2e} against torch");
        if rel > worst.0 {
            worst = (rel, k.clone());
        }
    }
    println!(
        "{name}: {} parameter gradients match torch autograd, worst relative L2 error {:.2e} ({}); zero in theory: {zeros:?}",
        pairs.len(),
        worst.0,
        worst.1
    );
}

#[test]
fn mlp_gradients_match_torch() {
    check("mlp", Loss::CrossEntropy(Default::default()), "labels");
}

#[test]
fn cnn_gradients_match_torch() {
    check("cnn_bn", Loss::CrossEntropy(Default::default()), "labels");
}

#[test]
fn transformer_gradients_match_torch() {
    check("transformer", Loss::Mse, "targets");
}
