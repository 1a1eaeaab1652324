//! `mpc bench`: what a model costs per step under each policy on one device: step time (median
//! after warm-up), samples per second, the FLOP rate achieved and its share of the device's
//! measured matrix-product rate, the bytes the program holds, the compile time and the launches
//! per step.
//!
//! Every policy runs in the same process on the same device, one after the other, so their ratios
//! are measured side by side. A step's inputs are fed before it (the arena reuses their bytes),
//! and the step is timed from its enqueue to the read of its smallest result (the loss when
//! training), which waits for the device: the time a caller waits per step, less the feed.

use std::collections::HashMap;
use std::path::Path;
use std::time::Instant;

use mpc_ir::{DType, Graph, Op, Shape, Tensor, TypeInfo};
use mpc_runtime::device::Device;
use mpc_runtime::session::Session;
use serde::Serialize;

use crate::{Error, Options, Result};

/// What to measure.
pub struct BenchConfig {
    pub policies: Vec<String>,
    /// Binds the first symbolic dim of each input (`--dim` binds others).
    pub batch: u64,
    pub warmup: usize,
    pub steps: usize,
    /// Time the training step (the options' `train` is set) rather than inference.
    pub train: bool,
    /// After the timed steps, run one more with each launch timed, and report the time by op.
    pub profile: bool,
}

/// The launches of one op type and output dtype in a profiled step, and their time.
#[derive(Clone, Debug, Serialize)]
pub struct OpTime {
    pub op: String,
    pub dtype: String,
    pub launches: u64,
    pub ms: f64,
    /// Of the profiled step's summed launch times.
    pub share: f64,
    /// The least the launches move (each tensor a launch reads or writes, once), and that over
    /// their time: how near they run to the device's bandwidth.
    pub bytes: u64,
    pub gb_per_s: f64,
}

/// One policy's measurements.
#[derive(Clone, Debug, Serialize)]
pub struct BenchRow {
    pub policy: String,
    pub step_ms_median: f64,
    pub step_ms_min: f64,
    pub samples_per_s: f64,
    /// Matrix-product and convolution FLOPs of one step: the forward pass, or three times it for
    /// a training step (forward, and the two products of the backward pass).
    pub flops_per_step: u64,
    pub tflops: f64,
    /// The device's rate on one large matrix product in the policy's matmul dtype, measured in
    /// this run, and the step's share of it.
    pub peak_tflops: f64,
    pub share_of_peak: f64,
    pub arena_bytes: u64,
    pub state_bytes: u64,
    pub constants_bytes: u64,
    /// Every device allocation made for the policy's run: the regions above, the program's
    /// workspace (the launches' scratch, cuDNN's among it), its launch constants, and the matrix
    /// library's workspace. The figure to hold beside PyTorch's `max_memory_allocated`, which
    /// counts its own library workspaces.
    pub allocated_bytes: u64,
    /// Of those, the program's workspace: the scratch of launches whose scratch the arena's free
    /// bytes did not hold (cuDNN's among it), and how many launches' the arena held.
    pub workspace_bytes: u64,
    pub scratch_in_arena: u64,
    /// Compiling the model, lowering the step and loading it on the device (its constants, its
    /// kernels built or taken from the cache).
    pub compile_ms: f64,
    pub launches_per_step: u64,
    /// The device memory in use after the steps as its driver reports it (GPUs; every process's).
    pub device_memory_in_use: Option<u64>,
    /// What the driver's figure grew by from the device's opening (its context and matrix-product
    /// workspace made) to after the steps: the program's regions and workspaces, as allocated.
    pub device_memory_used: Option<u64>,
    /// Convolutions the device runs through cuDNN, and those cuDNN refused (they run as im2col
    /// and GEMMs); 0 on the CPU.
    pub cudnn_convolutions: u64,
    pub cudnn_refused: u64,
    /// Products with a bias or ReLU epilogue the device runs through cuBLASLt, and those it
    /// refused (they run as a broadcast, a GEMM and a ReLU); 0 on the CPU.
    pub cublaslt_gemms: u64,
    pub cublaslt_refused: u64,
    /// With `profile`: one step's launch times by op and dtype, the longest first.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub profile: Option<Vec<OpTime>>,
}

