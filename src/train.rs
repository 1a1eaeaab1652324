//! `mpc train`: compile the training step, feed it batches, keep its state resident, evaluate,
//! checkpoint and resume.
//!
//! The data file's tensors are named after the graph inputs (and the labels); the first dimension
//! is the sample. The last `eval_split` share of the samples is held out for evaluation. Each
//! epoch visits the training samples in an order drawn from `(seed, epoch)`, so a resumed run sees
//! exactly the batches the uninterrupted run would have seen. Checkpoints hold every state value
//! under its graph name (the masters under their initializer names, the rest under `mpc.`) and
//! `mpc.iteration`, the number of batches done.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::time::Instant;

use mpc_ir::{DType, Dim, Graph, Op, Shape, Tensor, TypeInfo, ValueId};
use mpc_runtime::device::{CpuDevice, Device};
use mpc_runtime::program::{Program, StateLayout};
use mpc_runtime::session::{ProgramId, Session};
use mpc_runtime::HostTensor;

use crate::{Error, Options, Result};

/// Steps between two reads of the losses (and updates of the progress bar).
const PRINT_EVERY: usize = 16;

/// How to train.
#[derive(Clone, Debug)]
pub struct TrainConfig {
    pub data: PathBuf,
    pub epochs: usize,
    pub batch: usize,
    /// The samples (the last ones) held out for evaluation: a share when below 1, else a count.
    pub eval_split: f64,
    /// Seed of the sample order.
    pub seed: u64,
    pub checkpoint: Option<PathBuf>,
    pub resume: bool,
    /// Write a JSON line per step and per evaluation here ([`StepLog`]).
    pub log: Option<PathBuf>,
    /// Stop after this many batches in all (tests of resuming).
    pub max_steps: Option<usize>,
    /// Draw a progress bar on a terminal.
    pub progress: bool,
}

impl Default for TrainConfig {
    fn default() -> Self {
        TrainConfig {
            data: PathBuf::new(),
            epochs: 1,
            batch: 64,
            eval_split: 0.0,
            seed: 0,
            checkpoint: None,
            resume: false,
            log: None,
            max_steps: None,
            progress: false,
        }
    }
}

/// One epoch's numbers.
#[derive(Clone, Debug, PartialEq)]
pub struct EpochReport {
    pub epoch: usize,
    pub mean_loss: f64,
    pub loss_scale: Option<f64>,
    pub skipped: usize,
    pub samples_per_s: f64,
    /// Accuracy and mean loss on the held-out samples.
    pub eval: Option<(f64, f64)>,
}

/// What a run leaves: per-epoch reports, the loss of every step, and the final state by name.
pub struct Trained {
    pub epochs: Vec<EpochReport>,
    pub losses: Vec<f32>,
    pub skipped: Vec<bool>,
    pub state: Vec<(String, HostTensor)>,
    /// What the training step cost (`--stats`).
    pub stats: String,
    /// The exported copies of one weight trained as that weight.
    pub ties: Vec<mpc_passes::train::Tie>,
    /// The constants trained as weights of their own in place of parameters the export folded
    /// ([`mpc_passes::train::folded_weights`]).
    pub folded: Option<(Vec<String>, Vec<String>)>,
    /// `--loss-scale auto`'s measurement.
    pub auto_scale: Option<mpc_passes::AutoScale>,
}

/// Gives every graph input a symbolic leading dim `batch`, so that a model exported with a fixed
/// batch trains with any batch size (and a short last batch). Returns the export's batch when
/// the inputs had one.
///
/// An exporter also bakes that batch into the graph: declared output shapes, the shape operands
/// of Reshape, Expand and ConstantOfShape, and constants expanded to it (token-type ids, a class
/// token). Declared leading dims equal to it are forgotten (inference recomputes them); a shape
/// operand that starts with it starts with -1 (Reshape; 0 when it has a -1 already) or 1
/// (Expand, ConstantOfShape: broadcasting restores the batch); a constant (not a parameter) whose
/// leading dim is it and whose slices along that dim are all equal becomes its first slice. What
/// still holds the batch fails inference, naming its node.
pub fn free_batch(g: &mut Graph) -> Option<u64> {
    let mut batch = None;
    for v in g.inputs().to_vec() {
        let ty = g.ty(v).clone();
        if let (Some(d), Some(s)) = (ty.dtype, &ty.shape) {
            if let Some(&Dim::Fixed(b)) = s.dims().first() {
                let mut dims = s.dims().to_vec();
                dims[0] = Dim::sym("batch");
                g.set_ty(v, TypeInfo::new(d, Shape(dims)));
                batch.get_or_insert(b);
            }
        }
    }
    let b = batch.filter(|&b| b > 1)?;
    for v in g.value_ids().collect::<Vec<_>>() {
        if matches!(g.value(v).def(), mpc_ir::Def::Node(..)) {
            if let Some(s) = g.ty(v).shape.as_ref().filter(|s| s.dims().first() == Some(&Dim::Fixed(b))) {
                let mut ty = g.ty(v).clone();
                ty.shape = Some(Shape([&[Dim::Unknown], &s.dims()[1..]].concat()));
                g.set_ty(v, ty);
            }
        }
    }
    fold_shape_arithmetic(g);
    // A parameter is the model's own, whatever its shape: only constants are rewritten (in a
    // dynamo export, those its signature does not name: a class token the exporter expanded to
    // the batch trains as its first slice, which the broadcast gives every sample).
    let params: HashSet<ValueId> = match mpc_passes::train::ExportSignature::of(g) {
        Some(sig) => g.initializers().filter(|&v| sig.names_parameter(g.name(v))).collect(),
        None => mpc_passes::train::trainable(g, &Default::default()).into_iter().collect(),
    };
    for n in g.node_ids().collect::<Vec<_>>() {
        for slot in 0..g.node(n).inputs().len() {
            let input = g.node(n).input(slot).filter(|v| !params.contains(v));
            let Some(c) = input.and_then(|v| g.constant(v)).cloned() else { continue };
            let name = g.unique_name(&format!("{}.any_batch", g.name(g.node(n).input(slot).expect("read above"))));
            let v = match freed_of(g, n, slot, &c, b) {
                Some(Freed::Constant(t)) => g.add_initializer(&name, t),
                Some(Freed::Target(dims, at)) => batch_target(g, &name, &dims, &at),
                None => continue,
            };
            g.set_input(n, slot, Some(v));
        }
    }
    Some(b)
}

