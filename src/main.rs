//! The `mpc` command line.

// A graph is millions of small allocations; mimalloc handles them about twice as fast as the
// system allocator (measured on a 100k-node compile).
#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

use mpc_runtime::device::Device;
use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Instant;

use clap::{Parser, Subcommand};
use mpc::{Error, Format, Options};
use mpc_ir::text;

#[derive(Parser)]
#[command(name = "mpc", version, about = "A mixed-precision graph compiler for ONNX models")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(clap::Args)]
struct Common {
    /// The model: an .onnx file or mpc text IR (.mpcir).
    model: PathBuf,
    /// Precision policy: fp32 (no rewrite; the default), mixed (FP16), mixed-bf16, fp16 (everything FP16).
    #[arg(long)]
    policy: Option<String>,
    /// A TOML policy file: base policy, low dtype, list edits, pinned nodes.
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// Run this op type in low precision (repeatable).
    #[arg(long, value_name = "OP")]
    allow: Vec<String>,
    /// Keep this op type in FP32 (repeatable).
    #[arg(long, value_name = "OP")]
    deny: Vec<String>,
    /// Keep the node with this name in FP32 (repeatable).
    #[arg(long, value_name = "NODE")]
    pin_fp32: Vec<String>,
    /// Graph input and output dtypes: keep (default) or low.
    #[arg(long, value_name = "keep|low", default_value = "keep")]
    io_types: String,
    /// Size of a symbolic dim, as NAME=N (repeatable), e.g. --dim batch=64.
    #[arg(long = "dim", value_name = "NAME=N")]
    dims: Vec<String>,
    /// Measure every value's range on these sample inputs (safetensors, named after the graph
    /// inputs) in FP32 first, and keep in FP32 the nodes whose outputs the low dtype would break
    /// (an overflow, or more than 1% of the non-zeros flushed to zero).
    #[arg(long, value_name = "DATA")]
    calibrate: Option<PathBuf>,
    /// Calibrate with ranges saved by --ranges-out instead of measuring.
    #[arg(long, value_name = "FILE", conflicts_with = "calibrate")]
    ranges_in: Option<PathBuf>,
    /// Save the measured ranges (JSON) for --ranges-in.
    #[arg(long, value_name = "FILE")]
    ranges_out: Option<PathBuf>,
    /// Batches of the calibration data to measure, and samples per batch.
    #[arg(long, value_name = "N", default_value_t = 8)]
    calibrate_batches: usize,
    #[arg(long, value_name = "N", default_value_t = 32)]
    calibrate_batch: usize,
    /// The most memory one lowered program may hold (activations, weights, training state), as
    /// bytes or with a K, M, G or T suffix (powers of 1024); the default is the machine's memory.
    /// A larger program is refused before anything is allocated.
    #[arg(long, value_name = "SIZE")]
    max_memory: Option<String>,
    /// With --device cuda: launch every kernel of every step instead of recording the second
    /// step as a CUDA graph and replaying it (the results are the same bits).
    #[arg(long)]
    no_cuda_graph: bool,
}

impl Common {
    fn options(&self, dump_after: Vec<String>, stop_after: Option<String>) -> Result<Options, Error> {
        let io_low = match self.io_types.as_str() {
            "keep" => false,
            "low" => true,
            other => return Err(Error::Usage(format!("--io-types `{other}`: expected keep or low"))),
        };
        Ok(Options {
            policy: self.policy.clone(),
            config: self.config.clone(),
            allow: self.allow.clone(),
            deny: self.deny.clone(),
            pin_fp32: self.pin_fp32.clone(),
            io_low,
            dims: parse_dims(&self.dims)?,
            dump_after,
            stop_after,
            train: None,
            loss_scale: None,
            calibrate: self.calibration(),
        })
    }

    fn calibration(&self) -> Option<mpc::ranges::Calibration> {
        (self.calibrate.is_some() || self.ranges_in.is_some()).then(|| mpc::ranges::Calibration {
            data: self.calibrate.clone(),
            ranges_in: self.ranges_in.clone(),
            ranges_out: self.ranges_out.clone(),
            batch: self.calibrate_batch,
            batches: self.calibrate_batches,
        })
    }
}