/// The whole report: the device, then one row per policy.
#[derive(Clone, Debug, Serialize)]
pub struct BenchReport {
    pub model: String,
    pub device: String,
    /// How steps were timed: the device's own events around each step, or the host's clock from
    /// enqueue to the read of a result.
    pub timing: String,
    pub batch: u64,
    pub train: bool,
    pub rows: Vec<BenchRow>,
    /// The process's peak resident memory after all runs (the CPU device's figure).
    pub process_peak_bytes: Option<u64>,
}

/// The dims that `batch` binds: the first symbolic dim of each input, unless `--dim` bound it.
fn batch_dims(g: &Graph, batch: u64, dims: &HashMap<String, u64>) -> HashMap<String, u64> {
    let mut out = dims.clone();
    for &v in g.inputs() {
        let first = g.ty(v).shape.as_ref().and_then(|s| s.dims().iter().find_map(|d| d.symbol().map(str::to_string)));
        if let Some(s) = first {
            out.entry(s).or_insert(batch);
        }
    }
    out
}

fn median(mut t: Vec<f64>) -> (f64, f64) {
    t.sort_by(f64::total_cmp);
    (t[t.len() / 2], t[0])
}

/// What a benchmark steps: a training step loaded by the library's trainer, or an inference
/// program in a session of its own; and the inputs it is fed.
struct Stepped<D: Device> {
    runner: Runner<D>,
    feeds: HashMap<String, mpc_runtime::HostTensor>,
}

enum Runner<D: Device> {
    Train(Box<crate::trainer::Trainer<D>>),
    Infer(Session<D>),
}

impl<D: Device> Stepped<D> {
    fn session(&mut self) -> &mut Session<D> {
        match &mut self.runner {
            Runner::Train(t) => t.session_mut(),
            Runner::Infer(s) => s,
        }
    }
}

/// The step a policy's row measures, on `dev`, and the result read after each step (the loss
/// when training, else the smallest output). Training goes through [`crate::trainer::TrainingStep`],
/// as `mpc train` does; `fwd` is the model with its batch freed (inference binds it as is).
fn open_step<D: Device>(
    dev: D,
    model: &Graph,
    fwd: &Graph,
    path: &Path,
    o: &Options,
    cfg: &BenchConfig,
) -> Result<(Stepped<D>, String)> {
    let rerr = |source| Error::Run { path: path.to_owned(), source };
    let inputs = |g: &Graph| {
        let dims = batch_dims(g, cfg.batch, &o.dims);
        crate::run::random_inputs(g, 1, &dims).map_err(|e| Error::Usage(format!("{}: {e}", path.display())))
    };
    if cfg.train {
        let sizes = batch_dims(fwd, cfg.batch, &o.dims);
        let step = crate::trainer::TrainingStep::compile(model, path, o, sizes)?;
        let feeds = inputs(step.graph())?;
        let trainer = step.on(dev, &feeds)?;
        let sync = trainer.loss_name().to_string();
        return Ok((Stepped { runner: Runner::Train(Box::new(trainer)), feeds }, sync));
    }
    let mut g = fwd.clone();
    crate::compile(&mut g, path, o, &mut |_, _| {})?;
    let feeds = inputs(&g)?;
    let program = crate::run::lower_for_inputs(&g, &feeds, dev.caps(), path)?;
    let sync = program
        .outputs
        .iter()
        .min_by_key(|(_, r)| r.bytes())
        .map(|(n, _)| n.clone())
        .ok_or_else(|| Error::Usage(format!("{}: the model has no output", path.display())))?;
    let session = Session::new(dev, program).map_err(rerr)?;
    Ok((Stepped { runner: Runner::Infer(session), feeds }, sync))
}