/// What a constant holding the export's batch becomes.
enum Freed {
    Constant(Tensor),
    /// An Expand's target whose entries at these positions are the batch of the data, read from
    /// the first input's shape when the step runs.
    Target(Vec<i64>, Vec<usize>),
}

/// A shape `dims` with the entries at `at` the leading dim of the graph's first input: Concat of
/// the constant runs and `Shape(input)[0:1]`.
fn batch_target(g: &mut Graph, name: &str, dims: &[i64], at: &[usize]) -> ValueId {
    let input = g.inputs()[0];
    let shape_op = Op::Shape(mpc_ir::ops::ShapeAttrs { start: 0, end: Some(1) });
    let batch = g.add_op(&format!("{name}.batch"), shape_op, &[Some(input)], 1).1[0];
    let mut parts = Vec::new();
    let mut run = Vec::new();
    for (i, &d) in dims.iter().enumerate() {
        if at.contains(&i) {
            if !run.is_empty() {
                let c = g.add_initializer(
                    &g.unique_name(&format!("{name}.dims")),
                    Tensor::from_i64(vec![run.len() as u64], &run),
                );
                parts.push(Some(c));
                run.clear();
            }
            parts.push(Some(batch));
        } else {
            run.push(d);
        }
    }
    if !run.is_empty() {
        let c =
            g.add_initializer(&g.unique_name(&format!("{name}.dims")), Tensor::from_i64(vec![run.len() as u64], &run));
        parts.push(Some(c));
    }
    g.add_op(name, Op::Concat(mpc_ir::ops::ConcatAttrs { axis: 0 }), &parts, 1).1[0]
}

/// Constant `c`, read at `slot` of node `n`, with the export's batch `b` freed, or `None` where it
/// holds none: a shape operand's batch entry becomes -1 or 0 (Reshape), the data's batch (Expand,
/// at any position whose input dim is 1) or 1 (ConstantOfShape, leading: broadcasting restores
/// it); a constant of one value (zeros, ones) 1 along every axis of size `b` where its reader
/// broadcasts (Expand, the element-wise ops, an RNN's initial state); and a constant of equal
/// slices along a leading `b` its first slice.
fn freed_of(g: &mut Graph, n: mpc_ir::NodeId, slot: usize, c: &Tensor, b: u64) -> Option<Freed> {
    let broadcasts = match &g.node(n).op {
        Op::Expand | Op::Add | Op::Sub | Op::Mul | Op::Div | Op::Where => true,
        Op::Opaque(o) => matches!(o.op_type.as_str(), "LSTM" | "GRU") && matches!(slot, 5 | 6),
        _ => false,
    };
    if broadcasts && c.all_equal() && c.shape().contains(&b) && !(matches!(g.node(n).op, Op::Expand) && slot == 1) {
        let shape: Vec<u64> = c.shape().iter().map(|&d| if d == b { 1 } else { d }).collect();
        let n = shape.iter().product::<u64>() as usize;
        let one = c.bytes().slice(..c.dtype().size());
        let bytes: Vec<u8> = one.iter().copied().cycle().take(n * one.len()).collect();
        return Tensor::from_bytes(c.dtype(), shape, bytes.into()).ok().map(Freed::Constant);
    }
    let t = freed_operand(g, n, slot, c, b)?;
    Some(t)
}

/// [`freed_of`] for shape operands and equal slices.
fn freed_operand(g: &mut Graph, n: mpc_ir::NodeId, slot: usize, c: &Tensor, b: u64) -> Option<Freed> {
    let b = b as i64;
    match (&g.node(n).op, slot) {
        (Op::Reshape(a), 1) => {
            let mut dims = c.to_i64_vec().filter(|d| d.first() == Some(&b))?;
            dims[0] = match (dims.contains(&-1), a.allowzero) {
                (false, _) => -1,
                (true, false) => 0,
                // `allowzero` makes 0 a size: it means "copy" again only where no entry is 0.
                (true, true) if !dims.contains(&0) => {
                    *g.node_op_mut(n) = Op::Reshape(mpc_ir::ops::ReshapeAttrs { allowzero: false });
                    0
                }
                (true, true) => return None,
            };
            Some(Freed::Constant(Tensor::from_i64(vec![dims.len() as u64], &dims)))
        }
        (Op::Expand, 1) => {
            let mut dims = c.to_i64_vec()?;
            let x = g.node(n).input(0).and_then(|x| g.ty(x).shape.clone());
            let rank = dims.len();
            let one_in_x = |i: usize| match &x {
                // Right-aligned broadcasting: a dim the input lacks, or has as 1.
                Some(s) => i + s.rank() < rank || s.dims()[i + s.rank() - rank].fixed() == Some(1),
                None => i == 0,
            };
            let at: Vec<usize> = (0..rank).filter(|&i| dims[i] == b && one_in_x(i)).collect();
            (!at.is_empty()).then(|| Freed::Target(std::mem::take(&mut dims), at))
        }
        (Op::ConstantOfShape(_), 0) => {
            let mut dims = c.to_i64_vec().filter(|d| d.first() == Some(&b))?;
            dims[0] = 1;
            Some(Freed::Constant(Tensor::from_i64(vec![dims.len() as u64], &dims)))
        }
        _ => first_of_equal_slices(c, b as u64).map(Freed::Constant),
    }
}

