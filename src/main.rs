//! The `mpc` command line.

// A graph is millions of small allocations; mimalloc handles them about twice as fast as the
// system allocator (measured on a 100k-node compile).
#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

use mpc_runtime::device::{Device, DeviceOptions};
use std::collections::HashMap;
use std::io::{ErrorKind, Write};
use std::path::Path;
use std::process::ExitCode;
use std::time::Instant;

use clap::Parser;
use mpc::{Error, Format};
use mpc_ir::text;

mod args;

use args::*;

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

fn open_cpu(options: DeviceOptions) -> Result<mpc_runtime::device::CpuDevice, Error> {
    Ok(mpc_runtime::device::CpuDevice::with_options(options))
}

/// The first GPU, or one line saying why there is none (no driver, no GPU, no NVRTC).
#[cfg(feature = "cuda")]
fn open_cuda(options: DeviceOptions) -> Result<mpc_runtime::cuda::device::CudaDevice, Error> {
    mpc_runtime::cuda::device::CudaDevice::with_options(0, options)
        .map_err(|e| Error::Usage(format!("--device cuda: {e}")))
}

/// How devices behave: `--max-memory`, `--no-cuda-graph`, and the environment's `MPC_*`
/// overrides (each turns one thing off, to tell one kind of kernel's fault from another's or to
/// measure what it is worth; `MPC_FMAD=1` turns contraction on), read here, once.
fn device_options(common: Option<&args::Common>) -> Result<DeviceOptions, Error> {
    let off = |name: &str| std::env::var(name).is_ok_and(|v| v == "0");
    let d = DeviceOptions::default();
    Ok(DeviceOptions {
        memory_limit: common.and_then(|c| c.max_memory.as_deref()).map(parse_size).transpose()?,
        capture: !common.is_some_and(|c| c.no_cuda_graph),
        fuse: d.fuse && !off("MPC_FUSE"),
        wide: d.wide && !off("MPC_WIDE"),
        relu_masks: d.relu_masks && !off("MPC_RELU_MASK"),
        fmad: d.fmad || std::env::var("MPC_FMAD").is_ok_and(|v| v == "1"),
        cublaslt: d.cublaslt && !off("MPC_CUBLASLT"),
        cudnn: d.cudnn && !off("MPC_CUDNN"),
        cudnn_deterministic: d.cudnn_deterministic && !off("MPC_CUDNN_DETERMINISTIC"),
        scratch_in_arena: d.scratch_in_arena && !off("MPC_SCRATCH_IN_ARENA"),
    })
}

