//! What lowered programs promise: every fixture's inference graph under each policy and the
//! training graphs lower; no launch reads device data for a shape; a program run twice gives the
//! same bits; after the first step no step allocates (so no region moves) and no step reads back
//! more than its `If` conditions; a training step updates its state in place.

#[path = "../common/mod.rs"]
mod common;

use std::collections::HashMap;

use common::{fixture, FIXTURES};
use mpc_ir::{DType, Graph};
use mpc_runtime::device::Device;
use mpc_runtime::program::{Operand, Program, TensorRef};
use mpc_runtime::session::Session;
use mpc_runtime::HostTensor;

const BATCH: u64 = 4;

fn compiled(name: &str, policy: &str, train: bool) -> Graph {
    try_compiled(name, policy, train).unwrap_or_else(|e| panic!("{name} {policy}: {e}"))
}

/// The fixture compiled under `policy`, as an inference graph or a training step.
fn try_compiled(name: &str, policy: &str, train: bool) -> Result<Graph, mpc::Error> {
    common::compiled(name, policy, train)
}

fn dims() -> HashMap<String, u64> {
    [("batch".to_string(), BATCH)].into()
}

fn lowered(g: &Graph, caps: mpc_runtime::program::DeviceCaps) -> (Graph, Program) {
    let (bound, _) = mpc::summary::bind_inputs(g, &dims()).unwrap();
    let p =
        mpc::run::lower_bound(&bound, caps, None, None, &fixture("mlp")).unwrap_or_else(|e| panic!("lowering: {e}"));
    (bound, p)
}

/// A fixture compiled under `policy` and lowered for the CPU device with `opts`.
fn cpu_lowered(name: &str, policy: &str, train: bool, opts: mpc_runtime::program::LowerOptions) -> Program {
    let (bound, _) = mpc::summary::bind_inputs(&compiled(name, policy, train), &dims()).unwrap();
    mpc_runtime::program::lower(&bound, mpc_runtime::device::CpuDevice::default().caps(), opts).unwrap()
}

/// The arena buffer that holds `t` is alive from launch `from` to launch `to`.
fn assert_alive(p: &Program, t: &TensorRef, from: usize, to: usize) {
    let buffer = p.buffers.iter().find(|x| x.offset == t.offset && x.bytes >= t.bytes()).unwrap();
    assert!(buffer.first <= from && buffer.last >= to, "{}..{} for {from}..{to}", buffer.first, buffer.last);
}

/// Every host operand of every launch is a value in the descriptor.
fn assert_shapes_resolved(p: &Program) {
    for l in &p.launches {
        for &slot in l.op.host_operands() {
            assert!(
                l.inputs.get(slot).and_then(Operand::tensor).is_none(),
                "{}: operand {slot} would be read from device memory",
                l.node
            );
        }
    }
}

fn same(a: &HostTensor, b: &HostTensor, what: &str) {
    if let Some(e) = differs(a, b, what) {
        panic!("{e}");
    }
}

/// Where `a` and `b` differ in a bit, what and how (`None` where they are the same bits).
fn differs(a: &HostTensor, b: &HostTensor, what: &str) -> Option<String> {
    mpc_runtime::Tolerance::EXACT.check(a, b).err().map(|e| format!("{what}: {e}"))
}

/// Panics with every difference found, one per line, where there are any.
fn none_differ(bad: &[String]) {
    assert!(bad.is_empty(), "{} differences:\n{}", bad.len(), bad.join("\n"));
}

mod fusion;
mod transformers;

use fusion::{fused_chains_give_the_unfused_bits, residual_gradients_and_the_relu_gradient_are_one_launch};

common::per_device!(
    inference_programs_keep_their_promises => inference_programs_keep_their_promises,
    training_programs_update_their_state_in_place => training_programs_update_their_state_in_place,
    fused_chains_give_the_unfused_bits => fused_chains_give_the_unfused_bits,
    residual_gradients_and_the_relu_gradient_are_one_launch => residual_gradients_and_the_relu_gradient_are_one_launch,
);