/// Folds the integer shape arithmetic on constants (`Where(Equal(C, -1), 1, C)` around an Expand's
/// target): what an export computes from the batch it holds becomes a constant that can be freed.
/// Integer results only (the types are not inferred yet): float constants stay as written.
fn fold_shape_arithmetic(g: &mut Graph) {
    let ints = |outs: &[HostTensor]| outs.iter().all(|t| !t.dtype().is_float());
    while crate::run::fold_constants(g, &HashSet::new(), &ints).unwrap_or(0) > 0 {}
}

/// The first slice of `t` along its leading dim, when that dim is `b` and every slice equals it.
/// A vector is left alone: its one dim is as likely a size of the model's own (channels, groups)
/// as the batch.
fn first_of_equal_slices(t: &Tensor, b: u64) -> Option<Tensor> {
    if t.shape().len() < 2 || t.shape().first() != Some(&b) {
        return None;
    }
    let bytes = t.bytes();
    let slice = bytes.len() / b as usize;
    if slice == 0 || bytes.chunks(slice).any(|c| c != &bytes[..slice]) {
        return None;
    }
    let shape = [&[1], &t.shape()[1..]].concat();
    Tensor::from_bytes(t.dtype(), shape, bytes.slice(..slice)).ok()
}

/// Rows `idx` of `t` (first dim), reshaped to `shape` per sample when given.
fn take_rows(t: &HostTensor, idx: &[usize], sample: Option<&[usize]>) -> HostTensor {
    let row: usize = t.shape[1..].iter().product();
    let flat: Vec<usize> = idx.iter().flat_map(|&r| r * row..(r + 1) * row).collect();
    let mut shape = vec![idx.len()];
    match sample {
        Some(s) => shape.extend(s),
        None => shape.extend(&t.shape[1..]),
    }
    t.pick(shape, &flat)
}

/// A permutation of `0..n` drawn from `seed` (Fisher-Yates over xorshift).
fn permutation(n: usize, seed: u64) -> Vec<usize> {
    let mut s = seed.wrapping_mul(0x9e3779b97f4a7c15) ^ 0x2545f4914f6cdd1d;
    let mut next = move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        s
    };
    let mut p: Vec<usize> = (0..n).collect();
    for i in (1..n).rev() {
        let j = (next() % (i as u64 + 1)) as usize;
        p.swap(i, j);
    }
    p
}

/// The data tensors the graph reads, checked against its inputs: (name, tensor, per-sample shape).
fn feeds_for(
    g: &Graph,
    data: &HashMap<String, HostTensor>,
    path: &Path,
) -> Result<Vec<(String, HostTensor, Vec<usize>)>> {
    let usage = |m: String| Error::Usage(format!("{}: {m}", path.display()));
    let mut out = Vec::new();
    let mut samples = None;
    for &v in g.inputs() {
        let name = g.name(v);
        let t = data.get(name).ok_or_else(|| {
            let mut have: Vec<&str> = data.keys().map(|k| k.as_str()).collect();
            have.sort();
            usage(format!("no tensor `{name}` for the graph input of that name (the file has: {})", have.join(", ")))
        })?;
        let want = g.ty(v).dtype.unwrap_or(t.dtype());
        if t.dtype() != want {
            return Err(usage(format!("tensor `{name}` is {}, the graph input is {want}", t.dtype())));
        }
        if t.shape.is_empty() {
            return Err(usage(format!("tensor `{name}` has no sample dimension")));
        }
        let n = t.shape[0];
        if *samples.get_or_insert(n) != n {
            return Err(usage(format!("tensor `{name}` has {n} samples, others have {}", samples.unwrap_or(0))));
        }
        // Per-sample shape: the graph's when fixed and of the same size (images stored flat).
        let row: usize = t.shape[1..].iter().product();
        let sample = g
            .ty(v)
            .shape
            .as_ref()
            .and_then(|s| s.dims()[1..].iter().map(|d| d.fixed().map(|x| x as usize)).collect::<Option<Vec<_>>>())
            .filter(|s| s.iter().product::<usize>() == row)
            .unwrap_or_else(|| t.shape[1..].to_vec());
        out.push((name.to_string(), t.clone(), sample));
    }
    Ok(out)
}

/// `model` with the symbolic dims of its inputs other than the batch (a sequence length, an image
/// size) bound to what the samples of `batch_of` (its inputs, by name) have, so that the training
/// step is built for them: the backward pass of a recurrence, and of the shape arithmetic the
/// exporters write around attention, needs them. The batch (the symbols of the inputs' leading
/// dims) stays symbolic.
pub fn bind_sample_dims(model: &Graph, batch_of: &HashMap<String, HostTensor>, path: &Path) -> Result<Graph> {
    // The shapes only: the fixed dims and dtypes are checked against each batch when it is lowered.
    crate::run::bind_sample_dims(model, crate::run::input_sizes(model, batch_of, path)?, path)
}

