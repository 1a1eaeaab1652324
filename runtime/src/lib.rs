//! mpc-runtime: a typed graph becomes work for a device, once, and is then only replayed.
//!
//! ```text
//! graph (every shape known) ──lower()──▶ Program ──Session::new / load──▶ Session<D: Device>
//!                                                       feed / step / read
//! ```
//!
//! - [`program::lower`] builds a [`program::Program`]: the schedule; constant and shape arithmetic
//!   folded; reshapes as views; one [`program::Launch`] per remaining node, a resolved descriptor
//!   (the typed op, the dtype, shape and place of every operand, and the values of the operands
//!   that set shapes or parameters); the memory layout in three regions: the activation arena
//!   (the memory plan's placement, alignment from the device), the state region (training state
//!   and any weight a step may change; several programs share one [`program::StateLayout`]), and
//!   the program's constants; and the copies that move each next state into its slot (none where
//!   the optimizer writes it in place). `If` branches are lowered into the same regions; choosing
//!   one is the step's one host read, declared by the program. An op no device runs is an error
//!   here, naming its node.
//! - [`device::Device`] is what a backend implements: allocate a region, write host bytes, read
//!   bytes back (an explicit synchronisation) or stage them for a later fetch (no wait), copy
//!   between places, enqueue a launch, poison a region (debug checks), count what it did. It only
//!   enqueues. A launch says what to compute, not how: each device derives its kernels'
//!   parameters (GEMM m/n/k and strides, window geometry, broadcast strides) from the resolved
//!   shapes, and a device that launches many times should do so once, in `prepare`.
//!   [`device::CpuDevice`] is the reference: every op on host memory with the kernels of [`cpu`],
//!   FP16/BF16 stored as half with f32 arithmetic and accumulation, deterministic. Its regions are
//!   the memory: kernels read typed views of their operands where they lie ([`value::Elems`]),
//!   f32 matrix products write straight into their place, and every other result is copied into
//!   its place before the next launch (after its inputs' views are gone, so an output the plan
//!   puts over an input is correct).
//! - [`cuda`] (the `cuda` feature): finding GPUs and the CUDA libraries without panicking,
//!   compiling `kernels/*.cu` with NVRTC to cached cubins, and the CUDA device (plans of kernel
//!   launches, cuBLAS/cuBLASLt products, CUDA-graph replay of a step).
//! - [`session::Session`] holds the state region and, per loaded program, an arena and a
//!   constants region, all allocated when the program is loaded: a step allocates nothing.
//!   `feed` writes a batch into the input places, `step` enqueues the launches and state copies,
//!   `read` reads an output or a state value back; `--stats` prints its [`session::StepStats`].
//! - [`cost`] says what a program costs before it runs: what its arena holds at its peak, and
//!   the bytes and matrix-product FLOPs of each launch (a step's two floors).
//! - [`plan`] holds the placement search the arena uses (`inspect --memory` prints the arena of
//!   the program it lowers).

pub mod build;
pub mod collective;
pub mod cost;
pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod device;
pub mod fuse;
pub mod plan;
pub mod program;
pub mod session;
pub mod tolerance;
pub mod value;

pub use cpu::{scheduled_rate, KernelError};
pub use tolerance::{Comparison, Tolerance};
pub use value::{Data, HostTensor};

#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    #[error("input `{0}` is missing")]
    MissingInput(String),
    #[error("`{0}` is not an input of the model (inputs: {1})")]
    UnexpectedInput(String, String),
    #[error("input `{name}` is {got}, the model expects {expected}")]
    WrongDtype { name: String, expected: String, got: String },
    #[error("input `{name}` has shape {got:?}, the model expects {expected}")]
    WrongShape { name: String, expected: String, got: Vec<usize> },
    #[error("node {node}: {msg}")]
    Unsupported { node: String, msg: String },
    #[error("node {node}: {msg}")]
    Node { node: String, msg: String },
    #[error("the size of `{0}` is unknown: bind its symbolic dims first")]
    UnknownShape(String),
    #[error("{0}")]
    Graph(String),
    /// A value or program larger than the device may hold (`--max-memory`).
    #[error("{0} (--max-memory sets the limit)")]
    TooLarge(String),
    /// An invariant of mpc itself failed.
    #[error("internal error: {0}")]
    Internal(String),
}