fn inference_programs_keep_their_promises<D: Device>(device: impl Fn() -> D) {
    for name in FIXTURES {
        for policy in ["fp32", "mixed", "mixed-bf16"] {
            let g = compiled(name, policy, false);
            let (bound, _) = mpc::summary::bind_inputs(&g, &dims()).unwrap();
            let program = mpc::run::lower_bound(&bound, device().caps(), None, None, &fixture(name))
                .unwrap_or_else(|e| panic!("{name} {policy}: {e}"));
            assert_shapes_resolved(&program);
            println!(
                "{name} {policy}: {} launches, {} folded, {} views, arena {} B, constants {} B",
                program.launches.len(),
                program.folded,
                program.views,
                program.arena_bytes,
                program.constants_bytes
            );
            let mut inputs = mpc::run::random_inputs(&bound, 7, &dims()).unwrap();
            let mut s = Session::new(device(), program).unwrap();
            // An If's condition is an input: both branches, on one session.
            let conds: &[bool] = if inputs.contains_key("cond") { &[true, false] } else { &[true] };
            let mut got = Vec::new();
            for &c in conds {
                if inputs.contains_key("cond") {
                    inputs.insert("cond".into(), HostTensor::from_i64(mpc_ir::DType::Bool, vec![], vec![c as i64]));
                }
                got = s.run(&inputs).unwrap();
                assert_eq!(got.len(), bound.outputs().len());
            }
            // A second run on the same session gives the same bits.
            let again = s.run(&inputs).unwrap();
            for ((_, a), (_, b)) in got.iter().zip(&again) {
                same(a, b, &format!("{name} {policy} second run"));
            }
            assert_eq!(s.stats(0).allocations_in_steps, 0);
            assert_eq!(s.stats(0).host_reads_per_step as usize, s.program(0).unwrap().host_reads, "{name}");
        }
    }
}

fn training_programs_update_their_state_in_place<D: Device>(device: impl Fn() -> D) {
    let mut trained = 0;
    let models = FIXTURES.iter().chain(&["digits_mlp"]);
    for (name, policy) in models.flat_map(|n| ["fp32", "mixed", "mixed-bf16"].map(|p| (*n, p))) {
        let g = match try_compiled(name, policy, true) {
            Ok(g) => g,
            // Fixtures with nothing to train, or an op with no gradient rule, are refused when
            // compiling (tests/train.rs checks the messages).
            Err(e) => {
                let msg = e.to_string();
                assert!(msg.contains("nothing to train") || msg.contains("has no gradient rule"), "{name}: {msg}");
                continue;
            }
        };
        trained += 1;
        let (bound, program) = lowered(&g, device().caps());
        assert_shapes_resolved(&program);
        let sig = bound.train.clone().unwrap();
        // The optimizer writes masters and moments into their own slots: no copy after the step.
        let in_place = program.state.iter().filter(|st| st.next == st.slot).count();
        println!("{name} {policy}: {in_place} of {} state values updated in place", program.state.len());
        assert!(in_place * 2 > program.state.len(), "{name} {policy}: {in_place} in place");
        let mut s = Session::new(device(), program).unwrap();
        let loss_name = bound.name(sig.loss.unwrap()).to_string();
        let names: Vec<String> = sig.state.iter().map(|&(v, _)| bound.name(v).to_string()).collect();
        let start: Vec<HostTensor> = names.iter().map(|n| s.read_state(n).unwrap()).collect();
        for step in 0..3 {
            let inputs = mpc::run::random_inputs(&bound, 11 + step, &dims()).unwrap();
            s.feed(0, &inputs).unwrap();
            s.step(0).unwrap();
            let loss = s.read(0, &loss_name).unwrap().f64s()[0];
            assert!(loss.is_finite(), "{name} {policy} step {step}: loss {loss}");
        }
        let moved = names.iter().zip(&start).filter(|(n, t)| &s.read_state(n).unwrap() != *t).count();
        assert!(moved * 2 > names.len(), "{name} {policy}: only {moved} of {} state values moved", names.len());
        let st = s.stats(0);
        assert_eq!(st.allocations_in_steps, 0, "{name}: allocations inside steps");
        assert_eq!(st.host_reads_per_step, 0, "{name}: host reads inside a step");
        assert!(st.launches_per_step > 0 && st.steps == 3);
    }
    // mlp, mlp_loss, cnn_bn, resblock, transformer, digits_mlp under three policies.
    assert_eq!(trained, 18, "training steps lowered");
}

