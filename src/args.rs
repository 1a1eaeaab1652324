//! The command line's arguments: the subcommands and the options they share (clap).

use std::path::PathBuf;

use clap::{Parser, Subcommand};
use mpc::{Error, Options};

use super::parse_dims;

#[derive(Parser)]
#[command(name = "mpc", version, about = "A mixed-precision graph compiler for ONNX models")]
pub(crate) struct Cli {
    #[command(subcommand)]
    pub(crate) command: Command,
}

#[derive(clap::Args)]
pub(crate) struct Common {
    /// The model: an .onnx file or mpc text IR (.mpcir).
    pub(crate) model: PathBuf,
    /// Precision policy: fp32 (no rewrite; the default), mixed (FP16), mixed-bf16, fp16 (everything FP16).
    #[arg(long)]
    pub(crate) policy: Option<String>,
    /// A TOML policy file: base policy, low dtype, list edits, pinned nodes.
    #[arg(long, value_name = "FILE")]
    pub(crate) config: Option<PathBuf>,
    /// Run this op type in low precision (repeatable).
    #[arg(long, value_name = "OP")]
    pub(crate) allow: Vec<String>,
    /// Keep this op type in FP32 (repeatable).
    #[arg(long, value_name = "OP")]
    pub(crate) deny: Vec<String>,
    /// Keep the node with this name in FP32 (repeatable).
    #[arg(long, value_name = "NODE")]
    pub(crate) pin_fp32: Vec<String>,
    /// Graph input and output dtypes: keep (default) or low.
    #[arg(long, value_name = "keep|low", default_value = "keep")]
    pub(crate) io_types: String,
    /// Run each attention chain whose products the policy makes f16 or bf16 (MatMul, scale, mask,
    /// Softmax, MatMul) as one fused ai.mpc::Attention node, which keeps no probabilities for the
    /// backward pass (on CUDA: flash-attention kernels on the tensor cores, head dims up to 128).
    #[arg(long)]
    pub(crate) fused_attention: bool,
    /// Size of a symbolic dim, as NAME=N (repeatable), e.g. --dim batch=64.
    #[arg(long = "dim", value_name = "NAME=N")]
    pub(crate) dims: Vec<String>,
    /// Measure every value's range on these sample inputs (safetensors, named after the graph
    /// inputs) in FP32 first, and keep in FP32 the nodes whose outputs the low dtype would break
    /// (an overflow, or more than 1% of the non-zeros flushed to zero).
    #[arg(long, value_name = "DATA")]
    pub(crate) calibrate: Option<PathBuf>,
    /// Calibrate with ranges saved by --ranges-out instead of measuring.
    #[arg(long, value_name = "FILE", conflicts_with = "calibrate")]
    pub(crate) ranges_in: Option<PathBuf>,
    /// Save the measured ranges (JSON) for --ranges-in.
    #[arg(long, value_name = "FILE")]
    pub(crate) ranges_out: Option<PathBuf>,
    /// Batches of the calibration data to measure, and samples per batch.
    #[arg(long, value_name = "N", default_value_t = 8)]
    pub(crate) calibrate_batches: usize,
    #[arg(long, value_name = "N", default_value_t = 32)]
    pub(crate) calibrate_batch: usize,
    /// The most memory one lowered program may hold (activations, weights, training state), as
    /// bytes or with a K, M, G or T suffix (powers of 1024); the default is the machine's memory.
    /// A larger program is refused before anything is allocated.
    #[arg(long, value_name = "SIZE")]
    pub(crate) max_memory: Option<String>,
    /// With --device cuda: launch every kernel of every step instead of recording the second
    /// step as a CUDA graph and replaying it (the results are the same bits).
    #[arg(long)]
    pub(crate) no_cuda_graph: bool,
}