/// Training options (`compile --train` and `train`); each overrides the config file's `[train]`
/// table, which overrides the defaults.
#[derive(clap::Args)]
struct TrainArgs {
    /// The loss: cross-entropy (on the first output, against integer labels; the default), mse, or
    /// output:NAME (the model computes its own scalar loss). Cross-entropy takes the classes on
    /// axis 1 and skips labels of -100; `cross-entropy:axis=-1` is a language model's loss over
    /// [batch, tokens, vocabulary] scores, `ignore-index=N|none` sets the skipped label.
    #[arg(long)]
    loss: Option<String>,
    /// Name of the labels (or targets) input the loss adds [default: labels].
    #[arg(long)]
    labels: Option<String>,
    /// sgd, momentum, adam (the default) or adamw.
    #[arg(long)]
    optimizer: Option<String>,
    /// Learning rate [default: 0.001].
    #[arg(long)]
    lr: Option<f32>,
    /// Weight decay [default: 0].
    #[arg(long)]
    weight_decay: Option<f32>,
    /// Momentum of the momentum optimizer [default: 0.9].
    #[arg(long)]
    momentum: Option<f32>,
    /// Clip the gradients' global norm (after unscaling) to this.
    #[arg(long, value_name = "NORM")]
    clip_norm: Option<f32>,
    /// dynamic, auto (dynamic, starting where gradients measured on --calibrate DATA say), static:S
    /// or none (default: dynamic for mixed, none otherwise).
    #[arg(long, value_name = "MODE")]
    loss_scale: Option<String>,
    /// Do not train this initializer (repeatable).
    #[arg(long, value_name = "NAME")]
    freeze: Vec<String>,
    /// Seed of the random streams: the dropout masks and, for `train`, the sample order [default: 0].
    #[arg(long)]
    seed: Option<u64>,
    /// Train initializers that are copies or transposes of one another (an exported tied LM head)
    /// as separate parameters, not as one.
    #[arg(long)]
    no_tie: bool,
    /// Cast each FP32 master weight to the low dtype in every step, instead of keeping its low
    /// copy as training state that the optimizer update writes: less memory (a copy lives only
    /// from its forward use to its last backward use), one more launch and more traffic per weight.
    #[arg(long)]
    no_weight_copies: bool,
}

impl TrainArgs {
    fn settings(&self) -> mpc::config::TrainFile {
        mpc::config::TrainFile {
            loss: self.loss.clone(),
            labels: self.labels.clone(),
            optimizer: self.optimizer.clone(),
            lr: self.lr,
            weight_decay: self.weight_decay,
            momentum: self.momentum,
            clip_norm: self.clip_norm,
            loss_scale: self.loss_scale.clone(),
            freeze: self.freeze.clone(),
            seed: self.seed,
            tie: self.no_tie.then_some(false),
            weight_copies: self.no_weight_copies.then_some(false),
            ..Default::default()
        }
    }
}

