//! The memory plan never lets two values that are alive at once share bytes.

mod common;

use std::collections::HashMap;

use common::{fixture, FIXTURES};

#[test]
fn live_values_never_overlap_in_the_arena() {
    for name in FIXTURES {
        for policy in ["fp32", "mixed", "mixed-bf16"] {
            let b = compiled(name, policy, 8);
            let plan = mpc_runtime::plan(&b).unwrap();
            let step: HashMap<_, _> = plan.order.iter().enumerate().map(|(i, &n)| (n, i)).collect();
            let life = |v: mpc_ir::ValueId| {
                let def = b.value(v).producer().map_or(0, |(n, _)| step[&n]);
                (def, plan.last_use.get(&v).copied().unwrap_or(def).max(def))
            };
            let vals: Vec<_> = plan.slots.keys().copied().collect();
            for (i, &a) in vals.iter().enumerate() {
                let (sa, (da, la)) = (plan.slots[&a], life(a));
                assert!(sa.offset + sa.size <= plan.peak_activation_bytes, "{name}/{policy}: slot past the arena");
                for &c in &vals[i + 1..] {
                    let (sc, (dc, lc)) = (plan.slots[&c], life(c));
                    let bytes_overlap = sa.offset < sc.offset + sc.size && sc.offset < sa.offset + sa.size;
                    // Alive together, except for an in-place hand-over at the step the input dies.
                    let alive_together = da < lc && dc < la;
                    assert!(
                        !(bytes_overlap && alive_together),
                        "{name}/{policy}: `{}` [{da}, {la}] and `{}` [{dc}, {lc}] share bytes",
                        b.name(a),
                        b.name(c)
                    );
                }
            }
        }
    }
}

/// The fixture compiled under `policy`, its batch bound to `batch`.
fn compiled(name: &str, policy: &str, batch: u64) -> mpc_ir::Graph {
    let path = fixture(name);
    let mut g = mpc::load(&path).unwrap();
    let opts = mpc::Options { policy: Some(policy.into()), ..Default::default() };
    mpc::compile(&mut g, &path, &opts, &mut |_, _| {}).unwrap();
    let dims: HashMap<String, u64> = [("batch".to_string(), batch)].into();
    mpc::summary::bind_inputs(&g, &dims).unwrap().0
}

/// Peak activation bytes of `name` under `policy` at batch 64.
fn peak(name: &str, policy: &str) -> u64 {
    mpc_runtime::plan(&compiled(name, policy, 64)).unwrap().peak_activation_bytes
}

#[test]
fn mixed_activations_are_at_most_six_tenths_of_fp32() {
    for name in ["cnn_bn", "transformer"] {
        let (mixed, fp32) = (peak(name, "mixed"), peak(name, "fp32"));
        let ratio = mixed as f64 / fp32 as f64;
        println!("{name}: peak activations at batch 64, mixed {mixed} B, fp32 {fp32} B: {ratio:.3}x");
        assert!(ratio <= 0.6, "{name}: mixed / fp32 = {ratio}");
    }
}
