//! [`Trainer`]: a model's training step compiled once and kept on a device, its state resident.
//!
//! A trainer is made from a forward model, the [`Options`] of a compile with training options,
//! a device and a first batch (the tensors named after the model's inputs and the labels, the
//! first dim the sample). It binds the model's sample dims (a sequence length, an image size) to
//! the batch's, frees an export's fixed batch, runs the training pipeline once (the evaluation
//! graph is the same compile's graph after the precision pass), and lowers one program per
//! binding of the symbolic dims it is fed (a short last batch gets its own), all over one state.
//!
//! ```
//! use std::collections::HashMap;
//! use std::path::Path;
//! use mpc::trainer::Trainer;
//! use mpc_runtime::device::CpuDevice;
//! # fn main() -> mpc::Result<()> {
//! let path = Path::new("tests/models/digits_mlp.onnx");
//! let model = mpc::load(path)?;
//! let opts = mpc::Options {
//!     policy: Some("mixed".into()),
//!     train: Some(mpc_passes::train::TrainOptions::default()),
//!     ..Default::default()
//! };
//! let data = mpc::run::read_safetensors(Path::new("tests/data/digits.safetensors"))?;
//! // Batches of 64: rows of the images (64 pixels each) and of the labels.
//! let batch = |k: usize| -> HashMap<String, mpc_runtime::HostTensor> {
//!     let rows: Vec<usize> = (k * 64..(k + 1) * 64).collect();
//!     HashMap::from([
//!         ("images".to_string(), mpc::trainer::rows(&data["images"], &rows, None)),
//!         ("labels".to_string(), mpc::trainer::rows(&data["labels"], &rows, None)),
//!     ])
//! };
//! let mut trainer = Trainer::new(CpuDevice::default(), &model, path, &opts, &batch(0))?;
//! let mut pending = Vec::new();
//! for k in 0..20 {
//!     pending.push(trainer.step(&batch(k))?); // no wait for the device
//! }
//! for p in pending {
//!     let s = trainer.wait(p)?;
//!     println!("loss {} lr {} skipped {}", s.loss, s.lr, s.skipped);
//! }
//! let eval = trainer.evaluate(&batch(21))?;
//! println!("accuracy {}", eval.correct as f64 / eval.counted as f64);
//! let dir = std::env::temp_dir().join("mpc-trainer-example");
//! trainer.save(&dir.join("checkpoint.safetensors"), 20)?; // what --resume reads
//! trainer.set_lr(1e-4)?; // the next steps' rate
//! let trained = trainer.export(&model)?; // the model with the trained weights
//! mpc::save(&trained, &dir.join("trained.onnx"), mpc::Format::Onnx)?;
//! # Ok(()) }
//! ```

mod batch;
pub mod checkpoint;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};

pub use batch::free_batch;
use mpc_ir::{Dim, Graph, Op, ValueId};
use mpc_passes::train::{CrossEntropy, Loss, LossScale, Tie};
use mpc_runtime::device::Device;
use mpc_runtime::program::{DeviceCaps, Program, StateLayout};
use mpc_runtime::session::{Pending, ProgramId, Session};
use mpc_runtime::HostTensor;

use crate::{Error, Options, Result};

/// A binding of the symbolic dims, in order: the key of a lowered program.
type Dims = BTreeMap<String, u64>;

/// A training step compiled for a model and kept on a device: see the [module](self).
pub struct Trainer<D: Device> {
    session: Session<D>,
    /// The step compiled for each binding of the sample dims fed so far (a second sequence
    /// length is a second compile), all over one state; the first is the first batch's.
    variants: Vec<Variant>,
    /// The model and the options, to compile the step for another binding.
    source: (Graph, Options),
    layout: StateLayout,
    /// The programs loaded: by variant and the binding of every symbolic dim (the batch too).
    programs: HashMap<(usize, Dims), ProgramId>,
    eval_programs: HashMap<(usize, Dims), ProgramId>,
    names: Names,
    /// The bounds of dynamic loss scaling, which a loaded scale must lie within.
    scale_bounds: Option<(f32, f32)>,
    /// The class axis and the labels input of a cross-entropy loss: what accuracy is counted on.
    accuracy: Option<(CrossEntropy, String)>,
    compiled: Compiled,
    sharding: Option<Sharding>,
}

/// A state sharded over the ranks (`TrainOptions::shard_state`): this rank's place and, for
/// each state value that is a block, the shape of the whole.
#[derive(Clone, Debug)]
struct Sharding {
    at: mpc_passes::train::StateShard,
    shapes: HashMap<String, Vec<usize>>,
}