/// Measures every policy of `cfg` on devices from `device`, one fresh device per policy.
pub fn bench<D: Device>(
    device: impl Fn() -> Result<D>,
    model: &Graph,
    path: &Path,
    opts: &Options,
    cfg: &BenchConfig,
) -> Result<BenchReport> {
    let rerr = |source| Error::Run { path: path.to_owned(), source };
    if cfg.steps == 0 || cfg.batch == 0 {
        return Err(Error::Usage("--steps and --batch must be at least 1".into()));
    }
    let mut fwd = model.clone();
    if cfg.train {
        crate::train::free_batch(&mut fwd);
    }
    let dims = batch_dims(&fwd, cfg.batch, &opts.dims);
    let (bound, _) =
        crate::summary::bind_inputs(&fwd, &dims).map_err(|source| Error::Pass { path: path.to_owned(), source })?;
    let forward = crate::summary::flops(&bound).total();
    let flops_per_step = if cfg.train { 3 * forward } else { forward };
    let mut rows = Vec::new();
    let mut peaks: HashMap<DType, f64> = HashMap::new();
    let mut device_name = "";
    let mut timing = "host clock";
    for policy in &cfg.policies {
        let mut o = opts.clone();
        o.policy = Some(policy.clone());
        let t0 = Instant::now();
        let dev = device()?;
        let opened = dev.memory_in_use();
        device_name = dev.caps().name;
        let (mut step, sync) = open_step(dev, model, &fwd, path, &o, cfg)?;
        let compile_ms = t0.elapsed().as_secs_f64() * 1e3;
        let feeds = std::mem::take(&mut step.feeds);
        let session = step.session();
        let (times, events) = time_steps(session, &feeds, &sync, cfg, path)?;
        if events {
            timing = "device events";
        }
        let device_memory = session.memory_in_use();
        let device_memory_used = opened.zip(device_memory).map(|(a, b)| b.saturating_sub(a));
        let profile = if cfg.profile {
            session.feed(0, &feeds).map_err(rerr)?;
            let launches = session.profile_step(0).map_err(rerr)?;
            session.read(0, &sync).map_err(rerr)?;
            Some(by_op(&launches))
        } else {
            None
        };
        let (step_ms_median, step_ms_min) = median(times);
        let stats = session.stats(0);
        let counters = session.counters();
        let low = crate::policy(&o)?.as_ref().map_or(DType::F32, |p| p.low);
        let low = if policy == "fp32" { DType::F32 } else { low };
        let peak = match peaks.get(&low) {
            Some(&p) => p,
            None => {
                let p = gemm_rate(&device, low, path)?;
                peaks.insert(low, p);
                p
            }
        };
        let times = (step_ms_median, step_ms_min);
        let measured = Measured { times, compile_ms, device_memory, device_memory_used, stats, counters, profile };
        rows.push(row(policy, cfg, flops_per_step, peak, measured));
    }
    Ok(BenchReport {
        model: path.file_name().map_or(String::new(), |n| n.to_string_lossy().into_owned()),
        device: device_name.to_string(),
        timing: timing.to_string(),
        batch: cfg.batch,
        train: cfg.train,
        rows,
        process_peak_bytes: crate::peak_rss(),
    })
}

/// The times (ms) of `cfg.steps` steps of program 0 after `cfg.warmup` untimed ones, each fed
/// `feeds` (the arena reuses an input's bytes after its last reader) and read back through
/// `sync`; and whether the device's events timed them (else the host clock, enqueue to result).
fn time_steps<D: Device>(
    session: &mut Session<D>,
    feeds: &HashMap<String, mpc_runtime::HostTensor>,
    sync: &str,
    cfg: &BenchConfig,
    path: &Path,
) -> Result<(Vec<f64>, bool)> {
    let rerr = |source| Error::Run { path: path.to_owned(), source };
    let (mut times, mut events) = (Vec::with_capacity(cfg.steps), false);
    for i in 0..cfg.warmup + cfg.steps {
        session.feed(0, feeds).map_err(rerr)?;
        let t = Instant::now();
        let start = session.mark().map_err(rerr)?;
        session.step(0).map_err(rerr)?;
        let end = session.mark().map_err(rerr)?;
        session.read(0, sync).map_err(rerr)?;
        let ms = match (start, end) {
            (Some(a), Some(b)) => {
                events = true;
                session.elapsed_ms(a, b).map_err(rerr)?
            }
            _ => t.elapsed().as_secs_f64() * 1e3,
        };
        if i >= cfg.warmup {
            times.push(ms);
        }
    }
    Ok((times, events))
}

/// What a policy's run measured besides the session's counts.
struct Measured {
    /// The median and the least step time (ms).
    times: (f64, f64),
    compile_ms: f64,
    device_memory: Option<u64>,
    device_memory_used: Option<u64>,
    stats: mpc_runtime::session::StepStats,
    counters: mpc_runtime::device::DeviceCounters,
    profile: Option<Vec<OpTime>>,
}