/// What [`bind_sample_dims`] bound in `model` to give `bound`, and where: "the data's `seq` is 16
/// (input `input_ids` axis 1)", or nothing.
fn bound_from(model: &Graph, bound: &Graph) -> String {
    let (mut said, mut seen) = (Vec::new(), HashSet::new());
    for (&v, &b) in model.inputs().iter().zip(bound.inputs()) {
        let (Some(s), Some(t)) = (model.ty(v).shape.as_ref(), bound.ty(b).shape.as_ref()) else { continue };
        for (axis, (d, n)) in s.dims().iter().zip(t.dims()).enumerate() {
            if let (Dim::Sym(e), Dim::Fixed(n)) = (d, n) {
                if seen.insert(e.to_string()) {
                    said.push(format!("the data's `{e}` is {n} (input `{}` axis {axis})", model.name(v)));
                }
            }
        }
    }
    said.join(", ")
}

/// The program of a session that runs a batch (by name), lowered for it when it is the first of
/// its binding.
type ProgramFor<'a, D> = dyn FnMut(&HashMap<String, HostTensor>, &mut Session<D>) -> Result<ProgramId> + 'a;

/// A binding of the symbolic dims, in order: the key of a lowered program.
type Dims = BTreeMap<String, u64>;

/// The dims a batch binds in `g` ([`crate::run::input_dims`]: checked, one line naming the input
/// and axis at fault).
fn dims_of(g: &Graph, batch: &HashMap<String, HostTensor>, path: &Path) -> Result<Dims> {
    Ok(crate::run::input_dims(g, batch, path)?.into_iter().collect())
}

fn batch_feeds(feeds: &[(String, HostTensor, Vec<usize>)], idx: &[usize]) -> HashMap<String, HostTensor> {
    feeds.iter().map(|(n, t, s)| (n.clone(), take_rows(t, idx, Some(s)))).collect()
}

/// The forward graph for evaluation: the training pipeline up to the precision pass (loss and
/// masters included), with batch normalisation back on its running statistics and dropout off.
fn eval_graph(model: &Graph, path: &Path, opts: &Options) -> Result<Graph> {
    let mut g = model.clone();
    let o = Options { stop_after: Some("precision".into()), dump_after: Vec::new(), ..opts.clone() };
    crate::compile(&mut g, path, &o, &mut |_, _| {})?;
    let mut drop = Vec::new();
    for n in g.node_ids().collect::<Vec<_>>() {
        if let Op::BatchNormalization(a) = g.node_op_mut(n) {
            a.training_mode = false;
            drop.extend(g.node(n).outputs()[1..].iter().copied());
        }
        if matches!(g.node(n).op, Op::Dropout(_)) {
            g.truncate_inputs(n, 2);
        }
    }
    let outs: Vec<ValueId> = g.outputs().iter().copied().filter(|v| !drop.contains(v)).collect();
    g.set_outputs(outs);
    Ok(g)
}

/// The held-out samples of `n`: `eval_split` as a share when below 1, else as a count.
fn eval_count(cfg: &TrainConfig, n: usize) -> usize {
    let n_eval =
        if cfg.eval_split < 1.0 { ((n as f64) * cfg.eval_split).round() as usize } else { cfg.eval_split as usize };
    n_eval.min(n)
}

/// The batches of every epoch over `n` samples: the run a schedule spans (--max-steps stops a
/// run that may be resumed, and does not shorten its schedule).
fn run_length(cfg: &TrainConfig, n: usize) -> usize {
    cfg.epochs * (n - eval_count(cfg, n)).div_ceil(cfg.batch.max(1))
}

/// `opts` with its learning-rate schedule spanning the run's updates (where it has no length of
/// its own): its batches, or under gradient accumulation its whole groups of micro-batches.
fn with_run_length(opts: &Options, cfg: &TrainConfig, n: usize) -> Options {
    let mut o = opts.clone();
    if let Some(t) = o.train.as_mut() {
        let updates = run_length(cfg, n) / t.accumulate.max(1) as usize;
        if let Some(s) = t.schedule.as_mut() {
            *s = s.for_run(updates as u64);
        }
    }
    o
}

fn checkpoint_file(dir: &Path) -> PathBuf {
    dir.join("checkpoint.safetensors")
}

/// Trains `model` (loaded from `path`) as `opts` and `cfg` say; `report` receives each epoch.
pub fn train(
    model: &Graph,
    path: &Path,
    opts: &Options,
    cfg: &TrainConfig,
    report: &mut dyn FnMut(&EpochReport),
) -> Result<Trained> {
    train_on(CpuDevice::default(), model, path, opts, cfg, report)
}