#[derive(Subcommand)]
enum Command {
    /// Rewrite a model and write it as ONNX, text IR, Graphviz or JSON.
    Compile {
        #[command(flatten)]
        common: Common,
        /// Output file; the format follows its extension (.onnx, .mpcir, .dot, .json).
        /// Without it, the text IR goes to stdout.
        #[arg(short, long)]
        output: Option<PathBuf>,
        /// Output format, overriding the extension: onnx, ir, dot, json.
        #[arg(long)]
        emit: Option<String>,
        /// Print the text IR after this pass to stderr (repeatable).
        #[arg(long, value_name = "PASS")]
        dump_after: Vec<String>,
        /// Stop the pipeline after this pass.
        #[arg(long, value_name = "PASS")]
        stop_after: Option<String>,
        /// Print timings and peak memory to stderr.
        #[arg(long)]
        stats: bool,
        /// Build the whole training step: loss, backward graph, optimizer, loss scaling.
        #[arg(long)]
        train: bool,
        #[command(flatten)]
        train_args: TrainArgs,
    },
    /// Compile the training step and train on a data file; print per-epoch loss and accuracy.
    Train {
        #[command(flatten)]
        common: Common,
        #[command(flatten)]
        train_args: TrainArgs,
        /// Training data (safetensors): tensors named after the graph inputs and the labels,
        /// the first dimension being the sample.
        #[arg(long, value_name = "FILE")]
        data: PathBuf,
        #[arg(long, default_value_t = 1)]
        epochs: usize,
        #[arg(long, default_value_t = 64)]
        batch: usize,
        /// Hold out the last samples for evaluation after each epoch: a share (below 1) or a count.
        #[arg(long, value_name = "F|N", default_value_t = 0.0)]
        eval_split: f64,
        /// Write DIR/checkpoint.safetensors after each epoch.
        #[arg(long, value_name = "DIR")]
        checkpoint: Option<PathBuf>,
        /// Continue from the checkpoint in --checkpoint DIR.
        #[arg(long)]
        resume: bool,
        /// Stop after this many steps in all (a run can be resumed later).
        #[arg(long, value_name = "N")]
        max_steps: Option<usize>,
        /// The device: cpu, or cuda (the first GPU).
        #[arg(long, default_value = "cpu")]
        device: String,
        /// Write the model with the trained weights (ONNX, ready for inference).
        #[arg(short, long)]
        output: Option<PathBuf>,
        /// Print what the training step costs: arena, state and constants bytes, launches per
        /// step, allocations inside steps after the first, host reads per step.
        #[arg(long)]
        stats: bool,
    },
    /// Show a model as text IR with a summary: op counts, parameters, estimated FLOPs.
    Inspect {
        #[command(flatten)]
        common: Common,
        /// Say, for every node, which precision it got and which rule or neighbour decided it.
        #[arg(long)]
        explain: bool,
        /// Print the graph as Graphviz, coloured by precision, instead of text.
        #[arg(long)]
        dot: bool,
        /// Print the memory plan's peak bytes (weights, activations) for the policy.
        #[arg(long)]
        memory: bool,
        /// Batch size for --memory (binds the first symbolic dim of each input; --dim for others).
        #[arg(long)]
        batch: Option<u64>,
        /// Run the FP32 model on these sample inputs and report, for every float value, what the
        /// policy's low dtype (FP16 unless --policy mixed-bf16) would flush or overflow; the values
        /// at risk first. Batches as --calibrate-batches and --calibrate-batch say.
        #[arg(long, value_name = "DATA")]
        ranges: Option<PathBuf>,
        /// With --ranges: print every value's measurements as JSON.
        #[arg(long, requires = "ranges")]
        json: bool,
        /// With --ranges: measure the training step too (FP32, loss scale 1, the data holding the
        /// labels) and print the histogram of log2 |activation gradient| with the loss scales that
        /// lose nothing and overflow nothing. With --memory: the plan of the training step (the
        /// training options) instead of inference's.
        #[arg(long)]
        train: bool,
        /// With --ranges --train: draw the activation-gradient histogram to this SVG file.
        #[arg(long, value_name = "FILE.svg", requires_all = ["train", "ranges"])]
        plot: Option<PathBuf>,
        #[command(flatten)]
        train_args: TrainArgs,
    },
    /// Compile with a policy and run on a backend; print a summary of each output.
    Run {
        #[command(flatten)]
        common: Common,
        /// Inputs as a safetensors file, tensors named after the graph inputs.
        #[arg(long, value_name = "FILE", conflicts_with = "random_inputs")]
        inputs: Option<PathBuf>,
        /// Random inputs from this seed (floats N(0,1), integers in [0,2)); --dim sizes symbolic dims.
        #[arg(long, value_name = "SEED")]
        random_inputs: Option<u64>,
        /// Where to write the outputs (safetensors, keyed by graph output name).
        #[arg(short, long)]
        output: Option<PathBuf>,
        /// The device: cpu, or cuda (the first GPU).
        #[arg(long, default_value = "cpu")]
        device: String,
        /// Run this many more times after a warm-up run and print the median time per run.
        #[arg(long, value_name = "N")]
        repeat: Option<usize>,
        /// Print what the lowered program costs: arena and persistent bytes, launches per step,
        /// allocations inside steps after the first, host reads per step.
        #[arg(long)]
        stats: bool,
    },
    /// Time a model's step under each policy on a device: median step time, samples/s, TFLOP/s
    /// and its share of the device's measured matrix-product rate, memory, compile time, launches.
    Bench {
        #[command(flatten)]
        common: Common,
        /// Time the training step (with the training options) instead of inference.
        #[arg(long)]
        train: bool,
        #[command(flatten)]
        train_args: TrainArgs,
        /// The policies to compare, comma-separated (the default: fp32,mixed,mixed-bf16);
        /// --policy also takes such a list here.
        #[arg(long, value_name = "P,P,...")]
        policies: Option<String>,
        /// Binds the first symbolic dim of each input.
        #[arg(long, default_value_t = 64)]
        batch: u64,
        /// Steps timed after the warm-up.
        #[arg(long, default_value_t = 20)]
        steps: usize,
        #[arg(long, default_value_t = 3)]
        warmup: usize,
        /// The device: cpu, or cuda (the first GPU).
        #[arg(long, default_value = "cpu")]
        device: String,
        /// Print the report as JSON.
        #[arg(long)]
        json: bool,
        /// After the timed steps, time each launch of one more step and report the time by op.
        #[arg(long)]
        profile: bool,
    },
    /// List the CPU and the GPUs mpc can use, with the CUDA libraries it finds, or say why none.
    Devices,
}