/// What the compile found out about the model.
#[derive(Clone, Debug, Default)]
pub struct Compiled {
    /// The exported copies of one weight trained as that weight.
    pub ties: Vec<Tie>,
    /// The constants trained as weights of their own in place of parameters the export folded
    /// ([`mpc_passes::train::folded_weights`]).
    pub folded: Option<(Vec<String>, Vec<String>)>,
    /// `--loss-scale auto`'s measurement.
    pub auto_scale: Option<mpc_passes::AutoScale>,
}

/// The step compiled for one binding of the sample dims.
struct Variant {
    /// The sample dims bound (every symbolic input dim but the batch's).
    sizes: Dims,
    step: Lowering,
    /// The forward graph for evaluation: batch normalisation on its running statistics, no
    /// dropout, the loss and the masters as in training. Its weights are variables at the
    /// training state's slots (`eval_vars`), read in place.
    eval: Graph,
    eval_vars: HashSet<ValueId>,
}

/// The names of the step's values a trainer reads.
#[derive(Clone, PartialEq)]
struct Names {
    loss: String,
    skipped: String,
    /// The rate the step applies: the schedule's output, else the state `mpc.lr`.
    lr: String,
    /// The loss scale: a state under dynamic scaling (read as it moves), else a constant.
    scale: Option<String>,
    fixed_scale: Option<f64>,
}

/// A step's numbers on their way to the host ([`Trainer::step`]); [`Trainer::wait`] reads them.
pub struct StepHandle<S> {
    loss: Pending<S>,
    skipped: Pending<S>,
    lr: Pending<S>,
    scale: Option<Pending<S>>,
}

/// What a step did.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepNumbers {
    /// The (unscaled) loss of the batch.
    pub loss: f32,
    /// Whether the update was skipped (a non-finite gradient under loss scaling).
    pub skipped: bool,
    /// The learning rate the step applied.
    pub lr: f32,
    /// The loss scale after the step; `None` without loss scaling.
    pub loss_scale: Option<f64>,
}

/// One evaluation batch's numbers.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct EvalNumbers {
    /// The batch's mean loss.
    pub loss: Option<f64>,
    /// Labels (not ignored) whose class scores highest, and labels counted (cross-entropy only).
    pub correct: usize,
    pub counted: usize,
}

/// A model's training step compiled for a device to load ([`TrainingStep::on`]): what
/// [`Trainer::new`] does in two halves, for a caller that makes its first batch from the step's
/// inputs (random data for a benchmark).
pub struct TrainingStep {
    /// The sample dims bound, and the model and options compiled.
    sizes: Dims,
    source: (Graph, Options),
    graph: Graph,
    eval: Graph,
    names: Names,
    scale_bounds: Option<(f32, f32)>,
    accuracy: Option<(CrossEntropy, String)>,
    compiled: Compiled,
    sharding: Option<Sharding>,
    export_batch: Option<u64>,
    bound_from: String,
    path: PathBuf,
}

