//! mpc: a mixed-precision graph compiler. This crate ties the IR and the passes together into
//! the library calls behind the CLI: [`load`] a model, [`compile`] it with a policy, [`save`] it
//! in any of the output formats, and [`summary::summarize`] it for `mpc inspect`.

pub mod bench;
pub mod config;
pub mod data;
pub mod devices;
pub mod distributed;
pub mod dot;
pub mod explain;
pub mod plot;
pub mod ranges;
pub mod run;
pub mod summary;
pub mod synthetic;
pub mod train;
pub mod trainer;

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use mpc_ir::text::{self, TensorMode};
use mpc_ir::{Graph, IrError};
use mpc_passes::precision::{Class, Policy};
use mpc_passes::train::{LossScale, TrainOptions};
use mpc_passes::{Context, PassError, PassManager, Pipeline};

/// Everything that can go wrong, each naming the file it concerns.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{path}: {source}")]
    Input { path: PathBuf, source: IrError },
    #[error("{path}: {source}")]
    Pass { path: PathBuf, source: PassError },
    #[error("{path}: cannot write: {source}")]
    Output { path: PathBuf, source: std::io::Error },
    #[error("{path}: {source}")]
    Run { path: PathBuf, source: mpc_runtime::RuntimeError },
    #[error("{0}")]
    Usage(String),
}

impl Error {
    /// 2 for bad input or usage, 1 for mpc's own failures.
    pub fn exit_code(&self) -> i32 {
        match self {
            Error::Pass { source: PassError::Verify { .. }, .. } => 1,
            Error::Run { source: mpc_runtime::RuntimeError::Internal(_), .. } => 1,
            _ => 2,
        }
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Output formats.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    Onnx,
    Ir,
    Dot,
    Json,
}

impl Format {
    pub fn from_name(s: &str) -> Option<Format> {
        Some(match s {
            "onnx" => Format::Onnx,
            "ir" | "mpcir" => Format::Ir,
            "dot" => Format::Dot,
            "json" => Format::Json,
            _ => return None,
        })
    }