/// A policy's row of the report.
fn row(policy: &str, cfg: &BenchConfig, flops_per_step: u64, peak: f64, m: Measured) -> BenchRow {
    let (step_ms_median, step_ms_min) = m.times;
    let (stats, counters) = (&m.stats, &m.counters);
    let tflops = flops_per_step as f64 / (step_ms_median * 1e-3) / 1e12;
    BenchRow {
        policy: policy.to_string(),
        step_ms_median,
        step_ms_min,
        samples_per_s: cfg.batch as f64 / (step_ms_median * 1e-3),
        flops_per_step,
        tflops,
        peak_tflops: peak,
        share_of_peak: if peak > 0.0 { tflops / peak } else { 0.0 },
        arena_bytes: stats.arena_bytes,
        state_bytes: stats.state_bytes,
        constants_bytes: stats.constants_bytes,
        allocated_bytes: counters.allocated_bytes,
        workspace_bytes: counters.workspace_bytes,
        scratch_in_arena: counters.scratch_in_arena,
        compile_ms: m.compile_ms,
        launches_per_step: stats.launches_per_step,
        device_memory_in_use: m.device_memory,
        device_memory_used: m.device_memory_used,
        cudnn_convolutions: counters.dnn_convolutions,
        cudnn_refused: counters.dnn_fallbacks,
        cublaslt_gemms: counters.lt_gemms,
        cublaslt_refused: counters.lt_fallbacks,
        profile: m.profile,
    }
}

/// Launch times summed by op type and output dtype, the longest first.
fn by_op(launches: &[mpc_runtime::session::LaunchTime]) -> Vec<OpTime> {
    let mut groups: HashMap<(String, String), (u64, f64, u64)> = HashMap::new();
    for l in launches {
        let dtype = l.dtype.map_or(String::new(), |d| d.name().to_string());
        let e = groups.entry((l.op.clone(), dtype)).or_default();
        e.0 += 1;
        e.1 += l.ms;
        e.2 += l.bytes;
    }
    let total: f64 = launches.iter().map(|l| l.ms).sum();
    let mut out: Vec<OpTime> = groups
        .into_iter()
        .map(|((op, dtype), (launches, ms, bytes))| OpTime {
            op,
            dtype,
            launches,
            ms,
            share: if total > 0.0 { ms / total } else { 0.0 },
            bytes,
            gb_per_s: if ms > 0.0 { bytes as f64 / (ms * 1e-3) / 1e9 } else { 0.0 },
        })
        .collect();
    out.sort_by(|a, b| b.ms.total_cmp(&a.ms).then_with(|| a.op.cmp(&b.op)));
    out
}

/// The device's rate, in TFLOP/s, on one square matrix product in `dtype` (the median of a few
/// runs after a warm-up): the peak the report compares each step with.
pub fn gemm_rate<D: Device>(device: &impl Fn() -> Result<D>, dtype: DType, path: &Path) -> Result<f64> {
    let rerr = |source| Error::Run { path: path.to_owned(), source };
    let dev = device()?;
    let n: u64 = if dev.caps().name == "cpu" { 512 } else { 8192 };
    let mut g = Graph::new("gemm");
    let a = g.add_input("a", TypeInfo::new(dtype, Shape::fixed(&[n, n])));
    let vals: Vec<f64> = (0..n * n).map(|i| ((i * 7919) % 1000) as f64 / 1000.0 - 0.5).collect();
    let b = g.add_initializer("b", Tensor::from_f64_as(dtype, vec![n, n], &vals));
    let (_, y) = g.add_op("gemm", Op::MatMul, &[Some(a), Some(b)], 1);
    g.add_output(y[0]);
    let feeds = crate::run::random_inputs(&g, 3, &HashMap::new())?;
    let program = crate::run::lower_for_inputs(&g, &feeds, dev.caps(), path)?;
    let mut session = Session::new(dev, program).map_err(rerr)?;
    let name = g.name(y[0]).to_string();
    let mut times = Vec::new();
    for i in 0..8 {
        session.feed(0, &feeds).map_err(rerr)?;
        let t = Instant::now();
        let start = session.mark().map_err(rerr)?;
        session.step(0).map_err(rerr)?;
        let end = session.mark().map_err(rerr)?;
        session.read(0, &name).map_err(rerr)?;
        let secs = match (start, end) {
            (Some(a), Some(b)) => session.elapsed_ms(a, b).map_err(rerr)? * 1e-3,
            _ => t.elapsed().as_secs_f64(),
        };
        if i >= 2 {
            times.push(secs);
        }
    }
    let (secs, _) = median(times);
    Ok(2.0 * (n * n * n) as f64 / secs / 1e12)
}