impl TrainingStep {
    /// Compiles `model` (loaded from `path`, which messages name) as `opts` says, its sample dims
    /// bound to `sizes` (a sequence length, an image size: what a batch's tensors give them,
    /// [`crate::run::input_sizes`]; the batch stays symbolic), an export's fixed batch freed.
    pub fn compile(model: &Graph, path: &Path, opts: &Options, mut sizes: HashMap<String, u64>) -> Result<Self> {
        let batch = crate::run::batch_symbols(model);
        sizes.retain(|s, _| !batch.contains(s));
        let bound_from = bound_from(model, &sizes);
        let fwd =
            crate::run::bind_sample_dims(model, sizes.clone(), path).map_err(|e| bound_by_data(e, &bound_from))?;
        let mut graph = fwd;
        let export_batch = free_batch(&mut graph);
        // The evaluation graph is the pipeline's graph after the precision pass.
        let mut o = opts.clone();
        o.dump_after.push("precision".into());
        let mut eval = None;
        let cx = crate::compile(&mut graph, path, &o, &mut |pass, g| {
            if pass == "precision" {
                eval = Some(g.clone());
            }
        })
        .map_err(|e| pinned(e, export_batch))
        .map_err(|e| bound_by_data(e, &bound_from))?;
        let internal = |what: &str| Error::Run {
            path: path.to_owned(),
            source: mpc_runtime::RuntimeError::Internal(format!("the training graph has no {what}")),
        };
        let mut eval = eval_graph(eval.ok_or_else(|| internal("precision pass"))?);
        let sig = graph.train.clone().ok_or_else(|| internal("training signature"))?;
        let sharding = opts.train.as_ref().and_then(|t| t.shard_state).map(|at| Sharding {
            at,
            shapes: sig
                .sharded
                .iter()
                .map(|(v, s)| (graph.name(*v).to_string(), s.iter().map(|&d| d as usize).collect()))
                .collect(),
        });
        if let Some(sh) = &sharding {
            // The evaluation reads the masters: gathered from the ranks' blocks, as the step does.
            // In the signature's order: every rank's evaluation gathers them in the same order.
            let masters: Vec<String> = sig.sharded.iter().map(|(v, _)| graph.name(*v).to_string()).collect();
            mpc_passes::train::shard::read_sharded(&mut eval, &masters, sh.at)
                .map_err(|source| Error::Pass { path: path.to_owned(), source })?;
        }
        let name = |v: Option<ValueId>, what: &str| v.map(|v| graph.name(v).to_string()).ok_or_else(|| internal(what));
        let is_state = |v: ValueId| sig.state.iter().any(|&(s, _)| s == v);
        let names = Names {
            loss: name(sig.loss, "loss")?,
            skipped: name(sig.skipped, "step flag")?,
            lr: sig.lr.map_or(mpc_passes::train::LR.to_string(), |v| graph.name(v).to_string()),
            scale: sig.loss_scale.filter(|&s| is_state(s)).map(|s| graph.name(s).to_string()),
            fixed_scale: sig
                .loss_scale
                .filter(|&s| !is_state(s))
                .and_then(|s| graph.constant(s))
                .map(|t| t.to_f64_vec()[0]),
        };
        let scale_bounds = cx.train.as_ref().and_then(|t| match &t.loss_scale {
            LossScale::Dynamic { attrs, .. } => Some((attrs.min_scale, attrs.max_scale)),
            _ => None,
        });
        let accuracy = match opts.train.as_ref().map(|t| (&t.loss, &t.labels)) {
            Some((Loss::CrossEntropy(ce), labels)) => Some((*ce, labels.clone())),
            _ => None,
        };
        let compiled = Compiled { ties: cx.ties, folded: cx.folded, auto_scale: cx.auto_scale };
        Ok(TrainingStep {
            sizes: sizes.into_iter().collect(),
            source: (model.clone(), opts.clone()),
            graph,
            eval,
            names,
            scale_bounds,
            accuracy,
            compiled,
            sharding,
            export_batch,
            bound_from,
            path: path.to_owned(),
        })
    }

    /// The training step, with its symbolic dims: its inputs are what a batch holds.
    pub fn graph(&self) -> &Graph {
        &self.graph
    }

    /// Loads the step on `device`, lowered for `first` (a batch: the graph inputs and the labels
    /// by name).
    pub fn on<D: Device>(self, device: D, first: &HashMap<String, HostTensor>) -> Result<Trainer<D>> {
        let caps = device.caps();
        let (source, names, scale_bounds, accuracy, compiled) =
            (self.source.clone(), self.names.clone(), self.scale_bounds, self.accuracy.clone(), self.compiled.clone());
        let sharding = self.sharding.clone();
        let (sizes, step, eval) = self.into_parts(caps);
        let dims = step.dims(first)?;
        let main = step.lower(&step.graph, &dims, None, &HashSet::new())?;
        let layout = main.state_layout.clone();
        let session = Session::new(device, main).map_err(|source| step.run_error(source))?;
        let eval_vars = eval.initializers().filter(|&v| layout.find(eval.name(v)).is_some()).collect();
        Ok(Trainer {
            session,
            variants: vec![Variant { sizes, step, eval, eval_vars }],
            source,
            layout,
            programs: HashMap::from([((0, dims), 0)]),
            eval_programs: HashMap::new(),
            names,
            scale_bounds,
            accuracy,
            compiled,
            sharding,
        })
    }

    /// The sample dims bound, the step to lower for a device of `caps`, and the evaluation graph.
    fn into_parts(self, caps: DeviceCaps) -> (Dims, Lowering, Graph) {
        let TrainingStep { sizes, graph, eval, export_batch, bound_from, path, .. } = self;
        let state = graph.train.iter().flat_map(|t| t.state.iter().map(|&(s, _)| s)).collect();
        (sizes, Lowering { state, graph, caps, export_batch, bound_from, path }, eval)
    }
}