    pub fn from_path(p: &Path) -> Option<Format> {
        Format::from_name(p.extension()?.to_str()?)
    }
}

/// The sidecar file holding a text IR file's large tensors.
pub fn sidecar_path(p: &Path) -> PathBuf {
    let mut s = p.as_os_str().to_owned();
    s.push(".bin");
    PathBuf::from(s)
}

/// Loads an ONNX model or a text IR file (by extension, else by content).
pub fn load(path: &Path) -> Result<Graph> {
    let err = |source| Error::Input { path: path.to_owned(), source };
    if path.is_dir() {
        return Err(err(IrError::Invalid("is a directory, not a model".into())));
    }
    let bytes = read_shared(path).map_err(|e| err(e.into()))?;
    let is_text = Format::from_path(path) == Some(Format::Ir) || bytes.starts_with(b"mpcir");
    if is_text {
        let text =
            std::str::from_utf8(&bytes).map_err(|_| err(IrError::Parse { line: 0, msg: "not UTF-8 text".into() }))?;
        let side = std::fs::read(sidecar_path(path)).ok();
        text::parse(text, side.as_deref()).map_err(err)
    } else {
        mpc_ir::onnx::decode_onnx(bytes, path.parent()).map_err(err)
    }
}

/// A file's contents as shared bytes. Large files are mapped rather than read: their pages are the
/// file cache's own, so the weights are neither copied nor backed by fresh memory (on a ResNet-18,
/// zeroing fresh pages for a read buffer was most of the time of a whole compile).
fn read_shared(path: &Path) -> std::io::Result<bytes::Bytes> {
    let file = std::fs::File::open(path)?;
    let len = file.metadata()?.len();
    if len < 1 << 20 {
        return std::fs::read(path).map(bytes::Bytes::from);
    }
    // SAFETY: the map is read-only and lives as long as the tensors that share it. Changing or
    // truncating the model file while mpc runs would change what it reads (or fault), as with any
    // tool that maps its inputs.
    let map = unsafe { memmap2::Mmap::map(&file)? };
    Ok(bytes::Bytes::from_owner(map))
}

/// Compilation options.
#[derive(Clone, Debug, Default)]
pub struct Options {
    /// `fp32`, `mixed`, `mixed-bf16` or `fp16`; `None`: the config file's, else `fp32`.
    pub policy: Option<String>,
    /// A TOML policy file ([`config::PolicyFile`]).
    pub config: Option<PathBuf>,
    pub allow: Vec<String>,
    pub deny: Vec<String>,
    pub pin_fp32: Vec<String>,
    /// `--io-types low`: graph inputs and outputs in the low dtype.
    pub io_low: bool,
    /// `--fused-attention`: attention chains in the low dtype as one `ai.mpc::Attention` node.
    pub fused_attention: bool,
    pub dims: HashMap<String, u64>,
    pub dump_after: Vec<String>,
    pub stop_after: Option<String>,
    /// Build the training step (`--train`) with these options.
    pub train: Option<TrainOptions>,
    /// `--loss-scale`; `None`: dynamic for `mixed`, none otherwise.
    pub loss_scale: Option<LossScale>,
    /// `--calibrate DATA` / `--ranges-in FILE`: measured ranges pin the values the low dtype
    /// breaks to FP32.
    pub calibrate: Option<ranges::Calibration>,
}

/// The policy names.
pub const POLICIES: [&str; 4] = ["fp32", "mixed", "mixed-bf16", "fp16"];

/// The training options: `flags` (the command line's) over the `[train]` table of the config
/// file, over the defaults; and the loss scaling when one is asked for.
pub fn train_options(flags: &config::TrainFile, config: Option<&Path>) -> Result<(TrainOptions, Option<LossScale>)> {
    let file = match config {
        Some(p) => read_config(p)?.train,
        None => config::TrainFile::default(),
    };
    // A bad flag is named as the flag; a bad setting the flags leave to the file, as the file's.
    flags.resolve().map_err(|e| Error::Usage(format!("--{}", e.replacen('_', "-", 1))))?;
    flags.over(&file).resolve().map_err(|e| {
        Error::Usage(format!("{} [train]: {e}", config.map_or_else(String::new, |p| p.display().to_string())))
    })
}

fn read_config(p: &Path) -> Result<config::PolicyFile> {
    let text = std::fs::read_to_string(p).map_err(|e| Error::Usage(format!("{}: {e}", p.display())))?;
    config::PolicyFile::parse(&text).map_err(|e| Error::Usage(format!("{}: {e}", p.display())))
}

/// Resolves the options into a policy (`None` for fp32): `--policy` over the config file's,
/// then the file's edits, then `--allow`, `--deny`, `--pin-fp32`.
pub fn policy(opts: &Options) -> Result<Option<Policy>> {
    let file = opts.config.as_deref().map(read_config).transpose()?;
    let name =
        opts.policy.clone().or_else(|| file.as_ref().and_then(|f| f.policy.clone())).unwrap_or_else(|| "fp32".into());
    let mut policy =
        match Policy::named(&name).map_err(Error::Usage)? {
            Some(p) => p,
            None if opts.fused_attention => return Err(Error::Usage(
                "policy fp32 rewrites nothing: --fused-attention fuses f16 or bf16 attention, under --policy mixed, \
                 mixed-bf16 or fp16"
                    .into(),
            )),
            None if file.as_ref().is_some_and(|f| f.edits_policy())
                || !opts.allow.is_empty()
                || !opts.deny.is_empty()
                || !opts.pin_fp32.is_empty()
                || opts.io_low =>
            {
                return Err(Error::Usage(
                    "policy fp32 rewrites nothing: list edits need --policy mixed, mixed-bf16 or fp16".into(),
                ))
            }
            None => return Ok(None),
        };
    if let (Some(f), Some(p)) = (&file, &opts.config) {
        f.apply(&mut policy).map_err(|e| Error::Usage(format!("{}: {e}", p.display())))?;
    }
    for (ops, class, flag) in [(&opts.allow, Class::Low, "--allow"), (&opts.deny, Class::F32, "--deny")] {
        for op in ops {
            policy.set_class(op, class).map_err(|e| Error::Usage(format!("{flag}: {e}")))?;
        }
    }
    policy.pin_fp32.extend(opts.pin_fp32.iter().cloned());
    policy.io_low |= opts.io_low;
    policy.fused_attention |= opts.fused_attention;
    Ok(Some(policy))
}

/// Runs the pipeline of the options' policy on `g`; `dump` receives the graph after each pass
/// asked for. Returns the context, which holds the precision pass's report.
pub fn compile(g: &mut Graph, path: &Path, opts: &Options, dump: &mut dyn FnMut(&str, &Graph)) -> Result<Context> {
    let mut policy = policy(opts)?;
    let perr = |source| Error::Pass { path: path.to_owned(), source };
    let train = opts.train.clone().map(|mut t| {
        t.loss_scale =
            opts.loss_scale.clone().unwrap_or_else(|| mpc_passes::train::default_loss_scale(policy.as_ref(), &t));
        t
    });
    let mut train = train;
    let mut auto_scale = None;
    if let Some(t) = train.as_mut() {
        if let LossScale::Auto { attrs } = &t.loss_scale {
            // The activation gradients of one FP32 step at scale 1 say where scaling should start.
            let data = opts.calibrate.as_ref().and_then(|c| c.data.as_ref().map(|d| (c, d))).ok_or_else(|| {
                Error::Usage(
                    "--loss-scale auto needs --calibrate DATA: samples, with their labels, to measure gradients on"
                        .into(),
                )
            })?;
            let t0 = std::time::Instant::now();
            let r = ranges::measure_training(g, path, data.1, t, data.0.batch, data.0.batches)?;
            let h = r.gradient_histogram().ok_or_else(|| Error::Usage("no activation gradients to measure".into()))?;
            let k = h.auto_scale();
            let init = 2f32.powi(k).clamp(attrs.min_scale, attrs.max_scale);
            auto_scale = Some(mpc_passes::AutoScale {
                exp: k,
                init,
                lost: h.lost_at(init.log2() as i32),
                samples: r.samples,
                took: t0.elapsed(),
            });
            t.loss_scale = LossScale::Dynamic { init, attrs: attrs.clone() };
        }
    }
    let mut calibration = None;
    if let (Some(c), Some(p)) = (&opts.calibrate, policy.as_mut()) {
        // Measured on the forward model as given, before any training pass.
        let t0 = std::time::Instant::now();
        let ranges = ranges::calibrate(g, path, c)?;
        for (name, _, why) in ranges.at_risk(p.low) {
            p.measured.insert(name.to_string(), why);
        }
        calibration = Some((t0.elapsed(), ranges.samples, p.measured.len()));
    }
    let mut ties = Vec::new();
    if let Some(t) = train.as_ref().filter(|t| t.tie) {
        let candidates = mpc_passes::train::tie_candidates(g, &t.freeze);
        ties = mpc_passes::train::tie_weights(g, &candidates);
    }
    let folded =
        train.as_ref().and_then(|t| mpc_passes::train::folded_weights(g, &mpc_passes::train::trainable(g, &t.freeze)));
    if let (Some(t), Some(p)) = (&train, policy.as_mut()) {
        p.masters = mpc_passes::train::masters(g, p, &t.freeze);
    }
    let pipeline = if train.is_some() { Pipeline::Training } else { Pipeline::Inference };
    let mut pm = PassManager::pipeline(pipeline);
    for d in &opts.dump_after {
        pm = pm.dump_after(d).map_err(perr)?;
    }
    if let Some(s) = &opts.stop_after {
        pm = pm.stop_after(s).map_err(perr)?;
    }
    let cx =
        Context { dims: opts.dims.clone(), policy, train, ties, folded, calibration, auto_scale, ..Default::default() };
    pm.run(g, &cx, dump).map_err(perr)?;
    Ok(cx)
}

/// Renders `g` in `format`. Text IR comes with its sidecar bytes (empty when all is inline).
pub fn render(g: &Graph, format: Format, path: &Path) -> Result<(Vec<u8>, Vec<u8>)> {
    let err = |source| Error::Input { path: path.to_owned(), source };
    Ok(match format {
        Format::Onnx => (mpc_ir::onnx::encode_onnx(g).map_err(err)?, Vec::new()),
        Format::Ir => {
            let p = text::print(g, TensorMode::FILE).map_err(err)?;
            (p.text.into_bytes(), p.sidecar)
        }
        Format::Dot => (dot::to_dot(g).map_err(err)?.into_bytes(), Vec::new()),
        Format::Json => (summary::to_json(g).map_err(err)?.into_bytes(), Vec::new()),
    })
}

/// Writes `g` to `out` atomically (temporary file + rename): on any error nothing is left behind.
pub fn save(g: &Graph, out: &Path, format: Format) -> Result<()> {
    if format == Format::Onnx {
        return write_atomic_with(out, |f| {
            mpc_ir::onnx::write_onnx(g, f).map_err(|e| match e {
                IrError::Io(source) => Error::Output { path: out.to_owned(), source },
                source => Error::Input { path: out.to_owned(), source },
            })
        });
    }
    let (main, side) = render(g, format, out)?;
    let side_path = sidecar_path(out);
    if format == Format::Ir && !side.is_empty() {
        write_atomic(&side_path, &side)?;
    } else if format == Format::Ir && side_path.is_file() {
        // A stale sidecar from an earlier run would be misleading next to an all-inline file.
        std::fs::remove_file(&side_path).map_err(|source| Error::Output { path: side_path, source })?;
    }
    write_atomic(out, &main)
}

/// Writes `data` to a temporary file beside `path`, then renames it into place.
pub fn write_atomic(path: &Path, data: &[u8]) -> Result<()> {
    use std::io::Write;
    write_atomic_with(path, |f| f.write_all(data).map_err(|source| Error::Output { path: path.to_owned(), source }))
}

/// Lets `write` fill a temporary file beside `path`, then renames it into place; on any error
/// the temporary file is removed and `path` is left as it was.
pub fn write_atomic_with(path: &Path, write: impl FnOnce(&mut std::fs::File) -> Result<()>) -> Result<()> {
    use std::io::Write;
    let err = |source| Error::Output { path: path.to_owned(), source };
    // Only a regular file is replaced: not a directory, a symlink (nor what it points to), a
    // device node or a FIFO.
    if let Ok(m) = std::fs::symlink_metadata(path) {
        let kind = m.file_type();
        if !kind.is_file() {
            let what = if kind.is_dir() {
                "is a directory"
            } else if kind.is_symlink() {
                "is a symbolic link; mpc replaces only regular files"
            } else {
                "is not a regular file (a device or a FIFO); mpc replaces only regular files"
            };
            return Err(err(std::io::Error::other(what)));
        }
    }
    let name = path.file_name().ok_or_else(|| err(std::io::Error::other("no file name")))?;
    let mut prefix = std::ffi::OsString::from(".");
    prefix.push(name);
    prefix.push(".tmp");
    remove_stale_temporaries(path, &prefix);
    let mut tmp_name = prefix;
    tmp_name.push(std::process::id().to_string());
    let tmp = path.with_file_name(tmp_name);
    let mut f = std::fs::File::create(&tmp).map_err(err)?;
    let result =
        write(&mut f).and_then(|()| f.flush().map_err(err)).and_then(|()| std::fs::rename(&tmp, path).map_err(err));
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

/// Removes the temporary files (`prefix` + a process id) that writers of `path` killed before
/// their rename left beside it. A file whose process still runs (on Linux, `/proc/PID` exists) is
/// another writer's, and is left alone; elsewhere nothing is removed.
fn remove_stale_temporaries(path: &Path, prefix: &std::ffi::OsStr) {
    if !Path::new("/proc/self").exists() {
        return;
    }
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    let prefix = prefix.to_string_lossy();
    for e in entries.flatten() {
        let name = e.file_name();
        let name = name.to_string_lossy();
        let Some(pid) = name.strip_prefix(prefix.as_ref()).and_then(|p| p.parse::<u32>().ok()) else { continue };
        let own = pid == std::process::id();
        if !own && !Path::new(&format!("/proc/{pid}")).exists() && e.file_type().is_ok_and(|t| t.is_file()) {
            let _ = std::fs::remove_file(e.path());
        }
    }
}

/// The process's peak resident memory in bytes (Linux), for `--stats`.
pub fn peak_rss() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}