/// What `--device` names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum DeviceKind {
    Cpu,
    Cuda,
}

/// `--device cpu|cuda`; cuda is refused with one line where this build or machine has none.
fn check_device(device: &str) -> Result<DeviceKind, Error> {
    match device {
        "cpu" => Ok(DeviceKind::Cpu),
        "cuda" if cfg!(feature = "cuda") => Ok(DeviceKind::Cuda),
        "cuda" => Err(Error::Usage(format!("--device cuda: {}", mpc::devices::cuda_refusal()))),
        d => Err(Error::Usage(format!("--device {d}: unknown device (cpu or cuda)"))),
    }
}

fn open_cpu() -> Result<mpc_runtime::device::CpuDevice, Error> {
    Ok(mpc_runtime::device::CpuDevice::default())
}

/// The first GPU, or one line saying why there is none (no driver, no GPU, no NVRTC).
#[cfg(feature = "cuda")]
fn open_cuda() -> Result<mpc_runtime::cuda::device::CudaDevice, Error> {
    mpc_runtime::cuda::device::CudaDevice::new(0).map_err(|e| Error::Usage(format!("--device cuda: {e}")))
}

/// Runs `$body` with `$open` bound to the factory of the device `$kind` names.
macro_rules! on_device {
    ($kind:expr, $open:ident => $body:expr) => {
        match $kind {
            DeviceKind::Cpu => {
                let $open = open_cpu;
                $body
            }
            #[cfg(feature = "cuda")]
            DeviceKind::Cuda => {
                let $open = open_cuda;
                $body
            }
            #[cfg(not(feature = "cuda"))]
            DeviceKind::Cuda => unreachable!("check_device refuses cuda in a build without it"),
        }
    };
}

/// `mpc run` on one device: the outputs of the first run, after `repeat` more timed runs.
fn run_on<D: Device>(
    device: D,
    g: &mpc_ir::Graph,
    feeds: &HashMap<String, mpc_runtime::HostTensor>,
    model: &std::path::Path,
    repeat: Option<usize>,
    stats: bool,
) -> Result<Vec<(String, mpc_runtime::HostTensor)>, Error> {
    let rerr = |source| Error::Run { path: model.to_owned(), source };
    let program = mpc::run::lower_for_inputs(g, feeds, device.caps(), model)?;
    let mut session = mpc_runtime::session::Session::new(device, program).map_err(rerr)?;
    let outs = session.run(feeds).map_err(rerr)?;
    if let Some(n) = repeat.filter(|&n| n > 0) {
        let mut times = Vec::with_capacity(n);
        for _ in 0..n {
            let t = Instant::now();
            session.run(feeds).map_err(rerr)?;
            times.push(t.elapsed().as_secs_f64() * 1e3);
        }
        times.sort_by(f64::total_cmp);
        eprintln!("mpc: median run {:.3} ms over {n} runs (min {:.3} ms)", times[n / 2], times[0]);
    }
    if stats {
        let program = session.program(0).map_err(rerr)?;
        eprintln!("mpc: {}", mpc::run::stats_line(program, &session.stats(0)));
    }
    Ok(outs)
}

fn parse_dims(dims: &[String]) -> Result<HashMap<String, u64>, Error> {
    dims.iter()
        .map(|d| {
            let (k, v) = d.split_once('=').ok_or_else(|| Error::Usage(format!("--dim `{d}`: expected NAME=N")))?;
            let n = v.parse().map_err(|_| Error::Usage(format!("--dim `{d}`: `{v}` is not a size")))?;
            Ok((k.to_string(), n))
        })
        .collect()
}

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        // Help and the version are output, not errors.
        Err(e) if !e.use_stderr() => {
            let _ = e.print();
            return ExitCode::SUCCESS;
        }
        // A usage error is one line, like every other error.
        Err(e) => {
            // clap's message is its first paragraph; usage and tips follow.
            let text = e.to_string();
            let lines: Vec<&str> = text.lines().take_while(|l| !l.trim().is_empty()).map(str::trim).collect();
            let message = lines.join(" ");
            eprintln!("mpc: {} (see mpc --help)", one_line(message.trim_start_matches("error: ")));
            return ExitCode::from(2);
        }
    };
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("mpc: {}", one_line(&e.to_string()));
            ExitCode::from(e.exit_code() as u8)
        }
    }
}