/// [`train`] on `device`.
pub fn train_on<D: Device>(
    device: D,
    model: &Graph,
    path: &Path,
    opts: &Options,
    cfg: &TrainConfig,
    report: &mut dyn FnMut(&EpochReport),
) -> Result<Trained> {
    let rerr = |source| Error::Run { path: path.to_owned(), source };
    let data = crate::run::read_safetensors(&cfg.data)?;
    let model_feeds = feeds_for(model, &data, &cfg.data)?;
    // A schedule spans the run: its updates, from the samples and the epochs.
    let samples = model_feeds.first().map_or(0, |f| f.1.shape[0]);
    let opts = &with_run_length(opts, cfg, samples);
    let mut fwd = match model_feeds {
        f if f.first().is_some_and(|f| f.1.shape[0] > 0) => bind_sample_dims(model, &batch_feeds(&f, &[0]), path)?,
        _ => model.clone(),
    };
    // Where a bound dim came from, for a batch that does not fit it (labels of another length).
    let bound_from = bound_from(model, &fwd);
    let export_batch = free_batch(&mut fwd);
    let mut g = fwd.clone();
    // A model whose batch is built into it names the node that holds it.
    let pinned = |e: Error| {
        match (e, export_batch) {
        (Error::Pass { path, source }, Some(b)) => Error::Usage(format!(
            "{}: {source} (the model was exported with a fixed batch of {b}, which its graph still holds here: export it with a dynamic batch axis)",
            path.display()
        )),
        (e, _) => e,
    }
    };
    let cx = crate::compile(&mut g, path, opts, &mut |_, _| {}).map_err(pinned)?;
    // The bounds of dynamic loss scaling, which a resumed scale must lie within.
    let scale_bounds = cx.train.as_ref().and_then(|t| match &t.loss_scale {
        mpc_passes::train::LossScale::Dynamic { attrs, .. } => Some((attrs.min_scale, attrs.max_scale)),
        _ => None,
    });
    let (ties, folded, auto_scale) = (cx.ties, cx.folded, cx.auto_scale);
    let eval_g = eval_graph(&fwd, path, opts)?;
    let sig = g.train.clone().unwrap_or_default();
    let state = sig.state;
    let missing = |what: &str| Error::Run {
        path: path.to_owned(),
        source: mpc_runtime::RuntimeError::Internal(format!("the training graph has no {what}")),
    };
    let loss = sig.loss.ok_or_else(|| missing("loss"))?;
    let skipped = sig.skipped.ok_or_else(|| missing("step flag"))?;
    let scale = sig.loss_scale;

    let feeds = feeds_for(&g, &data, &cfg.data)?;
    let n = feeds.first().map_or(0, |f| f.1.shape[0]);
    let n_eval = eval_count(cfg, n);
    let n_train = n - n_eval;
    if n_train == 0 || cfg.batch == 0 {
        return Err(Error::Usage(format!(
            "{}: no training samples (batch {}, {n} samples)",
            cfg.data.display(),
            cfg.batch
        )));
    }
    let per_epoch = n_train.div_ceil(cfg.batch);

    // One program per binding of the symbolic dims (the batch, whose last one in an epoch may be
    // smaller; a sequence length; an image size), each bound from the batch's own tensors, all
    // over one state.
    let state_ids: HashSet<ValueId> = state.iter().map(|&(s, _)| s).collect();
    let caps = device.caps();
    let lower_at = |g: &Graph, dims: &Dims, layout: Option<&StateLayout>, variables: &HashSet<ValueId>| {
        let dims: HashMap<String, u64> = dims.iter().map(|(k, &v)| (k.clone(), v)).collect();
        let changing: HashSet<ValueId> = state_ids.union(variables).copied().collect();
        let (bound, _) = crate::run::fold_and_infer(g.clone(), &dims, &changing, path).map_err(pinned)?;
        crate::run::lower_bound(&bound, caps, layout, Some(variables), path)
    };
    let first = batch_feeds(&feeds, &(0..cfg.batch.min(n_train)).collect::<Vec<_>>());
    // The dims a batch binds; where it does not fit, the message names the input and axis, and
    // where it came from the dim the data bound, or the node of an export that holds its batch.
    let dims_for = |batch: &HashMap<String, HostTensor>| {
        dims_of(&g, batch, path).map_err(|e| match e {
            Error::Usage(_) if export_batch.is_some() => {
                let sizes = crate::run::input_sizes(&g, batch, path).map(|d| d.into_iter().collect());
                match sizes.and_then(|d| lower_at(&g, &d, None, &HashSet::new())) {
                    Err(pinned) => pinned,
                    Ok(_) => e,
                }
            }
            Error::Usage(m) if !bound_from.is_empty() => Error::Usage(format!("{m}; {bound_from}")),
            e => e,
        })
    };
    let first_dims = dims_for(&first)?;
    let main: Program = lower_at(&g, &first_dims, None, &HashSet::new())?;
    let layout = main.state_layout.clone();
    let mut session = Session::new(device, main).map_err(rerr)?;
    let mut train_programs: HashMap<Dims, ProgramId> = HashMap::from([(first_dims, 0)]);
    // Evaluation reads the training state in place: its weights are variables at the same slots.
    let eval_vars: HashSet<ValueId> =
        eval_g.initializers().filter(|&v| layout.find(eval_g.name(v)).is_some()).collect();
    let mut eval_programs: HashMap<Dims, ProgramId> = HashMap::new();
    let loss_name = g.name(loss).to_string();
    let skipped_name = g.name(skipped).to_string();
    // The loss scale: a training state under dynamic scaling, read back as it moves; a constant
    // of the graph under a static one.
    let is_state = |v: ValueId| state.iter().any(|&(s, _)| s == v);
    let scale_name = scale.filter(|&s| is_state(s)).map(|s| g.name(s).to_string());
    let fixed_scale = scale.filter(|&s| !is_state(s)).and_then(|s| g.constant(s)).map(|t| t.to_f64_vec()[0]);
    let mut iteration = 0usize;
    if cfg.resume {
        let dir = cfg.checkpoint.as_ref().ok_or_else(|| Error::Usage("--resume needs --checkpoint DIR".into()))?;
        let file = checkpoint_file(dir);
        let saved = crate::run::read_safetensors(&file)?;
        let bad = |what: String| Error::Usage(format!("{}: {what}", file.display()));
        for &(s, _) in &state {
            let name = g.name(s);
            // A master's low-precision copy that the checkpoint lacks (one written with
            // --no-weight-copies) is its master rounded.
            let copy = low_copy_of(name, &saved, g.ty(s).dtype);
            // A checkpoint from before the rate was state keeps this run's rate.
            if name == mpc_passes::train::LR && !saved.contains_key(name) {
                continue;
            }
            let t = saved
                .get(name)
                .or(copy.as_ref())
                .ok_or_else(|| bad(format!("no tensor `{name}` (a checkpoint of another model?)")))?;
            check_state(name, t, scale.is_some_and(|v| v == s).then_some(scale_bounds).flatten()).map_err(&bad)?;
            session.write_state(name, t).map_err(rerr)?;
        }
        let done =
            saved.get("mpc.iteration").ok_or_else(|| bad("no `mpc.iteration`: not a checkpoint mpc wrote".into()))?;
        iteration = match (done.shape.as_slice(), done.i64s().as_deref()) {
            ([], Some(&[n])) if n >= 0 => n as usize,
            _ => return Err(bad("`mpc.iteration` is not a count of batches (a non-negative int64 scalar)".into())),
        };
    }
    let total = (cfg.epochs * per_epoch).min(cfg.max_steps.unwrap_or(usize::MAX));
    if iteration >= total && cfg.resume {
        return Err(Error::Usage(format!(
            "{}: the checkpoint has done {iteration} batches, and this run has {total} ({} epochs of {per_epoch}): nothing is left to train; raise --epochs",
            cfg.checkpoint.as_ref().map_or(Path::new("").into(), |d| checkpoint_file(d)).display(),
            cfg.epochs
        )));
    }
    let bar = if cfg.progress {
        let b = indicatif::ProgressBar::new(total as u64);
        b.set_style(
            indicatif::ProgressStyle::with_template("{bar:30} {pos}/{len} {msg}")
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
        );
        b.set_position(iteration as u64);
        b
    } else {
        indicatif::ProgressBar::hidden()
    };
    // The rate each step applied: the schedule's output, else the state (set from the host).
    let lr_name = sig.lr.map_or(mpc_passes::train::LR.to_string(), |v| g.name(v).to_string());
    let mut log = StepLog::open(cfg.log.as_deref(), cfg.resume)?;
    let mut out = Trained {
        epochs: Vec::new(),
        losses: Vec::new(),
        skipped: Vec::new(),
        state: Vec::new(),
        stats: String::new(),
        ties,
        folded,
        auto_scale,
    };
    let mut skipped_total = 0usize;
    let mut pending = Vec::with_capacity(PRINT_EVERY);
    while iteration < total {
        let epoch = iteration / per_epoch;
        let order = permutation(n_train, cfg.seed ^ (epoch as u64).wrapping_mul(0x100000001b3));
        let t0 = Instant::now();
        let (mut sum, mut count, mut samples, mut skipped_epoch) = (0f64, 0usize, 0usize, 0usize);
        while iteration < total && iteration / per_epoch == epoch {
            let k = iteration % per_epoch;
            let idx = &order[k * cfg.batch..((k + 1) * cfg.batch).min(n_train)];
            let batch = batch_feeds(&feeds, idx);
            let dims = dims_for(&batch)?;
            let id = match train_programs.get(&dims) {
                Some(&id) => id,
                None => {
                    let p = lower_at(&g, &dims, Some(&layout), &HashSet::new())?;
                    let id = session.load(p).map_err(rerr)?;
                    train_programs.insert(dims, id);
                    id
                }
            };
            session.feed(id, &batch).map_err(rerr)?;
            session.step(id).map_err(rerr)?;
            // The loss and the flag go to the host without a wait; they are read when printed.
            // The rate this step applied and the loss scale after it, for the log.
            let later = |session: &mut Session<D>, name: Option<&str>| {
                name.filter(|_| log.is_on()).map(|n| session.read_later(id, n)).transpose().map_err(rerr)
            };
            pending.push(Pending {
                step: iteration + 1,
                loss: session.read_later(id, &loss_name).map_err(rerr)?,
                skipped: session.read_later(id, &skipped_name).map_err(rerr)?,
                lr: later(&mut session, Some(&lr_name))?,
                scale: later(&mut session, scale_name.as_deref())?,
            });
            samples += idx.len();
            iteration += 1;
            let epoch_ends = iteration == total || iteration / per_epoch != epoch;
            if pending.len() >= PRINT_EVERY || epoch_ends {
                let mut last = 0.0;
                let per_s = samples as f64 / t0.elapsed().as_secs_f64().max(1e-9);
                for p in pending.drain(..) {
                    let mut value = |h| session.wait(h).map(|t| t.f64s()[0]).map_err(rerr);
                    let l = value(p.loss)?;
                    let was_skipped = value(p.skipped)? != 0.0;
                    if let Some(lr) = p.lr {
                        let scale = p.scale.map(&mut value).transpose()?.or(fixed_scale);
                        log.write(serde_json::json!({
                            "step": p.step, "epoch": epoch + 1, "loss": l as f32, "lr": value(lr)? as f32,
                            "loss_scale": scale, "skipped": was_skipped, "samples_per_s": per_s,
                        }))?;
                    }
                    out.losses.push(l as f32);
                    out.skipped.push(was_skipped);
                    if was_skipped {
                        skipped_epoch += 1;
                        skipped_total += 1;
                    } else {
                        sum += l;
                        count += 1;
                    }
                    last = l;
                }
                let s = match &scale_name {
                    Some(n) => Some(session.read_state(n).map_err(rerr)?.f64s()[0]),
                    None => fixed_scale,
                };
                bar.set_position(iteration as u64);
                bar.set_message(format!(
                    "loss {last:.4}{} skipped {skipped_total} {} samples/s",
                    s.map_or(String::new(), |s| format!(" scale {s}")),
                    rate(per_s)
                ));
            }
        }
        let secs = t0.elapsed().as_secs_f64().max(1e-9);
        let eval = if n_eval > 0 && (iteration % per_epoch == 0 || iteration == total) {
            let rows: Vec<usize> = (n_train..n).collect();
            let mut programs = |feed: &HashMap<String, HostTensor>, session: &mut Session<D>| -> Result<ProgramId> {
                let dims = dims_of(&eval_g, feed, path)?;
                if let Some(&id) = eval_programs.get(&dims) {
                    return Ok(id);
                }
                let id = session.load(lower_at(&eval_g, &dims, Some(&layout), &eval_vars)?).map_err(rerr)?;
                eval_programs.insert(dims, id);
                Ok(id)
            };
            Some(evaluate(&mut session, opts, &mut programs, &eval_g, &feeds, &rows, cfg.batch, path)?)
        } else {
            None
        };
        if let Some((acc, l)) = eval {
            log.write(
                serde_json::json!({"step": iteration, "epoch": epoch + 1, "eval_loss": l, "eval_accuracy": acc}),
            )?;
        }
        let loss_scale = match &scale_name {
            Some(n) => Some(session.read_state(n).map_err(rerr)?.f64s()[0]),
            None => fixed_scale,
        };
        let rep = EpochReport {
            epoch: epoch + 1,
            mean_loss: sum / count.max(1) as f64,
            loss_scale,
            skipped: skipped_epoch,
            samples_per_s: samples as f64 / secs,
            eval,
        };
        bar.suspend(|| report(&rep));
        out.epochs.push(rep);
        if let Some(dir) = &cfg.checkpoint {
            save_checkpoint(dir, &mut session, &g, &state, iteration)?;
        }
    }
    bar.finish_and_clear();
    log.finish()?;
    for &(s, _) in &state {
        out.state.push((g.name(s).to_string(), session.read_state(g.name(s)).map_err(rerr)?));
    }
    out.stats = crate::run::stats_line(session.program(0).map_err(rerr)?, &session.stats(0));
    Ok(out)
}