/// The report as a table.
pub fn table(r: &BenchReport) -> String {
    let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
    let mut s = format!(
        "{} on {}, batch {}, {}, timed by {}\n{:<11} {:>10} {:>10} {:>12} {:>9} {:>8} {:>11} {:>10} {:>10} {:>10} {:>10} {:>9}\n",
        r.model,
        r.device,
        r.batch,
        if r.train { "training step" } else { "inference" },
        r.timing,
        "policy",
        "step ms",
        "min ms",
        "samples/s",
        "TFLOP/s",
        "of peak",
        "arena MiB",
        "state MiB",
        "const MiB",
        "alloc MiB",
        "compile ms",
        "launches"
    );
    for row in &r.rows {
        s.push_str(&format!(
            "{:<11} {:>10.3} {:>10.3} {:>12.1} {:>9.4} {:>7.1}% {:>11.2} {:>10.2} {:>10.2} {:>10.2} {:>10.1} {:>9}\n",
            row.policy,
            row.step_ms_median,
            row.step_ms_min,
            row.samples_per_s,
            row.tflops,
            100.0 * row.share_of_peak,
            mib(row.arena_bytes),
            mib(row.state_bytes),
            mib(row.constants_bytes),
            mib(row.allocated_bytes),
            row.compile_ms,
            row.launches_per_step
        ));
    }
    if let Some(p) = r.process_peak_bytes {
        s.push_str(&format!("process peak memory: {:.1} MiB\n", mib(p)));
    }
    for row in r.rows.iter().filter(|row| row.workspace_bytes + row.scratch_in_arena > 0) {
        s.push_str(&format!(
            "{}: scratch of {} launches in the arena's free bytes, a workspace of {:.2} MiB for the rest\n",
            row.policy,
            row.scratch_in_arena,
            mib(row.workspace_bytes)
        ));
    }
    for row in r.rows.iter().filter(|row| row.cudnn_convolutions + row.cudnn_refused > 0) {
        s.push_str(&format!(
            "{}: {} convolutions through cuDNN, {} refused by it (run as im2col and GEMMs)\n",
            row.policy, row.cudnn_convolutions, row.cudnn_refused
        ));
    }
    for row in r.rows.iter().filter(|row| row.cublaslt_gemms + row.cublaslt_refused > 0) {
        s.push_str(&format!(
            "{}: {} products with a bias or ReLU through cuBLASLt, {} refused by it (run as a broadcast, a GEMM and a ReLU)\n",
            row.policy, row.cublaslt_gemms, row.cublaslt_refused
        ));
    }
    for row in &r.rows {
        let Some(profile) = &row.profile else { continue };
        let total: f64 = profile.iter().map(|o| o.ms).sum();
        s.push_str(&format!(
            "{}: one profiled step, {total:.3} ms in launches; the longest ops, with the bytes they move at the \
             least and that over their time:\n",
            row.policy
        ));
        let label = |o: &OpTime| format!("{} {}", o.op, o.dtype).trim_end().to_string();
        let width = profile.iter().take(PROFILE_ROWS).map(|o| label(o).len()).max().unwrap_or(0).max(32);
        for o in profile.iter().take(PROFILE_ROWS) {
            s.push_str(&format!(
                "  {:<width$} {:>6} launches {:>10.3} ms {:>6.1}% {:>10.1} MiB {:>8.1} GB/s\n",
                label(o),
                o.launches,
                o.ms,
                100.0 * o.share,
                o.bytes as f64 / (1u64 << 20) as f64,
                o.gb_per_s
            ));
        }
    }
    s
}

/// The ops of a profile that the table lists (the JSON report has them all).
const PROFILE_ROWS: usize = 15;