/// `s` with its control characters escaped (`\n`, `\t`, `\u{1b}`): a name holding a newline
/// cannot break an error into two lines.
fn one_line(s: &str) -> String {
    s.chars().map(|c| if c.is_control() { c.escape_default().to_string() } else { c.to_string() }).collect()
}

/// `--max-memory`'s value: bytes, or a count of K, M, G or T (powers of 1024, an optional `iB` or
/// `B` after the letter).
fn parse_size(text: &str) -> Result<u64, Error> {
    let t = text.trim();
    let t = t.strip_suffix("iB").or_else(|| t.strip_suffix('B')).unwrap_or(t);
    let (digits, shift) = match t.chars().last() {
        Some('K' | 'k') => (&t[..t.len() - 1], 10),
        Some('M' | 'm') => (&t[..t.len() - 1], 20),
        Some('G' | 'g') => (&t[..t.len() - 1], 30),
        Some('T' | 't') => (&t[..t.len() - 1], 40),
        _ => (t, 0),
    };
    digits
        .parse::<u64>()
        .ok()
        .and_then(|n| n.checked_mul(1u64 << shift))
        .filter(|&n| n > 0)
        .ok_or_else(|| Error::Usage(format!("--max-memory `{text}`: expected a size such as 512M or 16G")))
}

