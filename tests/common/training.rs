//! Helpers of the training tests (tests/train.rs, tests/train_graph.rs): the digits data, the
//! training options of a policy, a run, a compiled training graph and its parts.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use mpc::train::{train, TrainConfig, Trained};
use mpc::Options;
use mpc_ir::{Graph, Op};
use mpc_passes::train::{Optimizer, TrainOptions};
use mpc_runtime::device::Device;
use mpc_runtime::session::Session;
use mpc_runtime::HostTensor;

pub fn digits() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/digits.safetensors")
}

pub fn options(policy: &str, t: TrainOptions) -> Options {
    Options { policy: Some(policy.into()), train: Some(t), ..Default::default() }
}

pub fn run(model: &Path, policy: &str, t: TrainOptions, cfg: &TrainConfig) -> Trained {
    let g = mpc::load(model).unwrap();
    train(&g, model, &options(policy, t), cfg, &mut |_| {}).unwrap_or_else(|e| panic!("{policy}: {e}"))
}

pub fn run_on<D: Device>(device: D, model: &Path, policy: &str, t: TrainOptions, cfg: &TrainConfig) -> Trained {
    let g = mpc::load(model).unwrap();
    mpc::train::train_on(device, &g, model, &options(policy, t), cfg, &mut |_| {})
        .unwrap_or_else(|e| panic!("{policy}: {e}"))
}

/// The split of the data's README: the first 1500 samples train, the last 297 test.
pub fn digits_cfg(epochs: usize) -> TrainConfig {
    TrainConfig { data: vec![digits()], epochs, batch: 64, eval_split: 297.0, seed: 7, ..Default::default() }
}

pub fn training_graph(model: &Path, policy: &str, t: TrainOptions) -> Graph {
    let mut g = mpc::load(model).unwrap();
    mpc::compile(&mut g, model, &options(policy, t), &mut |_, _| {}).unwrap();
    g
}

/// A session of `g` on `device`, lowered for the shapes of `feeds`.
pub fn program_session<D: Device>(device: D, g: &Graph, feeds: &HashMap<String, HostTensor>) -> Session<D> {
    let program = mpc::run::lower_for_inputs(g, feeds, device.caps(), Path::new("train")).unwrap();
    Session::new(device, program).unwrap()
}

pub fn state_of(g: &Graph) -> Vec<(mpc_ir::ValueId, mpc_ir::ValueId)> {
    g.train.as_ref().expect("a training graph").state.clone()
}

pub fn digits_batch(from: usize, n: usize) -> HashMap<String, HostTensor> {
    let data = mpc::run::read_safetensors(&digits()).unwrap();
    let pick = |t: &HostTensor| {
        let row: usize = t.shape[1..].iter().product();
        let mut shape = t.shape.clone();
        shape[0] = n;
        t.pick(shape, &(from * row..(from + n) * row).collect::<Vec<_>>())
    };
    [("images".to_string(), pick(&data["images"])), ("labels".to_string(), pick(&data["labels"]))].into()
}

pub fn sgd(lr: f32) -> TrainOptions {
    TrainOptions {
        loss: mpc_passes::train::Loss::Mse,
        labels: "targets".into(),
        optimizer: Optimizer::Sgd,
        lr,
        ..Default::default()
    }
}

/// The optimizer update of parameter `name`: the node that reads it as its first input.
pub fn update_of<'g>(g: &'g mpc_ir::Graph, name: &str) -> &'g mpc_ir::Node {
    let p = g.find(name).unwrap_or_else(|| panic!("no `{name}`"));
    g.value(p)
        .uses()
        .iter()
        .map(|u| g.node(u.node))
        .find(|n| matches!(n.op, Op::AdamUpdate(_) | Op::SgdUpdate(_)) && n.input(0) == Some(p))
        .unwrap_or_else(|| panic!("no update of `{name}`"))
}

/// One step of each of two sessions (the same program but for what is compared, the same state)
/// on `inputs`: their losses within `rel_l2`, and each f32 weight's update (not the low copies,
/// rounded from them, nor scalar state such as the loss scale) within `rel_l2` of the second
/// session's, relative L2. An update that vanishes in exact arithmetic (the key projection's
/// bias: the softmax ignores what it adds to a whole row) is rounding on both sides: it is
/// measured against the largest update. Returns the weights updated and the worst difference;
/// panics naming `label` and the weight.
pub fn compare_one_step<D: Device>(
    label: &str,
    s: &mut [Session<D>; 2],
    state: &[String],
    inputs: &HashMap<String, HostTensor>,
    rel_l2: f64,
) -> (usize, f64) {
    let before: Vec<HostTensor> = state.iter().map(|n| s[1].read_state(n).unwrap()).collect();
    let losses: Vec<HostTensor> = s
        .iter_mut()
        .map(|x| {
            x.feed(0, inputs).unwrap();
            x.step(0).unwrap();
            x.read(0, "loss").unwrap()
        })
        .collect();
    let tol = mpc_runtime::Tolerance { rtol: f64::INFINITY, atol: f64::INFINITY, rel_l2 };
    tol.check(&losses[0], &losses[1]).unwrap_or_else(|e| panic!("{label} loss: {e}"));
    let mut updates = Vec::new();
    for (n, w0) in state.iter().zip(&before) {
        let [x, y] = [0, 1].map(|i| s[i].read_state(n).unwrap());
        if x.dtype() == mpc_ir::DType::F32 && x.shape == w0.shape && !x.shape.is_empty() {
            let delta = |w: &HostTensor| -> Vec<f64> { w.f64s().iter().zip(w0.f64s()).map(|(a, b)| a - b).collect() };
            updates.push((n, delta(&x), delta(&y)));
        }
    }
    let norm = |v: &[f64]| v.iter().map(|x| x * x).sum::<f64>().sqrt();
    let largest = updates.iter().map(|(_, _, y)| norm(y)).fold(0.0, f64::max);
    let (mut updated, mut worst) = (0, 0f64);
    for (n, x, y) in &updates {
        let diff: Vec<f64> = x.iter().zip(y).map(|(a, b)| a - b).collect();
        let e = if norm(y) < 1e-3 * largest { norm(&diff) / largest } else { norm(&diff) / norm(y) };
        assert!(e <= rel_l2, "{label}: the update of `{n}` differs by {e:.2e} (relative L2)");
        updated += (norm(y) > 0.0) as usize;
        worst = worst.max(e);
    }
    (updated, worst)
}

/// `f` run as each rank of a `LocalGroup` of `world` ranks (what `mpiexec -n world` runs, as
/// threads of one process), a thread each; the results in rank order.
pub fn on_ranks<T: Send>(world: usize, f: impl Fn(usize, mpc_runtime::collective::LocalGroup) -> T + Sync) -> Vec<T> {
    let group = mpc_runtime::collective::LocalGroup::new(world, std::time::Duration::from_secs(60));
    std::thread::scope(|scope| {
        let f = &f;
        let ranks: Vec<_> = group.into_iter().enumerate().map(|(rank, r)| scope.spawn(move || f(rank, r))).collect();
        ranks.into_iter().map(|t| t.join().unwrap()).collect()
    })
}
