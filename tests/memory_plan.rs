//! The arena of a lowered program never lets two values that are alive at once share bytes, and
//! mixed precision shrinks it.

mod common;

use std::collections::HashMap;

use common::{fixture, FIXTURES};
use mpc_runtime::program::{Launch, Operand, Program, Region};

/// The fixture's program under `policy` at `batch`.
fn program(name: &str, policy: &str, batch: u64) -> Program {
    let path = fixture(name);
    let mut g = mpc::load(&path).unwrap();
    let opts = mpc::Options { policy: Some(policy.into()), ..Default::default() };
    mpc::compile(&mut g, &path, &opts, &mut |_, _| {}).unwrap();
    let dims: HashMap<String, u64> = [("batch".to_string(), batch)].into();
    mpc::run::memory_plan(&g, &path, &dims).unwrap().0
}

/// Every launch, the branches of an `If` after it, in the order a step may run them.
fn flat(launches: &[Launch]) -> Vec<&Launch> {
    let mut out = Vec::new();
    for l in launches {
        out.push(l);
        if let Some(b) = &l.branches {
            out.extend(flat(&b.then_launches));
            out.extend(flat(&b.else_launches));
        }
    }
    out
}

#[test]
fn live_values_never_overlap_in_the_arena() {
    for name in FIXTURES {
        for policy in ["fp32", "mixed", "mixed-bf16"] {
            let p = program(name, policy, 8);
            let launches = flat(&p.launches);
            let end = launches.len();
            // Each value in the arena: its place (offset, bytes), the step that writes it and the
            // last that reads it. A write to a place starts a new value there unless the same
            // launch reads that place (an output written in place over its input). Inputs are
            // written before the step, outputs read after it.
            let mut life: Vec<((u64, u64), (usize, usize))> = Vec::new();
            let mut current: HashMap<(u64, u64), usize> = HashMap::new();
            for (_, t) in &p.inputs {
                current.insert((t.offset, t.bytes()), life.len());
                life.push(((t.offset, t.bytes()), (0, 0)));
            }
            let arena = |t: &&mpc_runtime::program::TensorRef| t.region == Region::Arena;
            for (i, l) in launches.iter().enumerate() {
                let reads: Vec<(u64, u64)> = l
                    .inputs
                    .iter()
                    .filter_map(|o| match o {
                        Operand::Device(t) if t.region == Region::Arena => Some((t.offset, t.bytes())),
                        _ => None,
                    })
                    .collect();
                for k in &reads {
                    let e = *current
                        .get(k)
                        .unwrap_or_else(|| panic!("{name}/{policy}: step {i} reads {k:?}, never written"));
                    life[e].1 .1 = life[e].1 .1.max(i);
                }
                for t in l.outputs.iter().filter(arena) {
                    let k = (t.offset, t.bytes());
                    if !reads.contains(&k) || !current.contains_key(&k) {
                        current.insert(k, life.len());
                        life.push((k, (i, i)));
                    }
                }
            }
            for (_, t) in p.outputs.iter().filter(|(_, t)| t.region == Region::Arena) {
                let e = current[&(t.offset, t.bytes())];
                life[e].1 .1 = end;
            }
            let bufs = life;
            for (i, &((oa, ba), (da, la))) in bufs.iter().enumerate() {
                assert!(oa + ba <= p.arena_bytes, "{name}/{policy}: a buffer past the arena");
                for &((oc, bc), (dc, lc)) in &bufs[i + 1..] {
                    let bytes_overlap = oa < oc + bc && oc < oa + ba;
                    // Alive together, except for an in-place hand-over at the step the input dies.
                    let alive_together = da < lc && dc < la;
                    assert!(
                        !(bytes_overlap && alive_together),
                        "{name}/{policy}: [{oa}, +{ba}) live [{da}, {la}] and [{oc}, +{bc}) live [{dc}, {lc}] share bytes"
                    );
                }
            }
        }
    }
}

#[test]
fn mixed_activations_are_at_most_six_tenths_of_fp32() {
    for name in ["cnn_bn", "transformer"] {
        let (mixed, fp32) = (program(name, "mixed", 64).arena_bytes, program(name, "fp32", 64).arena_bytes);
        let ratio = mixed as f64 / fp32 as f64;
        println!("{name}: the arena at batch 64, mixed {mixed} B, fp32 {fp32} B: {ratio:.3}x");
        assert!(ratio <= 0.6, "{name}: mixed / fp32 = {ratio}");
    }
}