impl<D: Device> Trainer<D> {
    /// Compiles `model` (loaded from `path`, which messages name) as `opts` says and loads the
    /// step for `first` (a batch: the graph inputs and the labels by name) on `device`.
    pub fn new(
        device: D,
        model: &Graph,
        path: &Path,
        opts: &Options,
        first: &HashMap<String, HostTensor>,
    ) -> Result<Self> {
        let sizes = crate::run::input_sizes(model, first, path)?;
        TrainingStep::compile(model, path, opts, sizes)?.on(device, first)
    }

    /// The session the trainer steps, for measurements (device marks, a profiled step, the
    /// counters): program 0 is the one lowered for the first batch.
    pub fn session_mut(&mut self) -> &mut Session<D> {
        &mut self.session
    }

    /// The training step's outputs' names: its loss.
    pub fn loss_name(&self) -> &str {
        &self.names.loss
    }

    /// The training step, with its symbolic dims: its inputs are what a batch holds.
    pub fn graph(&self) -> &Graph {
        &self.variants[0].step.graph
    }

    /// The first variant's step: the state's names, the model's path for messages.
    fn first(&self) -> &Lowering {
        &self.variants[0].step
    }

    /// The variant of the step compiled for `batch`'s sample dims (a sequence length, an image
    /// size), compiled now when it is the first batch of its binding; its state is the trainer's.
    fn variant_for(&mut self, batch: &HashMap<String, HostTensor>) -> Result<usize> {
        let (model, opts) = &self.source;
        let path = self.first().path.clone();
        let mut sizes = crate::run::input_sizes(model, batch, &path)?;
        let batch_dims = crate::run::batch_symbols(model);
        sizes.retain(|s, _| !batch_dims.contains(s));
        let key: Dims = sizes.clone().into_iter().collect();
        if let Some(i) = self.variants.iter().position(|v| v.sizes == key) {
            return Ok(i);
        }
        let step = TrainingStep::compile(model, &path, opts, sizes)?;
        if step.names != self.names {
            let what = format!("the step compiled for {key:?} names its results otherwise than the first");
            return Err(self.first().run_error(mpc_runtime::RuntimeError::Internal(what)));
        }
        let (sizes, step, eval) = step.into_parts(self.first().caps);
        let eval_vars = eval.initializers().filter(|&v| self.layout.find(eval.name(v)).is_some()).collect();
        self.variants.push(Variant { sizes, step, eval, eval_vars });
        Ok(self.variants.len() - 1)
    }

    /// The program of variant `v` (its evaluation graph's where `eval`) for `batch`'s dims,
    /// lowered over the trainer's state the first time.
    fn program_for(&mut self, v: usize, eval: bool, batch: &HashMap<String, HostTensor>) -> Result<ProgramId> {
        let var = &self.variants[v];
        let dims = if eval { dims_of(&var.eval, batch, &var.step.path)? } else { var.step.dims(batch)? };
        let loaded = if eval { &self.eval_programs } else { &self.programs };
        if let Some(&id) = loaded.get(&(v, dims.clone())) {
            return Ok(id);
        }
        let p = match eval {
            true => var.step.lower(&var.eval, &dims, Some(&self.layout), &var.eval_vars)?,
            false => var.step.lower(&var.step.graph, &dims, Some(&self.layout), &HashSet::new())?,
        };
        let id = self.session.load(p).map_err(|e| self.first().run_error(e))?;
        let loaded = if eval { &mut self.eval_programs } else { &mut self.programs };
        loaded.insert((v, dims), id);
        Ok(id)
    }

    /// What the compile found out about the model.
    pub fn compiled(&self) -> &Compiled {
        &self.compiled
    }

    /// Runs one training step on `batch` (lowering a program for its dims the first time it
    /// sees them). The step's numbers are staged to the host without a wait: [`Self::wait`].
    pub fn step(&mut self, batch: &HashMap<String, HostTensor>) -> Result<StepHandle<D::Staged>> {
        let v = self.variant_for(batch)?;
        let id = self.program_for(v, false, batch)?;
        let s = &mut self.session;
        let staged = (|| {
            s.feed(id, batch)?;
            s.step(id)?;
            Ok(StepHandle {
                loss: s.read_later(id, &self.names.loss)?,
                skipped: s.read_later(id, &self.names.skipped)?,
                lr: s.read_later(id, &self.names.lr)?,
                scale: self.names.scale.as_deref().map(|n| s.read_later(id, n)).transpose()?,
            })
        })();
        staged.map_err(|e| self.first().run_error(e))
    }