impl Common {
    pub(crate) fn options(&self, dump_after: Vec<String>, stop_after: Option<String>) -> Result<Options, Error> {
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
            fused_attention: self.fused_attention,
            dims: parse_dims(&self.dims)?,
            dump_after,
            stop_after,
            train: None,
            loss_scale: None,
            calibrate: self.calibration(),
        })
    }

    pub(crate) fn calibration(&self) -> Option<mpc::ranges::Calibration> {
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
pub(crate) struct TrainArgs {
    /// The loss: cross-entropy (on the first output, against integer labels; the default), mse, or
    /// output:NAME (the model computes its own scalar loss). Cross-entropy takes the classes on
    /// axis 1 and skips labels of -100; `cross-entropy:axis=-1` is a language model's loss over
    /// [batch, tokens, vocabulary] scores, `ignore-index=N|none` sets the skipped label.
    #[arg(long)]
    pub(crate) loss: Option<String>,
    /// Name of the labels (or targets) input the loss adds [default: labels].
    #[arg(long)]
    pub(crate) labels: Option<String>,
    /// sgd, momentum, adam (the default) or adamw.
    #[arg(long)]
    pub(crate) optimizer: Option<String>,
    /// Learning rate [default: 0.001].
    #[arg(long)]
    pub(crate) lr: Option<f32>,
    /// How the learning rate moves, computed on the device from the count of applied updates:
    /// constant (the default), linear or cosine (decay to --lr-min at the run's end), step[:size=N,
    /// gamma=G] (×G every N updates; N 1, G 0.1 by default) or one-cycle[:div=D] (from lr/D up to
    /// lr over --warmup, then down to --lr-min, by default lr/(D·10⁴); D 25), as PyTorch's and
    /// Hugging Face's schedulers of those names.
    #[arg(long, value_name = "CURVE")]
    pub(crate) schedule: Option<String>,
    /// Updates of linear warmup from 0 before the schedule (one-cycle: of its rise); below 1, a share
    /// of the run's updates (rounded up) [default: 0].
    #[arg(long, value_name = "N")]
    pub(crate) warmup: Option<f64>,
    /// The learning rate a linear, cosine or one-cycle schedule ends at [default: 0].
    #[arg(long, value_name = "LR")]
    pub(crate) lr_min: Option<f32>,
    /// The run's length in updates for a schedule (`mpc train` counts it from the data, epochs and
    /// --max-steps; `mpc compile --train` needs it for a schedule that decays).
    #[arg(long, value_name = "N")]
    pub(crate) total_steps: Option<u64>,
    /// Weight decay [default: 0].
    #[arg(long)]
    pub(crate) weight_decay: Option<f32>,
    /// Momentum of the momentum optimizer [default: 0.9].
    #[arg(long)]
    pub(crate) momentum: Option<f32>,
    /// Clip the gradients' global norm (after unscaling) to this.
    #[arg(long, value_name = "NORM")]
    pub(crate) clip_norm: Option<f32>,
    /// dynamic, auto (dynamic, starting where gradients measured on --calibrate DATA say), static:S
    /// or none (default: dynamic for mixed, none otherwise).
    #[arg(long, value_name = "MODE")]
    pub(crate) loss_scale: Option<String>,
    /// Train these parameters without weight decay: `biases`, `norms` (normalisation scales and
    /// biases), or name patterns with `*` (comma-separated or repeated).
    #[arg(long, value_name = "biases,norms,PATTERN")]
    pub(crate) no_decay: Vec<String>,
    /// Sum the gradients of N micro-batches (of --batch samples each) in FP32 and update once with
    /// their mean, as PyTorch's gradient accumulation; a non-finite gradient in any of them skips
    /// that update [default: 1].
    #[arg(long, value_name = "N")]
    pub(crate) accumulate: Option<u32>,
    /// Do not train this initializer (repeatable).
    #[arg(long, value_name = "NAME")]
    pub(crate) freeze: Vec<String>,
    /// Seed of the random streams: the dropout masks and, for `train`, the sample order [default: 0].
    #[arg(long)]
    pub(crate) seed: Option<u64>,
    /// Train initializers that are copies or transposes of one another (an exported tied LM head)
    /// as separate parameters, not as one.
    #[arg(long)]
    pub(crate) no_tie: bool,
    /// Cast each FP32 master weight to the low dtype in every step, instead of keeping its low
    /// copy as training state that the optimizer update writes: less memory (a copy lives only
    /// from its forward use to its last backward use), one more launch and more traffic per weight.
    #[arg(long)]
    pub(crate) no_weight_copies: bool,
}

impl TrainArgs {
    pub(crate) fn settings(&self) -> mpc::config::TrainFile {
        mpc::config::TrainFile {
            loss: self.loss.clone(),
            labels: self.labels.clone(),
            optimizer: self.optimizer.clone(),
            lr: self.lr,
            schedule: self.schedule.clone(),
            warmup: self.warmup,
            lr_min: self.lr_min,
            total_steps: self.total_steps,
            weight_decay: self.weight_decay,
            momentum: self.momentum,
            clip_norm: self.clip_norm,
            loss_scale: self.loss_scale.clone(),
            freeze: self.freeze.clone(),
            no_decay: self.no_decay.clone(),
            accumulate: self.accumulate,
            seed: self.seed,
            tie: self.no_tie.then_some(false),
            weight_copies: self.no_weight_copies.then_some(false),
            ..Default::default()
        }
    }
}

#[derive(Subcommand)]
pub(crate) enum Command {
    /// Rewrite a model and write it as ONNX, text IR, Graphviz or JSON.
    Compile(CompileCmd),
    /// Compile the training step and train on a data file; print per-epoch loss and accuracy.
    Train(TrainCmd),
    /// Show a model as text IR with a summary: op counts, parameters, estimated FLOPs.
    Inspect(InspectCmd),
    /// Compile with a policy and run on a backend; print a summary of each output.
    Run(RunCmd),
    /// Time a model's step under each policy on a device: median step time, samples/s, TFLOP/s
    /// and its share of the device's measured matrix-product rate, memory, compile time, launches.
    Bench(BenchCmd),
    /// List the CPU and the GPUs mpc can use, with the CUDA libraries it finds, or say why none.
    Devices,
}

/// `mpc train`'s arguments.
#[derive(clap::Args)]
pub(crate) struct TrainCmd {
    #[command(flatten)]
    pub(crate) common: Common,
    #[command(flatten)]
    pub(crate) train_args: TrainArgs,
    /// Training data (safetensors): tensors named after the graph inputs and the labels,
    /// the first dimension being the sample. Several shards: repeat the flag, or a pattern
    /// (`shards/train-*.safetensors`); each is memory-mapped and read a batch at a time.
    #[arg(long, value_name = "FILE", required = true)]
    pub(crate) data: Vec<PathBuf>,
    /// A separate evaluation set (shards, as --data), evaluated after each epoch.
    #[arg(long, value_name = "FILE")]
    pub(crate) eval_data: Vec<PathBuf>,
    #[arg(long, default_value_t = 1)]
    pub(crate) epochs: usize,
    /// Samples per step (per rank in a data-parallel run).
    #[arg(long, default_value_t = 64)]
    pub(crate) batch: usize,
    /// Samples per update over all ranks (in place of --batch × ranks): each rank steps on
    /// N / ranks, so a run resumes at the same global batch on another number of ranks.
    #[arg(long, value_name = "N")]
    pub(crate) global_batch: Option<usize>,
    /// Hold out the last samples for evaluation after each epoch: a share (below 1) or a count.
    #[arg(long, value_name = "F|N", default_value_t = 0.0)]
    pub(crate) eval_split: f64,
    /// Write DIR/checkpoint.safetensors after each epoch.
    #[arg(long, value_name = "DIR")]
    pub(crate) checkpoint: Option<PathBuf>,
    /// Continue from the checkpoint in --checkpoint DIR.
    #[arg(long)]
    pub(crate) resume: bool,
    /// Write one JSON line per step (step, epoch, loss, lr, loss_scale, skipped,
    /// samples_per_s) and one per evaluation (step, epoch, eval_loss, eval_accuracy).
    #[arg(long, value_name = "FILE.jsonl")]
    pub(crate) log: Option<PathBuf>,
    /// Draw the training and evaluation loss and the learning rate against the step (SVG)
    /// when the run ends.
    #[arg(long, value_name = "FILE.svg")]
    pub(crate) plot: Option<PathBuf>,
    /// Stop after this many steps in all (a run can be resumed later).
    #[arg(long, value_name = "N")]
    pub(crate) max_steps: Option<usize>,
    /// The device: cpu, or cuda (the first GPU).
    #[arg(long, default_value = "cpu")]
    pub(crate) device: String,
    /// Write the model with the trained weights (ONNX, ready for inference).
    #[arg(short, long)]
    pub(crate) output: Option<PathBuf>,
    /// Print what the training step costs: arena, state and constants bytes, launches per
    /// step, allocations inside steps after the first, host reads per step.
    #[arg(long)]
    pub(crate) stats: bool,
    /// Train data-parallel, one rank per process of `mpiexec -n N mpc train ...` (an mpc built
    /// with `--features mpi`): --batch is per rank, the gradients are averaged over the ranks,
    /// rank 0 prints, logs, checkpoints and writes the output.
    #[arg(long)]
    pub(crate) distributed: bool,
    /// Shard the optimizer state over the ranks (ZeRO stage 1): each rank keeps its block of
    /// every master weight, moment and low-precision copy, the weights gathered at each step's
    /// start and the gradients reduce-scattered.
    #[arg(long)]
    pub(crate) shard_optimizer: bool,
    /// With --distributed: all-reduce the gradients together in buckets of at most this many
    /// MiB (0: one all-reduce per gradient).
    #[arg(long, value_name = "MIB", default_value_t = 25.0)]
    pub(crate) bucket_mb: f64,
    /// With --distributed: a collective that waits longer than this for the other ranks (one
    /// died, or hangs) ends the run with one line naming the rank and the step.
    #[arg(long, value_name = "SECONDS", default_value_t = 300.0)]
    pub(crate) collective_timeout: f64,
}

/// `mpc compile`'s arguments.
#[derive(clap::Args)]
pub(crate) struct CompileCmd {
    #[command(flatten)]
    pub(crate) common: Common,
    /// Output file; the format follows its extension (.onnx, .mpcir, .dot, .json).
    /// Without it, the text IR goes to stdout.
    #[arg(short, long)]
    pub(crate) output: Option<PathBuf>,
    /// Output format, overriding the extension: onnx, ir, dot, json.
    #[arg(long)]
    pub(crate) emit: Option<String>,
    /// Print the text IR after this pass to stderr (repeatable).
    #[arg(long, value_name = "PASS")]
    pub(crate) dump_after: Vec<String>,
    /// Stop the pipeline after this pass.
    #[arg(long, value_name = "PASS")]
    pub(crate) stop_after: Option<String>,
    /// Print timings and peak memory to stderr.
    #[arg(long)]
    pub(crate) stats: bool,
    /// Build the whole training step: loss, backward graph, optimizer, loss scaling.
    #[arg(long)]
    pub(crate) train: bool,
    #[command(flatten)]
    pub(crate) train_args: TrainArgs,
}

/// `mpc inspect`'s arguments.
#[derive(clap::Args)]
pub(crate) struct InspectCmd {
    #[command(flatten)]
    pub(crate) common: Common,
    /// Say, for every node, which precision it got and which rule or neighbour decided it.
    #[arg(long)]
    pub(crate) explain: bool,
    /// Print the graph as Graphviz, coloured by precision, instead of text.
    #[arg(long)]
    pub(crate) dot: bool,
    /// Print the memory plan's peak bytes (weights, activations) for the policy.
    #[arg(long)]
    pub(crate) memory: bool,
    /// With --memory: list every launch of the step in order, with the bytes it moves at the
    /// least, its matrix-product FLOPs and its outputs.
    #[arg(long, requires = "memory")]
    pub(crate) launches: bool,
    /// Batch size for --memory (binds the first symbolic dim of each input; --dim for others).
    #[arg(long)]
    pub(crate) batch: Option<u64>,
    /// Run the FP32 model on these sample inputs and report, for every float value, what the
    /// policy's low dtype (FP16 unless --policy mixed-bf16) would flush or overflow; the values
    /// at risk first. Batches as --calibrate-batches and --calibrate-batch say.
    #[arg(long, value_name = "DATA")]
    pub(crate) ranges: Option<PathBuf>,
    /// With --ranges: print every value's measurements as JSON.
    #[arg(long, requires = "ranges")]
    pub(crate) json: bool,
    /// With --ranges: measure the training step too (FP32, loss scale 1, the data holding the
    /// labels) and print the histogram of log2 |activation gradient| with the loss scales that
    /// lose nothing and overflow nothing. With --memory: the plan of the training step (the
    /// training options) instead of inference's.
    #[arg(long)]
    pub(crate) train: bool,
    /// With --ranges --train: draw the activation-gradient histogram to this SVG file.
    #[arg(long, value_name = "FILE.svg", requires_all = ["train", "ranges"])]
    pub(crate) plot: Option<PathBuf>,
    #[command(flatten)]
    pub(crate) train_args: TrainArgs,
}

/// `mpc run`'s arguments.
#[derive(clap::Args)]
pub(crate) struct RunCmd {
    #[command(flatten)]
    pub(crate) common: Common,
    /// Inputs as a safetensors file, tensors named after the graph inputs.
    #[arg(long, value_name = "FILE", conflicts_with = "random_inputs")]
    pub(crate) inputs: Option<PathBuf>,
    /// Random inputs from this seed (floats N(0,1), integers in [0,2)); --dim sizes symbolic dims.
    #[arg(long, value_name = "SEED")]
    pub(crate) random_inputs: Option<u64>,
    /// Where to write the outputs (safetensors, keyed by graph output name).
    #[arg(short, long)]
    pub(crate) output: Option<PathBuf>,
    /// The device: cpu, or cuda (the first GPU).
    #[arg(long, default_value = "cpu")]
    pub(crate) device: String,
    /// Run this many more times after a warm-up run and print the median time per run.
    #[arg(long, value_name = "N")]
    pub(crate) repeat: Option<usize>,
    /// Print what the lowered program costs: arena and persistent bytes, launches per step,
    /// allocations inside steps after the first, host reads per step.
    #[arg(long)]
    pub(crate) stats: bool,
}

/// `mpc bench`'s arguments.
#[derive(clap::Args)]
pub(crate) struct BenchCmd {
    #[command(flatten)]
    pub(crate) common: Common,
    /// Time the training step (with the training options) instead of inference.
    #[arg(long)]
    pub(crate) train: bool,
    #[command(flatten)]
    pub(crate) train_args: TrainArgs,
    /// The policies to compare, comma-separated (the default: fp32,mixed,mixed-bf16);
    /// --policy also takes such a list here.
    #[arg(long, value_name = "P,P,...")]
    pub(crate) policies: Option<String>,
    /// Binds the first symbolic dim of each input.
    #[arg(long, default_value_t = 64)]
    pub(crate) batch: u64,
    /// Steps timed after the warm-up.
    #[arg(long, default_value_t = 20)]
    pub(crate) steps: usize,
    /// Steps run before the timed ones (warm-up: first-use costs, caches, clocks).
    #[arg(long, value_name = "N", default_value_t = 3)]
    pub(crate) untimed: usize,
    /// The device: cpu, or cuda (the first GPU).
    #[arg(long, default_value = "cpu")]
    pub(crate) device: String,
    /// Print the report as JSON.
    #[arg(long)]
    pub(crate) json: bool,
    /// After the timed steps, time each launch of one more step and report the time by op.
    #[arg(long)]
    pub(crate) profile: bool,
}