/// A step's numbers on their way to the host.
struct Pending<S> {
    /// The count of batches done after it.
    step: usize,
    loss: mpc_runtime::session::Pending<S>,
    skipped: mpc_runtime::session::Pending<S>,
    /// The rate it applied and the loss scale after it, read when there is a log.
    lr: Option<mpc_runtime::session::Pending<S>>,
    scale: Option<mpc_runtime::session::Pending<S>>,
}

/// `--log FILE.jsonl`: one JSON object per line, written as the steps' numbers reach the host
/// (every [`PRINT_EVERY`] steps and at the end of an epoch). A step's line holds `step` (the
/// count of batches done), `epoch`, `loss`, `lr` (the rate the step applied), `loss_scale` (after
/// the step; null without scaling), `skipped` and `samples_per_s` (the epoch's so far); an
/// evaluation's line `step`, `epoch`, `eval_loss` and `eval_accuracy`. A resumed run appends.
pub struct StepLog {
    out: Option<(PathBuf, std::io::BufWriter<std::fs::File>)>,
}

impl StepLog {
    pub fn open(path: Option<&Path>, append: bool) -> Result<Self> {
        let Some(path) = path else { return Ok(StepLog { out: None }) };
        let file = std::fs::OpenOptions::new()
            .create(true)
            .write(true)
            .append(append)
            .truncate(!append)
            .open(path)
            .map_err(|source| Error::Output { path: path.to_owned(), source })?;
        Ok(StepLog { out: Some((path.to_owned(), std::io::BufWriter::new(file))) })
    }