    /// Waits for a step's numbers.
    pub fn wait(&mut self, h: StepHandle<D::Staged>) -> Result<StepNumbers> {
        let s = &mut self.session;
        let numbers = (|| {
            let mut value = |p| s.wait(p).map(|t| t.f64s()[0]);
            Ok(StepNumbers {
                loss: value(h.loss)? as f32,
                skipped: value(h.skipped)? != 0.0,
                lr: value(h.lr)? as f32,
                loss_scale: h.scale.map(&mut value).transpose()?.or(self.names.fixed_scale),
            })
        })();
        numbers.map_err(|e| self.first().run_error(e))
    }

    /// The loss scale now; `None` without loss scaling.
    pub fn loss_scale(&mut self) -> Result<Option<f64>> {
        match &self.names.scale {
            Some(n) => Ok(Some(self.session.read_state(n).map_err(|e| self.first().run_error(e))?.f64s()[0])),
            None => Ok(self.names.fixed_scale),
        }
    }

    /// The learning rate of the next steps (the state `mpc.lr`: under a schedule, its peak).
    pub fn lr(&mut self) -> Result<f32> {
        let t = self.session.read_state(mpc_passes::train::LR).map_err(|e| self.first().run_error(e))?;
        Ok(t.f64s()[0] as f32)
    }

    /// Sets the learning rate of the next steps: the state `mpc.lr`, which is the rate itself,
    /// or under a schedule the peak the schedule scales.
    pub fn set_lr(&mut self, lr: f32) -> Result<()> {
        let t = HostTensor::from_f64(mpc_ir::DType::F32, vec![], vec![f64::from(lr)]);
        self.session.write_state(mpc_passes::train::LR, &t).map_err(|e| self.first().run_error(e))
    }

    /// The mean loss and the accuracy counts of `batch` under the evaluation graph, which reads
    /// the training state in place.
    pub fn evaluate(&mut self, batch: &HashMap<String, HostTensor>) -> Result<EvalNumbers> {
        let v = self.variant_for(batch)?;
        let id = self.program_for(v, true, batch)?;
        let eval = &self.variants[v].eval;
        let rerr = |e| Error::Run { path: self.variants[0].step.path.clone(), source: e };
        self.session.feed(id, batch).map_err(rerr)?;
        self.session.step(id).map_err(rerr)?;
        let mut out = EvalNumbers::default();
        let loss = mpc_passes::train::loss_value(eval);
        if let Some(l) = loss {
            out.loss = Some(self.session.read(id, eval.name(l)).map_err(rerr)?.f64s()[0]);
        }
        let scores =
            eval.outputs().iter().copied().find(|&v| Some(v) != loss && eval.ty(v).dtype.is_some_and(|d| d.is_float()));
        let Some(((ce, labels), scores)) = self.accuracy.as_ref().zip(scores) else { return Ok(out) };
        let Some(labels) = batch.get(labels) else { return Ok(out) };
        let scores = self.session.read(id, eval.name(scores)).map_err(rerr)?;
        (out.correct, out.counted) = count_correct(&scores, labels, ce);
        Ok(out)
    }

    /// Every state value by name (the masters under their initializer names, the rest `mpc.`).
    /// A sharded state is gathered from the ranks, each value whole: every rank calls this alike.
    pub fn state(&mut self) -> Result<Vec<(String, HostTensor)>> {
        let g = &self.variants[0].step.graph;
        let names: Vec<String> = g.train.iter().flat_map(|t| &t.state).map(|&(s, _)| g.name(s).to_string()).collect();
        let mut out = Vec::with_capacity(names.len());
        let path = self.first().path.clone();
        let run = |e| Error::Run { path: path.clone(), source: e };
        for n in names {
            let mut t = self.session.read_state(&n).map_err(run)?;
            if let Some(shape) = self.sharding.as_ref().and_then(|s| s.shapes.get(&n)) {
                let group = self.session.device().collective().ok_or_else(|| {
                    run(mpc_runtime::RuntimeError::Internal("a sharded state on a device of no group".into()))
                })?;
                let all = group.all_gather(&t).map_err(run)?;
                let numel = shape.iter().product::<usize>();
                t = all.pick(shape.clone(), &(0..numel).collect::<Vec<_>>());
            }
            out.push((n, t));
        }
        Ok(out)
    }

    /// Tells the device's group which step of the run the next collectives belong to (what a
    /// timed-out call names).
    pub fn at_step(&self, step: u64) {
        if let Some(g) = self.session.device().collective() {
            g.at_step(step);
        }
    }