fn run(cli: Cli) -> Result<(), Error> {
    let common = match &cli.command {
        Command::Compile { common, .. }
        | Command::Train { common, .. }
        | Command::Inspect { common, .. }
        | Command::Run { common, .. }
        | Command::Bench { common, .. } => Some(common),
        Command::Devices => None,
    };
    if let Some(size) = common.and_then(|c| c.max_memory.as_deref()) {
        mpc_runtime::device::set_memory_limit(parse_size(size)?);
    }
    if common.is_some_and(|c| c.no_cuda_graph) {
        mpc_runtime::device::set_capture(false);
    }
    match cli.command {
        Command::Train {
            common,
            train_args,
            data,
            epochs,
            batch,
            eval_split,
            checkpoint,
            resume,
            max_steps,
            device,
            output,
            stats,
        } => {
            let kind = check_device(&device)?;
            if !(eval_split >= 0.0 && (eval_split < 1.0 || eval_split.fract() == 0.0)) {
                return Err(Error::Usage(format!("--eval-split {eval_split}: expected a share in [0, 1) or a count")));
            }
            let mut opts = common.options(Vec::new(), None)?;
            let (t, scale) = mpc::train_options(&train_args.settings(), common.config.as_deref())?;
            let t_seed = t.seed;
            opts.train = Some(t);
            opts.loss_scale = scale;
            let model = mpc::load(&common.model)?;
            let cfg = mpc::train::TrainConfig {
                data,
                epochs,
                batch,
                eval_split,
                seed: t_seed,
                checkpoint,
                resume,
                max_steps,
                progress: std::io::IsTerminal::is_terminal(&std::io::stderr()),
            };
            let mut report = |r: &mpc::train::EpochReport| {
                let mut line = format!("epoch {}: loss {:.4}", r.epoch, r.mean_loss);
                if let Some((acc, l)) = r.eval {
                    line.push_str(&format!(", eval loss {l:.4}, accuracy {:.2}%", acc * 100.0));
                }
                if let Some(s) = r.loss_scale {
                    line.push_str(&format!(", loss scale {s}"));
                }
                line.push_str(&format!(", skipped {}, {:.0} samples/s", r.skipped, r.samples_per_s));
                println!("{line}");
            };
            let trained = on_device!(kind, open => mpc::train::train_on(open()?, &model, &common.model, &opts, &cfg, &mut report)?);
            report_ties(&trained.ties);
            report_auto_scale(trained.auto_scale.clone());
            if let Some((acc, _)) = trained.epochs.last().and_then(|e| e.eval) {
                println!("test accuracy: {:.2}%", acc * 100.0);
            }
            if stats {
                eprintln!("mpc: training step: {}", trained.stats);
            }
            if let Some(o) = output {
                let g = mpc::train::with_trained_weights(&model, &trained.state, &trained.ties);
                mpc::save(&g, &o, Format::Onnx)?;
            }
            Ok(())
        }
        Command::Compile { common, output, emit, dump_after, stop_after, stats, train, train_args } => {
            let format = match (&emit, &output) {
                (Some(e), _) => Some(
                    Format::from_name(e)
                        .ok_or_else(|| Error::Usage(format!("unknown --emit format `{e}` (onnx, ir, dot, json)")))?,
                ),
                (None, Some(o)) => Some(Format::from_path(o).ok_or_else(|| {
                    Error::Usage(format!(
                        "{}: cannot tell the format from the extension; use .onnx, .mpcir, .dot, .json or --emit",
                        o.display()
                    ))
                })?),
                (None, None) => None,
            };
            let mut opts = common.options(dump_after, stop_after)?;
            if train {
                let (t, scale) = mpc::train_options(&train_args.settings(), common.config.as_deref())?;
                opts.train = Some(t);
                opts.loss_scale = scale;
            }
            let t0 = Instant::now();
            let mut g = mpc::load(&common.model)?;
            let t1 = Instant::now();
            let peak_after_load = mpc::peak_rss();
            let mut dump = |pass: &str, g: &mpc_ir::Graph| {
                let text = text::to_summary(g).unwrap_or_else(|e| format!("(cannot print: {e})\n"));
                eprint!("# after {pass}\n{text}");
            };
            let cx = mpc::compile(&mut g, &common.model, &opts, &mut dump)?;
            report_ties(&cx.ties);
            report_auto_scale(cx.auto_scale.clone());
            let t2 = Instant::now();
            match (output, format) {
                (Some(out), Some(f)) => mpc::save(&g, &out, f)?,
                (None, f) => {
                    let bytes = match f {
                        None | Some(Format::Ir) => text::to_summary(&g)
                            .map_err(|source| Error::Input { path: common.model.clone(), source })?
                            .into_bytes(),
                        Some(Format::Onnx) => return Err(Error::Usage("ONNX output needs -o FILE".into())),
                        Some(f) => mpc::render(&g, f, Path::new("-"))?.0,
                    };
                    std::io::stdout()
                        .write_all(&bytes)
                        .map_err(|source| Error::Output { path: "stdout".into(), source })?;
                }
                (Some(_), None) => {
                    unreachable!("a format is known whenever there is an output path")
                }
            }
            if stats {
                let t3 = Instant::now();
                let ms = |a: Instant, b: Instant| (b - a).as_secs_f64() * 1e3;
                let mib = |b: Option<u64>| {
                    b.map_or("unknown".into(), |b| format!("{:.1} MiB", b as f64 / (1u64 << 20) as f64))
                };
                let peak = mib(mpc::peak_rss());
                eprintln!("mpc:   peak memory after loading: {}", mib(peak_after_load));
                report_calibration(&cx);
                for (pass, run, verify) in cx.timings.borrow().iter() {
                    let ms = |d: &std::time::Duration| d.as_secs_f64() * 1e3;
                    eprintln!("mpc:   pass {pass}: {:.1} ms (+ {:.1} ms verifying)", ms(run), ms(verify));
                }
                eprintln!(
                    "mpc: load {:.1} ms, passes {:.1} ms, write {:.1} ms, total {:.1} ms, peak memory {peak}",
                    ms(t0, t1),
                    ms(t1, t2),
                    ms(t2, t3),
                    ms(t0, t3)
                );
            }
            // The process ends here: handing the memory back to the system is faster than
            // freeing every node (a large graph has millions of small allocations).
            std::mem::forget(g);
            Ok(())
        }
        Command::Bench { common, train, train_args, policies, batch, steps, warmup, device, json, profile } => {
            let kind = check_device(&device)?;
            let mut opts = common.options(Vec::new(), None)?;
            if train {
                let (t, scale) = mpc::train_options(&train_args.settings(), common.config.as_deref())?;
                opts.train = Some(t);
                opts.loss_scale = scale;
            }
            let list = policies.or(common.policy.clone()).unwrap_or_else(|| "fp32,mixed,mixed-bf16".into());
            let policies: Vec<String> = list.split(',').map(|p| p.trim().to_string()).collect();
            if let Some(p) = policies.iter().find(|p| !mpc::POLICIES.contains(&p.as_str())) {
                return Err(Error::Usage(format!("unknown policy `{p}` (fp32, mixed, mixed-bf16, fp16)")));
            }
            let cfg = mpc::bench::BenchConfig { policies, batch, warmup, steps, train, profile };
            let model = mpc::load(&common.model)?;
            let report = on_device!(kind, open => mpc::bench::bench(open, &model, &common.model, &opts, &cfg)?);
            if json {
                println!("{}", serde_json::to_string_pretty(&report).map_err(|e| Error::Usage(e.to_string()))?);
            } else {
                print!("{}", mpc::bench::table(&report));
            }
            Ok(())
        }
        Command::Devices => {
            let (lines, problem) = mpc::devices::report();
            for l in lines {
                println!("{l}");
            }
            match problem {
                Some(p) => Err(Error::Usage(p)),
                None => Ok(()),
            }
        }
        Command::Run { common, inputs, random_inputs, output, device, repeat, stats } => {
            let kind = check_device(&device)?;
            let opts = common.options(Vec::new(), None)?;
            let mut g = mpc::load(&common.model)?;
            let cx = mpc::compile(&mut g, &common.model, &opts, &mut |_, _| {})?;
            let feeds = match (inputs, random_inputs) {
                (Some(p), _) => mpc::run::read_safetensors(&p)?,
                (None, Some(seed)) => mpc::run::random_inputs(&g, seed, &opts.dims)
                    .map_err(|e| Error::Usage(format!("{}: {e}", common.model.display())))?,
                (None, None) => {
                    return Err(Error::Usage("give --inputs FILE.safetensors or --random-inputs SEED".into()))
                }
            };
            if stats {
                report_calibration(&cx);
            }
            let outs = on_device!(kind, open => run_on(open()?, &g, &feeds, &common.model, repeat, stats)?);
            for (name, t) in &outs {
                println!("{}", mpc::run::summary(name, t));
            }
            if let Some(o) = output {
                mpc::run::write_safetensors(&o, &outs)?;
            }
            Ok(())
        }
        Command::Inspect { common, explain, dot, memory, batch, ranges, json, train, plot, train_args } => {
            let mut opts = common.options(Vec::new(), None)?;
            if train && ranges.is_none() {
                if !memory {
                    return Err(Error::Usage("--train goes with --ranges or --memory".into()));
                }
                let (t, scale) = mpc::train_options(&train_args.settings(), common.config.as_deref())?;
                opts.train = Some(t);
                opts.loss_scale = scale;
            }
            let before = mpc::load(&common.model)?;
            let mut g = before.clone();
            let cx = mpc::compile(&mut g, &common.model, &opts, &mut |_, _| {})?;
            let perr = |source| Error::Pass { path: common.model.clone(), source };
            let ierr = |source| Error::Input { path: common.model.clone(), source };
            if let Some(b) = batch {
                for &v in g.inputs() {
                    let first_sym = g
                        .ty(v)
                        .shape
                        .as_ref()
                        .and_then(|s| s.dims().iter().find_map(|d| d.symbol().map(str::to_string)));
                    if let Some(s) = first_sym {
                        opts.dims.entry(s).or_insert(b);
                    }
                }
            }
            let out = if let Some(data) = ranges {
                let r = if train {
                    let (t, _) = mpc::train_options(&train_args.settings(), common.config.as_deref())?;
                    let (b, n) = (common.calibrate_batch, common.calibrate_batches);
                    mpc::ranges::measure_training(&before, &common.model, &data, &t, b, n)?
                } else {
                    mpc::ranges::measure(
                        &before,
                        &common.model,
                        &data,
                        common.calibrate_batch,
                        common.calibrate_batches,
                    )?
                };
                if let Some(out) = &common.ranges_out {
                    r.write(out)?;
                }
                if let (Some(file), Some(h)) = (&plot, r.gradient_histogram()) {
                    let name = common.model.file_name().map_or(String::new(), |n| n.to_string_lossy().into_owned());
                    mpc::ranges::plot(&h, &format!("{name}: activation gradients, {} samples", r.samples), file)?;
                }
                if json {
                    serde_json::to_string_pretty(&r).map_err(|e| Error::Usage(e.to_string()))? + "\n"
                } else if dot {
                    // The nodes computing a value at risk, and those calibration pinned.
                    let low = cx.policy.as_ref().map_or(mpc_ir::DType::F16, |p| p.low);
                    let mut marks = dot_marks(&cx);
                    for n in g.node_ids() {
                        for &v in g.node(n).outputs() {
                            let name = measured_name(g.name(v));
                            if let Some(why) = r.values.get(name).and_then(|r| r.harm(low)) {
                                marks.entry(n).or_insert(format!("at risk: {why}"));
                            }
                        }
                    }
                    mpc::dot::to_dot_marked(&g, &marks).map_err(ierr)?
                } else {
                    let low = cx.policy.as_ref().map_or(mpc_ir::DType::F16, |p| p.low);
                    // What the policy (without calibration) computes each value in.
                    let mut colours: HashMap<String, &'static str> = HashMap::new();
                    for (&n, (c, _)) in cx.report.borrow().iter().flat_map(|rep| rep.nodes.iter()) {
                        let what = if *c == mpc_passes::precision::Colour::Low { "low" } else { "in f32" };
                        for &v in g.node(n).outputs() {
                            let name = measured_name(g.name(v));
                            colours.insert(name.to_string(), what);
                        }
                    }
                    let mut text = mpc::ranges::report(&r, low, &colours);
                    if let Some(h) = r.gradient_histogram() {
                        text.push_str(&h.text());
                    }
                    text
                }
            } else if memory {
                let (p, used) = mpc::run::memory_plan(&g, &common.model, &opts.dims)?;
                mpc::run::memory_report(&p, &used)
            } else if dot {
                mpc::dot::to_dot_marked(&g, &dot_marks(&cx)).map_err(ierr)?
            } else {
                let mut out = text::to_summary(&g).map_err(ierr)?;
                out.push_str(&mpc::summary::summarize(&g, &opts.dims).map_err(perr)?);
                if explain {
                    let report = cx.report.borrow();
                    out.push_str(&mpc::explain::explain(&before, &g, report.as_ref(), &opts.dims).map_err(perr)?);
                }
                out
            };
            std::io::stdout()
                .write_all(out.as_bytes())
                .map_err(|source| Error::Output { path: "stdout".into(), source })
        }
    }
}