    fn is_on(&self) -> bool {
        self.out.is_some()
    }

    pub fn write(&mut self, line: serde_json::Value) -> Result<()> {
        use std::io::Write;
        let Some((path, out)) = self.out.as_mut() else { return Ok(()) };
        writeln!(out, "{line}").map_err(|source| Error::Output { path: path.clone(), source })
    }

    pub fn finish(&mut self) -> Result<()> {
        use std::io::Write;
        let Some((path, out)) = self.out.as_mut() else { return Ok(()) };
        out.flush().map_err(|source| Error::Output { path: path.clone(), source })
    }
}

/// Accuracy (argmax of the first model output against the labels) and mean loss on `rows`, by
/// the evaluation programs (`program` gives the one for a batch size) over the training state.
#[allow(clippy::too_many_arguments)]
fn evaluate<D: Device>(
    session: &mut Session<D>,
    opts: &Options,
    program: &mut ProgramFor<'_, D>,
    eval_g: &Graph,
    feeds: &[(String, HostTensor, Vec<usize>)],
    rows: &[usize],
    batch: usize,
    path: &Path,
) -> Result<(f64, f64)> {
    let rerr = |source| Error::Run { path: path.to_owned(), source };
    let loss = mpc_passes::train::loss_value(eval_g);
    let scores =
        eval_g.outputs().iter().copied().find(|&v| Some(v) != loss && eval_g.ty(v).dtype.is_some_and(|d| d.is_float()));
    // Accuracy is the share of labels (not ignored) whose class scores highest, on the class axis
    // of a cross-entropy loss; other losses have none.
    let ce = match opts.train.as_ref().map(|t| (&t.loss, t.labels.as_str())) {
        Some((mpc_passes::train::Loss::CrossEntropy(ce), name)) => Some((*ce, name)),
        _ => None,
    };
    let labels = ce.and_then(|(_, name)| eval_g.inputs().iter().copied().find(|&v| eval_g.name(v) == name));
    let (mut correct, mut total, mut loss_sum, mut batches) = (0usize, 0usize, 0f64, 0usize);
    for chunk in rows.chunks(batch.max(1)) {
        let feed = batch_feeds(feeds, chunk);
        let id = program(&feed, session)?;
        session.feed(id, &feed).map_err(rerr)?;
        session.step(id).map_err(rerr)?;
        if let Some(l) = loss {
            loss_sum += session.read(id, eval_g.name(l)).map_err(rerr)?.f64s()[0];
            batches += 1;
        }
        if let (Some(sc), Some(lb), Some((ce, _))) = (scores, labels.and_then(|l| feed.get(eval_g.name(l))), ce) {
            let sc = session.read(id, eval_g.name(sc)).map_err(rerr)?;
            let (v, y) = (sc.f64s(), lb.i64s().unwrap_or_default());
            let Some(axis) = mpc_ir::normalize_axis(ce.axis, sc.shape.len()) else { continue };
            // Scores [outer, classes, inner]; label `o * inner + j` is scored at (o, k, j).
            let (c, inner) = (sc.shape[axis], sc.shape[axis + 1..].iter().product::<usize>());
            for (i, &label) in y.iter().enumerate() {
                if Some(label) == ce.ignore_index {
                    continue;
                }
                let (o, j) = (i / inner.max(1), i % inner.max(1));
                let at = |k: usize| v[(o * c + k) * inner + j];
                let best = (0..c).fold(0, |b, k| if at(k) > at(b) { k } else { b });
                correct += (best as i64 == label) as usize;
                total += 1;
            }
        }
    }
    Ok((correct as f64 / total.max(1) as f64, loss_sum / batches.max(1) as f64))
}