    /// This rank's place in a data-parallel run (rank 0 of 1 on a device of no group).
    fn rank(&self) -> usize {
        self.session.device().collective().map_or(0, |g| g.rank())
    }

    /// In a data-parallel run, checks that every rank lowered the same step (the same
    /// collectives, [`mpc_runtime::collective::same_program`]); one line naming this rank where
    /// they differ. Nothing on a device of one rank.
    pub fn check_same_program(&mut self) -> Result<()> {
        let path = self.variants[0].step.path.clone();
        let run = |e| Error::Run { path: path.clone(), source: e };
        let Some(group) = self.session.device().collective() else { return Ok(()) };
        let program = self.session.program(0).map_err(run)?;
        mpc_runtime::collective::same_program(group, program).map_err(run)
    }

    /// `x` averaged (or, with `sum`, summed) over the ranks of a data-parallel run; `x` itself on
    /// a device of one rank. Every rank must call it alike.
    pub fn over_ranks(&mut self, x: f64, sum: bool) -> Result<f64> {
        let Some(group) = self.session.device().collective().filter(|g| g.world() > 1) else { return Ok(x) };
        let how = if sum { mpc_ir::ops::CollectiveReduction::Sum } else { mpc_ir::ops::CollectiveReduction::Mean };
        let t = HostTensor::from_f64(mpc_ir::DType::F64, vec![1], vec![x]);
        let path = self.variants[0].step.path.clone();
        let r = group.all_reduce(&t, how).map_err(|e| Error::Run { path, source: e })?;
        Ok(r.f64s()[0])
    }

    /// Each of `xs` averaged over the ranks of a data-parallel run, in one all-reduce; `xs`
    /// itself on a device of one rank. Every rank must call it alike.
    pub fn over_ranks_each(&mut self, xs: &[f64]) -> Result<Vec<f64>> {
        let Some(group) = self.session.device().collective().filter(|g| g.world() > 1) else { return Ok(xs.to_vec()) };
        let t = HostTensor::from_f64(mpc_ir::DType::F64, vec![xs.len()], xs.to_vec());
        let path = self.variants[0].step.path.clone();
        let r =
            group.all_reduce(&t, mpc_ir::ops::CollectiveReduction::Mean).map_err(|e| Error::Run { path, source: e })?;
        Ok(r.f64s())
    }

    /// Moves this rank's dropout stream away from the others' in a data-parallel run: the key
    /// `mpc.rng` (the seed on every rank) gains `rank · 2⁴⁰`, so that the ranks draw other masks
    /// for 2⁴⁰ steps. Nothing for rank 0, or a step without dropout.
    pub fn own_dropout_stream(&mut self, shard: crate::train::Shard) -> Result<()> {
        if shard.rank == 0 || self.layout.find(mpc_passes::train::RNG).is_none() {
            return Ok(());
        }
        let run = |e| Error::Run { path: self.variants[0].step.path.clone(), source: e };
        let key = self.session.read_state(mpc_passes::train::RNG).map_err(run)?;
        let moved: Vec<i64> =
            key.i64s().unwrap_or_default().iter().map(|k| k.wrapping_add((shard.rank as i64) << 40)).collect();
        let t = HostTensor::from_i64(key.dtype(), key.shape.clone(), moved);
        self.session.write_state(mpc_passes::train::RNG, &t).map_err(run)
    }

    /// Writes a saved state (read from `origin`, which messages name) into the trainer's: every
    /// state value must be there, finite, counters not negative, the loss scale within its
    /// bounds. A master's low-precision copy that `saved` lacks is its master rounded; a saved
    /// state from before the rate was state keeps this trainer's rate.
    pub fn load_state(&mut self, saved: &HashMap<String, HostTensor>, origin: &Path) -> Result<()> {
        let bad = |what: String| Error::Usage(format!("{}: {what}", origin.display()));
        let g = &self.variants[0].step.graph;
        let sig = g.train.as_ref().map(|t| t.state.clone()).unwrap_or_default();
        for (s, _) in sig {
            let name = g.name(s);
            let copy = checkpoint::low_copy_of(name, saved, g.ty(s).dtype);
            if name == mpc_passes::train::LR && !saved.contains_key(name) {
                continue;
            }
            let t = saved
                .get(name)
                .or(copy.as_ref())
                .ok_or_else(|| bad(format!("no tensor `{name}` (a checkpoint of another model?)")))?;
            let bounds = (self.names.scale.as_deref() == Some(name)).then_some(self.scale_bounds).flatten();
            checkpoint::check_state(name, t, bounds).map_err(&bad)?;
            let block = self
                .sharding
                .as_ref()
                .filter(|s| s.shapes.contains_key(name))
                .map(|s| mpc_runtime::collective::padded_block(t, s.at.rank, s.at.world));
            self.session
                .write_state(name, block.as_ref().unwrap_or(t))
                .map_err(|e| Error::Run { path: self.variants[0].step.path.clone(), source: e })?;
        }
        Ok(())
    }