/// Runs `$body` with `$open` bound to the factory of the device `$kind` names, opened with
/// `$options`.
macro_rules! on_device {
    ($kind:expr, $options:expr, $open:ident => $body:expr) => {
        match $kind {
            DeviceKind::Cpu => {
                let $open = || open_cpu($options);
                $body
            }
            #[cfg(feature = "cuda")]
            DeviceKind::Cuda => {
                let $open = || open_cuda($options);
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
        // The reader of the output closed it (`mpc inspect ... | head`): it has what it wanted.
        Err(Error::Output { path, source })
            if path == Path::new("stdout") && source.kind() == ErrorKind::BrokenPipe =>
        {
            ExitCode::SUCCESS
        }
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

/// `mpc train`: the options, the model, the run on its device, the report and the outputs.
fn train_command(t: TrainCmd, devices: DeviceOptions) -> Result<(), Error> {
    let TrainCmd {
        common,
        train_args,
        data,
        eval_data,
        epochs,
        batch,
        global_batch,
        eval_split,
        checkpoint,
        resume,
        log,
        plot,
        max_steps,
        device,
        output,
        stats,
        distributed,
        shard_optimizer,
        bucket_mb,
        collective_timeout,
    } = t;
    let kind = check_device(&device)?;
    // Kept to the end: MPI is finalised when it drops.
    let group = distributed.then(|| join_group(&device, collective_timeout)).transpose()?;
    let shard = group.as_ref().map_or(mpc::train::Shard::ALONE, |g| g.shard());
    let lead = shard.rank == 0;
    if !(eval_split >= 0.0 && (eval_split < 1.0 || eval_split.fract() == 0.0)) {
        return Err(Error::Usage(format!("--eval-split {eval_split}: expected a share in [0, 1) or a count")));
    }
    let mut opts = common.options(Vec::new(), None)?;
    let (mut t, scale) = mpc::train_options(&train_args.settings(), common.config.as_deref())?;
    let t_seed = t.seed;
    if !(bucket_mb >= 0.0 && bucket_mb.is_finite()) {
        return Err(Error::Usage(format!("--bucket-mb {bucket_mb}: expected a size in MiB, 0 or more")));
    }
    t.bucket_bytes = (bucket_mb * (1u64 << 20) as f64) as u64;
    if shard_optimizer && device != "cpu" {
        return Err(Error::Usage(format!(
            "--shard-optimizer --device {device}: the sharded optimizer state runs on the CPU device for now (the CUDA device has no collectives yet)"
        )));
    }
    if shard_optimizer {
        t.shard_state = Some(mpc_passes::train::StateShard { rank: shard.rank, world: shard.world });
    }
    opts.train = Some(t);
    opts.loss_scale = scale;
    let model = mpc::load(&common.model)?;
    let cfg = mpc::train::TrainConfig {
        data,
        eval_data,
        epochs,
        batch,
        global_batch,
        eval_split,
        seed: t_seed,
        checkpoint,
        resume,
        log: log.filter(|_| lead),
        plot: plot.filter(|_| lead),
        max_steps,
        progress: lead && std::io::IsTerminal::is_terminal(&std::io::stderr()),
        shard,
    };
    let mut report = |r: &mpc::train::EpochReport| {
        // A closed output does not stop the training (its checkpoints are its results).
        if lead {
            let _ = write_out(epoch_line(r));
        }
    };
    let trained = match &group {
        Some(g) => mpc::train::train_on(g.device(), &model, &common.model, &opts, &cfg, &mut report)?,
        None => {
            on_device!(kind, devices, open => mpc::train::train_on(open()?, &model, &common.model, &opts, &cfg, &mut report)?)
        }
    };
    if !lead {
        return Ok(());
    }
    report_ties(&trained.ties);
    report_folded(&trained.folded);
    report_auto_scale(trained.auto_scale.clone());
    if let Some((acc, _)) = trained.epochs.last().and_then(|e| e.eval) {
        write_out(format!("test accuracy: {:.2}%\n", acc * 100.0))?;
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

/// `--distributed`: this process's rank of the MPI run, its collectives timed out after
/// `timeout` seconds.
fn join_group(device: &str, timeout: f64) -> Result<mpc::distributed::Group, Error> {
    if !(timeout > 0.0 && timeout.is_finite()) {
        return Err(Error::Usage(format!("--collective-timeout {timeout}: expected a positive number of seconds")));
    }
    mpc::distributed::join(device, std::time::Duration::from_secs_f64(timeout))
}

/// The line `mpc train` prints after an epoch.
fn epoch_line(r: &mpc::train::EpochReport) -> String {
    let mut line = format!("epoch {}: loss {:.4}", r.epoch, r.mean_loss);
    if let Some((acc, l)) = r.eval {
        line.push_str(&format!(", eval loss {l:.4}, accuracy {:.2}%", acc * 100.0));
    }
    if let Some(s) = r.loss_scale {
        line.push_str(&format!(", loss scale {s}"));
    }
    line.push_str(&format!(", skipped {}, {} samples/s\n", r.skipped, mpc::train::rate(r.samples_per_s)));
    line
}

/// `mpc compile`.
fn compile_command(c: CompileCmd) -> Result<(), Error> {
    let CompileCmd { common, output, emit, dump_after, stop_after, stats, train, train_args } = c;
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
    // `--dim` sizes symbolic dims for the passes (an RNN over `seq` steps unrolls).
    if !opts.dims.is_empty() {
        g = mpc::summary::bind_symbols(&g, &opts.dims)
            .map_err(|source| Error::Pass { path: common.model.clone(), source })?;
    }
    let t1 = Instant::now();
    let peak_after_load = mpc::peak_rss();
    let mut dump = |pass: &str, g: &mpc_ir::Graph| {
        let text = text::to_summary(g).unwrap_or_else(|e| format!("(cannot print: {e})\n"));
        eprint!("# after {pass}\n{text}");
    };
    let cx = mpc::compile(&mut g, &common.model, &opts, &mut dump)?;
    report_ties(&cx.ties);
    report_folded(&cx.folded);
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
            write_out(&bytes)?;
        }
        (Some(_), None) => {
            unreachable!("a format is known whenever there is an output path")
        }
    }
    if stats {
        let t3 = Instant::now();
        let ms = |a: Instant, b: Instant| (b - a).as_secs_f64() * 1e3;
        let mib = |b: Option<u64>| b.map_or("unknown".into(), |b| format!("{:.1} MiB", b as f64 / (1u64 << 20) as f64));
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

/// `mpc inspect`.
fn inspect_command(c: InspectCmd, devices: DeviceOptions) -> Result<(), Error> {
    let InspectCmd { common, explain, dot, memory, launches, batch, ranges, json, train, plot, train_args } = c;
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
            let first_sym =
                g.ty(v).shape.as_ref().and_then(|s| s.dims().iter().find_map(|d| d.symbol().map(str::to_string)));
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
            mpc::ranges::measure(&before, &common.model, &data, common.calibrate_batch, common.calibrate_batches)?
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
        let caps = mpc_runtime::device::CpuDevice::with_options(devices).caps();
        let (p, used) = mpc::run::memory_plan_for(&g, &common.model, &opts.dims, caps)?;
        let mut out = mpc::run::memory_report(&p, &used);
        if launches {
            out.push_str(&mpc::run::launch_list(&p));
        }
        out
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
    write_out(&out)
}

/// `mpc run`.
fn run_command(c: RunCmd, devices: DeviceOptions) -> Result<(), Error> {
    let RunCmd { common, inputs, random_inputs, output, device, repeat, stats } = c;
    let kind = check_device(&device)?;
    let opts = common.options(Vec::new(), None)?;
    let model = mpc::load(&common.model)?;
    let given = inputs.map(|p| mpc::run::read_safetensors(&p)).transpose()?;
    if given.is_none() && random_inputs.is_none() {
        return Err(Error::Usage("give --inputs FILE.safetensors or --random-inputs SEED".into()));
    }
    // The symbolic dims but the batch bound first, from the inputs (or --dim), so that
    // the passes see them (an RNN over a sequence of `seq` steps unrolls once `seq` is
    // known); the batch is bound when the program is lowered.
    let dims = match &given {
        Some(f) => mpc::run::input_sizes(&model, f, &common.model)?,
        None => opts.dims.clone(),
    };
    let mut g = mpc::run::bind_sample_dims(&model, dims, &common.model)?;
    let cx = mpc::compile(&mut g, &common.model, &opts, &mut |_, _| {})?;
    let feeds = match (given, random_inputs) {
        (Some(f), _) => f,
        (None, seed) => mpc::run::random_inputs_within(&g, seed.unwrap_or_default(), &opts.dims, devices.memory())
            .map_err(|e| Error::Usage(format!("{}: {e}", common.model.display())))?,
    };
    if stats {
        report_calibration(&cx);
    }
    let outs = on_device!(kind, devices, open => run_on(open()?, &g, &feeds, &common.model, repeat, stats)?);
    for (name, t) in &outs {
        write_out(format!("{}\n", mpc::run::summary(name, t)))?;
    }
    if let Some(o) = output {
        mpc::run::write_safetensors(&o, &outs)?;
    }
    Ok(())
}

/// `mpc bench`.
fn bench_command(c: BenchCmd, devices: DeviceOptions) -> Result<(), Error> {
    let BenchCmd { common, train, train_args, policies, batch, steps, untimed, device, json, profile } = c;
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
    let cfg = mpc::bench::BenchConfig { policies, batch, warmup: untimed, steps, train, profile };
    let model = mpc::load(&common.model)?;
    let report = on_device!(kind, devices, open => mpc::bench::bench(open, &model, &common.model, &opts, &cfg)?);
    if json {
        write_out(serde_json::to_string_pretty(&report).map_err(|e| Error::Usage(e.to_string()))? + "\n")?;
    } else {
        write_out(mpc::bench::table(&report))?;
    }
    Ok(())
}

fn run(cli: Cli) -> Result<(), Error> {
    let common = match &cli.command {
        Command::Compile(CompileCmd { common, .. })
        | Command::Train(TrainCmd { common, .. })
        | Command::Inspect(InspectCmd { common, .. })
        | Command::Run(RunCmd { common, .. })
        | Command::Bench(BenchCmd { common, .. }) => Some(common),
        Command::Devices => None,
    };
    let devices = device_options(common)?;
    match cli.command {
        Command::Train(t) => train_command(t, devices),
        Command::Compile(c) => compile_command(c),
        Command::Bench(c) => bench_command(c, devices),
        Command::Devices => {
            let (lines, problem) = mpc::devices::report(&devices);
            for l in lines {
                write_out(format!("{l}\n"))?;
            }
            match problem {
                Some(p) => Err(Error::Usage(p)),
                None => Ok(()),
            }
        }
        Command::Run(c) => run_command(c, devices),
        Command::Inspect(c) => inspect_command(c, devices),
    }
}

/// Writes `text` to standard output: where it is closed, an error, not a panic.
fn write_out(text: impl AsRef<[u8]>) -> Result<(), Error> {
    std::io::stdout().write_all(text.as_ref()).map_err(|source| Error::Output { path: "stdout".into(), source })
}

/// One line per tied weight, on stderr.
fn report_ties(ties: &[mpc_passes::train::Tie]) {
    for t in ties {
        let how = if t.transposed { "the transpose of" } else { "a copy of" };
        eprintln!("mpc: `{}` is {how} `{}`: trained as that one parameter (--no-tie keeps them apart)", t.copy, t.kept);
    }
}

/// Constants trained in place of parameters the export folded into them.
fn report_folded(folded: &Option<(Vec<String>, Vec<String>)>) {
    if let Some((own, lost)) = folded {
        let list = |v: &[String]| v.iter().map(|s| format!("`{s}`")).collect::<Vec<_>>().join(", ");
        eprintln!(
            "mpc: the export folded the parameters {} into constants: {} train as weights of their own, and the trained model holds them so",
            list(lost),
            list(own)
        );
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