/// One line per tied weight, on stderr.
fn report_ties(ties: &[mpc_passes::train::Tie]) {
    for t in ties {
        let how = if t.transposed { "the transpose of" } else { "a copy of" };
        eprintln!("mpc: `{}` is {how} `{}`: trained as that one parameter (--no-tie keeps them apart)", t.copy, t.kept);
    }
}

/// `--stats`: what calibration cost.
fn report_calibration(cx: &mpc_passes::Context) {
    if let Some((t, samples, pinned)) = cx.calibration {
        eprintln!(
            "mpc:   calibration: one FP32 forward pass over {samples} samples, {:.1} ms; {pinned} values the low dtype breaks",
            t.as_secs_f64() * 1e3
        );
    }
}

/// `--loss-scale auto`: where dynamic scaling starts, why, and what measuring cost.
fn report_auto_scale(auto: Option<mpc_passes::AutoScale>) {
    if let Some(a) = auto {
        eprintln!(
            "mpc: --loss-scale auto: the gradients of one FP32 step over {} samples ({:.1} ms) call for 2^{}; dynamic scaling starts at {} ({:.2}% of the activation gradients below FP16's 2^-24)",
            a.samples,
            a.took.as_secs_f64() * 1e3,
            a.exp,
            a.init,
            100.0 * a.lost
        );
    }
}

/// The nodes calibration keeps in FP32, with the measurement, for the DOT picture.
fn dot_marks(cx: &mpc_passes::Context) -> std::collections::BTreeMap<mpc_ir::NodeId, String> {
    let report = cx.report.borrow();
    let nodes = report.iter().flat_map(|r| r.nodes.iter());
    nodes
        .filter_map(|(&n, (_, why))| match why {
            mpc_passes::precision::Reason::Measured(m) => Some((n, format!("calibration: {m}"))),
            _ => None,
        })
        .collect()
}

/// The name a value had when ranges were measured: a graph output computed low kept its name on
/// the cast back, and the value itself took a `.f16`/`.bf16` suffix.
fn measured_name(name: &str) -> &str {
    name.strip_suffix(".f16").or(name.strip_suffix(".bf16")).unwrap_or(name)
}
