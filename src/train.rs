//! `mpc train`: compile the training step, feed it batches, keep its state resident, evaluate,
//! checkpoint and resume.
//!
//! The data's tensors ([`Dataset`]: one or more safetensors shards, memory-mapped) are named after
//! the graph inputs (and the labels); the first dimension is the sample. The evaluation set is
//! `eval_data`, or the last `eval_split` share of the samples, held out. Each
//! epoch visits the training samples in an order drawn from `(seed, epoch)`, so a resumed run sees
//! exactly the batches the uninterrupted run would have seen. Checkpoints hold every state value
//! under its graph name (the masters under their initializer names, the rest under `mpc.`) and
//! `mpc.iteration`, the number of batches done. The step itself is the library's [`Trainer`]:
//! this module is the loop over it (data, progress, evaluation, checkpoints, the log).

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::time::Instant;

use mpc_ir::Graph;
use mpc_runtime::device::{CpuDevice, Device};
use mpc_runtime::HostTensor;

use crate::data::Dataset;
use crate::trainer::checkpoint::Progress;
pub use crate::trainer::{bind_sample_dims, free_batch, with_trained_weights};
use crate::trainer::{StepHandle, Trainer};
use crate::{Error, Options, Result};

/// Steps between two reads of the losses (and updates of the progress bar).
const PRINT_EVERY: usize = 16;

/// How to train.
#[derive(Clone, Debug)]
pub struct TrainConfig {
    /// The training shards (files, or patterns of file names).
    pub data: Vec<PathBuf>,
    /// A separate evaluation set (shards); none: `eval_split`.
    pub eval_data: Vec<PathBuf>,
    pub epochs: usize,
    /// Samples per step: per rank in a data-parallel run.
    pub batch: usize,
    /// Samples per update over all ranks, in place of `batch × shard.world` (each rank then
    /// steps on `global_batch / world`, which must divide).
    pub global_batch: Option<usize>,
    /// The samples (the last ones) held out for evaluation: a share when below 1, else a count.
    pub eval_split: f64,
    /// Seed of the sample order.
    pub seed: u64,
    pub checkpoint: Option<PathBuf>,
    pub resume: bool,
    /// Write a JSON line per step and per evaluation here ([`StepLog`]).
    pub log: Option<PathBuf>,
    /// Draw the losses and the learning rate against the step here when the run ends (SVG).
    pub plot: Option<PathBuf>,
    /// Stop after this many batches in all (tests of resuming).
    pub max_steps: Option<usize>,
    /// Draw a progress bar on a terminal.
    pub progress: bool,
    /// This process's part of a data-parallel run ([`Shard::ALONE`]: the whole run).
    pub shard: Shard,
}

/// One rank of a data-parallel run: `batch` is per rank, each global batch of `batch × world`
/// samples (from the same permutation on every rank, as torch's DistributedSampler draws it) is
/// cut into `world` parts, and rank `rank` steps on its part, its gradients averaged with the
/// others' (`TrainOptions::data_parallel`). Rank 0 alone writes checkpoints.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shard {
    pub rank: usize,
    pub world: usize,
}

impl Shard {
    pub const ALONE: Shard = Shard { rank: 0, world: 1 };

    /// This rank's part of a global batch: the `rank`-th of `world` runs as even as can be; a batch
    /// with fewer samples than ranks gives each rank one of them (some twice), since every rank
    /// must step.
    pub fn part<'a>(&self, global: &'a [u32]) -> std::borrow::Cow<'a, [u32]> {
        let (n, w, r) = (global.len(), self.world, self.rank);
        if n < w {
            return std::borrow::Cow::Owned(vec![global[r % n.max(1)]]);
        }
        std::borrow::Cow::Borrowed(&global[r * n / w..(r + 1) * n / w])
    }
}