/// The state `mpc.<dtype>.<master>` (a master weight's low-precision copy) made from the master
/// in `saved`, when `name` is such a copy that `saved` does not hold.
fn low_copy_of(name: &str, saved: &HashMap<String, HostTensor>, dtype: Option<DType>) -> Option<HostTensor> {
    let dtype = dtype.filter(|d| matches!(d, DType::F16 | DType::BF16))?;
    let master = name.strip_prefix(&format!("mpc.{dtype}."))?;
    (!saved.contains_key(name)).then(|| saved.get(master).map(|m| m.cast(dtype))).flatten()
}

/// Checks a state tensor read from a checkpoint: finite floats; integer counters not negative
/// (the random key `mpc.rng` may be anything); the loss scale within its bounds.
fn check_state(name: &str, t: &HostTensor, scale_bounds: Option<(f32, f32)>) -> std::result::Result<(), String> {
    if t.dtype().is_float() {
        if let Some(x) = t.f64s().into_iter().find(|x| !x.is_finite()) {
            return Err(format!("`{name}` holds {x}: a checkpoint holds only finite values"));
        }
        if let (Some((lo, hi)), Some(&s)) = (scale_bounds, t.f64s().first()) {
            if s < f64::from(lo) || s > f64::from(hi) {
                return Err(format!(
                    "the loss scale `{name}` is {s}, outside the dynamic scaling's bounds [{lo}, {hi}]"
                ));
            }
        }
    } else if name != mpc_passes::train::RNG {
        if let Some(x) = t.i64s().unwrap_or_default().into_iter().find(|&x| x < 0) {
            return Err(format!("the counter `{name}` is {x}: counters are never negative"));
        }
    }
    Ok(())
}

/// Writes every state value and the iteration count, atomically.
fn save_checkpoint<D: Device>(
    dir: &Path,
    s: &mut Session<D>,
    g: &Graph,
    state: &[(ValueId, ValueId)],
    iteration: usize,
) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(|source| Error::Output { path: dir.to_owned(), source })?;
    let mut tensors = Vec::new();
    for &(v, _) in state {
        let t = s.read_state(g.name(v)).map_err(|source| Error::Run { path: dir.to_owned(), source })?;
        tensors.push((g.name(v).to_string(), t));
    }
    tensors.push(("mpc.iteration".into(), HostTensor::from_i64(DType::I64, vec![], vec![iteration as i64])));
    crate::run::write_safetensors(&checkpoint_file(dir), &tensors)
}

/// The original model with its initializers replaced by the trained values of the same name, and
/// the copies training tied read from the weight they were tied to.
pub fn with_trained_weights(model: &Graph, state: &[(String, HostTensor)], ties: &[mpc_passes::train::Tie]) -> Graph {
    let mut g = model.clone();
    mpc_passes::train::apply_ties(&mut g, ties);
    for (name, t) in state {
        if let Some(v) = g.find(name) {
            let Some(dt) = g.value(v).initializer().map(|i| i.dtype()) else { continue };
            g.set_initializer(v, mpc_ir::Tensor::from(t).to_dtype(dt));
        }
    }
    g
}

/// A rate to three significant digits, and no decimals from 100 on: `12400`, `38.2`, `0.271`.
pub fn rate(x: f64) -> String {
    let decimals = if x >= 100.0 || x == 0.0 { 0 } else { (2 - x.abs().log10().floor() as i32).clamp(0, 6) as usize };
    format!("{x:.decimals$}")
}

#[cfg(test)]
mod tests {
    #[test]
    fn rates_keep_three_digits() {
        use super::rate;
        assert_eq!(
            [rate(12400.3), rate(138.6), rate(38.23), rate(5.0), rate(0.2712), rate(0.0)],
            ["12400", "139", "38.2", "5.00", "0.271", "0"]
        );
    }
}