/// The CPU device's in-place launches (f32 matrix products on the regions) give exactly the
/// bits of the reference kernels on copies: inference under every policy, and training steps.
#[test]
fn in_place_launches_give_the_reference_bits() {
    use mpc_runtime::device::CpuDevice;
    for name in FIXTURES {
        for policy in ["fp32", "mixed", "mixed-bf16"] {
            let g = compiled(name, policy, false);
            let (bound, _) = mpc::summary::bind_inputs(&g, &dims()).unwrap();
            let inputs = mpc::run::random_inputs(&bound, 3, &dims()).unwrap();
            let path = fixture(name);
            let a = mpc::run::run_once_on(CpuDevice::default(), &bound, &inputs, &path).unwrap();
            let b = mpc::run::run_once_on(CpuDevice::on_copies(), &bound, &inputs, &path).unwrap();
            for ((n, x), (_, y)) in a.iter().zip(&b) {
                same(x, y, &format!("{name} {policy} `{n}`"));
            }
        }
    }
    for (name, policy) in [("mlp", "mixed"), ("cnn_bn", "mixed"), ("transformer", "mixed"), ("mlp", "fp32")] {
        let g = compiled(name, policy, true);
        let (bound, program) = lowered(&g, CpuDevice::default().caps());
        let names: Vec<String> =
            bound.train.as_ref().unwrap().state.iter().map(|&(v, _)| bound.name(v).to_string()).collect();
        // The operands of the launches that run a kernel (not those whose outputs are all empty).
        let operands: Vec<&TensorRef> = program
            .launches
            .iter()
            .flat_map(|l| l.parts())
            .filter(|l| l.outputs.is_empty() || !l.outputs.iter().all(|t| t.shape.contains(&0)))
            .flat_map(|l| &l.inputs)
            .filter_map(Operand::tensor)
            .collect();
        let bools = operands.iter().filter(|t| t.dtype == DType::Bool).count() as u64;
        // Operands read widened (a fused Cast) are widened into a copy.
        let widened = program
            .launches
            .iter()
            .flat_map(|l| l.parts())
            .flat_map(|l| &l.inputs)
            .filter(|o| matches!(o, Operand::Widened(_)))
            .count() as u64;
        // So are operands read transposed (a fused Transpose) by a product that does not run in
        // place (an f16 or bf16 one), and operands read through a permutation.
        let transposed = program
            .launches
            .iter()
            .flat_map(|l| l.parts())
            .flat_map(|l| &l.inputs)
            .filter(|o| {
                matches!(o, Operand::Transposed(t) if t.dtype != DType::F32) || matches!(o, Operand::Permuted(..))
            })
            .count() as u64;
        let all = operands.len() as u64;
        // A dy read through a ReLU's gradient is that gradient, computed into a new tensor.
        let prologues =
            program.launches.iter().flat_map(|l| l.parts()).filter(|l| l.relu_prologue.is_some()).count() as u64;
        let mut s = [
            Session::new(CpuDevice::default(), program.clone()).unwrap(),
            Session::new(CpuDevice::on_copies(), program).unwrap(),
        ];
        for step in 0..3 {
            let inputs = mpc::run::random_inputs(&bound, 21 + step, &dims()).unwrap();
            for x in s.iter_mut() {
                x.feed(0, &inputs).unwrap();
                x.step(0).unwrap();
            }
        }
        // fp32 matrix products (forward and gradients) run in place; f16 ones on copies.
        assert_eq!(s[1].counters().in_place, 0);
        assert!(policy != "fp32" || s[0].counters().in_place > 0, "{name}: no launch ran in place");
        // Kernels read every operand where it lies, but bools (whose bytes need not be 0 or 1),
        // operands read widened and low-precision operands read transposed.
        println!(
            "{name} {policy}: {all} operands a step, {bools} of them bools, {widened} read widened, \
             {transposed} read transposed in f16 or bf16, {prologues} read through a ReLU's gradient"
        );
        let copied = bools + widened + transposed + prologues;
        assert_eq!(s[0].counters().operand_copies, 3 * copied, "{name} {policy}: operands copied");
        assert_eq!(s[1].counters().operand_copies, 3 * (all + prologues), "{name} {policy}: operands copied");
        for n in &names {
            let (x, y) = (s[0].read_state(n).unwrap(), s[1].read_state(n).unwrap());
            same(&x, &y, &format!("{name} {policy} `{n}` after 3 steps"));
        }
    }
}