impl Default for TrainConfig {
    fn default() -> Self {
        TrainConfig {
            data: Vec::new(),
            eval_data: Vec::new(),
            epochs: 1,
            batch: 64,
            global_batch: None,
            eval_split: 0.0,
            seed: 0,
            checkpoint: None,
            resume: false,
            log: None,
            plot: None,
            max_steps: None,
            progress: false,
            shard: Shard::ALONE,
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

/// A permutation of `0..n` drawn from `seed` (Fisher-Yates over xorshift), as 32-bit indices: 4
/// bytes a sample are all a run keeps of its data that grows with it.
fn permutation(n: u32, seed: u64) -> Vec<u32> {
    let mut s = seed.wrapping_mul(0x9e3779b97f4a7c15) ^ 0x2545f4914f6cdd1d;
    let mut next = move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        s
    };
    let mut p: Vec<u32> = (0..n).collect();
    for i in (1..n as usize).rev() {
        let j = (next() % (i as u64 + 1)) as usize;
        p.swap(i, j);
    }
    p
}

/// A data tensor the step reads: its name, and the per-sample shape it is fed as where the
/// model fixes one of the stored size (images stored flat); else as stored (a bucket's length).
type Feed = (String, Option<Vec<usize>>);

/// "no tensor `name` for the graph input of that name (the file has: ...)".
fn no_tensor(name: &str, data: &Dataset) -> Error {
    Error::Usage(format!(
        "{}: no tensor `{name}` for the graph input of that name (the file has: {})",
        data.describe(),
        data.names().join(", ")
    ))
}

/// The data tensors the graph reads, checked against its inputs: (name, per-sample shape).
fn feeds_for(g: &Graph, data: &Dataset) -> Result<Vec<Feed>> {
    let usage = |m: String| Error::Usage(format!("{}: {m}", data.describe()));
    let mut out = Vec::new();
    for &v in g.inputs() {
        let name = g.name(v);
        let c = data.column(name).ok_or_else(|| no_tensor(name, data))?;
        let want = g.ty(v).dtype.unwrap_or(c.dtype);
        if c.dtype != want {
            return Err(usage(format!("tensor `{name}` is {}, the graph input is {want}", c.dtype)));
        }
        // Per-sample shape: the graph's when fixed and of the same size (images stored flat).
        let row: usize = c.sample.iter().product();
        let sample = g
            .ty(v)
            .shape
            .as_ref()
            .and_then(|s| s.dims().get(1..)?.iter().map(|d| d.fixed().map(|x| x as usize)).collect::<Option<Vec<_>>>())
            .filter(|s| s.iter().product::<usize>() == row && *s != c.sample);
        out.push((name.to_string(), sample));
    }
    Ok(out)
}

fn batch_feeds(data: &Dataset, feeds: &[Feed], idx: &[usize]) -> HashMap<String, HostTensor> {
    feeds.iter().map(|(n, s)| (n.clone(), data.rows(n, idx, s.as_deref()))).collect()
}

/// The feeds of the model's inputs and, where the loss reads labels, of the labels: what the
/// training step reads, known before it is compiled.
fn step_feeds(model: &Graph, data: &Dataset, opts: &Options) -> Result<Vec<Feed>> {
    let mut feeds = feeds_for(model, data)?;
    if let Some(t) = opts.train.as_ref().filter(|t| !matches!(t.loss, mpc_passes::train::Loss::Output(_))) {
        if model.find(&t.labels).is_none_or(|v| !model.inputs().contains(&v)) {
            data.column(&t.labels).ok_or_else(|| no_tensor(&t.labels, data))?;
            feeds.push((t.labels.clone(), None));
        }
    }
    Ok(feeds)
}

/// Checks a sample of each bucket (its first shard) against the model's inputs: their dtypes,
/// ranks and fixed dims, and the symbolic dims they bind agreeing between inputs. One line naming
/// the shard, the input and the axis, before any step.
fn fits_the_model(model: &Graph, data: &Dataset) -> Result<()> {
    let feeds = feeds_for(model, data)?;
    // Any batch: an export's fixed one is freed when the step is built.
    let mut model = model.clone();
    for v in model.inputs().to_vec() {
        let mut ty = model.ty(v).clone();
        if let Some(d) = ty.shape.as_mut().and_then(|s| s.0.first_mut()) {
            *d = mpc_ir::Dim::sym("batch");
        }
        model.set_ty(v, ty);
    }
    let model = &model;
    for bucket in data.buckets(data.len()) {
        let Some(first) = bucket.first else { continue };
        let batch = batch_feeds(data, &feeds, &[first]);
        if let Err(mpc_runtime::build::BuildError::Data(m)) = mpc_runtime::build::input_dims(model, &batch) {
            return Err(Error::Usage(format!("{}: {m}", bucket.path.display())));
        }
    }
    Ok(())
}

/// The first batch a run feeds: the first `batch` training samples of the first sample's bucket
/// (the step is compiled for their sample dims).
fn first_batch(data: &Dataset, n_train: usize, batch: usize) -> Vec<usize> {
    let b = data.bucket_of(0);
    (0..n_train).filter(|&i| data.bucket_of(i) == b).take(batch).collect()
}

/// An epoch's batches: the shuffled order cut into batches, each of one bucket's samples. With
/// one bucket, the order's consecutive runs of `batch`; with several, each bucket's samples in
/// the order's order, a batch made as soon as a bucket has `batch` of them (so that the buckets
/// interleave as the order mixes them), the part-filled ones last.
struct Batches {
    order: Vec<u32>,
    /// Where each batch starts in `order` (with several buckets), and its end.
    bounds: Option<Vec<usize>>,
    batch: usize,
}

impl Batches {
    fn of(order: Vec<u32>, data: &Dataset, batch: usize) -> Batches {
        if data.buckets(data.len()).len() < 2 {
            return Batches { order, bounds: None, batch };
        }
        let mut open: BTreeMap<usize, Vec<u32>> = BTreeMap::new();
        let (mut arranged, mut bounds) = (Vec::with_capacity(order.len()), vec![0]);
        for i in order {
            let b = open.entry(data.bucket_of(i as usize)).or_default();
            b.push(i);
            if b.len() == batch {
                arranged.append(b);
                bounds.push(arranged.len());
            }
        }
        for (_, mut rest) in open.into_iter().filter(|(_, v)| !v.is_empty()) {
            arranged.append(&mut rest);
            bounds.push(arranged.len());
        }
        Batches { order: arranged, bounds: Some(bounds), batch }
    }

    /// Batch `k` of the epoch.
    fn get(&self, k: usize) -> &[u32] {
        match &self.bounds {
            Some(b) => &self.order[b[k]..b[k + 1]],
            None => &self.order[k * self.batch..((k + 1) * self.batch).min(self.order.len())],
        }
    }
}

/// The held-out samples of `n`: `eval_split` as a share when below 1, else as a count.
fn eval_count(cfg: &TrainConfig, n: usize) -> usize {
    let n_eval =
        if cfg.eval_split < 1.0 { ((n as f64) * cfg.eval_split).round() as usize } else { cfg.eval_split as usize };
    n_eval.min(n)
}

/// `opts` with its learning-rate schedule spanning the run's updates (where it has no length of
/// its own): its batches (`per_epoch` in every epoch; --max-steps stops a run that may be
/// resumed, and does not shorten its schedule), or under gradient accumulation its whole groups
/// of micro-batches.
fn with_run_length(opts: &Options, cfg: &TrainConfig, per_epoch: usize) -> Options {
    let mut o = opts.clone();
    if let Some(t) = o.train.as_mut() {
        t.data_parallel |= cfg.shard.world > 1;
        let updates = cfg.epochs * per_epoch / t.accumulate.max(1) as usize;
        if let Some(s) = t.schedule.as_mut() {
            *s = s.for_run(updates as u64);
        }
    }
    o
}

/// `cfg` with `batch` the per-rank share of `--global-batch`, where it is given.
fn per_rank_batch(cfg: &TrainConfig) -> Result<TrainConfig> {
    let Some(g) = cfg.global_batch else { return Ok(cfg.clone()) };
    let w = cfg.shard.world;
    if g == 0 || g % w != 0 {
        return Err(Error::Usage(format!(
            "--global-batch {g} over {w} ranks: the global batch must be a positive multiple of the ranks"
        )));
    }
    Ok(TrainConfig { batch: g / w, global_batch: None, ..cfg.clone() })
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
    if !cfg.eval_data.is_empty() && cfg.eval_split > 0.0 {
        return Err(Error::Usage("--eval-data and --eval-split: give one of them".into()));
    }
    let cfg = &per_rank_batch(cfg)?;
    let data = Dataset::open(&cfg.data)?;
    let feeds = step_feeds(model, &data, opts)?;
    let n = data.len();
    let n_train = n - eval_count(cfg, n);
    if n_train == 0 || cfg.batch == 0 {
        let what = format!("no training samples (batch {}, {n} samples)", cfg.batch);
        return Err(Error::Usage(format!("{}: {what}", data.describe())));
    }
    if u32::try_from(n).is_err() {
        return Err(Error::Usage(format!("{}: {n} samples, more than 2^32", data.describe())));
    }
    let eval_data = (!cfg.eval_data.is_empty()).then(|| Dataset::open(&cfg.eval_data)).transpose()?;
    // An epoch's batches, each of one bucket; a schedule spans the run's.
    let global = cfg.batch * cfg.shard.world;
    let per_epoch: usize = data.buckets(n_train).iter().map(|b| b.samples.div_ceil(global)).sum();
    let opts = &with_run_length(opts, cfg, per_epoch);
    fits_the_model(model, &data)?;
    let first = batch_feeds(&data, &feeds, &first_batch(&data, n_train, cfg.batch));
    let mut trainer = Trainer::new(device, model, path, opts, &first)?;
    if cfg.shard.world > 1 {
        trainer.check_same_program()?;
    }
    trainer.own_dropout_stream(cfg.shard)?;
    // Every input of the step, the labels with the per-sample shape the step gives them; the
    // evaluation set's checked before any step.
    let feeds = feeds_for(trainer.graph(), &data)?;
    let eval = match eval_data {
        Some(e) => Some(EvalSet::Separate(feeds_for(trainer.graph(), &e)?, e)),
        None => (n > n_train).then_some(EvalSet::HeldOut(n_train..n)),
    };
    let mut run = Run {
        total: (cfg.epochs * per_epoch).min(cfg.max_steps.unwrap_or(usize::MAX)),
        trainer,
        data,
        feeds,
        eval,
        cfg,
        n_train,
        per_epoch,
        iteration: 0,
        losses: Vec::new(),
        skipped: Vec::new(),
        skipped_total: 0,
        points: Vec::new(),
        evals: Vec::new(),
        log: StepLog::off(),
        bar: indicatif::ProgressBar::hidden(),
    };
    if cfg.resume {
        run.iteration = run.resume()?;
    }
    run.log = StepLog::open(cfg.log.as_deref(), cfg.resume.then_some(run.iteration))?;
    if cfg.progress {
        run.bar = progress_bar();
    }
    let mut epochs = Vec::new();
    while run.iteration < run.total {
        let rep = run.epoch()?;
        run.bar.suspend(|| report(&rep));
        epochs.push(rep);
        // Every rank takes part (a sharded state is gathered); rank 0 writes.
        if let Some(dir) = cfg.checkpoint.as_ref() {
            let progress = Progress { iteration: run.iteration, global_batch: Some(cfg.batch * cfg.shard.world) };
            run.trainer.save_progress(&checkpoint_file(dir), progress)?;
        }
    }
    run.bar.finish_and_clear();
    run.log.finish()?;
    if let Some(p) = &cfg.plot {
        let title =
            format!("mpc train {}", path.file_name().map_or(String::new(), |n| n.to_string_lossy().into_owned()));
        crate::plot::training_curves(&run.points, &run.evals, &title, p)?;
    }
    let compiled = run.trainer.compiled().clone();
    Ok(Trained {
        epochs,
        losses: run.losses,
        skipped: run.skipped,
        state: run.trainer.state()?,
        stats: run.trainer.stats()?,
        ties: compiled.ties,
        folded: compiled.folded,
        auto_scale: compiled.auto_scale,
    })
}

/// The progress bar of a terminal: an epoch's steps, the loss and the time left in the epoch.
fn progress_bar() -> indicatif::ProgressBar {
    let b = indicatif::ProgressBar::new(0);
    b.set_style(
        indicatif::ProgressStyle::with_template("epoch {prefix} {bar:30} {pos}/{len} {msg}, {eta} left")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    b
}

/// The samples evaluated after each epoch.
enum EvalSet {
    /// These samples of the training data, which training does not visit.
    HeldOut(std::ops::Range<usize>),
    /// Every sample of a dataset of their own (`--eval-data`).
    Separate(Vec<Feed>, Dataset),
}

/// A run in progress: the trainer, the data, and what the run has seen so far.
struct Run<'a, D: Device> {
    trainer: Trainer<D>,
    data: Dataset,
    feeds: Vec<Feed>,
    eval: Option<EvalSet>,
    cfg: &'a TrainConfig,
    n_train: usize,
    per_epoch: usize,
    /// The batches of the run, and those done.
    total: usize,
    iteration: usize,
    losses: Vec<f32>,
    skipped: Vec<bool>,
    skipped_total: usize,
    /// Each step's numbers and each evaluation's loss, for `--plot`.
    points: Vec<crate::plot::StepPoint>,
    evals: Vec<(usize, f64)>,
    log: StepLog,
    bar: indicatif::ProgressBar,
}

/// An epoch's sums, as its steps' numbers reach the host.
#[derive(Default)]
struct EpochSums {
    loss: f64,
    counted: usize,
    samples: usize,
    skipped: usize,
}

impl<D: Device> Run<'_, D> {
    /// Loads the checkpoint of `--checkpoint DIR`; returns its batches done, which must leave
    /// some of this run's to train.
    fn resume(&mut self) -> Result<usize> {
        let dir = self.cfg.checkpoint.as_ref().ok_or_else(|| Error::Usage("--resume needs --checkpoint DIR".into()))?;
        let file = checkpoint_file(dir);
        let Progress { iteration: done, global_batch } = self.trainer.load_progress(&file)?;
        let here = self.cfg.batch * self.cfg.shard.world;
        if let Some(g) = global_batch.filter(|&g| g != here) {
            return Err(Error::Usage(format!(
                "{}: the checkpoint counts batches of {g} samples over all ranks, and this run's are {here} (--batch {} × {} ranks): resume with --global-batch {g}",
                file.display(),
                self.cfg.batch,
                self.cfg.shard.world
            )));
        }
        if done >= self.total {
            return Err(Error::Usage(format!(
                "{}: the checkpoint has done {done} batches, and this run has {} ({} epochs of {}): nothing is left to train; raise --epochs",
                file.display(),
                self.total,
                self.cfg.epochs,
                self.per_epoch
            )));
        }
        Ok(done)
    }

    /// Runs the rest of the current epoch (to the run's end at most), evaluating after it.
    fn epoch(&mut self) -> Result<EpochReport> {
        let epoch = self.iteration / self.per_epoch;
        let order = permutation(self.n_train as u32, self.cfg.seed ^ (epoch as u64).wrapping_mul(0x100000001b3));
        let batches = Batches::of(order, &self.data, self.cfg.batch * self.cfg.shard.world);
        let t0 = Instant::now();
        let mut sums = EpochSums::default();
        let mut pending = Vec::with_capacity(PRINT_EVERY);
        let in_epoch = |i: usize| i - epoch * self.per_epoch;
        self.bar.set_prefix(format!("{}/{}", epoch + 1, self.cfg.epochs));
        self.bar.set_length(in_epoch(self.total.min((epoch + 1) * self.per_epoch)) as u64);
        self.bar.reset_eta();
        self.bar.set_position(in_epoch(self.iteration) as u64);
        while self.iteration < self.total && self.iteration / self.per_epoch == epoch {
            let part = self.cfg.shard.part(batches.get(self.iteration % self.per_epoch));
            let idx: Vec<usize> = part.iter().map(|&i| i as usize).collect();
            let idx = idx.as_slice();
            self.trainer.at_step(self.iteration as u64 + 1);
            pending.push((self.iteration + 1, self.trainer.step(&batch_feeds(&self.data, &self.feeds, idx))?));
            sums.samples += idx.len();
            self.iteration += 1;
            let epoch_ends = self.iteration == self.total || self.iteration / self.per_epoch != epoch;
            if pending.len() >= PRINT_EVERY || epoch_ends {
                let per_s = sums.samples as f64 / t0.elapsed().as_secs_f64().max(1e-9);
                self.drain(&mut pending, epoch, per_s, &mut sums)?;
            }
        }
        let secs = t0.elapsed().as_secs_f64().max(1e-9);
        let ends = self.iteration % self.per_epoch == 0 || self.iteration == self.total;
        let eval = if ends { self.evaluate()? } else { None };
        if let Some((acc, l)) = eval {
            self.evals.push((self.iteration, l));
            let line =
                serde_json::json!({"step": self.iteration, "epoch": epoch + 1, "eval_loss": l, "eval_accuracy": acc});
            self.log.write(line)?;
        }
        // The steps' losses are the ranks' means already; the samples/s of the whole run.
        let mean_loss = sums.loss / sums.counted.max(1) as f64;
        let samples_per_s = self.trainer.over_ranks(sums.samples as f64 / secs, true)?;
        Ok(EpochReport {
            epoch: epoch + 1,
            mean_loss,
            loss_scale: self.trainer.loss_scale()?,
            skipped: sums.skipped,
            samples_per_s,
            eval,
        })
    }

    /// Reads the numbers of the steps in `pending` (the count of batches after each, and its
    /// handle): the log's lines, the losses, the epoch's sums and the progress bar.
    fn drain(
        &mut self,
        pending: &mut Vec<(usize, StepHandle<D::Staged>)>,
        epoch: usize,
        per_s: f64,
        sums: &mut EpochSums,
    ) -> Result<()> {
        let mut last = 0.0;
        let mut numbers = Vec::with_capacity(pending.len());
        for (step, h) in pending.drain(..) {
            numbers.push((step, self.trainer.wait(h)?));
        }
        // Over the ranks of a data-parallel run (one all-reduce per drain): each step's loss the
        // mean of the ranks' (the global batch's), the samples/s their sum.
        let mut local: Vec<f64> = numbers.iter().map(|(_, s)| f64::from(s.loss)).collect();
        local.push(per_s);
        let all = self.trainer.over_ranks_each(&local)?;
        let per_s = all[numbers.len()] * self.cfg.shard.world as f64;
        for ((step, mut s), loss) in numbers.into_iter().zip(all) {
            s.loss = loss as f32;
            self.log.write(serde_json::json!({
                "step": step, "epoch": epoch + 1, "loss": s.loss, "lr": s.lr,
                "loss_scale": s.loss_scale, "skipped": s.skipped, "samples_per_s": per_s,
            }))?;
            self.losses.push(s.loss);
            if self.cfg.plot.is_some() {
                self.points.push(crate::plot::StepPoint { step, loss: s.loss, lr: s.lr, skipped: s.skipped });
            }
            self.skipped.push(s.skipped);
            if s.skipped {
                sums.skipped += 1;
                self.skipped_total += 1;
            } else {
                sums.loss += f64::from(s.loss);
                sums.counted += 1;
            }
            last = s.loss;
        }
        let scale = self.trainer.loss_scale()?;
        self.bar.set_position((self.iteration - epoch * self.per_epoch) as u64);
        self.bar.set_message(format!(
            "loss {last:.4}{} skipped {} {} samples/s",
            scale.map_or(String::new(), |s| format!(" scale {s}")),
            self.skipped_total,
            rate(per_s)
        ));
        Ok(())
    }

    /// Accuracy (argmax of the first model output against the labels) and mean loss on the
    /// evaluation set, in batches of the run's size; none without one.
    fn evaluate(&mut self) -> Result<Option<(f64, f64)>> {
        let (data, feeds, rows) = match &self.eval {
            None => return Ok(None),
            Some(EvalSet::HeldOut(rows)) => (&self.data, &self.feeds, rows.clone()),
            Some(EvalSet::Separate(feeds, data)) => (data, feeds, 0..data.len()),
        };
        // In batches of one bucket each, the buckets in order.
        let mut rows: Vec<usize> = rows.collect();
        rows.sort_by_key(|&i| data.bucket_of(i));
        let mut chunks = Vec::new();
        for run in rows.chunk_by(|&a, &b| data.bucket_of(a) == data.bucket_of(b)) {
            chunks.extend(run.chunks(self.cfg.batch.max(1)));
        }
        // The loss is each batch's mean weighted by its samples: the mean over the set, whatever
        // the batch size (a short last batch counts for what it holds).
        let (mut correct, mut counted, mut loss, mut samples) = (0, 0, 0f64, 0usize);
        for chunk in chunks {
            let e = self.trainer.evaluate(&batch_feeds(data, feeds, chunk))?;
            correct += e.correct;
            counted += e.counted;
            if let Some(l) = e.loss {
                loss += l * chunk.len() as f64;
                samples += chunk.len();
            }
        }
        Ok(Some((correct as f64 / counted.max(1) as f64, loss / samples.max(1) as f64)))
    }
}

/// `--log FILE.jsonl`: one JSON object per line, written as the steps' numbers reach the host
/// (every [`PRINT_EVERY`] steps and at the end of an epoch). A step's line holds `step` (the
/// count of batches done), `epoch`, `loss`, `lr` (the rate the step applied), `loss_scale` (after
/// the step; null without scaling), `skipped` and `samples_per_s` (the epoch's so far); an
/// evaluation's line `step`, `epoch`, `eval_loss` and `eval_accuracy`. A resumed run keeps the
/// lines up to its checkpoint's step (a run stopped after it logged more) and appends.
pub struct StepLog {
    out: Option<(PathBuf, std::io::BufWriter<std::fs::File>)>,
}

impl StepLog {
    fn off() -> Self {
        StepLog { out: None }
    }

    /// The log at `path` (none without one): a new file, or resuming after `resumed_at`
    /// batches, the existing one's lines up to that step.
    pub fn open(path: Option<&Path>, resumed_at: Option<usize>) -> Result<Self> {
        let Some(path) = path else { return Ok(StepLog::off()) };
        let err = |source| Error::Output { path: path.to_owned(), source };
        let kept: String = match resumed_at {
            Some(done) => match std::fs::read_to_string(path) {
                Ok(text) => text
                    .lines()
                    .filter(|l| {
                        let step = serde_json::from_str::<serde_json::Value>(l).ok().and_then(|v| v["step"].as_u64());
                        step.is_some_and(|s| s <= done as u64)
                    })
                    .flat_map(|l| [l, "\n"])
                    .collect(),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
                Err(e) => return Err(err(e)),
            },
            None => String::new(),
        };
        let mut file = std::io::BufWriter::new(std::fs::File::create(path).map_err(err)?);
        std::io::Write::write_all(&mut file, kept.as_bytes()).map_err(err)?;
        Ok(StepLog { out: Some((path.to_owned(), file)) })
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