    /// Writes the state and `iteration` (the batches done) to `file`, atomically. In a
    /// data-parallel run every rank calls it (a sharded state is gathered) and rank 0 writes.
    pub fn save(&mut self, file: &Path, iteration: usize) -> Result<()> {
        self.save_progress(file, checkpoint::Progress { iteration, global_batch: None })
    }

    /// [`Self::save`] with the run's global batch too, which [`Self::load_progress`] reads back.
    pub fn save_progress(&mut self, file: &Path, progress: checkpoint::Progress) -> Result<()> {
        let mut tensors = self.state()?;
        if self.rank() != 0 {
            return Ok(());
        }
        if let Some(dir) = file.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(|source| Error::Output { path: dir.to_owned(), source })?;
        }
        tensors.extend(checkpoint::progress_tensors(progress));
        crate::run::write_safetensors(file, &tensors)
    }

    /// Loads a checkpoint [`Self::save`] wrote; returns its count of batches done.
    pub fn load(&mut self, file: &Path) -> Result<usize> {
        Ok(self.load_progress(file)?.iteration)
    }

    /// Loads a checkpoint; returns how far its run got.
    pub fn load_progress(&mut self, file: &Path) -> Result<checkpoint::Progress> {
        let saved = crate::run::read_safetensors(file)?;
        let progress = checkpoint::progress(&saved).map_err(|m| Error::Usage(format!("{}: {m}", file.display())))?;
        self.load_state(&saved, file)?;
        Ok(progress)
    }

    /// The original `model` with its initializers replaced by the trained values of the same
    /// name (and the copies training tied read from the weight they were tied to).
    pub fn export(&mut self, model: &Graph) -> Result<Graph> {
        Ok(with_trained_weights(model, &self.state()?, &self.compiled.ties))
    }

    /// What the training step costs (`--stats`): its launches, arena and state.
    pub fn stats(&self) -> Result<String> {
        let p = self.session.program(0).map_err(|e| self.first().run_error(e))?;
        Ok(crate::run::stats_line(p, &self.session.stats(0)))
    }
}

/// The symbolic training step and how to lower it for a binding of its dims.
struct Lowering {
    graph: Graph,
    /// The state values: not constants, however they start.
    state: HashSet<ValueId>,
    caps: DeviceCaps,
    /// The batch the export held, which a message about a node that still holds it names.
    export_batch: Option<u64>,
    /// Where the dims bound from the first batch came from ([`bound_from`]).
    bound_from: String,
    path: PathBuf,
}

impl Lowering {
    fn run_error(&self, source: mpc_runtime::RuntimeError) -> Error {
        Error::Run { path: self.path.clone(), source }
    }

    /// `g` (the step or the evaluation graph) lowered for `dims`, over `layout`'s state and with
    /// `variables` read in place.
    fn lower(
        &self,
        g: &Graph,
        dims: &Dims,
        layout: Option<&StateLayout>,
        variables: &HashSet<ValueId>,
    ) -> Result<Program> {
        let dims: HashMap<String, u64> = dims.iter().map(|(k, &v)| (k.clone(), v)).collect();
        let changing: HashSet<ValueId> = self.state.union(variables).copied().collect();
        let (bound, _) = crate::run::fold_and_infer(g.clone(), &dims, &changing, self.caps, &self.path)
            .map_err(|e| pinned(e, self.export_batch))?;
        crate::run::lower_bound(&bound, self.caps, layout, Some(variables), &self.path)
    }

    /// The dims a batch binds in the step; where it does not fit, the message names the input and
    /// axis, and where it came from the dim the first batch bound, or the node of an export that
    /// holds its batch.
    fn dims(&self, batch: &HashMap<String, HostTensor>) -> Result<Dims> {
        dims_of(&self.graph, batch, &self.path).map_err(|e| match e {
            Error::Usage(_) if self.export_batch.is_some() => {
                let sizes = crate::run::input_sizes(&self.graph, batch, &self.path).map(|d| d.into_iter().collect());
                match sizes.and_then(|d| self.lower(&self.graph, &d, None, &HashSet::new())) {
                    Err(pinned) => pinned,
                    Ok(_) => e,
                }
            }
            Error::Usage(m) if !self.bound_from.is_empty() => Error::Usage(format!("{m}; {}", self.bound_from)),
            e => e,
        })
    }
}

