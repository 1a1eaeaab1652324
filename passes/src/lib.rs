//! mpc-passes: graph rewrites and analyses, run by a pass manager that verifies after each one.
//!
//! A [`Pass`] mutates a [`Graph`] and says whether it changed it. [`PassManager`] runs an explicit
//! list, verifies the graph after every pass (structure, and types re-inferred from scratch must
//! agree), and can hand out the graph after a named pass (`--dump-after`) or stop there
//! (`--stop-after`).

mod cast_cleanup;
mod composite;
mod dce;
mod expand_attention;
mod fuse_attention;
mod gemm_transpose;
mod infer;
mod known;
mod manager;
pub mod precision;
mod rnn;
mod simplify;
pub mod train;

pub use cast_cleanup::CastCleanup;
pub use composite::{expand_composites, COMPOSITE};
pub use dce::Dce;
pub use expand_attention::ExpandAttention;
pub use fuse_attention::FuseAttention;
pub use gemm_transpose::GemmTranspose;
pub use infer::{infer_types, InferTypes};
pub use manager::{verify, PassManager, Pipeline};
pub use precision::{Policy, Precision};
pub use rnn::UnrollRnn;
pub use simplify::Simplify;

use std::cell::RefCell;
use std::collections::HashMap;

use mpc_ir::{Graph, GraphError, IrError};

/// Did a pass change the graph?
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Changed {
    Yes,
    No,
}

/// Options every pass can read.
#[derive(Clone, Debug, Default)]
pub struct Context {
    /// Sizes bound to symbolic dims (`batch=64`), used where a pass needs concrete sizes.
    pub dims: HashMap<String, u64>,
    /// The precision policy; `None` is `fp32`: no precision rewrite.
    pub policy: Option<Policy>,
    /// Training options: set for the training pipeline.
    pub train: Option<train::TrainOptions>,
    /// The initializers training ties to another (copies and transposes of one parameter).
    pub ties: Vec<train::Tie>,
    /// Constants a torch.export program folded from parameters it no longer holds, trained as
    /// weights of their own ([`train::folded_weights`]), and those parameters.
    pub folded: Option<(Vec<String>, Vec<String>)>,
    /// Calibration, when it ran: its time, the samples it measured, and the values it found the
    /// low dtype breaks.
    pub calibration: Option<(std::time::Duration, usize, usize)>,
    /// `--loss-scale auto`'s measurement, when it ran.
    pub auto_scale: Option<AutoScale>,
    /// What the precision pass decided, for explanations.
    pub report: RefCell<Option<precision::Report>>,
    /// Wall time of each pass and of the verification after it, for `--stats`.
    pub timings: RefCell<Vec<(&'static str, std::time::Duration, std::time::Duration)>>,
}

/// What `--loss-scale auto` measured and chose.
#[derive(Clone, Debug, PartialEq)]
pub struct AutoScale {
    /// The power of two the measured gradients call for.
    pub exp: i32,
    /// Where dynamic scaling starts (that power, within the scaling's bounds).
    pub init: f32,
    /// The share of the non-zero activation gradients FP16 loses at `init`.
    pub lost: f64,
    /// Samples measured, and the time the FP32 forward and backward pass over them took.
    pub samples: usize,
    pub took: std::time::Duration,
}

/// What a pass may do to the graph. The manager verifies the whole graph (structure and types)
/// after a pass that rewrites; after the narrower kinds, the parts of that check that cannot fail
/// are skipped in release builds and still run in debug builds (the tests), so a pass that does
/// more than it declares is caught.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Effect {
    /// Anything.
    Rewrites,
    /// Only adds nodes (it may also add values, rename them, and set the outputs and metadata),
    /// leaving the nodes that were there as they were, and leaves the added nodes' types to the
    /// manager. The manager infers them, which gives them what the type check would demand.
    Adds,
    /// Only removes nodes and values that nothing reads: the nodes left keep their inputs, so
    /// their types stay right and only the structure is checked.
    Removes,
}

/// A graph-to-graph transformation or analysis.
pub trait Pass {
    fn name(&self) -> &'static str;
    fn run(&self, graph: &mut Graph, cx: &Context) -> Result<Changed>;

    /// What the pass may do to the graph, which decides how the manager checks it afterwards.
    fn effect(&self) -> Effect {
        Effect::Rewrites
    }
}

/// A pass failure, naming the node or value at fault.
#[derive(Debug, thiserror::Error)]
pub enum PassError {
    /// The input graph is invalid (a shape mismatch, an impossible reshape): the user's problem.
    #[error("node {node}: {msg}")]
    Node { node: String, msg: String },
    #[error(transparent)]
    Graph(#[from] GraphError),
    #[error(transparent)]
    Ir(#[from] IrError),
    /// A pass left the graph invalid: mpc's problem.
    #[error("internal error: the graph is invalid after pass `{pass}`: {msg}")]
    Verify { pass: &'static str, msg: String },
    #[error("unknown pass `{0}` (passes: {1})")]
    UnknownPass(String, String),
    /// A bad option (an unknown op or node name in a policy).
    #[error("{0}")]
    Usage(String),
}

pub type Result<T, E = PassError> = std::result::Result<T, E>;