/// A pass's failure on the step built for the dims the data bound, said with them: a shape that
/// holds another sequence length than the data's (a legacy nn.MultiheadAttention export keeps the
/// length it was traced at) is blamed on its node and on the input that gave the length.
fn bound_by_data(e: Error, bound_from: &str) -> Error {
    match e {
        Error::Pass { path, source }
            if !bound_from.is_empty() && !matches!(source, mpc_passes::PassError::Verify { .. }) =>
        {
            Error::Usage(format!("{}: {source}; {bound_from}", path.display()))
        }
        e => e,
    }
}

/// A pass's failure on a model whose batch is built into it, said as that.
fn pinned(e: Error, export_batch: Option<u64>) -> Error {
    match (e, export_batch) {
        (Error::Pass { path, source }, Some(b)) => Error::Usage(format!(
            "{}: {source} (the model was exported with a fixed batch of {b}, which its graph still holds here: export it with a dynamic batch axis)",
            path.display()
        )),
        (e, _) => e,
    }
}

/// The dims a batch binds in `g` ([`crate::run::input_dims`]: checked, one line naming the input
/// and axis at fault).
fn dims_of(g: &Graph, batch: &HashMap<String, HostTensor>, path: &Path) -> Result<Dims> {
    Ok(crate::run::input_dims(g, batch, path)?.into_iter().collect())
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

/// Where the sizes [`bind_sample_dims`] binds in `model` come from: "the data's `seq` is 16
/// (input `input_ids` axis 1)", or nothing.
fn bound_from(model: &Graph, sizes: &HashMap<String, u64>) -> String {
    let (mut said, mut seen) = (Vec::new(), HashSet::new());
    for &v in model.inputs() {
        let Some(s) = model.ty(v).shape.as_ref() else { continue };
        for (axis, d) in s.dims().iter().enumerate() {
            let Dim::Sym(e) = d else { continue };
            let name = e.to_string();
            if let Some(n) = sizes.get(&name).filter(|_| seen.insert(name.clone())) {
                said.push(format!("the data's `{name}` is {n} (input `{}` axis {axis})", model.name(v)));
            }
        }
    }
    said.join(", ")
}

/// The forward graph for evaluation from the pipeline's graph after the precision pass: batch
/// normalisation back on its running statistics (its statistics outputs dropped), dropout off.
fn eval_graph(mut g: Graph) -> Graph {
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
    g
}

/// The labels (not ignored) whose class scores highest on cross-entropy's class axis, and the
/// labels counted.
fn count_correct(scores: &HostTensor, labels: &HostTensor, ce: &CrossEntropy) -> (usize, usize) {
    let (v, y) = (scores.f64s(), labels.i64s().unwrap_or_default());
    let Some(axis) = mpc_ir::normalize_axis(ce.axis, scores.shape.len()) else { return (0, 0) };
    // Scores [outer, classes, inner]; label `o * inner + j` is scored at (o, k, j).
    let (c, inner) = (scores.shape[axis], scores.shape[axis + 1..].iter().product::<usize>());
    let (mut correct, mut counted) = (0, 0);
    for (i, &label) in y.iter().enumerate() {
        if Some(label) == ce.ignore_index {
            continue;
        }
        let (o, j) = (i / inner.max(1), i % inner.max(1));
        let at = |k: usize| v[(o * c + k) * inner + j];
        let best = (0..c).fold(0, |b, k| if at(k) > at(b) { k } else { b });
        correct += (best as i64 == label) as usize;
        counted += 1;
    }
    (correct, counted)
}

/// The original model with its initializers replaced by the trained values of the same name, and
/// the copies training tied read from the weight they were tied to.
pub fn with_trained_weights(model: &Graph, state: &[(String, HostTensor)], ties: &[Tie]) -> Graph {
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

/// Rows `idx` of `t` (its first dim), each reshaped to `sample` when given (images stored flat).
pub fn rows(t: &HostTensor, idx: &[usize], sample: Option<&[usize]>) -> HostTensor {
    let row: usize = t.shape[1..].iter().product();
    let flat: Vec<usize> = idx.iter().flat_map(|&r| r * row..(r + 1) * row).collect();
    let mut shape = vec![idx.len()];
    match sample {
        Some(s) => shape.extend(s),
        None => shape.extend(&t.shape[1..]),
    }
    t.pick(shape, &flat)
}
